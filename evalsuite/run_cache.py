"""What a run computes from small files and may reuse in the next process: a corpus's token ids under one
tokenizer, and a load plan that passed its meta-device check.

Both are pure functions of files (and of the code that reads them), so each is kept under a key that holds
every input: the files' digests, the options, and `code_versions()` (evalsuite's own source and the versions
of the libraries that compute them). A changed tokenizer file, another Transformers or an edited evalsuite
gives another key: nothing stale is ever read. Entries live in `$EVALSUITE_CACHE/<kind>` (default
`~/.cache/evalsuite/<kind>`), one file per key, written atomically; an unreadable or unwritable cache costs
time, never correctness. Token ids are stored as `.npy` and read with `allow_pickle=False`.

Why a disk cache: `compare` and nightly CI run the same reference, tokenizer and corpus in process after
process; tokenizing the corpus and building the model on the meta device were a fifth of a short `ppl` run
on a 135 M model, paid again every time for the same bytes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import io
import json
from pathlib import Path

import numpy as np

from evalsuite.digest import default_cache_folder
from evalsuite.run_folder import write_atomic
from evalsuite.version import __version__

# The libraries whose code decides what is cached: a tokenizer's ids, a load plan's verdict.
_LIBRARIES = ("transformers", "tokenizers", "torch", "compressed-tensors", "accelerate", "safetensors")


@functools.cache
def code_versions() -> str:
    """A digest of the code that computes a cached result: evalsuite's own source files (an edited checkout
    keeps its version string) and the installed versions of `_LIBRARIES`."""
    digest = hashlib.sha256(__version__.encode())
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    for name in _LIBRARIES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{name}={version}".encode())
    return digest.hexdigest()


class RunCache:
    """One kind of cached result (`kind` names its folder), by key. `folder` None: nothing is kept."""

    def __init__(self, kind: str, folder: Path | None = None, enabled: bool = True) -> None:
        self.folder = (folder or default_cache_folder().parent / kind) if enabled else None

    def _path(self, key: dict[str, str], suffix: str) -> Path | None:
        if self.folder is None:
            return None
        text = json.dumps({**key, "code": code_versions()}, sort_keys=True)
        return self.folder / f"{hashlib.sha256(text.encode()).hexdigest()[:40]}{suffix}"

    def tokens(self, key: dict[str, str]) -> np.ndarray | None:
        """Token ids cached under `key`, or None."""
        path = self._path(key, ".npy")
        if path is None:
            return None
        try:
            tokens = np.load(path, allow_pickle=False)
        except (OSError, ValueError):
            return None
        if tokens.dtype != np.int64 or tokens.ndim != 1:
            return None
        return tokens

    def put_tokens(self, key: dict[str, str], tokens: np.ndarray) -> None:
        """Keep token ids under `key`."""
        path = self._path(key, ".npy")
        if path is None:
            return
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(tokens, dtype=np.int64), allow_pickle=False)
        with contextlib.suppress(OSError):
            write_atomic(path, buffer.getvalue())

    def passed(self, key: dict[str, str]) -> bool:
        """Whether a check passed under `key` (only a pass is ever kept)."""
        path = self._path(key, ".json")
        return path is not None and path.is_file()

    def put_passed(self, key: dict[str, str]) -> None:
        """Record that a check passed under `key`."""
        path = self._path(key, ".json")
        if path is not None:
            with contextlib.suppress(OSError):
                write_atomic(path, json.dumps(key, sort_keys=True))
