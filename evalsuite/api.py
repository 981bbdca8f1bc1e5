"""The Python API: `run`, `compare`, `record` and `report`, each taking its command's options as typed
arguments and returning a typed outcome; the CLI is a thin layer over these.

Errors are the project's own (`evalsuite.errors`): `InputError` for bad input, `DependencyError` for a
missing package or device, `ResourceError` for exhausted memory, `Cancelled` when `cancel` was set. Anything
else is a bug. Nothing here prints; progress goes to the `progress` callback, if one is given.

The heavy pieces (the runner, the comparison, the report renderers) are imported when a function is called,
so that `import evalsuite` stays cheap.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from evalsuite.contract.results import Comparison, RecordingManifest, Results
from evalsuite.errors import Cancelled, InputError
from evalsuite.files.run_folder import write_atomic

if TYPE_CHECKING:
    from evalsuite.backends.options import BackendOptions
    from evalsuite.files.run_cache import CacheKind
    from evalsuite.pipeline.observe import OnLoad
    from evalsuite.pipeline.runner import RecordRequest, RunRequest
    from evalsuite.protocol.task import Progress

DEFAULT_FIXTURES = Path(
    os.environ.get("EVALSUITE_FIXTURES", Path.home() / ".cache" / "evalsuite" / "fixtures")
)
# A traceback left by an earlier crash in a run folder: the CLI writes it; a finished run removes it, since
# it no longer describes the folder.
TRACEBACK_NAME = "traceback.txt"
ReportFormat = Literal["model-card", "md", "json"]
Verdict = Literal["pass", "fail", "error"]


@dataclass(frozen=True)
class RunOutcome:
    """What `run` did: the typed results.json, the run folder and every file written by name (`results`,
    `report`, and `junit` / `model_card` when asked for). `document` is results.json as written."""

    results: Results
    folder: Path
    paths: dict[str, Path]
    document: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def verdict(self) -> Verdict:
        """`pass`, `fail` (a check failed) or `error` (nothing could be compared, or a task failed to run)."""
        return self.results.verdict

    @property
    def exit_code(self) -> int:
        """The CLI's exit code for this verdict: 0 pass, 1 fail, 2 error."""
        return {"pass": 0, "fail": 1}.get(self.verdict, 2)


@dataclass(frozen=True)
class CompareOutcome:
    """What `compare` did: the typed compare.json, each candidate's typed results.json by candidate name,
    and the comparison folder."""

    comparison: Comparison
    candidates: dict[str, Results]
    out: Path

    @property
    def exit_code(self) -> int:
        """0 when every candidate passed, 1 when one failed a check, 2 when one could not be compared."""
        verdicts = {r.verdict for r in self.candidates.values()}
        return 2 if "error" in verdicts else 1 if "fail" in verdicts else 0


@dataclass(frozen=True)
class RecordOutcome:
    """What `record` wrote: the recording folder, its typed manifest and its size on disk."""

    path: Path
    manifest: RecordingManifest
    size_bytes: int


@dataclass
class Cancellation:
    """A `threading.Event` wrapped as a `Progress`: every step of every pass first checks the event and
    raises `Cancelled` once it is set. A cancelled run resumes from its saved observations when run again."""

    cancel: threading.Event
    progress: Progress | None = None
    _noop: Callable[[], None] = field(default=lambda: None, repr=False)

    def check(self) -> None:
        """Raise `Cancelled` if the event is set."""
        if self.cancel.is_set():
            raise Cancelled("cancelled; run the same call again to resume where it stopped")

    def __call__(self, description: str, total: int) -> Callable[[], None]:
        self.check()
        advance = self.progress(description, total) if self.progress is not None else self._noop

        def step() -> None:
            advance()
            self.check()

        return step


def _progress(progress: Progress | None, cancel: threading.Event | None) -> Progress | None:
    return progress if cancel is None else Cancellation(cancel, progress)


def resolve_source(source: str | Path, fixtures: Path = DEFAULT_FIXTURES) -> str:
    """A folder as given; a fixture name (`smollm2-135m-w4a8`) from the fixtures folder; else a hub id.

    A name is a fixture when `fixtures/NAME` holds a fixture manifest, so no builder is imported to resolve
    it; a known fixture name without a finished build there is an error that says how to build it.

    Args:
        source: a checkpoint folder, a fixture name, or a Hugging Face repo id in the local cache.
        fixtures: the folder fixture names are looked up in.
    """
    source = str(source)
    if Path(source).exists():
        return source
    from evalsuite.fixtures.names import BENCH_FIXTURE_NAMES, FIXTURE_NAMES, MANIFEST_NAME

    folder = Path(fixtures) / source
    if Path(source).name == source and (folder / MANIFEST_NAME).is_file():
        return str(folder)
    if source in FIXTURE_NAMES or source in BENCH_FIXTURE_NAMES:
        raise InputError(
            f"fixture {source!r} is not built; run `evalsuite fixtures --out {fixtures}`", folder
        )
    return source


