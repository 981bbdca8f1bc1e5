"""evalsuite on a lent GPU machine: every task on CUDA against the same run on that machine's CPU.

Parts (each a few CLI runs of at most RUN_LIMIT seconds; the lent machine gives 15 minutes of device time in
all, so `tiny-cuda` comes first and the others as time allows):

- `tiny-cuda`: the tiny MiniCPM-V 4.7 pair, every task on backend hf with `--device cuda` and `cpu`; backend
  intref's tasks on both; `ppl,moe,layers --stream` on cuda.
- `auto`: `ppl,moe,layers --device auto` (accelerate's device_map; streamed needs on cuda:0) against cpu.
- `exl3`: the tiny EXL3 pack, `--backend exl3` on cuda (exllamav3 where it imports, else the decoded
  weights) against cpu. exllamav3 builds its CUDA extension at import, longer than a lease allows: its
  kernels' bit-exactness is bench/exl3_gpu_check.sh's, with golden vectors.
- `wide`: the real-shape wide pair (real widths and vocabulary, 4 layers), built on the device, `ppl` loaded
  on cuda: torch's peak CUDA memory against the memory plan's loaded peak.

For each run it prints the exit code, the wall time, torch's peak CUDA memory (max_memory_allocated, through
bench/sides/cuda_peak.py) and nvidia-smi's (the whole device, CUDA context included), the memory plan, and the
agreement of every metric with the CPU run of the same pair. Tolerances: the devices' kernels round
differently, so metrics agree within 2% relative or 1e-4 absolute for perplexity-like and rate metrics and
counts, and 25% relative or 1e-5 absolute for KLD-like ones (a KLD between two executions of one model is
rounding noise); strings and booleans equal exactly, the execution's description aside. Standard errors are
not compared: each is an estimate derived from a rate that is compared, and near a rate of 1 it moves by a
fifth when one token flips.

    bash bench/gpu_check.sh [--dry-run | --quick] [PART ...]     (installs .whl/*.whl first, then this)
    python bench/gpu_check.py [--dry-run | --quick] [PART ...]

`--dry-run` (any machine): what each part would run and its fixtures' memory plans. `--quick` rehearses
`tiny-cuda` on this CPU (cpu standing in for cuda): it checks the script, not the device.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import figures

from evalsuite.fixtures.names import REAL_WIDE_BF16, REAL_WIDE_W4A8

ROOT = Path(__file__).resolve().parent.parent
RUN_LIMIT = 300  # seconds: a run that takes longer on a GPU is itself the finding
WORK = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/evalsuite-gpu-check"))
TASKS = "ppl,smoke,vision,tensors,intref,moe,layers"
INTREF_TASKS = "ppl,smoke,vision,moe,layers"  # what backend intref executes (tensors reads files only)
STREAMED_TASKS = "ppl,moe,layers"
TINY = ("tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8")
TINY_EXL3 = ("tiny-minicpmv47-bf16", "tiny-minicpmv47-exl3")
WIDE = (REAL_WIDE_BF16, REAL_WIDE_W4A8)
# A loaded side's peak against the plan's loaded peak (issue 39's bound for the loaded peak).
PLAN_RATIO_GOAL = "<= 1.25"


@dataclass(frozen=True)
class Run:
    """One `evalsuite run` of a part: its pair, its arguments, and the run its metrics must agree with."""

    name: str
    pair: tuple[str, str]
    args: tuple[str, ...]
    against: str | None = None
    plan_goal: bool = False  # judge torch's peak against the memory plan (loaded runs of a real shape)


CPU = Run("cpu", TINY, ("--tasks", TASKS, "--device", "cpu"))
INTREF_CPU = Run("intref-cpu", TINY, ("--tasks", INTREF_TASKS, "--backend", "intref", "--device", "cpu"))
EXL3_CPU = Run("exl3-cpu", TINY_EXL3, ("--tasks", "ppl", "--backend", "exl3", "--device", "cpu"))
PARTS: dict[str, list[Run]] = {
    "tiny-cuda": [
        CPU,
        Run("cuda", TINY, ("--tasks", TASKS, "--device", "cuda"), against="cpu"),
        INTREF_CPU,
        Run(
            "intref-cuda",
            TINY,
            ("--tasks", INTREF_TASKS, "--backend", "intref", "--device", "cuda"),
            against="intref-cpu",
        ),
        Run("stream-cuda", TINY, ("--tasks", STREAMED_TASKS, "--stream", "--device", "cuda"), against="cpu"),
    ],
    "auto": [CPU, Run("auto", TINY, ("--tasks", STREAMED_TASKS, "--device", "auto"), against="cpu")],
    "exl3": [
        EXL3_CPU,
        Run("exl3-cuda", TINY_EXL3, ("--tasks", "ppl", "--backend", "exl3", "--device", "cuda"), "exl3-cpu"),
    ],
    "wide": [Run("wide-cuda", WIDE, ("--tasks", "ppl", "--device", "cuda"), plan_goal=True)],
}


RUNS = {run.name: run for runs in PARTS.values() for run in runs}
reported: set[str] = set()


@dataclass
class Outcome:
    """What one run did."""

    rc: int | None
    seconds: float
    peak_allocated: int | None
    peak_reserved: int | None
    smi_peak_mib: int | None
    plan_bytes: int
    tail: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)


def fixture_folder(name: str) -> Path:
    return figures.TEST_FIXTURES / name


def build_fixtures(names: tuple[str, ...]) -> None:
    """Build the fixtures a run needs that this machine lacks (the device starts bare)."""
    missing = [n for n in names if not (fixture_folder(n) / "config.json").is_file()]
    if not missing:
        return
    only = [arg for name in missing for arg in ("--only", name)]
    command = [sys.executable, "-m", "evalsuite.cli", "fixtures", "--out", str(figures.TEST_FIXTURES), *only]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"gpu_check: building {', '.join(missing)} failed:\n{proc.stderr[-2000:]}")


def plan_bytes(pair: tuple[str, str], args: tuple[str, ...]) -> int:
    """The memory plan's loaded peak of the larger side (one model is resident at a time); 0 for a fixture
    not built on this machine."""
    from evalsuite.backends.memory import loaded_peak_bytes
    from evalsuite.backends.options import BackendOptions
    from evalsuite.files.checkpoint import Checkpoint

    backend = args[args.index("--backend") + 1] if "--backend" in args else "auto"
    peaks = []
    for side, name in zip(("ref", "ckpt"), pair, strict=True):
        folder = fixture_folder(name)
        if not (folder / "config.json").is_file():
            return 0
        checkpoint = Checkpoint.open(folder)
        options = BackendOptions(backend="auto").for_format(checkpoint.format)
        if side == "ckpt" and backend != "auto":
            options = options.with_backend(backend, {})
        peaks.append(loaded_peak_bytes(checkpoint, options))
    return max(peaks)


def on_device(args: tuple[str, ...], quick: bool) -> tuple[str, ...]:
    """`--quick` rehearses on this CPU: cpu stands in for cuda and auto."""
    if not quick:
        return args
    return tuple("cpu" if a in ("cuda", "auto") else a for a in args)


def sample_gpu(log: Path) -> subprocess.Popen[bytes] | None:
    """nvidia-smi's used memory every 200 ms into `log`, or None where there is no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "200"]
    return subprocess.Popen(query, stdout=log.open("wb"), stderr=subprocess.DEVNULL)


