"""The Task piece: what a task plugin is, what it needs observed, and what it returns.

A model task is a small class registered with `@task("name")`. `prepare` makes the inputs both sides share
(and refuses sides that cannot be compared) from files alone; `needs` declares the observations it compares,
each one made by an `Observer` on one side under one execution; `compare` turns those observations into a
`TaskResult` and knows nothing of models. The runner observes every distinct observation once, whichever
tasks need it (`ppl` and `intref` share both sides' window logits under `hf`), one model resident at a time.

A file-only task implements `compare_files` instead and never loads a model.

The registry of tasks is `evalsuite.pipeline.registry`, above the plugins; this module knows none of them.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeVar, runtime_checkable

from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import Check, TaskSpec
from evalsuite.inputs.corpus import Corpus, load_corpus
from evalsuite.stats import claims

if TYPE_CHECKING:
    from evalsuite.backends import Backend
    from evalsuite.files.digest import DigestCache
    from evalsuite.protocol.side import Side

Status = Literal["pass", "fail", "error", "skipped"]
MetricValue = float | int | bool | str | None
Role = Literal["ref", "ckpt", "pair"]
# A task's shared inputs: token ids, prompts, images, and their hashes (the JSON-able scalars are hashed
# into every observation's key).
Inputs = dict[str, Any]
# A progress factory: (label, total) -> a callable that advances by one step.
Progress = Callable[[str, int], Callable[[], None]]


def no_progress(label: str, total: int) -> Callable[[], None]:
    """A progress factory that shows nothing."""
    return lambda: None


def inputs_digest(inputs: Inputs) -> dict[str, Any]:
    """The JSON-able scalar part of a task's inputs: hashes, names and counts, not arrays."""
    return {k: v for k, v in sorted(inputs.items()) if isinstance(v, str | int | float | bool)}


class Observer(Protocol):
    """Makes one side's observation with a loaded backend.

    `name` says what is observed (`window-logits`, `smoke-generations`); two observers with the same name and
    `identity()` make the same observation from the same inputs, so the runner makes it once.
    """

    name: str

    def identity(self) -> dict[str, Any]:
        """What the observation depends on beyond the side, its execution and the inputs' hashes: the part
        of the spec that shapes it (a protocol, prompts), as JSON data."""
        ...

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        """Observe one side. Large files go into `folder`, which an interrupted observation left as it was:
        an observer may resume from what it finds there."""
        ...


@runtime_checkable
class RecordableObserver(Observer, Protocol):
    """An observer whose reference observation can be recorded (see `evalsuite.protocol.recording`)."""

    def record(self, observation: Observation, folder: Path) -> Observation:
        """The compact form of a reference observation that a later comparison needs."""
        ...


@dataclass(frozen=True)
class Need:
    """One observation a task compares: `observer` on the `role` side, found by `compare` under `label`.

    `backend` executes that side another way than it runs (`intref` for the candidate of the `intref`
    task); `conventions` are the settings that backend takes from the task's spec (intref's activation
    divisor and rounding), part of the observation's key. `streamed` runs the side one decoder layer at a
    time whatever the run's execution, for an observer that looks inside the model (it is handed a
    `StreamedBackend`). Role `pair` is both sides at once, streamed in lockstep: the observer is handed a
    `StreamedPair`, and the run refuses a recorded reference for it. `consumes` names needs of the same task,
    listed before this one, whose observations `observe` receives in `inputs["observed"]` by label; their
    keys are part of this observation's key. `alone`, for a need that consumes others to keep less than an
    observer of its side alone keeps: that observer, which the plan takes instead where its observation is
    made anyway (another task needs it, or the side is the very one consumed: a checkpoint against itself)
    or where what would be consumed is a recording.
    """

    label: str
    role: Role
    observer: Observer
    backend: str | None = None
    conventions: tuple[tuple[str, Any], ...] = ()
    streamed: bool = False
    consumes: tuple[str, ...] = ()
    alone: Observer | None = None


