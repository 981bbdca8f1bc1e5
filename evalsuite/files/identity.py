"""A file's identity while evalsuite reads it: its device and inode, its size, and the times of its last
change.

Why: a tensor's offsets come from the header read when its checkpoint was opened, its bytes from whatever
file is at the path later. A shard replaced by a rename (as downloads and `cp` over a folder do) has another
inode; one rewritten or cut short in place has another size or modification time. So each shard's identity
is taken with its header and compared whenever its bytes are mapped or read and again when a side's
observation is saved: a change ends the run with one line naming the file (exit 2), and never are the bytes
of one file judged under the header, and the digest, of another.

The status-change time (`st_ctime`) moves with the bytes but also with the file's metadata alone: a hard
link made to it, a chmod, a chown (even to the owner it has). A run is not ended by those, so a change of
that time alone is not a change here (`FileIdentity.difference`); a rewrite that sets its modification time
back (`touch -r`) is heard by the lease held on a mapped shard (`evalsuite.files.leases`). An identity's
equality still counts it, so what is cached by identity (a digest, a parsed GGUF header) is computed again
after any change rather than trusted.

A file's times are as fine as its file system's clock, which Linux advances every few milliseconds: a file
rewritten to the same size within that tick of its identity being taken keeps its identity. Such a change
to a mapped shard is heard by its lease where one is held.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from evalsuite.errors import InputError


class FileChangedError(InputError):
    """A file evalsuite was reading changed (replaced, rewritten or cut short) while it ran."""

    def __init__(self, path: str | Path, how: str) -> None:
        super().__init__(f"changed while evalsuite ran ({how}); run again once it no longer changes", path)


@dataclass(frozen=True)
class FileIdentity:
    """What tells one state of a file from another without reading it: its device, inode, size, and
    modification and status-change times."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, status: os.stat_result) -> FileIdentity:
        """The identity in `status` (`os.stat` or `os.fstat`)."""
        return cls(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)

    def difference(self, now: FileIdentity) -> str | None:
        """How `now` differs from this identity, in words; None where it does not."""
        if (now.device, now.inode) != (self.device, self.inode):
            return "another file now stands at its path"
        if now.size < self.size:
            return f"cut short: {now.size:,} bytes, {self.size:,} when opened"
        if now.size != self.size:
            return f"{now.size:,} bytes, {self.size:,} when opened"
        if now.mtime_ns != self.mtime_ns:
            return "rewritten in place"
        return None  # the status-change time alone: a link, chmod or chown, not the bytes (module docstring)


def check_unchanged(path: Path, identity: FileIdentity, status: os.stat_result | None = None) -> None:
    """Raise `FileChangedError` where the file at `path` (or the open file `status` describes) is no
    longer the one `identity` was taken of."""
    if status is None:
        try:
            status = os.stat(path)
        except FileNotFoundError:
            raise FileChangedError(path, "it is gone") from None
    how = identity.difference(FileIdentity.of(status))
    if how is not None:
        raise FileChangedError(path, how)
