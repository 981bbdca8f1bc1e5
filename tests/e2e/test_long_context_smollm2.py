"""The shipped long-context spec (tasks/ppl-long.toml) on SmolLM2-135M: one 8,192-token window, its full
context, the head applied 512 positions at a time. Second tier: four 8k-token forwards on 2 cores."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from evalsuite.fixtures import SMOLLM2_BF16, SMOLLM2_W4A8
from tests.conftest import Run, rerun, run_pair

pytestmark = pytest.mark.slow

LONG_SPEC = Path(__file__).resolve().parents[2] / "tasks" / "ppl-long.toml"
BUCKETS = {"pos_0_1k": 1024, "pos_1k_4k": 3072, "pos_4k_16k": 4095}


@pytest.fixture(scope="module")
def long_run(smollm2_pair, tmp_path_factory) -> Run:
    out = tmp_path_factory.mktemp("smollm2-long") / "run"
    run = run_pair(
        smollm2_pair[SMOLLM2_W4A8], smollm2_pair[SMOLLM2_BF16], out, "ppl", "--spec", f"ppl={LONG_SPEC}"
    )
    assert run.cli.returncode in (0, 1), run.cli.stderr
    return run


def test_one_8k_window_gives_the_metrics_of_the_unchunked_head(long_run, smollm2_pair, tmp_path):
    whole_spec = tmp_path / "ppl-long-whole.toml"
    text = LONG_SPEC.read_text(encoding="utf-8")
    whole_spec.write_text(text.replace("head_chunk_rows = 512", "head_chunk_rows = 0"), encoding="utf-8")
    whole = run_pair(
        smollm2_pair[SMOLLM2_W4A8], smollm2_pair[SMOLLM2_BF16], tmp_path / "whole", "ppl",
        "--spec", f"ppl={whole_spec}",
    )  # fmt: skip
    assert whole.cli.returncode in (0, 1), whole.cli.stderr
    a, b = long_run.metrics("ppl"), whole.metrics("ppl")
    assert a["window_tokens"] == 8192 and a["n_scored_tokens"] == 8191 and a["head_chunk_rows"] == 512
    assert a["kld_mean"] > 0.01  # a W4A8 copy: equality below is not that of two zeros
    # Every statistic of the NLLs and top tokens is the unchunked head's; KL(ref ‖ ckpt) is estimated from
    # the reference's top-64 and 64 sampled tail ids (its compact form), the reverse KLD is not reported.
    assert "compact form" in a["kld_estimator"] and b["kld_estimator"] == "full-vocabulary"
    assert a["kld_mean"] == pytest.approx(b["kld_mean"], rel=0.02)
    for name, value in b.items():
        if "kld" in name:
            continue
        if isinstance(value, float):
            assert a[name] == pytest.approx(value, rel=1e-6, abs=0), name
        else:
            assert a[name] == value, name
    assert {f"{bucket}_n_tokens": n for bucket, n in BUCKETS.items()}.items() <= a.items()
    # What each side keeps per scored token is set by [record], not by the 49,152-token vocabulary.
    assert a["ref_stored_bytes_per_token"] == 8 * 64 + 8 * 64 + 24 + 4 * 5
    assert a["ckpt_stored_bytes_per_token"] == 4 * (64 + 64) + 16 + 4 * 5 + 1


def test_an_identical_candidate_gives_kld_zero_in_every_bucket(long_run, smollm2_pair, tmp_path):
    bf16 = smollm2_pair[SMOLLM2_BF16]
    args = ("run", "--ckpt", bf16, "--ref", bf16, "--tasks", "ppl", "--spec", f"ppl={LONG_SPEC}")
    same = rerun(long_run, tmp_path / "same", *args, "--corpus", "python-docs")
    assert same.cli.returncode == 0, same.cli.stderr
    # The reference's 8k observation is reused, under its key; the candidate's is made against it.
    assert len(same.loads) == 1 and same.loads[0].startswith("loading ckpt")
    m = same.metrics("ppl")
    for bucket, n in BUCKETS.items():
        assert m[f"{bucket}_n_tokens"] == n
        assert m[f"{bucket}_kld_mean"] == 0.0 and m[f"{bucket}_same_top_p"] == 1.0, bucket
        assert m[f"{bucket}_delta_p_mean"] == 0.0 and m[f"{bucket}_ln_ppl_ratio"] == 0.0, bucket
    shutil.rmtree(tmp_path / "same")
