"""The runner: plan from the files, observe one side at a time, compare, and hand results to the report.

A run has three phases.

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
import fnmatch
import hashlib
import json
import platform
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from evalsuite import __version__
from evalsuite.backends import check_load_plan, load_backend, load_pair
from evalsuite.backends.memory import streamed_if_needed
from evalsuite.backends.options import BackendOptions
from evalsuite.digest import DigestCache
from evalsuite.errors import EvalsuiteError, InputError
from evalsuite.machine import describe_machine, execution_differences, measured_drift, replay_caveat
from evalsuite.observation import Observation
from evalsuite.recording import RecordedObservation, write_recording
from evalsuite.registry import get_task, spec_source
from evalsuite.run_folder import RunFolder
from evalsuite.side import Side, open_side
from evalsuite.spec import Threshold, flat_metric_tables, load_spec
from evalsuite.task import (
    FileTask,
    Inputs,
    ModelTask,
    Need,
    Progress,
    RecordableObserver,
    RunContext,
    Task,
    TaskResult,
    TaskSkipped,
    inputs_digest,
    no_progress,
)

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
    "lm-eval",
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
    thresholds_file: Path | None = None  # where `thresholds` came from, named in its errors
    baseline: Path | None = None  # an accepted earlier results.json: fail on metrics that worsened
    specs: dict[str, Path] = field(default_factory=dict)  # task -> spec file replacing tasks/TASK.toml
    resume: bool = True
    keep_observations: bool = True  # False: the run folder keeps its reports only (the demo)


@dataclass
class RunResult:
    """The outcome: the results.json document and where it was written."""

    results: dict[str, Any]
    folder: RunFolder

    @property
    def exit_code(self) -> int:
        return {"pass": 0, "fail": 1}.get(self.results["verdict"], 2)


# Called with (side, options) just before a model is loaded: the CLI prints one line.
OnLoad = Callable[[Side, BackendOptions], Any]


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


# --------------------------------------------------------------------------------------------------------
# Tasks and specs
# --------------------------------------------------------------------------------------------------------


def build_tasks(
    names: list[str],
    context: RunContext,
    thresholds: dict[str, dict[str, Any]] | None = None,
    specs: dict[str, Path] | None = None,
    thresholds_file: Path | None = None,
) -> list[Task]:
    """Instantiate the requested tasks with their validated specs; a bad spec, an unknown task or a
    threshold on a metric the task does not report fails here, before any model."""
    thresholds, specs = thresholds or {}, specs or {}
    if not names:
        raise InputError("no task to run: --tasks names none (e.g. --tasks ppl,tensors)")
    for what, given in (("thresholds", thresholds), ("--spec", specs)):
        unknown = set(given) - set(names)
        if unknown:
            raise InputError(
                f"{what} given for tasks that are not run: {', '.join(sorted(unknown))}",
                thresholds_file if what == "thresholds" else None,
            )
    tasks = []
    for name in dict.fromkeys(names):
        cls = get_task(name)
        overrides = None
        if name in thresholds:
            overrides = {"thresholds": _checked_thresholds(cls, thresholds[name], thresholds_file)}
        spec = load_spec(cls.spec_model, specs.get(name) or spec_source(cls), overrides)
        tasks.append(cls(spec, context))
    return tasks


def _checked_thresholds(cls: type, table: Any, where: Path | None) -> dict[str, Any]:
    """`--thresholds` entries of one task, each a valid bound on a metric the task reports."""
    from pydantic import ValidationError

    if not isinstance(table, dict):
        raise InputError(f"[{cls.name}] must be a table of metric = {{ min = …, max = … }}", where)
    # A name may be a pattern (`*.recovery`): tasks whose metrics are named per sub-task list them so.
    known = getattr(cls, "metric_names", ())
    checked = {}
    for metric, bound in flat_metric_tables(table).items():
        if known and not any(fnmatch.fnmatchcase(metric, pattern) for pattern in known):
            raise InputError(
                f"[{cls.name}] {metric}: `{cls.name}` reports no such metric (thresholds apply to: "
                f"{', '.join(known)})",
                where,
            )
        try:
            checked[metric] = Threshold.model_validate(bound).model_dump(exclude_none=True)
        except ValidationError as exc:
            raise InputError(f"[{cls.name}] {metric}: {exc.errors()[0]['msg']}", where) from None
    return checked


# --------------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------------


@dataclass
class PlannedObservation:
    """One observation the run needs: on which side, how executed, by which observer, for which tasks.

    A `pair` observation is made on both sides at once: `side` is the candidate, `partner` the reference
    (`partner_options` its execution). `consumes` maps the labels of the observations it is handed to their
    keys.
    """

    key: str
    side: Side
    options: BackendOptions
    need: Need
    inputs: Inputs
    tasks: list[str]
    partner: Side | None = None
    partner_options: BackendOptions | None = None
    consumes: dict[str, str] = field(default_factory=dict)

    @property
    def role(self) -> str:
        """`ref`, `ckpt`, or `pair` for both sides at once."""
        return "pair" if self.partner is not None else self.side.role


@dataclass
class RunPlan:
    """Everything decided before any model loads."""

    ref: Side
    ckpt: Side
    tasks: list[Task]
    inputs: dict[str, Inputs]
    skipped: dict[str, TaskResult]
    observations: dict[str, PlannedObservation]  # by key, in observation order (reference first)
    wiring: dict[str, dict[str, str]]  # task -> label -> key
    provenance: dict[str, dict[str, str]] = field(default_factory=dict)  # task -> where its spec came from


def side_options(side: Side, need: Need) -> BackendOptions:
    """How a need's side is executed: the side's own options, or the need's backend and conventions;
    streamed when the need asks for it (a `pair` need always does)."""
    if need.backend is None or (need.backend == side.options.backend and not need.conventions):
        options = side.options
    else:
        options = side.options.with_backend(need.backend, need.conventions)
    if need.streamed or need.role == "pair":
        options = dataclasses.replace(options, stream=True)
    return options


def observation_key(
    side: Side,
    options: BackendOptions,
    need: Need,
    inputs: Inputs,
    digests: DigestCache,
    consumes: dict[str, str] | None = None,
    partner: tuple[Side, BackendOptions] | None = None,
) -> str:
    """Identity of an observation: every byte of the side's weights, its execution with its conventions,
    the observer and what shapes it, the inputs' hashes, the evalsuite version; and for an observation made
    from others, their keys; for a pair, the reference side's weights and execution too."""
    doc: dict[str, Any] = {
        "observer": need.observer.name,
        "identity": need.observer.identity(),
        "inputs": inputs_digest(inputs),
        "content_sha256": side.content_sha256(digests),
        "execution": options.to_json(),
        "evalsuite": __version__,
    }
    if consumes:
        doc["consumes"] = consumes
    if partner is not None:
        doc["partner"] = {
            "content_sha256": partner[0].content_sha256(digests),
            "execution": partner[1].to_json(),
        }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def prepare_all(tasks: list[Task], ref: Side, ckpt: Side) -> tuple[dict[str, Inputs], dict[str, TaskResult]]:
    """Each task's shared inputs; tasks that cannot run here come back as `skipped` results."""
    inputs: dict[str, Inputs] = {}
    skipped: dict[str, TaskResult] = {}
    for t in tasks:
        try:
            inputs[t.name] = t.prepare(ref, ckpt)
        except TaskSkipped as skip:
            skipped[t.name] = TaskResult(status="skipped", reason=str(skip))
    return inputs, skipped


