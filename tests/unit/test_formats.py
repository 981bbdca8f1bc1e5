"""Per-format knowledge on cases worked by hand and on files the tests write: unpacking, rounding, both
compressed-tensors decodes, scheme lookup, pairing, protected-tensor comparison and EXL3 layouts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from evalsuite.files.checkpoint import Checkpoint, TensorInfo
from evalsuite.formats import ShardReader, ct_decode, exl3
from evalsuite.formats import compressed_tensors as ct
from evalsuite.stats import tensor_errors
from evalsuite.tasks.tensors._verification import (
    ErrorAccumulator,
    ModuleRules,
    layer_and_projection,
    library_runs,
    pair_tensors,
    verify_tensors,
)

RULES = ModuleRules(
    embedding=("re:.*embed",),
    router=(r"re:.*\.mlp\.gate$",),
    state=(r"re:.*linear_attn\.in_proj_(a|b)$",),
    head=("lm_head",),
    vision=("re:.*vision_tower",),
)


# ----------------------------------------------------------------------------------------------------------
# Unpacking and rounding
# ----------------------------------------------------------------------------------------------------------


def test_offset_binary_nibbles_unpack_low_nibble_first():
    # q = 1, -2, 7, -8, 0, 3, -1, 5 → codes q + 8 = 9, 6, 15, 0, 8, 11, 7, 13, code i in bits 4i..4i+3
    codes = [9, 6, 15, 0, 8, 11, 7, 13]
    word = sum(c << (4 * i) for i, c in enumerate(codes))
    words = np.array([[word - (1 << 32)]], dtype=np.int32)  # stored as a signed int32
    assert ct_decode.unpack_offset_binary(words, 4, 8).tolist() == [[1, -2, 7, -8, 0, 3, -1, 5]]
    assert ct_decode.unpack_offset_binary(words, 4, 3).tolist() == [[1, -2, 7]]  # padding codes are dropped


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_unpack_inverts_compressed_tensors_pack(bits):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(bits)
    half = 1 << (bits - 1)
    q = torch.randint(-half, half, (5, 37), generator=gen, dtype=torch.int8)
    packed = pack_to_int32(q, bits).numpy()
    assert np.array_equal(ct_decode.unpack_offset_binary(packed, bits, 37), q.numpy())


def test_bf16_rounding_is_to_nearest_even():
    # Between 1 (0x3F80) and 1 + 2^-7 (0x3F81): 1 + 2^-8 is the midpoint and goes to the even 0x3F80;
    # 1 + 3·2^-8 is the midpoint above 0x3F81 and goes to the even 0x3F82; a hair above a midpoint goes up.
    values = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8)], dtype=np.float32)
    assert ct_decode.round_to_dtype(values, "BF16").tolist() == [0x3F80, 0x3F82, 0x3F81, 0xBF80]


def test_bf16_rounding_agrees_with_torch_on_random_values():
    x = np.random.default_rng(0).normal(scale=3.0, size=10_000).astype(np.float32)
    x[:4] = [np.nan, np.inf, -np.inf, 3.3e38]  # NaN gets torch's 0x7FC0; the largest floats round to inf
    ours = ct_decode.round_to_dtype(x, "BF16")
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert ours[0] & 0x7F80 == 0x7F80 and ours[0] & 0x7F  # a NaN (its bits vary between torch's kernels)
    assert np.array_equal(ours[1:], theirs[1:])


# ----------------------------------------------------------------------------------------------------------
# The two decodes of compressed-tensors weights agree bit for bit
# ----------------------------------------------------------------------------------------------------------


def _compressed(
    fmt: str, bits: int, strategy: str, group_size: int | None, symmetric: bool, dtype: torch.dtype
):
    """A random weight compressed by compressed-tensors itself, with its stored scheme."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(48, 64, generator=gen).to(dtype)
    args = QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size
    )
    groups = weight.float().reshape(48, -1, group_size) if strategy == "group" else weight.float()[:, None, :]
    if strategy == "tensor":
        groups = weight.float().reshape(1, 1, -1)
    qmax = (1 << (bits - 1)) - 1
    if symmetric:
        scale = (groups.abs().amax(-1) / qmax).to(dtype)
        state = {"weight": weight, "weight_scale": scale}
    else:
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo) / (2 * qmax + 1)).to(dtype)
        zp = (-(1 << (bits - 1)) - torch.round(lo / scale.float())).clamp(-(qmax + 1), qmax).to(torch.int8)
        state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zp}
    scheme = QuantizationScheme(targets=["x"], weights=args, format=fmt)
    compressed = BaseCompressor.get_value_from_registry(fmt).compress(state, scheme)
    stored = ct.StoredQuantization(fmt, "int", bits, strategy, group_size, None, symmetric, False)
    return weight, compressed, stored, scheme


