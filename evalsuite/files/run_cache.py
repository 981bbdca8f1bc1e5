"""What a run computes from small files and may reuse in the next process: a corpus's token ids under one
tokenizer, and a load plan that passed its meta-device check.

Both are pure functions of files (and of the code that reads them), so each is kept under a key that holds
every input: the digests of the files (of every file a tokenizer load may read, `checkpoint.TOKENIZER_FILES`),
the options, and `code_versions()` (evalsuite's own source and the versions of every library that tokenizes
or plans a load). A changed tokenizer file, another Transformers or sentencepiece, or an edited evalsuite
gives another key: nothing stale is ever read. Entries live in `$EVALSUITE_CACHE/<kind>` (default
`~/.cache/evalsuite/<kind>`), one file per key, written atomically; an unreadable or unwritable cache costs
time, never correctness. Token ids are stored as `.npy` and read with `allow_pickle=False`.

Since every key holds the code, each upgrade (or each edit of a checkout) leaves the old entries behind for
good: the kinds here are kept under `EVALSUITE_CACHE_MAX_MB` megabytes together (`DEFAULT_MAX_BYTES`), the
least recently used dropped first when an entry is added (a read counts as a use). The digests beside them
(`evalsuite.files.digest`) are one small file per file ever hashed, replaced when it changes, and dropping one
costs hashing its checkpoint again (minutes at 70 GB): they are not evicted. `evalsuite cache` shows all of
it, the fixtures included, and `--clear` removes all but the fixtures (`cache_usage`, `clear_cache`).

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
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from evalsuite.errors import InputError
from evalsuite.files.digest import default_cache_folder
from evalsuite.files.run_folder import write_atomic
from evalsuite.version import __version__

# The libraries whose code decides what is cached. A tokenizer's ids: Transformers and every library it
# tokenizes through (the Rust tokenizers, sentencepiece, tiktoken, the protobuf that reads a SentencePiece
# model when it is converted to a fast tokenizer, mistral-common's tekken and SentencePiece tokenizers, regex
# for the Python BPE tokenizers' pre-tokenization). A load plan's verdict: the loader's libraries.
_LIBRARIES = (
    "transformers",
    "tokenizers",
    "sentencepiece",
    "tiktoken",
    "protobuf",
    "mistral-common",
    "regex",
    "torch",
    "compressed-tensors",
    "accelerate",
    "safetensors",
)
# The kinds of `RunCache`, each a folder of the cache, evicted together under one cap.
KINDS = ("tokens", "load-plans")
# The cap's default: 256 MB. A corpus's ids take 8 bytes a token, so WikiText-2's test split (a few hundred
# thousand tokens) takes a few MB under one tokenizer and a load plan's mark a few hundred bytes: this keeps
# every corpus × tokenizer a machine runs in a season (a hundred or so at that size), and stays a small
# fraction of one checkpoint on the same disk.
DEFAULT_MAX_BYTES = 256 * 10**6
MAX_BYTES_VARIABLE = "EVALSUITE_CACHE_MAX_MB"


@functools.cache
def code_versions() -> str:
    """A digest of the code that computes a cached result: evalsuite's own source files (an edited checkout
    keeps its version string) and the installed versions of `_LIBRARIES`."""
    digest = hashlib.sha256(__version__.encode())
    # The whole package, wherever this module sits in it.
    package = Path(str(resources.files("evalsuite"))).resolve()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    for name in _LIBRARIES:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{name}={version}".encode())
    return digest.hexdigest()


def max_cache_bytes() -> int:
    """The cap on the `KINDS` together: `$EVALSUITE_CACHE_MAX_MB` megabytes (10^6 bytes; 0 keeps nothing), or
    `DEFAULT_MAX_BYTES`."""
    text = os.environ.get(MAX_BYTES_VARIABLE, "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    try:
        megabytes = float(text)
    except ValueError:
        megabytes = -1.0
    if not 0 <= megabytes < float("inf"):
        raise InputError(
            f"{MAX_BYTES_VARIABLE}={text!r} is not a size in megabytes (e.g. 256; 0 keeps nothing)"
        )
    return int(megabytes * 10**6)


def _entries(folder: Path) -> list[tuple[int, int, Path]]:
    """A kind's entries as (last use in ns, bytes, path); a writer's temporary file (a dot file) is none."""
    entries = []
    with contextlib.suppress(OSError):
        for path in folder.iterdir():
            if path.name.startswith("."):
                continue
            with contextlib.suppress(OSError):
                st = path.stat()
                entries.append((st.st_mtime_ns, st.st_size, path))
    return entries


def evict(folders: list[Path], max_bytes: int) -> None:
    """Remove the least recently used entries of `folders` until they hold `max_bytes` at most together."""
    entries = sorted(entry for folder in folders for entry in _entries(folder))
    total = sum(size for _, size, _ in entries)
    for _, size, path in entries:
        if total <= max_bytes:
            break
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        total -= size


class RunCache:
    """One kind of cached result (`kind` names its folder), by key. `folder` None: nothing is kept."""

    def __init__(self, kind: str, folder: Path | None = None, enabled: bool = True) -> None:
        self.folder = (folder or default_cache_folder().parent / kind) if enabled else None

    def _used(self, path: Path) -> None:
        # The entry's modification time is its last use (the access time is not kept on most mounts).
        with contextlib.suppress(OSError):
            os.utime(path)

    def _kept(self, path: Path) -> None:
        # Every kind's entries under one cap, this one's own folder among them (a test's may be elsewhere).
        folders = [path.parent, *(path.parent.parent / kind for kind in KINDS if kind != path.parent.name)]
        evict(folders, max_cache_bytes())

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
        self._used(path)
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
        self._kept(path)

    def passed(self, key: dict[str, str]) -> bool:
        """Whether a check passed under `key` (only a pass is ever kept)."""
        path = self._path(key, ".json")
        if path is None or not path.is_file():
            return False
        self._used(path)
        return True

    def put_passed(self, key: dict[str, str]) -> None:
        """Record that a check passed under `key`."""
        path = self._path(key, ".json")
        if path is not None:
            with contextlib.suppress(OSError):
                write_atomic(path, json.dumps(key, sort_keys=True))
            self._kept(path)


@dataclass(frozen=True)
class CacheKind:
    """One kind of what evalsuite keeps between runs: its folder, its entries and their bytes, whether
    `clear_cache` removes them (the fixtures are rebuilt only by `evalsuite fixtures`) and whether they are
    kept under the cap (`max_cache_bytes`)."""

    name: str
    folder: Path
    entries: int
    size_bytes: int
    clearable: bool
    evicted: bool


def _usage(name: str, folder: Path, clearable: bool, evicted: bool) -> CacheKind:
    if name == "fixtures":  # a fixture is a folder; the bytes are every file's, downloads and all
        built = (
            [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
            if folder.is_dir()
            else []
        )
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        return CacheKind(name, folder, len(built), size, clearable, evicted)
    entries = _entries(folder)
    return CacheKind(name, folder, len(entries), sum(size for _, size, _ in entries), clearable, evicted)


def cache_usage(fixtures: Path) -> list[CacheKind]:
    """Every kind evalsuite keeps between runs: the `KINDS` here, the file digests (`evalsuite.files.digest`),
    and
    the fixtures in `fixtures`."""
    root = default_cache_folder().parent
    kinds = [_usage(kind, root / kind, True, True) for kind in KINDS]
    return [
        *kinds,
        _usage("digests", default_cache_folder(), True, False),
        _usage("fixtures", fixtures, False, False),
    ]


def clear_cache(fixtures: Path) -> list[CacheKind]:
    """Remove every entry of the kinds `cache_usage` calls clearable (all but the fixtures); returns what each
    kind held before. Only files evalsuite wrote are removed: a kind's folder holds nothing else."""
    before = cache_usage(fixtures)
    for kind in before:
        if not kind.clearable or not kind.folder.is_dir():
            continue
        for path in kind.folder.iterdir():
            if path.is_file():
                with contextlib.suppress(FileNotFoundError):  # a concurrent run's eviction
                    path.unlink()
    return before
