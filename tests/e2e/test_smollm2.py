"""The demo pair: SmolLM2-135M-Instruct BF16 against its W4A8 copy, through the CLI with fixture names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, run_cli
from tests.e2e.test_run_ppl import CONTRACT

pytestmark = pytest.mark.slow


def test_smollm2_pair_writes_every_contract_metric_on_2040_tokens(smollm2_pair, tmp_path):
    res = run_cli(
        "run",
        "--ckpt",
        "smollm2-135m-w4a8",
        "--ref",
        "smollm2-135m-bf16",
        "--tasks",
        "ppl",
        "--fixtures",
        FIXTURES,
        "--corpus",
        "python-docs",
        "--out",
        tmp_path,
        "--quiet",
    )
    assert res.returncode == 0, res.stderr  # the default thresholds are calibrated on this pair
    results = json.loads((tmp_path / "results.json").read_text())
    m = results["tasks"]["ppl"]["metrics"]
    assert all(name in m for name in CONTRACT)
    assert m["n_scored_tokens"] == 2040
    assert 1.0 < m["ppl_ratio"] < 1.7 and m["kld_mean"] > 0 and 0.6 < m["same_top_p"] < 1.0
    assert results["ckpt"]["format"] == "compressed-tensors"


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2_live_and_replay(smollm2_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2")
    rec = root / "rec"
    res = run_cli(
        "record",
        "--ckpt",
        smollm2_pair["smollm2-135m-bf16"],
        "--out",
        rec,
        "--corpus",
        "python-docs",
        "--quiet",
    )
    assert res.returncode == 0, res.stderr
    args = ("run", "--ckpt", smollm2_pair["smollm2-135m-w4a8"], "--corpus", "python-docs", "--quiet")
    live = run_cli(*args, "--ref", smollm2_pair["smollm2-135m-bf16"], "--out", root / "live")
    replay = run_cli(*args, "--ref", rec, "--out", root / "replay")
    assert live.returncode == 0 and replay.returncode == 0, live.stderr + replay.stderr
    return (
        json.loads((root / name / "results.json").read_text())["tasks"]["ppl"]["metrics"]
        for name in ("live", "replay")
    )


def test_replay_against_a_recording_matches_the_live_full_vocabulary_run(smollm2_live_and_replay):
    live, replay = smollm2_live_and_replay
    for name in ("ppl_ref", "ppl_ckpt", "same_top_p", "delta_p_mean"):
        assert replay[name] == pytest.approx(live[name], rel=1e-6), name
    assert replay["kld_mean"] == pytest.approx(live["kld_mean"], rel=0.01)
    assert replay["kld_median"] == pytest.approx(live["kld_median"], rel=0.05)
    assert replay["kld_p99"] == pytest.approx(live["kld_p99"], rel=0.05)


def test_the_committed_recording_replays_against_the_demo_candidate(smollm2_pair, tmp_path):
    """reference_outputs/smollm2-135m-bf16 is not stale: same spec, text, tokens and checkpoint headers."""
    rec = REPO / "reference_outputs" / "smollm2-135m-bf16"
    manifest = json.loads((rec / "manifest.json").read_text())
    from evalsuite.checkpoint import Checkpoint

    assert (
        manifest["checkpoint"]["fingerprint"]
        == Checkpoint.open(smollm2_pair["smollm2-135m-bf16"]).fingerprint
    )
    res = run_cli(
        "run",
        "--ckpt",
        smollm2_pair["smollm2-135m-w4a8"],
        "--ref",
        rec,
        "--corpus",
        "python-docs",
        "--out",
        tmp_path,
        "--quiet",
    )
    assert res.returncode == 0, res.stderr
    committed = json.loads((REPO / "reports" / "smollm2-135m-w4a8" / "results.json").read_text())
    m = json.loads((tmp_path / "results.json").read_text())["tasks"]["ppl"]["metrics"]
    assert m["ppl_ref"] == pytest.approx(committed["tasks"]["ppl"]["metrics"]["ppl_ref"], rel=1e-6)
