"""Quantized checkpoint formats on disk: the shard reader every format reads its tensors with, and what a
quantized format provides.

A format module (`compressed_tensors`, `exl3`) knows what a quantized module stores in place of its source
weight, how its scheme and bits are read from the stored tensors and the config, and how it decodes
(`ct_decode` is the independent compressed-tensors decoder). Verifying a candidate against its source is
the `tensors` task's business (`evalsuite.tasks.tensors._verification`), not a format's. This module imports
none of its submodules: they import it.

Memory is bounded by a block of rows, not by the tensor: every tensor is read in row blocks from its shard,
into buffers that are reused, so the largest tensor of the checkpoint never has to fit in memory at once.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal, Protocol

import numpy as np

from evalsuite.files.checkpoint import TensorInfo
from evalsuite.files.identity import check_unchanged

ModuleKind = Literal["linear", "embedding", "router", "state", "norm", "other"]
Part = Literal["text", "head", "vision", "mtp"]

# Elements per block of rows: 1 MB per float32 array keeps a block's arithmetic in a core's L2 cache (measured
# fastest among 2^16..2^20), and float32 sums over blocks this size are accurate to about 1e-6.
BLOCK_ELEMENTS = 1 << 18
# Bytes per block when a protected tensor is compared and hashed.
BLOCK_BYTES = 16 << 20

# How stored bytes are viewed: bf16 has no numpy dtype, so its raw 16 bits are kept and widened by hand.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
    # FP8 has no numpy dtype either: its raw byte is kept and widened through `FP8_E4M3_VALUES`.
    "F8_E4M3": np.dtype(np.uint8),
}


def _fp8_e4m3_values() -> np.ndarray:
    """Every FP8 E4M3 (the OCP "fn" variant) byte as float32, from the definition: 1 sign bit, 4 exponent
    bits of bias 7, 3 mantissa bits, subnormals at exponent 0, no infinities, S.1111.111 NaN."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    magnitude = np.where(
        exponent == 0, mantissa / 8.0 * 2.0**-6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0)
    )
    values = np.where(codes & 0x80, -magnitude, magnitude).astype(np.float32)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values


# FP8 E4M3 byte → its value (float32 holds each exactly).
FP8_E4M3_VALUES = _fp8_e4m3_values()


class QuantizedFormat(Protocol):
    """What a quantized format stores for a module `X` in place of the source's `X.weight`: tensors named
    `X.<param>`, with `param` one of `params`; a module storing any of `marks` is quantized in this format."""

    name: str
    params: frozenset[str]
    marks: frozenset[str]

    def split(self, name: str) -> tuple[str, str] | None:
        """A stored tensor's name as (module, param); None where it is none of the format's
        (`split_at_last_dot` for every format whose params follow the module's name after a dot)."""
        ...


def split_at_last_dot(name: str) -> tuple[str, str] | None:
    """`X.param` as (`X`, `param`): how most formats name what a module stores."""
    module, _, param = name.rpartition(".")
    return module, param


