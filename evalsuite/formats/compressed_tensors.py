"""compressed-tensors on disk: what a quantized module stores, which config group or `ignore` entry covers a
module, what a module's stored tensors say about its quantization, and the library's own decode of a weight.

The library decode is compressed-tensors' decompressor (what Transformers and vLLM run); `ct_decode` holds the
independent one it is checked against. Matching uses compressed-tensors' own helpers (`is_match`,
`match_targets`) on the modules of the model Transformers builds on the meta device when the caller has them
(class-name targets such as `Linear` then match what compressed-tensors matches at load: an MoE router is no
`Linear`), else on stand-ins: a module whose source weight is a 2-D Linear-like weight stands in as
`torch.nn.Linear`, an embedding as `torch.nn.Embedding`, anything else as a plain `torch.nn.Module` (see the
tensors task's `ModuleRules`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint, TensorInfo
from evalsuite.formats import ModuleKind, ShardReader, as_float32, rows_and_cols, split_at_last_dot

# Every tensor compressed-tensors may store for a quantized module (int-quantized keeps the name `weight`).
PARAMS = frozenset(
    {
        "weight",
        "weight_packed",
        "weight_scale",
        "weight_zero_point",
        "weight_shape",
        "weight_g_idx",
        "weight_global_scale",
        "input_scale",
        "input_zero_point",
        "input_global_scale",
        "output_scale",
        "output_zero_point",
    }
)
MARKS = frozenset({"weight_packed", "weight_scale"})
# Formats compressed-tensors' decompressor decodes here (`library_decode`): every weight format of 0.20 that
# llm-compressor writes for Linear layers. `ct_decode.reference_decode` decodes them too
# (`INDEPENDENT_DECODE_FORMATS`) but MXFP4, whose E8M0 scales only the library's decode reads.
DECODED_FORMATS = frozenset(
    {
        "pack-quantized",
        "int-quantized",
        "naive-quantized",
        "float-quantized",
        "nvfp4-pack-quantized",
        "mxfp4-pack-quantized",
    }
)
INDEPENDENT_DECODE_FORMATS = DECODED_FORMATS - {"mxfp4-pack-quantized"}
# FP4 (E2M1) formats: two codes per uint8, low nibble first, with groups of this many weights per scale.
FP4_GROUP_SIZES = {"nvfp4-pack-quantized": 16, "mxfp4-pack-quantized": 32}
# Integer weight formats: what `intref` executes and counts by its bits (quantized_int4, quantized_int8).
INTEGER_FORMATS = frozenset({"pack-quantized", "int-quantized", "naive-quantized"})
# Kinds of module compressed-tensors gives a scheme to: Linear layers (routers and state projections are
# Linear layers too) and embeddings.
QUANTIZABLE_KINDS = frozenset({"linear", "router", "state", "embedding"})


@cache
def _stand_in(kind: ModuleKind) -> Any:
    import torch

    if kind in ("linear", "router", "state"):
        return torch.nn.Linear(1, 1, device="meta")
    if kind == "embedding":
        return torch.nn.Embedding(1, 1, device="meta")
    return torch.nn.Module()


@dataclass(frozen=True)
class Coverage:
    """What the config says of one module: the group whose scheme applies (None when no group targets it or
    it is ignored), that scheme, the format it is stored in, and whether an `ignore` entry names it."""

    group: str | None
    scheme: Any | None
    format: str | None
    ignored: bool


# compressed-tensors 0.19 removed `actorder: "group"` (alias "dynamic") and refuses a config that carries it,
# though packs written before it (llm-compressor <= 0.13, `weight_g_idx` stored) are published and still run
# elsewhere. Which group each column belongs to is in the files' `weight_g_idx`, not in this value, so such a
# config is read as the library would read the same pack without activation order.
REMOVED_ACTORDER = ("group", "dynamic")


def readable_config(quantization_config: dict[str, Any]) -> dict[str, Any]:
    """The config with any removed `actorder` value left out (see REMOVED_ACTORDER); a copy when changed."""
    groups = quantization_config.get("config_groups")
    if not isinstance(groups, dict) or not any(
        isinstance(g, dict)
        and isinstance(g.get("weights"), dict)
        and g["weights"].get("actorder") in REMOVED_ACTORDER
        for g in groups.values()
    ):
        return quantization_config
    readable = {**quantization_config, "config_groups": {}}
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict) and weights.get("actorder") in REMOVED_ACTORDER:
            group = {**group, "weights": {k: v for k, v in weights.items() if k != "actorder"}}
        readable["config_groups"][name] = group
    return readable


class SchemeLookup:
    """A `quantization_config` read by compressed-tensors itself, resolved per module as it resolves it at
    load time: a module is quantized by the first of its matching targets in `match_targets` order (exact
    names, then regexes, then class names), a target listed twice belongs to the later group, and a module
    matching an `ignore` entry is left alone."""

    def __init__(self, quantization_config: dict[str, Any], where: Any = None) -> None:
        from compressed_tensors.quantization import QuantizationConfig
        from pydantic import ValidationError

        try:
            self.config = QuantizationConfig.model_validate(readable_config(quantization_config))
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise InputError(f"quantization_config.{loc}: {err['msg']}", where) from None
        self.target_to_group: OrderedDict[str, str] = OrderedDict()
        for group, scheme in self.config.config_groups.items():
            for target in scheme.targets:
                self.target_to_group[target] = group
        self.ignore = list(self.config.ignore or [])

    def covering(self, module: str, kind: ModuleKind, instance: Any = None) -> Coverage:
        """The config's word on `module` (see the class docstring). `instance` is the module as the model
        skeleton Transformers builds holds it (its class is what a class-name target such as `Linear`
        matches: an MoE router is no `Linear` there); without one, a stand-in of the module's kind."""
        from compressed_tensors.utils.match import is_match, match_targets

        stand_in = instance if instance is not None else _stand_in(kind)
        ignored = bool(self.ignore) and is_match(module, stand_in, self.ignore)
        matched = match_targets(module, stand_in, list(self.target_to_group))
        if ignored or not matched or (instance is None and kind not in QUANTIZABLE_KINDS):
            return Coverage(None, None, None, ignored)
        group = self.target_to_group[matched[0]]
        scheme = self.config.config_groups[group]
        fmt = scheme.format or (self.config.format if self.config.format != "mixed-precision" else None)
        return Coverage(group, scheme, fmt, ignored)

    def unmatched_targets(
        self, modules: dict[str, ModuleKind], instances: dict[str, Any] | None = None
    ) -> list[tuple[str, str]]:
        """(group, target) for every target that matches no module of the source at all (`instances`: the
        skeleton's modules by name, as `covering` takes them)."""
        from compressed_tensors.utils.match import is_match

        left = dict(self.target_to_group)
        instances = instances or {}
        for module, kind in modules.items():
            stand_in = instances.get(module) or _stand_in(kind)
            for target in [t for t in left if is_match(module, stand_in, t)]:
                del left[target]
            if not left:
                break
        return [(group, target) for target, group in left.items()]


