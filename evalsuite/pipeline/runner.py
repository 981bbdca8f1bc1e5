"""The runner: plan from the files, observe one side at a time, compare, and hand results to the report.

A run has three phases: the plan is `evalsuite.pipeline.plan`'s, observing `evalsuite.pipeline.observe`'s, and
this module runs them, compares and gives the verdict (and records a reference).

1. **Plan**, from files alone, before any model loads: both sides opened and their options checked; every
   task's spec and thresholds validated; each task's shared inputs prepared (tokens, prompts, images: a
   mismatched tokenizer is refused here); the baseline checked against those inputs; every observation the
   tasks need identified by its key (a digest of every byte of the side's weights, the execution and its
   conventions, the observer's identity and the inputs' hashes), so that one observation serves every task
   that needs it; a recorded reference checked for each of them; and the load plan of every side that will
   be loaded checked on the meta device (a checkpoint Transformers would fill with random weights is
   refused now, not after an hour on the reference).
2. **Observe**: the observations not already saved under their key, grouped by side and execution, one model
   resident at a time, the reference first. Each observation is saved under its key as it completes, and an
   interrupted one resumes from what its observer left in its folder.
3. **Compare**: each task compares the observations of its needs; file-only tasks compare the checkpoints.
"""

from __future__ import annotations

import dataclasses
import platform
import tempfile
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from evalsuite.backends import check_load_plan
from evalsuite.backends.options import BackendOptions
from evalsuite.contract.results import RESULTS_SCHEMA as SCHEMA
from evalsuite.contract.results import SCHEMA_VERSION, not_comparable
from evalsuite.errors import EvalsuiteError, InputError
from evalsuite.files.digest import DigestCache
from evalsuite.files.run_folder import RunFolder
from evalsuite.machine import describe_machine, execution_differences, measured_drift, replay_caveat
from evalsuite.pipeline.observe import OnLoad, observe_all
from evalsuite.pipeline.plan import (
    RunPlan,
    RunRequest,
    build_tasks,
    check_files_a_task_reads,
    check_out_folder,
    load_results,
    plan_observations,
    plan_run,
    prepare_all,
    stream_if_needed,
)
from evalsuite.protocol.recording import RecordedObservation, write_recording
from evalsuite.protocol.side import open_side
from evalsuite.protocol.task import (
    FileTask,
    ModelTask,
    Progress,
    RecordableObserver,
    RunContext,
    Task,
    TaskResult,
    TaskSkipped,
    inputs_digest,
    no_progress,
    takes_progress,
)
from evalsuite.stats import claims
from evalsuite.version import __version__

# Planning lives in evalsuite.pipeline.plan; the request and the tasks a run is made of are imported with the
# run.
__all__ = ["RecordRequest", "RunRequest", "RunResult", "build_tasks", "plan_run", "record", "run"]


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
    "lm-eval",
)


@dataclass
class RunResult:
    """The outcome: the results.json document and where it was written."""

    results: dict[str, Any]
    folder: RunFolder

    @property
    def exit_code(self) -> int:
        return {"pass": 0, "fail": 1}.get(self.results["verdict"], 2)


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
        "machine": describe_machine(options.device),
    }


def run(
    request: RunRequest,
    progress: Progress | None = None,
    on_load: OnLoad | None = None,
    digests: DigestCache | None = None,
) -> RunResult:
    """Run the request end to end and return results.json's document (not yet written)."""
    digests = digests or DigestCache.default()
    plan = plan_run(request, digests)
    folder = RunFolder(request.out)
    results: dict[str, TaskResult] = dict(plan.skipped)
    # Files before models: file-only tasks compare the two checkpoints directly, before any model loads.
    for t in plan.tasks:
        if t.name in plan.inputs and isinstance(t, FileTask):
            try:
                extra = {"progress": progress} if progress is not None and takes_progress(t) else {}
                results[t.name] = t.compare_files(
                    plan.ref, plan.ckpt, plan.inputs[t.name], folder.artifacts, **extra
                )
            except TaskSkipped as skip:
                results[t.name] = TaskResult(status="skipped", reason=str(skip))
    loads: list[dict[str, Any]] = []
    observed = observe_all(plan, folder, request.resume, progress or no_progress, on_load, log=loads)
    for t in plan.tasks:
        if t.name in results:
            continue
        try:
            results[t.name] = t.compare(
                {label: observed[key] for label, key in plan.wiring[t.name].items()}, folder.artifacts
            )
        except EvalsuiteError as exc:
            results[t.name] = TaskResult(status="error", reason=str(exc))
    for t in plan.tasks:
        results[t.name].spec_sha256 = t.spec.measured_sha256
        differences = getattr(t, "paired_differences", None)
        if differences is not None and results[t.name].status in ("pass", "fail"):
            results[t.name].differences = differences(results[t.name].metrics)
    with_holm(results)
    if request.baseline is not None:
        baseline = load_results(request.baseline)
        for t in plan.tasks:
            if results[t.name].status in ("pass", "fail"):
                results[t.name] = with_regression_checks(t, results[t.name], baseline)
    for t in plan.tasks:
        # The task's own descriptions (completed with what it measured) over its class's.
        described = {**getattr(t, "metric_descriptions", {}), **results[t.name].descriptions}
        results[t.name].descriptions = {k: v for k, v in described.items() if k in results[t.name].metrics}
        results[t.name].spec = plan.provenance[t.name]
    if request.keep_observations:
        folder.prune_observations(keep=set(plan.observations))
    else:
        folder.remove_observations()
    statuses = {r.status for r in results.values()}
    # A run in which nothing was compared has not shown anything: that is not a pass.
    if "error" in statuses or statuses <= {"skipped"}:
        verdict = "error"
    else:
        verdict = "fail" if "fail" in statuses else "pass"
    doc = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "ckpt": plan.ckpt.describe(),
        "ref": plan.ref.describe(),
        "environment": environment(request.ckpt_options),
        "verdict": verdict,
        "tasks": {t.name: results[t.name].to_json() for t in plan.tasks},
        # Each model this run loaded: its side, execution, observations and decoder layers read.
        "model_loads": loads,
    }
    if request.baseline is not None:
        doc["baseline"] = str(request.baseline)
    if plan.ref.recording is not None:
        replay = replay_environment(doc["ref"].get("environment"), doc["environment"])
        if replay is not None:
            doc["replay"] = replay
    return RunResult(results=doc, folder=folder)


