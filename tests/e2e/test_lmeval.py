"""lmeval end to end on the tiny pair: live, recorded and replayed, an identical candidate, and the refusals
that come before any model loads (exit 2, one line, no report)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from evalsuite.tasks.lmeval import STATS, shipped_task_folder
from tests.conftest import assert_refused, cli_in_process, cli_run_in_process

# Six documents of each shipped task: the tiny model generates slowly on CPU; these runs test the plumbing.
SPEC = """tasks = ["evalsuite-mini", "evalsuite-mini-gen"]
limit = 6
[thresholds]
evalsuite-mini.acc.flip_rate = { max = 1.0 }
"""


def lmeval_args(spec: Path) -> tuple[str, ...]:
    return ("--tasks", "lmeval", "--spec", f"lmeval={spec}", "--quiet")


def lmeval_results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())["tasks"]["lmeval"]


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "lmeval.toml"
    path.write_text(SPEC)
    return path


@pytest.fixture(scope="module")
def runs(tiny_pair, spec, tmp_path_factory) -> dict[str, Path]:
    """One recording of the reference and three runs: live, replayed from it, and the reference itself as
    the candidate. Five model observations in all."""
    root = tmp_path_factory.mktemp("lmeval")
    bf16, w4a8 = tiny_pair["tiny-minicpmv47-bf16"], tiny_pair["tiny-minicpmv47-w4a8"]
    args = lmeval_args(spec)
    res = cli_run_in_process("record", "--ckpt", bf16, "--out", root / "rec", *args)
    assert res.returncode == 0, res.stderr
    for name, ckpt, ref in (
        ("live", w4a8, bf16),
        ("replay", w4a8, root / "rec"),
        ("identical", bf16, root / "rec"),
    ):
        if name == "replay":  # in a copy of the live run's folder: no model is loaded at all
            shutil.copytree(root / "live", root / name)
        res = cli_run_in_process("run", "--ckpt", ckpt, "--ref", ref, "--out", root / name, *args)
        assert res.returncode == 0, res.stderr
        if ref == root / "rec":
            assert "loading ref" not in res.stderr  # the reference model is never loaded
    return {"rec": root / "rec", **{name: root / name for name in ("live", "replay", "identical")}}


def prefixes(metrics: dict) -> list[str]:
    return [name.removesuffix(".n") for name in metrics if name.endswith(".n")]


def test_replay_from_a_recording_equals_live(runs):
    live, replay = lmeval_results(runs["live"]), lmeval_results(runs["replay"])
    assert replay["metrics"] == live["metrics"]
    assert replay["details"] == live["details"]
    assert replay["checks"] == live["checks"]


def test_an_identical_candidate_has_no_flip_and_a_delta_of_exactly_zero(runs):
    m = lmeval_results(runs["identical"])["metrics"]
    assert prefixes(m) == ["evalsuite-mini.acc", "evalsuite-mini.acc_norm", "evalsuite-mini-gen.exact_match"]
    for p in prefixes(m):
        assert m[f"{p}.ref"] == m[f"{p}.ckpt"], p
        assert m[f"{p}.delta"] == 0.0 and m[f"{p}.delta_stderr"] == 0.0, p
        assert (m[f"{p}.flips_c2w"], m[f"{p}.flips_w2c"], m[f"{p}.flip_rate"]) == (0, 0, 0.0), p
        assert m[f"{p}.mcnemar_p"] == 1.0, p
    for p in ("evalsuite-mini.acc", "evalsuite-mini.acc_norm"):
        assert m[f"{p}.choice_kld_mean"] == 0.0 and m[f"{p}.choice_change_rate"] == 0.0


def test_the_live_run_reports_every_statistic_on_the_documents_asked(runs):
    entry = lmeval_results(runs["live"])
    m = entry["metrics"]
    for p in prefixes(m):
        assert m[f"{p}.n"] == 6
        binary = {"flips_c2w", "flips_w2c", "flip_rate", "mcnemar_p"}
        choices = {"choice_kld_mean", "choice_change_rate"}
        expected = set(STATS) - (set() if p.startswith("evalsuite-mini.") else choices)
        assert {s for s in STATS if f"{p}.{s}" in m} == expected, p
        assert binary <= expected
    assert m["lm_eval_version"] == "0.4.13" and m["n_documents"] == 12 and m["limit"] == 6
    assert entry["checks"][0]["name"] == "evalsuite-mini.acc.flip_rate"


def test_the_scores_are_those_lm_eval_itself_reported(runs):
    m = lmeval_results(runs["live"])["metrics"]
    for role in ("ref", "ckpt"):
        (saved,) = (runs["live"] / "observations").glob(f"{role}-lmeval-samples-*/observation.json")
        tasks = json.loads(saved.read_text())["meta"]["lm_eval_tasks"]
        assert tasks["evalsuite-mini"]["lm_eval_results"]["acc,none"] == m[f"evalsuite-mini.acc.{role}"]
        assert (
            tasks["evalsuite-mini"]["lm_eval_results"]["acc_norm,none"]
            == m[f"evalsuite-mini.acc_norm.{role}"]
        )
        gen = tasks["evalsuite-mini-gen"]["lm_eval_results"]["exact_match,none"]
        assert gen == m[f"evalsuite-mini-gen.exact_match.{role}"]
        assert tasks["evalsuite-mini"]["n_shot"] == 0 and tasks["evalsuite-mini"]["version"] == 1.0


def test_report_and_model_card_show_the_paired_tables(runs):
    report = (runs["live"] / "report.md").read_text()
    assert "### lm-eval `evalsuite-mini`: 6 documents, 0-shot, version 1.0" in report
    assert "### lm-eval `evalsuite-mini-gen`: 6 documents, 4-shot, version 1.0" in report
    res = cli_run_in_process("report", runs["live"], "--format", "model-card")
    assert res.returncode == 0, res.stderr
    card = (runs["live"] / "model-card.md").read_text()
    assert "Downstream accuracy (lm-eval)" in card and "| `evalsuite-mini.acc` | 6 |" in card
    assert "downstream accuracy was not measured" not in card


def against_the_recording(runs, tiny_pair, tmp_path, spec: Path) -> tuple[int, list[str]]:
    """Exit code and stderr lines of the W4A8 copy run against the recording under another lmeval spec."""
    ckpt = tiny_pair["tiny-minicpmv47-w4a8"]
    code, lines, _ = cli_in_process(
        "run", "--ckpt", ckpt, "--ref", runs["rec"], "--out", tmp_path / "out", *lmeval_args(spec)
    )
    return code, lines


def test_a_recording_made_with_other_few_shot_settings_is_refused(runs, tiny_pair, tmp_path):
    spec = tmp_path / "lmeval.toml"
    spec.write_text(SPEC.replace("limit", "num_fewshot = 1\nlimit"))
    code, lines = against_the_recording(runs, tiny_pair, tmp_path, spec)
    assert_refused(code, lines, str(runs["rec"]), "another `lmeval` spec (num_fewshot differ)")
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_recording_made_with_other_task_versions_is_refused(runs, tiny_pair, tmp_path):
    folder = shutil.copytree(shipped_task_folder(), tmp_path / "my-tasks")
    yaml = folder / "evalsuite-mini.yaml"
    yaml.write_text(yaml.read_text().replace("version: 1.0", "version: 2.0"))
    spec = tmp_path / "lmeval.toml"
    spec.write_text(f'include_path = "{folder}"\n' + SPEC)
    code, lines = against_the_recording(runs, tiny_pair, tmp_path, spec)
    assert_refused(code, lines, "other lm-eval task versions", "evalsuite-mini=2.0")
