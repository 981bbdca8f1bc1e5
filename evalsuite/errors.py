"""The one small error hierarchy of evalsuite.

The CLI maps every `EvalsuiteError` to exit code 2 and prints its message as one line, but a
`ResourceError` to exit code 4; anything else is a bug (exit 3, one line, the traceback in a file), except an
exhausted device or host memory wherever it is raised, which is exit 4 too (`is_out_of_memory`).
"""

from __future__ import annotations

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
    """The machine ran out of a resource the run needs (device or host memory): a bigger machine, another
    device or `--stream` helps; a bug report does not. Exit code 4."""


# What PyTorch's allocators and CUDA say when an allocation fails (CPU: `DefaultCPUAllocator: can't allocate
# memory`; CUDA: `CUDA out of memory`, `torch.OutOfMemoryError`; cuBLAS: `CUBLAS_STATUS_ALLOC_FAILED`).
_OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "cannot allocate memory", "alloc_failed")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from or during, is a failed memory allocation."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, MemoryError) or type(current).__name__ == "OutOfMemoryError":
            return True
        if isinstance(current, RuntimeError) and any(m in str(current).lower() for m in _OUT_OF_MEMORY):
            return True
        current = current.__cause__ or current.__context__
    return False


def out_of_memory_line(exc: BaseException) -> str:
    """The one line an out-of-memory failure prints (exit 4)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"out of memory ({first[:200]}): a machine or device with more memory, --stream (one decoder layer "
        "resident at a time) or a smaller --max-memory helps"
    )
