"""NVIDIA ModelOpt packs (FP8 and NVFP4) written by ModelOpt's own quantizer and Hugging Face export (in a
virtual environment of its own): detected from config.json, decoded bit for bit as ModelOpt's own code
dequantizes them, `tensors` passes them and fails, naming the tensor, copies with one code byte or one scale
damaged; `ppl` runs each pack from its decoded weights exactly as the writer's dequantization runs, and a
pack whose codes lack their scales is refused before any load. Every test here needs ModelOpt's
environment: the slow tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from evalsuite.backends.decoded import weight_decoding
from evalsuite.backends.memory import loaded_bytes
from evalsuite.backends.options import BackendOptions
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures.llmcompressor_packs import DEQUANTIZED_SUFFIX
from evalsuite.fixtures.modelopt_packs import MODELOPT_PACKS, MODELOPT_VERSION
from tests.conftest import assert_ppl_refused_before_any_load, copy_checkpoint, edit_tensors, run_tasks
from tests.e2e.test_tensors import failed_checks, named, run_tensors

pytestmark = [
    pytest.mark.slow,
    pytest.mark.format_evidence(format="modelopt", writer=f"NVIDIA ModelOpt {MODELOPT_VERSION}"),
]

SOURCE, PACKS = "tiny-llama-bf16", "tiny-llama-modelopt"
MODULE = "model.layers.1.mlp.down_proj"


def pack(built: dict[str, Path], name: str) -> Path:
    return built[PACKS] / name


@pytest.mark.format_evidence(claim="decode")
@pytest.mark.parametrize("name", list(MODELOPT_PACKS))
def test_every_weight_decodes_as_modelopt_dequantizes_it(modelopt_tiny, name):
    folder = pack(modelopt_tiny, name)
    checkpoint = Checkpoint.open(folder)
    assert checkpoint.format == "modelopt"
    decoding = weight_decoding(checkpoint)
    assert decoding.format.algo == name.upper()
    writer = load_file(str(folder.with_name(name + DEQUANTIZED_SUFFIX) / "model.safetensors"))
    assert len(decoding.modules()) == 14
    for module in decoding.modules():
        ours = decoding.decode(module)
        assert torch.equal(ours, writer[f"{module}.weight"]), module


@pytest.mark.format_evidence(claim="tensors")
@pytest.mark.parametrize("name", list(MODELOPT_PACKS))
def test_tensors_passes_the_writers_pack(modelopt_tiny, name, tmp_path):
    code, entry, err = run_tensors(pack(modelopt_tiny, name), modelopt_tiny[SOURCE], tmp_path)
    assert code == 0, (err, entry.get("details"))
    m = entry["metrics"]
    assert (m["config_mismatches"], m["missing"], m["unexpected"], m["assets_changed"]) == (0, 0, 0, 0)
    assert m["quantized_other"] == 14
    # FP8: 8 bits and a float32 scale per tensor; NVFP4: 4 bits, an FP8 scale per 16, one more per tensor.
    low = 8.0 if name == "fp8" else 4.5
    assert low < m["avg_bits_per_weight"] < low + 0.01
    assert m["protected_total"] == m["protected_identical"] > 0  # embedding, head and norms as stored
    assert 0 < m["worst_rel_err"] < (0.1 if name == "fp8" else 0.3)
    assert m.get("decode_exact") is None  # no ModelOpt here: the test above checks the decode


def damaged(built: dict[str, Path], name: str, where: str, dst: Path) -> Path:
    def edit(tensors):
        if where == "code":
            # Eight bytes of one output channel's codes, their signs flipped (NVFP4: sixteen codes).
            raw = tensors[f"{MODULE}.weight"].view(torch.uint8)
            raw[5, 3:11] ^= 0x80 if name == "fp8" else 0x88
        elif name == "fp8":
            tensors[f"{MODULE}.weight_scale"] *= 4  # the tensor's one scale
        else:
            # One block's FP8 scale two exponent steps up: that block's 16 weights four times too large.
            tensors[f"{MODULE}.weight_scale"].view(torch.uint8)[5, 1] += 0x10

    candidate = copy_checkpoint(pack(built, name), dst)
    edit_tensors(candidate, edit)
    return candidate


@pytest.mark.parametrize(
    "where", [pytest.param(w, marks=pytest.mark.format_evidence(claim=w)) for w in ("code", "scale")]
)
@pytest.mark.parametrize("name", list(MODELOPT_PACKS))
def test_a_damaged_code_or_scale_fails_naming_the_tensor(modelopt_tiny, name, where, tmp_path):
    candidate = damaged(modelopt_tiny, name, where, tmp_path / "ckpt")
    code, entry, _ = run_tensors(candidate, modelopt_tiny[SOURCE], tmp_path / "run")
    assert code == 1, entry["metrics"]
    failed = failed_checks(entry)
    assert failed, entry["checks"]
    m = entry["metrics"]
    blamed = {m.get("worst_channel_z_tensor", ""), m.get("worst_rel_err_tensor", "")}
    blamed |= {t for check in failed for t in named(entry, check)}
    assert any(str(t).startswith(f"{MODULE}.weight") for t in blamed), (failed, blamed)


@pytest.mark.format_evidence(claim="ppl")
@pytest.mark.parametrize("name", list(MODELOPT_PACKS))
def test_ppl_runs_the_decoded_pack_exactly_as_the_writers_dequantization(modelopt_tiny, name, tmp_path):
    folder = pack(modelopt_tiny, name)
    writer = folder.with_name(name + DEQUANTIZED_SUFFIX)
    _, tasks = run_tasks(writer, folder, "ppl", tmp_path / "run", "--dtype", "float32", "--no-plots")
    m = tasks["ppl"]["metrics"]
    assert (m["ppl_ratio"], m["kld_max"], m["same_top_p"]) == (1.0, 0.0, 1.0)
    execution = m["ckpt_execution"]
    assert execution.startswith(f"ModelOpt {name.upper()} decoded on the CPU by evalsuite"), execution
    assert "input scales not applied" in execution and "runtime not run" in execution
    options = BackendOptions()
    assert loaded_bytes(Checkpoint.open(folder), options) == loaded_bytes(
        Checkpoint.open(modelopt_tiny[SOURCE]), options
    )


@pytest.mark.format_evidence(claim="refused")
@pytest.mark.parametrize(
    ("name", "drop", "said"),
    [
        ("fp8", "weight_scale", "F8_E4M3 weight stored without the weight_scale to decode it"),
        ("nvfp4", "weight_scale_2", "weight_scale_2 is none, not a F32 scalar (NVFP4)"),
    ],
)
def test_a_pack_whose_codes_lack_their_scales_is_refused_in_one_line_before_any_model_loads(
    modelopt_tiny, name, drop, said, tmp_path
):
    candidate = copy_checkpoint(pack(modelopt_tiny, name), tmp_path / "ckpt")
    edit_tensors(candidate, lambda t: t.pop(f"{MODULE}.{drop}"))
    said = f"ModelOpt {name.upper()} module {MODULE}: {said}"
    assert_ppl_refused_before_any_load(candidate, modelopt_tiny[SOURCE], tmp_path / "o", said)


@pytest.mark.parametrize("claim", ["ignored", "group_size"])
def test_a_config_that_disagrees_with_the_files_fails_tensors_naming_what(modelopt_tiny, claim, tmp_path):
    import json

    candidate = copy_checkpoint(pack(modelopt_tiny, "nvfp4"), tmp_path / "ckpt")
    if claim == "ignored":  # config.json leaves a module in float that the files store quantized
        config = json.loads((candidate / "config.json").read_text())
        config["quantization_config"]["ignore"].append(MODULE)
        (candidate / "config.json").write_text(json.dumps(config))
        said = (f"{MODULE}.weight", "stored quantized, but the config's ignore leaves it in float")
    else:  # hf_quant_config.json claims blocks of 32 for NVFP4's 16
        beside = json.loads((candidate / "hf_quant_config.json").read_text())
        beside["quantization"]["group_size"] = 32
        (candidate / "hf_quant_config.json").write_text(json.dumps(beside))
        said = ("hf_quant_config.json", "group_size 32, not 16")
    code, entry, _ = run_tensors(candidate, modelopt_tiny[SOURCE], tmp_path / "run")
    assert code == 1 and entry["metrics"]["config_mismatches"] == 1
    assert any(said[0] in str(d) and said[1] in str(d) for d in entry["details"]), entry["details"]


def test_hf_quant_config_claiming_another_algorithm_than_config_json_fails_tensors(modelopt_tiny, tmp_path):
    import json

    candidate = copy_checkpoint(pack(modelopt_tiny, "fp8"), tmp_path / "ckpt")
    beside = candidate / "hf_quant_config.json"
    content = json.loads(beside.read_text())
    content["quantization"]["quant_algo"] = "NVFP4"
    beside.write_text(json.dumps(content))
    code, entry, _ = run_tensors(candidate, modelopt_tiny[SOURCE], tmp_path / "run")
    assert code == 1
    assert any("hf_quant_config.json" in str(d) for d in entry["details"]), entry["details"]
    assert entry["metrics"]["config_mismatches"] == 1
