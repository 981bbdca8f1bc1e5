"""The files of a checkpoint that are not tensors, compared with its source's: the `tensors` task's assets.

A quantized pack claims to preserve its source's processor and tokenizer: the tokenizer files, the chat
template, the generation config, the preprocessor settings (MiniCPM-V's `slice_mode`, `downsample_mode`,
`max_slice_nums`). Every file of the source that is not a weight file must be in the candidate and equal:
JSON compared as data (key order, spacing and `1` against `1.0` do not matter) with the keys a quantized
copy legitimately changes (`quantization_config`, `torch_dtype`) left out as the spec lists them; text
compared line by line (line endings aside); anything else byte for byte. Each difference names the file and
the key (a dotted JSON path, or the line), so a changed `slice_mode` reads `preprocessor_config.json:
slice_mode`.
"""

from __future__ import annotations

import filecmp
import json
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from evalsuite.contract.spec import StrictModel
from evalsuite.files.manifest import WEIGHT_FILE, folder_files

# Past this many differences in one file the rest are counted, not listed (a replaced tokenizer differs in
# every one of its 248 k entries).
SHOWN_PER_FILE = 20
# Top-level keys of a JSON asset that only steer how it was loaded, never what it does: where the files came
# from and how they were fetched. Transformers writes back what it was loaded with (llm-compressor's save of a
# tokenizer loaded from a local folder adds `local_files_only` and `is_local`), so they are no differences. A
# changed truncation or padding default, special token, chat template or vocabulary still is.
LOADING_KEYS = frozenset(
    {
        "local_files_only",
        "is_local",
        "_commit_hash",
        "name_or_path",
        "_name_or_path",
        "cache_dir",
        "revision",
        "force_download",
        "resume_download",
        "proxies",
        "subfolder",
        "token",
        "use_auth_token",
        "_from_auto",
        "_from_pipeline",
    }
)


class AssetRules(StrictModel):
    """Which source files are compared and which JSON keys may differ (`fnmatch` patterns: files by their
    path in the folder, keys by their dotted path in the file, `[i]` for a list's items)."""

    # Tensor maps, documentation a pack rewrites, repository metadata and manifests (verified on their own).
    ignore_files: list[str] = Field(
        default_factory=lambda: [
            "*.index.json",
            "*.md",
            ".gitattributes",
            "SHA256SUMS",
            "UPLOAD_MANIFEST.json",
        ]
    )
    # file pattern -> key patterns that may differ in such a file
    ignore_keys: dict[str, list[str]] = Field(default_factory=dict)


@dataclass(frozen=True)
class AssetDifference:
    """A source file missing from the candidate, or one key (or line) of it that differs."""

    kind: Literal["asset_missing", "asset_changed"]
    file: str
    key: str
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"check": self.kind, "file": self.file, "key": self.key, "detail": self.detail}


@dataclass
class AssetComparison:
    """Every compared source asset and what differs, per file."""

    compared: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    changed: dict[str, int] = field(default_factory=dict)  # file -> number of differing keys or lines
    differences: list[AssetDifference] = field(default_factory=list)  # listed (at most SHOWN_PER_FILE a file)

    def summary(self) -> dict[str, int]:
        """The metrics: files compared, missing, changed, and differing keys in all."""
        return {
            "assets_compared": len(self.compared),
            "assets_missing": len(self.missing),
            "assets_changed": len(self.changed),
            "asset_differences": sum(self.changed.values()),
        }


def asset_files(folder: Path, rules: AssetRules) -> list[str]:
    """The source's files that are compared: every file but weights and the ignored ones."""
    return [
        p
        for p in folder_files(folder)
        if not WEIGHT_FILE.search(p) and not any(fnmatchcase(p, pattern) for pattern in rules.ignore_files)
    ]