def plan_observations(
    tasks: list[Task],
    inputs: dict[str, Inputs],
    sides: dict[str, Side],
    digests: DigestCache,
    roles: tuple[str, ...] = ("ref", "ckpt", "pair"),
) -> tuple[dict[str, PlannedObservation], dict[str, dict[str, str]]]:
    """Every distinct observation the model tasks need of the `roles` sides, by key, and which key each
    task's label gets. A need that consumes others is planned after them (a task lists them first)."""
    planned: dict[str, PlannedObservation] = {}
    wiring: dict[str, dict[str, str]] = {}
    for t in tasks:
        if t.name not in inputs or not isinstance(t, ModelTask):
            continue
        wiring[t.name] = {}
        for need in t.needs():
            if need.role not in roles or not all(label in wiring[t.name] for label in need.consumes):
                continue
            consumes = {label: wiring[t.name][label] for label in need.consumes}
            side = sides["ckpt" if need.role == "pair" else need.role]
            partner = None
            if need.role == "pair":
                partner = (sides["ref"], dataclasses.replace(sides["ref"].options, stream=True))
            options = side_options(side, need)
            key = observation_key(side, options, need, inputs[t.name], digests, consumes, partner)
            wiring[t.name][need.label] = key
            if key in planned:
                planned[key].tasks.append(t.name)
            else:
                planned[key] = PlannedObservation(
                    key,
                    side,
                    options,
                    need,
                    inputs[t.name],
                    [t.name],
                    partner=partner[0] if partner else None,
                    partner_options=partner[1] if partner else None,
                    consumes=consumes,
                )
    # The reference first (all its loads), then the candidate, then both at once: one model resident at a
    # time (a pair holds one layer of each). The sort is stable: what a need consumes stays before it.
    rank = {"ref": 0, "ckpt": 1, "pair": 2}
    order = sorted(planned.values(), key=lambda p: rank[p.role])
    return {p.key: p for p in order}, wiring


