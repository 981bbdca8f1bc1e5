"""Safetensors files read as claims to be checked: each shard's header, the index's weight_map, and the
strict JSON both are written in.

A checkpoint is input from whoever published it, and a header that lies about its offsets would otherwise
surface as a crash (or a silently wrong tensor) halfway through a run; so every entry is checked here, the
way the safetensors reader itself would accept it, before anything reads a byte of tensor data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from evalsuite.errors import InputError
from evalsuite.files.identity import FileIdentity

INDEX_FILE = "model.safetensors.index.json"

# The cap the safetensors library itself applies; a larger length is a corrupt or hostile file, and reading
# it would allocate whatever the file claims.
MAX_HEADER_BYTES = 100_000_000
# Bytes per element of every dtype that safetensors can hand to torch; anything else is rejected rather than
# guessed, because the byte ranges are checked against numel × this size.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "F8_E5M2FNUZ": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}
FLOAT_DTYPES = frozenset(d for d in DTYPE_SIZES if d.startswith(("F", "BF")))


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its shard file and the absolute byte range of its data in that file; for a
    shard's header, the identity its file had when the header was read (`evalsuite.files.identity`)."""

    name: str
    shard: Path
    dtype: str
    shape: tuple[int, ...]
    data_begin: int
    data_end: int
    identity: FileIdentity | None = None

    @property
    def nbytes(self) -> int:
        """Size of the stored data in bytes."""
        return self.data_end - self.data_begin

    @property
    def numel(self) -> int:
        """Number of elements (1 for a scalar)."""
        return math.prod(self.shape)


def read_index(index_path: Path, folder: Path, roots: tuple[Path, ...]) -> tuple[dict[str, str], list[Path]]:
    """The index's weight_map (tensor name → shard path relative to the folder) and its shard files."""
    index = read_json(index_path, strict=True)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError("no weight_map object (or an empty one)", index_path)
    normalized: dict[str, str] = {}
    shards: dict[str, Path] = {}
    for name, rel in weight_map.items():
        pure = PurePosixPath(rel) if isinstance(rel, str) and rel else None
        if pure is None or pure.is_absolute() or ".." in pure.parts or "\\" in rel:
            raise InputError(
                f"weight_map entry for {name!r} leaves the checkpoint folder: {rel!r}", index_path
            )
        key = pure.as_posix()  # "./a" and "a" are the same shard
        if key not in shards:
            shard = folder / pure
            if not resolves_inside(shard, roots):
                raise InputError(
                    f"weight_map entry for {name!r} resolves outside the checkpoint folder: {rel!r}",
                    index_path,
                )
            if not shard.is_file():
                raise InputError(f"shard listed in {INDEX_FILE} does not exist", shard)
            shards[key] = shard
        normalized[name] = key
    return normalized, [shards[key] for key in sorted(shards)]


def check_index_matches_headers(
    index_path: Path, folder: Path, weight_map: dict[str, str], tensors: dict[str, TensorInfo]
) -> None:
    for name, rel in weight_map.items():
        if name not in tensors:
            raise InputError(f"tensor {name!r} is mapped to {rel} but no shard header has it", index_path)
    # Once per shard, not per tensor: pathlib's parsing costs 0.1 s over the 12,000 tensors of a pair.
    shard_names = {info.shard: "" for info in tensors.values()}
    for shard in shard_names:
        shard_names[shard] = shard.relative_to(folder).as_posix()
    for name, info in tensors.items():
        stored_in = shard_names[info.shard]
        if name not in weight_map:
            raise InputError(f"tensor {name!r} of {stored_in} is not in the weight_map", index_path)
        if weight_map[name] != stored_in:
            raise InputError(
                f"tensor {name!r} is mapped to {weight_map[name]} but stored in {stored_in}", index_path
            )