def read_thresholds(path: Path | None) -> dict[str, Any]:
    """A thresholds file: TOML tables `[TASK]` of `metric = { min = …, max = … }` ({} for None).

    Args:
        path: the TOML file, or None.
    """
    if path is None:
        return {}
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError("thresholds file does not exist", path) from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"invalid TOML: {exc}", path) from None
    if not all(isinstance(v, dict) for v in data.values()):
        raise InputError("expected one table per task, e.g. [ppl] ppl_ratio = { max = 1.05 }", path)
    return data


def backend_options(
    dtype: str = "bfloat16",
    device: str = "cpu",
    trust_remote_code: bool = False,
    stream: bool = False,
    max_memory: str | None = None,
) -> BackendOptions:
    """The execution options both sides start from.

    Args:
        dtype: compute dtype, `bfloat16`, `float16` or `float32`.
        device: `cpu`, `cuda`, `cuda:N` or `auto` (accelerate's device map).
        trust_remote_code: allow code from the checkpoint folders.
        stream: run one decoder layer at a time (for models larger than memory).
        max_memory: memory a side may fill (`24GB`, `30GiB`); None for the device's free memory.
    """
    from evalsuite.backends.memory import parse_memory_size
    from evalsuite.backends.options import BackendOptions

    return BackendOptions(
        dtype=dtype,
        device=device,
        trust_remote_code=trust_remote_code,
        stream=stream,
        max_memory=None if max_memory is None else parse_memory_size(max_memory),
    )


def default_run_folder(ckpt: str) -> Path:
    """Where `run` writes when no `out` is given: reports/<the candidate folder's name>.

    Args:
        ckpt: the candidate's resolved source.
    """
    return Path("reports") / Path(ckpt.rstrip("/")).name


def _task_list(tasks: str | Sequence[str]) -> list[str]:
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    return [t.strip() for t in names if t.strip()]