def plan_run(request: RunRequest, digests: DigestCache) -> RunPlan:
    """Phase 1: everything that can be decided from files (see the module docstring)."""
    ref_options, ckpt_options = request.ref_options.check(), request.ckpt_options.check()
    ref = open_side("ref", request.ref, ref_options)
    ckpt = open_side("ckpt", request.ckpt, ckpt_options)
    for side in (ref, ckpt):
        stream_if_needed(side)
    check_out_folder(request.out)
    # File tasks hash through the run's digest cache: a file is read once per run, whichever task asks.
    context = dataclasses.replace(request.context, digests=digests)
    tasks = build_tasks(request.tasks, context, request.thresholds, request.specs, request.thresholds_file)
    if ckpt.options.backend == "intref" and not ckpt.options.conventions:
        ckpt.options = ckpt.options.with_backend("intref", intref_conventions(request))
    baseline = load_results(request.baseline) if request.baseline is not None else None
    inputs, skipped = prepare_all(tasks, ref, ckpt)
    if baseline is not None:
        check_baseline(tasks, inputs, baseline, request.baseline)
    for t in tasks:
        if t.name in inputs and not isinstance(t, ModelTask | FileTask):
            raise InputError(f"task `{t.name}` has neither needs/compare nor compare_files")
    observations, wiring = plan_observations(tasks, inputs, {"ref": ref, "ckpt": ckpt}, digests)
    folder = RunFolder(request.out)
    loads: set[tuple[str, BackendOptions]] = set()
    for planned in observations.values():
        if planned.side.recording is not None:
            recorded_observation(planned)  # refused now if stale, not after the candidate's hour
        elif not (request.resume and _saved(folder, planned)):
            loads.add((planned.side.role, planned.options))
            if planned.partner is not None:
                if planned.partner.recording is not None:
                    raise InputError(
                        f"`{planned.tasks[0]}` runs the reference's own layers, which a recording does not "
                        "hold: give the reference checkpoint",
                        planned.partner.path,
                    )
                loads.add((planned.partner.role, planned.partner_options))
    for role, options in sorted(loads, key=lambda load: load[0] != "ref"):
        side = ref if role == "ref" else ckpt
        check_load_plan(side.checkpoint, options)
    provenance = {t.name: spec_provenance(t, request) for t in tasks}
    return RunPlan(ref, ckpt, tasks, inputs, skipped, observations, wiring, provenance)


