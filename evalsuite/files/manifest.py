"""File manifests: the SHA-256 of every file a checkpoint was uploaded with, so a download is proved whole.

Two forms are read, by file name, in the checkpoint folder:

- `SHA256SUMS` (also `sha256sums.txt`): what `sha256sum` prints, one `<64 hex digits>  <relative path>` line
  per file (a `*` before the path, binary mode, is accepted, as are its backslash-escaped names); the BSD form
  `SHA256 (<path>) = <64 hex digits>` too. Blank lines and lines starting with `#` are skipped.
- `UPLOAD_MANIFEST.json`: a JSON object mapping each relative path to its SHA-256 (a hex string, or an object
  `{"sha256": …, "size": …}`), or a list of objects `{"path": …, "sha256": …, "size": …}` (`size`, in bytes,
  optional; other keys ignored), either one alone or under a top-level `"files"` key beside other metadata.

Paths are relative, with `/` separators, and must stay inside the folder: a manifest that names a path outside
it, or a line or entry that does not parse, is refused with the file and the line (or entry). Verification
hashes through a `DigestCache`, so the files a run has already hashed for its observation keys are not read
again. `write_sha256sums` writes the `SHA256SUMS` form, which `sha256sum -c SHA256SUMS` checks in the folder.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from evalsuite.errors import InputError
from evalsuite.files.digest import DigestCache
from evalsuite.files.run_folder import write_atomic

SHA256SUMS = "SHA256SUMS"
UPLOAD_MANIFEST = "UPLOAD_MANIFEST.json"
MANIFEST_NAMES = (SHA256SUMS, "sha256sums.txt", UPLOAD_MANIFEST)
# Files that hold weights: a manifest that leaves one out does not cover what the model computes with.
WEIGHT_FILE = re.compile(r"(?i)\.(safetensors|gguf|bin|pt|pth|ckpt|h5|msgpack|onnx)$")

_HEX = re.compile(r"[0-9a-fA-F]{64}")
_GNU_LINE = re.compile(r"^(\\?)([0-9a-fA-F]{64}) [ *](.+)$")
_BSD_LINE = re.compile(r"^(\\?)SHA256 \((.+)\) = ([0-9a-fA-F]{64})$")


@dataclass(frozen=True)
class ManifestEntry:
    """One listed file: its path relative to the folder, its SHA-256 (lower-case hex), its size if given,
    and where the manifest lists it (`line 3`, `entry 2`)."""

    path: str
    sha256: str
    size: int | None
    where: str


@dataclass(frozen=True)
class Manifest:
    """A manifest file and its entries, in the order listed."""

    file: Path
    entries: list[ManifestEntry]


@dataclass
class ManifestCheck:
    """What verifying one manifest against its folder found."""

    manifest: Manifest
    verified: int = 0
    missing: list[ManifestEntry] = field(default_factory=list)
    mismatched: list[tuple[ManifestEntry, str]] = field(default_factory=list)  # (entry, problem)
    unlisted_weights: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.mismatched or self.unlisted_weights)

    def problems(self) -> list[dict[str, str]]:
        """One row per problem: which manifest, which file, what is wrong."""
        name = self.manifest.file.name
        rows = [
            {
                "check": "manifest_missing",
                "file": e.path,
                "key": f"{name} {e.where}",
                "detail": "listed, absent",
            }
            for e in self.missing
        ]
        rows += [
            {"check": "manifest_mismatched", "file": e.path, "key": f"{name} {e.where}", "detail": problem}
            for e, problem in self.mismatched
        ]
        rows += [
            {"check": "manifest_unlisted_weights", "file": p, "key": name, "detail": "weight file not listed"}
            for p in self.unlisted_weights
        ]
        return rows


def find_manifests(folder: Path) -> list[Path]:
    """The manifest files present in the folder, in `MANIFEST_NAMES` order."""
    return [folder / name for name in MANIFEST_NAMES if (folder / name).is_file()]


def read_manifest(path: Path) -> Manifest:
    """Parse a manifest (the form is told by its name); InputError naming the file and line or entry for
    anything malformed or a path that leaves the folder."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"is not UTF-8 (byte {exc.start})", path) from None
    except OSError as exc:
        raise InputError(f"cannot be read: {exc.strerror}", path) from None
    entries = _read_json(text, path) if path.suffix == ".json" else _read_lines(text, path)
    seen: dict[str, str] = {}
    for entry in entries:
        _check_path(entry, path)
        if entry.path in seen:
            raise InputError(
                f"{entry.where}: {entry.path} is listed again (first at {seen[entry.path]})", path
            )
        seen[entry.path] = entry.where
    return Manifest(path, entries)


def _read_lines(text: str, path: Path) -> list[ManifestEntry]:
    entries = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        where = f"line {number}"
        if gnu := _GNU_LINE.match(line):
            escaped, digest, name = gnu.groups()
        elif bsd := _BSD_LINE.match(line):
            escaped, name, digest = bsd.groups()
        else:
            shown = line if len(line) <= 80 else line[:77] + "..."
            raise InputError(f"{where}: not `<sha256>  <path>` (sha256sum's format): {shown!r}", path)
        if escaped:
            name = _unescape(name, where, path)
        entries.append(ManifestEntry(name, digest.lower(), None, where))
    return entries


