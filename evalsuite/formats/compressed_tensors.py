"""compressed-tensors on disk: which config group or `ignore` entry covers a module, what a module's stored
tensors say about its quantization, and two decodes of its weight that must agree bit for bit.

The decodes are compressed-tensors' own decompressor (what Transformers and vLLM run) and an independent one
written here from the format's definition: `pack-quantized` stores q + 2^(b−1) ("offset binary") densely in
int32 words, least significant bits first; `int-quantized` stores q as int8; either way the weight is
(q − zero_point) × scale, rounded once to the scale's dtype. Matching uses compressed-tensors' own helpers
(`is_match`, `match_targets`) on stand-in modules, since no model is built: a module whose source weight is a
2-D Linear-like weight stands in as `torch.nn.Linear`, an embedding as `torch.nn.Embedding`, anything else as
a plain `torch.nn.Module` (see `ModuleRules`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from evalsuite.checkpoint import Checkpoint, TensorInfo
from evalsuite.errors import InputError
from evalsuite.formats import (
    NUMPY_DTYPES,
    ErrorAccumulator,
    ModuleKind,
    Problem,
    ShardReader,
    as_float32,
    row_blocks,
    rows_and_cols,
)

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
# Formats decoded here; any other (FP8, NVFP4, …) is classified and checked against the config, not decoded.
DECODED_FORMATS = frozenset({"pack-quantized", "int-quantized", "naive-quantized"})
# Kinds of module compressed-tensors gives a scheme to: Linear layers (routers and state projections are
# Linear layers too) and embeddings.
QUANTIZABLE_KINDS = frozenset({"linear", "router", "state", "embedding"})
UNCOVERED_LINEAR = "a Linear left unquantized: no config group targets it and no `ignore` entry names it"


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


class SchemeLookup:
    """A `quantization_config` read by compressed-tensors itself, resolved per module as it resolves it at
    load time: a module is quantized by the first of its matching targets in `match_targets` order (exact
    names, then regexes, then class names), a target listed twice belongs to the later group, and a module
    matching an `ignore` entry is left alone."""

    def __init__(self, quantization_config: dict[str, Any], where: Any = None) -> None:
        from compressed_tensors.quantization import QuantizationConfig
        from pydantic import ValidationError

        try:
            self.config = QuantizationConfig.model_validate(quantization_config)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            raise InputError(f"quantization_config.{loc}: {err['msg']}", where) from None
        self.target_to_group: OrderedDict[str, str] = OrderedDict()
        for group, scheme in self.config.config_groups.items():
            for target in scheme.targets:
                self.target_to_group[target] = group
        self.ignore = list(self.config.ignore or [])

    def covering(self, module: str, kind: ModuleKind) -> Coverage:
        """The config's word on `module` (see the class docstring)."""
        from compressed_tensors.utils.match import is_match, match_targets

        stand_in = _stand_in(kind)
        ignored = bool(self.ignore) and is_match(module, stand_in, self.ignore)
        matched = match_targets(module, stand_in, list(self.target_to_group))
        if ignored or not matched or kind not in QUANTIZABLE_KINDS:
            return Coverage(None, None, None, ignored)
        group = self.target_to_group[matched[0]]
        scheme = self.config.config_groups[group]
        fmt = scheme.format or (self.config.format if self.config.format != "mixed-precision" else None)
        return Coverage(group, scheme, fmt, ignored)

    def unmatched_targets(self, modules: dict[str, ModuleKind]) -> list[tuple[str, str]]:
        """(group, target) for every target that matches no module of the source at all."""
        from compressed_tensors.utils.match import is_match

        left = dict(self.target_to_group)
        for module, kind in modules.items():
            for target in [t for t in left if is_match(module, _stand_in(kind), t)]:
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


