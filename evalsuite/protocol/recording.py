"""Recordings: an observed reference side saved to disk, so that `--ref` need not load the model again.

`evalsuite record` observes one checkpoint and keeps, per observation the tasks need of a reference, the
compact form a later comparison needs (safetensors arrays and JSON, never pickle), with a manifest of
everything it depends on: the checkpoint's content digest (every byte of its weights), each observation's
identity (the part of the spec that shaped it), the inputs' hashes, the tokenizer, the execution, the package
versions. A run given a recording as `--ref` reads it instead of loading a model, and refuses it, with the
reason, when it was made from another spec, text, tokenizer or protocol: a stale reference is never compared
silently.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evalsuite.contract.observation import Observation
from evalsuite.contract.results import RECORDING_SCHEMA as SCHEMA
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.files.run_folder import write_atomic
from evalsuite.version import __version__

MANIFEST = "manifest.json"
_OBSERVER_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")

# What a differing input means, in the words a user needs to act on it.
INPUT_MISMATCH = {
    "corpus_sha256": "it was recorded on another text",
    "corpus": "it was recorded on another corpus",
    "n_tokens_text": "the candidate's tokenizer splits the text differently (another tokenizer)",
    "tokens_sha256": "the candidate's tokenizer gives other token ids (another tokenizer)",
    "prompts_sha256": "the candidate's tokenizer or chat template makes other prompt tokens",
    "inputs_sha256": "the candidate's processor makes other image inputs",
    "lmeval_tasks": "it was recorded on other lm-eval tasks",
    "lmeval_versions": "it was recorded with other lm-eval task versions",
    "lmeval_tasks_sha256": "it was recorded with other lm-eval task configs or documents",
}


def is_recording(source: str | Path) -> bool:
    """Whether `source` is a folder holding an evalsuite recording (a manifest with a recording schema)."""
    manifest = Path(source) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return str(json.loads(manifest.read_text(encoding="utf-8")).get("schema", "")).startswith(
            "evalsuite.recording/"
        )
    except (ValueError, AttributeError):
        return False


@dataclass(frozen=True)
class RecordedObservation:
    """One observation to record: the observer's name and identity, the inputs' hashes, the tasks that need
    it, the backend it was made on, and its compact form."""

    name: str
    identity: dict[str, Any]
    inputs: dict[str, Any]
    tasks: tuple[str, ...]
    backend: str
    observation: Observation
    # The observation's key when it was made: the key a replay plans it under where the recording is the
    # observation itself (`Recording.recorded_key`).
    key: str = ""


@dataclass(frozen=True)
class Recording:
    """A recording folder: `manifest.json` and one sub-folder per recorded observation."""

    path: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, source: str | Path) -> Recording:
        """Read and check a recording's manifest."""
        path = Path(source).resolve()
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise InputError("not a recording (no manifest.json)", path) from None
        except ValueError as exc:
            raise InputError(f"invalid JSON: {exc}", manifest_path) from None
        if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
            found = manifest.get("schema") if isinstance(manifest, dict) else None
            raise InputError(
                f"recording schema {found!r}; this evalsuite reads {SCHEMA!r} (record the reference again)",
                manifest_path,
            )
        for key in ("checkpoint", "observations"):
            if not isinstance(manifest.get(key), dict):
                raise InputError(f"manifest has no `{key}` table", manifest_path)
        return cls(path=path, manifest=manifest)

    @property
    def fingerprint(self) -> str:
        """The fingerprint (config and headers) of the checkpoint that was recorded."""
        return str(self.manifest["checkpoint"].get("fingerprint"))

    @property
    def content_sha256(self) -> str:
        """The content digest of the checkpoint that was recorded."""
        return str(self.manifest["checkpoint"].get("content_sha256"))

    @property
    def tasks(self) -> list[str]:
        """Every task some recorded observation serves."""
        names = {t for entry in self.manifest["observations"].values() for t in entry.get("tasks", [])}
        return sorted(names)

    def observation(
        self, task: str, name: str, identity: dict[str, Any], inputs: dict[str, Any], backend: str
    ) -> Observation:
        """The recorded observation `name` for `task`, refused (InputError, with the reason a user can act
        on) unless it was made with the same identity, on the same inputs and backend."""
        entry = self.manifest["observations"].get(name)
        if not isinstance(entry, dict):
            held = ", ".join(self.tasks) or "nothing"
            raise InputError(
                f"the recording has nothing `{task}` needs (it holds {held}); record it with --tasks {task}",
                self.path,
            )
        if entry.get("identity") != identity:
            recorded = entry.get("identity") or {}
            keys = sorted(k for k in {*recorded, *identity} if recorded.get(k) != identity.get(k))
            raise InputError(
                f"it was recorded with another `{task}` spec ({', '.join(keys) or 'settings'} differ)",
                self.path,
            )
        recorded_inputs = entry.get("inputs", {})
        for key, value in inputs.items():
            if recorded_inputs.get(key) != value:
                reason = INPUT_MISMATCH.get(key, f"it was recorded with other inputs ({key} differs)")
                raise InputError(f"{reason}: recorded {recorded_inputs.get(key)!r}, now {value!r}", self.path)
        if entry.get("backend", "hf") != backend:
            raise InputError(
                f"`{task}` needs the reference run by {backend}; it was recorded with {entry.get('backend')}",
                self.path,
            )
        folder = (self.path / name).resolve()
        if not _OBSERVER_NAME.fullmatch(name) or not folder.is_relative_to(self.path):
            raise InputError(f"observation name {name!r} leaves the recording folder", self.path)
        return Observation.load(folder)

    def recorded_key(self, name: str, identity: dict[str, Any]) -> str | None:
        """The key observation `name` was made under, where it was recorded with `identity` (None for a
        recording made before keys were kept, or another identity)."""
        entry = self.manifest["observations"].get(name)
        if not isinstance(entry, dict) or entry.get("identity") != identity:
            return None
        key = entry.get("key")
        return key if isinstance(key, str) and key else None

    def to_json(self) -> dict[str, Any]:
        """How results.json describes a recorded reference."""
        ckpt = self.manifest["checkpoint"]
        return {
            "path": str(self.path),
            "format": "recording",
            "fingerprint": self.fingerprint,
            "content_sha256": self.content_sha256,
            "recorded_from": {"path": ckpt.get("path"), "format": ckpt.get("format")},
            # Where it was recorded: a replay elsewhere mixes that machine's kernels into the comparison.
            "environment": self.manifest.get("environment"),
        }


