"""The one small error hierarchy of evalsuite.

The CLI maps every `EvalsuiteError` to exit code 2 and prints its message as one line, but a
`ResourceError` to exit code 4; anything else is a bug (exit 3, one line, the traceback in a file), except an
exhausted device or host memory (`is_out_of_memory`) or too many open files (`is_out_of_descriptors`)
wherever it is raised, which is exit 4 too: the machine's limit, not the file being read nor a bug.
"""

from __future__ import annotations

import errno
import resource
from collections.abc import Iterator
from pathlib import Path


class EvalsuiteError(Exception):
    """A run that cannot be done: the message is one line a user can act on."""


class InputError(EvalsuiteError):
    """A bad checkpoint, spec, recording, text file or option.

    `path` names the file (or folder) at fault; the message is prefixed with it.
    """

    def __init__(self, message: str, path: str | Path | None = None) -> None:
        self.path = None if path is None else Path(path)
        super().__init__(f"{path}: {message}" if path is not None else message)


class DependencyError(EvalsuiteError):
    """A missing package, device or network resource that this run needs."""


class Cancelled(EvalsuiteError):
    """A run stopped because its caller asked (the API's `cancel` event); what it saved resumes it."""


class ResourceError(EvalsuiteError):
    """The machine ran out of a resource the run needs (device or host memory, open files): a bigger
    machine, another device, `--stream` or a higher `ulimit -n` helps; a bug report does not. Exit code 4."""


# What PyTorch's allocators and CUDA say when an allocation fails (CPU: `DefaultCPUAllocator: can't allocate
# memory`; CUDA: `CUDA out of memory`, `torch.OutOfMemoryError`; cuBLAS: `CUBLAS_STATUS_ALLOC_FAILED`).
_OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "cannot allocate memory", "alloc_failed")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or during (`raise … from None` keeps the latter)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from or during, is a failed memory allocation."""
    return any(
        isinstance(current, MemoryError)
        or type(current).__name__ == "OutOfMemoryError"
        or (isinstance(current, RuntimeError) and any(m in str(current).lower() for m in _OUT_OF_MEMORY))
        for current in _chain(exc)
    )


def is_out_of_descriptors(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from or during, is the process out of open files
    (EMFILE): an `OSError` saying so, or an error whose words carry it (a library's, or a task's reason in
    the one line of a run with no verdict)."""
    return any(
        (isinstance(current, OSError) and current.errno == errno.EMFILE)
        or "too many open files" in str(current).lower()
        for current in _chain(exc)
    )


def out_of_memory_line(exc: BaseException) -> str:
    """The one line an out-of-memory failure prints (exit 4)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"out of memory ({first[:200]}): a machine or device with more memory, --stream (one decoder layer "
        "resident at a time) or a smaller --max-memory helps"
    )


def out_of_descriptors_line() -> str:
    """The one line a run out of open files prints (exit 4): the process's limits, and the `ulimit -n` that
    raises the soft one (to the hard one at most, which only root raises)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    raise_to = max(4096, 4 * soft) if hard == unlimited else min(hard, max(4096, 4 * soft))
    limits = f"limit {soft}, hard limit {'unlimited' if hard == unlimited else hard}"
    advice = (
        f"raise it with `ulimit -n {raise_to}` in the shell that runs evalsuite"
        if raise_to > soft
        else "the hard limit is reached: only root raises it (`ulimit -Hn`, /etc/security/limits.conf)"
    )
    return f"out of a system resource: too many open files ({limits}): {advice}"
