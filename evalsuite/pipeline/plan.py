"""Phase 1 of a run, the plan: everything decided from files alone, before any model loads.

Both sides opened and their options checked; every task's spec and thresholds validated; each task's shared
inputs prepared (tokens, prompts, images: a mismatched tokenizer is refused here); the baseline checked
against those inputs; every observation the tasks need identified by its key (a digest of every byte of
the side's weights, the execution and its conventions, the observer's identity and the inputs' hashes), so
that one observation serves every task that needs it; a recorded reference checked for each of them; and the
load plan of every side that will be loaded checked on the meta device (a checkpoint Transformers would fill
with random weights is refused now, not after an hour on the reference). `evalsuite.pipeline.runner` runs the
plan.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evalsuite.backends import check_load_internals, check_load_plan
from evalsuite.backends.memory import streamed_if_needed
from evalsuite.backends.options import BackendOptions
from evalsuite.contract.observation import Observation
from evalsuite.contract.results import read_results
from evalsuite.contract.spec import Threshold, flat_metric_tables, load_spec
from evalsuite.errors import InputError
from evalsuite.files.digest import DigestCache
from evalsuite.files.run_cache import RunCache
from evalsuite.files.run_folder import RunFolder
from evalsuite.formats.gguf import read_gguf
from evalsuite.pipeline.registry import get_task, spec_source
from evalsuite.protocol.side import Side, open_side
from evalsuite.protocol.task import (
    FileTask,
    Inputs,
    ModelTask,
    Need,
    RunContext,
    Task,
    TaskResult,
    TaskSkipped,
    inputs_digest,
)
from evalsuite.version import __version__


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
    spec_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # task -> spec sections (compare)


def build_tasks(
    names: list[str],
    context: RunContext,
    thresholds: dict[str, dict[str, Any]] | None = None,
    specs: dict[str, Path] | None = None,
    thresholds_file: Path | None = None,
    spec_overrides: dict[str, dict[str, Any]] | None = None,
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
        overrides = dict((spec_overrides or {}).get(name, {})) or None
        if name in thresholds:
            overrides = {
                **(overrides or {}),
                "thresholds": _checked_thresholds(cls, thresholds[name], thresholds_file),
            }
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
    # Whether observing may fetch from the Hub (`--allow-download`); else only local caches are read.
    allow_download: bool = False


def side_options(side: Side, need: Need) -> BackendOptions:
    """How a need's side is executed: the side's own options, or the need's backend and conventions;
    streamed when the need asks for it (a `pair` need always does)."""
    if need.backend is None or (need.backend == side.options.backend and not need.conventions):
        options = side.options
    else:
        options = side.options.with_backend(need.backend, need.conventions)
    if need.streamed or need.role == "pair":
        options = options.streamed()
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
    """Identity of an observation: every byte of the side's weights, its execution with its conventions (on
    a CPU, `cpu_threads` too), the observer and what shapes it, the inputs' hashes, the evalsuite version;
    and for an observation made from others, their keys; for a pair, the reference side's weights and
    execution too."""
    doc: dict[str, Any] = {
        "observer": need.observer.name,
        "identity": need.observer.identity(),
        "inputs": inputs_digest(inputs),
        "content_sha256": side.content_sha256(digests),
        "execution": options.to_json(),
        "evalsuite": __version__,
    }
    if side.recording is not None:
        # A recording holds the compact form a comparison needs, not what the observer makes live: a live
        # candidate of the very checkpoint that was recorded must not take the recording's place.
        doc["recorded"] = True
    elif options.device == "cpu":
        doc["cpu_threads"] = cpu_threads()
    if consumes:
        doc["consumes"] = consumes
    if partner is not None:
        doc["partner"] = {
            "content_sha256": partner[0].content_sha256(digests),
            "execution": partner[1].to_json(),
        }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def cpu_threads() -> int:
    """The threads torch's CPU kernels run on: part of a CPU observation's identity, because oneDNN's matrix
    products (a bf16 Linear) add in an order set by the thread count, so that one and two threads round some
    logits the other way (with AMX as without; docs/reproducibility.md). A run resumed under another count
    observes its windows again rather than mixing two executions' windows in one observation."""
    import torch

    return torch.get_num_threads()


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
    saved: Callable[[PlannedObservation], bool] | None = None,
) -> tuple[dict[str, PlannedObservation], dict[str, dict[str, str]]]:
    """Every distinct observation the model tasks need of the `roles` sides, by key, and which key each
    task's label gets. A need that consumes others is planned after them (a task lists them first).
    `saved`: whether an observation is in the run folder already (`Need.alone` takes it where it is)."""
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
                partner = (sides["ref"], sides["ref"].options.streamed())
            options = side_options(side, need)
            key = observation_key(side, options, need, inputs[t.name], digests, consumes, partner)
            if side.recording is not None and getattr(need.observer, "records_itself", False):
                # A recording that is the observation itself stands under the key it was made under, so that
                # what consumes it (a candidate forced along the reference's answers) is the live run's.
                key = side.recording.recorded_key(need.observer.name, need.observer.identity()) or key
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
    _take_alone_where_made(planned, wiring, digests, saved)
    # The reference first (all its loads), then the candidate, then both at once: one model resident at a
    # time (a pair holds one layer of each). The sort is stable: what a need consumes stays before it.
    rank = {"ref": 0, "ckpt": 1, "pair": 2}
    order = sorted(planned.values(), key=lambda p: rank[p.role])
    return {p.key: p for p in order}, wiring