def spec_provenance(task: Task, request: RunRequest) -> dict[str, str]:
    """Where a task's spec and thresholds came from, for results.json (a report says when they are the
    shipped defaults, which are calibrated on a 135 M demo pair)."""
    source = request.specs.get(task.name) or spec_source(type(task))
    if task.name in request.thresholds:
        thresholds = f"--thresholds {request.thresholds_file or ''}".rstrip()
    elif task.name in request.specs:
        thresholds = "--spec"
    else:
        thresholds = "shipped default"
    return {"file": str(source), "thresholds": thresholds}


def stream_if_needed(side: Side) -> None:
    """Stream a side, one decoder layer resident at a time, when asked (`--stream`) or when its model would
    not fit the memory budget (`evalsuite.backends.memory`); decided before any task prepares its inputs,
    since tasks that generate are skipped on a streamed side."""
    if side.checkpoint is not None:
        side.options, side.stream_reason = streamed_if_needed(side.checkpoint, side.options)


def intref_conventions(request: RunRequest) -> dict[str, Any]:
    """The activation convention `--backend intref` runs the candidate with: the `intref` task's spec in
    effect (`--spec intref=FILE` or the shipped one), whichever task is run."""
    cls = get_task("intref")
    spec = load_spec(cls.spec_model, request.specs.get("intref") or spec_source(cls))
    return spec.activations.model_dump(mode="json")


def check_out_folder(out: Path) -> None:
    """`--out` must be a folder (or not exist yet), under a parent that is one."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError("--out is a file, not a folder for the run's reports", out)
    parent = next((p for p in out.resolve().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise InputError("--out lies under a file, not a folder", parent)


def check_baseline(
    tasks: list[Task], inputs: dict[str, Inputs], baseline: dict[str, Any], path: Path
) -> None:
    """A baseline must hold every task of the run that will be compared, measured on the same inputs."""
    for t in tasks:
        if t.name not in inputs:
            continue
        entry = baseline["tasks"].get(t.name)
        if not isinstance(entry, dict) or not entry.get("metrics"):
            raise InputError(f"the baseline has no `{t.name}` metrics to compare with", path)
        before = entry["metrics"]
        for name, value in inputs_digest(inputs[t.name]).items():
            if name.endswith("_sha256") and name in before and before[name] != value:
                raise InputError(f"the baseline was measured on other inputs ({t.name}.{name} differs)", path)


def recorded_observation(planned: PlannedObservation) -> Observation:
    """The reference's observation from its recording, refused unless made the same way on the same inputs."""
    need = planned.need
    return planned.side.recording.observation(
        planned.tasks[0],
        need.observer.name,
        need.observer.identity(),
        inputs_digest(planned.inputs),
        planned.options.backend,
    )


# --------------------------------------------------------------------------------------------------------
# Observing
# --------------------------------------------------------------------------------------------------------


def _final(folder: RunFolder, planned: PlannedObservation) -> Path:
    return folder.observation(planned.role, planned.need.observer.name, planned.key)


def _saved(folder: RunFolder, planned: PlannedObservation) -> bool:
    """Whether the run folder holds this very observation, complete (its key is in its folder name and in
    its observation.json)."""
    final = _final(folder, planned)
    if not Observation.is_complete(final):
        return False
    try:
        return Observation.load(final).key == planned.key
    except InputError:
        return False