@dataclass(frozen=True)
class StoredQuantization:
    """What a module's stored tensors say about its weight quantization, read from their dtypes and shapes."""

    format: str
    type: str
    num_bits: int
    strategy: str
    group_size: int | None
    block: tuple[int, int] | None
    symmetric: bool
    actorder: bool

    def describe(self) -> str:
        """E.g. `int4 pack-quantized channel` or `int8 int-quantized group 128 asymmetric`."""
        parts = [f"{self.type}{self.num_bits}", self.format, self.strategy]
        if self.group_size:
            parts.append(str(self.group_size))
        if self.block:
            parts.append(f"{self.block[0]}x{self.block[1]}")
        if not self.symmetric:
            parts.append("asymmetric")
        return " ".join(parts)

    def scheme(self) -> Any:
        """The weight scheme as compressed-tensors' `QuantizationScheme`, to hand to its decompressor."""
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        args = QuantizationArgs(
            num_bits=self.num_bits,
            type=self.type,
            symmetric=self.symmetric,
            strategy=self.strategy,
            group_size=self.group_size,
            block_structure=list(self.block) if self.block else None,
        )
        return QuantizationScheme(targets=["evalsuite"], weights=args, format=self.format)


def describe_scheme(scheme: Any, fmt: str | None) -> str:
    """A config group's weight scheme in the words of `StoredQuantization.describe`."""
    w = scheme.weights
    if w is None:
        return "no weight quantization"
    parts = [f"{w.type}{w.num_bits}", fmt or "(format unstated)", str(w.strategy)]
    if w.group_size:
        parts.append(str(w.group_size))
    if w.block_structure:
        parts.append("x".join(map(str, w.block_structure)))
    if not w.symmetric:
        parts.append("asymmetric")
    return " ".join(parts)