def run(
    ckpt: str | Path,
    ref: str | Path,
    *,
    tasks: str | Sequence[str] = ("ppl",),
    out: Path | None = None,
    text_file: Path | None = None,
    corpus: str = "auto",
    allow_download: bool = False,
    corpus_path: Path | None = None,
    chats: Path | None = None,
    calibration: Path | None = None,
    draft: Path | None = None,
    thresholds: Path | None = None,
    specs: Mapping[str, Path] | None = None,
    baseline: Path | None = None,
    junit: Path | None = None,
    model_card: bool = False,
    backend: str = "auto",
    dtype: str = "bfloat16",
    device: str = "cpu",
    stream: bool = False,
    max_memory: str | None = None,
    trust_remote_code: bool = False,
    resume: bool = True,
    keep_observations: bool = True,
    fixtures: Path = DEFAULT_FIXTURES,
    plots: bool = True,
    execution_floor: bool = False,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    on_load: OnLoad | None = None,
) -> RunOutcome:
    """Compare a candidate checkpoint with its reference and write results.json and report.md (`evalsuite
    run`).

    Args:
        ckpt: the candidate: a checkpoint folder, a cached hub id, or a fixture name.
        ref: the reference (the BF16 source) in the same forms, or a recording of it.
        tasks: the tasks, as a list or comma-separated.
        out: the run folder [default: reports/<ckpt name>].
        text_file: score this UTF-8 text instead of a corpus.
        corpus: `auto`, `wikitext-2-raw-v1` or `python-docs`.
        allow_download: let datasets fetch WikiText-2 from the hub.
        corpus_path: a local copy of WikiText-2's raw test split.
        chats: score `ppl` on this JSONL file's chats, through the chat template, instead of a text.
        calibration: the candidate's calibration data (text or JSONL): evaluated text it holds is flagged.
        draft: a draft checkpoint `specdec` drafts with (the sides' tokenizer); None: prompt lookup.
        thresholds: a TOML file overriding spec thresholds.
        specs: task name → a spec file replacing the shipped tasks/TASK.toml.
        baseline: an accepted earlier results.json: fail on metrics that worsened.
        junit: also write JUnit XML here (one test case per check).
        model_card: also write model-card.md into the run folder.
        backend: how the candidate is executed: `hf`, `intref`, `exl3` or `auto`.
        dtype: compute dtype: `bfloat16`, `float16` or `float32`.
        device: `cpu`, `cuda`, `cuda:N` or `auto`.
        stream: run both sides one decoder layer at a time.
        max_memory: memory a side may fill (`24GB`); a side that needs more runs streamed.
        trust_remote_code: allow code from the checkpoint folders.
        resume: reuse observations saved by an earlier run.
        keep_observations: keep this run's observations in OUT/observations.
        fixtures: where fixture names are looked up.
        plots: draw each task's PNG plots (False: the verdict and the tables alone, for CI).
        execution_floor: also run the reference's `ppl` windows batched and report its own difference.
        progress: called as `progress(description, total)` when a pass begins; the callable it returns is
            called once per step done.
        cancel: an event that, once set, stops the run at its next step with `Cancelled`.
        on_load: called with the side and its options before each model loads.

    Returns:
        The typed results, the run folder and the files written.
    """
    from evalsuite.pipeline.runner import RunRequest
    from evalsuite.protocol.task import RunContext

    ckpt_source, ref_source = resolve_source(ckpt, fixtures), resolve_source(ref, fixtures)
    options = backend_options(dtype, device, trust_remote_code, stream, max_memory)
    request = RunRequest(
        ckpt=ckpt_source,
        ref=ref_source,
        ckpt_options=dataclasses.replace(options, backend=backend),
        tasks=_task_list(tasks),
        out=Path(out) if out is not None else default_run_folder(ckpt_source),
        context=RunContext(
            corpus_name=corpus,
            text_file=text_file,
            allow_download=allow_download,
            corpus_path=corpus_path,
            plots=plots,
            chats_file=chats,
            calibration_file=calibration,
            execution_floor=execution_floor,
            draft_path=draft,
        ),
        ref_options=options,
        thresholds=read_thresholds(thresholds),
        thresholds_file=thresholds,
        specs=dict(specs or {}),
        baseline=baseline,
        resume=resume,
        keep_observations=keep_observations,
    )
    return run_request(
        request, progress=progress, cancel=cancel, on_load=on_load, junit=junit, model_card=model_card
    )


def run_request(
    request: RunRequest,
    *,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    on_load: OnLoad | None = None,
    junit: Path | None = None,
    model_card: bool = False,
) -> RunOutcome:
    """Run a prepared `RunRequest` and write its reports (what `run` does once its options are read).

    Args:
        request: the run, as `evalsuite.pipeline.runner.RunRequest`.
        progress: as in `run`.
        cancel: as in `run`.
        on_load: as in `run`.
        junit: also write JUnit XML here.
        model_card: also write model-card.md into the run folder.
    """
    from evalsuite.pipeline.runner import run as run_plan
    from evalsuite.reporting.diff_report import write_reports

    result = run_plan(request, progress=_progress(progress, cancel), on_load=on_load)
    # Everything rendered before anything is written: a rendering error leaves no report half-made.
    extra: dict[str, tuple[Path, str]] = {}
    if junit is not None:
        from evalsuite.reporting.junit import render_junit

        extra["junit"] = (Path(junit), render_junit(result.results))
    if model_card:
        from evalsuite.reporting.model_card import render_model_card

        extra["model_card"] = (result.folder.root / "model-card.md", render_model_card(result.results))
    typed = Results.model_validate(result.results)
    write_reports(result.results, result.folder)
    for path, text in extra.values():
        write_atomic(path, text)
    (result.folder.root / TRACEBACK_NAME).unlink(missing_ok=True)
    paths = {"results": result.folder.results_json, "report": result.folder.report_md}
    paths.update({name: path for name, (path, _) in extra.items()})
    return RunOutcome(results=typed, folder=result.folder.root, paths=paths, document=result.results)


