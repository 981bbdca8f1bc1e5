"""The command line: `run`, `compare`, `record`, `report`, `fixtures`, `demo`, `manifest`, `tasks`, `inspect`,
`cache`.

Exit codes: 0 every check passed, 1 a check failed (a regression), 2 the run could not be done (bad input, a
missing dependency), 3 an internal error (any other exception: a bug, a changed library), 4 out of a system
resource (device or host memory exhausted, wherever: a bigger machine or `--stream` helps; too many open
files: a higher `ulimit -n` helps), 130 interrupted; the reason is one line on stderr, and for 3 and 4 the
traceback is in a file.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from typer.exceptions import TyperException

# read_thresholds, the demo's names, PROGRESS_LINES and ProgressLines are named here too, where callers have
# always found them.
from evalsuite.api import (  # noqa: F401
    DEFAULT_FIXTURES,
    TRACEBACK_NAME,
    default_run_folder,
    read_thresholds,
    resolve_source,
    tune_allocator,
)
from evalsuite.cli.demo import DEMO_CKPT, DEMO_OUT, DEMO_TASKS, DEMO_THRESHOLDS, VISION_DEMO_OUT  # noqa: F401
from evalsuite.cli.options import (
    CalibrationOption,
    ChatsOption,
    CorpusPath,
    Device,
    DraftOption,
    Dtype,
    ExecutionFloor,
    MaxMemory,
    SpecOption,
    Stream,
    parse_specs,
    task_names,
)
from evalsuite.cli.output import (  # noqa: F401
    PROGRESS_LINES,
    ProgressLines,
    announce_load,
    console,
    progress_display,
    summarise_noise,
    third_party_quiet,
)
from evalsuite.errors import (
    EvalsuiteError,
    ResourceError,
    is_out_of_descriptors,
    is_out_of_memory,
    out_of_descriptors_line,
    out_of_memory_line,
)
from evalsuite.files import leases as file_leases
from evalsuite.files.run_folder import write_atomic
from evalsuite.plotting import plot_process

if TYPE_CHECKING:
    from evalsuite.api import RunOutcome
    from evalsuite.pipeline.runner import RunRequest

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Validate a quantized checkpoint against its reference and write a diff report.",
)
# The folder a command writes its run into, once known: an internal error's traceback goes there, beside the
# reports it did not write (else to a file in the temporary folder).
output_folder: contextvars.ContextVar[Path | None] = contextvars.ContextVar("output_folder", default=None)


def execute(
    request: RunRequest, quiet: bool = False, junit: Path | None = None, model_card: bool = False
) -> int:
    """Run a request with progress bars, write the reports, print the table; return the exit code."""
    from evalsuite.api import run_request

    if request.context.plots:
        plot_process.start()
    with third_party_quiet() as noise, progress_display(quiet) as progress:
        outcome = run_request(
            request, progress=progress, on_load=announce_load, junit=junit, model_card=model_card
        )
    summarise_noise(noise)
    return show_run(outcome)


def show_run(outcome: RunOutcome) -> int:
    """Print a run's summary table and where its report is; return its exit code (2, no verdict, as an
    error whose one line says why)."""
    from evalsuite.reporting.diff_report import print_summary

    print_summary(outcome.document, Console())
    print(f"report: {outcome.paths['report']}")
    if outcome.exit_code == 2:
        # Nothing failed a check, but nothing could be compared either (every task skipped, or one failed to
        # run): say why in the one line the exit code promises.
        why = "; ".join(
            f"{name} {entry.status}: {entry.reason or ''}" for name, entry in outcome.results.tasks.items()
        )
        raise EvalsuiteError(f"no verdict: {why}")
    return outcome.exit_code


@app.command("run")
def run_command(
    ckpt: Annotated[
        str, typer.Option(help="Candidate checkpoint: a folder, a cached hub id, or a fixture name.")
    ],
    ref: Annotated[str, typer.Option(help="Reference checkpoint (the BF16 source), same forms as --ckpt.")],
    tasks: Annotated[str, typer.Option(help="Comma-separated tasks.")] = "ppl",
    out: Annotated[Path | None, typer.Option(help="Run folder [default: reports/<ckpt name>].")] = None,
    text_file: Annotated[Path | None, typer.Option(help="Score this UTF-8 text instead of a corpus.")] = None,
    corpus: Annotated[str, typer.Option(help="auto, wikitext-2-raw-v1 or python-docs.")] = "auto",
    allow_download: Annotated[bool, typer.Option(help="Let datasets fetch WikiText-2 from the hub.")] = False,
    corpus_path: CorpusPath = None,
    chats: ChatsOption = None,
    calibration: CalibrationOption = None,
    draft: DraftOption = None,
    thresholds: Annotated[Path | None, typer.Option(help="TOML overriding spec thresholds.")] = None,
    spec: SpecOption = None,
    baseline: Annotated[
        Path | None, typer.Option(help="An accepted earlier results.json: fail on metrics that worsened.")
    ] = None,
    junit: Annotated[
        Path | None, typer.Option(help="Also write JUnit XML (one test case per check).")
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            help="How the candidate is executed: hf (Transformers), intref (integer W4A8), exl3 (exllamav3 "
            "on CUDA, else decoded weights), llamacpp (a GGUF file through llama.cpp), or auto (exl3 for an "
            "EXL3 pack, hf otherwise)."
        ),
    ] = "auto",
    dtype: Dtype = "bfloat16",
    device: Device = "cpu",
    stream: Stream = False,
    max_memory: MaxMemory = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow code from the checkpoint folders.")] = False,
    resume: Annotated[bool, typer.Option(help="Reuse observations saved by an earlier run.")] = True,
    keep_observations: Annotated[
        bool,
        typer.Option(help="Keep this run's observations in OUT/observations (for resuming, re-comparing)."),
    ] = True,
    fixtures: Annotated[Path, typer.Option(help="Where fixture names are looked up.")] = DEFAULT_FIXTURES,
    plots: Annotated[
        bool, typer.Option("--plots/--no-plots", help="Draw the PNG plots (--no-plots: tables only).")
    ] = True,
    execution_floor: ExecutionFloor = False,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> int:
    """Compare a candidate checkpoint with its reference and write reports/NAME/{results.json,report.md}."""
    from evalsuite import api

    out = out or default_run_folder(resolve_source(ckpt, fixtures))
    output_folder.set(out)
    if plots:
        plot_process.start()
    with third_party_quiet() as noise, progress_display(quiet) as progress:
        outcome = api.run(
            ckpt,
            ref,
            tasks=task_names(tasks),
            out=out,
            text_file=text_file,
            corpus=corpus,
            allow_download=allow_download,
            corpus_path=corpus_path,
            chats=chats,
            calibration=calibration,
            draft=draft,
            thresholds=thresholds,
            specs=parse_specs(spec),
            baseline=baseline,
            junit=junit,
            backend=backend,
            dtype=dtype,
            device=device,
            stream=stream,
            max_memory=max_memory,
            trust_remote_code=trust_remote_code,
            resume=resume,
            keep_observations=keep_observations,
            fixtures=fixtures,
            plots=plots,
            execution_floor=execution_floor,
            progress=progress,
            on_load=announce_load,
        )
    summarise_noise(noise)
    return show_run(outcome)


@app.command("compare")
def compare_command(
    ckpt: Annotated[
        list[str],
        typer.Option(help="A candidate (repeatable): a folder, a cached hub id, or a fixture name."),
    ],
    ref: Annotated[str, typer.Option(help="Reference checkpoint or a recording of it, observed once.")],
    out: Annotated[
        Path, typer.Option(help="Comparison folder: compare.{md,json}, one run folder per candidate.")
    ],
    tasks: Annotated[str, typer.Option(help="Comma-separated tasks.")] = "ppl",
    text_file: Annotated[Path | None, typer.Option(help="Score this UTF-8 text instead of a corpus.")] = None,
    corpus: Annotated[str, typer.Option(help="auto, wikitext-2-raw-v1 or python-docs.")] = "auto",
    allow_download: Annotated[bool, typer.Option(help="Let datasets fetch WikiText-2 from the hub.")] = False,
    chats: ChatsOption = None,
    calibration: CalibrationOption = None,
    thresholds: Annotated[Path | None, typer.Option(help="TOML overriding spec thresholds.")] = None,
    spec: SpecOption = None,
    backend: Annotated[
        str, typer.Option(help="How the candidates are executed (as `run --backend`).")
    ] = "auto",
    dtype: Dtype = "bfloat16",
    device: Device = "cpu",
    stream: Stream = False,
    max_memory: MaxMemory = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow code from the checkpoint folders.")] = False,
    noise_floor: Annotated[
        bool, typer.Option(help="Measure ppl's noise floor: the reference again with BF16-sized noise.")
    ] = True,
    executor: Annotated[str, typer.Option(help="local (one candidate after another) or ray.")] = "local",
    ray_address: Annotated[
        str | None, typer.Option(help="Ray cluster address [default: RAY_ADDRESS, else a local cluster].")
    ] = None,
    fixtures: Annotated[Path, typer.Option(help="Where fixture names are looked up.")] = DEFAULT_FIXTURES,
    plots: Annotated[
        bool, typer.Option("--plots/--no-plots", help="Draw the PNG plots (--no-plots: tables only).")
    ] = True,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> int:
    """Compare many candidates with one reference: each candidate's run, and DIR/compare.{md,json}."""
    from evalsuite import api

    if plots:
        plot_process.start()
    with third_party_quiet() as noise, progress_display(quiet) as progress:
        outcome = api.compare(
            ckpt,
            ref,
            out,
            tasks=task_names(tasks),
            text_file=text_file,
            corpus=corpus,
            allow_download=allow_download,
            chats=chats,
            calibration=calibration,
            thresholds=thresholds,
            specs=parse_specs(spec),
            backend=backend,
            dtype=dtype,
            device=device,
            stream=stream,
            max_memory=max_memory,
            trust_remote_code=trust_remote_code,
            noise_floor=noise_floor,
            executor=executor,
            ray_address=ray_address,
            fixtures=fixtures,
            plots=plots,
            progress=progress,
            on_load=announce_load,
            on_candidate=lambda name: console.print(f"candidate: {name}"),
        )
    summarise_noise(noise)
    for row in outcome.comparison.candidates:
        front = " (front)" if row.pareto else ""
        print(f"{row.name}\t{row.verdict}\tbpw {row.bits_per_weight}\tkld {row.kld_mean}{front}")
    print(f"comparison: {outcome.out / 'compare.md'}")
    return outcome.exit_code