def stored_quantization(
    source: TensorInfo, tensors: dict[str, TensorInfo], hint: Any, reader: ShardReader
) -> tuple[StoredQuantization | None, list[str]]:
    """Read a quantized module's scheme from its tensors (`hint`: the config's weight args, to choose among
    readings the shapes allow); the problems say where the tensors disagree with the source weight."""
    rows, cols = rows_and_cols(source.shape)
    scale = tensors.get("weight_scale")
    if scale is None:
        return None, ["stores weight_packed but no weight_scale"]
    problems: list[str] = []
    if "weight_packed" in tensors:
        packed = tensors["weight_packed"]
        if packed.dtype != "I32":
            return None, [f"weight_packed is {packed.dtype}, not I32: not an integer pack-quantized weight"]
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
            fmt, kind, bits = "int-quantized", "int", 8
        elif weight.dtype.startswith("F8"):
            fmt, kind, bits = "float-quantized", "float", 8
        else:
            return None, [f"weight is {weight.dtype} beside a weight_scale: not a quantized weight"]
    strategy, group_size, block = _strategy(scale.shape, rows, cols, hint)
    if strategy is None:
        return None, [f"weight_scale {list(scale.shape)} fits no strategy for a weight {list(source.shape)}"]
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
        or (stored.strategy == "group" and w.group_size != stored.group_size)
        or bool(w.symmetric) != stored.symmetric
    )
    if not differs:
        return []
    said = describe_scheme(coverage.scheme, coverage.format)
    return [f"stored as {stored.describe()}, but config group `{coverage.group}` says {said}"]


# ----------------------------------------------------------------------------------------------------------
# The independent decode
# ----------------------------------------------------------------------------------------------------------


Scratch = Callable[[str, tuple[int, ...], Any], np.ndarray]


