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
# The threshold outside a load, restored after each (glibc does not report it): its usual ceiling, or the
# load's own once `map_large_allocations` has made that the process's for good.
_running_threshold = RUNNING_MMAP_THRESHOLD


def release_freed_memory() -> None:
    """Hand the heaps' free memory back to the system (glibc's `malloc_trim`)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


@contextlib.contextmanager
def tensors_mapped_while_loading(map_large: bool = True) -> Iterator[None]:
    """For the duration of a model's load, tensors of 1 MiB or more mapped (and unmapped when freed); then
    the threshold back to the process's running one (`map_large_allocations`) and the heaps trimmed.

    `map_large=False` serves the load from the heaps instead (the threshold at its ceiling), for a load that
    decompresses: dequantizing each expert allocates temporaries of the same sizes as the per-expert tensors
    and frees them at once, so mapping them pays a page fault for every page of every temporary, and it
    saves nothing at the peak (bench/real_shape.py and the wide W4A8 load, mapped or not: the same peak).
    The heaps are trimmed afterwards all the same."""
    if _LIBC is None:
        yield
        return
    _LIBC.mallopt(_M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD if map_large else RUNNING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, _running_threshold)
        release_freed_memory()


def map_large_allocations() -> bool:
    """From now on in this process, every allocation of 1 MiB or more (`LOADING_MMAP_THRESHOLD`) is mapped
    on its own and returned to the system when freed, loads or not; whether it applied (not on another C
    library).

    Why: a long window's reduction allocates thousands of same-sized temporaries (a block of float64
    log-probs, its copies: 6 MB at a 49 k vocabulary, 32 MB at 248 k) between small results that live on, in
    the arena of whichever torch thread asked: the small results split the freed blocks, the next block does
    not fit the holes, and the arenas grow by a block each time, to many times the window's own working
    memory (bench/long_context.py measures the whole process). A streamed layer's load keeps it so."""
    global _running_threshold
    if _LIBC is None:
        return False
    _running_threshold = LOADING_MMAP_THRESHOLD
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, _running_threshold))