def _int_bits(hint: Any, default: int) -> int:
    """The bits of an integer scheme whose values sit in wider storage (int4 in int8 tensors): the config's,
    when it says an integer of at most the storage's bits."""
    bits = getattr(hint, "num_bits", None)
    if str(getattr(hint, "type", "int")) == "int" and isinstance(bits, int) and 1 < bits <= default:
        return bits
    return default


def stored_quantization(
    source: TensorInfo,
    tensors: dict[str, TensorInfo],
    hint: Any,
    reader: ShardReader,
    format_hint: str | None = None,
) -> tuple[StoredQuantization | None, list[str]]:
    """Read a quantized module's scheme from its tensors and the config together, as compressed-tensors does:
    the storage from the tensors' dtypes and shapes, the bits from the scheme where storage is wider than the
    values (`hint`: the config's weight args; `format_hint`: the group's format). The problems say where the
    tensors disagree with the source weight; values outside the scheme's range are checked at decode."""
    rows, cols = rows_and_cols(source.shape)
    scale = tensors.get("weight_scale")
    if scale is None:
        return None, ["stores weight_packed but no weight_scale"]
    problems: list[str] = []
    if "weight_packed" in tensors and tensors["weight_packed"].dtype == "U8":
        packed = tensors["weight_packed"]
        if format_hint in FP4_GROUP_SIZES:
            fmt = format_hint
        else:
            fmt = "nvfp4-pack-quantized" if "weight_global_scale" in tensors else "mxfp4-pack-quantized"
        if rows_and_cols(packed.shape) != (rows, math.ceil(cols / 2)):
            held = f"weight_packed {list(packed.shape)} cannot hold the source weight {list(source.shape)}"
            return None, [f"{held} as FP4"]
        kind, bits = "float", 4
    elif "weight_packed" in tensors:
        packed = tensors["weight_packed"]
        if packed.dtype != "I32":
            return None, [f"weight_packed is {packed.dtype}, neither I32 (integers) nor U8 (FP4)"]
        fmt, kind = "pack-quantized", "int"
        width = packed.shape[-1] if packed.shape else 0
        fits = [b for b in range(1, 9) if math.ceil(cols * b / 32) == width]
        if not fits or rows_and_cols(packed.shape)[0] != rows:
            held = f"weight_packed {list(packed.shape)} cannot hold the source weight {list(source.shape)}"
            return None, [held]
        hinted = getattr(hint, "num_bits", None)
        bits = hinted if hinted in fits else fits[0]
        shape_info = tensors.get("weight_shape")
        if shape_info is None:
            problems.append("stores no weight_shape")
        else:
            stored_shape = [int(v) for v in reader.tensor(shape_info).reshape(-1)]
            if stored_shape != list(source.shape):
                problems.append(f"weight_shape says {stored_shape}, the source weight {list(source.shape)}")
    else:
        weight = tensors.get("weight")
        if weight is None or weight.shape != source.shape:
            got = "nothing" if weight is None else f"{weight.dtype} {list(weight.shape)}"
            return None, [f"stores {got} for a source weight {list(source.shape)} beside its weight_scale"]
        if weight.dtype == "I8":
            # llm-compressor stores W4A8's int4 values in int8 tensors, `int-quantized` at 4 bits.
            fmt, kind, bits = "int-quantized", "int", _int_bits(hint, 8)
        elif weight.dtype.startswith("F8"):
            fmt, kind, bits = "float-quantized", "float", 8
        else:
            return None, [f"weight is {weight.dtype} beside a weight_scale: not a quantized weight"]
    strategy, group_size, block = _strategy(scale.shape, rows, cols, hint)
    if strategy is None:
        return None, [f"weight_scale {list(scale.shape)} fits no strategy for a weight {list(source.shape)}"]
    if strategy == "group" and "weight_global_scale" in tensors:
        strategy = "tensor_group"  # NVFP4: FP8 group scales under one FP32 global scale
    stored = StoredQuantization(
        format=fmt,
        type=kind,
        num_bits=bits,
        strategy=strategy,
        group_size=group_size,
        block=block,
        symmetric="weight_zero_point" not in tensors,
        actorder="weight_g_idx" in tensors,
    )
    return stored, problems