def _take_alone_where_made(
    planned: dict[str, PlannedObservation],
    wiring: dict[str, dict[str, str]],
    digests: DigestCache,
    saved: Callable[[PlannedObservation], bool] | None,
) -> None:
    """A need planned with what it consumes (`Need.alone`) whose side's observation alone is planned anyway
    (by another task, or as the very observation it consumes: a checkpoint against itself), is `saved`
    already (a run resumed with other tasks), or that would consume a recording: the tasks that asked for it
    get the observation alone (nothing is observed twice)."""
    for key, p in list(planned.items()):
        if p.need.alone is None:
            continue
        alone = dataclasses.replace(p.need, observer=p.need.alone, consumes=(), alone=None)
        alone_key = observation_key(p.side, p.options, alone, p.inputs, digests)
        if alone_key not in planned:
            instead = dataclasses.replace(p, key=alone_key, need=alone, tasks=[], consumes={})
            recorded = any(planned[k].side.recording is not None for k in p.consumes.values())
            if not recorded and (saved is None or not saved(instead)):
                continue
            planned[alone_key] = instead
        del planned[key]
        for task_name in p.tasks:
            planned[alone_key].tasks.append(task_name)
            wiring[task_name] = {k: alone_key if v == key else v for k, v in wiring[task_name].items()}


def plan_run(request: RunRequest, digests: DigestCache) -> RunPlan:
    """Phase 1: everything that can be decided from files (see the module docstring)."""
    ref_options, ckpt_options = request.ref_options.check(), request.ckpt_options.check()
    ref = open_side("ref", request.ref, ref_options)
    ckpt = open_side("ckpt", request.ckpt, ckpt_options)
    for side in (ref, ckpt):
        if side.checkpoint is not None and side.checkpoint.gguf_file is not None:
            # Its tensor table, checked as llama.cpp checks it, before its vocabulary is rebuilt to tokenize.
            read_gguf(side.checkpoint.gguf_file)
        stream_if_needed(side)
    check_out_folder(request.out)
    # File tasks hash through the run's digest cache: a file is read once per run, whichever task asks.
    context = dataclasses.replace(request.context, digests=digests)
    tasks = build_tasks(
        request.tasks,
        context,
        request.thresholds,
        request.specs,
        request.thresholds_file,
        request.spec_overrides,
    )
    check_files_a_task_reads(tasks, context)
    if ckpt.options.backend == "intref" and not ckpt.options.conventions:
        ckpt.options = ckpt.options.with_backend("intref", intref_conventions(request))
    baseline = load_results(request.baseline) if request.baseline is not None else None
    inputs, skipped = prepare_all(tasks, ref, ckpt)
    if baseline is not None:
        check_baseline(tasks, inputs, baseline, request.baseline)
    for t in tasks:
        if t.name in inputs and not isinstance(t, ModelTask | FileTask):
            raise InputError(f"task `{t.name}` has neither needs/compare nor compare_files")
    folder = RunFolder(request.out)
    observations, wiring = plan_observations(
        tasks,
        inputs,
        {"ref": ref, "ckpt": ckpt},
        digests,
        saved=(lambda planned: is_saved(folder, planned)) if request.resume else None,
    )
    loads: set[tuple[str, BackendOptions]] = set()
    for planned in observations.values():
        if planned.side.recording is not None:
            recorded_observation(planned)  # refused now if stale, not after the candidate's hour
        elif not (request.resume and is_saved(folder, planned)):
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
        check_load_plan_once(ref if role == "ref" else ckpt, options, digests)
    provenance = {t.name: spec_provenance(t, request) for t in tasks}
    return RunPlan(
        ref, ckpt, tasks, inputs, skipped, observations, wiring, provenance, request.context.allow_download
    )


