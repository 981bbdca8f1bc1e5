"""MXFP4 in gpt-oss's layout (`quant_method: mxfp4`): a tiny gpt-oss whose routed experts are stored as FP4
blocks and E8M0 scales (fixture `tiny-gpt-oss-mxfp4`) is detected; `tensors` passes with every expert decoded
by evalsuite and by Transformers' own dequantization bit for bit; a flipped code and a scale one step off
each fail, naming the tensor; `ppl` runs the pack as Transformers loads it on a CPU (its experts dequantized
at load), which the report says."""

from __future__ import annotations

from pathlib import Path

import pytest

from evalsuite.backends.memory import loaded_bytes
from evalsuite.backends.options import BackendOptions
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import build_fixtures
from evalsuite.fixtures.names import TINY_GPT_OSS_BF16, TINY_GPT_OSS_MXFP4
from tests.conftest import FIXTURES, ppl_metrics, tensor_edited_copy
from tests.e2e.test_tensors import failed_checks, named, run_tensors

pytestmark = pytest.mark.format_evidence(format="mxfp4", writer="evalsuite's encoder (OCP MX rule)")
# A corrupted scale and a corrupted code word: each a claim of docs/formats.md's table.
WHERE = [pytest.param(w, marks=pytest.mark.format_evidence(claim=w)) for w in ("scale", "code")]

GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def gpt_oss() -> tuple[Path, Path]:
    """(the tiny gpt-oss in bf16, its MXFP4 pack; read-only)."""
    built = build_fixtures(FIXTURES, [TINY_GPT_OSS_BF16, TINY_GPT_OSS_MXFP4])
    return built[TINY_GPT_OSS_BF16], built[TINY_GPT_OSS_MXFP4]


@pytest.mark.format_evidence(claim=["tensors", "decode"])
def test_an_mxfp4_pack_is_detected_and_every_expert_decodes_as_transformers_decodes_it(gpt_oss, tmp_path):
    source, pack = gpt_oss
    assert Checkpoint.open(pack).format == "mxfp4"
    # The memory plan counts the experts decoded into the run's dtype: the source's bytes.
    assert loaded_bytes(Checkpoint.open(pack), BackendOptions()) == loaded_bytes(
        Checkpoint.open(source), BackendOptions()
    )
    code, entry, err = run_tensors(pack, source, tmp_path / "run")
    assert code == 0, (err, entry.get("details"))
    m = entry["metrics"]
    # 2 layers × (gate_up_proj, down_proj) in MXFP4; attention, router, biases, norms, embeddings as stored.
    assert (m["quantized_other"], m["protected_total"], m["protected_identical"]) == (4, 33, 33)
    assert (m["missing"], m["unexpected"], m["config_mismatches"]) == (0, 0, 0)
    assert m["decode_exact"] is True and m["decode_cross_checked_tensors"] == 4
    assert m["avg_bits_per_weight"] == 4 + 8 / 32  # one E8M0 exponent per block of 32
    assert 0 < m["worst_rel_err"] < 0.2


def flip_largest_sign(blocks) -> None:
    """In expert 1's row 5, first block: the byte holding the largest-magnitude code, its sign bit flipped."""
    row = blocks[1, 5, 0]
    codes = [(int(byte) >> shift) & 0x0F for byte in row.tolist() for shift in (0, 4)]
    at = max(range(32), key=lambda i: codes[i] & 0x07)
    row[at // 2] ^= 0x08 << (4 * (at % 2))


@pytest.mark.parametrize("where", WHERE)
def test_a_corrupted_scale_or_code_fails_naming_the_tensor(where, gpt_oss, tmp_path):
    source, pack = gpt_oss
    if where == "scale":  # one block's exponent three steps up: its 32 weights 8× too large
        pack = tensor_edited_copy(pack, tmp_path / "pack", f"{GATE_UP}_scales", lambda s: s[1, 5, 0].add_(3))
    else:  # one byte: the sign of its block's largest weight flipped
        pack = tensor_edited_copy(pack, tmp_path / "pack", f"{GATE_UP}_blocks", flip_largest_sign)
    code, entry, err = run_tensors(pack, source, tmp_path / "run")
    assert code == 1, (err, entry.get("details"))
    assert "outlier_channels" in failed_checks(entry)
    assert list(named(entry, "outlier")) == [GATE_UP]


@pytest.mark.format_evidence(claim="ppl")
def test_ppl_runs_the_pack_as_transformers_loads_it_on_a_cpu(gpt_oss, tmp_path):
    source, pack = gpt_oss
    m = ppl_metrics(pack, source, tmp_path / "run")
    assert m["ckpt_execution"].endswith("MXFP4 experts dequantized to bfloat16 at load by Transformers")
    assert 0 < m["kld_mean"] < 0.01
