"""The C heap under a model's tensors: when glibc hands freed memory back to the system, and when it does not.

glibc serves an allocation below its mmap threshold from its heaps, which keep freed chunks for reuse rather
than return them; the threshold rises (to 32 MiB at most on 64-bit) each time a mapped chunk is freed. A load
keeps its temporaries in the heaps for reuse (`heap_kept_while_loading`); a long window's reduction maps its
large ones (`map_large_allocations`). Nothing here exists outside glibc: elsewhere every function is a no-op.

The thresholds are the process's, and glibc cannot give them back: once `mallopt` has set the mmap or the trim
threshold, its dynamic adjustment of both is off for good, and it reports neither. So they are set only in a
process that chose them (`allow_thresholds`): the command line does, as it starts; a program that calls
`evalsuite.run` keeps its own allocator unless it calls `evalsuite.tune_allocator` first.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from collections.abc import Iterator
from typing import Any

# mallopt's parameter numbers of the trim and mmap thresholds (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Outside a load: free memory at the heap's top kept up to twice the running mmap threshold, as glibc's own
# dynamic adjustment would keep it. Set by hand, the mmap threshold stops that adjustment and leaves the trim
# threshold at 128 KiB: every temporary of a forward or a window's scoring freed at the top of a heap was
# handed back and faulted in again at its next allocation (bench/ppl.py, the SmolLM2 pair's system time).
RUNNING_TRIM_THRESHOLD = 64 << 20
# While a model loads: free memory at the heap's top kept up to this much (`heap_kept_while_loading`).
LOADING_TRIM_THRESHOLD = 256 << 20
# Where a process maps every allocation of 1 MiB or more, and unmaps it when freed (`map_large_allocations`).
LARGE_MMAP_THRESHOLD = 1 << 20
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
# Whether this process chose evalsuite's thresholds (`allow_thresholds`): until it does, nothing is set.
_allowed = False
# The threshold outside a load, restored after each (glibc does not report it): its usual ceiling, or
# `LARGE_MMAP_THRESHOLD` once `map_large_allocations` has made that the process's for good.
_running_threshold = RUNNING_MMAP_THRESHOLD


def allow_thresholds() -> bool:
    """Let evalsuite set glibc's thresholds in this process from now on, for good (a load's, then the running
    ones; `map_large_allocations`); whether they will be (not on another C library). The command line calls
    it as it starts; a program calls it through `evalsuite.tune_allocator`."""
    global _allowed
    _allowed = _LIBC is not None
    return _allowed


def release_freed_memory() -> None:
    """Hand the heaps' free memory back to the system (glibc's `malloc_trim`)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


@contextlib.contextmanager
def heap_kept_while_loading() -> Iterator[None]:
    """For the duration of a model's load, allocations below the running ceiling served from the heaps and
    freed memory kept there for the next allocation (the trim threshold at `LOADING_TRIM_THRESHOLD`); then
    the thresholds back to the process's running ones (`map_large_allocations`) and the heaps trimmed.

    Why: the tensors a load reads are mappings of their own (`evalsuite.files.mapped_tensors`), so what the
    heaps serve is the conversion's temporaries: dequantizing each expert of a W4A8 pack allocates and frees
    temporaries of the per-expert tensors' sizes, hundreds of times a layer. Mapped each time, or trimmed from
    the heap's top each time they are freed (glibc trims above 128 KiB once the threshold is set by hand),
    every page of every temporary costs a page fault; kept, the next expert reuses them (bench/ppl.py: the
    wide W4A8 load, and its peak, which this does not raise).

    Only where the process chose evalsuite's thresholds (`allow_thresholds`): elsewhere the load runs under
    the caller's allocator, as it found it, since what the thresholds were before cannot be read back."""
    if not _allowed:
        yield
        return
    _LIBC.mallopt(_M_TRIM_THRESHOLD, LOADING_TRIM_THRESHOLD)
    _LIBC.mallopt(_M_MMAP_THRESHOLD, RUNNING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        _LIBC.mallopt(_M_TRIM_THRESHOLD, RUNNING_TRIM_THRESHOLD)
        _LIBC.mallopt(_M_MMAP_THRESHOLD, _running_threshold)
        release_freed_memory()


def map_large_allocations() -> bool:
    """From now on in this process, every allocation of 1 MiB or more (`LARGE_MMAP_THRESHOLD`) is mapped
    on its own and returned to the system when freed, loads or not; whether it applied.

    Why: a long window's reduction allocates thousands of same-sized temporaries (a block of float64
    log-probs, its copies: 6 MB at a 49 k vocabulary, 32 MB at 248 k) between small results that live on, in
    the arena of whichever torch thread asked: the small results split the freed blocks, the next block does
    not fit the holes, and the arenas grow by a block each time, to many times the window's own working
    memory (bench/long_context.py measures the whole process). A load still keeps its own temporaries in the
    heaps, and trims them when done (`heap_kept_while_loading`). Nothing is set (False) unless the process
    chose evalsuite's thresholds (`allow_thresholds`)."""
    global _running_threshold
    if not _allowed:
        return False
    _running_threshold = LARGE_MMAP_THRESHOLD
    return bool(_LIBC.mallopt(_M_MMAP_THRESHOLD, _running_threshold))