def execute(run: Run, quick: bool, threads: int | None = None) -> Outcome:
    """One CLI run through bench/sides/cuda_peak.py, with its wall time and peaks; `threads`: its torch
    threads (OMP_NUM_THREADS), None for torch's default (every core)."""
    folder = WORK / run.name
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    peak_file, smi_log = WORK / f"{run.name}.peak.json", WORK / f"{run.name}.smi"
    ref, ckpt = (str(fixture_folder(n)) for n in run.pair)
    command = [
        sys.executable, str(ROOT / "bench" / "sides" / "cuda_peak.py"), "run", "--ckpt", ckpt, "--ref", ref,
        "--corpus", "python-docs", "--quiet", "--no-plots", "--out", str(folder), *on_device(run.args, quick),
    ]  # fmt: skip
    env = {**os.environ, "CUDA_PEAK_FILE": str(peak_file)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    smi = sample_gpu(smi_log)
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=RUN_LIMIT, check=False
        )
        rc, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stderr = None, f"timed out after {RUN_LIMIT} s\n{exc.stderr or ''}"
    seconds = time.perf_counter() - start
    if smi is not None:
        smi.terminate()
        smi.wait()
    (WORK / f"{run.name}.stderr").write_text(str(stderr), encoding="utf-8")
    peak = json.loads(peak_file.read_text()) if peak_file.is_file() else {}
    used = [int(x) for x in smi_log.read_text().split() if x.isdigit()] if smi_log.is_file() else []
    return Outcome(
        rc=rc,
        seconds=seconds,
        peak_allocated=peak.get("allocated"),
        peak_reserved=peak.get("reserved"),
        smi_peak_mib=max(used, default=None),
        plan_bytes=plan_bytes(run.pair, run.args),
        tail=failure_lines(str(stderr), folder),
    )


