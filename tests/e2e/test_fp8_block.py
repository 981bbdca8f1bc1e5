"""Block-wise FP8 (`quant_method: fp8`, `weight_block_size`) written by Transformers' own FP8 quantizer:
detected, every weight decoded by evalsuite and by Transformers' dequantization bit for bit, `tensors` passes
and fails, naming the tensor, a copy with a byte made NaN or a block factor moved; `ppl` runs through
Transformers, which on a CPU dequantizes the pack to BF16 at load."""

from __future__ import annotations

import pytest
import torch

from evalsuite.files.checkpoint import Checkpoint
from tests.conftest import copy_checkpoint, edit_tensors
from tests.e2e.test_llmcompressor_packs import run_task
from tests.e2e.test_tensors import failed_checks, named, run_tensors

pytestmark = pytest.mark.format_evidence(format="fp8", writer="Transformers' Fp8Quantize")

SOURCE, PACK = "tiny-llama-bf16", "tiny-llama-fp8-block"
MODULE = "model.layers.1.mlp.down_proj"


@pytest.mark.format_evidence(claim=["tensors", "decode"])
def test_tensors_passes_the_pack_with_transformers_decode_agreeing(fp8_block_tiny, tmp_path):
    assert Checkpoint.open(fp8_block_tiny[PACK]).format == "fp8"
    code, entry, err = run_tensors(fp8_block_tiny[PACK], fp8_block_tiny[SOURCE], tmp_path)
    assert code == 0, (err, entry.get("details"))
    m = entry["metrics"]
    assert m["decode_exact"] is True and m["config_mismatches"] == 0
    assert (m["quantized_other"], m["avg_bits_per_weight"]) == (14, 8.0)
    assert m["protected_total"] == m["protected_identical"] == 7
    assert 0 < m["worst_rel_err"] < 0.1 and m["outlier_channels"] == 0


@pytest.mark.format_evidence(claim="code")
def test_an_fp8_byte_made_nan_fails_naming_the_tensor(fp8_block_tiny, tmp_path):
    def nan(tensors):
        tensors[f"{MODULE}.weight"].view(torch.uint8)[2, 9] |= 0x7F  # S.1111.111: E4M3's NaN

    candidate = copy_checkpoint(fp8_block_tiny[PACK], tmp_path / "ckpt")
    edit_tensors(candidate, nan)
    code, entry, _ = run_tensors(candidate, fp8_block_tiny[SOURCE], tmp_path / "run")
    assert code == 1
    assert f"{MODULE}.weight" in (entry["metrics"]["worst_rel_err_tensor"], *named(entry, "worst_rel_err"))


@pytest.mark.format_evidence(claim="scale")
def test_a_wrong_block_factor_fails_naming_the_tensor(fp8_block_tiny, tmp_path):
    def scale_one_block(tensors):
        tensors[f"{MODULE}.weight_scale_inv"][1, 2] *= 4  # outputs 64..127, inputs 128..191

    candidate = copy_checkpoint(fp8_block_tiny[PACK], tmp_path / "ckpt")
    edit_tensors(candidate, scale_one_block)
    code, entry, _ = run_tensors(candidate, fp8_block_tiny[SOURCE], tmp_path / "run")
    assert code == 1
    assert "worst_channel_gain_err" in failed_checks(entry)
    channel = next(iter(named(entry, "worst_channel_gain_err")))
    assert (
        channel.startswith(f"{MODULE}.weight (output channel ") and 64 <= int(channel.split()[-1][:-1]) < 128
    )


@pytest.mark.slow  # two executions of the tiny Llama
@pytest.mark.format_evidence(claim="ppl")
def test_ppl_runs_the_pack_as_transformers_dequantizes_it(fp8_block_tiny, tmp_path):
    code, tasks = run_task(fp8_block_tiny[PACK], fp8_block_tiny[SOURCE], tmp_path / "run", "ppl")
    assert code in (0, 1) and tasks["ppl"]["status"] in ("pass", "fail"), tasks
    execution = tasks["ppl"]["metrics"]["ckpt_execution"]
    assert execution.startswith("Transformers") and "FP8 weights dequantized to bfloat16 at load" in execution