def write_recording(
    out: Path,
    checkpoint: Checkpoint,
    content_sha256: str,
    entries: list[RecordedObservation],
    environment: dict[str, Any],
) -> Path:
    """Write a recording of `entries` into `out`, replacing any older recording there atomically."""
    out = Path(out)
    if out.exists() and not is_recording(out):
        raise InputError("exists and is not a recording; refusing to replace it", out)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        manifest: dict[str, Any] = {
            "schema": SCHEMA,
            "evalsuite": __version__,
            "checkpoint": {
                "path": str(checkpoint.path),
                "format": checkpoint.format,
                "fingerprint": checkpoint.fingerprint,
                "content_sha256": content_sha256,
                "model_type": checkpoint.model_type,
            },
            "tokenizer_sha256": checkpoint.tokenizer_sha256,
            "environment": environment,
            "observations": {},
        }
        for entry in entries:
            if not _OBSERVER_NAME.fullmatch(entry.name):
                raise ValueError(f"observer name {entry.name!r} is not a folder name")
            entry.observation.save(partial / entry.name)
            manifest["observations"][entry.name] = {
                "identity": entry.identity,
                "inputs": entry.inputs,
                "tasks": sorted(entry.tasks),
                "backend": entry.backend,
                "key": entry.key,
            }
        write_atomic(partial / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            out.rename(old)
        partial.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out
