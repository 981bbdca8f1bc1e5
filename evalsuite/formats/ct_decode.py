"""The independent decoder of compressed-tensors weights, written here from the format's definition.

The `tensors` task's claim that a candidate decodes bit-exactly rests on this module: it decodes every
`pack-quantized` / `int-quantized` / `float-quantized` / `nvfp4-pack-quantized` weight a second time, without
compressed-tensors' code, and the two decodes must agree bit for bit. So it follows the format's definition,
never the library: `pack-quantized` stores q + 2^(b−1) ("offset binary") densely in int32 words, least
significant bits first; `int-quantized` stores q as int8 (int4 values too); `float-quantized` FP8 E4M3 bytes;
NVFP4 two E2M1 codes per byte, low nibble first, with FP8 group scales divided by a float32 global scale.
Either way the weight is (q − zero_point) × scale, rounded once (to nearest even) to the dtype the library
decodes to. What the stored tensors hold (strategy, group size, bits) comes from
`compressed_tensors.StoredQuantization`, read from their shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from evalsuite.formats import FP8_E4M3_VALUES, NUMPY_DTYPES
from evalsuite.formats.compressed_tensors import FP4_GROUP_SIZES, StoredQuantization

# FP4 E2M1 code → value, from the definition: sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_E2M1_VALUES = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32
)

# Where a decode takes its working arrays, by slot name: `ShardReader.scratch` reuses them from block to block
# (a fresh multi-megabyte array costs more in page faults than the decode done in it); by default, new ones.
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
    if stored.strategy in ("group", "tensor_group"):
        if g_idx is None:
            return np.repeat(s, stored.group_size, axis=1)[:, :cols]
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
    global_scale: float | None = None,
) -> np.ndarray:
    """Rows of a weight decoded by evalsuite: (q − zero_point) × scale in float32, exact for integer q and a
    16-bit scale, then rounded once to `scale_dtype` (the dtype the library decodes to: the scale's, bf16 for
    FP4); returns those values as float32 (exact).

    `weight` holds the stored rows (int32 words for pack-quantized, uint8 code pairs for FP4, FP8 bytes for
    float-quantized, int8 otherwise), `scale` the matching scale rows as float32, `zero_point` the zero points
    (q units) in the scale's layout, `g_idx` the group of each input column when the weight was quantized in
    activation order, `global_scale` NVFP4's: its group scales are divided by it in float32 first.
    """
    rows = weight.shape[0]
    q = scratch("q", (rows, cols), np.float32)
    if stored.format == "pack-quantized":
        codes = unpack_codes(weight, stored.num_bits, cols, scratch)
        np.subtract(codes, np.float32(1 << (stored.num_bits - 1)), out=q)
    elif stored.format in FP4_GROUP_SIZES:
        nibbles = np.stack((weight & 0x0F, weight >> 4), axis=-1).reshape(rows, -1)[:, :cols]
        np.take(FP4_E2M1_VALUES, nibbles, out=q)
    elif stored.format == "float-quantized":
        np.take(FP8_E4M3_VALUES, weight, out=q)
    else:
        q[...] = weight
    if global_scale is not None:
        scale = scale / np.float32(global_scale)
    if zero_point is not None:
        q -= _expand(zero_point.astype(np.float32), stored, rows, cols, g_idx)
    if stored.strategy == "group" and g_idx is None and cols % stored.group_size == 0:
        groups = q.reshape(rows, -1, stored.group_size)  # in place: no per-element scale array
        np.multiply(groups, scale.reshape(rows, -1, 1), out=groups)
    else:
        np.multiply(q, _expand(scale, stored, rows, cols, g_idx), out=q)
    # Integer (or FP4) q times a finite scale is finite: only a non-finite scale or FP8 code makes a NaN.
    finite = np.isfinite(scale).all() and (zero_point is None or np.isfinite(zero_point).all())
    finite = finite and (stored.format != "float-quantized" or bool(np.isfinite(q).all()))
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
