"""The runner: open both sides, plan, observe one side at a time, compare, and hand results to the report.

Only one model is ever resident: every task that needs a model observes the reference side, the reference
is freed, and only then is the candidate loaded. Each observation is saved under the run folder with a key of
everything it depends on, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from evalsuite import __version__
from evalsuite.backends import backend_identity, load_backend
from evalsuite.checkpoint import Checkpoint
from evalsuite.errors import EvalsuiteError, InputError
from evalsuite.recording import Recording, inputs_digest, is_recording, write_recording
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
    baseline: Path | None = None  # an accepted earlier results.json: fail on metrics that worsened
    specs: dict[str, Path] = field(default_factory=dict)  # task -> spec file replacing tasks/TASK.toml
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


def build_tasks(
    names: list[str],
    context: RunContext,
    thresholds: dict[str, dict[str, Any]],
    specs: dict[str, Path] | None = None,
) -> list[Task]:
    """Instantiate the requested tasks with their validated specs; a bad spec fails here, before any model."""
    for what, given in (("thresholds", thresholds), ("specs", specs or {})):
        unknown = set(given) - set(names)
        if unknown:
            raise InputError(f"{what} given for tasks that are not run: {', '.join(sorted(unknown))}")
    tasks = []
    for name in dict.fromkeys(names):
        cls = get_task(name)
        overrides = {"thresholds": thresholds[name]} if name in thresholds else None
        spec = load_spec(cls.spec_model, (specs or {}).get(name) or default_spec_path(name), overrides)
        tasks.append(cls(spec, context))
    return tasks


def observation_key(task: Task, side: Side, inputs: dict[str, Any]) -> str:
    """Identity of an observation: the task and its spec, the side's files and execution, the inputs."""
    doc = {
        "task": task.name,
        "spec": task.spec.observation_sha256,
        "side": side.fingerprint(),
        "backend": backend_identity(side.options),
        "inputs": inputs_digest(inputs),
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
    jobs: list[tuple[Task, str]],
    inputs: dict[str, dict[str, Any]],
    folder: RunFolder,
    resume: bool,
    on_load: Callable[[Side], Any] | None = None,
) -> dict[tuple[str, str], Observation]:
    """Observe each (task, role) job on one side, loading its model only if some observation is not saved.

    Several roles may share a side (`ckpt` and `ckpt@hf` when the candidate already runs on `hf`): the model
    is loaded once for all of them. A recorded side is read from its recording, after checking that it was
    made with the same specs and inputs.
    """
    observations: dict[tuple[str, str], Observation] = {}
    if side.recording is not None:
        for t, role in jobs:
            side.recording.check(t, inputs[t.name])
            observations[t.name, role] = side.recording.observation(t.name)
        return observations
    todo = []
    for t, role in jobs:
        key = observation_key(t, side, inputs[t.name])
        saved = folder.observation(role, t.name)
        if resume and (saved / "observation.json").is_file():
            obs = Observation.load(saved)
            if obs.key == key:
                observations[t.name, role] = obs
                continue
        todo.append((t, role, key))
    if not todo:
        return observations
    if on_load is not None:
        on_load(side)
    with resident(side):
        for t, role, key in todo:
            scratch = folder.scratch(role, t.name)
            obs = t.observe(side, inputs[t.name], scratch)
            obs.key = obs.key or key
            obs.save(scratch)
            final = folder.commit_observation(role, t.name, scratch)
            observations[t.name, role] = Observation.load(final)
    return observations


def role_sides(tasks: list[Task], ref: Side, ckpt: Side) -> dict[str, Side]:
    """The side of every role the tasks observe. `ckpt@BACKEND` is the candidate run by BACKEND; it shares
    the candidate's side (and its loaded model) when that already runs on BACKEND."""
    sides = {"ref": ref, "ckpt": ckpt}
    for t in tasks:
        for role in getattr(t, "roles", ("ref", "ckpt")):
            if role in sides:
                continue
            base, _, backend = role.partition("@")
            if base != "ckpt" or not backend:
                raise ValueError(f"task {t.name!r} observes unknown role {role!r}")
            if ckpt.checkpoint is None:
                raise InputError(f"task `{t.name}` needs the candidate's files, not a recording")
            options = dataclasses.replace(ckpt.options, backend=backend)
            sides[role] = (
                ckpt
                if options == ckpt.options
                else Side("ckpt", ckpt.checkpoint, options, progress=ckpt.progress)
            )
    return sides


