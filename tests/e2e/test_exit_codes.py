"""Every exit code keeps its meaning: 0 pass, 1 a check failed, 2 bad input (a missing library internal
included, refused before any model loads), 3 an internal error (one line, the traceback in OUT/traceback.txt,
no report half-written), 130 interrupted (also in a real process: tests/e2e/test_interrupt.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evalsuite.tasks.tensors import Tensors
from tests.conftest import TINY, assert_refused, cli_in_process

TINY_BF16, TINY_W4A8 = TINY


def tensors_args(pair: dict[str, Path], out: Path, *extra: str | Path) -> list[str | Path]:
    """`evalsuite run --tasks tensors` on the tiny pair: files only, no model, a second at most."""
    return ["run", "--ckpt", pair[TINY_W4A8], "--ref", pair[TINY_BF16], "--tasks", "tensors", "--out", out,
            "--quiet", *extra]  # fmt: skip


def test_a_passing_run_exits_0_and_a_failed_check_exits_1(tiny_pair, tmp_path):
    code, lines, _ = cli_in_process(*tensors_args(tiny_pair, tmp_path / "pass"))
    assert code == 0, lines
    strict = tmp_path / "strict.toml"
    strict.write_text("[tensors]\nworst_rel_err = { max = 1e-6 }\n")
    code, lines, _ = cli_in_process(*tensors_args(tiny_pair, tmp_path / "fail", "--thresholds", strict))
    assert code == 1, lines
    assert not any(line.startswith("evalsuite: error") for line in lines), lines


def test_bad_input_exits_2_with_one_line(tiny_pair, tmp_path):
    args = tensors_args(tiny_pair, tmp_path / "run")
    args[2] = tmp_path / "no-such-checkpoint"
    code, lines, _ = cli_in_process(*args)
    assert_refused(code, lines, "no-such-checkpoint")


def _raising(exc: BaseException):
    def compare_files(self, *args, **kwargs):
        raise exc

    return compare_files


def test_an_exception_not_evalsuites_own_exits_3_with_one_line_and_the_traceback_in_out(
    tiny_pair, tmp_path, monkeypatch
):
    monkeypatch.setattr(Tensors, "compare_files", _raising(KeyError("weight_packed")))
    out = tmp_path / "run"
    code, lines, _ = cli_in_process(*tensors_args(tiny_pair, out))
    assert code == 3, lines
    assert lines == [
        f"evalsuite: internal error: KeyError: 'weight_packed'; traceback in {out}/traceback.txt"
    ]
    text = (out / "traceback.txt").read_text()
    assert text.startswith("Traceback") and "compare_files" in text and "KeyError" in text
    # Nothing half-written: no report claims a verdict for the crashed run.
    assert not (out / "results.json").exists() and not (out / "report.md").exists()
    # The same folder run again, fixed: its reports are written and the stale traceback goes.
    monkeypatch.undo()
    code, lines, _ = cli_in_process(*tensors_args(tiny_pair, out))
    assert code == 0, lines
    assert (out / "results.json").is_file() and not (out / "traceback.txt").exists()


def test_a_report_that_fails_to_render_leaves_no_results_json_behind(tiny_pair, tmp_path, monkeypatch):
    from evalsuite.reporting import diff_report as report

    def unrenderable(results):
        raise ValueError("a metric the table cannot show")

    monkeypatch.setattr(report, "render_markdown", unrenderable)
    out = tmp_path / "run"
    code, lines, _ = cli_in_process(*tensors_args(tiny_pair, out))
    assert code == 3 and lines[-1].startswith("evalsuite: internal error: ValueError: a metric the"), lines
    assert not (out / "results.json").exists() and not (out / "report.md").exists()


def test_ctrl_c_exits_130(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setattr(Tensors, "compare_files", _raising(KeyboardInterrupt()))
    code, lines, _ = cli_in_process(*tensors_args(tiny_pair, tmp_path / "run"))
    assert code == 130 and lines[-1].startswith("evalsuite: interrupted"), lines


def test_a_missing_transformers_internal_is_refused_before_any_model_loads(tiny_pair, tmp_path, monkeypatch):
    import transformers.core_model_loading
    import transformers.modeling_utils  # imported as in a release lacking the function

    # A Transformers release without one of the private loading functions streaming calls. Deleted before
    # modeling_utils is first imported (this test alone), it would fail that import, and every internal
    # looked up in modeling_utils would be named missing.
    monkeypatch.delattr(transformers.core_model_loading, "rename_source_key")
    args = ["run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "ppl",
            "--stream", "--corpus", "python-docs", "--out", tmp_path / "run", "--quiet"]  # fmt: skip
    code, lines, _ = cli_in_process(*args)
    assert_refused(code, lines, "streamed execution needs transformers.core_model_loading.rename_source_key")
    assert not (tmp_path / "run" / "observations").exists()  # refused at plan time: nothing was observed


# A device running out of memory in the middle of the reference's windows, in a real process: the one line,
# the traceback file, the observation left resumable, no report.
OUT_OF_MEMORY = """
import sys, torch
from evalsuite.backends.hf import HFBackend
window_logits = HFBackend.window_logits
def failing(self, windows, positions):
    for i, logits in enumerate(window_logits(self, windows, positions)):
        if i == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        yield logits
HFBackend.window_logits = failing
from evalsuite.cli.app import main
main(sys.argv[1:])
"""


def test_an_out_of_memory_error_in_a_real_process_exits_4_with_one_line(tiny_pair, tmp_path):
    out = tmp_path / "run"
    args = ["run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "ppl",
            "--corpus", "python-docs", "--out", out, "--quiet"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", OUT_OF_MEMORY, *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=600,
        check=False,
    )
    # Out of resources (4), not a bug (3): a bigger machine or --stream helps.
    assert proc.returncode == 4, proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("evalsuite:")]
    assert said == [
        "evalsuite: error: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB): a machine or "
        "device with more memory, --stream (one decoder layer resident at a time) or a smaller --max-memory "
        f"helps; traceback in {out}/traceback.txt"
    ], proc.stderr
    assert "Traceback" not in proc.stderr
    assert re.search(r"OutOfMemoryError: CUDA out of memory", (out / "traceback.txt").read_text())
    assert not (out / "results.json").exists() and not (out / "report.md").exists()
    # The reference's window finished before the failure stays, for the next run to resume from.
    assert len(list((out / "observations").glob(".ref-window-logits-*.partial/logits-*.npy"))) == 1


@pytest.mark.parametrize(
    "internals", ["MODEL_CLASS_INTERNALS", "STREAMED_INTERNALS", "STREAMED_COMPRESSED_INTERNALS"]
)
def test_every_probed_internal_exists_in_the_installed_libraries(internals):
    from evalsuite.backends import transformers_internals

    assert transformers_internals.missing_internals(getattr(transformers_internals, internals)) == []
