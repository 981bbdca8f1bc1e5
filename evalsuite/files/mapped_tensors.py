"""Tensors handed to Transformers' loader as private mappings of their shard's bytes: one mapping per shard,
shared by every tensor read from it, each tensor's pages handed back when the tensor is freed.

Why mapped: Transformers converts most of what it reads (a MoE layer's per-expert tensors fused into one, a
compressed-tensors module decompressed) and frees the read tensor at once. Read into memory of its own, every
such tensor costs a fresh allocation, a page fault per page and a copy; mapped, it costs pages already in the
page cache (bench/ppl.py measures the whole run on the real shape's wide pair). A tensor Transformers keeps as
it was read (an unconverted parameter in its stored dtype: embeddings, norms, a BF16 model's attention) stays
a mapping of the file, as llama.cpp's models run from theirs: its pages are read when the forward first
touches them, so the rows of a 248 k-token embedding that no window uses never count in resident memory.

Why one mapping per shard, not per tensor: a mapping per tensor costs a kernel mapping and, since Python's
`mmap` (before 3.13) duplicates the descriptor it maps, an open file each. A streamed layer of the seed's
shape stores thousands of tensors, past the 1,024 files most shells allow (macOS's 256 fell to the demo's
SmolLM2), and the seed's W4A8 pack holds 93,213, past Linux's default 65,530 mappings. A shard
mapped once holds one mapping and two descriptors (the one its lease is taken on, `evalsuite.files.leases`,
and mmap's duplicate) whatever its tensor count, and a shard still mapped (a kept tensor of an earlier
layer) is not mapped again.

What a mapping per tensor gave for free, that nothing outlives its tensor, is kept by handing pages back:
when the last tensor over a page is freed, the page is dropped from the mapping (`MADV_DONTNEED`), so that a
shard's pages count in resident memory only while a tensor of them lives, and a load peaks at its model and
the layer being converted, not at its model plus its files. The mapping itself goes with its last tensor.

The mapping is copy-on-write (`ACCESS_COPY`): nothing written to a tensor reaches the checkpoint. Its bytes
are the file's as it was opened: the shard's identity (`evalsuite.files.identity`) is checked when it is
mapped and at every read, and a run leases it (`evalsuite.files.leases`) so that a process about to change it
ends the run first.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from evalsuite.errors import DependencyError
from evalsuite.files import leases as file_leases
from evalsuite.files.identity import FileIdentity, check_unchanged
from evalsuite.files.safetensors_headers import TensorInfo

if TYPE_CHECKING:
    import torch

# safetensors' dtype names as torch dtypes, for the tensors mapped in their own storage.
_TORCH_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8", "I16": "int16",
    "I32": "int32", "I64": "int64", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64",
}  # fmt: skip

_PAGE = mmap.PAGESIZE
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


def check_little_endian() -> None:
    """Refuse a big-endian host: safetensors and GGUF store little-endian values, which evalsuite maps and
    reads as they are."""
    if sys.byteorder != "little":
        raise DependencyError(
            "this host is big-endian: evalsuite reads the little-endian bytes of safetensors and GGUF files "
            "as they are stored, so every weight would be read byte-swapped"
        )


class ShardMapping:
    """One shard's bytes mapped once, privately, for every tensor read from it (module docstring); build
    one with `mapped_shard`."""

    def __init__(self, shard: Path, identity: FileIdentity) -> None:
        self.shard, self.identity = shard, identity
        # Reentrant: a tensor freed while a lock is held (by a collection in the middle of `_acquire`) hands
        # its pages back in the same thread.
        self._lock = threading.RLock()
        # Live tensors' byte ranges (how many arrays over each), and the pages at the ends of those ranges
        # (how many live ranges end or begin in each): the pages a range may share with its neighbours.
        self._ranges: dict[tuple[int, int], int] = {}
        self._edge_pages: dict[int, int] = {}
        fd = os.open(shard, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            file_leases.hold(fd, shard)  # before the check: a change after it is a break the run hears of
            check_unchanged(shard, identity, os.fstat(fd))
            self._map = mmap.mmap(fd, identity.size, access=mmap.ACCESS_COPY) if identity.size else None
        except BaseException:
            file_leases.let_go(fd)
            os.close(fd)
            raise
        self._fd = fd
        weakref.finalize(self, _close, fd)

    def lease(self) -> None:
        """Take this shard's lease again where a run's watch began after it was mapped."""
        file_leases.hold(self._fd, self.shard)

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        """The tensor `info` describes, as a view of this shard's mapping, its pages handed back when it is
        freed."""
        import torch

        dtype = getattr(torch, _TORCH_DTYPES[info.dtype])
        # The file as mapped must still be the file opened: a shard cut short would turn a read into SIGBUS.
        check_unchanged(self.shard, self.identity, os.fstat(self._fd))
        if info.nbytes == 0 or self._map is None:
            return torch.empty(info.shape, dtype=dtype)
        array = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.data_begin)
        self._acquire(info.data_begin, info.data_end)
        # torch.from_numpy holds the array until the tensor's storage is freed: then its pages go.
        weakref.finalize(array, self._release, info.data_begin, info.data_end)
        return torch.from_numpy(array).view(dtype).view(info.shape)

    def _acquire(self, begin: int, end: int) -> None:
        with self._lock:
            self._ranges[begin, end] = self._ranges.get((begin, end), 0) + 1
            for page in {begin // _PAGE, (end - 1) // _PAGE}:
                self._edge_pages[page] = self._edge_pages.get(page, 0) + 1

    def _release(self, begin: int, end: int) -> None:
        first, last = begin // _PAGE, (end - 1) // _PAGE
        with self._lock:
            left = self._ranges.pop((begin, end)) - 1
            if left:
                self._ranges[begin, end] = left
            free = set()
            for page in {first, last}:
                count = self._edge_pages.pop(page) - 1
                if count:
                    self._edge_pages[page] = count
                else:
                    free.add(page)
            if left or self._map is None or _DONTNEED is None:
                return
            # Pages strictly inside the range are this tensor's alone; its end pages, once no live range
            # begins or ends in them.
            low = first if first in free else first + 1
            high = last + 1 if last in free else last
            if high > low:
                # Should the kernel refuse, the memory is kept a little longer: nothing wrong.
                with contextlib.suppress(OSError, ValueError):
                    self._map.madvise(_DONTNEED, low * _PAGE, (high - low) * _PAGE)


def _close(fd: int) -> None:
    file_leases.let_go(fd)
    os.close(fd)


_mapped_lock = threading.Lock()
_mapped: weakref.WeakValueDictionary[tuple[Path, FileIdentity], ShardMapping] = weakref.WeakValueDictionary()


def mapped_shard(shard: Path, identity: FileIdentity) -> ShardMapping:
    """The shard's mapping: the one still alive (a kept tensor holds it), else a new one."""
    check_little_endian()
    with _mapped_lock:
        mapping = _mapped.get((shard, identity))
        if mapping is None:
            mapping = _mapped[shard, identity] = ShardMapping(shard, identity)
        else:
            mapping.lease()
        return mapping


class MappedRead:
    """One tensor of a mapped shard, as Transformers' loader takes a safetensors slice: `get_shape()`,
    `get_dtype()`, and an index: the whole (`handle[...]`, what the loader asks) a view of the shard's
    mapping, any part a copy, as safetensors gives it."""

    __slots__ = ("_info", "_mapping")

    def __init__(self, mapping: ShardMapping, info: TensorInfo) -> None:
        self._mapping, self._info = mapping, info

    def __getitem__(self, index: Any) -> torch.Tensor:
        whole = self._mapping.tensor(self._info)
        return whole if index is Ellipsis else whole[index].clone()

    def get_shape(self) -> list[int]:
        """The tensor's shape, as safetensors' slice gives it."""
        return list(self._info.shape)

    def get_dtype(self) -> str:
        """The tensor's safetensors dtype name ("BF16", "I32", ...)."""
        return self._info.dtype