@pytest.mark.parametrize(
    ("fmt", "bits", "strategy", "group_size", "symmetric", "dtype"),
    [
        ("pack-quantized", 4, "channel", None, True, torch.bfloat16),
        ("pack-quantized", 4, "group", 16, True, torch.bfloat16),
        ("pack-quantized", 4, "channel", None, False, torch.bfloat16),
        ("pack-quantized", 3, "channel", None, True, torch.float16),
        ("int-quantized", 8, "channel", None, True, torch.bfloat16),
        ("int-quantized", 8, "tensor", None, True, torch.float16),
        ("int-quantized", 8, "group", 32, False, torch.bfloat16),
    ],
)
def test_reference_decode_is_bit_identical_to_the_decompressor(
    fmt, bits, strategy, group_size, symmetric, dtype
):
    from compressed_tensors.compressors import BaseCompressor

    _, compressed, stored, scheme = _compressed(fmt, bits, strategy, group_size, symmetric, dtype)
    theirs = BaseCompressor.get_value_from_registry(fmt).decompress(compressed, scheme)["weight"]
    scale = compressed["weight_scale"]
    dtype_name = "BF16" if dtype == torch.bfloat16 else "F16"
    weight = compressed["weight_packed" if fmt == "pack-quantized" else "weight"].numpy()
    zp = compressed.get("weight_zero_point")
    if zp is not None and fmt == "pack-quantized":
        zp = torch.from_numpy(ct_decode.unpack_offset_binary(zp.numpy().T, bits, 48).T.copy())
    ours = ct_decode.reference_decode(
        stored,
        weight,
        scale.float().numpy().reshape(-1, scale.shape[-1] if scale.ndim else 1),
        dtype_name,
        64,
        None if zp is None else zp.numpy().reshape(-1, zp.shape[-1] if zp.ndim else 1),
    )
    # Both as float32 bits: widening bf16 / fp16 to float32 is one-to-one.
    assert np.array_equal(ours.view(np.uint32), theirs.float().numpy().view(np.uint32))


def test_a_flipped_code_is_a_decode_mismatch():
    from compressed_tensors.compressors import BaseCompressor

    _, compressed, stored, scheme = _compressed("pack-quantized", 4, "channel", None, True, torch.bfloat16)
    theirs = BaseCompressor.get_value_from_registry("pack-quantized").decompress(compressed, scheme)["weight"]
    packed = compressed["weight_packed"].numpy().copy()
    packed[3, 2] ^= 1 << 4  # one bit of one code
    ours = ct_decode.reference_decode(stored, packed, compressed["weight_scale"].float().numpy(), "BF16", 64)
    differ = np.argwhere(ours.view(np.uint32) != theirs.float().numpy().view(np.uint32))
    assert differ.tolist() == [[3, 17]]  # word 2 holds codes 16..23; bit 4 is code 17's lowest


