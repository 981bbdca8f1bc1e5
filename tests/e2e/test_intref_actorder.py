"""GPTQ W4A8 packs solved in activation order, as llm-compressor writes them: `intref` executes them.

`actorder: "static"` (llm-compressor 0.14) reorders the solve only: the files keep one scale per output
channel or per group of consecutive columns, and intref runs them as any pack, against Transformers'
execution of the same pack. `actorder: "group"` (llm-compressor 0.13, the last writer of it) scatters each
group's columns and stores `weight_g_idx`; the compressed-tensors evalsuite runs with (0.20) refuses that
config, so Transformers cannot execute the pack here, and the reference is the writer's own: its
compressed-tensors (0.18) dequantized every weight with the pack's g_idx (`<pack>-dequantized/`). Every test
here needs llm-compressor's virtual environments: the slow tier.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from evalsuite.backends.intref import IntrefBackend
from evalsuite.backends.options import BackendOptions
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures.llmcompressor_packs import DEQUANTIZED_SUFFIX
from evalsuite.formats.compressed_tensors import StoredQuantization, library_decode_scattered
from tests.conftest import copy_checkpoint, edit_tensors, run_cli
from tests.e2e.test_llmcompressor_packs import run_task
from tests.e2e.test_tensors import failed_checks, named, run_tensors
from tests.unit.test_intref_exactness import activations, integer_layers

pytestmark = pytest.mark.slow

SOURCE, PACKS = "tiny-llama-bf16", "tiny-llama-llmc-actorder"
GROUP = "w4a8-gptq-g64-group"
MODULE = "model.layers.1.mlp.down_proj"


def packs(built: dict[str, Path]) -> Path:
    return built[PACKS]


@pytest.mark.parametrize(
    ("scheme", "convention"), [("w4a8-gptq-static", "W4 channel"), ("w4a8-gptq-g64-static", "W4 group 64")]
)
def test_intref_runs_static_activation_order_packs_as_transformers_does(
    llmc_actorder, scheme, convention, tmp_path
):
    ckpt = packs(llmc_actorder) / scheme
    code, tasks = run_task(ckpt, llmc_actorder[SOURCE], tmp_path / "run", "intref")
    entry = tasks["intref"]
    assert code == 0 and entry["status"] == "pass", entry
    m = entry["metrics"]
    assert m["int_layers"] == m["int_layers_total"] == 14
    assert m["int_convention"].startswith(f"{convention} × A8") and "g_idx" not in m["int_convention"]
    # The same bound as every other integer pack of the tiny Llama (test_llmcompressor_packs.py).
    assert m["kld_int_vs_hf"] < 1e-3


def writer_weights(pack: Path) -> dict[str, torch.Tensor]:
    """The pack's weights as its writer's compressed-tensors dequantized them (float32)."""
    return load_file(str(pack.with_name(pack.name + DEQUANTIZED_SUFFIX) / "model.safetensors"))


def test_each_integer_layer_of_a_g_idx_pack_computes_the_writers_dequantized_weights(llmc_actorder):
    """Every integer layer's FP32 output lies within 1e-6 (relative to its terms) of the exact float64
    product of its quantized activations with the weights the writer dequantized; the same layer with its
    g_idx ignored (groups taken as consecutive columns) does not."""
    pack = packs(llmc_actorder) / GROUP
    reference = writer_weights(pack)
    backend = IntrefBackend(
        Checkpoint.open(pack), BackendOptions().with_backend("intref", {"divisor": 127.5})
    )
    try:
        layers = integer_layers(backend)
        assert len(layers) == 14 and all(layer.has_g_idx for layer in layers.values())
        for i, (name, layer) in enumerate(layers.items()):
            x = activations(layer.in_features, seed=i)
            q = x.float().double()
            scale = (q.abs().amax(dim=1) / 127.5).float().double()
            q = torch.clamp(
                torch.round((q / torch.where(scale > 0, scale, 1.0)[:, None]).float().double()), -128, 127
            )
            w = reference[f"{name}.weight"].double()
            terms = q * scale[:, None]
            exact, magnitude = terms @ w.T, terms.abs() @ w.abs().T
            _, y = layer.run(x)
            error = (y.double() - exact).abs()
            assert (error <= 1e-6 * magnitude + 1e-30).all(), name
            layer.has_g_idx = False  # the natural groups instead: another model
            _, y_natural = layer.run(x)
            layer.has_g_idx = True
            assert ((y_natural.double() - exact).abs() > 1e-3 * magnitude).any(), name
    finally:
        backend.close()


def test_the_library_decode_of_a_g_idx_pack_equals_the_writers(llmc_actorder):
    """compressed-tensors 0.20's decode with the columns gathered by g_idx (what `tensors` checks evalsuite's
    own decode against) equals the writer's 0.18 decode with g_idx, rounded as 0.20 decodes (to the scale's
    bf16), for every quantized weight."""
    pack = packs(llmc_actorder) / GROUP
    checkpoint, reference = Checkpoint.open(pack), writer_weights(pack)
    names = [n.removesuffix(".weight_g_idx") for n in checkpoint.tensors if n.endswith(".weight_g_idx")]
    assert len(names) == 14
    stored = StoredQuantization("int-quantized", "int", 4, "group", 64, None, True, True)
    for module in names:
        weight = checkpoint.read_tensor(f"{module}.weight").numpy()
        scale = checkpoint.read_tensor(f"{module}.weight_scale")
        g_idx = checkpoint.read_tensor(f"{module}.weight_g_idx").numpy().astype(np.int64)
        scale_bits = scale.view(torch.int16).numpy().view(np.uint16)
        ours = library_decode_scattered(stored, weight, scale_bits, "BF16", weight.shape[1], g_idx)
        writer = reference[f"{module}.weight"].to(torch.bfloat16).float().numpy()
        assert ours is not None and np.array_equal(ours, writer), module


def test_intref_runs_a_g_idx_pack_as_its_writer_dequantizes_it(llmc_actorder, tmp_path):
    """The whole model: `ppl` of the g_idx pack executed in integers against the writer's dequantized copy
    run by Transformers: as close as intref and Transformers' execution of any integer pack are."""
    pack = packs(llmc_actorder) / GROUP
    reference = pack.with_name(pack.name + DEQUANTIZED_SUFFIX)
    code, tasks = run_task(pack, reference, tmp_path / "run", "ppl", "--backend", "intref")
    m = tasks["ppl"]["metrics"]
    assert code == 0 and tasks["ppl"]["status"] == "pass", m
    assert m["ckpt_execution"].startswith("evalsuite integer reference")
    assert m["kld_mean"] < 1e-3


