"""Benchmark of the `ppl` task: a whole `evalsuite run --tasks ppl` against a bare script and against lm-eval,
on the same tokens, and its peak memory.

Prints ratios measured in this one run, each the median over pairs of whole processes run in turn
(A B C, then C B A, ...: drift of the machine's speed falls on both sides of a ratio):
  bare    `evalsuite run --tasks ppl` (both sides, one model resident at a time, the KLD detail, plots,
          reports) over bench/sides/bare_forward.py (load each model, forward the windows, log-softmax
          the scored rows; nothing else), wall and CPU seconds (goal <= 1.10);
  lm-eval the same run over bench/sides/lmeval_rolling.py, lm-eval's rolling log-likelihood of each
          window's text for each model (goal <= 0.50);
  floor   what no run can go below, over lm-eval: the bare side's whole seconds, and the seconds of its
          forward loops alone (every perplexity run of these windows with these models makes those
          forwards; lm-eval makes them too, one per window here): where the second is above a goal, no
          work beyond the forwards, removed or overlapped, can meet it on this machine;
  memory  peak resident memory of a whole run (a child process), above its footprint before the first model
          loads, over the same figure for observing the larger side alone (goal <= 1.3: it holds only if one
          model is resident at a time). Also printed over the bytes of the larger model's parameters.

    python bench/ppl.py [--pair smollm2|wide] [--pairs N] [--fixtures DIR] [--quick] [--results DIR]

`--pair wide`: the real-shape wide pair (a 248,320-token vocabulary; built on request, hours), loaded, against
the bare script only (lm-eval's HF model class does not take the vision-language checkpoint). `--quick`: the
tiny Llama against itself on 2 windows, one pair of processes (seconds; checks the bench, its figures say
nothing). The figures go to bench/results/ as JSON (bench/figures.py): bench `ppl`, or `ppl_wide` for the
wide pair.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from figures import TEST_FIXTURES, add_arguments, quick_ppl_spec, recorded

from evalsuite.api import DEFAULT_FIXTURES
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import build_fixtures
from evalsuite.fixtures.names import (
    REAL_WIDE_BF16,
    REAL_WIDE_W4A8,
    SMOLLM2_BF16,
    SMOLLM2_W4A8,
    TINY_LLAMA_BF16,
)
from evalsuite.pipeline.runner import build_tasks
from evalsuite.protocol.side import BackendOptions, Side
from evalsuite.protocol.task import RunContext

BENCH = Path(__file__).resolve().parent

# A child process per measurement, so each peak is its own. argv: mode (run | ref | ckpt), ckpt, ref, out,
# and the ppl spec file ("" for the shipped one).
CHILD = r"""
import json, resource, sys
from pathlib import Path
import psutil
from evalsuite import tune_allocator
from evalsuite.backends import load_backend
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.pipeline.runner import RunRequest, build_tasks, run
from evalsuite.protocol.side import BackendOptions, Side
from evalsuite.protocol.task import RunContext, no_progress
mode, ckpt, ref, out, spec = sys.argv[1:6]
tune_allocator()  # glibc's thresholds as the command line sets them, measured as it runs
specs = {"ppl": Path(spec)} if spec else {}
first_load = []
def on_load(side, options=None):
    first_load.append(psutil.Process().memory_info().rss)
context = RunContext(corpus_name="python-docs")
if mode == "run":
    request = RunRequest(ckpt=ckpt, ref=ref, tasks=["ppl"], out=Path(out), context=context, resume=False,
                         specs=specs)
    run(request, on_load=on_load)
else:
    side = Side(mode, BackendOptions(), Checkpoint.open(ckpt if mode == "ckpt" else ref))
    (task,) = build_tasks(["ppl"], context, {}, specs)
    inputs = task.prepare(side, side)
    on_load(side)
    backend = load_backend(side.checkpoint, side.options)
    folder = Path(out) / "child"
    folder.mkdir(parents=True)
    task.needs()[0].observer.observe(backend, inputs, folder, no_progress)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"above_baseline": peak - first_load[0]}))