def _strategy(
    scale_shape: tuple[int, ...], rows: int, cols: int, hint: Any
) -> tuple[str | None, int | None, tuple[int, int] | None]:
    srows, scols = rows_and_cols(scale_shape)
    if srows * scols == 1:
        return "tensor", None, None
    block = getattr(hint, "block_structure", None)
    if getattr(hint, "strategy", None) == "block" and block:
        bh, bw = block
        if (srows, scols) == (math.ceil(rows / bh), math.ceil(cols / bw)):
            return "block", None, (bh, bw)
    if srows != rows:
        return None, None, None
    hinted = getattr(hint, "group_size", None)
    grouped = str(getattr(hint, "strategy", "")) in ("group", "tensor_group") and hinted
    # One group per row (group_size >= cols) stores a scale of one column, as a channel scale does.
    if grouped and scols == math.ceil(cols / hinted):
        return "group", hinted, None
    if scols == 1:
        return "channel", None, None
    if cols % scols == 0:
        return "group", cols // scols, None
    return None, None, None


def scheme_mismatches(stored: StoredQuantization, coverage: Coverage) -> list[str]:
    """How the stored quantization differs from the scheme of the group that targets the module."""
    w = coverage.scheme.weights
    if w is None:
        return [f"stored as {stored.describe()}, but group `{coverage.group}` quantizes no weights"]
    differs = (
        (coverage.format is not None and coverage.format != stored.format)
        or w.num_bits != stored.num_bits
        or str(w.type) != stored.type
        or str(w.strategy) != stored.strategy
        or (stored.strategy in ("group", "tensor_group") and w.group_size != stored.group_size)
        or bool(w.symmetric) != stored.symmetric
    )
    if not differs:
        return []
    said = describe_scheme(coverage.scheme, coverage.format)
    return [f"stored as {stored.describe()}, but config group `{coverage.group}` says {said}"]


class CompressedTensors:
    """compressed-tensors as a `QuantizedFormat`, with the candidate's `quantization_config` resolved per
    module by `lookup`."""

    name = "compressed-tensors"
    params = PARAMS
    marks = MARKS
    split = staticmethod(split_at_last_dot)

    def __init__(self, candidate: Checkpoint) -> None:
        self.lookup = SchemeLookup(candidate.quantization_config or {}, candidate.path / "config.json")


# ----------------------------------------------------------------------------------------------------------
# The library decode
# ----------------------------------------------------------------------------------------------------------


@cache
def _decompressor(stored: StoredQuantization) -> tuple[Any, Any]:
    # Built once per distinct scheme: a QuantizationScheme is a pydantic model, too slow to build per block.
    from compressed_tensors.compressors import BaseCompressor

    return BaseCompressor.get_value_from_registry(stored.format), stored.scheme()


