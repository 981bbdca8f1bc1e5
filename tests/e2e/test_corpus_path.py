"""`evalsuite run --corpus-path`: a local copy of WikiText-2's test split is what the run scores, its
reconstruction's sha256 beside tokens_sha256 in results.json; a copy that is not the split is one line and
exit 2 before any model loads."""

from __future__ import annotations

import hashlib
import json

from tests.conftest import TINY, assert_refused, cli_in_process
from tests.unit.test_corpus import split_rows, write_parquet

TINY_BF16, TINY_W4A8 = TINY


def test_the_local_copy_is_scored_and_its_digest_recorded(tiny_pair, tmp_path):
    rows = split_rows()
    parquet = write_parquet(tmp_path / "wikitext-test.parquet", rows)
    # Two windows of the protocol are enough to show which text was scored.
    spec = tmp_path / "ppl.toml"
    spec.write_text(
        "[protocol]\nstarts = { first = 0, step = 4096, count = 2 }\n[thresholds]\nppl_ratio = { max = 2 }\n"
    )
    out = tmp_path / "run"
    args = ["run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "ppl",
            "--corpus-path", parquet, "--spec", f"ppl={spec}", "--out", out, "--quiet"]  # fmt: skip
    code, lines, _ = cli_in_process(*args)
    assert code == 0, lines
    m = json.loads((out / "results.json").read_text())["tasks"]["ppl"]["metrics"]
    assert m["corpus"] == "wikitext-2-raw-v1" and m["corpus_source"] == f"local copy {parquet}"
    assert m["corpus_sha256"] == hashlib.sha256("\n".join(rows).encode()).hexdigest()
    assert "tokens_sha256" in m and "corpus_fallback" not in m


def test_a_copy_that_is_not_the_split_is_one_line_and_exit_2(tiny_pair, tmp_path):
    truncated = write_parquet(tmp_path / "truncated.parquet", split_rows(4000))
    args = ["run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "ppl",
            "--corpus-path", truncated, "--out", tmp_path / "run", "--quiet"]  # fmt: skip
    code, lines, _ = cli_in_process(*args)
    assert_refused(code, lines, str(truncated), "4,000 rows, the split has 4,358")
    assert not (tmp_path / "run" / "observations").exists()
