"""The independent decoder of compressed-tensors weights, written here from the format's definition.

The `tensors` task measures every `pack-quantized` / `int-quantized` / `float-quantized` /
`nvfp4-pack-quantized` weight as this module decodes it, without compressed-tensors' code, and
compressed-tensors' decompressor decodes rows of it again, which must agree bit for bit. So it follows the
format's definition, never the library: `pack-quantized` stores q + 2^(b−1) ("offset binary") densely in
int32 words, least significant bits first; `int-quantized` stores q as int8 (int4 values too);
`float-quantized` FP8 E4M3 bytes; NVFP4 two E2M1 codes per byte, low nibble first, with FP8 group scales
divided by a float32 global scale. Either way the weight is (q − zero_point) × scale, rounded once (to nearest
even) to the dtype the library decodes to. Codes become values by table lookup, one per byte (two 4-bit codes
at once), which keeps this decode near the cost of reading the files. What the stored tensors hold (strategy,
group size, bits) comes from `compressed_tensors.StoredQuantization`, read from their shapes.
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


def _pair_table(values: np.ndarray) -> np.ndarray:
    """Byte → the values of its two 4-bit codes, the low nibble's first, as one uint64 per byte holding two
    float32: one table lookup per byte then writes two decoded weights in their order."""
    codes = np.arange(256)
    pairs = np.stack((values[codes & 0x0F], values[codes >> 4]), axis=-1).astype(np.float32)
    return np.ascontiguousarray(pairs).view("<u8").reshape(256)


# Offset-binary INT4 (q = code − 8) and FP4 E2M1 code pairs, by byte.
INT4_PAIRS = _pair_table(np.arange(16, dtype=np.float32) - 8)
FP4_PAIRS = _pair_table(FP4_E2M1_VALUES)
# Offset-binary INT8 (q = byte − 128), as pack-quantized stores 8-bit codes.
INT8_OFFSET = np.arange(256, dtype=np.float32) - 128


def _codes_by_byte(pairs: np.ndarray, codes: np.ndarray, cols: int, q: np.ndarray, scratch: Scratch) -> None:
    """q = the values of the 4-bit codes stored two per byte (rows of `codes`, uint8), low nibble first;
    a row's padding codes past `cols` are dropped."""
    rows = codes.shape[0]
    if codes.shape[1] * 2 == cols:
        # mode="clip": a uint8 index never leaves a 256-entry table, and numpy skips its bounds pass.
        np.take(pairs, codes, out=q.view("<u8"), mode="clip")
        return
    wide = scratch("codes", codes.shape, "<u8")
    np.take(pairs, codes, out=wide, mode="clip")
    q[...] = wide.view(np.float32).reshape(rows, -1)[:, :cols]


