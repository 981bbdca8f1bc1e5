"""lmeval on the demo pair: SmolLM2-135M-Instruct BF16 against its W4A8 copy on evalsuite-mini, one run shared
by every assertion (the first 30 documents of each task, the shipped thresholds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evalsuite.stats import metrics
from evalsuite.tasks.lmeval import shipped_task_folder
from tests.conftest import FIXTURES, run_cli

pytestmark = pytest.mark.slow

LIMIT = 30
MC = ("evalsuite-mini.acc", "evalsuite-mini.acc_norm")
GEN = "evalsuite-mini-gen.exact_match"  # 20 documents: all of them


@pytest.fixture(scope="module")
def smollm2_run(smollm2_pair, tmp_path_factory) -> tuple[Path, int, dict]:
    root = tmp_path_factory.mktemp("lmeval-smollm2")
    spec = root / "lmeval.toml"
    shipped = (shipped_task_folder().parent / "lmeval.toml").read_text()
    spec.write_text(shipped.replace("batch_size = 1", f"batch_size = 1\nlimit = {LIMIT}"))
    res = run_cli(
        "run",
        "--ckpt",
        "smollm2-135m-w4a8",
        "--ref",
        "smollm2-135m-bf16",
        "--fixtures",
        FIXTURES,
        "--tasks",
        "lmeval",
        "--spec",
        f"lmeval={spec}",
        "--out",
        root / "out",
        "--quiet",
    )
    assert res.returncode in (0, 1), res.stderr
    return root / "out", res.returncode, json.loads((root / "out" / "results.json").read_text())


def test_the_run_checks_the_shipped_thresholds_and_exits_by_its_verdict(smollm2_run):
    _, returncode, results = smollm2_run
    entry = results["tasks"]["lmeval"]
    names = {c["name"] for c in entry["checks"]}
    assert names == {
        "evalsuite-mini.acc.recovery",
        "evalsuite-mini.acc.flip_rate",
        "evalsuite-mini.acc.delta",
    }
    assert returncode == {"pass": 0, "fail": 1}[results["verdict"]]
    assert entry["status"] == results["verdict"]


def test_the_paired_statistics_agree_with_one_another(smollm2_run):
    m = smollm2_run[2]["tasks"]["lmeval"]["metrics"]
    for p in (*MC, GEN):
        n, c2w, w2c = m[f"{p}.n"], m[f"{p}.flips_c2w"], m[f"{p}.flips_w2c"]
        assert n == (20 if p == GEN else LIMIT)
        # A binary score's accuracy moves by exactly the net flips.
        assert m[f"{p}.delta"] * n == pytest.approx(w2c - c2w, abs=1e-9)
        assert m[f"{p}.ckpt"] - m[f"{p}.ref"] == pytest.approx(m[f"{p}.delta"], abs=1e-12)
        assert m[f"{p}.flip_rate"] == (c2w + w2c) / n
        assert m[f"{p}.mcnemar_p"] == metrics.mcnemar_exact_p(c2w, w2c)
        if m[f"{p}.ref"]:
            assert m[f"{p}.recovery"] == pytest.approx(m[f"{p}.ckpt"] / m[f"{p}.ref"], rel=1e-12)


def test_quantization_moves_the_choice_distributions(smollm2_run):
    m = smollm2_run[2]["tasks"]["lmeval"]["metrics"]
    assert m["evalsuite-mini.acc.choice_kld_mean"] > 0
    assert m["evalsuite-mini.acc.choice_kld_mean_stderr"] > 0
    # Every flip of `acc` changed the most likely choice; the choice can also change between wrong answers.
    flips = m["evalsuite-mini.acc.flips_c2w"] + m["evalsuite-mini.acc.flips_w2c"]
    assert m["evalsuite-mini.acc.choice_change_rate"] * LIMIT >= flips - 1e-9


def test_the_scores_are_those_lm_eval_itself_reported(smollm2_run):
    out, _, results = smollm2_run
    m = results["tasks"]["lmeval"]["metrics"]
    for role in ("ref", "ckpt"):
        (saved,) = (out / "observations").glob(f"{role}-lmeval-samples-*/observation.json")
        tasks = json.loads(saved.read_text())["meta"]["lm_eval_tasks"]
        assert tasks["evalsuite-mini"]["lm_eval_results"]["acc,none"] == m[f"evalsuite-mini.acc.{role}"]
        assert tasks["evalsuite-mini-gen"]["lm_eval_results"]["exact_match,none"] == m[f"{GEN}.{role}"]


def test_report_lists_the_flipped_documents_with_both_answers_and_the_gold(smollm2_run):
    out, _, results = smollm2_run
    m = results["tasks"]["lmeval"]["metrics"]
    details = results["tasks"]["lmeval"]["details"]
    for task, prefixes in (("evalsuite-mini", MC), ("evalsuite-mini-gen", (GEN,))):
        rows = [r for r in details if r["table"] == f"flipped documents: `{task}`" and r["doc"] != "…"]
        flips = sum(m[f"{p}.flips_c2w"] + m[f"{p}.flips_w2c"] for p in prefixes)
        assert len(rows) == min(flips, 20), task  # compare.max_flipped_rows
        for row in rows:
            assert row["question"].endswith("Answer:") and row["gold"], row
            if row["metric"] != "acc_norm":  # acc_norm decides on length-normalised log-likelihoods
                assert row["ref answer"] != row["ckpt answer"], row
    report = (out / "report.md").read_text()
    assert "### lm-eval `evalsuite-mini`: 30 documents, 0-shot, version 1.0" in report
    assert "### lm-eval `evalsuite-mini-gen`: 20 documents, 4-shot, version 1.0" in report