def observe_all(
    plan: RunPlan,
    folder: RunFolder,
    resume: bool,
    progress: Progress,
    on_load: OnLoad | None,
) -> dict[str, Observation]:
    """Phase 2: every planned observation, loading each (side, execution) once, one model at a time."""
    observed: dict[str, Observation] = {}
    groups: dict[tuple[str, BackendOptions, BackendOptions | None], list[PlannedObservation]] = {}
    for planned in plan.observations.values():
        if planned.side.recording is not None:
            observed[planned.key] = recorded_observation(planned)
            continue
        if resume and _saved(folder, planned):
            observed[planned.key] = Observation.load(_final(folder, planned))
            continue
        groups.setdefault((planned.role, planned.options, planned.partner_options), []).append(planned)
    for (role, options, partner_options), todo in groups.items():
        side, partner = todo[0].side, todo[0].partner
        if on_load is not None:
            if partner is not None:
                on_load(partner, partner_options)
            on_load(side, options)
        if partner is not None:
            backend = load_pair(partner.checkpoint, partner_options, side.checkpoint, options)
        else:
            backend = load_backend(side.checkpoint, options)
        try:
            for planned in todo:
                work = folder.observation_work(planned.role, planned.need.observer.name, planned.key, resume)
                label = f"{role} ({options.backend})"

                def labelled(what: str, total: int, label: str = label) -> Callable[[], None]:
                    return progress(f"{label}: {what}", total)

                inputs = planned.inputs
                if planned.consumes:
                    inputs = {**inputs, "observed": {k: observed[key] for k, key in planned.consumes.items()}}
                obs = planned.need.observer.observe(backend, inputs, work, labelled)
                obs.key = planned.key
                obs.meta["tasks"] = sorted(planned.tasks)
                obs.save(work)
                observed[planned.key] = Observation.load(
                    folder.commit_observation(work, _final(folder, planned))
                )
        finally:
            backend.close()
    return observed


# --------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------


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
                results[t.name] = t.compare_files(plan.ref, plan.ckpt, plan.inputs[t.name], folder.artifacts)
            except TaskSkipped as skip:
                results[t.name] = TaskResult(status="skipped", reason=str(skip))
    observed = observe_all(plan, folder, request.resume, progress or no_progress, on_load)
    for t in plan.tasks:
        if t.name in results:
            continue
        try:
            results[t.name] = t.compare(
                {label: observed[key] for label, key in plan.wiring[t.name].items()}, folder.artifacts
            )
        except EvalsuiteError as exc:
            results[t.name] = TaskResult(status="error", reason=str(exc))
    if request.baseline is not None:
        baseline = load_results(request.baseline)
        for t in plan.tasks:
            if results[t.name].status in ("pass", "fail"):
                results[t.name] = with_regression_checks(t, results[t.name], baseline)
    for t in plan.tasks:
        described = getattr(t, "metric_descriptions", {})
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
        "ckpt": plan.ckpt.describe(),
        "ref": plan.ref.describe(),
        "environment": environment(request.ckpt_options),
        "verdict": verdict,
        "tasks": {t.name: results[t.name].to_json() for t in plan.tasks},
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


def with_regression_checks(task: Task, result: TaskResult, baseline: dict[str, Any]) -> TaskResult:
    """Add one check per metric of the spec's `[regression]` table: no worse than the baseline's value.
    Everything else of the result (details, artifacts, notes) is kept."""
    before = baseline["tasks"][task.name]["metrics"]
    checks = list(result.checks)
    for name, tolerance in task.spec.regression.items():
        if isinstance(before.get(name), int | float) and not isinstance(before.get(name), bool):
            checks.append(tolerance.check(name, result.metrics.get(name), float(before[name])))
    status = "pass" if checks and all(c.passed for c in checks) else "fail"
    return dataclasses.replace(result, checks=checks, status=status)


# --------------------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------------------


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
    """Observe one checkpoint and save what later comparisons against it need (see `evalsuite.recording`)."""
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
    plan = RunPlan(side, side, tasks, inputs, {}, observations, {})
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
                )
            )
        return write_recording(
            out, side.checkpoint, side.content_sha256(digests), entries, environment(options)
        )
