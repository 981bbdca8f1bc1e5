"""Read leases on the files whose bytes a run maps, so that no other process changes one unseen.

A loaded model's tensors that Transformers keeps as they were read are private mappings of their shard's
pages (`evalsuite.files.mapped_tensors`). A page not yet copied shows the file's current bytes, and a file cut
short takes its pages away, even those the process wrote to: the next touch of one is a SIGBUS, which kills
the process with no line and no traceback, and which no Python code can catch. Identity checks
(`evalsuite.files.identity`) see a change only after it happened.

A read lease (Linux's `F_SETLEASE`) is the kernel's way to hear of it before: a process that opens a leased
file to write, or truncates it, waits (up to `/proc/sys/fs/lease-break-time`, 45 s by default) while the
holder is sent SIGIO. For the duration of `watching()` every shard mapped is leased, and the SIGIO handler
raises `FileChangedError` naming the file in the main thread: the run ends with that one line (exit 2) and
its mappings go with the process, before the writer proceeds. A file renamed over a shard changes no leased
file: the mapped inode keeps its bytes, and the identity check when the observation is saved names it.

Where no lease can be had, nothing else changes: a file the process does not own (without CAP_LEASE), a
file system without leases (NFS), a file open for writing elsewhere, a caller outside the main thread (only
it may set a signal handler), or a process whose own SIGIO handler is set. There the identity checks remain,
and a file cut short under a loaded model can still end the process by SIGBUS, as it ends llama.cpp's or
safetensors' own mapped reads.
"""

from __future__ import annotations

import contextlib
import fcntl
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from evalsuite.files.identity import FileChangedError

_F_SETLEASE = getattr(fcntl, "F_SETLEASE", None)
_F_GETLEASE = getattr(fcntl, "F_GETLEASE", None)
_SIGIO = getattr(signal, "SIGIO", None)

# Reentrant: the SIGIO handler runs in the main thread between two bytecodes, perhaps inside `hold`.
_lock = threading.RLock()
# The open descriptors this process holds a lease through, with their files' paths.
_held: dict[int, Path] = {}
# Files whose lease broke, in the order the breaks were heard.
_broken: list[Path] = []
_watching = 0
_previous_handler: Any = None


def _lease(fd: int) -> int | None:
    try:
        return fcntl.fcntl(fd, _F_GETLEASE)
    except OSError:
        return None


def _on_lease_break(signum: int, frame: Any) -> None:
    with _lock:
        breaking = [path for fd, path in _held.items() if _lease(fd) != fcntl.F_RDLCK]
        _broken.extend(p for p in breaking if p not in _broken)
    if breaking:
        raise _change(breaking[0])


def _change(path: Path) -> FileChangedError:
    return FileChangedError(path, "another process opened it to write, or cut it short")


@contextlib.contextmanager
def watching() -> Iterator[bool]:
    """For the block's duration, lease the files `hold` is given and end the run on a break (module
    docstring); yields whether leases are taken. Nested blocks share the outer one's watch. On leaving, every
    lease still held is let go and SIGIO's handler is what it was."""
    global _watching, _previous_handler
    can = (
        _F_SETLEASE is not None
        and _SIGIO is not None
        and threading.current_thread() is threading.main_thread()
    )
    if can and _watching == 0:
        current = signal.getsignal(_SIGIO)
        can = current in (signal.SIG_DFL, None)
        if can:
            _previous_handler = current
            _broken.clear()
            signal.signal(_SIGIO, _on_lease_break)
    elif can:
        can = signal.getsignal(_SIGIO) is _on_lease_break
    if not can:
        yield False
        return
    _watching += 1
    try:
        yield True
    finally:
        _watching -= 1
        if _watching == 0:
            with _lock:
                for fd in _held:
                    # A lease outliving the handler would turn its break into SIGIO's default: the end of
                    # the process.
                    with contextlib.suppress(OSError):
                        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)
                _held.clear()
            signal.signal(_SIGIO, _previous_handler if _previous_handler is not None else signal.SIG_DFL)


def hold(fd: int, path: Path) -> bool:
    """Lease the file open read-only on `fd` while a watch is on; whether a lease was taken. The lease lives
    with the open file (and every mapping of it) until `let_go` or the end of the watch."""
    if _watching == 0:
        return False
    try:
        fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
    except OSError:
        return False
    with _lock:
        _held[fd] = path
    return True


def let_go(fd: int) -> None:
    """Forget `fd`'s lease; called just before `fd` is closed (closing ends the lease with the file)."""
    with _lock:
        if _held.pop(fd, None) is not None:
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_UNLCK)


def change_heard() -> FileChangedError | None:
    """The first lease that broke during the current (or last) watch, as the error it raised (what ended the
    run, whatever an exception handler made of that error on its way out); asked once, it is forgotten."""
    with _lock:
        heard = _change(_broken[0]) if _broken else None
        _broken.clear()
        return heard
