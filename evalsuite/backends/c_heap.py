"""The C heap under a model's tensors: when glibc hands freed memory back to the system, and when it does not.

glibc serves an allocation below its mmap threshold from its heaps, which keep freed chunks for reuse rather
than return them; the threshold rises (to 32 MiB at most on 64-bit) each time a mapped chunk is freed. Loading
a MoE model reads each layer's routed experts as hundreds of small per-expert tensors (2 MB each at the seed's
real widths) that Transformers fuses into one 3-D tensor and frees: served from the heaps, they stay resident
beside the model (bench/real_shape.py measures how much), served by mmap they go back at once. Nothing here
exists outside glibc: elsewhere every function is a no-op.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator
from typing import Any

# mallopt's parameter number of the mmap threshold (malloc.h).
_M_MMAP_THRESHOLD = -3
# While a model loads: every tensor of 1 MiB or more is mapped, and unmapped when freed.
LOADING_MMAP_THRESHOLD = 1 << 20
# Afterwards: the ceiling glibc's own dynamic threshold reaches on 64-bit, so that a forward's activations are
# served from the heaps as they would be once glibc has adjusted (setting the threshold fixes it for good).
RUNNING_MMAP_THRESHOLD = 32 << 20


def _glibc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_LIBC = _glibc()


def release_freed_memory() -> None:
    """Hand the heaps' free memory back to the system (glibc's `malloc_trim`)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


@contextlib.contextmanager
def tensors_mapped_while_loading() -> Iterator[None]:
    """For the duration of a model's load, tensors of 1 MiB or more mapped (and unmapped when freed); then
    the threshold at glibc's usual ceiling and the heaps trimmed."""
    if _LIBC is None:
        yield
        return
    _LIBC.mallopt(_M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, RUNNING_MMAP_THRESHOLD)
        release_freed_memory()