@dataclass(frozen=True)
class Difference:
    """A difference between the candidate and the reference that a task tests, paired (by token, by
    document): reports name every one significant after Holm's correction over all of them
    (`evalsuite.reporting.diff_report.significant_differences`), whether or not a check covers it."""

    name: str  # what differs, as a report names it (`ppl`, `evalsuite-mini-gen.exact_match`)
    said: str  # the change in words and figures: `0.6 → 0.2, 8 correct → wrong against 0 wrong → correct`
    test: str  # the paired test the p-value is from
    p: float  # its two-sided p-value
    worse: bool  # whether the candidate is the worse side
    metrics: tuple[str, ...]  # the task's metrics about it: a check on one of them covers it
    p_holm: float | None = None  # Holm-adjusted over every difference of the run (set by the runner)

    @staticmethod
    def figure(value: Any) -> str:
        """A figure in `said`, to 4 significant digits as the reports show figures; `—` for none."""
        return f"{value:.4g}" if isinstance(value, int | float) and not isinstance(value, bool) else "—"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "said": self.said,
            "test": self.test,
            "p": self.p if math.isfinite(self.p) else None,
            "p_holm": self.p_holm if self.p_holm is not None and math.isfinite(self.p_holm) else None,
            "worse": self.worse,
            "metrics": list(self.metrics),
        }


def clustered_difference(
    name: str, said: str, metric: str, values: dict[str, Any], worse_when_higher: bool, *covers: str
) -> Difference | None:
    """The `Difference` of a task's per-token paired metric from its value, window-clustered error and window
    count (`metric`, `metric`_stderr_window, `n_windows`): two-sided t with windows − 1 degrees of freedom
    (`claims.two_sided_p`); None where the task did not report them. `covers`: other metrics about it."""
    value, stderr = values.get(metric), values.get(f"{metric}_stderr_window")
    windows = values.get("n_windows")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (value, stderr, windows)):
        return None
    assert isinstance(value, int | float) and isinstance(stderr, int | float) and isinstance(windows, int)
    test = f"paired by token, window-clustered t with {windows - 1} degrees of freedom"
    worse = value != 0 and (value > 0) == worse_when_higher
    return Difference(name, said, test, claims.two_sided_p(value, stderr, windows), worse, (metric, *covers))


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
    # Why a metric is null: results.json is strict JSON, so a value that is not a finite number is written
    # as null, with its reason here (given by the task, or said from the value).
    null_reasons: dict[str, str] = field(default_factory=dict)
    # Metrics a threshold names that the task had nothing to measure for (an EXL3 pack's decode_exact).
    not_measured: list[str] = field(default_factory=list)
    # What a metric means, for the reader of report.md (the task's `metric_descriptions`, set by the runner).
    descriptions: dict[str, str] = field(default_factory=dict)
    # Where the spec and its thresholds came from (set by the runner): a report says when they are defaults.
    spec: dict[str, str] = field(default_factory=dict)
    # What the metrics were measured on: named samples (`windows`, `tokens`, `words`: "on the fed windows
    # 0, 7 of 8: 1,024 tokens per MoE layer"), the task's default one named "every", and the metrics measured
    # on another (`metric_samples`, by name). With `spec_sha256` (the spec's `measured_sha256`, set by the
    # runner) they are each metric's identity: a baseline measured under another is not compared with it.
    samples: dict[str, dict[str, Any]] = field(default_factory=dict)
    metric_samples: dict[str, str] = field(default_factory=dict)
    spec_sha256: str | None = None
    # Regression tolerances not applied, by metric: the baseline measured it under another identity.
    not_comparable: dict[str, str] = field(default_factory=dict)
    # The paired differences from the reference the task tested, significant or not.
    differences: list[Difference] = field(default_factory=list)

    def identity(self) -> dict[str, Any]:
        """results.json's `identity` of the task's metrics: the spec's digest and the samples."""
        doc: dict[str, Any] = {"spec_sha256": self.spec_sha256}
        if self.samples:
            doc["samples"] = self.samples
        if self.metric_samples:
            doc["metric_samples"] = self.metric_samples
        return doc

    @classmethod
    def from_checks(cls, metrics: dict[str, MetricValue], checks: list[Check], **kw: Any) -> TaskResult:
        """`pass` when every check passes, else `fail`. A task with no check cannot pass."""
        status: Status = "pass" if checks and all(c.passed for c in checks) else "fail"
        return cls(status=status, metrics=metrics, checks=checks, **kw)

    def to_json(self) -> dict[str, Any]:
        """The results.json entry: strict JSON, every non-finite number null with its reason."""
        reasons = dict(self.null_reasons)
        metrics = {}
        for name, value in self.metrics.items():
            if isinstance(value, float) and not math.isfinite(value):
                reasons.setdefault(name, _non_finite_reason(value))
                value = None
            metrics[name] = value
        doc: dict[str, Any] = {"status": self.status}
        if self.reason is not None:
            doc["reason"] = self.reason
        doc["metrics"] = metrics
        if reasons:
            doc["null_reasons"] = {k: reasons[k] for k in metrics if k in reasons}
        doc["checks"] = [_finite_check(c.model_dump()) for c in self.checks]
        if self.not_measured:
            doc["not_measured"] = list(self.not_measured)
        if self.descriptions:
            doc["descriptions"] = {k: self.descriptions[k] for k in metrics if k in self.descriptions}
        if self.spec:
            doc["spec"] = dict(self.spec)
        if self.spec_sha256 is not None or self.samples:
            doc["identity"] = self.identity()
        if self.not_comparable:
            doc["not_comparable"] = dict(self.not_comparable)
        if self.differences:
            doc["differences"] = [d.to_json() for d in self.differences]
        doc["artifacts"] = self.artifacts
        if self.details:
            doc["details"] = [_finite_row(row) for row in self.details]
        return doc


