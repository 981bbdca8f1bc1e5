"""EXL3 packs read as exllamav3 writes them: padded layouts, block decode, tensor_storage, the tied head,
processor assets and the `auto` backend. Small files written here; no model is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from evalsuite.backends.exl3 import exllamav3_path
from evalsuite.backends.options import BackendOptions
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint, TensorInfo
from evalsuite.fixtures.exl3_encoder import encode_weight
from evalsuite.formats import exl3
from evalsuite.formats.exl3_decode import unpack_states
from evalsuite.tasks.tensors._verification import ModuleRules, pair_tensors, verify_tensors

MUL1 = exl3.CODEBOOK_MULTIPLIERS["mul1"]


def header(name: str, dtype: str, shape: tuple[int, ...]) -> TensorInfo:
    """A tensor as a checkpoint's index knows it (no data is read through it here)."""
    sizes = {"I16": 2, "F16": 2, "I32": 4, "BF16": 2}
    n = 1
    for d in shape:
        n *= d
    return TensorInfo(name, Path("x.safetensors"), dtype, shape, 0, n * sizes[dtype])


def linear(out_p: int, in_p: int, words: int = 64, marker: str = "mul1") -> dict[str, TensorInfo]:
    stored = {
        "trellis": header("m.trellis", "I16", (in_p // 16, out_p // 16, words)),
        "suh": header("m.suh", "F16", (in_p,)),
        "svh": header("m.svh", "F16", (out_p,)),
    }
    stored[marker] = header(f"m.{marker}", "I32", ())
    return stored


def mul1_marker(info: TensorInfo) -> int:
    return MUL1


def test_a_576_wide_linear_is_stored_padded_to_640():
    # SmolLM2's k_proj: (out 192, in 576) is stored as exllamav3 pads it, (640/16, 256/16, 16·K).
    assert exl3.padded(576) == 640 and exl3.padded(192) == 256 and exl3.padded(1536) == 1536
    assert exl3.linear_problems(linear(256, 640), 192, 576, mul1_marker) == []


def test_an_unpadded_trellis_is_named_with_the_padded_shape_expected():
    problems = exl3.linear_problems(linear(192, 576), 192, 576, mul1_marker)
    assert problems == [
        "trellis [36, 12, 64] does not tile the weight (out=192, in=576) padded to multiples of 128: "
        "expected [40, 16, 16·K]",
        "suh is F16 [576], expected F16 [640] (padded to a multiple of 128)",
        "svh is F16 [192], expected F16 [256] (padded to a multiple of 128)",
    ]


def test_a_bitrate_outside_1_to_8_is_named():
    problems = exl3.linear_problems(linear(128, 128, words=16 * 9), 128, 128, mul1_marker)
    assert problems == [
        "trellis width 144 words is no EXL3 bitrate "
        "(16·K words for K in 1..8, or 24, 40, 56 for K 1.5, 2.5, 3.5)"
    ]
    assert exl3.stored_bits(header("t", "I16", (8, 8, 144))) is None
    assert exl3.stored_bits(header("t", "I16", (8, 8, 40))) == 2.5


def test_an_unknown_codebook_marker_is_named():
    wrong_value = exl3.linear_problems(linear(128, 128), 128, 128, lambda info: 0x12345678)
    assert wrong_value == ["mul1 marker holds 0x12345678, not 0x83dcd12d"]
    stored = {**linear(128, 128), "cb4": header("m.cb4", "I32", ())}
    assert exl3.linear_problems(stored, 128, 128, mul1_marker) == [
        "stores cb4 beside its trellis, which no EXL3 Linear stores (an unknown codebook marker?)"
    ]


@pytest.mark.parametrize("packed", [False, True])
def test_block_decode_is_the_whole_decode_for_outputs_that_are_not_a_multiple_of_128(monkeypatch, packed):
    # 300 outputs pad to 384: three 128-channel blocks, the last holding 44 live channels and the padding.
    generator = torch.Generator().manual_seed(3)
    trellis = torch.randint(
        -(2**15), 2**15, (256 // 16, 384 // 16, 48), generator=generator, dtype=torch.int16
    )
    stored: dict[str, torch.Tensor] = {"trellis": trellis, "mul1": torch.tensor(0)}
    if packed:
        stored["su"] = torch.randint(-(2**15), 2**15, (256 // 16,), generator=generator, dtype=torch.int16)
        stored["sv"] = torch.randint(-(2**15), 2**15, (384 // 16,), generator=generator, dtype=torch.int16)
    else:
        stored["suh"] = torch.randn(256, generator=generator).half()
        stored["svh"] = torch.randn(384, generator=generator).half()
    monkeypatch.setattr(exl3, "_BLOCK_ELEMENTS", 128 * 256)  # one 128-channel block at a time
    blocks = list(exl3.decoded_blocks(stored, 300, 200))
    assert [(first, tuple(block.shape)) for first, block in blocks] == [
        (0, (128, 200)),
        (128, (128, 200)),
        (256, (44, 200)),
    ]
    whole = exl3.decode_linear(stored, 300, 200)
    assert torch.equal(torch.cat([block for _, block in blocks]), whole)


def write(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> Checkpoint:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return Checkpoint.open(folder)


def storage_of(tensors: dict[str, torch.Tensor], bits: dict[str, int]) -> dict:
    storage: dict[str, dict] = {}
    for name, t in sorted(tensors.items()):
        module = name.rpartition(".")[0]
        entry = storage.setdefault(module, {"stored_tensors": {}})
        entry["stored_tensors"][name] = {
            "shape": list(t.shape),
            "n_bytes": t.numel() * t.element_size(),
            "dtype": str(t.dtype),
        }
    for module, k in bits.items():
        storage[module].update(quant_format="exl3", bits_per_weight=k, mul1_multiplier=MUL1)
    return storage


@pytest.fixture(scope="module")
def tied_tensors() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A source that ties its head to the embedding (storing the embedding only) and an EXL3 copy that
    stores the head apart at 6 bpw, as exllamav3 writes it, with an encoded q projection at 4 bpw."""
    generator = torch.Generator().manual_seed(0)
    embed = (torch.randn(256, 64, generator=generator) * 0.02).to(torch.bfloat16)
    q = (torch.randn(64, 64, generator=generator) * 0.02).to(torch.bfloat16)
    source = {"model.embed_tokens.weight": embed, "model.layers.0.q_proj.weight": q}
    candidate: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for module, weight, k in (("lm_head", embed, 6), ("model.layers.0.q_proj", q, 4)):
        encoded = encode_weight(weight.float(), k, "mul1", effort=64)
        candidate.update({f"{module}.{p}": t for p, t in encoded.items()})
    return source, candidate


@pytest.fixture
def tied_pair(tied_tensors, tmp_path) -> tuple[Checkpoint, Checkpoint]:
    source, candidate = tied_tensors
    qc = {"quant_method": "exl3", "version": "1.6.5", "bits": 4, "head_bits": 6, "codebook": "mul1"}
    src = write(tmp_path / "src", source, {"model_type": "toy", "tie_word_embeddings": True})
    ckpt = write(
        tmp_path / "ckpt",
        candidate,
        {"model_type": "toy", "tie_word_embeddings": False, "quantization_config": qc},
    )
    storage = storage_of(candidate, {"lm_head": 6, "model.layers.0.q_proj": 4})
    (ckpt.path / "quantization_config.json").write_text(json.dumps({**qc, "tensor_storage": storage}))
    return src, Checkpoint.open(ckpt.path)


RULES = ModuleRules(embedding=("re:.*embed",), head=("lm_head",))


def test_a_head_the_source_ties_pairs_with_the_embedding_and_is_measured(tied_pair):
    src, ckpt = tied_pair
    found = verify_tensors(src, ckpt, RULES, workers=1)
    assert found.problems == []
    rows = {row.name: row for row in found.tensors}
    head = rows["lm_head.weight"]
    assert (head.tensor_class, head.part, head.bits, head.codebook) == ("quantized", "head", 6, "mul1")
    assert head.note == "tied to model.embed_tokens.weight in the source, stored apart in the candidate"
    assert 0 < head.rel_err < 0.12 and rows["model.layers.0.q_proj.weight"].rel_err < 0.15
    assert rows["model.embed_tokens.weight"].identical is True
    assert found.summary()["source_tensors"] == 3  # the two source tensors and the head stored apart


def test_without_the_tie_the_stored_head_pairs_with_nothing(tied_pair):
    src, ckpt = tied_pair
    fmt = exl3.Exl3(ckpt)
    _, unexpected = pair_tensors(src.tensors, ckpt.tensors, fmt)
    assert sorted(unexpected) == ["lm_head.mul1", "lm_head.suh", "lm_head.svh", "lm_head.trellis"]


def test_a_flipped_trellis_word_changes_only_its_states_and_shows_in_the_error(tied_pair):
    """One word of one tile feeds the 16-bit windows of the few states that read it: the decoder must see it
    (the measured error moves), and it moves by little: a single word hides in the quantization noise."""
    src, ckpt = tied_pair
    stored = {p: ckpt.read_tensor(f"model.layers.0.q_proj.{p}") for p in ("trellis", "suh", "svh", "mul1")}
    source = src.read_tensor("model.layers.0.q_proj.weight").float()
    flipped = stored["trellis"].clone()
    flipped[0, 0, 5] ^= -1
    changed = (unpack_states(flipped) != unpack_states(stored["trellis"])).nonzero().tolist()
    # Stored word 5 is stream word 4 (SWAP16 swaps the words of each pair): stream bits 64..79. At K=4 the
    # window of state t ends at bit 4(t+1), so the states 16..22 read some of those bits, and no other.
    assert {(i, j) for i, j, _ in changed} == {(0, 0)} and [t for *_, t in changed] == list(range(16, 23))

    def error(trellis: torch.Tensor) -> float:
        decoded = exl3.decode_linear({**stored, "trellis": trellis}, 64, 64)
        return float((decoded - source).norm() / source.norm())

    assert error(stored["trellis"]) < error(flipped) < error(stored["trellis"]) + 0.05


def test_tensor_storage_that_disagrees_with_the_files_is_named(tied_pair):
    _, ckpt = tied_pair
    storage = json.loads((ckpt.path / "quantization_config.json").read_text())["tensor_storage"]
    storage["model.layers.0.q_proj"]["bits_per_weight"] = 5
    storage["model.layers.0.q_proj"]["stored_tensors"]["model.layers.0.q_proj.suh"]["shape"] = [64]
    storage["lm_head"]["stored_tensors"]["lm_head.scale"] = {
        "shape": [],
        "n_bytes": 2,
        "dtype": "torch.float16",
    }
    assert exl3.storage_problems(storage, ckpt.tensors) == [
        ("lm_head.scale", "listed in tensor_storage['lm_head'], not stored"),
        ("model.layers.0.q_proj.suh", "tensor_storage says shape [64], stored [128]"),
        ("model.layers.0.q_proj.trellis", "tensor_storage says 5 bpw, the trellis shape gives 4 bpw"),
    ]


def test_auto_runs_an_exl3_pack_with_exl3_and_anything_else_with_hf():
    auto = BackendOptions(backend="auto").check()
    assert auto.for_format("exl3").backend == "exl3"
    assert auto.for_format("compressed-tensors").backend == "hf" and auto.for_format("bf16").backend == "hf"
    assert BackendOptions(backend="intref").for_format("exl3").backend == "intref"  # explicit stays
    with pytest.raises(InputError, match="known backends: hf, intref, exl3"):
        BackendOptions(backend="exllama").check()
    assert not exllamav3_path(BackendOptions(backend="exl3", device="cpu"))