def failure_lines(stderr: str, folder: Path) -> list[str]:
    """The last lines of stderr, and of the traceback evalsuite kept for an internal error (exit 3)."""
    lines = [line for line in stderr.splitlines() if line.strip()][-3:]
    traceback = folder / "traceback.txt"
    if traceback.is_file():
        lines += traceback.read_text(encoding="utf-8", errors="replace").splitlines()[-30:]
    return lines


def agreement(results: Path, against: Path) -> list[str]:
    """Every metric of `results` that differs from `against`'s beyond the module docstring's tolerances
    (only tasks and metrics both runs have)."""
    if not (results.is_file() and against.is_file()):
        return [f"no results.json in {results.parent.name if not results.is_file() else against.parent.name}"]
    a, b = (json.loads(p.read_text(encoding="utf-8")) for p in (results, against))
    outside = []
    for task, entry in a["tasks"].items():
        other = b["tasks"].get(task, {}).get("metrics", {})
        for name, x in entry.get("metrics", {}).items():
            if name not in other or "execution" in name or "stderr" in name:
                continue
            y = other[name]
            if isinstance(x, bool | str) or x is None or y is None or isinstance(x, list | dict):
                ok = x == y
            elif "kld" in name:
                ok = math.isclose(x, y, rel_tol=0.25, abs_tol=1e-5)
            else:
                ok = math.isclose(x, y, rel_tol=0.02, abs_tol=1e-4)
            if not ok:
                outside.append(f"{task}.{name}: {x!r} vs {y!r}")
    return outside