def replay_environment(recorded: dict[str, Any] | None, here: dict[str, Any]) -> dict[str, Any] | None:
    """results.json's `replay` block when the reference is a recording made under another execution
    environment: what differs, the drift `bench/drift.py` measured, and the caveat that says it; else None."""
    differences = execution_differences(recorded, here)
    if not differences:
        return None
    drift = measured_drift()
    return {
        "environment_differences": differences,
        "measured_drift": drift,
        "caveat": replay_caveat(differences, drift),
    }


def with_holm(results: dict[str, TaskResult]) -> None:
    """Each task's paired differences from the reference with their p adjusted by Holm's correction over
    every difference of the run (`claims.holm`): the family the reports' verdict paragraph is judged on."""
    every = [(r, i) for r in results.values() for i in range(len(r.differences))]
    adjusted = claims.holm([r.differences[i].p for r, i in every])
    for (r, i), p in zip(every, adjusted, strict=True):
        r.differences[i] = dataclasses.replace(r.differences[i], p_holm=p)


def with_regression_checks(task: Task, result: TaskResult, baseline: dict[str, Any]) -> TaskResult:
    """Add one check per metric of the spec's `[regression]` table: no worse than the baseline's value, where
    the baseline measured the same quantity (its spec's digest and the windows the metric used: results.json's
    `identity`); a metric measured otherwise is listed as not comparable, with why, never compared.
    Everything else of the result (details, artifacts, notes) is kept."""
    entry = baseline["tasks"][task.name]
    before = entry["metrics"]
    checks = list(result.checks)
    apart = dict(result.not_comparable)
    for name, tolerance in task.spec.regression.items():
        if isinstance(before.get(name), int | float) and not isinstance(before.get(name), bool):
            why = not_comparable(name, entry.get("identity"), result.identity())
            if why is not None:
                apart[name] = why
                continue
            checks.append(tolerance.check(name, result.metrics.get(name), float(before[name])))
    status = "pass" if checks and all(c.passed for c in checks) else "fail"
    return dataclasses.replace(result, checks=checks, status=status, not_comparable=apart)


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
    progress: Progress | None = None,
    on_load: OnLoad | None = None,
    digests: DigestCache | None = None,
) -> Path:
    """Observe one checkpoint and save what later comparisons against it need (see
    `evalsuite.protocol.recording`)."""
    digests = digests or DigestCache.default()
    out = Path(request.out)
    if not out.parent.is_dir():
        raise InputError("the folder to hold the recording does not exist", out.parent)
    check_out_folder(out)
    options = request.options.check()
    side = open_side("ref", request.ckpt, options)
    if side.recording is not None:
        raise InputError("is already a recording; record a checkpoint", request.ckpt)
    stream_if_needed(side)
    tasks = build_tasks(request.tasks, request.context, specs=request.specs)
    check_files_a_task_reads(tasks, request.context)
    inputs, skipped = prepare_all(tasks, side, side)
    if skipped:
        name, result = next(iter(skipped.items()))
        raise InputError(
            f"task `{name}` cannot be recorded from this checkpoint: {result.reason}", request.ckpt
        )
    unrecordable = [
        t.name
        for t in tasks
        if not isinstance(t, ModelTask)
        or not all(isinstance(n.observer, RecordableObserver) for n in t.needs() if n.role == "ref")
    ]
    if unrecordable:
        raise InputError(f"these tasks have nothing to record: {', '.join(unrecordable)}")
    observations, _ = plan_observations(tasks, inputs, {"ref": side, "ckpt": side}, digests, roles=("ref",))
    for options in {p.options for p in observations.values()}:
        check_load_plan(side.checkpoint, options)
    allow_download = request.context.allow_download
    plan = RunPlan(side, side, tasks, inputs, {}, observations, {}, allow_download=allow_download)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.observing-", dir=out.parent) as work:
        observed = observe_all(plan, RunFolder(Path(work)), False, progress or no_progress, on_load)
        entries = []
        for key, planned in observations.items():
            observer = planned.need.observer
            compact = observer.record(observed[key], Path(work) / "compact")
            entries.append(
                RecordedObservation(
                    name=observer.name,
                    identity=observer.identity(),
                    inputs=inputs_digest(planned.inputs),
                    tasks=tuple(planned.tasks),
                    backend=planned.options.backend,
                    observation=compact,
                    key=key,
                )
            )
        return write_recording(
            out, side.checkpoint, side.content_sha256(digests), entries, environment(options)
        )