def check_files_a_task_reads(tasks: list[Task], context: RunContext) -> None:
    """Refuse `--chats`, `--calibration`, `--draft` and `--execution-floor` in a run whose tasks would not
    read them: `ppl` scores the chats; `ppl`'s windows and chats, `smoke`'s prompts and `vision`'s questions
    are checked against the calibration set; `specdec` drafts with the draft; `ppl` runs the execution floor.
    A run without them would ignore what the user asked for and say nothing."""
    names = {t.name for t in tasks}
    if context.chats_file is not None and "ppl" not in names:
        raise InputError(
            "--chats is read by `ppl` only (the chats it scores), which --tasks does not run: add ppl to "
            "--tasks",
            context.chats_file,
        )
    if context.calibration_file is not None and not names & {"ppl", "smoke", "vision"}:
        raise InputError(
            "--calibration is read by `ppl`, `smoke` and `vision` only (their windows, chats, prompts and "
            "questions checked against the calibration set), none of which --tasks runs: add one of them "
            "to --tasks",
            context.calibration_file,
        )
    if context.draft_path is not None and "specdec" not in names:
        raise InputError(
            "--draft is read by `specdec` only (the checkpoint it drafts with), which --tasks does not run: "
            "add specdec to --tasks",
            context.draft_path,
        )
    if context.execution_floor and "ppl" not in names:
        raise InputError(
            "--execution-floor runs the reference's `ppl` windows again, and --tasks does not run ppl: add "
            "ppl to --tasks"
        )