def _non_finite_reason(value: float) -> str:
    if math.isnan(value):
        return "not a number (NaN): the statistic is undefined on these samples"
    return f"{'+' if value > 0 else '-'}infinity"


def _finite_check(check: dict[str, Any]) -> dict[str, Any]:
    for key in ("value", "threshold"):
        value = check.get(key)
        if isinstance(value, float) and not math.isfinite(value):
            check[key] = None
    return check


def _finite_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


class TaskSkipped(Exception):
    """Raised by `prepare` when a task cannot run on these sides or this machine; carries the reason."""


def skip_if_cannot_generate(ref: Side, ckpt: Side, what: str) -> None:
    """TaskSkipped for a task that generates on a backend that does not generate (`llamacpp`:
    `evalsuite.backends.llamacpp`). A streamed side generates, reading each decoder layer per new token for
    a whole batch of prompts (`StreamedBackend.generate_greedy_batch`)."""
    for side in (ref, ckpt):
        if side.checkpoint is not None and side.options.backend == "llamacpp":
            from evalsuite.backends.llamacpp import NO_GENERATION

            raise TaskSkipped(f"{what} generates, and {NO_GENERATION}")


class Task(Protocol):
    """What every task has: `name` (set by `@task`), `spec_model` and a validated `spec`.

    `metric_names` lists the metrics a threshold may name (a misspelled metric in `--thresholds` is refused
    before anything runs); empty means the task does not say. An optional `metric_descriptions` (name → one
    line) says what the main ones mean, for report.md; a `TaskResult`'s own `descriptions` (completed with
    what the metric was measured on) take their place. An optional `paired_differences(metrics)` gives the
    paired tests of the candidate against the reference its metrics allow (`Difference`): the reports name
    every one significant after Holm's correction over the run, beside the verdict.
    """

    name: ClassVar[str]
    spec_model: ClassVar[type[TaskSpec]]
    metric_names: ClassVar[tuple[str, ...]]
    spec: TaskSpec

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """Inputs both sides share (with their hashes), from files alone; raise InputError when the sides
        cannot be compared, TaskSkipped when the task cannot run on them or on this machine."""
        ...


@runtime_checkable
class ModelTask(Task, Protocol):
    """A task that compares observations of models."""

    def needs(self) -> list[Need]:
        """The observations `compare` receives, by label."""
        ...

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        """Metrics and checks from the observations of its needs; plots and tables go into `artifacts`."""
        ...


