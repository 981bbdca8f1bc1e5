"""A source tensor the candidate keeps under its own name: protected (its bytes must be identical) or cast to
another floating-point dtype (measured like a decode). Also the files a quantizer must carry over unchanged:
the tokenizer's and the processor's."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

from evalsuite.files.checkpoint import DTYPE_SIZES, FLOAT_DTYPES, TensorInfo
from evalsuite.formats import NUMPY_DTYPES, ShardReader, as_float32, row_blocks, rows_and_cols
from evalsuite.tasks.tensors._verification._rows import ErrorAccumulator, Problem, TensorRow

# Floating-point dtypes a tensor may be cast between, by their bits.
DTYPE_BITS = {"BF16": 16, "F16": 16, "F32": 32, "F64": 64}


def _value_text(raw: np.ndarray, dtype: str) -> str:
    """One stored element (its raw bytes, uint8) as a number, with its bits for floating-point dtypes (only
    the bits for a dtype numpy cannot read, e.g. FP8)."""
    bits = f"0x{int.from_bytes(raw.tobytes(), 'little'):0{2 * raw.size}x}"
    if dtype not in NUMPY_DTYPES:
        return bits
    value = raw.view(NUMPY_DTYPES[dtype])[:1]
    if dtype in FLOAT_DTYPES:
        return f"{float(as_float32(value, dtype)[0]):.6g} ({bits})"
    return str(value[0].item())


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Two uint8 blocks of one size hold the same bytes: compared 8 bytes at a time, a quarter of the passes
    of a byte-wise comparison, which costs as much as hashing the block."""
    whole = a.size // 8 * 8
    return np.array_equal(a[:whole].view(np.uint64), b[:whole].view(np.uint64)) and np.array_equal(
        a[whole:], b[whole:]
    )


def compare_same(
    source: TensorInfo,
    candidate: TensorInfo,
    reader: ShardReader,
    row: TensorRow,
    protected_casts: Mapping[tuple[str, str], str] | None = None,
) -> list[Problem]:
    """A tensor kept under its name: protected when dtype and shape are kept (its bytes must be identical),
    a cast when only a floating-point dtype changed (measured like a decode, classed as quantized).

    `protected_casts` maps (source dtype, candidate dtype) to why the format stores a tensor so: such a cast
    is protected too, and its values must equal the source's cast to the candidate's dtype (exllamav3 stores
    the Linears it leaves unquantized as FP16)."""
    why = (protected_casts or {}).get((source.dtype, candidate.dtype))
    if why is not None and source.shape == candidate.shape:
        return _compare_cast(source, candidate, reader, row, why)
    if source.shape != candidate.shape or source.dtype != candidate.dtype:
        if source.shape == candidate.shape and {source.dtype, candidate.dtype} <= DTYPE_BITS.keys():
            bits = DTYPE_BITS[candidate.dtype]
            row.tensor_class, row.format = "quantized", candidate.dtype.lower()
            row.bits = row.bits_per_weight = bits
            _measure_cast(source, candidate, reader, row)
            return []
        row.tensor_class, row.identical = "protected", False
        what = f"{source.dtype} {list(source.shape)} → {candidate.dtype} {list(candidate.shape)}"
        row.first_difference = what
        return [Problem("protected", source.name, f"stored as {what}")]
    row.tensor_class = "protected"
    src_hash, cand_hash = hashlib.sha256(), None
    offset, first = 0, None
    cand_blocks = reader.blocks(candidate, "same-candidate")
    for block in reader.blocks(source, "same-source"):
        other = next(cand_blocks)
        if cand_hash is None and not _same_bytes(block, other):
            # Up to here both sides held the same bytes: the candidate's digest starts from the source's.
            cand_hash = src_hash.copy()
            byte = int(np.flatnonzero(block != other)[0])
            first = offset + byte
        src_hash.update(block)
        if cand_hash is not None:
            cand_hash.update(other)
        offset += block.size
    row.sha256 = src_hash.hexdigest()
    row.identical = cand_hash is None
    if cand_hash is None:
        return []
    row.candidate_sha256 = cand_hash.hexdigest()
    itemsize = DTYPE_SIZES[source.dtype]
    element = first // itemsize
    index = [int(i) for i in np.unravel_index(element, source.shape)] if source.shape else []
    begin = element * itemsize
    values = [
        _value_text(reader.tensor_bytes(info, begin, itemsize), source.dtype) for info in (source, candidate)
    ]
    row.first_difference = f"element {index}: {values[0]} → {values[1]}"
    digests = f"sha256 {row.sha256[:12]}… → {row.candidate_sha256[:12]}…"
    detail = f"bytes differ ({digests}); first differing {row.first_difference}"
    return [Problem("protected", source.name, detail)]


def _measure_cast(source: TensorInfo, candidate: TensorInfo, reader: ShardReader, row: TensorRow) -> None:
    rows, cols = rows_and_cols(source.shape)
    errors = ErrorAccumulator()
    for r0, r1 in row_blocks(rows, cols):
        shape = (r1 - r0, cols)
        ref = as_float32(
            reader.rows(source, r0, r1, "source"), source.dtype, reader.scratch("ref", shape, "f4")
        )
        cand = reader.rows(candidate, r0, r1, "candidate")
        cand = as_float32(cand, candidate.dtype, reader.scratch("decoded", shape, "f4"))
        errors.add(r0, ref, cand, reader.scratch("difference", shape, "f4"))
    errors.fill(row)


def _compare_cast(
    source: TensorInfo, candidate: TensorInfo, reader: ShardReader, row: TensorRow, why: str
) -> list[Problem]:
    """A protected cast: every stored value equal to the source's value cast to the stored dtype (rounded to
    nearest, as torch casts), checked block by block; the first difference is named."""
    import torch

    rows, cols = rows_and_cols(source.shape)
    row.tensor_class, row.format = "protected", candidate.dtype.lower()
    row.note = why
    torch_dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[candidate.dtype]
    for r0, r1 in row_blocks(rows, cols):
        shape = (r1 - r0, cols)
        ref = as_float32(
            reader.rows(source, r0, r1, "source"), source.dtype, reader.scratch("ref", shape, "f4")
        )
        cast = torch.from_numpy(ref).to(torch_dtype).to(torch.float32).numpy()
        cand = as_float32(
            reader.rows(candidate, r0, r1, "candidate"),
            candidate.dtype,
            reader.scratch("decoded", shape, "f4"),
        )
        # NaN-aware and bitwise on values: a stored value equal to the cast is kept, whatever else.
        differ = np.flatnonzero((cast != cand) & ~(np.isnan(cast) & np.isnan(cand)))
        if differ.size:
            element = r0 * cols + int(differ[0])
            index = [int(i) for i in np.unravel_index(element, source.shape)] if source.shape else []
            flat = int(differ[0])
            row.identical = False
            row.first_difference = (
                f"element {index}: source {ref.reshape(-1)[flat]:.6g} cast to {candidate.dtype} is "
                f"{cast.reshape(-1)[flat]:.6g}, stored {cand.reshape(-1)[flat]:.6g}"
            )
            return [Problem("protected", source.name, f"{why}, but {row.first_difference}")]
    row.identical = True
    return []