"""


def child_peak(mode: str, ckpt: Path, ref: Path, out: Path, spec: Path | None) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(ckpt), str(ref), str(out), str(spec or "")],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the {mode} child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["above_baseline"]


def whole(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Wall and CPU seconds (all its threads and children) of one command run to its end, and its output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):  # 1: a threshold failed, which the bench does not judge
        raise SystemExit(f"{cmd[1]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout


def forward_seconds(output: str) -> float:
    """The seconds bench/sides/bare_forward.py says it spent forwarding."""
    (line,) = (line for line in output.splitlines() if line.startswith("forward_seconds "))
    return float(line.split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    parser.add_argument("--pair", choices=("smollm2", "wide"), default="smollm2")
    parser.add_argument("--pairs", type=int, default=5, help="pairs of whole processes per ratio")
    add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        ref_path = ckpt_path = build_fixtures(TEST_FIXTURES, [TINY_LLAMA_BF16])[TINY_LLAMA_BF16]
        args.pairs = 1
    else:
        source, quantized = (
            (SMOLLM2_BF16, SMOLLM2_W4A8) if args.pair == "smollm2" else (REAL_WIDE_BF16, REAL_WIDE_W4A8)
        )
        pair = build_fixtures(args.fixtures, [source, quantized])
        ref_path, ckpt_path = pair[source], pair[quantized]
    with_lm_eval = args.pair == "smollm2"
    tmp = tempfile.TemporaryDirectory()
    folder = Path(tmp.name)
    spec = quick_ppl_spec(folder) if args.quick else None
    specs = {"ppl": spec} if spec else {}
    (task,) = build_tasks(["ppl"], RunContext(corpus_name="python-docs"), {}, specs)
    ref = Side("ref", BackendOptions(), Checkpoint.open(ref_path))
    ckpt = Side("ckpt", BackendOptions(), Checkpoint.open(ckpt_path))
    inputs = task.prepare(ref, ckpt)
    windows = np.asarray(inputs["windows"], dtype=np.int64)
    np.save(folder / "windows.npy", windows)
    scored = task.spec.protocol.scored

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    commands: dict[str, list[str]] = {}
    run = [sys.executable, "-m", "evalsuite.cli", "run", "--ckpt", str(ckpt_path), "--ref", str(ref_path)]
    run += ["--tasks", "ppl", "--corpus", "python-docs", "--quiet", "--no-resume", "--out"]
    bare = [sys.executable, str(BENCH / "sides" / "bare_forward.py"), str(folder / "windows.npy")]
    commands["bare"] = [*bare, str(scored.first), str(scored.last), str(ref_path), str(ckpt_path)]
    if with_lm_eval:
        lm_eval = [sys.executable, str(BENCH / "sides" / "lmeval_rolling.py"), str(folder / "windows.npy")]
        commands["lm-eval"] = [*lm_eval, str(windows.shape[1]), str(ref_path), str(ckpt_path)]
    if spec is not None:
        run = [*run[:-1], "--spec", f"ppl={spec}", "--out"]
    # Both checkpoints' files read once before any timing: the first command timed would otherwise read them
    # from the disk and the others from the page cache (on the wide pair, 13 GB of files, the first pair's
    # ratio stood far above the later pairs').
    for checkpoint_folder in (ref_path, ckpt_path):
        for path in sorted(p for p in Path(checkpoint_folder).iterdir() if p.is_file()):
            with path.open("rb") as fh:
                while fh.read(64 << 20):
                    pass
    times: dict[str, list[tuple[float, float]]] = {"evalsuite": [], **{name: [] for name in commands}}
    forwarding: list[float] = []  # the bare side's seconds in its forward loops, per pair
    for i in range(args.pairs):
        order = ["evalsuite", *commands] if i % 2 == 0 else [*reversed(commands), "evalsuite"]
        for name in order:
            cmd = [*run, str(folder / f"run-{i}")] if name == "evalsuite" else commands[name]
            wall, cpu, output = whole(cmd, env)
            times[name].append((wall, cpu))
            if name == "bare":
                forwarding.append(forward_seconds(output))
            # A run keeps its observations (2 GB of logits on the wide pair): gone before the next command.
            shutil.rmtree(folder / f"run-{i}", ignore_errors=True)
            print(f"pair {i + 1}/{args.pairs}: {name} {times[name][-1][0]:.2f} s wall", file=sys.stderr)

    peaks = {}
    for mode in ("ref", "ckpt", "run"):
        peaks[mode] = child_peak(mode, ckpt_path, ref_path, folder / mode, spec)
        shutil.rmtree(folder / mode, ignore_errors=True)
    param_bytes = max(
        sum(info.nbytes for info in Checkpoint.open(path).tensors.values()) for path in (ref_path, ckpt_path)
    )
    tmp.cleanup()
    single = max(peaks["ref"], peaks["ckpt"])
    mib = 2**20
    # The two pairs are two benches on the benchmarks page: each keeps its latest run.
    with recorded("ppl_wide" if args.pair == "wide" else "ppl", __doc__, args) as figures:
        print(f"pair: {ref_path.name} / {ckpt_path.name}")
        n_scored = scored.last - scored.first + 1
        print(f"windows: {len(windows)} x {windows.shape[1]} tokens per side, {n_scored} scored each")
        for name, runs in times.items():
            shown = ", ".join(f"{wall:.2f}" for wall, _ in runs)
            print(f"{name}: wall s {shown}; cpu s {', '.join(f'{cpu:.2f}' for _, cpu in runs)}")
        for name, goal in (("bare", 1.10), ("lm-eval", 0.50)):
            if name not in times:
                continue
            for i, what in ((0, "wall"), (1, "cpu")):
                ratios = [e[i] / o[i] for e, o in zip(times["evalsuite"], times[name], strict=True)]
                median = statistics.median(ratios)
                shown = ", ".join(f"{r:.3f}" for r in ratios)
                met = f"(goal <= {goal:.2f})" if what == "wall" else ""
                print(
                    f"evalsuite / {name}, {what}: median {median:.3f} of {len(ratios)} pairs [{shown}] {met}"
                )
                figures.add(
                    f"time, evalsuite run / {name}, {what} (median of {len(ratios)} pairs)",
                    median,
                    goal=f"<= {goal}" if what == "wall" else None,
                )
        # What no run can go below: a ratio to lm-eval is at least the bare side's, and at least its forward
        # loops' alone (every perplexity run of these windows makes those forwards).
        print(f"bare side's forward loops: s {', '.join(f'{s:.2f}' for s in forwarding)}")
        if "lm-eval" in times:
            for name, seconds in (
                ("bare (whole) / lm-eval", [wall for wall, _ in times["bare"]]),
                ("bare's forward loops alone / lm-eval", forwarding),
            ):
                ratios = [s / lm[0] for s, lm in zip(seconds, times["lm-eval"], strict=True)]
                median = statistics.median(ratios)
                shown = ", ".join(f"{r:.3f}" for r in ratios)
                print(f"floor, {name}, wall: median {median:.3f} of {len(ratios)} pairs [{shown}]")
                figures.add(f"floor, {name}, wall (median of {len(ratios)} pairs)", median)
        print(
            f"peak above baseline: run {peaks['run'] / mib:.0f} MiB, ref alone {peaks['ref'] / mib:.0f} MiB, "
            f"ckpt alone {peaks['ckpt'] / mib:.0f} MiB; larger model's tensors {param_bytes / mib:.0f} MiB"
        )
        print(f"memory ratio run / larger side alone = {peaks['run'] / single:.3f}   (goal <= 1.3)")
        print(f"memory ratio run / larger model's tensors = {peaks['run'] / param_bytes:.3f}")
        figures.add("memory, run / larger side alone", peaks["run"] / single, goal="<= 1.3")
        figures.add("memory, run / larger model's tensors", peaks["run"] / param_bytes)
        figures.add("peak above baseline, whole run", peaks["run"] / mib, "MiB")
        figures.data = {
            "times": times,
            "bare_forward_seconds": forwarding,
            "peaks": peaks,
            "pair": [ref_path.name, ckpt_path.name],
        }


if __name__ == "__main__":
    main()
