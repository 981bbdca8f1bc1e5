"""A newcomer's mistakes: each one line on stderr and exit 2, before any model loads.

These run the CLI's entry point in-process (`evalsuite.cli.app.main` with the argv a user types), with the
model backend wrapped to count loads, so that "before any model" is measured, not assumed.
"""

from __future__ import annotations

import pytest

from tests.conftest import Models, assert_refused
from tests.conftest import cli_in_process as cli

TINY_BF16, TINY_W4A8 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8"


@pytest.fixture
def models(monkeypatch) -> Models:
    return Models().watch(monkeypatch)


@pytest.fixture
def pair(tiny_pair) -> tuple[str, ...]:
    return ("--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--corpus", "python-docs")


def test_out_pointing_at_a_file_is_refused(models, pair, tmp_path):
    target = tmp_path / "results.txt"
    target.write_text("not a folder")
    code, lines, _ = cli("run", *pair, "--out", target, "--quiet")
    assert_refused(code, lines, str(target), "--out is a file")
    assert models.loads == []


def test_record_into_a_missing_folder_is_refused(models, tiny_pair, tmp_path):
    code, lines, _ = cli("record", "--ckpt", tiny_pair[TINY_BF16], "--out", tmp_path / "a" / "b")
    assert_refused(code, lines, str(tmp_path / "a"), "does not exist")
    assert models.loads == []


@pytest.mark.parametrize(
    ("option", "value", "fragment"),
    [
        ("--device", "tpu", "unknown device 'tpu'"),
        ("--device", "cuda", "needs CUDA"),
        ("--dtype", "fp8", "unknown dtype 'fp8'"),
        ("--backend", "vllm", "unknown backend 'vllm'"),
    ],
)
def test_an_impossible_execution_is_refused_before_any_model(
    capsys, models, pair, tmp_path, option, value, fragment
):
    if value == "cuda":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    code, lines, _ = cli("run", *pair, option, value, "--out", tmp_path / "r", "--quiet")
    assert_refused(code, lines, fragment)
    assert models.loads == []


def test_no_task_is_refused(models, pair, tmp_path):
    code, lines, _ = cli("run", *pair, "--tasks", "", "--out", tmp_path / "r", "--quiet")
    assert_refused(code, lines, "no task to run")


def test_a_misspelled_threshold_names_the_file_and_the_metric(models, pair, tmp_path):
    thresholds = tmp_path / "mine.toml"
    thresholds.write_text("[ppl]\nppl_ration = { max = 1.05 }\n")
    code, lines, _ = cli("run", *pair, "--thresholds", thresholds, "--out", tmp_path / "r", "--quiet")
    assert_refused(code, lines, str(thresholds), "ppl_ration", "reports no such metric")
    assert models.loads == []


def test_a_bad_threshold_value_is_blamed_on_the_user_s_file(models, pair, tmp_path):
    thresholds = tmp_path / "mine.toml"
    thresholds.write_text("[ppl]\nppl_ratio = { max = 'high' }\n")
    code, lines, _ = cli("run", *pair, "--thresholds", thresholds, "--out", tmp_path / "r", "--quiet")
    assert_refused(code, lines, str(thresholds), "ppl_ratio")
    assert "ppl.toml" not in lines[0]


def test_vision_on_a_text_only_model_is_skipped_as_needing_a_vision_model(models, smollm2_pair, tmp_path):
    """SmolLM2 cannot see: its vision cases are skipped with that reason, never failed, and nothing loads."""
    args = ("--ckpt", smollm2_pair["smollm2-135m-w4a8"], "--ref", smollm2_pair["smollm2-135m-bf16"])
    code, lines, _ = cli("run", *args, "--tasks", "vision", "--out", tmp_path / "r", "--quiet")
    # Nothing could be compared: no verdict (exit 2), with the reason in one line; vision itself is skipped.
    reason = "the vision cases need a vision model: llama is text-only (no vision tower)"
    assert_refused(code, lines, "no verdict", f"vision skipped: {reason}")
    import json

    results = json.loads((tmp_path / "r" / "results.json").read_text())
    assert results["verdict"] != "fail" and models.loads == []
    assert results["tasks"]["vision"] == {**results["tasks"]["vision"], "status": "skipped", "reason": reason}
    report = (tmp_path / "r" / "report.md").read_text()
    assert f"- `vision` was skipped: {reason}." in report.splitlines()


def test_help_is_not_cut_when_piped():
    code, _, out = cli("run", "--help")
    assert code == 0
    assert "--trust-remote-code" in out
