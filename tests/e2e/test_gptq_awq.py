"""GPTQ and AWQ packs written by auto-round's exporters (in a virtual environment of its own): detected from
config.json, decoded bit for bit as the writer's own code dequantizes them, `tensors` passes them and fails,
naming the tensor and channel, copies with one word of packed codes or one scale damaged; `ppl` runs each
pack from its decoded weights exactly as the writer's dequantization runs. Every test here needs auto-round's
environment: the slow tier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file as load_torch_file

from evalsuite.backends.memory import loaded_bytes
from evalsuite.backends.options import BackendOptions
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures.autoround_packs import AUTOROUND_PACKS
from evalsuite.fixtures.llmcompressor_packs import DEQUANTIZED_SUFFIX
from evalsuite.formats.gptq import GptqFormat, decode
from tests.conftest import (
    assert_ppl_refused_before_any_load,
    copy_checkpoint,
    edit_tensors,
    run_cli,
    run_tasks,
)
from tests.e2e.test_tensors import failed_checks, named, run_tensors

pytestmark = [pytest.mark.slow, pytest.mark.format_evidence(writer="auto-round 0.14.2")]

SOURCE, PACKS = "tiny-llama-bf16", "tiny-llama-autoround"
MODULE = "model.layers.1.mlp.down_proj"
PARTS = (".qweight", ".qzeros", ".scales", ".g_idx")
PACK_PARAMS = [
    pytest.param(name, marks=pytest.mark.format_evidence(format=name.split("-")[0]))
    for name in AUTOROUND_PACKS
]


def pack(built: dict[str, Path], name: str) -> Path:
    return built[PACKS] / name


@pytest.mark.parametrize("name", PACK_PARAMS)
@pytest.mark.format_evidence(claim="decode")
def test_every_weight_decodes_as_its_writer_dequantizes_it(autoround_tiny, name):
    folder = pack(autoround_tiny, name)
    checkpoint = Checkpoint.open(folder)
    assert checkpoint.format == name.split("-")[0]
    fmt = GptqFormat(checkpoint)
    stored = {
        k: v.numpy()
        for k, v in load_torch_file(str(folder / "model.safetensors")).items()
        if k.endswith(PARTS)
    }
    # Both files keep what the writer left unquantized in bf16, which numpy has no dtype for.
    writer = load_torch_file(str(folder.with_name(name + DEQUANTIZED_SUFFIX) / "model.safetensors"))
    modules = [n.removesuffix(".qweight") for n in stored if n.endswith(".qweight")]
    assert len(modules) == 14
    for module in modules:
        ours = decode(
            fmt,
            stored[f"{module}.qweight"],
            stored[f"{module}.qzeros"],
            stored[f"{module}.scales"],
            stored.get(f"{module}.g_idx"),
        )
        assert np.array_equal(ours, writer[f"{module}.weight"].numpy()), module


@pytest.mark.parametrize("name", PACK_PARAMS)
@pytest.mark.format_evidence(claim="tensors")
def test_tensors_passes_the_writers_pack(autoround_tiny, name, tmp_path):
    code, entry, err = run_tensors(pack(autoround_tiny, name), autoround_tiny[SOURCE], tmp_path)
    assert code == 0, (err, entry.get("details"))
    m = entry["metrics"]
    assert (m["config_mismatches"], m["missing"], m["unexpected"], m["assets_changed"]) == (0, 0, 0, 0)
    assert m["quantized_other"] == 14 and m["avg_bits_per_weight"] == 4.0
    # The embedding, head and norms auto-round leaves unquantized: identical to the BF16 source (value-equal
    # where a writer's version widens them to float32).
    assert m["protected_total"] == m["protected_identical"] == 7
    assert 0 < m["worst_rel_err"] < 0.3 and m["outlier_channels"] == 0
    assert m.get("decode_exact") is None  # no decoder of the format imports here: the test above checks it


@pytest.mark.parametrize("name", PACK_PARAMS)
@pytest.mark.format_evidence(claim="code")
def test_a_damaged_word_of_codes_fails_naming_tensor_and_channel(autoround_tiny, name, tmp_path):
    def flip(tensors):
        # Every code of one word moved by 8 levels (the top bit of each nibble): a word of GPTQ's qweight is
        # 8 inputs of one output channel; of AWQ's, one input of 8 output channels.
        word = tensors[f"{MODULE}.qweight"]
        word[5, 3] ^= torch.tensor(0x88888888 - (1 << 32), dtype=torch.int32)

    candidate = copy_checkpoint(pack(autoround_tiny, name), tmp_path / "ckpt")
    edit_tensors(candidate, flip)
    code, entry, _ = run_tensors(candidate, autoround_tiny[SOURCE], tmp_path / "run")
    assert code == 1, entry["metrics"]
    assert failed_checks(entry), entry["details"]
    assert entry["metrics"]["worst_channel_z_tensor"].startswith(f"{MODULE}.weight (output channel ")


@pytest.mark.parametrize("name", PACK_PARAMS)
@pytest.mark.format_evidence(claim="scale")
def test_a_wrong_scale_fails_naming_the_channel(autoround_tiny, name, tmp_path):
    def scale_one_group(tensors):
        tensors[f"{MODULE}.scales"][1, 7] *= 4  # group 1 of output channel 7

    candidate = copy_checkpoint(pack(autoround_tiny, name), tmp_path / "ckpt")
    edit_tensors(candidate, scale_one_group)
    code, entry, _ = run_tensors(candidate, autoround_tiny[SOURCE], tmp_path / "run")
    assert code == 1
    assert "worst_channel_gain_err" in failed_checks(entry)
    assert list(named(entry, "worst_channel_gain_err")) == [f"{MODULE}.weight (output channel 7)"]


@pytest.mark.parametrize("name", PACK_PARAMS)
@pytest.mark.format_evidence(claim="ppl")
def test_ppl_runs_the_decoded_pack_exactly_as_the_writers_dequantization(autoround_tiny, name, tmp_path):
    # In float32 the decoded float16 values are held exactly: the pack's logits are the writer's own.
    folder = pack(autoround_tiny, name)
    writer = folder.with_name(name + DEQUANTIZED_SUFFIX)
    _, tasks = run_tasks(writer, folder, "ppl", tmp_path / "run", "--dtype", "float32", "--no-plots")
    m = tasks["ppl"]["metrics"]
    assert (m["ppl_ratio"], m["kld_max"], m["same_top_p"]) == (1.0, 0.0, 1.0)
    label = name.split("-")[0].upper()
    assert m["ckpt_execution"].startswith(f"{label} decoded on the CPU by evalsuite"), m["ckpt_execution"]
    assert (
        "float16 values held exactly" in m["ckpt_execution"]
        and f"{label} runtime not run" in m["ckpt_execution"]
    )
    options = BackendOptions()
    # The memory plan counts the decoded weights: as many values as the source holds.
    assert loaded_bytes(Checkpoint.open(folder), options) == loaded_bytes(
        Checkpoint.open(autoround_tiny[SOURCE]), options
    )


@pytest.mark.parametrize("name", PACK_PARAMS)
@pytest.mark.format_evidence(claim="refused")
def test_a_pack_that_cannot_fill_its_model_is_refused_in_one_line_before_any_model_loads(
    autoround_tiny, name, tmp_path
):
    candidate = copy_checkpoint(pack(autoround_tiny, name), tmp_path / "ckpt")
    edit_tensors(candidate, lambda t: t.pop(f"{MODULE}.qzeros"))
    said = f"{name.split('-')[0].upper()} module {MODULE}: qzeros missing beside its qweight"
    assert_ppl_refused_before_any_load(candidate, autoround_tiny[SOURCE], tmp_path / "o", said)


@pytest.mark.parametrize("name", PACK_PARAMS)
def test_intref_runs_the_pack_in_integers_as_its_decoded_execution_and_its_writers_dequantization(
    autoround_tiny, name, tmp_path
):
    folder = pack(autoround_tiny, name)
    _, tasks = run_tasks(autoround_tiny[SOURCE], folder, "intref", tmp_path / "intref", "--no-plots")
    entry = tasks["intref"]
    assert entry["status"] == "pass", entry
    m = entry["metrics"]
    assert m["int_layers"] == m["int_layers_total"] == 14
    # auto-round's GPTQ pack is symmetric (zero points all 8: none passed), its AWQ pack asymmetric.
    convention = "W4 group 64 g_idx" if name.startswith("gptq") else "W4 group 64 asymmetric"
    assert m["int_convention"].startswith(f"{convention} × A8 per token"), m["int_convention"]
    assert "activations quantized per token to INT8 and back" in m["hf_convention"]
    assert m["kld_int_vs_hf"] < 1e-3  # the bound every integer pack of the tiny Llama meets
    # The whole model in integers against the writer's own dequantized copy run by Transformers.
    writer = folder.with_name(name + DEQUANTIZED_SUFFIX)
    _, tasks = run_tasks(writer, folder, "ppl", tmp_path / "ppl", "--backend", "intref", "--no-plots")
    m = tasks["ppl"]["metrics"]
    assert m["ckpt_execution"].startswith("evalsuite integer reference"), m["ckpt_execution"]
    assert m["kld_mean"] < 1e-3


def test_a_symmetric_pack_whose_zero_points_are_not_centred_is_refused_by_intref(autoround_tiny, tmp_path):
    candidate = copy_checkpoint(pack(autoround_tiny, "gptq-w4g64"), tmp_path / "ckpt")
    # Stored minus one (GPTQ v1): 0x77777777 is eight zero points of 8; one nibble made 9.
    edit_tensors(candidate, lambda t: t[f"{MODULE}.qzeros"][0, 0].add_(1))
    res = run_cli(
        "run", "--ckpt", candidate, "--ref", autoround_tiny[SOURCE], "--tasks", "ppl", "--backend", "intref",
        "--corpus", "python-docs", "--out", tmp_path / "o", "--quiet",
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert f"{MODULE}: zero points other than 8 in a symmetric gptq pack" in last, last