def tasks_of(run: Run) -> str:
    return run.args[run.args.index("--tasks") + 1]


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def dry_run(parts: list[str]) -> None:
    from evalsuite.backends.memory import format_bytes

    for part in parts:
        print(f"part {part}:")
        for run in PARTS[part]:
            against = f" (metrics against {run.against})" if run.against else ""
            print(f"  {run.name}: run {' '.join(run.args)}{against}")
        for name in dict.fromkeys(n for run in PARTS[part] for n in run.pair):
            folder = fixture_folder(name)
            if not (folder / "config.json").is_file():
                print(f"    {name}: not built on this machine (built on the device by the part)")
                continue
            plan = plan_bytes((name, name), ())
            print(f"    {name}: plan {format_bytes(plan)} loaded peak")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", help=f"parts to run, in order (default: all): {', '.join(PARTS)}")
    parser.add_argument("--dry-run", action="store_true", help="list what each part would run, run nothing")
    parser.add_argument(
        "--finish",
        type=Path,
        metavar="DOC",
        help="complete DOC's report from the run folders in GPU_CHECK_WORK",
    )
    figures.add_arguments(parser)
    args = parser.parse_args()
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        print(f"gpu_check: unknown part {unknown[0]} (parts: {', '.join(PARTS)})", file=sys.stderr)
        sys.exit(2)
    parts = args.parts or (["tiny-cuda"] if args.quick else list(PARTS))
    if args.dry_run:
        dry_run(parts)
        return
    if args.finish is not None:
        finish(args.finish)
        return
    if not args.quick:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here (--dry-run lists the parts, --quick rehearses on cpu)")
            sys.exit(2)
    WORK.mkdir(parents=True, exist_ok=True)
    done: dict[str, Outcome] = {}
    lock = threading.Lock()
    with figures.recorded("gpu_check", __doc__, args) as fig:
        fig.data = {"gpu": gpu_description(), "runs": {}}

        def execute_and_keep(run: Run, part: str) -> None:
            outcome = execute(run, args.quick, threads)
            with lock:  # a run's outcome is kept as it ends: a lease that runs out keeps what was measured
                done[run.name] = outcome
                fig.data["runs"][run.name] = {"part": part, "args": list(run.args), **vars(outcome)}
                fig.save()
                print(f"  ({run.name}: exit {outcome.rc}, {outcome.seconds:.0f} s)", flush=True)

        # Part by part (a lease that runs out has finished the first parts): within a part the CPU runs go
        # side by side on the machine's cores while the device runs one at a time (so that nvidia-smi's
        # figure is one run's); a rehearsal (--quick) runs everything in turn.
        workers = 1 if args.quick else max(1, min(2, (os.cpu_count() or 1) // 4))
        # The processes at once share the cores: each with every core as torch threads oversubscribes them
        # (seen on the 16-core lent machine: three processes of 16 threads, the CPU runs unfinished in 5 min).
        threads = None if args.quick else max(1, (os.cpu_count() or 1) // (workers + 1))
        for part in parts:
            runs = [run for run in PARTS[part] if run.name not in done]
            for run in runs:
                build_fixtures(run.pair)
            on_cpu = [run for run in runs if args.quick or "cpu" in run.args]
            with ThreadPoolExecutor(max_workers=workers) as pool:
                cpu_futures = [pool.submit(execute_and_keep, run, part) for run in on_cpu]
                for run in runs:
                    if run not in on_cpu:
                        execute_and_keep(run, part)
                for future in cpu_futures:
                    future.result()
        report_parts(parts, done, fig, fig.data["runs"])


def report_parts(
    parts: list[str], done: dict[str, Outcome], fig: figures.Figures, kept: dict[str, Any]
) -> None:
    """Each part's runs that ended, with their agreement against the CPU run of the same pair."""
    for part in parts:
        print(f"part {part}")
        for run in PARTS[part]:
            outcome = done.get(run.name)
            if outcome is None:
                print(f"  {run.name:<12} not run (the lease ended first)")
                continue
            if run.against is not None and run.against in done:
                outcome.outside = agreement(
                    WORK / run.name / "results.json", WORK / run.against / "results.json"
                )
                kept[run.name]["outside"] = outcome.outside
            report(run, outcome, done, fig)


def finish(document: Path) -> None:
    """Complete the report of a check whose lease ended before its last part did (what it measured was kept as
    each run ended): agreement and figures from the run folders copied back into GPU_CHECK_WORK, written
    beside the partial document under its own date, machine and commit, with a note saying so."""
    doc = json.loads(document.read_text(encoding="utf-8"))
    kept = doc["data"]["runs"]
    if doc["data"].get("gpu") and not doc["machine"].get("gpu"):
        doc["machine"]["gpu"] = doc["data"]["gpu"]
    done = {
        name: Outcome(**{k: v for k, v in run.items() if k not in ("part", "args")})
        for name, run in kept.items()
    }
    parts = [arg for arg in doc["argv"] if arg in PARTS] or list(PARTS)
    unfinished = [part for part in parts if any(run.name not in done for run in PARTS[part])]
    fig = figures.Figures("gpu_check", __doc__, argparse.Namespace(quick=doc["mode"] == "quick"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        report_parts(parts, done, fig, kept)
    print(printed.getvalue(), end="")
    doc["figures"] = fig.figures
    doc["printed"] = [*doc["printed"], *printed.getvalue().splitlines()]
    doc["note"] = (
        f"The lease ended before part {', '.join(unfinished) or '(none)'} ended; this report was completed "
        "by `bench/gpu_check.py --finish` from the run folders the device wrote."
    )
    document.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"figures: {document}")


def report(run: Run, outcome: Outcome, done: dict[str, Outcome], fig: figures.Figures) -> None:
    """Print one run's line and add its figures (once for a run that several parts share)."""
    if run.name in reported:
        return
    reported.add(run.name)
    rc = "timed out" if outcome.rc is None else f"exit {outcome.rc}"
    print(
        f"  {run.name:<12} {rc:<9} {outcome.seconds:7.1f} s  torch peak {mib(outcome.peak_allocated):>11}  "
        f"nvidia-smi {mib(None if outcome.smi_peak_mib is None else outcome.smi_peak_mib * 2**20):>11}  "
        f"plan {mib(outcome.plan_bytes)}"
    )
    for line in outcome.tail if outcome.rc not in (0, 1) else []:
        print(f"      {line}")
    fig.add(f"{run.name}.seconds", round(outcome.seconds, 1), "s")
    if outcome.peak_allocated is not None:
        fig.add(f"{run.name}.torch_peak", outcome.peak_allocated, "B")
    if run.against is not None:
        if tasks_of(run) == tasks_of(RUNS[run.against]):  # the same checks: the same verdict
            expected = done[run.against].rc
            fig.add(f"{run.name}.exit_code", -1 if outcome.rc is None else outcome.rc, "", f"== {expected}")
        fig.add(f"{run.name}.metrics_outside_tolerance", len(outcome.outside), "", "== 0")
        verdict = "all metrics within tolerance" if not outcome.outside else f"{len(outcome.outside)} outside"
        print(f"      agreement with {run.against}: {verdict}")
        for line in outcome.outside[:8]:
            print(f"        {line}")
    if run.plan_goal and outcome.peak_allocated and outcome.plan_bytes:
        fig.add(
            f"{run.name}.torch_peak_over_plan",
            outcome.peak_allocated / outcome.plan_bytes,
            "",
            PLAN_RATIO_GOAL,
        )


def gpu_description() -> dict[str, Any] | None:
    """The CUDA device this ran on (name, memory, torch and driver versions), or None."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "memory_bytes": props.total_memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cores": os.cpu_count(),
    }


if __name__ == "__main__":
    main()