class PassedLoadPlans:
    """Load plans found good, by what the check reads and the options: `compare` plans its first candidate
    twice (with the reference, then in its own run), and a check builds the whole model on the meta device
    (a second or two for a 135 M model). Only a pass is kept: a refused plan is checked again. Sharing is
    the point (runs in one process, in one thread or several, skip a check another passed), so the table
    is bounded and every read and write of it is under its lock."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._passed: dict[tuple[str, BackendOptions], None] = {}
        self._lock = threading.Lock()

    def __contains__(self, key: tuple[str, BackendOptions]) -> bool:
        with self._lock:
            return key in self._passed

    def add(self, key: tuple[str, BackendOptions]) -> None:
        """Remember a passed check, forgetting the oldest beyond `keep`."""
        with self._lock:
            while len(self._passed) >= self.keep:
                del self._passed[next(iter(self._passed))]
            self._passed[key] = None


# The process's table, which `check_load_plan_once` uses unless given another.
PASSED_LOAD_PLANS = PassedLoadPlans()
# Backends whose check reads the configs and the safetensors headers, never tensor data: for them, two
# checkpoints with the same structure (a pack and its recalibrated twin, the same scheme with other scales)
# have the same plan. EXL3's check reads trellis markers, and the streamed one the layers' tensors.
_HEADER_ONLY_CHECKS = ("hf", "intref")


def load_plan_key(side: Side, options: BackendOptions, digests: DigestCache) -> str:
    """What a side's load-plan check depends on: for a header-only check, the checkpoint's `fingerprint`
    (config.json and every shard's raw header) and the bytes of its other small files (configs the loader
    reads beside config.json); else every byte of its content."""
    checkpoint = side.checkpoint
    if checkpoint is None or options.stream or options.backend not in _HEADER_ONLY_CHECKS:
        return f"content:{side.content_sha256(digests)}"
    shards = set(checkpoint.shards)
    others = [p for p in checkpoint.content_files() if p not in shards]
    digests_of = digests.sha256_many(others)
    files = ",".join(f"{p.relative_to(checkpoint.path).as_posix()}={digests_of[p]}" for p in others)
    return f"structure:{checkpoint.fingerprint}:{hashlib.sha256(files.encode()).hexdigest()}"


def check_load_plan_once(
    side: Side, options: BackendOptions, digests: DigestCache, passed: PassedLoadPlans | None = None
) -> None:
    """`check_load_plan` for a side's checkpoint, skipped where a checkpoint with what the check reads
    passed it under the same options before: in this process (`passed`, by default `PASSED_LOAD_PLANS`) or
    in an earlier one (`load_plan_cache`, under the same code)."""
    passed = PASSED_LOAD_PLANS if passed is None else passed
    key = (load_plan_key(side, options, digests), options)
    on_disk = load_plan_cache(options)
    disk_key = {"plan": key[0], "options": repr(options)}
    if key in passed or on_disk.passed(disk_key):
        # What neither table can vouch for is checked again: the library internals the load will call,
        # which a caller of `evalsuite.run` may have changed in this very process since the pass.
        check_load_internals(side.checkpoint, options)
    else:
        check_load_plan(side.checkpoint, options)
        on_disk.put_passed(disk_key)
    passed.add(key)


def load_plan_cache(options: BackendOptions) -> RunCache:
    """Where passed load plans are kept between processes (`evalsuite.files.run_cache`): none for a checkpoint
    whose own code runs (`trust_remote_code`), which its files' digests do not pin down for every loader."""
    return RunCache("load-plans", enabled=not options.trust_remote_code)


def spec_provenance(task: Task, request: RunRequest) -> dict[str, str]:
    """Where a task's spec and thresholds came from, for results.json (a report says when they are not the
    shipped defaults, and whose they are); the thresholds file as `shown_path` names it."""
    source = request.specs.get(task.name) or spec_source(type(task))
    if task.name in request.thresholds:
        shown = shown_path(request.thresholds_file, request.out) if request.thresholds_file else ""
        thresholds = f"--thresholds {shown}".rstrip()
    elif task.name in request.specs:
        thresholds = "--spec"
    else:
        thresholds = "shipped default"
    return {"file": str(source), "thresholds": thresholds}


def shown_path(path: Path | str, out: Path | str) -> str:
    """A file as a report names it: relative to the run folder `out` when it lies in it, else relative to the
    current folder (the project the run was started from), never by this machine's absolute path."""
    path = Path(path).resolve()
    run = Path(out).resolve()
    if path.is_relative_to(run):
        return path.relative_to(run).as_posix()
    return Path(os.path.relpath(path, Path.cwd().resolve())).as_posix()


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


def load_results(path: Path) -> dict[str, Any]:
    """A results.json document (an accepted baseline, or a run to re-render), checked for its schema and
    major version (`evalsuite.contract.results.read_results`)."""
    return read_results(path)


def saved_folder(folder: RunFolder, planned: PlannedObservation) -> Path:
    return folder.observation(planned.role, planned.need.observer.name, planned.key)


def is_saved(folder: RunFolder, planned: PlannedObservation) -> bool:
    """Whether the run folder holds this very observation, complete (its key is in its folder name and in
    its observation.json)."""
    final = saved_folder(folder, planned)
    if not Observation.is_complete(final):
        return False
    try:
        return Observation.load(final).key == planned.key
    except InputError:
        return False
