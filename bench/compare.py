"""Benchmark of `evalsuite compare` on the SmolLM2 pair with N = 4 candidates.

The candidates are the W4A8 copy and three copies of it with every weight scale multiplied by 0.99, 1.01 and
1.02: four packs with different bytes, each costing one observation. Prints, measured in this one run
(compare ratios, not seconds; these machines are noisy):
  (a) `compare` (noise floor off, in this process) over the observations it cannot avoid: the reference's and
      the 4 candidates', each a load and the `ppl` windows forwarded, timed on their own in this process
      (goal <= 1.10 wall, <= 1.05 CPU: compare adds little beyond observing); `--rounds` rounds of both,
      one after the other, each round's ratio and their median printed. Each of those observations stores
      its side's logits, as `ppl` stores the reference's; `compare` stores no candidate's (each candidate
      window is compared with the reference's as it is made: `evalsuite.observers.paired_window_logits`), so
      what its candidates skip counts in its favour, and their comparisons, made inside their
      observations, against it;
  (b) `evalsuite compare` as a command over four separate `evalsuite run` commands, one per candidate, each
      a fresh process as a user runs them (goal <= 0.6: the reference is observed once, not four times);
  (a') `compare` over its own observations, timed inside that very call (every `observe_all` it makes: the
      loads, the forwards, the saves): what it adds beyond observing, free of the forward's drift between
      two separate timings, which on a machine where an observation takes a minute is larger than the
      5 % (a) looks for;
  (a'') the CPU seconds of both sides of (a), every thread's: compare's spread over every core with none
      ever idle is the least wall time any overlapping of its own work with its observations could reach,
      printed over the observations' wall time, a floor under (a) for this work on this machine;
  and what the noise floor adds to `compare` (one more reference forward, in the same load). The floor is on
  by default in `compare`, and no `run` has one: (a) and (b) measure `compare` without it, so that both sides
  of each ratio do the same work; (b) with the floor is also printed, derived from the in-process ratio.
  The load average is printed at the start and at the end: the cores are shared.

    flock /tmp/evalsuite-heavy.lock python bench/compare.py [--fixtures DIR] [--pair tiny] [--rounds N]
                                                          [--parts a,b]

`--pair tiny` runs the tiny MiniCPM-V 4.7 pair instead (a minute, not ten): its forwards are so cheap that the
fixed costs of a comparison (KLD passes, plots, start-up) weigh far more than on any real model. `--quick` is
`--pair tiny --rounds 1 --parts a` on the test suite's fixtures (checks the bench, its figures say nothing).
The figures go to bench/results/ as JSON (bench/figures.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from figures import TEST_FIXTURES, add_arguments, recorded
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from evalsuite import tune_allocator
from evalsuite.backends import load_backend
from evalsuite.backends.options import BackendOptions
from evalsuite.candidates.comparing import CompareRequest, compare
from evalsuite.cli.app import DEFAULT_FIXTURES
from evalsuite.fixtures import SMOLLM2_BF16, SMOLLM2_W4A8, TINY_BF16, TINY_W4A8, build_fixtures
from evalsuite.pipeline.runner import build_tasks
from evalsuite.protocol.side import open_side
from evalsuite.protocol.task import RunContext

SCALES = (0.99, 1.01, 1.02)
CONTEXT = RunContext(corpus_name="python-docs")


def scaled_copy(src: Path, dst: Path, factor: float) -> Path:
    """A copy of a compressed-tensors checkpoint with every `weight_scale` multiplied by `factor`."""
    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as fh:
            metadata = fh.metadata()
        tensors = load_file(str(shard))
        tensors = {k: v * factor if k.endswith("weight_scale") else v for k, v in tensors.items()}
        save_file(tensors, str(shard), metadata=metadata)
    return dst


def observation_seconds(path: Path, ref: Path, folder: Path) -> tuple[float, float]:
    """One side's `ppl` observation on its own (the load, the windows forwarded, the logits saved): its
    seconds and the CPU seconds this process spent meanwhile, every thread's."""
    (task,) = build_tasks(["ppl"], CONTEXT)
    side = open_side("ckpt", str(path), BackendOptions().check())
    ref_side = open_side("ref", str(ref), BackendOptions().check())
    inputs = task.prepare(ref_side, side)
    observer = task.needs()[0].observer
    folder.mkdir(parents=True)
    t0, cpu0 = time.perf_counter(), time.process_time()
    backend = load_backend(side.checkpoint, side.options)
    try:
        observer.observe(backend, inputs, folder, lambda what, total: lambda: None)
    finally:
        backend.close()
    return time.perf_counter() - t0, time.process_time() - cpu0


