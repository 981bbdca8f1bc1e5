"""`evalsuite run --tasks ppl` on the tiny MiniCPM-V 4.7 pair, through the CLI's entry point (the shared tiny
run, whose metrics several tests compare with, is a child process)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from evalsuite.fixtures import TINY_BF16, TINY_W4A8
from evalsuite.inputs.corpus import python_docs_text
from tests.conftest import TINY_TASKS, cli_run_in_process, rerun, tiny_spec_args

CONTRACT = (
    "n_windows",
    "n_scored_tokens",
    "tokens_sha256",
    "ppl_ref",
    "ppl_ckpt",
    "ppl_ratio",
    "ln_ppl_ratio",
    "ln_ppl_ratio_stderr",
    "kld_mean",
    "kld_mean_stderr",
    "kld_median",
    "kld_p99",
    "kld_max",
    "same_top_p",
    "delta_p_mean",
    "rms_delta_p",
)


def test_tiny_pair_writes_the_results_contract(tiny_run):
    results = tiny_run.results
    assert results["schema"] == "evalsuite.results/1"
    assert results["ckpt"]["format"] == "compressed-tensors" and results["ref"]["format"] == "bf16"
    ppl = tiny_run.task("ppl")
    # The default thresholds pass the tiny pair (it measures ppl_ratio 1.0008, same_top_p 0.91).
    assert ppl["status"] == "pass"
    for name in CONTRACT:
        assert name in ppl["metrics"], name
    assert ppl["metrics"]["n_scored_tokens"] == 2040 and ppl["metrics"]["n_windows"] == 8
    assert all(math.isfinite(ppl["metrics"][k]) for k in ("ppl_ref", "ppl_ckpt", "kld_mean"))
    assert ppl["metrics"]["kld_mean"] > 0  # the W4A8 copy really differs from its source
    assert {c["name"] for c in ppl["checks"]} >= {"ppl_ratio", "same_top_p"}
    # The random tiny model names no shapes, so vision's answer checks fail: the run's exit code is 1.
    assert tiny_run.cli.returncode == 1 and results["verdict"] == "fail", tiny_run.cli.stderr
    assert "| ppl | ppl |" in (tiny_run.out / "report.md").read_text()


def test_every_metric_with_a_stderr_has_its_window_clustered_one(tiny_run):
    m = tiny_run.metrics("ppl")
    for name in ("ppl_ref", "ppl_ckpt", "ln_ppl_ratio", "kld_mean", "same_top_p"):
        assert m[f"{name}_stderr"] > 0 and m[f"{name}_stderr_window"] > 0, name


def test_checkpoint_against_itself_is_exactly_identical(tiny_pair, tmp_path):
    ref = tiny_pair["tiny-minicpmv47-bf16"]
    res = cli_run_in_process(
        "run", "--ckpt", ref, "--ref", ref, "--corpus", "python-docs", "--out", tmp_path, "--quiet"
    )
    assert res.returncode == 0, res.stderr
    m = json.loads((tmp_path / "results.json").read_text())["tasks"]["ppl"]["metrics"]
    assert m["ppl_ratio"] == 1.0
    assert m["kld_mean"] == 0.0 and m["kld_max"] == 0.0
    assert m["same_top_p"] == 1.0
    # One checkpoint, one execution: one observation serves both sides.
    assert len(list((tmp_path / "observations").iterdir())) == 1


def test_reference_ppl_agrees_with_an_independent_loop(tiny_pair, tiny_run):
    """Forward each window with full logits, log-softmax, gather the scored positions."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    reported = tiny_run.metrics("ppl")["ppl_ref"]
    path = tiny_pair["tiny-minicpmv47-bf16"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = tok(python_docs_text(), add_special_tokens=False)["input_ids"]
    nll = []
    with torch.no_grad():
        for start in range(0, 8 * 4096, 4096):
            window = torch.tensor(ids[start : start + 512])[None]
            logp = torch.log_softmax(model(input_ids=window).logits[0].float(), dim=-1)
            for pos in range(256, 511):
                nll.append(-logp[pos, window[0, pos + 1]].item())
    assert len(nll) == 2040
    assert reported == pytest.approx(math.exp(np.mean(nll)), rel=1e-6)


def test_short_text_scores_the_windows_that_fit_and_says_so(tiny_pair, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text(python_docs_text()[:40_000])
    ref = tiny_pair["tiny-minicpmv47-bf16"]
    res = cli_run_in_process(
        "run", "--ckpt", ref, "--ref", ref, "--text-file", text, "--out", tmp_path / "r", "--quiet"
    )
    assert res.returncode == 0, res.stderr
    m = json.loads((tmp_path / "r" / "results.json").read_text())["tasks"]["ppl"]["metrics"]
    assert 1 <= m["n_windows"] < 8
    assert m["n_scored_tokens"] == 255 * m["n_windows"]
    assert "too short" in m["protocol_note"]


def test_wrong_scales_fail_both_checks_that_the_good_copy_passes(tiny_pair, tiny_run, tmp_path):
    """A W4A8 copy whose weight scales are all ×4: the ppl checks must catch it. The good copy is judged by
    the same bounds in a copy of `tiny_run` (its observations reused)."""
    from tests.conftest import rerun, wrong_scale_copy

    broken = wrong_scale_copy(tiny_pair["tiny-minicpmv47-w4a8"], tmp_path / "wrong-scale")
    # Bounds the good tiny copy meets (it measures ppl_ratio 1.0008, same_top_p 0.91).
    thresholds = tmp_path / "tiny.toml"
    thresholds.write_text("[ppl]\nppl_ratio = { max = 1.01 }\nsame_top_p = { min = 0.85 }\n")
    ref = tiny_pair["tiny-minicpmv47-bf16"]
    args = ("--ref", ref, "--tasks", "ppl", "--corpus", "python-docs", "--thresholds", thresholds)
    good = rerun(tiny_run, tmp_path / "good", "run", "--ckpt", tiny_pair["tiny-minicpmv47-w4a8"], *args)
    bad = cli_run_in_process("run", "--ckpt", broken, "--out", tmp_path / "bad", *args, "--quiet")
    assert good.cli.returncode == 0 and good.loads == [], good.cli.stderr
    assert bad.returncode == 1, bad.stderr
    checks = json.loads((tmp_path / "bad" / "results.json").read_text())["tasks"]["ppl"]["checks"]
    assert {c["name"]: c["passed"] for c in checks} == {
        "ppl_ratio": False,
        "kld_mean": False,
        "same_top_p": False,
    }


def test_the_same_inputs_give_bit_identical_metrics(tiny_pair, tiny_run, tmp_path):
    res = cli_run_in_process(
        "run",
        "--ckpt",
        tiny_pair["tiny-minicpmv47-w4a8"],
        "--ref",
        tiny_pair["tiny-minicpmv47-bf16"],
        "--tasks",
        "ppl",
        "--corpus",
        "python-docs",
        "--out",
        tmp_path,
        "--no-resume",
        "--quiet",
    )
    assert res.returncode == 0, res.stderr
    again = json.loads((tmp_path / "results.json").read_text())["tasks"]["ppl"]["metrics"]
    assert again == tiny_run.metrics("ppl")


def test_inspect_reads_the_files_only(tiny_pair):
    res = cli_run_in_process("inspect", tiny_pair["tiny-minicpmv47-w4a8"])
    assert res.returncode == 0, res.stderr
    assert "format\tcompressed-tensors" in res.stdout and "fingerprint\t" in res.stdout


def test_piped_output_has_no_third_party_noise_and_no_wrapped_lines(tiny_run):
    """Transformers' kernel fallbacks, compressed-tensors' log lines and tqdm bars are held back (one line
    counts them); evalsuite's own lines are never folded at 80 columns."""
    err, out = tiny_run.cli.stderr, tiny_run.cli.stdout
    assert "[transformers]" not in err and "Could not match" not in err and "it/s]" not in err, err
    assert any(line.startswith("note: ") and "held back" in line for line in err.splitlines()), err
    for line in tiny_run.loads:
        assert line.endswith("backend hf)") or line.endswith("backend intref)"), line
    assert any(line.startswith("ppl ") and "ppl_ratio <= 1.03" in line for line in out.splitlines()), out


def test_no_plots_gives_the_same_verdict_and_metrics_without_a_picture(tiny_pair, tiny_run, tmp_path):
    args = ("run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", TINY_TASKS)
    args += tiny_spec_args()
    again = rerun(tiny_run, tmp_path / "run", *args, "--corpus", "python-docs", "--no-plots")
    assert again.cli.returncode == tiny_run.cli.returncode, again.cli.stderr
    drawn = []  # the plots the first run drew (the vision task's input images are shown either way)
    for task in ("ppl", "tensors", "intref"):
        assert again.metrics(task) == tiny_run.metrics(task), task
        assert not [a for a in again.task(task).get("artifacts", {}).values() if a.endswith(".png")], task
        drawn += [a for a in tiny_run.task(task).get("artifacts", {}).values() if a.endswith(".png")]
    assert len(drawn) >= 3
    first, second = (
        (run / "report.md").read_text(encoding="utf-8") for run in (tiny_run.out, tmp_path / "run")
    )
    assert all(png in first for png in drawn) and not any(png in second for png in drawn)