def compare_assets(source: Path, candidate: Path, rules: AssetRules) -> AssetComparison:
    """Compare every asset of `source` with the candidate's file of the same path."""
    found = AssetComparison()
    for name in asset_files(source, rules):
        found.compared.append(name)
        theirs = candidate / name
        if not theirs.is_file():
            found.missing.append(name)
            found.differences.append(AssetDifference("asset_missing", name, "", "missing from the candidate"))
            continue
        ignored = [
            k for pattern, keys in rules.ignore_keys.items() if fnmatchcase(name, pattern) for k in keys
        ]
        differences = _compare_file(source / name, theirs, ignored)
        if differences:
            found.changed[name] = len(differences)
            found.differences += [
                AssetDifference("asset_changed", name, key, detail)
                for key, detail in differences[:SHOWN_PER_FILE]
            ]
            if len(differences) > SHOWN_PER_FILE:
                more = f"{len(differences) - SHOWN_PER_FILE} more differences"
                found.differences.append(AssetDifference("asset_changed", name, "…", more))
    return found


def _compare_file(ours: Path, theirs: Path, ignored: list[str]) -> list[tuple[str, str]]:
    """(key, detail) for every difference; JSON as data, text by line, the rest by bytes."""
    if ours.suffix == ".json" and (mine := _json(ours)) is not None:
        other = _json(theirs)
        if other is None:
            return [("", "not valid JSON in the candidate")]
        return list(_data_differences(as_loaded(mine), as_loaded(other), "", ignored))
    if filecmp.cmp(ours, theirs, shallow=False):
        return []
    try:
        a, b = ours.read_text(encoding="utf-8"), theirs.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return [("", f"bytes differ ({ours.stat().st_size:,} in the source, {theirs.stat().st_size:,} here)")]
    # read_text translates line endings: a file saved on Windows is the same text.
    lines_a, lines_b = a.splitlines(), b.splitlines()
    if lines_a == lines_b:
        return []
    for i, (x, y) in enumerate(zip(lines_a, lines_b, strict=False), start=1):
        if x != y:
            return [(f"line {i}", f"source {_short(x)} → candidate {_short(y)}")]
    n = min(len(lines_a), len(lines_b)) + 1
    return [(f"line {n}", f"{len(lines_a)} lines in the source, {len(lines_b)} in the candidate")]


def as_loaded(data: Any) -> Any:
    """A JSON asset as Transformers acts on it: loading-only keys (`LOADING_KEYS`) left out, and a tokenizer's
    `model_specific_special_tokens` folded into the top-level `*_token` keys it is read together with
    (`PreTrainedTokenizerBase.from_pretrained` merges the two), so writing a token in either place is the same
    tokenizer."""
    if not isinstance(data, dict):
        return data
    loaded = {k: v for k, v in data.items() if k not in LOADING_KEYS}
    specific = loaded.pop("model_specific_special_tokens", None)
    if isinstance(specific, dict):
        for key, token in specific.items():
            loaded.setdefault(key, token)
    elif specific is not None:
        loaded["model_specific_special_tokens"] = specific
    return loaded


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None


def _data_differences(a: Any, b: Any, path: str, ignored: list[str]) -> Any:
    """Yield (dotted path, detail) for every difference between two JSON values, skipping ignored keys."""
    if path and any(fnmatchcase(path, pattern) for pattern in ignored):
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            sub = f"{path}.{key}" if path else str(key)
            if any(fnmatchcase(sub, pattern) for pattern in ignored):
                continue
            if key not in b:
                yield sub, f"missing from the candidate (source {_short(a[key])})"
            elif key not in a:
                yield sub, f"not in the source (candidate {_short(b[key])})"
            else:
                yield from _data_differences(a[key], b[key], sub, ignored)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield path, f"{len(a)} items in the source, {len(b)} in the candidate"
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            yield from _data_differences(x, y, f"{path}[{i}]", ignored)
    elif a != b or isinstance(a, bool) != isinstance(b, bool):
        # bool is an int in Python: `true` and `1` compare equal there, not in JSON.
        yield path, f"source {_short(a)} → candidate {_short(b)}"


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
