"""The Task piece: what a task plugin is, what it returns, and the registry that finds it by name.

A task is a small class registered with `@task("name")`: `prepare` makes the inputs both sides share (and
refuses sides that cannot be compared), `observe` runs one side and knows nothing of the other, `compare`
turns two observations into a `TaskResult` and knows nothing of models. Third-party tasks register through
the `evalsuite.tasks` entry-point group.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import numpy as np

from evalsuite.corpus import Corpus, load_corpus
from evalsuite.errors import InputError
from evalsuite.run_folder import write_atomic
from evalsuite.side import Side
from evalsuite.spec import Check, TaskSpec

Status = Literal["pass", "fail", "error", "skipped"]
MetricValue = float | int | bool | str | None


@dataclass
class Observation:
    """What one side produced for one task: JSON metadata, compact arrays, and large side files.

    `key` identifies everything the observation depends on (checkpoint, backend, spec, inputs), so a
    resumed run reuses an observation only when nothing it depends on has changed.
    """

    task: str
    key: str
    meta: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)

    def save(self, folder: Path) -> None:
        """Write into `folder`; observation.json goes last, so its presence means the rest is complete."""
        from safetensors.numpy import save_file

        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / "arrays.safetensors.tmp"
        save_file({k: np.ascontiguousarray(v) for k, v in self.arrays.items()}, str(tmp))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)  # safetensors writes 0600; a recording is meant to be shared
        tmp.replace(folder / "arrays.safetensors")
        doc = {
            "task": self.task,
            "key": self.key,
            "meta": self.meta,
            "files": {k: str(p.relative_to(folder)) for k, p in self.files.items()},
        }
        write_atomic(folder / "observation.json", json.dumps(doc, indent=1, sort_keys=True))

    @classmethod
    def load(cls, folder: Path) -> Observation:
        """Read an observation saved by `save`."""
        from safetensors.numpy import load_file

        try:
            doc = json.loads((folder / "observation.json").read_text())
            arrays = load_file(str(folder / "arrays.safetensors"))
        except (OSError, ValueError) as exc:
            raise InputError(f"unreadable observation ({exc})", folder) from None
        files = {k: folder / rel for k, rel in doc["files"].items()}
        for name, path in files.items():
            if not path.resolve().is_relative_to(folder.resolve()) or not path.is_file():
                raise InputError(f"observation file {name!r} is missing or outside the folder", folder)
        return cls(task=doc["task"], key=doc["key"], meta=doc["meta"], arrays=arrays, files=files)


@dataclass
class TaskResult:
    """One task's entry in results.json (see DESIGN.md, the contract)."""

    status: Status
    metrics: dict[str, MetricValue] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    artifacts: dict[str, str] = field(default_factory=dict)
    reason: str | None = None
    # Rows a person reads in report.md (one per prompt, say); kept in results.json so that the report can be
    # re-rendered from it alone. Values are strings, numbers or booleans.
    details: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_checks(cls, metrics: dict[str, MetricValue], checks: list[Check], **kw: Any) -> TaskResult:
        """`pass` when every check passes, else `fail`. A task with no check cannot pass."""
        status: Status = "pass" if checks and all(c.passed for c in checks) else "fail"
        return cls(status=status, metrics=metrics, checks=checks, **kw)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"status": self.status}
        if self.reason is not None:
            doc["reason"] = self.reason
        doc["metrics"] = self.metrics
        doc["checks"] = [c.model_dump() for c in self.checks]
        doc["artifacts"] = self.artifacts
        if self.details:
            doc["details"] = self.details
        return doc


class TaskSkipped(Exception):
    """Raised by `prepare` when a task cannot run on these sides or this machine; carries the reason."""


class Task(Protocol):
    """The shape of a task plugin. `name`, `needs_model` and `spec_model` are class attributes.

    A model task (`needs_model = True`) implements `observe` and `compare`. It observes the roles in its
    optional `roles` attribute, in order (default `("ref", "ckpt")`); `ckpt@BACKEND` is the candidate executed
    by another backend, e.g. `ckpt@intref`. `compare` receives one observation per role, then the artifacts
    folder. A model task that can be recorded also implements `record(observation, folder) -> Observation`.

    A file-only task (`needs_model = False`) implements `compare_files(ref, ckpt, inputs, artifacts)` instead:
    it streams both checkpoints' files and no model is ever loaded for it.
    """

    name: ClassVar[str]
    needs_model: ClassVar[bool]
    spec_model: ClassVar[type[TaskSpec]]
    spec: TaskSpec

    def prepare(self, ref: Side, ckpt: Side) -> dict[str, Any]:
        """Inputs both sides share (with their hashes); raise InputError when the sides cannot be compared,
        TaskSkipped when the task cannot run on them or on this machine."""
        ...

    def observe(self, side: Side, inputs: dict[str, Any], folder: Path) -> Observation:
        """Run one side; large files go into `folder`."""
        ...

    def compare(self, ref: Observation, ckpt: Observation, artifacts: Path) -> TaskResult:
        """Metrics and checks from the observations of its roles; plots and tables go into `artifacts`."""
        ...


@dataclass
class RunContext:
    """What tasks may ask of the run beyond their spec: the text to score, chosen once for both sides."""

    corpus_name: str = "auto"
    text_file: Path | None = None
    allow_download: bool = False

    @cached_property
    def corpus(self) -> Corpus:
        return load_corpus(self.corpus_name, text_file=self.text_file, allow_download=self.allow_download)


_REGISTRY: dict[str, type] = {}


def task(name: str) -> Callable[[type], type]:
    """Class decorator that registers a task plugin under `name`."""

    def register(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"task {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register


def registered_tasks() -> dict[str, type]:
    """Every task by name: the built-in ones and those of installed `evalsuite.tasks` entry points."""
    import evalsuite.tasks  # noqa: F401  (importing registers the built-in tasks)

    for ep in entry_points(group="evalsuite.tasks"):
        if ep.name not in _REGISTRY:
            ep.load()
    return dict(sorted(_REGISTRY.items()))


def get_task(name: str) -> type:
    """The task class registered as `name`; InputError listing the known names otherwise."""
    tasks = registered_tasks()
    if name not in tasks:
        raise InputError(f"unknown task {name!r}; known tasks: {', '.join(tasks)}")
    return tasks[name]