def code_values(
    stored: StoredQuantization, weight: np.ndarray, cols: int, scratch: Scratch = _fresh
) -> np.ndarray:
    """The stored values before scaling (q, the codes' values in q units: integers, FP8 or FP4 values) of
    rows of a weight as stored, as float32 (rows, cols) in the scratch slot "q"."""
    rows = weight.shape[0]
    q = scratch("q", (rows, cols), np.float32)
    if stored.format == "pack-quantized" and stored.num_bits in (4, 8):
        little = np.ascontiguousarray(weight).astype("<i4", copy=False).view(np.uint8).reshape(rows, -1)
        if stored.num_bits == 4:
            _codes_by_byte(INT4_PAIRS, little, cols, q, scratch)
        else:
            np.take(INT8_OFFSET, little[:, :cols], out=q, mode="clip")
    elif stored.format == "pack-quantized":
        codes = unpack_codes(weight, stored.num_bits, cols, scratch)
        np.subtract(codes, np.float32(1 << (stored.num_bits - 1)), out=q)
    elif stored.format in FP4_GROUP_SIZES:
        _codes_by_byte(FP4_PAIRS, np.ascontiguousarray(weight), cols, q, scratch)
    elif stored.format == "float-quantized":
        np.take(FP8_E4M3_VALUES, weight, out=q, mode="clip")
    else:
        q[...] = weight
    return q


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

    Where a byte-coded weight has one scale per row, per group of at least `TABLE_MIN_BYTES` stored bytes, or
    per tensor, the formula is evaluated once per (scale, code) and the weights are looked up in that table
    (`_decode_by_table`): the same float32 operations on the same operands, so the same bits.
    """
    if global_scale is not None:
        scale = scale / np.float32(global_scale)
    decoded = _decode_by_table(stored, weight, scale, scale_dtype, cols, zero_point, g_idx, scratch)
    if decoded is not None:
        return decoded
    rows = weight.shape[0]
    q = code_values(stored, weight, cols, scratch)
    if zero_point is not None:
        q -= _expand(zero_point.astype(np.float32), stored, rows, cols, g_idx)
    if stored.strategy in ("group", "tensor_group") and g_idx is None and cols % stored.group_size == 0:
        groups = q.reshape(rows, -1, stored.group_size)  # in place: no per-element scale array
        np.multiply(groups, scale.reshape(rows, -1, 1), out=groups)
    else:
        np.multiply(q, _expand(scale, stored, rows, cols, g_idx), out=q)
    return rounded_to(q, scale_dtype, scratch)


# A table of 256 entries (codes or code pairs) per scale pays when a scale covers at least this many stored
# bytes: building an entry costs about what decoding a weight by the formula does.
TABLE_MIN_BYTES = 256
# Offset-binary INT4 (q = code − 8), one 4-bit code.
INT4_OFFSET = np.arange(16, dtype=np.float32) - 8


def _byte_codes(
    stored: StoredQuantization, weight: np.ndarray, cols: int
) -> tuple[np.ndarray, np.ndarray, bool] | None:
    """A weight's rows as bytes (rows, stored bytes per row), the value of each code, and whether a byte holds
    two 4-bit codes (low nibble first); None where codes are not whole bytes or nibble pairs of whole rows,
    and for int-quantized: its int8 codes become values by a cast, which with the scale multiply and the
    rounding costs less than a gather (measured: 0.28 ms against 0.41 ms per 2^18 weights)."""
    rows = weight.shape[0]
    if stored.format == "pack-quantized" and stored.num_bits in (4, 8):
        little = np.ascontiguousarray(weight).astype("<i4", copy=False).view(np.uint8).reshape(rows, -1)
        if stored.num_bits == 8:
            return little[:, :cols], INT8_OFFSET, False
        return (little, INT4_OFFSET, True) if little.shape[1] * 2 == cols else None
    if stored.format in FP4_GROUP_SIZES:
        codes = np.ascontiguousarray(weight)
        return (codes, FP4_E2M1_VALUES, True) if codes.shape[1] * 2 == cols else None
    if weight.dtype.itemsize != 1:
        return None
    if stored.format == "float-quantized":
        return weight.view(np.uint8), FP8_E4M3_VALUES, False
    return None


def _decode_by_table(
    stored: StoredQuantization,
    weight: np.ndarray,
    scale: np.ndarray,
    scale_dtype: str,
    cols: int,
    zero_point: np.ndarray | None,
    g_idx: np.ndarray | None,
    scratch: Scratch,
) -> np.ndarray | None:
    """`reference_decode` by lookup: table[u, code] = round((value(code) − zero_point[u]) × scale[u]) for each
    scale u (a row's, a group's or the tensor's), then one gather of every weight; None where the scales
    are not of such a layout or cover too few bytes for a table to pay."""
    rows = weight.shape[0]
    found = _byte_codes(stored, weight, cols)
    if found is None or rows == 0 or cols == 0 or g_idx is not None:
        return None
    codes, values, pairs = found
    per_row = codes.shape[1]
    if stored.strategy == "tensor":
        groups, units = 1, 1
    elif stored.strategy == "channel":
        groups, units = 1, rows
    elif stored.strategy in ("group", "tensor_group") and cols % stored.group_size == 0:
        groups, units = cols // stored.group_size, rows * (cols // stored.group_size)
        if per_row % groups or (pairs and stored.group_size % 2):
            return None
    else:
        return None
    if units > 1 and per_row // groups < TABLE_MIN_BYTES:
        return None
    scale = np.ascontiguousarray(scale, dtype=np.float32)
    # One table per distinct (scale, zero point): a tensor's bf16 scales take a few hundred values, so rows
    # share tables and building them costs far less than the gather.
    key = scale.reshape(units).view(np.uint32).astype(np.uint64)
    if zero_point is not None:
        zero = zero_point.astype(np.float32).reshape(units)
        key = key << np.uint64(32) | zero.view(np.uint32)
    key, first, which = np.unique(key, return_index=True, return_inverse=True)
    q = np.broadcast_to(values, (key.size, values.size))
    if zero_point is not None:
        q = q - zero[first].reshape(-1, 1)
    table = rounded_to(np.multiply(q, scale.reshape(units)[first].reshape(-1, 1)), scale_dtype)
    if pairs:
        # Byte hi·16 + lo → its two weights (lo's, then hi's) as one 8-byte entry: the gather writes both.
        both = np.empty((key.size, 16, 16, 2), dtype=np.float32)
        both[..., 0] = table[:, None, :]
        both[..., 1] = table[:, :, None]
        table = both.view(np.int64)
    import torch

    index = torch.from_numpy(scratch("table-index", codes.shape, np.int32))
    index.copy_(torch.from_numpy(codes))
    offsets = torch.from_numpy((which.astype(np.int32) * 256).reshape(-1, groups, 1))
    index.view(rows, groups, -1).add_(offsets)
    out = scratch("q", (rows, cols), np.float32)
    # torch's index_select takes int32 indices; numpy's take widens every index to int64 first.
    torch.index_select(
        torch.from_numpy(table.reshape(-1)),
        0,
        index.view(-1),
        out=torch.from_numpy(out.view(np.int64) if pairs else out).view(-1),
    )
    return out


def rounded_to(values: np.ndarray, dtype: str, scratch: Scratch = _fresh) -> np.ndarray:
    """float32 values rounded in place to nearest-even in `dtype` (BF16, F16 or F32) and kept as float32,
    which holds every bf16 and fp16 value exactly. A NaN stays a (quiet) NaN.

    Done by a cast there and back with torch (IEEE round to nearest even, as compressed-tensors' decode
    rounds too; the casts are torch's, not the library's): two vectorised passes, where rounding by the bits
    in numpy took five and a scan for NaNs."""
    if dtype == "F32":
        return values
    if dtype not in ("BF16", "F16"):
        raise ValueError(f"no rounding to {dtype}")
    import torch

    narrow = torch.from_numpy(scratch("rounded", values.shape, np.float16 if dtype == "F16" else np.int16))
    narrow = narrow if dtype == "F16" else narrow.view(torch.bfloat16)
    wide = torch.from_numpy(values)
    narrow.copy_(wide)
    wide.copy_(narrow)
    return values


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