def observe_all(
    tasks: list[Task],
    sides: dict[str, Side],
    inputs: dict[str, dict[str, Any]],
    folder: RunFolder,
    resume: bool,
    on_load: Callable[[Side], Any] | None,
) -> dict[tuple[str, str], Observation]:
    """Observe every (task, role) pair, one side resident at a time, the reference first."""
    jobs: dict[int, tuple[Side, list[tuple[Task, str]]]] = {}
    for role, side in sides.items():  # insertion order: ref, ckpt, then extra roles
        for t in tasks:
            if role in getattr(t, "roles", ("ref", "ckpt")):
                jobs.setdefault(id(side), (side, []))[1].append((t, role))
    observed: dict[tuple[str, str], Observation] = {}
    for side, side_jobs in jobs.values():
        observed |= observe_side(side, side_jobs, inputs, folder, resume, on_load)
    return observed


def open_side(role: str, source: str, options: BackendOptions, progress: ProgressFactory | None) -> Side:
    """A checkpoint side, or for the reference a recording of one."""
    if is_recording(source):
        if role != "ref":
            raise InputError("a recording can only be the reference (--ref), not the candidate", source)
        return Side(role, None, options, recording=Recording.open(source), progress=progress)
    return Side(role, Checkpoint.open(source), options, progress=progress)


def describe(side: Side) -> dict[str, Any]:
    """results.json's description of a side."""
    if side.recording is not None:
        return side.recording.to_json()
    ckpt = side.checkpoint
    return {"path": str(ckpt.path), "format": ckpt.format, "fingerprint": ckpt.fingerprint}


def prepare_all(
    tasks: list[Task], ref: Side, ckpt: Side
) -> tuple[dict[str, dict[str, Any]], dict[str, TaskResult]]:
    """Each task's shared inputs; tasks that cannot run here come back as `skipped` results."""
    inputs: dict[str, dict[str, Any]] = {}
    skipped: dict[str, TaskResult] = {}
    for t in tasks:
        try:
            inputs[t.name] = t.prepare(ref, ckpt)
        except TaskSkipped as skip:
            skipped[t.name] = TaskResult(status="skipped", reason=str(skip))
    return inputs, skipped


def run(
    request: RunRequest, progress: ProgressFactory | None = None, on_load: Callable[[Side], Any] | None = None
) -> RunResult:
    """Run the request end to end and return results.json's document (not yet written)."""
    ref = open_side("ref", request.ref, request.ref_options, progress)
    ckpt = open_side("ckpt", request.ckpt, request.ckpt_options, progress)
    tasks = build_tasks(request.tasks, request.context, request.thresholds, request.specs)
    baseline = load_results(request.baseline) if request.baseline is not None else None
    folder = RunFolder(request.out)
    inputs, results = prepare_all(tasks, ref, ckpt)
    # Files before models: file-only tasks compare the two checkpoints directly, before any model loads.
    for t in tasks:
        if t.name in inputs and not t.needs_model:
            try:
                results[t.name] = t.compare_files(ref, ckpt, inputs[t.name], folder.artifacts)
            except TaskSkipped as skip:
                results[t.name] = TaskResult(status="skipped", reason=str(skip))
    model_tasks = [t for t in tasks if t.name in inputs and t.needs_model]
    sides = role_sides(model_tasks, ref, ckpt)
    observed = observe_all(model_tasks, sides, inputs, folder, request.resume, on_load)
    for t in tasks:
        if t.name in results:
            continue
        try:
            roles = getattr(t, "roles", ("ref", "ckpt"))
            result = t.compare(*(observed[t.name, role] for role in roles), folder.artifacts)
        except EvalsuiteError as exc:
            result = TaskResult(status="error", reason=str(exc))
        results[t.name] = result
    for t in tasks:
        if baseline is not None and results[t.name].status in ("pass", "fail"):
            results[t.name] = with_regression_checks(t, results[t.name], baseline, request.baseline)
    statuses = {r.status for r in results.values()}
    # A run in which nothing was compared has not shown anything: that is not a pass.
    if "error" in statuses or statuses <= {"skipped"}:
        verdict = "error"
    else:
        verdict = "fail" if "fail" in statuses else "pass"
    doc = {
        "schema": SCHEMA,
        "ckpt": describe(ckpt),
        "ref": describe(ref),
        "environment": environment(request.ckpt_options),
        "verdict": verdict,
        "tasks": {t.name: results[t.name].to_json() for t in tasks},
    }
    if request.baseline is not None:
        doc["baseline"] = str(request.baseline)
    return RunResult(results=doc, folder=folder)