def _unescape(name: str, where: str, path: Path) -> str:
    # sha256sum writes `\\` for a backslash and `\n` for a newline in a name, and marks the line with `\`.
    out, chars = [], iter(name)
    for ch in chars:
        if ch == "\\":
            nxt = next(chars, "")
            if nxt not in ("\\", "n", "r"):
                raise InputError(f"{where}: unknown escape `\\{nxt}` in the file name", path)
            out.append({"\\": "\\", "n": "\n", "r": "\r"}[nxt])
        else:
            out.append(ch)
    return "".join(out)


def _read_json(text: str, path: Path) -> list[ManifestEntry]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"line {exc.lineno}: invalid JSON: {exc.msg}", path) from None
    if isinstance(doc, dict) and isinstance(doc.get("files"), dict | list):
        doc = doc["files"]
    if isinstance(doc, dict):
        items = [(f"entry {name!r}", {"path": name, **_as_entry(value)}) for name, value in doc.items()]
    elif isinstance(doc, list):
        items = [(f"entry {i + 1}", value) for i, value in enumerate(doc)]
    else:
        raise InputError("expected an object of path → sha256, or a list of {path, sha256[, size]}", path)
    entries = []
    for where, value in items:
        if not isinstance(value, dict):
            raise InputError(f"{where}: expected an object {{path, sha256[, size]}}, not {value!r}", path)
        name, digest, size = value.get("path"), value.get("sha256"), value.get("size")
        if not isinstance(name, str) or not name:
            raise InputError(f"{where}: `path` is missing or not a string", path)
        if not isinstance(digest, str) or not _HEX.fullmatch(digest):
            raise InputError(f"{where}: `sha256` of {name} is not 64 hex digits: {digest!r}", path)
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise InputError(f"{where}: `size` of {name} is not a byte count: {size!r}", path)
        entries.append(ManifestEntry(name, digest.lower(), size, where))
    return entries


def _as_entry(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        return {"sha256": value}
    return value if isinstance(value, dict) else {"sha256": value}


def _check_path(entry: ManifestEntry, manifest: Path) -> None:
    pure = PurePosixPath(entry.path)
    folder = manifest.parent.resolve()
    outside = pure.is_absolute() or ".." in pure.parts or not (folder / pure).resolve().is_relative_to(folder)
    if outside:
        raise InputError(f"{entry.where}: {entry.path!r} lies outside the checkpoint folder", manifest)


def verify_manifest(manifest: Manifest, digests: DigestCache) -> ManifestCheck:
    """Every listed file present with its size and digest (hashed through `digests`, a few files at a time),
    and every weight file of the folder listed."""
    folder = manifest.file.parent
    check = ManifestCheck(manifest)
    present = []
    for entry in manifest.entries:
        target = folder / entry.path
        if not target.is_file():
            check.missing.append(entry)
        elif entry.size is not None and target.stat().st_size != entry.size:
            size = target.stat().st_size
            check.mismatched.append((entry, f"{size:,} bytes, listed as {entry.size:,}"))
        else:
            present.append(entry)
    found = digests.sha256_many(folder / e.path for e in present)
    for entry in present:
        actual = found[folder / entry.path]
        if actual == entry.sha256:
            check.verified += 1
        else:
            check.mismatched.append((entry, f"sha256 {actual}, listed as {entry.sha256}"))
    listed = {PurePosixPath(e.path).as_posix() for e in manifest.entries}
    check.unlisted_weights = [p for p in folder_files(folder) if WEIGHT_FILE.search(p) and p not in listed]
    return check


def folder_files(folder: Path) -> list[str]:
    """Every regular file under `folder` as a relative POSIX path, sorted; hidden folders (`.git`, a hub
    download's `.cache`) are not part of a checkpoint."""
    files = []
    for path in folder.rglob("*"):
        rel = path.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts[:-1]) or not path.is_file():
            continue
        files.append(rel.as_posix())
    return sorted(files)


def write_sha256sums(folder: Path, digests: DigestCache, name: str = SHA256SUMS) -> tuple[Path, int]:
    """Write `folder/name` listing every file of the folder but the manifests, in sha256sum's format; returns
    its path and the number of files listed."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError("is not a folder", folder)
    files = [p for p in folder_files(folder) if p not in MANIFEST_NAMES]
    found = digests.sha256_many(folder / p for p in files)
    lines = [f"{_escaped_line(found[folder / p], p)}\n" for p in files]
    target = folder / name
    write_atomic(target, "".join(lines))
    return target, len(files)


def _escaped_line(digest: str, path: str) -> str:
    if "\\" in path or "\n" in path or "\r" in path:
        escaped = path.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
        return f"\\{digest}  {escaped}"
    return f"{digest}  {path}"
