"""Recorded references: `evalsuite record`, replay with `--ref RECORDING`, refusals, baselines and JUnit."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from evalsuite.inputs.corpus import python_docs_text
from tests.conftest import cli_run_in_process, copy_checkpoint, rerun, run_cli, tiny_spec_args

EXACT = ("ppl_ref", "ppl_ckpt", "same_top_p", "delta_p_mean")


def metrics_of(run_dir):
    return json.loads((run_dir / "results.json").read_text())["tasks"]["ppl"]["metrics"]


def test_replay_gives_the_live_figures(tiny_run, tiny_replay):
    assert tiny_replay.loads == [], tiny_replay.cli.stderr  # no model: the recording and saved observations
    live, replay = tiny_run.metrics("ppl"), tiny_replay.metrics("ppl")
    for name in EXACT:
        assert replay[name] == pytest.approx(live[name], rel=1e-6, abs=1e-12), name
    # A sampled estimate of the tail: its error depends on the fixture's random weights (2% holds with room).
    assert replay["kld_mean"] == pytest.approx(live["kld_mean"], rel=0.02)
    assert live["kld_estimator"] == "full-vocabulary"
    assert "sampled tail" in replay["kld_estimator"]
    assert tiny_replay.results["ref"]["format"] == "recording"


def test_recording_is_deterministic(tiny_pair, tiny_recording, tmp_path):
    # In a child process: the session's recording may have been made in this one, and the bytes must not
    # depend on a process's state (hash seeds, caches).
    again = tmp_path / "again"
    res = run_cli(
        "record",
        "--ckpt",
        tiny_pair["tiny-minicpmv47-bf16"],
        "--out",
        again,
        "--tasks",
        "ppl,smoke",
        *tiny_spec_args(),
        "--corpus",
        "python-docs",
        "--quiet",
    )
    assert res.returncode == 0, res.stderr
    for name in ("window-logits", "smoke-answers", "smoke-forced-answers-compact"):
        assert (again / name / "arrays.safetensors").read_bytes() == (
            tiny_recording / name / "arrays.safetensors"
        ).read_bytes(), name


def test_recording_from_another_text_is_refused(tiny_pair, tmp_path):
    text = tmp_path / "other.txt"
    text.write_text(python_docs_text()[::-1])
    rec = tmp_path / "rec"
    res = cli_run_in_process(
        "record", "--ckpt", tiny_pair["tiny-minicpmv47-bf16"], "--out", rec, "--text-file", text, "--quiet"
    )
    assert res.returncode == 0, res.stderr
    res = cli_run_in_process(
        "run",
        "--ckpt",
        tiny_pair["tiny-minicpmv47-w4a8"],
        "--ref",
        rec,
        "--corpus",
        "python-docs",
        "--out",
        tmp_path / "out",
        "--quiet",
    )
    assert res.returncode == 2 and len(res.error_lines) == 1, res.stderr
    assert str(rec) in res.error_lines[0] and "another" in res.error_lines[0]
    assert not (tmp_path / "out" / "results.json").exists()


def test_recording_with_another_tokenizer_is_refused(tiny_pair, tiny_recording, tmp_path):
    ckpt = copy_checkpoint(tiny_pair["tiny-minicpmv47-w4a8"], tmp_path / "other-tokenizer")
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tok["model"]["merges"] = tok["model"]["merges"][:-50]
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    res = cli_run_in_process(
        "run",
        "--ckpt",
        ckpt,
        "--ref",
        tiny_recording,
        "--corpus",
        "python-docs",
        "--out",
        tmp_path / "out",
        "--quiet",
    )
    assert res.returncode == 2 and len(res.error_lines) == 1, res.stderr
    assert "tokenizer" in res.error_lines[0]


def test_recording_with_another_spec_is_refused(tiny_pair, tiny_recording, tmp_path):
    import shutil

    rec = tmp_path / "rec"
    shutil.copytree(tiny_recording, rec)
    manifest = json.loads((rec / "manifest.json").read_text())
    # As if recorded with another protocol.
    manifest["observations"]["window-logits"]["identity"]["protocol"]["window"] = 256
    (rec / "manifest.json").write_text(json.dumps(manifest))
    res = cli_run_in_process(
        "run",
        "--ckpt",
        tiny_pair["tiny-minicpmv47-w4a8"],
        "--ref",
        rec,
        "--corpus",
        "python-docs",
        "--out",
        tmp_path / "out",
        "--quiet",
    )
    assert res.returncode == 2 and "spec" in res.error_lines[0], res.stderr


def test_a_recording_cannot_be_the_candidate(tiny_pair, tiny_recording, tmp_path):
    res = cli_run_in_process(
        "run",
        "--ckpt",
        tiny_recording,
        "--ref",
        tiny_pair["tiny-minicpmv47-bf16"],
        "--out",
        tmp_path / "out",
        "--quiet",
    )
    assert res.returncode == 2 and "reference" in res.error_lines[0], res.stderr


def test_the_recorded_checkpoint_against_its_own_recording_reads_kld_zero(
    tiny_pair, tiny_recording, tmp_path
):
    # The candidate's observation is made live: the recording's compact form never stands in for it.
    res = cli_run_in_process(
        "run",
        "--ckpt",
        tiny_pair["tiny-minicpmv47-bf16"],
        "--ref",
        tiny_recording,
        "--tasks",
        "ppl",
        "--corpus",
        "python-docs",
        "--out",
        tmp_path / "out",
        "--quiet",
    )
    assert res.returncode == 0, res.stderr
    metrics = metrics_of(tmp_path / "out")
    assert metrics["same_top_p"] == 1.0
    assert metrics["ppl_ckpt"] == pytest.approx(metrics["ppl_ref"], rel=1e-6)
    assert metrics["kld_mean"] == pytest.approx(0.0, abs=1e-6)


def test_a_better_baseline_fails_the_run_and_junit_names_the_check(tiny_pair, tiny_run, tmp_path):
    accepted = tiny_run.results
    # The same run passes against itself as a baseline ...
    (tmp_path / "same.json").write_text(json.dumps(accepted))
    # ... and fails against a baseline whose KLD was 20% lower, more than the 5% tolerance of the spec.
    accepted["tasks"]["ppl"]["metrics"]["kld_mean"] *= 0.8
    (tmp_path / "better.json").write_text(json.dumps(accepted))
    args = ("run", "--ckpt", tiny_pair["tiny-minicpmv47-w4a8"], "--ref", tiny_pair["tiny-minicpmv47-bf16"])
    args += ("--tasks", "ppl", "--corpus", "python-docs")
    same = rerun(tiny_run, tmp_path / "same", *args, "--baseline", tmp_path / "same.json")
    assert same.cli.returncode == 0 and same.loads == [], same.cli.stderr
    junit = tmp_path / "junit.xml"
    worse = rerun(
        tiny_run, tmp_path / "worse", *args, "--baseline", tmp_path / "better.json", "--junit", junit
    )
    assert worse.cli.returncode == 1, worse.cli.stderr
    failed = [c["name"] for c in worse.task("ppl")["checks"] if not c["passed"]]
    assert failed == ["kld_mean_vs_baseline"]
    cases = ET.parse(junit).getroot().iter("testcase")
    failures = [case.get("name") for case in cases if case.find("failure") is not None]
    assert failures == ["kld_mean_vs_baseline"]


def test_report_re_renders_a_run_from_results_json_alone(tiny_run, tmp_path):
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(tiny_run.out, run_dir, ignore=shutil.ignore_patterns("observations"))
    before = (run_dir / "report.md").read_text()
    (run_dir / "report.md").unlink()
    for fmt, name in (("md", "report.md"), ("model-card", "model-card.md"), ("json", "results.json")):
        res = cli_run_in_process("report", run_dir, "--format", fmt)
        assert res.returncode == 0, res.stderr
        assert (run_dir / name).is_file()
    assert (run_dir / "report.md").read_text() == before


def test_a_replay_on_the_recording_s_own_machine_has_no_environment_caveat(tiny_replay):
    assert "replay" not in tiny_replay.results
    assert "another execution environment" not in (tiny_replay.out / "report.md").read_text()


def test_a_replay_of_a_recording_made_on_another_machine_says_so_with_the_measured_drift(
    tiny_pair, tiny_run, tiny_recording, tmp_path
):
    import shutil

    from evalsuite.machine import measured_drift

    rec = tmp_path / "rec"
    shutil.copytree(tiny_recording, rec)
    manifest = json.loads((rec / "manifest.json").read_text())
    # As if recorded on a machine whose torch kernels use another vector width than this one's.
    here = manifest["environment"]["machine"]["torch_cpu_capability"]
    there = "AVX2" if here == "AVX512" else "AVX512"
    manifest["environment"]["machine"]["torch_cpu_capability"] = there
    (rec / "manifest.json").write_text(json.dumps(manifest))
    args = ("run", "--ckpt", tiny_pair["tiny-minicpmv47-w4a8"], "--ref", rec, "--tasks", "ppl")
    replay = rerun(tiny_run, tmp_path / "run", *args, "--corpus", "python-docs")
    assert replay.cli.returncode in (0, 1), replay.cli.stderr
    block = replay.results["replay"]
    assert replay.results["environment"]["machine"]["torch_cpu_capability"] == here
    assert block["environment_differences"] == {"machine.torch_cpu_capability": [there, here]}
    drift = measured_drift()
    assert drift is not None and block["measured_drift"] == drift
    kld = drift["variants"]["ONEDNN_MAX_CPU_ISA=AVX2"]["kld_mean"]
    assert f"kld_mean {kld:.2g}" in block["caveat"]
    report = (replay.out / "report.md").read_text()
    assert "recording made under another execution environment" in report
    assert f"torch_cpu_capability: recorded {there}, here {here}" in report