def compare(
    ckpts: Sequence[str | Path],
    ref: str | Path,
    out: Path,
    *,
    tasks: str | Sequence[str] = ("ppl",),
    text_file: Path | None = None,
    corpus: str = "auto",
    allow_download: bool = False,
    chats: Path | None = None,
    calibration: Path | None = None,
    thresholds: Path | None = None,
    specs: Mapping[str, Path] | None = None,
    backend: str = "auto",
    dtype: str = "bfloat16",
    device: str = "cpu",
    stream: bool = False,
    max_memory: str | None = None,
    trust_remote_code: bool = False,
    noise_floor: bool = True,
    executor: str = "local",
    ray_address: str | None = None,
    fixtures: Path = DEFAULT_FIXTURES,
    plots: bool = True,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    on_load: OnLoad | None = None,
    on_candidate: Callable[[str], Any] | None = None,
) -> CompareOutcome:
    """Compare many candidates with one reference observed once, and write compare.{json,md} (`evalsuite
    compare`).

    Args:
        ckpts: the candidates: checkpoint folders, cached hub ids or fixture names.
        ref: the reference checkpoint or a recording of it.
        out: the comparison folder (compare.json, compare.md, one run folder per candidate).
        tasks: the tasks, as a list or comma-separated.
        text_file: score this UTF-8 text instead of a corpus.
        corpus: `auto`, `wikitext-2-raw-v1` or `python-docs`.
        allow_download: let datasets fetch WikiText-2 from the hub.
        chats: score `ppl` on this JSONL file's chats (as in `run`).
        calibration: the candidates' calibration data (as in `run`).
        thresholds: a TOML file overriding spec thresholds.
        specs: task name → a spec file replacing the shipped tasks/TASK.toml.
        backend: how the candidates are executed (as in `run`).
        dtype: compute dtype.
        device: `cpu`, `cuda`, `cuda:N` or `auto`.
        stream: run every side one decoder layer at a time.
        max_memory: memory a side may fill.
        trust_remote_code: allow code from the checkpoint folders.
        noise_floor: measure ppl's noise floor (the reference again with BF16-sized noise).
        executor: `local` (one candidate after another) or `ray`.
        ray_address: the Ray cluster's address [default: RAY_ADDRESS, else a local cluster].
        fixtures: where fixture names are looked up.
        plots: draw the plots (each run's and the comparison's); False for the tables alone.
        progress: as in `run`.
        cancel: as in `run`.
        on_load: as in `run`.
        on_candidate: called with each candidate's name as its run begins.

    Returns:
        The typed comparison and every candidate's typed results.
    """
    from evalsuite.candidates.comparing import CompareRequest
    from evalsuite.candidates.comparing import compare as compare_all
    from evalsuite.protocol.task import RunContext

    options = backend_options(dtype, device, trust_remote_code, stream, max_memory)
    request = CompareRequest(
        ref=resolve_source(ref, fixtures),
        ckpts=[resolve_source(c, fixtures) for c in ckpts],
        tasks=_task_list(tasks),
        out=Path(out),
        context=RunContext(
            corpus_name=corpus,
            text_file=text_file,
            allow_download=allow_download,
            plots=plots,
            chats_file=chats,
            calibration_file=calibration,
        ),
        ckpt_options=dataclasses.replace(options, backend=backend),
        ref_options=options,
        thresholds=read_thresholds(thresholds),
        thresholds_file=thresholds,
        specs=dict(specs or {}),
        noise_floor=noise_floor,
        executor=executor,
        ray_address=ray_address,
    )
    result = compare_all(
        request, progress=_progress(progress, cancel), on_load=on_load, on_candidate=on_candidate
    )
    return CompareOutcome(
        comparison=Comparison.model_validate(result.comparison),
        candidates={name: Results.model_validate(doc) for name, doc in result.candidates.items()},
        out=result.out,
    )