def _fresh(slot: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


def unpack_codes(words: np.ndarray, bits: int, count: int, scratch: Scratch = _fresh) -> np.ndarray:
    """The first `count` b-bit codes of each row of 32-bit words packed densely, least significant bits first
    (code i occupies bits i·b … i·b + b − 1 of the row's little-endian bit stream), as uint8 (rows, count)."""
    rows = words.shape[0]
    if words.dtype not in (np.dtype("<i4"), np.dtype("<u4")):
        words = words.astype("<u4")
    little = np.ascontiguousarray(words).view(np.uint8).reshape(rows, -1)
    if bits == 4:
        # Two codes per byte, the low nibble first: the common case, done without a bit stream. Each byte b
        # is spread over a little-endian 16-bit word as (b | b << 4) & 0x0F0F, whose two bytes are then the
        # low and the high nibble, in order: contiguous passes instead of interleaved writes.
        spread = scratch("codes", little.shape, "<u2")
        spread[...] = little
        wide = scratch("codes-shifted", little.shape, "<u2")
        np.left_shift(spread, 4, out=wide)
        np.bitwise_or(spread, wide, out=spread)
        np.bitwise_and(spread, 0x0F0F, out=spread)
        return spread.view(np.uint8).reshape(rows, -1)[:, :count]
    if bits == 8:
        return little[:, :count]
    stream = np.unpackbits(little, axis=1, bitorder="little")[:, : count * bits]
    weights = (1 << np.arange(bits, dtype=np.uint16)).astype(np.uint16)
    return (stream.reshape(rows, count, bits).astype(np.uint16) @ weights).astype(np.uint8)


def unpack_offset_binary(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The signed values q of `unpack_codes`: each code minus 2^(b−1) (offset binary), as int16."""
    return unpack_codes(words, bits, count).astype(np.int16) - np.int16(1 << (bits - 1))


def round_to_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to nearest-even in `dtype` (BF16, F16 or F32), as the raw bits of that dtype."""
    if dtype == "BF16":
        return (rounded_to(values.copy(), "BF16").view(np.uint32) >> 16).astype(np.uint16)
    return (
        rounded_to(values.copy(), dtype).astype(NUMPY_DTYPES[dtype]).view(f"<u{2 if dtype == 'F16' else 4}")
    )


def rounded_to(
    values: np.ndarray, dtype: str, may_hold_nan: bool = True, scratch: Scratch = _fresh
) -> np.ndarray:
    """float32 values rounded in place to nearest-even in `dtype` (BF16, F16 or F32) and kept as float32,
    which holds every bf16 and fp16 value exactly. A NaN stays a (quiet) NaN; `may_hold_nan=False` skips the
    pass that sees to it."""
    if dtype == "F32":
        return values
    if dtype == "F16":
        values[...] = values.astype(np.float16)
        return values
    if dtype != "BF16":
        raise ValueError(f"no rounding to {dtype}")
    nan = np.isnan(values) if may_hold_nan else None
    u = values.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit, then clearing the low 16 bits, rounds half to even.
    lowest_kept = scratch("round", values.shape, np.uint32)
    np.right_shift(u, 16, out=lowest_kept)
    np.bitwise_and(lowest_kept, 1, out=lowest_kept)
    np.add(u, lowest_kept, out=u)
    np.add(u, 0x7FFF, out=u)
    np.bitwise_and(u, 0xFFFF0000, out=u)
    if nan is not None and nan.any():
        u[nan] = 0x7FC00000
    return values


def _expand(values: np.ndarray, stored: StoredQuantization, rows: int, cols: int, g_idx: Any) -> np.ndarray:
    """Per-row scales or zero points broadcastable against a (rows, cols) block."""
    s = values.reshape(-1, values.shape[-1] if values.ndim else 1)
    if stored.strategy == "tensor":
        return s.reshape(1, 1)
    if stored.strategy == "channel":
        return s
    if stored.strategy == "group":
        if g_idx is None:
            return np.repeat(s, stored.group_size, axis=1)
        return s[:, g_idx]
    bh, bw = stored.block
    return np.repeat(np.repeat(s, bh, axis=0), bw, axis=1)[:rows, :cols]


def reference_decode(
    stored: StoredQuantization,
    weight: np.ndarray,
    scale: np.ndarray,
    scale_dtype: str,
    cols: int,
    zero_point: np.ndarray | None = None,
    g_idx: np.ndarray | None = None,
    scratch: Scratch = _fresh,
) -> np.ndarray:
    """Rows of a weight decoded by evalsuite: (q − zero_point) × scale in float32, exact for integer q and a
    16-bit scale, then rounded once to the scale's dtype; returns those values as float32 (exact).

    `weight` holds the stored rows (int32 words for pack-quantized, int8 otherwise), `scale` the matching
    scale rows as float32, `zero_point` the zero points (q units) in the scale's layout, `g_idx` the group of
    each input column when the weight was quantized in activation order.
    """
    rows = weight.shape[0]
    q = scratch("q", (rows, cols), np.float32)
    if stored.format == "pack-quantized":
        codes = unpack_codes(weight, stored.num_bits, cols, scratch)
        np.subtract(codes, np.float32(1 << (stored.num_bits - 1)), out=q)
    else:
        q[...] = weight
    if zero_point is not None:
        q -= _expand(zero_point.astype(np.float32), stored, rows, cols, g_idx)
    if stored.strategy == "group" and g_idx is None:
        groups = q.reshape(rows, -1, stored.group_size)  # in place: no per-element scale array
        np.multiply(groups, scale.reshape(rows, -1, 1), out=groups)
    else:
        np.multiply(q, _expand(scale, stored, rows, cols, g_idx), out=q)
    # Integer q times a finite scale is finite: only a non-finite scale can make a NaN.
    finite = np.isfinite(scale).all() and (zero_point is None or np.isfinite(zero_point).all())
    return rounded_to(q, scale_dtype, may_hold_nan=not finite, scratch=scratch)


def first_difference(ours: np.ndarray, theirs: np.ndarray) -> tuple[int, int] | None:
    """Where two decoded blocks (float32 holding values of the scale's dtype) first differ in their bits.

    Widening to float32 is one-to-one, so equal float32 bits are equal bits in the scale's dtype. Two NaNs
    agree: their bits vary between torch's kernels, and a NaN scale fails the error checks anyway.
    """
    a, b = ours.view(np.uint32), theirs.view(np.uint32)
    if np.array_equal(a, b):
        return None
    differ = (a != b) & ~(np.isnan(ours) & np.isnan(theirs))
    return (int(differ.argmax() // a.shape[-1]), int(differ.argmax() % a.shape[-1])) if differ.any() else None


# ----------------------------------------------------------------------------------------------------------
# The handler
# ----------------------------------------------------------------------------------------------------------


def _torch_view(array: np.ndarray, dtype: str) -> Any:
    """A torch tensor sharing the memory of a stored array (bf16 from its raw bits)."""
    import torch

    if dtype == "BF16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
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


class CompressedTensors:
    """The format handler of compressed-tensors checkpoints (see `evalsuite.formats.FormatHandler`)."""

    name = "compressed-tensors"
    params = PARAMS
    marks = MARKS

    def __init__(self, candidate: Checkpoint) -> None:
        self.lookup = SchemeLookup(candidate.quantization_config or {}, candidate.path / "config.json")

    def measure(
        self, source: TensorInfo, tensors: dict[str, TensorInfo], reader: ShardReader, row: dict[str, Any]
    ) -> list[Problem]:
        """Read the module's scheme, decode it both ways block by block, and measure it against the source."""
        coverage = self.lookup.covering(row["module"], row["kind"])
        row["group"] = coverage.group
        hint = coverage.scheme.weights if coverage.scheme is not None else None
        stored, problems = stored_quantization(source, tensors, hint, reader)
        found = [Problem("config", source.name, p) for p in problems]
        if stored is None:
            row["format"] = "unreadable"
            return found
        row.update(
            format=stored.format,
            bits=stored.num_bits,
            bits_per_weight=stored.num_bits,
            strategy=stored.strategy,
            group_size=stored.group_size,
            symmetric=stored.symmetric,
        )
        if stored.format not in DECODED_FORMATS:
            row["note"] = f"{stored.format} is not decoded here"
            return found
        mismatch = self._decode(source, tensors, stored, reader, row)
        if mismatch:
            found.append(Problem("decode", source.name, mismatch))
        return found

    def _decode(
        self,
        source: TensorInfo,
        tensors: dict[str, TensorInfo],
        stored: StoredQuantization,
        reader: ShardReader,
        row: dict[str, Any],
    ) -> str | None:
        import torch
        from compressed_tensors.compressors import BaseCompressor

        rows, cols = rows_and_cols(source.shape)
        weight = tensors.get("weight_packed") or tensors["weight"]
        scale_info = tensors["weight_scale"]
        scale = reader.tensor(scale_info)
        scale = scale.reshape(rows_and_cols(scale.shape))
        scale32 = as_float32(scale, scale_info.dtype)
        zp_info, g_info = tensors.get("weight_zero_point"), tensors.get("weight_g_idx")
        zp = reader.tensor(zp_info) if zp_info is not None else None
        zp = zp.reshape(rows_and_cols(zp.shape)) if zp is not None else None
        g_idx = reader.tensor(g_info).astype(np.int64).reshape(-1) if g_info is not None else None
        compressor = BaseCompressor.get_value_from_registry(stored.format)
        scheme = stored.scheme()
        packed_zp = zp is not None and stored.format == "pack-quantized"
        # Blocks of rows must start where scales (and zero points packed along rows) start.
        align = stored.block[0] if stored.block else 32 if packed_zp else 1
        errors, mismatch = ErrorAccumulator(), None
        for r0, r1 in row_blocks(rows, cols, align):
            block = reader.rows(weight, r0, r1, "weight")
            s0, s1 = (0, 1) if stored.strategy == "tensor" else (r0, r1)
            if stored.block:
                s0, s1 = r0 // stored.block[0], math.ceil(r1 / stored.block[0])
            theirs_in = {"weight_scale": _torch_view(scale[s0:s1], scale_info.dtype)}
            ours_zp = None
            if zp is not None:
                if packed_zp:
                    bits = stored.num_bits
                    words = zp[r0 * bits // 32 : math.ceil(r1 * bits / 32)]
                    theirs_in["weight_zero_point"] = torch.from_numpy(np.ascontiguousarray(words))
                    ours_zp = unpack_offset_binary(words.T, bits, r1 - r0).T
                else:
                    theirs_in["weight_zero_point"] = torch.from_numpy(np.ascontiguousarray(zp[s0:s1]))
                    ours_zp = zp[s0:s1]
            if stored.format == "pack-quantized":
                theirs_in["weight_packed"] = torch.from_numpy(block)
                theirs_in["weight_shape"] = torch.tensor([r1 - r0, cols])
            else:
                theirs_in["weight"] = torch.from_numpy(block)
            theirs = _bits_view(compressor.decompress(theirs_in, scheme)["weight"].reshape(r1 - r0, cols))
            shape = (r1 - r0, cols)
            decoded = _float32_of_bits(theirs, scale_info.dtype, reader.scratch("decoded", shape, np.float32))
            ours = reference_decode(
                stored, block, scale32[s0:s1], scale_info.dtype, cols, ours_zp, g_idx, reader.scratch
            )
            if mismatch is None and (at := first_difference(ours, decoded)) is not None:
                index = [int(i) for i in np.unravel_index((r0 + at[0]) * cols + at[1], source.shape)]
                a, b = decoded[at[0], at[1]], ours[at[0], at[1]]
                mismatch = (
                    f"compressed-tensors and evalsuite decode element {index} differently: {a:.6g} vs {b:.6g}"
                )
            ref = reader.scratch("ref", shape, np.float32)
            as_float32(reader.rows(source, r0, r1, "source"), source.dtype, ref)
            errors.add(r0, ref, decoded, reader.scratch("difference", shape, np.float32))
        row["decode_exact"] = mismatch is None
        errors.fill(row)
        if mismatch and g_idx is not None:
            mismatch += " (the weight stores weight_g_idx, which the decompressor does not apply)"
        return mismatch

    def check_config(self, rows: list[dict[str, Any]]) -> tuple[list[Problem], dict[str, Any]]:
        """Every module a group targets is stored in its format, bits and strategy; every module in `ignore`
        is stored as in the source; no Linear is left unquantized without being ignored; every target matches
        some module."""
        problems: list[Problem] = []
        modules: dict[str, ModuleKind] = {}
        for row in rows:
            if row["tensor_class"] == "unexpected" or not row["name"].endswith(".weight"):
                continue
            modules[row["module"]] = row["kind"]
            if row["tensor_class"] == "missing" or row["format"] == "unreadable":
                continue  # already a problem of its own
            coverage = self.lookup.covering(row["module"], row["kind"])
            ct_quantized = row["tensor_class"] == "quantized" and row["strategy"] is not None
            quantized = row["tensor_class"] == "quantized"
            stored = f"stored as {row['format']}" if quantized else "stored unquantized"
            if coverage.scheme is not None and not ct_quantized:
                said = describe_scheme(coverage.scheme, coverage.format)
                problems.append(
                    Problem(
                        "config",
                        row["name"],
                        f"config group `{coverage.group}` says {said}, but it is {stored} ({row['dtype']})",
                    )
                )
            elif coverage.scheme is not None:
                stored_q = StoredQuantization(
                    row["format"],
                    "float" if row["format"] == "float-quantized" else "int",
                    row["bits"],
                    row["strategy"],
                    row.get("group_size"),
                    None,
                    row["symmetric"],
                    False,
                )
                problems += [Problem("config", row["name"], p) for p in scheme_mismatches(stored_q, coverage)]
            elif row["tensor_class"] == "quantized":
                why = "it is in `ignore`" if coverage.ignored else "no config group targets it"
                problems.append(Problem("config", row["name"], f"{stored}, but {why}"))
            elif row["kind"] == "linear" and not coverage.ignored and row["tensor_class"] == "protected":
                problems.append(Problem("config", row["name"], UNCOVERED_LINEAR))
        for group, target in self.lookup.unmatched_targets(modules):
            problems.append(
                Problem("config", f"config_groups.{group}", f"target {target!r} matches no source module")
            )
        config = self.lookup.config
        claims = {"config_format": config.format, "config_groups": len(config.config_groups)}
        return problems, claims