@app.command("record")
def record_command(
    ckpt: Annotated[str, typer.Option(help="The checkpoint to record (the BF16 reference).")],
    out: Annotated[Path, typer.Option(help="Recording folder, e.g. reference_outputs/NAME.")],
    tasks: Annotated[str, typer.Option(help="Comma-separated tasks.")] = "ppl",
    text_file: Annotated[Path | None, typer.Option(help="Score this UTF-8 text instead of a corpus.")] = None,
    corpus: Annotated[str, typer.Option(help="auto, wikitext-2-raw-v1 or python-docs.")] = "auto",
    allow_download: Annotated[bool, typer.Option(help="Let datasets fetch WikiText-2 from the hub.")] = False,
    corpus_path: CorpusPath = None,
    chats: ChatsOption = None,
    draft: DraftOption = None,
    spec: SpecOption = None,
    dtype: Dtype = "bfloat16",
    device: Device = "cpu",
    stream: Stream = False,
    max_memory: MaxMemory = None,
    trust_remote_code: Annotated[bool, typer.Option(help="Allow code from the checkpoint folder.")] = False,
    fixtures: Annotated[Path, typer.Option(help="Where fixture names are looked up.")] = DEFAULT_FIXTURES,
    execution_floor: ExecutionFloor = False,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> int:
    """Observe one checkpoint and save a compact recording that `run --ref` accepts instead of the model."""
    from evalsuite import api

    with progress_display(quiet) as progress:
        outcome = api.record(
            ckpt,
            out,
            tasks=task_names(tasks),
            text_file=text_file,
            corpus=corpus,
            allow_download=allow_download,
            corpus_path=corpus_path,
            chats=chats,
            draft=draft,
            specs=parse_specs(spec),
            dtype=dtype,
            device=device,
            stream=stream,
            max_memory=max_memory,
            trust_remote_code=trust_remote_code,
            fixtures=fixtures,
            execution_floor=execution_floor,
            progress=progress,
            on_load=announce_load,
        )
    console.print(f"recording: {outcome.path} ({outcome.size_bytes:,} bytes)")
    return 0


@app.command("report")
def report_command(
    run_dir: Annotated[Path, typer.Argument(help="A run folder holding results.json.")],
    format: Annotated[str, typer.Option(help="model-card, md or json.")] = "md",
) -> int:
    """Re-render a run from its results.json alone: report.md, model-card.md or results.json."""
    from evalsuite import api

    print(api.report(run_dir, format))  # type: ignore[arg-type]  # api.report refuses an unknown format
    return 0


@app.command("fixtures")
def fixtures_command(
    out: Annotated[
        Path, typer.Option(help="Folder that receives one sub-folder per fixture.")
    ] = DEFAULT_FIXTURES,
    only: Annotated[list[str] | None, typer.Option(help="Build only these fixtures (repeatable).")] = None,
) -> int:
    """Build the offline test checkpoints (cached by a hash of their recipe)."""
    from evalsuite.fixtures import build_fixtures

    built = build_fixtures(out, only or None, progress=lambda msg: console.print(msg))
    for name, path in built.items():
        print(f"{name}\t{path}")
    return 0


@app.command("demo")
def demo_command(
    fixtures: Annotated[Path, typer.Option(help="Where the SmolLM2 pair is built.")] = DEFAULT_FIXTURES,
    out: Annotated[Path, typer.Option(help="Run folder.")] = DEMO_OUT / DEMO_CKPT,
    corpus: Annotated[str, typer.Option(help="auto, wikitext-2-raw-v1 or python-docs.")] = "auto",
    tasks: Annotated[str, typer.Option(help="Comma-separated tasks.")] = DEMO_TASKS,
    record: Annotated[
        Path | None, typer.Option(help="Also (re)record the reference into this folder first.")
    ] = None,
    vision: Annotated[
        bool, typer.Option(help="Show the vision task instead, on the tiny MiniCPM-V 4.7 pair (see below).")
    ] = False,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
) -> int:
    """Build the SmolLM2-135M BF16 / W4A8 pair if needed, run the suite on it, and write the model card.

    The reports go to demo-reports/ (git-ignored). The committed examples are regenerated, from the
    repository root, by `evalsuite demo --out reports/smollm2-135m-w4a8 --corpus python-docs --tasks
    ppl,tensors,intref,lmeval --record reference_outputs/smollm2-135m-bf16`. The pair is judged by
    tasks/demo-thresholds.toml (a 135 M round-to-nearest pack fails the shipped defaults, rightly).

    `--vision` runs `vision` on the tiny MiniCPM-V 4.7 pair instead, with `ppl` on the shipped chats through
    its chat template (tasks/ppl-chat.toml). No model that can see can be had
    offline (no vision-language model ships in a package index wheel), so the pair has random weights: its
    vision-tower parity passes (the W4A8 copy keeps the tower byte for byte) and both answers fail.
    """
    from evalsuite.cli.demo import demo_request, vision_demo_request

    if vision:
        output_folder.set(VISION_DEMO_OUT)
        return execute(vision_demo_request(fixtures), quiet=quiet)
    output_folder.set(out)
    request = demo_request(fixtures, out, corpus, task_names(tasks), record)
    return execute(request, quiet=quiet, model_card=True)


@app.command("manifest")
def manifest_command(
    ckpt: Annotated[str, typer.Argument(help="A checkpoint folder (or fixture name) to list.")],
    fixtures: Annotated[Path, typer.Option(help="Where fixture names are looked up.")] = DEFAULT_FIXTURES,
) -> int:
    """Write CKPT/SHA256SUMS: every file of the folder with its SHA-256, in sha256sum's format (`sha256sum -c
    SHA256SUMS` checks it; the `tensors` task verifies it in a candidate)."""
    from evalsuite.files.digest import DigestCache
    from evalsuite.files.manifest import write_sha256sums

    path, count = write_sha256sums(Path(resolve_source(ckpt, fixtures)), DigestCache.default())
    print(f"{path}\t{count} files")
    return 0


@app.command("tasks")
def tasks_command() -> int:
    """List the registered tasks, where each one's spec comes from, and what it does."""
    from evalsuite.pipeline.registry import registered_tasks, spec_source

    for name, cls in registered_tasks().items():
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        print(f"{name}\t{spec_source(cls)}\t{cls.__module__}\t{doc}")
    return 0


@app.command("inspect")
def inspect_command(
    source: Annotated[str, typer.Argument(help="A checkpoint folder, cached hub id, or fixture name.")],
    fixtures: Annotated[Path, typer.Option(help="Where fixture names are looked up.")] = DEFAULT_FIXTURES,
) -> int:
    """Show what the files of a checkpoint say: format, tensors by dtype, bytes, fingerprint."""
    from collections import Counter

    from evalsuite.files.checkpoint import Checkpoint

    ckpt = Checkpoint.open(resolve_source(source, fixtures))
    by_dtype = Counter(t.dtype for t in ckpt.tensors.values())
    print(f"path\t{ckpt.path}\nformat\t{ckpt.format}\nmodel_type\t{ckpt.model_type}")
    print(f"tensors\t{len(ckpt.tensors)}\t" + ", ".join(f"{k}: {v}" for k, v in sorted(by_dtype.items())))
    print(f"bytes\t{ckpt.total_bytes:,}\nfingerprint\t{ckpt.fingerprint}")
    return 0


@app.command("cache")
def cache_command(
    clear: Annotated[bool, typer.Option("--clear", help="Remove every kind but the fixtures.")] = False,
    fixtures: Annotated[Path, typer.Option(help="The fixtures folder to show.")] = DEFAULT_FIXTURES,
) -> int:
    """Show what evalsuite keeps between runs: each kind's entries, bytes and folder.

    Token ids and passed load plans ($EVALSUITE_CACHE, default ~/.cache/evalsuite) are kept under
    $EVALSUITE_CACHE_MAX_MB megabytes together (default 256), the least recently used dropped first; file
    digests are not evicted (dropping one costs hashing its checkpoint again); fixtures are shown, never
    removed here (`evalsuite fixtures` rebuilds them, in minutes). `--clear` removes all but the fixtures.
    """
    from evalsuite import api

    for kind in api.cache(clear=clear, fixtures=fixtures):
        what = "removed" if clear and kind.clearable else "kept" if clear else ""
        line = f"{kind.name}\t{kind.entries} entries\t{kind.size_bytes:,} bytes\t{kind.folder}\t{what}"
        print(line.rstrip("\t"))
    return 0


def main(argv: list[str] | None = None) -> None:
    """Console entry point: map evalsuite errors to one line and exit code 2 (4 out of resources)."""
    args = sys.argv[1:] if argv is None else argv
    # Hub libraries read these at import; without them a missing dataset or model retries the network for
    # half a minute before failing. --allow-download lifts them for the one run that asks.
    os.environ.setdefault("TQDM_DISABLE", "1")  # third-party tqdm bars would interleave with evalsuite's own
    if not os.environ.get("EVALSUITE_VERBOSE"):
        # compressed-tensors' own switch, read when it configures its logger at import.
        os.environ.setdefault("COMPRESSED_TENSORS_LOG_DISABLED", "1")
    if "--allow-download" not in args:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if not sys.stdout.isatty():
        # Piped help is typer's rich panels at 80 columns, which cut option names: give it room.
        os.environ.setdefault("TERMINAL_WIDTH", "120")
    output_folder.set(None)  # an in-process caller may run several commands
    try:
        # Inside the mapping: the modules it imports may fail to open (too many open files), exit 4 as well.
        tune_allocator()  # the process is evalsuite's own: its loads keep their temporaries in the heaps
        code = app(args=args, prog_name="evalsuite", standalone_mode=False)
        if code == 130:  # typer turns Ctrl-C into exit code 130, silently
            raise KeyboardInterrupt
    except ResourceError as exc:
        print(f"evalsuite: error: {exc}", file=sys.stderr)
        sys.exit(4)
    except EvalsuiteError as exc:
        changed = file_leases.change_heard()
        if changed is None and is_out_of_descriptors(exc):  # said of a file it could not open: not the file's
            exit_out_of_descriptors(exc)
        print(f"evalsuite: error: {changed or exc}", file=sys.stderr)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        print(
            "evalsuite: interrupted; run the same command again to resume where it stopped (exit 130)",
            file=sys.stderr,
        )
        sys.exit(130)
    except TyperException as exc:  # usage errors: typer vendors click, so its exceptions live here
        exc.show()
        sys.exit(2)
    except Exception as exc:
        # A leased file about to change ended the run, whatever a handler made of its error on the way out.
        if changed := file_leases.change_heard():
            print(f"evalsuite: error: {changed}", file=sys.stderr)
            sys.exit(2)
        if is_out_of_memory(exc):  # wherever it happens: the machine's limit, not a bug (exit 4)
            print(f"evalsuite: error: {out_of_memory_line(exc)}; {write_traceback(exc)}", file=sys.stderr)
            sys.exit(4)
        if is_out_of_descriptors(exc):  # the process's limit of open files, not a bug either
            exit_out_of_descriptors(exc)
        # Not evalsuite's own: a bug, a library that changed. Never exit 1, which CI reads as a failed check.
        print(internal_error(exc), file=sys.stderr)
        sys.exit(3)
    sys.exit(code if isinstance(code, int) else 0)


def exit_out_of_descriptors(exc: BaseException) -> NoReturn:
    """End a run that ran out of open files: one line naming the limit and how to raise it, exit 4."""
    print(f"evalsuite: error: {out_of_descriptors_line()}; {write_traceback(exc)}", file=sys.stderr)
    sys.exit(4)


def internal_error(exc: BaseException) -> str:
    """Write the traceback of `exc` beside the run's reports (or to a temporary file) and return the one
    line that names it. The reports themselves are never half-written (each is replaced atomically)."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"evalsuite: internal error: {type(exc).__name__}: {message}; {write_traceback(exc)}"


def write_traceback(exc: BaseException) -> str:
    """Write the traceback of `exc` beside the run's reports (or to a temporary file); say where."""
    text = "".join(traceback.format_exception(exc))
    folder = output_folder.get()
    target = None
    candidates = [folder / TRACEBACK_NAME] if folder is not None else []
    # Finding the temporary folder opens files: a process out of them has none, and still says why it ended.
    with contextlib.suppress(OSError):
        candidates.append(Path(tempfile.gettempdir()) / f"evalsuite-traceback-{os.getpid()}.txt")
    for candidate in candidates:
        try:
            write_atomic(candidate, text)
        except OSError:
            continue
        target = candidate
        break
    return f"traceback in {target}" if target is not None else "the traceback could not be written"


if __name__ == "__main__":
    main()