@runtime_checkable
class FileTask(Task, Protocol):
    """A task that compares the two checkpoints' files; no model is ever loaded for it."""

    def compare_files(self, ref: Side, ckpt: Side, inputs: Inputs, artifacts: Path) -> TaskResult:
        """Stream both checkpoints' files; metrics, checks and artifacts. A task whose files take minutes
        (31,000 tensors) may take a `progress` keyword too (`takes_progress`): the runner passes its
        `Progress` to those that do."""
        ...


def takes_progress(task: FileTask) -> bool:
    """Whether a file task's `compare_files` takes a `progress` keyword (tasks written before it do not)."""
    import inspect

    return "progress" in inspect.signature(task.compare_files).parameters


T = TypeVar("T")


class SharedWork:
    """Results a run computes once and reuses across the sides and candidates it compares (the corpus's
    token ids, a reference's normalisers, a noise floor's per-token KLD), by a key naming everything they
    were computed from. Owned by one `RunContext`: two runs, in two threads or one after the other, share
    nothing unless they share the context. Thread-safe; one computation per key at a time; keeps the
    `keep` most recently used results."""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._values: OrderedDict[Hashable, Any] = OrderedDict()
        self._making: dict[Hashable, threading.Lock] = {}

    def get(self, key: Hashable, make: Callable[[], T]) -> T:
        """The result for `key`, made by `make()` if no earlier call kept it."""
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return self._values[key]
            making = self._making.setdefault(key, threading.Lock())
        with making:  # a second caller with the same key waits for the first's result
            with self._lock:
                if key in self._values:
                    return self._values[key]
            value = make()
            with self._lock:
                self._keep(key, value)
                self._making.pop(key, None)
        return value

    def find(self, key: Hashable) -> Any | None:
        """The result kept for `key`, or None."""
        with self._lock:
            return self._values.get(key)

    def put(self, key: Hashable, value: Any) -> None:
        """Keep `value` for `key` (results a caller made as a side effect of other work)."""
        with self._lock:
            self._keep(key, value)

    def _keep(self, key: Hashable, value: Any) -> None:
        """`value` as the most recent result, the oldest dropped past `keep` (the lock held)."""
        self._values[key] = value
        self._values.move_to_end(key)
        while len(self._values) > self.keep:
            self._values.popitem(last=False)

    def __len__(self) -> int:
        return len(self._values)

    def __getstate__(self) -> dict[str, int]:
        # Another process (a Ray task, a forked worker) gets an empty store: results and locks are this
        # process's own.
        return {"keep": self.keep}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(state["keep"])  # type: ignore[misc]


@dataclass
class RunContext:
    """What tasks may ask of the run beyond their spec: the text to score, chosen once for both sides, the
    run's file digests (the cache its observation keys are hashed through; None outside a run) and the work
    its tasks share across sides and candidates (`SharedWork`)."""

    corpus_name: str = "auto"
    text_file: Path | None = None
    allow_download: bool = False
    digests: DigestCache | None = None
    corpus_path: Path | None = None  # a local copy of WikiText-2's test split (`--corpus-path`)
    shared: SharedWork = field(default_factory=SharedWork, repr=False, compare=False)
    plots: bool = True  # draw each task's PNG plots (`--no-plots`: a CI job that wants the verdict alone)
    chats_file: Path | None = None  # chats to score instead of a text's windows (`--chats`)
    calibration_file: Path | None = None  # a pack's calibration data, kept apart from what is scored
    execution_floor: bool = False  # the reference again in another execution (`--execution-floor`)
    draft_path: Path | None = None  # a draft checkpoint `specdec` drafts with (`--draft`), else prompt lookup

    @cached_property
    def corpus(self) -> Corpus:
        return load_corpus(
            self.corpus_name,
            text_file=self.text_file,
            allow_download=self.allow_download,
            corpus_path=self.corpus_path,
        )


def task(name: str) -> Callable[[type], type]:
    """Class decorator naming a task plugin. `evalsuite.pipeline.registry` finds built-in and entry-point
    tasks."""

    def named(cls: type) -> type:
        cls.name = name
        if not hasattr(cls, "metric_names"):
            cls.metric_names = ()
        return cls

    return named