def record(
    ckpt: str | Path,
    out: Path,
    *,
    tasks: str | Sequence[str] = ("ppl",),
    text_file: Path | None = None,
    corpus: str = "auto",
    allow_download: bool = False,
    corpus_path: Path | None = None,
    chats: Path | None = None,
    draft: Path | None = None,
    specs: Mapping[str, Path] | None = None,
    dtype: str = "bfloat16",
    device: str = "cpu",
    stream: bool = False,
    max_memory: str | None = None,
    trust_remote_code: bool = False,
    fixtures: Path = DEFAULT_FIXTURES,
    execution_floor: bool = False,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    on_load: OnLoad | None = None,
) -> RecordOutcome:
    """Observe one checkpoint and save a compact recording that `run(ref=…)` accepts instead of the model
    (`evalsuite record`).

    Args:
        ckpt: the checkpoint to record (the BF16 reference).
        out: the recording folder, e.g. reference_outputs/NAME.
        tasks: the tasks, as a list or comma-separated.
        text_file: score this UTF-8 text instead of a corpus.
        corpus: `auto`, `wikitext-2-raw-v1` or `python-docs`.
        allow_download: let datasets fetch WikiText-2 from the hub.
        corpus_path: a local copy of WikiText-2's raw test split.
        chats: record `ppl` on this JSONL file's chats (as in `run`).
        draft: the draft checkpoint `specdec` drafts with (as in `run`).
        specs: task name → a spec file replacing the shipped tasks/TASK.toml.
        dtype: compute dtype.
        device: `cpu`, `cuda`, `cuda:N` or `auto`.
        stream: run one decoder layer at a time.
        max_memory: memory the side may fill.
        trust_remote_code: allow code from the checkpoint folder.
        fixtures: where fixture names are looked up.
        execution_floor: also record the reference against itself batched (as in `run`).
        progress: as in `run`.
        cancel: as in `run`.
        on_load: as in `run`.
    """
    from evalsuite.pipeline.runner import RecordRequest
    from evalsuite.protocol.task import RunContext

    request = RecordRequest(
        ckpt=resolve_source(ckpt, fixtures),
        tasks=_task_list(tasks),
        out=Path(out),
        context=RunContext(
            corpus_name=corpus,
            text_file=text_file,
            allow_download=allow_download,
            corpus_path=corpus_path,
            chats_file=chats,
            execution_floor=execution_floor,
            draft_path=draft,
        ),
        options=backend_options(dtype, device, trust_remote_code, stream, max_memory),
        specs=dict(specs or {}),
    )
    return record_request(request, progress=progress, cancel=cancel, on_load=on_load)


def record_request(
    request: RecordRequest,
    *,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    on_load: OnLoad | None = None,
) -> RecordOutcome:
    """Record a prepared `RecordRequest` (what `record` does once its options are read).

    Args:
        request: the recording, as `evalsuite.pipeline.runner.RecordRequest`.
        progress: as in `run`.
        cancel: as in `run`.
        on_load: as in `run`.
    """
    from evalsuite.contract.results import load_recording_manifest
    from evalsuite.pipeline.runner import record as record_side
    from evalsuite.protocol.recording import MANIFEST

    path = record_side(request, progress=_progress(progress, cancel), on_load=on_load)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return RecordOutcome(path=path, manifest=load_recording_manifest(path / MANIFEST), size_bytes=size)


def report(run_dir: Path, format: ReportFormat = "md") -> Path:
    """Re-render a run from its results.json alone (`evalsuite report`); returns the file written.

    Args:
        run_dir: a run folder holding results.json.
        format: `md` (report.md), `model-card` (model-card.md) or `json` (results.json, rewritten).
    """
    import json

    from evalsuite.contract.results import read_results
    from evalsuite.reporting.diff_report import render_markdown

    run_dir = Path(run_dir)
    results = read_results(run_dir / "results.json")
    if format == "model-card":
        from evalsuite.reporting.model_card import render_model_card

        target, text = run_dir / "model-card.md", render_model_card(results)
    elif format == "md":
        target, text = run_dir / "report.md", render_markdown(results)
    elif format == "json":
        target, text = run_dir / "results.json", json.dumps(results, indent=2) + "\n"
    else:
        raise InputError(f"unknown format {format!r}; use model-card, md or json")
    write_atomic(target, text)
    return target


def tune_allocator() -> bool:
    """Let evalsuite set glibc's malloc thresholds in this process, as the command line does; whether it will
    (False on another C library, where nothing is ever set). It lasts as long as the process.

    Why a program opts in: loads keep their temporaries in the heaps and long windows map their large blocks,
    both through `mallopt`, after which glibc's dynamic thresholds are off for good and cannot be restored.
    So `run`, `compare` and `record` leave the allocator alone unless this was called (the CLI calls it).
    """
    from evalsuite.backends.c_heap import allow_thresholds

    return allow_thresholds()


def cache(*, clear: bool = False, fixtures: Path = DEFAULT_FIXTURES) -> list[CacheKind]:
    """What evalsuite keeps between runs (`evalsuite cache`): each kind's folder, entries and bytes. Token
    ids and passed load plans (`$EVALSUITE_CACHE`) are kept under `$EVALSUITE_CACHE_MAX_MB` together, the
    least recently used dropped first; file digests are not evicted; fixtures are shown, never removed here.

    Args:
        clear: first remove every kind but the fixtures, returning what each held; fixtures: the folder shown.
    """
    from evalsuite.files.run_cache import cache_usage, clear_cache

    return clear_cache(fixtures) if clear else cache_usage(fixtures)
