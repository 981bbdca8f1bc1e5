"""SHA-256 digests of files, streamed at disk speed and cached per file by its identity on disk.

An observation is only as trustworthy as the claim that it was made on these very bytes, so its key holds a
digest of every byte of the side's weights. Hashing 70 GB takes minutes, so a digest is cached per file under
what identifies an unchanged file, its `FileIdentity` compared whole: device and inode, size, modification
and status-change times (the ctime cannot be set back by `touch`, so an in-place edit that restores the mtime
is still seen; a chmod costs one hash more, never a stale digest). A file that
changes while it is hashed is hashed again, never cached half-read.

The cache is one small JSON file per hashed file (named by a hash of the file's resolved path) in
`EVALSUITE_CACHE/digests` (default `~/.cache/evalsuite/digests`), written atomically, so concurrent runs
share it without a lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from evalsuite.errors import InputError
from evalsuite.files.identity import FileIdentity
from evalsuite.files.run_folder import write_atomic

# Threads hashing files at once: hashlib releases the GIL on large updates, so two files hash on two cores.
MAX_WORKERS = 4
_SCHEMA = "evalsuite.digest/1"


def default_cache_folder() -> Path:
    """Where digests are cached: `$EVALSUITE_CACHE/digests`, or `~/.cache/evalsuite/digests`."""
    root = os.environ.get("EVALSUITE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "evalsuite") / "digests"


def _hash_file(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError as exc:
        raise InputError(f"cannot be read: {exc.strerror}", path) from None


class DigestCache:
    """File digests, cached in `folder` (None: computed every time, nothing written)."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self.hashed_bytes = 0  # bytes read by this cache object (0 when every digest came from the cache)
        self._lock = threading.Lock()

    @classmethod
    def default(cls) -> DigestCache:
        """The user's shared cache (see `default_cache_folder`)."""
        return cls(default_cache_folder())

    def _entry_path(self, path: Path) -> Path | None:
        if self.folder is None:
            return None
        name = hashlib.sha256(str(path).encode("utf-8", "surrogateescape")).hexdigest()[:40]
        return self.folder / f"{name}.json"

    def cached(self, path: Path) -> str | None:
        """The cached digest of `path` if the file is unchanged since it was hashed, else None."""
        path = Path(path).resolve()
        entry = self._entry_path(path)
        if entry is None:
            return None
        try:
            doc = json.loads(entry.read_text(encoding="utf-8"))
            identity = FileIdentity.of(path.stat())
        except (OSError, ValueError):
            return None
        if (
            isinstance(doc, dict)
            and doc.get("schema") == _SCHEMA
            and doc.get("path") == str(path)
            and doc.get("identity") == asdict(identity)
            and isinstance(doc.get("sha256"), str)
        ):
            return doc["sha256"]
        return None

    def sha256(self, path: Path) -> str:
        """The SHA-256 of a file's bytes (hex), from the cache when the file is unchanged."""
        path = Path(path).resolve()
        if (hit := self.cached(path)) is not None:
            return hit
        for _ in range(3):
            before = FileIdentity.of(path.stat())
            digest = _hash_file(path)
            after = FileIdentity.of(path.stat())
            with self._lock:
                self.hashed_bytes += after.size
            if before == after:
                self._store(path, after, digest)
                return digest
        raise InputError("keeps changing while it is read; is another program writing it?", path)

    def _store(self, path: Path, identity: FileIdentity, digest: str) -> None:
        entry = self._entry_path(path)
        if entry is None:
            return
        doc = {"schema": _SCHEMA, "path": str(path), "identity": asdict(identity), "sha256": digest}
        # An unwritable cache costs time on the next run, never correctness.
        with contextlib.suppress(OSError):
            write_atomic(entry, json.dumps(doc, sort_keys=True))

    def sha256_many(self, paths: Iterable[Path], workers: int | None = None) -> dict[Path, str]:
        """Digests of several files, hashed a few at a time in threads; keys are the paths as given."""
        paths = list(paths)
        workers = max(1, min(workers or MAX_WORKERS, os.cpu_count() or 1, len(paths) or 1))
        if workers == 1:
            return {p: self.sha256(p) for p in paths}
        with ThreadPoolExecutor(workers, thread_name_prefix="digest") as pool:
            return dict(zip(paths, pool.map(self.sha256, paths), strict=True))
