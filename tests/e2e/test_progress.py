"""Progress in a CI log: `evalsuite run` as CI runs it (stderr a pipe, not a terminal) prints a line per
decoder layer of a streamed pass with the time left, as it goes, not one finished bar at the end."""

from __future__ import annotations

import re

from evalsuite.fixtures import TINY_BF16, TINY_W4A8
from tests.conftest import run_cli

ONE_WINDOW = """
[protocol]
window = 512
starts = { first = 0, step = 4096, count = 1 }
scored = { first = 256, last = 510 }

[thresholds]
final_hidden_cosine = { min = 0.90 }
"""
LINE = re.compile(
    r"^ckpt \(hf\): layers: (\d+)/2 \(\d+%\), (?:\d+:\d\d:\d\d elapsed, about \d+:\d\d:\d\d left|done in)"
)


def test_a_streamed_pass_prints_a_line_per_layer_with_the_time_left_to_a_log(tiny_pair, tmp_path):
    spec = tmp_path / "layers.toml"
    spec.write_text(ONE_WINDOW)
    result = run_cli(
        "run", "--ref", tiny_pair[TINY_BF16], "--ckpt", tiny_pair[TINY_W4A8], "--tasks", "layers", "--stream",
        "--corpus", "python-docs", "--spec", f"layers={spec}", "--out", tmp_path / "out",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [m for m in map(LINE.match, result.stderr.splitlines()) if m]
    assert [int(m[1]) for m in lines] == [1, 2], result.stderr
    assert lines[0][0].endswith("left") and "done in" in lines[1][0]
    # No bar drawn for a terminal that is not there.
    assert "━" not in result.stderr