def test_tensors_passes_a_g_idx_pack_and_fails_a_corrupted_weight_or_scale_by_name(llmc_actorder, tmp_path):
    pack, source = packs(llmc_actorder) / GROUP, llmc_actorder[SOURCE]
    code, entry, err = run_tensors(pack, source, tmp_path / "good")
    assert code == 0, (err, entry.get("details"))
    assert entry["metrics"]["decode_exact"] is True and entry["metrics"]["config_mismatches"] == 0

    def flip_weight(tensors):
        tensors[f"{MODULE}.weight"].view(torch.uint8)[3, 5] ^= 0x40  # no int4 value any more

    def scale_one_group(tensors):
        tensors[f"{MODULE}.weight_scale"][7, 1] *= 4

    broken = copy_checkpoint(pack, tmp_path / "weight")
    edit_tensors(broken, flip_weight)
    code, entry, _ = run_tensors(broken, source, tmp_path / "weight-run")
    assert code == 1 and "config_mismatches" in failed_checks(entry)
    assert "outside the int4 range -8..7" in named(entry, "config")[f"{MODULE}.weight"]

    broken = copy_checkpoint(pack, tmp_path / "scale")
    edit_tensors(broken, scale_one_group)
    code, entry, _ = run_tensors(broken, source, tmp_path / "scale-run")
    assert code == 1 and "worst_channel_gain_err" in failed_checks(entry)
    assert list(named(entry, "worst_channel_gain_err")) == [f"{MODULE}.weight (output channel 7)"]


def test_a_g_idx_that_does_not_fill_every_group_is_refused_naming_the_tensor(llmc_actorder, tmp_path):
    broken = copy_checkpoint(packs(llmc_actorder) / GROUP, tmp_path / "ckpt")

    def one_group(tensors):
        tensors[f"{MODULE}.weight_g_idx"].zero_()

    edit_tensors(broken, one_group)
    code, _, _ = run_tensors(broken, llmc_actorder[SOURCE], tmp_path / "tensors")
    assert code == 1  # compressed-tensors' decode, gathered by that g_idx, cannot be: `decode_exact` fails
    args = ("--tasks", "ppl", "--backend", "intref", "--corpus", "python-docs", "--out", tmp_path / "run")
    cli = run_cli("run", "--ckpt", broken, "--ref", llmc_actorder[SOURCE], *args, "--quiet")
    assert cli.returncode == 2
    error = cli.stderr.strip().splitlines()[-1]  # after the progress lines: one line naming file and tensor
    assert error.startswith("evalsuite: error: ") and f"ckpt: tensor {MODULE}.weight_g_idx: " in error