def read_header(shard: Path) -> tuple[bytes, list[TensorInfo], FileIdentity]:
    """Parse and check one shard's header; returns the raw header (length prefix included), its tensors in
    file order, and the file's identity as the header was read (its size among it)."""
    with shard.open("rb") as f:
        identity = FileIdentity.of(os.fstat(f.fileno()))
        size = identity.size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise InputError(f"truncated shard: {size} bytes, too short for the 8-byte header length", shard)
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise InputError(f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte cap", shard)
        if 8 + header_len > size:
            raise InputError(
                f"header claims {header_len} bytes but the file has only {size - 8} after its length", shard
            )
        raw = f.read(header_len)
    data_start = 8 + header_len
    data_size = size - data_start
    header = parse_json(raw, shard, "header", strict=True)
    if not isinstance(header, dict):
        raise InputError("header is not a JSON object", shard)

    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError("header __metadata__ is not an object of strings", shard)

    entries = [_header_entry(shard, name, entry) for name, entry in header.items()]
    entries.sort(key=lambda e: (e[3], e[4]))
    needed = max((e[4] for e in entries), default=0)
    if needed > data_size:
        raise InputError(
            f"truncated shard: the header needs {needed} bytes of tensor data but the file has {data_size}",
            shard,
        )
    # Same layout rule as the safetensors reader: the ranges tile the data section exactly, so a file that
    # passes here is one safe_open accepts, and no byte can belong to two tensors.
    expected, previous = 0, None
    for name, _, _, begin, end in entries:
        if begin < expected:
            raise InputError(f"tensors {previous!r} and {name!r} overlap in data_offsets", shard)
        if begin > expected:
            raise InputError(f"data bytes {expected}..{begin} belong to no tensor (before {name!r})", shard)
        expected, previous = end, name
    if expected != data_size:
        raise InputError(f"{data_size - expected} bytes after the last tensor's data", shard)

    infos = [
        TensorInfo(name, shard, dtype, shape, data_start + begin, data_start + end, identity)
        for name, dtype, shape, begin, end in entries
    ]
    return prefix + raw, infos, identity


def _header_entry(shard: Path, name: str, entry: Any) -> tuple[str, str, tuple[int, ...], int, int]:
    """One checked header entry: (name, dtype, shape, begin, end), offsets relative to the data section."""
    if not isinstance(entry, dict):
        raise InputError(f"header entry {name!r} is not an object", shard)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise InputError(f"tensor {name!r} has unknown dtype {dtype!r}", shard)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise InputError(f"tensor {name!r} has shape {shape!r}, not a list of non-negative integers", shard)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise InputError(
            f"tensor {name!r} has data_offsets {offsets!r}, not two non-negative integers", shard
        )
    begin, end = offsets
    if end < begin:
        raise InputError(f"tensor {name!r} has data_offsets {offsets!r} that end before they begin", shard)
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise InputError(
            f"tensor {name!r} spans {end - begin} bytes but {dtype} {tuple(shape)} needs {expected}", shard
        )
    return name, dtype, tuple(shape), begin, end


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_inside(path: Path, roots: tuple[Path, ...]) -> None:
    if not resolves_inside(path, roots):
        raise InputError("is a symlink that resolves outside the checkpoint folder", path)


def resolves_inside(path: Path, roots: tuple[Path, ...]) -> bool:
    resolved = path.resolve()
    return any(resolved.is_relative_to(root) for root in roots)


class _DuplicateKeyError(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys; in a header or weight_map that would silently pick one
    # of two claims about the same tensor.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(key)
        result[key] = value
    return result


def read_json(path: Path, *, strict: bool = False) -> Any:
    """Parse a JSON file; `strict` also rejects an object with two equal keys."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot be read: {exc.strerror}", path) from None
    return parse_json(raw, path, "file", strict=strict)


def parse_json(raw: bytes, path: Path, what: str, *, strict: bool) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not UTF-8 (byte {exc.start})", path) from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys if strict else None)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"invalid JSON in {what} at line {exc.lineno}, column {exc.colno}: {exc.msg}", path
        ) from None
    except _DuplicateKeyError as exc:
        raise InputError(
            f"invalid JSON in {what}: key {exc.args[0]!r} appears twice in one object", path
        ) from None


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def hash_parts(hasher: Any, *parts: bytes) -> None:
    # Length-prefixed, so that no two different sequences of parts hash the same bytes.
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