def _torch_view(array: np.ndarray, dtype: str) -> Any:
    """A torch tensor sharing the memory of a stored array (bf16 and FP8 from their raw bits)."""
    import torch

    if dtype == "BF16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    if dtype == "F8_E4M3":
        return torch.from_numpy(array.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(array)


def _bits_view(tensor: Any) -> np.ndarray:
    """The raw bits of a 16- or 32-bit float torch tensor as an unsigned numpy array (no copy)."""
    import torch

    if tensor.element_size() == 2:
        return tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
    return tensor.contiguous().view(torch.int32).numpy().view(np.uint32)


def _float32_of_bits(bits: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    if dtype == "BF16":
        return as_float32(bits, "BF16", out)
    return as_float32(bits.view(np.float16 if dtype == "F16" else np.float32), dtype, out)


def decoded_dtype(stored: StoredQuantization, scale_dtype: str) -> str:
    """The dtype compressed-tensors decodes a weight to: its scale's, but bf16 for FP4 (the unpacked codes'
    dtype, `unpack_fp4_from_uint8`, which its dequantize casts to)."""
    return "BF16" if stored.format in FP4_GROUP_SIZES else scale_dtype


def library_decode(
    stored: StoredQuantization,
    weight: np.ndarray,
    scale: np.ndarray,
    scale_dtype: str,
    cols: int,
    zero_point: np.ndarray | None = None,
    out: np.ndarray | None = None,
    global_scale: np.ndarray | None = None,
) -> np.ndarray:
    """Rows of a weight decoded by compressed-tensors' own decompressor, as float32 (into `out` when given)
    holding values of `decoded_dtype` exactly, to be compared with `ct_decode.reference_decode`.

    Every array is as stored, for the same rows: `weight` the int32 words (pack-quantized), uint8 FP4 pairs
    (nvfp4 / mxfp4), int8 values or FP8 bytes, `scale` the scale rows (bf16 and FP8 as their raw bits),
    `zero_point` the zero points (pack-quantized packs them along the rows, 32 / b rows per word),
    `global_scale` NVFP4's float32: the tensor's one, as stored, or one per row, shape (rows, 1, 1), for the
    rows of several tensors in one call (the decompressor divides each group scale by it elementwise, so each
    row by its own tensor's). The decompressor does not apply `weight_g_idx` (`library_decode_scattered`).
    """
    import torch

    compressor, scheme = _decompressor(stored)
    rows = weight.shape[0]
    state = {"weight_scale": _torch_view(scale, scale_dtype)}
    if zero_point is not None:
        state["weight_zero_point"] = torch.from_numpy(np.ascontiguousarray(zero_point))
    if global_scale is not None:
        state["weight_global_scale"] = torch.from_numpy(np.ascontiguousarray(global_scale))
    if stored.format == "pack-quantized":
        state["weight_packed"] = torch.from_numpy(weight)
        state["weight_shape"] = torch.tensor([rows, cols])
    elif stored.format in FP4_GROUP_SIZES:
        state["weight_packed"] = torch.from_numpy(np.ascontiguousarray(weight))
    elif stored.format == "float-quantized":
        state["weight"] = _torch_view(weight, "F8_E4M3")
    else:
        state["weight"] = torch.from_numpy(weight)
    decoded = compressor.decompress(state, scheme)["weight"].reshape(rows, -1)[:, :cols]
    dtype = {torch.bfloat16: "BF16", torch.float16: "F16"}.get(decoded.dtype, "F32")
    return _float32_of_bits(_bits_view(decoded.to(torch.float32) if dtype == "F32" else decoded), dtype, out)


def library_decode_scattered(
    stored: StoredQuantization,
    weight: np.ndarray,
    scale: np.ndarray,
    scale_dtype: str,
    cols: int,
    g_idx: np.ndarray,
    zero_point: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray | None:
    """`library_decode` of a weight whose groups' columns activation order scattered (`weight_g_idx`, the
    group of every column): compressed-tensors 0.19 dropped g_idx from its decode, so the columns are
    gathered group by group (packed words unpacked and repacked by the library's own `unpack_from_int32` /
    `pack_to_int32`), decoded by the library as a plain grouped weight, and put back in place. None when
    g_idx does not give every group its `group_size` columns, which no plain grouped weight can express."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    natural = np.arange(cols) // stored.group_size
    groups = int(natural[-1]) + 1
    if (
        g_idx.min() < 0
        or g_idx.max() >= groups
        or not np.array_equal(np.bincount(g_idx, minlength=groups), np.bincount(natural, minlength=groups))
    ):
        return None
    order = np.argsort(g_idx, kind="stable")
    rows = weight.shape[0]
    if stored.format == "pack-quantized":
        values = unpack_from_int32(torch.from_numpy(weight), stored.num_bits, torch.Size((rows, cols)))
        gathered = pack_to_int32(values[:, torch.from_numpy(order)].contiguous(), stored.num_bits).numpy()
    else:
        gathered = np.ascontiguousarray(weight[:, order])
    decoded = library_decode(stored, gathered, scale, scale_dtype, cols, zero_point)
    result = out if out is not None else np.empty((rows, cols), dtype=np.float32)
    result[:, order] = decoded
    return result