def test_library_runs_sample_each_window_of_rows_at_offsets_fixed_by_the_name():
    runs = library_runs("layers.0.mlp.up_proj.weight", 2500, 1, "sample")
    assert len(runs) == 3 and all(b - a == 16 for a, b in runs)  # one run in each window of 1,024 rows
    assert [a // 1024 for a, _ in runs] == [0, 1, 2] and all(b <= 2500 for _, b in runs)
    assert runs == library_runs("layers.0.mlp.up_proj.weight", 2500, 1, "sample")  # the same every run
    assert runs != library_runs("layers.1.mlp.up_proj.weight", 2500, 1, "sample")
    assert library_runs("x", 5, 1, "sample") == [(0, 5)]  # a short tensor is checked whole
    assert all(a % 32 == 0 and b - a == 32 for a, b in library_runs("x", 4096, 32, "sample"))
    assert library_runs("x", 2500, 1, "all") == [(0, 2500)]


def _int8_pair(tmp_path: Path, rows: int = 2048) -> tuple[Checkpoint, Checkpoint]:
    """A source of one Linear and its int-quantized copy written by compressed-tensors' compressor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weight = torch.randn(rows, 16, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    args = QuantizationArgs(**_args(8))
    scheme = QuantizationScheme(targets=["re:.*proj$"], weights=args, format="int-quantized")
    scale = (weight.float().abs().amax(1, keepdim=True) / 127).to(torch.bfloat16)
    compressed = BaseCompressor.get_value_from_registry("int-quantized").compress(
        {"weight": weight, "weight_scale": scale}, scheme
    )
    qc = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"g": scheme.model_dump(mode="json")},
    }
    source = _write(tmp_path / "src", {"up_proj.weight": weight})
    candidate = {f"up_proj.{k}": v.contiguous() for k, v in compressed.items()}
    return source, _write(tmp_path / "ckpt", candidate, {"model_type": "toy", "quantization_config": qc})


def test_the_library_decodes_a_sample_of_rows_or_every_row_when_asked(tmp_path):
    source, candidate = _int8_pair(tmp_path)
    sampled = verify_tensors(source, candidate, RULES, workers=1)
    summary = sampled.summary()
    assert (summary["decode_exact"], summary["decode_cross_check"]) == (True, "sample")
    assert sampled.rows[0]["library_checked_rows"] == 32  # 16 rows in each of two windows of 1,024
    assert summary["decode_cross_checked_weights"] == 32 * 16
    assert summary["decode_cross_checked_fraction"] == 32 / 2048
    every = verify_tensors(source, candidate, RULES, workers=1, library_check="all").summary()
    assert (every["decode_cross_check"], every["decode_cross_checked_fraction"]) == ("all", 1.0)
    assert every["decode_exact"] is True and every["worst_rel_err"] == summary["worst_rel_err"]


@pytest.mark.parametrize("check", ["sample", "all"])
def test_a_library_decode_that_differs_is_named_at_the_first_row_it_decoded(tmp_path, monkeypatch, check):
    from evalsuite.tasks.tensors._verification import _compressed_tensors

    def shifted(*args, **kwargs):
        decoded = ct.library_decode(*args, **kwargs)
        decoded[:, 3] += 1  # the library (here) decodes column 3 of every row it is given differently
        return decoded

    monkeypatch.setattr(_compressed_tensors, "library_decode", shifted)
    source, candidate = _int8_pair(tmp_path)
    found = verify_tensors(source, candidate, RULES, workers=1, library_check=check)
    first = library_runs("up_proj.weight", 2048, 1, check)[0][0]
    assert found.summary()["decode_exact"] is False
    assert [(p.check, p.tensor) for p in found.problems] == [("decode", "up_proj.weight")]
    assert f"decode element [{first}, 3] differently" in found.problems[0].detail


# ----------------------------------------------------------------------------------------------------------
# Which config group covers a module
# ----------------------------------------------------------------------------------------------------------


def _args(bits: int) -> dict:
    return {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "channel"}


def test_scheme_lookup_follows_compressed_tensors_precedence():
    config = {
        "quant_method": "compressed-tensors",
        "format": "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": {
            "g4": {
                "targets": [r"re:.*mlp\..*_proj$", "Linear"],
                "weights": _args(4),
                "format": "pack-quantized",
            },
            "g8": {"targets": ["model.layers.0.mlp.up_proj"], "weights": _args(8), "format": "int-quantized"},
        },
        "ignore": [r"re:.*vision_tower.*"],
    }
    lookup = ct.SchemeLookup(config)
    # An exact name beats a regex, a regex beats a class name; ignore wins over all.
    assert lookup.covering("model.layers.0.mlp.up_proj", "linear").group == "g8"
    assert lookup.covering("model.layers.1.mlp.up_proj", "linear").group == "g4"
    assert lookup.covering("model.layers.1.self_attn.q_proj", "linear").group == "g4"  # by class: Linear
    vision = lookup.covering("model.vision_tower.fc1", "linear")
    assert vision.group is None and vision.ignored
    # A norm is no Linear: neither the class target nor a scheme applies to it.
    assert lookup.covering("model.layers.1.input_layernorm", "norm").group is None
    modules = {"model.layers.1.mlp.up_proj": "linear"}
    assert lookup.unmatched_targets(modules) == [("g8", "model.layers.0.mlp.up_proj")]


def test_stored_quantization_reads_the_scheme_from_shapes(tmp_path):
    _, compressed, _, _ = _compressed("pack-quantized", 4, "group", 16, True, torch.bfloat16)
    path = tmp_path / "m.safetensors"
    save_file({f"x.{k}": v.contiguous() for k, v in compressed.items()}, str(path))
    (tmp_path / "config.json").write_text("{}")
    ckpt = Checkpoint.open(tmp_path)
    source = TensorInfo("x.weight", path, "BF16", (48, 64), 0, 48 * 64 * 2)
    tensors = {k.removeprefix("x."): v for k, v in ckpt.tensors.items()}
    with ShardReader() as reader:
        stored, problems = ct.stored_quantization(source, tensors, None, reader)
        assert problems == []
        assert stored.describe() == "int4 pack-quantized group 16"
        wrong = TensorInfo("x.weight", path, "BF16", (48, 60), 0, 48 * 60 * 2)  # in_features ≠ weight_shape
        _, problems = ct.stored_quantization(wrong, tensors, None, reader)
    assert problems == ["weight_shape says [48, 64], the source weight [48, 60]"]


# ----------------------------------------------------------------------------------------------------------
# Modules, pairing, protected tensors, errors
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "shape", "kind"),
    [
        ("model.embed_tokens.weight", (512, 64), "embedding"),
        ("model.layers.0.mlp.gate.weight", (4, 64), "router"),
        ("model.layers.0.linear_attn.in_proj_a.weight", (4, 64), "state"),
        ("model.layers.0.input_layernorm.weight", (64,), "norm"),
        ("model.layers.0.linear_attn.conv1d.weight", (128, 1, 4), "other"),
        ("model.layers.0.linear_attn.A_log", (4,), "other"),
        ("model.layers.0.mlp.gate_proj.weight", (32, 64), "linear"),
    ],
)
def test_module_kinds(name, shape, kind):
    assert RULES.kind(name, shape) == kind


def test_layer_and_projection_names():
    assert layer_and_projection("model.language_model.layers.3.mlp.experts.17.up_proj", "text") == (
        3,
        "mlp.experts.*.up_proj",
    )
    assert layer_and_projection("model.vision_tower.encoder.layers.0.mlp.fc1", "vision") == (
        0,
        "vision:mlp.fc1",
    )
    assert layer_and_projection("lm_head", "head") == (None, "lm_head")


def _info(name: str, dtype: str = "BF16", shape: tuple[int, ...] = (2, 2)) -> TensorInfo:
    return TensorInfo(name, Path("x.safetensors"), dtype, shape, 0, 8)


def test_every_source_tensor_pairs_once_and_leftovers_are_unexpected():
    source = {n: _info(n) for n in ("a.weight", "b.weight", "b.bias", "c.weight", "d.weight")}
    candidate = {
        n: _info(n)
        for n in (
            "a.weight",  # protected
            "b.weight_packed",
            "b.weight_scale",
            "b.weight_shape",  # b quantized
            "b.bias",  # protected beside it
            "c.weight",
            "c.weight_scale",  # c int-quantized: its int8 weight keeps the name
            "e.weight_packed",
            "e.weight_scale",  # a quantized module with no source weight
            "a.extra",
        )
    }
    handler = ct.CompressedTensors.__new__(ct.CompressedTensors)
    pairs, unexpected = pair_tensors(source, candidate, handler)
    assert [(p.source, p.how) for p in pairs] == [
        ("a.weight", "same"),
        ("b.weight", "quantized"),
        ("b.bias", "same"),
        ("c.weight", "quantized"),
        ("d.weight", "missing"),
    ]
    assert pairs[1].candidate == {
        "weight_packed": "b.weight_packed",
        "weight_scale": "b.weight_scale",
        "weight_shape": "b.weight_shape",
    }
    assert pairs[3].candidate == {"weight": "c.weight", "weight_scale": "c.weight_scale"}
    assert sorted(unexpected) == ["a.extra", "e.weight_packed", "e.weight_scale"]


def _write(folder: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Checkpoint:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "toy"}))
    return Checkpoint.open(folder)


def test_a_flipped_bit_names_the_first_differing_element(tmp_path):
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
    changed = weight.clone()
    changed.view(torch.int16)[2, 1] ^= 1  # lowest mantissa bit of 9.0
    source = _write(tmp_path / "src", {"norm.weight": weight.reshape(-1).clone(), "emb.weight": weight})
    candidate = _write(tmp_path / "ckpt", {"norm.weight": weight.reshape(-1).clone(), "emb.weight": changed})
    found = verify_tensors(source, candidate, RULES, workers=1)
    assert [(p.check, p.tensor) for p in found.problems] == [("protected", "emb.weight")]
    assert "first differing element [2, 1]: 9 (0x4110) → 9.0625 (0x4111)" in found.problems[0].detail
    summary = found.summary()
    assert (summary["protected_total"], summary["protected_identical"]) == (2, 1)


def test_a_cast_is_measured_like_a_decode(tmp_path):
    weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    source = _write(tmp_path / "src", {"w.weight": weight.to(torch.bfloat16)})
    candidate = _write(tmp_path / "ckpt", {"w.weight": weight.to(torch.float16)})
    row = verify_tensors(source, candidate, RULES).rows[0]
    assert (row["tensor_class"], row["format"], row["bits"]) == ("quantized", "f16", 16)
    assert 0 < row["rel_err"] < 1e-2


def test_error_accumulator_adds_up_to_the_metric_sums():
    rng = np.random.default_rng(3)
    ref = rng.normal(size=(10, 32)).astype(np.float32)
    cand = ref + rng.normal(scale=0.01, size=ref.shape).astype(np.float32)
    cand[6] *= 3  # one bad channel
    acc = ErrorAccumulator()
    acc.add(0, ref[:4], cand[:4])
    acc.add(4, ref[4:], cand[4:])
    whole = tensor_errors.error_sums(ref.astype(np.float64), cand.astype(np.float64))
    for field in ("ref_sq", "err_sq", "cand_sq", "dot", "max_abs"):
        assert getattr(acc.sums, field) == pytest.approx(getattr(whole, field), rel=1e-5)
    assert acc.worst_channel == 6
    assert acc.worst_channel_rel_err == pytest.approx(2.0, rel=0.05)


# ----------------------------------------------------------------------------------------------------------
# EXL3 layouts
# ----------------------------------------------------------------------------------------------------------


def _mcg() -> torch.Tensor:
    return torch.tensor(exl3.CODEBOOK_MULTIPLIERS["mcg"] - (1 << 32), dtype=torch.int32)


def _exl3_pair(
    tmp_path: Path, k: int = 4, storage_bits: float | None = None, marker: torch.Tensor | None = None
):
    gen = torch.Generator().manual_seed(1)
    source = {"q.weight": torch.randn(32, 64, generator=gen).to(torch.bfloat16), "n.weight": torch.ones(64)}
    # exllamav3 pads both feature counts to multiples of 128 (modules/linear.py, pad_to=128).
    candidate = {
        "q.trellis": torch.zeros(128 // 16, 128 // 16, 16 * k, dtype=torch.int16),
        "q.suh": torch.ones(128, dtype=torch.float16),
        "q.svh": torch.ones(128, dtype=torch.float16),
        "q.mcg": _mcg() if marker is None else marker,
        "n.weight": torch.ones(64),
    }
    qc = {"quant_method": "exl3", "bits": k, "head_bits": 6, "codebook": "mcg"}
    src = _write(tmp_path / "src", source, {"model_type": "toy"})
    _write(tmp_path / "ckpt", candidate, {"model_type": "toy", "quantization_config": qc})
    stored = {
        name: {"shape": list(t.shape), "n_bytes": t.numel() * t.element_size(), "dtype": str(t.dtype)}
        for name, t in candidate.items()
        if name.startswith("q.")
    }
    storage = {
        "q": {
            "stored_tensors": stored,
            "quant_format": "exl3",
            "bits_per_weight": k if storage_bits is None else storage_bits,
            "mcg_multiplier": exl3.CODEBOOK_MULTIPLIERS["mcg"],
        },
        "n": {"stored_tensors": {"n.weight": {"shape": [64], "n_bytes": 256, "dtype": "torch.float32"}}},
    }
    (tmp_path / "ckpt" / "quantization_config.json").write_text(json.dumps({**qc, "tensor_storage": storage}))
    return src, Checkpoint.open(tmp_path / "ckpt")


def test_exl3_bits_per_weight_come_from_the_trellis_width():
    assert exl3.bits_per_weight((4, 2, 64)) == 4
    assert exl3.bits_per_weight((4, 2, 40)) == 2.5


def layout_problems(found) -> list:
    """The problems of an `_exl3_pair`'s layout: its all-zero trellis quantizes no source, so its decode's
    channels stand out from each other (`outlier`), which these tests are not about."""
    return [p for p in found.problems if p.check != "outlier"]


def test_a_consistent_exl3_layout_has_no_problem(tmp_path):
    src, ckpt = _exl3_pair(tmp_path)
    found = verify_tensors(src, ckpt, RULES)
    assert layout_problems(found) == []
    summary = found.summary()
    assert (summary["quantized_other"], summary["protected_identical"], summary["avg_bits_per_weight"]) == (
        1,
        1,
        4,
    )
    assert summary["decode_exact"] is None and summary["bpw_claim_error"] == 0


def test_exl3_tensor_storage_bits_that_disagree_with_the_trellis_name_the_tensor(tmp_path):
    src, ckpt = _exl3_pair(tmp_path, storage_bits=5)
    found = verify_tensors(src, ckpt, RULES)
    assert [(p.check, p.tensor) for p in layout_problems(found)] == [("config", "q.weight")]
    assert "tensor_storage says 5 bpw, the trellis shape gives 4 bpw" in layout_problems(found)[0].detail


def test_exl3_codebook_marker_must_hold_its_multiplier(tmp_path):
    src, ckpt = _exl3_pair(tmp_path, marker=torch.tensor(7, dtype=torch.int32))
    details = [p.detail for p in verify_tensors(src, ckpt, RULES).problems]
    assert details == ["mcg marker holds 0x00000007, not 0xcbac1fed"]


def test_fp8_and_fp4_tables_match_torch_and_compressed_tensors():
    """evalsuite's FP8 E4M3 and FP4 E2M1 tables, written from the definitions, against the libraries'."""
    import numpy as np
    import torch
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    from evalsuite.formats import FP8_E4M3_VALUES
    from evalsuite.formats.ct_decode import FP4_E2M1_VALUES

    theirs = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(np.isnan(theirs), np.isnan(FP8_E4M3_VALUES))
    assert np.array_equal(np.nan_to_num(theirs), np.nan_to_num(FP8_E4M3_VALUES))
    codes = torch.tensor([[lo | (hi << 4) for hi in range(16) for lo in range(16)]], dtype=torch.uint8)
    unpacked = unpack_fp4_from_uint8(codes, 1, 512, dtype=torch.float32).numpy().reshape(-1)
    ours = np.stack([FP4_E2M1_VALUES[codes.numpy() & 0xF], FP4_E2M1_VALUES[codes.numpy() >> 4]], -1).reshape(
        -1
    )
    assert np.array_equal(unpacked, ours)


def _decode_by_formula(stored, weight, scale, scale_dtype, cols, zero_point=None, global_scale=None):
    """The spec of `reference_decode`: every weight's (q − zero_point) × scale in float32, rounded once to
    `scale_dtype` (the formula evalsuite decoded by before its lookup tables)."""
    rows = weight.shape[0]
    q = ct_decode.code_values(stored, weight, cols).copy()
    if global_scale is not None:
        scale = scale / np.float32(global_scale)
    if zero_point is not None:
        q -= ct_decode._expand(zero_point.astype(np.float32), stored, rows, cols, None)
    np.multiply(q, ct_decode._expand(scale, stored, rows, cols, None), out=q)
    return ct_decode.rounded_to(q, scale_dtype)


# Scales at the edges of bf16 and fp16: zeros of both signs, subnormals, the largest finite, infinities, NaN.
_EDGE_SCALES = np.array(
    [0.0, -0.0, 1e-40, -1e-40, 9.2e-41, 3.3895314e38, -3.3895314e38, np.inf, -np.inf, np.nan, 6e-8, 65504.0],
    dtype=np.float32,
)


@pytest.mark.parametrize(
    ("fmt", "bits", "strategy", "group_size"),
    [
        ("pack-quantized", 4, "channel", None),
        ("pack-quantized", 4, "group", 512),
        ("pack-quantized", 4, "tensor", None),
        ("pack-quantized", 8, "channel", None),
        ("float-quantized", 8, "channel", None),
        ("float-quantized", 8, "group", 256),
        ("nvfp4-pack-quantized", 4, "channel", None),
    ],
)
@pytest.mark.parametrize("scale_dtype", ["BF16", "F16", "F32"])
@pytest.mark.parametrize("asymmetric", [False, True])
def test_decode_by_table_is_bit_identical_to_the_formula(
    fmt, bits, strategy, group_size, scale_dtype, asymmetric
):
    rng = np.random.default_rng(bits * 7 + len(fmt))
    rows, cols = 24, 1024
    stored = ct.StoredQuantization(fmt, "int", bits, strategy, group_size, None, not asymmetric, False)
    if fmt == "pack-quantized":
        weight = rng.integers(-(2**31), 2**31, (rows, cols * bits // 32), dtype=np.int64).astype(np.int32)
    else:
        weight = rng.integers(0, 256, (rows, cols // 2 if bits == 4 else cols), dtype=np.uint8)
    groups = 1 if strategy != "group" else cols // group_size
    shape = (1, 1) if strategy == "tensor" else (rows, groups)
    scale = (rng.standard_normal(shape) * 10.0 ** rng.integers(-30, 30, shape)).astype(np.float32)
    if strategy != "tensor":
        scale.reshape(-1)[: _EDGE_SCALES.size] = _EDGE_SCALES[: scale.size]
        scale[-1] = scale[0]  # rows sharing a scale share a table
    zero = rng.integers(-8, 8, shape).astype(np.int8) if asymmetric else None
    for global_scale in (None, 3.0) if fmt.startswith("nvfp4") else (None,):
        args = (stored, weight, scale, scale_dtype, cols, zero)
        with np.errstate(over="ignore", invalid="ignore"):  # the edge scales overflow, as they should
            # the table path is the one tested here
            assert ct_decode._decode_by_table(*args, None, ct_decode._fresh) is not None
            ours = ct_decode.reference_decode(*args, global_scale=global_scale)
            spec = _decode_by_formula(*args, global_scale)
        assert np.array_equal(ours.view(np.uint32), spec.view(np.uint32))


def _nvfp4_library_calls(llmc_tiny, monkeypatch, differ_when_batched: bool):
    """verify_tensors of llm-compressor's NVFP4A16 pack of the tiny Llama, with every call of the library's
    decoder recorded (the real decoder; with `differ_when_batched`, a call holding rows of several tensors
    returns column 1 decoded differently)."""
    from evalsuite.tasks.tensors._verification import _compressed_tensors

    calls: list[int] = []

    def recorded(*args, **kwargs):
        decoded = ct.library_decode(*args, **kwargs)
        global_scale = kwargs.get("global_scale")
        calls.append(1 if global_scale is None else int(np.unique(global_scale).size))
        if differ_when_batched and calls[-1] > 1:
            decoded[:, 1] += 1
        return decoded

    monkeypatch.setattr(_compressed_tensors, "library_decode", recorded)
    source = Checkpoint.open(llmc_tiny["tiny-llama-bf16"])
    candidate = Checkpoint.open(llmc_tiny["tiny-llama-llmc"] / "nvfp4a16")
    return verify_tensors(source, candidate, RULES, workers=1), calls


def test_nvfp4_weights_are_cross_checked_many_tensors_a_call(llmc_tiny, monkeypatch):
    found, calls = _nvfp4_library_calls(llmc_tiny, monkeypatch, differ_when_batched=False)
    nvfp4 = [r for r in found.rows if r.get("format") == "nvfp4-pack-quantized"]
    assert len(nvfp4) > 1 and all(r["decode_exact"] is True and r["library_checked_rows"] for r in nvfp4)
    # Each tensor's own global scale rides with its rows: far fewer calls than tensors, each holding several.
    assert len(calls) < len(nvfp4) and max(calls) > 1
    assert found.summary()["decode_exact"] is True and not found.problems


def test_a_difference_only_a_batched_nvfp4_decode_shows_is_not_reported(llmc_tiny, monkeypatch):
    found, calls = _nvfp4_library_calls(llmc_tiny, monkeypatch, differ_when_batched=True)
    # Every batched difference was decoded again on its own, as stored, where both decodes agree.
    assert max(calls) > 1 and calls.count(1) > 0
    assert found.summary()["decode_exact"] is True and not found.problems