@contextlib.contextmanager
def timed_observations(spent: list[float]):
    """`compare`'s own observations timed as it makes them: every call of `observe_all` (each a group of
    loads, forwards and saves) adds its seconds to `spent`."""
    import evalsuite.candidates.comparing as compare_module
    import evalsuite.pipeline.runner as runner_module

    original = runner_module.observe_all

    @functools.wraps(original)
    def observe_all(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    modules = (compare_module, runner_module)
    for module in modules:
        module.observe_all = observe_all
    try:
        yield
    finally:
        for module in modules:
            module.observe_all = original


def cli(*args: str | Path) -> float:
    """Seconds of one `evalsuite` command. Exit 1 is a verdict, not a failure of the benchmark: the shipped
    thresholds are a good 4-bit pack's, which the 135 M demo pair does not meet."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "evalsuite.cli", *map(str, args), "--quiet"],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode not in (0, 1):
        raise SystemExit(f"evalsuite {args[0]} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return time.perf_counter() - t0


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    parser.add_argument("--pair", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (a), observations then compare")
    parser.add_argument(
        "--parts", default="a,b,floor", help="what to time: a (in process), b (commands), floor (a compare "
        "with the noise floor); on a machine where one observation takes a minute, each is many minutes",
    )  # fmt: skip
    add_arguments(parser)
    args = parser.parse_args()
    tune_allocator()  # glibc's thresholds as the command line sets them, measured as it runs
    if args.quick:
        args.pair, args.rounds, args.parts, args.fixtures = "tiny", 1, "a", TEST_FIXTURES
    source, quantized = (SMOLLM2_BF16, SMOLLM2_W4A8) if args.pair == "smollm2" else (TINY_BF16, TINY_W4A8)
    pair = build_fixtures(args.fixtures, [source, quantized])
    load_before = load_average()
    ref = pair[source]
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        root = Path(tmp)
        candidates = [pair[quantized]]
        candidates += [scaled_copy(candidates[0], root / f"w4a8-x{f}", f) for f in SCALES]
        # (a) in this process: the observations alone, then compare (imports are warm for both), in rounds
        # A B A B: a single pair of timings moves by a fifth between runs on these machines.
        parts = set(args.parts.split(","))
        ratios, observed, compared, inside, cpu = [], [], [], [], []
        for r in range(args.rounds if "a" in parts else 0):
            sides = [observation_seconds(ref, ref, root / f"obs-{r}" / "ref")]
            for i, c in enumerate(candidates):
                sides.append(observation_seconds(c, ref, root / f"obs-{r}" / f"c{i}"))
            observe, observe_cpu = (sum(column) for column in zip(*sides, strict=True))
            request = CompareRequest(
                ref=str(ref), ckpts=list(map(str, candidates)), tasks=["ppl"], out=root / f"cmp-{r}",
                context=CONTEXT, noise_floor=False,
            )  # fmt: skip
            spent: list[float] = []
            with timed_observations(spent):
                t0, cpu0 = time.perf_counter(), time.process_time()
                compare(request)
                seconds, compare_cpu = time.perf_counter() - t0, time.process_time() - cpu0
            inside.append((sum(spent), seconds))
            cpu.append((observe_cpu, compare_cpu))
            observed.append(observe)
            compared.append(seconds)
            ratios.append(seconds / observe)
        timings = {False: statistics.median(compared)} if compared else {}
        request = CompareRequest(
            ref=str(ref), ckpts=list(map(str, candidates)), tasks=["ppl"], out=root / "cmp-floor",
            context=CONTEXT, noise_floor=True,
        )  # fmt: skip
        if compared and "floor" in parts:
            t0 = time.perf_counter()
            compare(request)
            timings[True] = time.perf_counter() - t0
        # (b) as commands, as a user runs them, in the same rounds
        common = ("--tasks", "ppl", "--corpus", "python-docs")
        ckpts = [a for c in candidates for a in ("--ckpt", c)]
        commands = []
        for r in range(args.rounds if "b" in parts else 0):
            separate = sum(
                cli("run", "--ckpt", c, "--ref", ref, *common, "--out", root / f"run-{r}-{i}")
                for i, c in enumerate(candidates)
            )
            out = root / f"cmd-{r}"
            command = cli("compare", "--ref", ref, *ckpts, *common, "--no-noise-floor", "--out", out)
            commands.append((command, separate))
    load_after = load_average()
    with recorded("compare", __doc__, args) as figures:
        report(ref, candidates, observed, compared, ratios, inside, cpu, timings, commands, figures)
        print(f"load average (1, 5, 15 min) at the start: {load_before}; at the end: {load_after}")


def report(ref, candidates, observed, compared, ratios, inside, cpu, timings, commands, figures) -> None:
    """Print the timings of every round and record the medians and per-round ratios."""
    n = len(candidates)
    print(
        f"{ref.name} pair, {n} candidates, task ppl; timings taken in one run "
        "(the load averages below say how busy the machine was)"
    )
    for r, (o, c, q) in enumerate(zip(observed, compared, ratios, strict=True)):
        print(f"(a) round {r + 1}: observations alone (1 reference + {n} candidates) {o:.1f} s, "
              f"compare {c:.1f} s: {q:.3f}")  # fmt: skip
    if ratios:
        with_floor = f"; with the noise floor: {timings[True]:.1f} s" if True in timings else ""
        print(f"compare in process (median): {timings[False]:.1f} s{with_floor}")
        median = statistics.median(ratios)
        print(f"(a) compare / observations, median of {len(ratios)} rounds = {median:.3f}   (goal <= 1.10)")
        figures.add(f"(a) compare / observations, median of {len(ratios)} rounds", median, goal="<= 1.1")
        cpu_median = statistics.median(cmp_cpu / obs_cpu for obs_cpu, cmp_cpu in cpu)
        print(f"(a) in CPU seconds, median of {len(cpu)} rounds = {cpu_median:.3f}   (goal <= 1.05)")
        figures.add(
            f"(a) compare / observations in CPU seconds, median of {len(cpu)} rounds",
            cpu_median,
            goal="<= 1.05",
        )
        for r, (own, total) in enumerate(inside):
            print(f"(a') round {r + 1}: compare {total:.1f} s, of which its own observations {own:.1f} s: "
                  f"{total / own:.3f} ({total - own:.1f} s beyond observing)")  # fmt: skip
            figures.add(f"(a') round {r + 1}: compare / its own observations", total / own)
        # CPU time is what no overlapping of compare's work with its observations can shrink: spread over
        # every core without a moment idle, compare's CPU seconds set a floor under its wall time.
        cores = len(os.sched_getaffinity(0))
        for r, ((obs_cpu, cmp_cpu), o) in enumerate(zip(cpu, observed, strict=True)):
            floor = cmp_cpu / (cores * o)
            print(f"(a'') round {r + 1}: CPU time, observations alone {obs_cpu:.1f} s ({obs_cpu / o:.2f} of "
                  f"{cores} cores busy), compare {cmp_cpu:.1f} s ({cmp_cpu / obs_cpu:.3f} of it): with every "
                  f"core busy throughout, it would still take {floor:.3f} x the observations")  # fmt: skip
            figures.add(f"(a'') round {r + 1}: CPU-time floor under (a)", floor)
    for r, (command, separate) in enumerate(commands):
        print(f"(b) round {r + 1}: evalsuite compare {command:.1f} s; {n} separate evalsuite run "
              f"{separate:.1f} s: {command / separate:.3f}")  # fmt: skip
    if commands:
        b = statistics.median(command / separate for command, separate in commands)
        print(f"(b) compare / separate runs, median of {len(commands)} rounds = {b:.3f}   (goal <= 0.6)")
        figures.add(f"(b) compare / separate runs, median of {len(commands)} rounds", b, goal="<= 0.6")
    if True in timings:
        floor = timings[True] / timings[False]
        print(f"noise floor: compare with it / without = {floor:.3f}")
        figures.add("noise floor: compare with it / without", floor)
        if commands:
            print(f"(b) with the floor (derived: (b) x the line above) = {b * floor:.3f}")


if __name__ == "__main__":
    main()
