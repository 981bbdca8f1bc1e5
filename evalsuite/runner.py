"""The runner: open both sides, plan, observe one side at a time, compare, and hand results to the report.

Only one model is ever resident: every task that needs a model observes the reference side, the reference
is freed, and only then is the candidate loaded. Each observation is saved under the run folder with a key of
everything it depends on, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from evalsuite import __version__
from evalsuite.backends import load_backend
from evalsuite.checkpoint import Checkpoint
from evalsuite.errors import EvalsuiteError, InputError
from evalsuite.run_folder import RunFolder
from evalsuite.side import BackendOptions, Side
from evalsuite.spec import default_spec_path, load_spec
from evalsuite.task import Observation, RunContext, Task, TaskResult, TaskSkipped, get_task

SCHEMA = "evalsuite.results/1"
PACKAGES = (
    "evalsuite",
    "torch",
    "transformers",
    "compressed-tensors",
    "safetensors",
    "tokenizers",
    "datasets",
    "accelerate",
    "numpy",
)


@dataclass
class RunRequest:
    """Everything `evalsuite run` was asked to do."""

    ckpt: str
    ref: str
    tasks: list[str]
    out: Path
    context: RunContext = field(default_factory=RunContext)
    ckpt_options: BackendOptions = field(default_factory=BackendOptions)
    ref_options: BackendOptions = field(default_factory=BackendOptions)
    thresholds: dict[str, dict[str, Any]] = field(default_factory=dict)  # task -> {metric: {min|max}}
    resume: bool = True


@dataclass
class RunResult:
    """The outcome: the results.json document and where it was written."""

    results: dict[str, Any]
    folder: RunFolder

    @property
    def exit_code(self) -> int:
        return {"pass": 0, "fail": 1}.get(self.results["verdict"], 2)


# A progress factory: (description, total) -> advance-by-one callable.
ProgressFactory = Callable[[str, int], Callable[[], None]]


def environment(options: BackendOptions) -> dict[str, Any]:
    """Package versions and the execution settings, for results.json."""
    import torch

    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    packages["evalsuite"] = __version__
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": packages,
        "device": options.device,
        "device_name": torch.cuda.get_device_name(0)
        if options.device != "cpu" and torch.cuda.is_available()
        else platform.processor() or "cpu",
        "dtype": options.dtype,
        "torch_threads": torch.get_num_threads(),
    }


def build_tasks(names: list[str], context: RunContext, thresholds: dict[str, dict[str, Any]]) -> list[Task]:
    """Instantiate the requested tasks with their validated specs; a bad spec fails here, before any model."""
    unknown = set(thresholds) - set(names)
    if unknown:
        raise InputError(f"thresholds given for tasks that are not run: {', '.join(sorted(unknown))}")
    tasks = []
    for name in dict.fromkeys(names):
        cls = get_task(name)
        overrides = {"thresholds": thresholds[name]} if name in thresholds else None
        spec = load_spec(cls.spec_model, default_spec_path(name), overrides)
        tasks.append(cls(spec, context))
    return tasks


def _inputs_digest(inputs: dict[str, Any]) -> dict[str, Any]:
    """The JSON-able scalar part of a task's inputs: hashes and counts, not arrays."""
    return {k: v for k, v in sorted(inputs.items()) if isinstance(v, str | int | float | bool)}


def observation_key(task: Task, side: Side, inputs: dict[str, Any]) -> str:
    """Identity of an observation: the task and its spec, the side's files and execution, the inputs."""
    doc = {
        "task": task.name,
        "spec": task.spec.sha256,
        "side": side.fingerprint(),
        "inputs": _inputs_digest(inputs),
        "evalsuite": __version__,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


@contextmanager
def resident(side: Side) -> Iterator[Side]:
    """Load the side's model for the duration of the block, and free it after."""
    side.backend = load_backend(side.checkpoint, side.options)
    try:
        yield side
    finally:
        side.backend.close()
        side.backend = None


def observe_side(
    side: Side,
    tasks: list[Task],
    inputs: dict[str, dict[str, Any]],
    folder: RunFolder,
    resume: bool,
    on_load: Callable[[Side], Any] | None = None,
) -> dict[str, Observation]:
    """Observe every task on one side, loading its model only if some observation is not already saved."""
    observations: dict[str, Observation] = {}
    todo = []
    for t in tasks:
        key = observation_key(t, side, inputs[t.name])
        saved = folder.observation(side.role, t.name)
        if resume and (saved / "observation.json").is_file():
            obs = Observation.load(saved)
            if obs.key == key:
                observations[t.name] = obs
                continue
        todo.append((t, key))
    if not todo:
        return observations
    if on_load is not None:
        on_load(side)
    with resident(side):
        for t, key in todo:
            scratch = folder.scratch(side.role, t.name)
            obs = t.observe(side, inputs[t.name], scratch)
            obs.key = obs.key or key
            obs.save(scratch)
            final = folder.commit_observation(side.role, t.name, scratch)
            observations[t.name] = Observation.load(final)
    return observations


def run(
    request: RunRequest, progress: ProgressFactory | None = None, on_load: Callable[[Side], Any] | None = None
) -> RunResult:
    """Run the request end to end and return results.json's document (not yet written)."""
    ref_ckpt = Checkpoint.open(request.ref)
    ckpt_ckpt = Checkpoint.open(request.ckpt)
    tasks = build_tasks(request.tasks, request.context, request.thresholds)
    ref = Side("ref", ref_ckpt, request.ref_options, progress=progress)
    ckpt = Side("ckpt", ckpt_ckpt, request.ckpt_options, progress=progress)
    folder = RunFolder(request.out)
    inputs: dict[str, dict[str, Any]] = {}
    results: dict[str, TaskResult] = {}
    for t in tasks:
        try:
            inputs[t.name] = t.prepare(ref, ckpt)
        except TaskSkipped as skip:
            results[t.name] = TaskResult(status="skipped", reason=str(skip))
    runnable = [t for t in tasks if t.name in inputs]
    observed = {
        side.role: observe_side(side, runnable, inputs, folder, request.resume, on_load)
        for side in (ref, ckpt)
    }
    for t in runnable:
        try:
            results[t.name] = t.compare(observed["ref"][t.name], observed["ckpt"][t.name], folder.artifacts)
        except EvalsuiteError as exc:
            results[t.name] = TaskResult(status="error", reason=str(exc))
    statuses = {r.status for r in results.values()}
    # A run in which nothing was compared has not shown anything: that is not a pass.
    verdict = (
        "error"
        if "error" in statuses or statuses <= {"skipped"}
        else "fail"
        if "fail" in statuses
        else "pass"
    )
    doc = {
        "schema": SCHEMA,
        "ckpt": {
            "path": str(ckpt_ckpt.path),
            "format": ckpt_ckpt.format,
            "fingerprint": ckpt_ckpt.fingerprint,
        },
        "ref": {"path": str(ref_ckpt.path), "format": ref_ckpt.format, "fingerprint": ref_ckpt.fingerprint},
        "environment": environment(request.ckpt_options),
        "verdict": verdict,
        "tasks": {t.name: results[t.name].to_json() for t in tasks},
    }
    return RunResult(results=doc, folder=folder)
