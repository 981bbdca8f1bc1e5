"""Recordings: an observed reference side saved to disk, so that `--ref` need not load the model again.

`evalsuite record` observes one checkpoint and keeps, per task, the compact observation that a later
comparison needs (safetensors arrays and JSON, never pickle), with a manifest of everything it depends on: the
checkpoint's fingerprint, each task's spec, the inputs' hashes, the tokenizer, the package versions. A run
given a recording as `--ref` reads it instead of loading a model, and refuses it, with the reason, when it
was made from another spec, text, tokenizer or protocol: a stale reference is never compared silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evalsuite import __version__
from evalsuite.checkpoint import Checkpoint
from evalsuite.errors import InputError
from evalsuite.run_folder import write_atomic
from evalsuite.task import Observation, Task

SCHEMA = "evalsuite.recording/1"
MANIFEST = "manifest.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)

# What a differing input means, in the words a user needs to act on it.
INPUT_MISMATCH = {
    "corpus_sha256": "it was recorded on another text",
    "corpus": "it was recorded on another corpus",
    "n_tokens_text": "the candidate's tokenizer splits the text differently (another tokenizer)",
    "tokens_sha256": "the candidate's tokenizer gives other token ids (another tokenizer)",
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


def tokenizer_sha256(checkpoint: Checkpoint) -> str:
    """Hash of the tokenizer files present in a checkpoint folder (names and bytes)."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = checkpoint.path / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def inputs_digest(inputs: dict[str, Any]) -> dict[str, Any]:
    """The JSON-able scalar part of a task's inputs: hashes, names and counts, not arrays."""
    return {k: v for k, v in sorted(inputs.items()) if isinstance(v, str | int | float | bool)}


@dataclass(frozen=True)
class Recording:
    """A recording folder: `manifest.json` and one sub-folder per recorded task."""

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
            raise InputError(f"recording schema {found!r}; this evalsuite reads {SCHEMA!r}", manifest_path)
        for key in ("checkpoint", "tasks"):
            if not isinstance(manifest.get(key), dict):
                raise InputError(f"manifest has no `{key}` table", manifest_path)
        return cls(path=path, manifest=manifest)

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the checkpoint that was recorded."""
        return str(self.manifest["checkpoint"].get("fingerprint"))

    def check(self, task: Task, inputs: dict[str, Any]) -> None:
        """Refuse this recording for `task` unless it was made with the same spec and the same inputs."""
        entry = self.manifest["tasks"].get(task.name)
        if entry is None:
            recorded = ", ".join(sorted(self.manifest["tasks"])) or "nothing"
            raise InputError(
                f"the recording has no `{task.name}` (it holds {recorded}); "
                f"record it with --tasks {task.name}",
                self.path,
            )
        if entry.get("spec_sha256") != task.spec.observation_sha256:
            raise InputError(
                f"it was recorded with another `{task.name}` spec (protocol or record settings differ)",
                self.path,
            )
        recorded_inputs = entry.get("inputs", {})
        for key, value in inputs_digest(inputs).items():
            if recorded_inputs.get(key) != value:
                reason = INPUT_MISMATCH.get(key, f"it was recorded with other inputs ({key} differs)")
                raise InputError(f"{reason}: recorded {recorded_inputs.get(key)!r}, now {value!r}", self.path)

    def observation(self, task_name: str) -> Observation:
        """The recorded observation of one task."""
        folder = self.path / task_name
        if not folder.resolve().is_relative_to(self.path):
            raise InputError(f"task name {task_name!r} leaves the recording folder", self.path)
        return Observation.load(folder)

    def to_json(self) -> dict[str, Any]:
        """How results.json describes a recorded reference."""
        ckpt = self.manifest["checkpoint"]
        return {
            "path": str(self.path),
            "format": "recording",
            "fingerprint": self.fingerprint,
            "recorded_from": {"path": ckpt.get("path"), "format": ckpt.get("format")},
        }


def write_recording(
    out: Path,
    checkpoint: Checkpoint,
    tasks: list[Task],
    inputs: dict[str, dict[str, Any]],
    observations: dict[str, Observation],
    environment: dict[str, Any],
) -> Path:
    """Write the recording of `observations` into `out`, replacing any older recording there atomically."""
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
                "model_type": checkpoint.model_type,
            },
            "tokenizer_sha256": tokenizer_sha256(checkpoint),
            "environment": environment,
            "tasks": {},
        }
        for t in tasks:
            record = getattr(t, "record", None)
            if record is None:
                raise InputError(f"task `{t.name}` cannot be recorded")
            compact = record(observations[t.name], partial / t.name)
            compact.save(partial / t.name)
            manifest["tasks"][t.name] = {
                "spec_sha256": t.spec.observation_sha256,
                "spec": t.spec.model_dump(mode="json", exclude=set(t.spec.COMPARE_ONLY)),
                "inputs": inputs_digest(inputs[t.name]),
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
