"""The seed's model at its real depth and expert count: `tensors` on the narrow W4A8 copy counts what the
MiniCPM-V-4.7-35B-A3B W4A8 card counts (slow tier: the narrow pair is 31,000 tensors, built in minutes)."""

from __future__ import annotations

import json

import pytest

from evalsuite.fixtures import build_fixtures, read_manifest
from evalsuite.fixtures.names import REAL_NARROW_BF16, REAL_NARROW_W4A8
from tests.conftest import FIXTURES, cli_in_process

LAYERS, EXPERTS = 40, 256
GATED_DELTANET_LAYERS, FULL_ATTENTION_LAYERS = 30, 10


@pytest.mark.slow
def test_the_narrow_w4a8_copy_holds_the_seed_cards_int4_and_int8_counts(tmp_path):
    built = build_fixtures(FIXTURES, [REAL_NARROW_BF16, REAL_NARROW_W4A8])
    config = json.loads((built[REAL_NARROW_BF16] / "config.json").read_text())["text_config"]
    assert config["num_hidden_layers"] == LAYERS and config["num_experts"] == EXPERTS
    assert config["layer_types"].count("linear_attention") == GATED_DELTANET_LAYERS

    code, _, _ = cli_in_process(
        "run", "--ckpt", built[REAL_NARROW_W4A8], "--ref", built[REAL_NARROW_BF16], "--tasks", "tensors",
        "--out", tmp_path / "run", "--quiet",
    )  # fmt: skip
    entry = json.loads((tmp_path / "run" / "results.json").read_text())["tasks"]["tensors"]
    assert code == 0 and entry["status"] == "pass"
    # INT4: every routed expert's gate/up/down, Gated DeltaNet's in_proj_qkv/in_proj_z/out_proj, full
    # attention's q/k/v/o. INT8: every shared expert's gate/up/down and lm_head. The seed's policy says so
    # with no count of its own: the depth, the layer pattern and the expert count give the card's figures.
    int4 = LAYERS * EXPERTS * 3 + GATED_DELTANET_LAYERS * 3 + FULL_ATTENTION_LAYERS * 4
    int8 = LAYERS * 3 + 1
    assert (int4, int8) == (30_850, 121)
    assert entry["metrics"]["quantized_int4"] == int4
    assert entry["metrics"]["quantized_int8"] == int8
    assert entry["metrics"]["quantized_other"] == 0
    counts = read_manifest(built[REAL_NARROW_W4A8])["counts"]
    assert (counts["int4_projections"], counts["int8_projections"]) == (int4, int8)