def load_results(path: Path) -> dict[str, Any]:
    """A results.json document (an accepted baseline, or a run to re-render), checked for its schema."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError("results file does not exist", path) from None
    except ValueError as exc:
        raise InputError(f"invalid JSON: {exc}", path) from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("tasks"), dict):
        raise InputError(f"not an evalsuite results file (schema {SCHEMA})", path)
    return doc


def with_regression_checks(
    task: Task, result: TaskResult, baseline: dict[str, Any], path: Path
) -> TaskResult:
    """Add one check per metric of the spec's `[regression]` table: no worse than the baseline's value.

    A baseline measured on other inputs (any `*_sha256` metric differs) cannot be compared: refused.
    """
    entry = baseline["tasks"].get(task.name)
    if entry is None or not entry.get("metrics"):
        raise InputError(f"the baseline has no `{task.name}` metrics to compare with", path)
    before = entry["metrics"]
    for name, value in result.metrics.items():
        if name.endswith("_sha256") and name in before and before[name] != value:
            raise InputError(f"the baseline was measured on other inputs ({task.name}.{name} differs)", path)
    checks = list(result.checks)
    for name, tolerance in task.spec.regression.items():
        if isinstance(before.get(name), int | float) and not isinstance(before.get(name), bool):
            checks.append(tolerance.check(name, result.metrics.get(name), float(before[name])))
    return TaskResult.from_checks(result.metrics, checks, artifacts=result.artifacts)


@dataclass
class RecordRequest:
    """Everything `evalsuite record` was asked to do."""

    ckpt: str
    tasks: list[str]
    out: Path
    context: RunContext = field(default_factory=RunContext)
    options: BackendOptions = field(default_factory=BackendOptions)
    specs: dict[str, Path] = field(default_factory=dict)


def record(
    request: RecordRequest,
    progress: ProgressFactory | None = None,
    on_load: Callable[[Side], Any] | None = None,
) -> Path:
    """Observe one checkpoint and save what later comparisons against it need (see `evalsuite.recording`)."""
    side = open_side("ref", request.ckpt, request.options, progress)
    if side.recording is not None:
        raise InputError("is already a recording; record a checkpoint", request.ckpt)
    tasks = build_tasks(request.tasks, request.context, {}, request.specs)
    inputs, skipped = prepare_all(tasks, side, side)
    if skipped:
        name, result = next(iter(skipped.items()))
        raise InputError(
            f"task `{name}` cannot be recorded from this checkpoint: {result.reason}", request.ckpt
        )
    unrecordable = [t.name for t in tasks if not t.needs_model or getattr(t, "record", None) is None]
    if unrecordable:
        raise InputError(f"these tasks have nothing to record: {', '.join(unrecordable)}")
    with tempfile.TemporaryDirectory(prefix=".evalsuite-record-", dir=Path(request.out).parent) as work:
        jobs = [(t, "ref") for t in tasks]
        observed = observe_side(side, jobs, inputs, RunFolder(Path(work)), False, on_load)
        observations = {name: obs for (name, _), obs in observed.items()}
        return write_recording(
            Path(request.out), side.checkpoint, tasks, inputs, observations, environment(request.options)
        )