class ShardReader:
    """Byte ranges of tensors read from their shards, one open file per shard, into reused buffers.

    Offsets come from headers that `Checkpoint` parsed and checked, so every range lies inside its file.
    """

    def __init__(self) -> None:
        self._files: dict[Path, BinaryIO] = {}
        self._buffers: dict[str, np.ndarray] = {}

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def _read(self, info: TensorInfo, begin: int, out: np.ndarray) -> np.ndarray:
        handle = self._files.get(info.shard)
        if handle is None:
            handle = self._files[info.shard] = info.shard.open("rb", buffering=0)
            if info.identity is not None:  # the file whose header gave these offsets, or none
                check_unchanged(info.shard, info.identity, os.fstat(handle.fileno()))
        handle.seek(info.data_begin + begin)
        view = memoryview(out).cast("B")
        done = 0
        while done < len(view):
            got = handle.readinto(view[done:])
            if not got:
                if info.identity is not None:
                    check_unchanged(info.shard, info.identity, os.fstat(handle.fileno()))
                raise EOFError(f"{info.shard}: tensor {info.name!r} ends past the end of the file")
            done += got
        return out

    def buffer(self, slot: str, nbytes: int) -> np.ndarray:
        """A reused uint8 buffer of `nbytes` (valid until the next call for the same slot).

        Reuse is what makes block arithmetic cheap: a fresh multi-megabyte array costs more in page faults
        than the arithmetic done in it.
        """
        buf = self._buffers.get(slot)
        if buf is None or buf.size < nbytes:
            buf = self._buffers[slot] = np.empty(max(nbytes, 1 << 16), dtype=np.uint8)
        return buf[:nbytes]

    def scratch(self, slot: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A reused array of `shape` and `dtype` (contents undefined; valid until the slot's next use)."""
        dtype = np.dtype(dtype)
        # math.prod, not np.prod: this runs several times per block, where numpy's call overhead shows.
        return self.buffer(slot, math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)

    def tensor_bytes(self, info: TensorInfo, begin: int, n: int) -> np.ndarray:
        """`n` bytes of the tensor's data from `begin` (a new array)."""
        return self._read(info, begin, np.empty(n, dtype=np.uint8))

    def tensor(self, info: TensorInfo) -> np.ndarray:
        """A whole tensor as a (new) array of its dtype; for the small tensors beside a weight."""
        out = np.empty(info.nbytes, dtype=np.uint8)
        return self._read(info, 0, out).view(NUMPY_DTYPES[info.dtype]).reshape(info.shape)

    def rows(self, info: TensorInfo, r0: int, r1: int, slot: str) -> np.ndarray:
        """Rows r0..r1 of the tensor seen as 2-D (leading dims flattened), in a reused buffer."""
        cols = info.shape[-1] if info.shape else 1
        itemsize = NUMPY_DTYPES[info.dtype].itemsize
        row_bytes = cols * itemsize
        out = self.buffer(slot, (r1 - r0) * row_bytes)
        self._read(info, r0 * row_bytes, out)
        return out.view(NUMPY_DTYPES[info.dtype]).reshape(r1 - r0, cols)

    def blocks(self, info: TensorInfo, slot: str, block_bytes: int = BLOCK_BYTES) -> Iterator[np.ndarray]:
        """The tensor's bytes in successive blocks (uint8), each valid until the next."""
        for begin in range(0, info.nbytes, block_bytes):
            n = min(block_bytes, info.nbytes - begin)
            yield self._read(info, begin, self.buffer(slot, n))


def rows_and_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    """A tensor seen as a matrix: leading dims flattened into rows (a scalar is one row of one)."""
    if not shape:
        return 1, 1
    cols = shape[-1]
    return math.prod(shape[:-1]), cols


def row_blocks(rows: int, cols: int, align: int = 1) -> Iterator[tuple[int, int]]:
    """(r0, r1) blocks of about `BLOCK_ELEMENTS` elements, each a multiple of `align` rows but the last."""
    step = max(align, (BLOCK_ELEMENTS // max(cols, 1)) // align * align)
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


def as_float32(values: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """Stored floating-point values as float32 (into `out` when given); bf16, kept as its raw uint16 bits,
    is widened exactly by a shift, FP8 (its raw byte) by a table."""
    if out is None:
        out = np.empty(values.shape, dtype=np.float32)
    if dtype == "BF16" and values.flags.writeable and values.dtype.itemsize == 2:
        import torch

        # torch's widening cast, about half the time of numpy's shift through a uint16 → uint32 cast loop.
        torch.from_numpy(out).copy_(torch.from_numpy(values.view(np.int16)).view(torch.bfloat16))
    elif dtype == "BF16":
        np.left_shift(values, 16, out=out.view(np.uint32), dtype=np.uint32)
    elif dtype == "F8_E4M3":
        np.take(FP8_E4M3_VALUES, values, out=out)
    else:
        out[...] = values
    return out


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch limited to one intra-op thread inside the block, restored when the last block open leaves.

    For work cut into small blocks (decoding a Linear block by block, one Linear per worker thread): a second
    OpenMP thread adds a barrier to every operation, which costs milliseconds whenever the other core is busy,
    far more than it saves, and would fight the worker threads for the cores. One thread also makes a decode's
    float results the same on every machine size. The thread count is process-wide, so blocks open in two
    threads at once are counted: the first in saves the caller's count, the last out restores it (a plain
    save and restore in each would leave the process at one thread when the two interleave)."""
    import torch

    with _ONE_THREAD_LOCK:
        if _ONE_THREAD["open"] == 0:
            _ONE_THREAD["before"] = torch.get_num_threads()
            torch.set_num_threads(1)
        _ONE_THREAD["open"] += 1
    try:
        yield
    finally:
        with _ONE_THREAD_LOCK:
            _ONE_THREAD["open"] -= 1
            if _ONE_THREAD["open"] == 0:
                torch.set_num_threads(_ONE_THREAD["before"])


# How many `one_torch_thread` blocks are open in the process, and the thread count the first one found.
_ONE_THREAD_LOCK = threading.Lock()
_ONE_THREAD = {"open": 0, "before": 0}
