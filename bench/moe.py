"""Benchmark of the `moe` task's memory and time: the 3 GB MoE pair, against `layers` alone.

    python bench/moe.py [--fixtures DIR] [--small] [--quick] [--results DIR]

The pair is `bench/stream.py`'s: the tiny MiniCPM-V 4.7 architecture scaled to 3.1 GB in BF16 (28 hybrid
MoE layers, hidden 1,024, 32 routed experts, top 2, a shared expert) and its W4A8 copy
(`minicpmv47-3gb-{bf16,w4a8}`, 6 GB of disk, built once). Each run is `evalsuite run --stream` on the first
`--windows` windows of the `ppl` protocol (default 4 of its 8 windows of 512 tokens, to fit a shared machine's
queue: each layer is read once per pass whatever the count, so fewer windows weigh the reads, which both
tasks share, more), a child process of its own, in one sitting:

1. the RSS of a process that has imported what `evalsuite run` imports before its first model loads;
2. `--tasks layers`: its time and peak RSS;
3. `--tasks moe`: (peak RSS − RSS after imports) / the BF16 model's bytes (goal <= 0.25) and its time / the
   time of `layers` (goal <= 1.5), wall clock (and CPU seconds, steadier on a busy machine).

Both runs start with the files' digests cached and the files in the page cache. These machines are shared:
compare the ratios, not the seconds. `--small` runs the same on the tiny pair (seconds; the ratios say nothing
there), to check the benchmark itself; `--quick` is `--small --windows 1` on the test suite's fixtures. The
figures go to bench/results/ as JSON (bench/figures.py).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path

# The child-process measurements are bench/stream.py's (this folder is on the path of a script run from it).
from figures import TEST_FIXTURES, add_arguments, recorded
from stream import rss_after_imports, timed_run

from evalsuite.files.checkpoint import Checkpoint
from evalsuite.files.digest import DigestCache
from evalsuite.fixtures import build_fixtures
from evalsuite.fixtures.names import SCALED_BF16, SCALED_W4A8, TINY_BF16, TINY_W4A8

PROTOCOL = """
[protocol]
window = 512
starts = {{ first = 0, step = 4096, count = {count} }}
scored = {{ first = 256, last = 510 }}
"""
THRESHOLDS = {
    "layers": "[thresholds]\nfinal_hidden_cosine = { min = 0.90 }\n",
    "moe": "[thresholds]\nmean_topk_overlap = { min = 0.80 }\n",
}
MEMORY_GOAL = 0.25
TIME_GOAL = 1.5


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--fixtures", type=Path, default=Path.home() / ".cache" / "evalsuite" / "bench-fixtures"
    )
    parser.add_argument("--small", action="store_true", help="the tiny pair: checks the benchmark runs")
    parser.add_argument("--windows", type=int, default=4, help="windows of the ppl protocol (at most 8)")
    add_arguments(parser)
    options = parser.parse_args()
    if options.quick:
        options.small, options.windows, options.fixtures = True, 1, TEST_FIXTURES

    names = [TINY_BF16, TINY_W4A8] if options.small else [SCALED_BF16, SCALED_W4A8]
    built = build_fixtures(options.fixtures, names, progress=print)
    ref, ckpt = built[names[0]], built[names[1]]
    model_bytes = Checkpoint.open(ref).total_bytes
    for folder in (ref, ckpt):  # digests cached, files read once: both runs start alike
        Checkpoint.open(folder).content_sha256(DigestCache.default())
    baseline = rss_after_imports()
    print(f"model (BF16) {model_bytes / 1e9:.3f} GB; RSS after imports {baseline / 1e6:.0f} MB")
    print(f"{options.windows} windows of 512 tokens, both sides streamed")

    runs: dict[str, tuple[float, int, float]] = {}
    with tempfile.TemporaryDirectory(prefix="evalsuite-bench-moe-") as tmp:
        for task in ("layers", "moe"):
            spec = Path(tmp) / f"{task}.toml"
            spec.write_text(PROTOCOL.format(count=options.windows) + THRESHOLDS[task])
            args = ["run", "--ref", str(ref), "--ckpt", str(ckpt), "--tasks", task, "--corpus", "python-docs"]
            args += ["--spec", f"{task}={spec}"]
            args += ["--stream", "--no-resume", "--quiet", "--out", f"{tmp}/{task}"]
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            code, seconds, peak = timed_run(args, None)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            if code not in (0, 1):
                print(f"FAILED: `{task}` exited with {code}")
                return 2
            runs[task] = (seconds, peak, cpu)
        moe = json.loads(Path(f"{tmp}/moe/results.json").read_text())["tasks"]["moe"]
    with recorded("moe", __doc__, options) as figures:
        for task, (seconds, peak, cpu) in runs.items():
            print(
                f"{task}: {seconds:.1f} s ({cpu:.1f} s of CPU), peak RSS {peak / 1e6:.0f} MB; (peak RSS − "
                f"RSS after imports) / model bytes = {(peak - baseline) / model_bytes:.3f}"
            )
        shown = (
            "mean_topk_overlap",
            "worst_layer",
            "worst_expert",
            "worst_expert_rel_err",
            "hot_hurt_experts",
        )
        print("moe: " + ", ".join(f"{m} {moe['metrics'][m]}" for m in shown))
        memory = (runs["moe"][1] - baseline) / model_bytes
        ratio = runs["moe"][0] / runs["layers"][0]
        cpu_ratio = runs["moe"][2] / runs["layers"][2]
        print(f"moe: (peak RSS − RSS after imports) / model bytes = {memory:.3f}  (goal <= {MEMORY_GOAL})")
        print(f"moe time / layers time = {ratio:.2f}  (goal <= {TIME_GOAL}); CPU time ratio {cpu_ratio:.2f}")
        figures.add("model (BF16)", model_bytes / 1e9, "GB")
        figures.add("windows of 512 tokens", options.windows)
        figures.add("moe: (peak RSS − RSS after imports) / model bytes", memory, goal=f"<= {MEMORY_GOAL}")
        figures.add("moe time / layers time", ratio, goal=f"<= {TIME_GOAL}")
        figures.add("moe CPU time / layers CPU time", cpu_ratio)
    return 0 if (memory <= MEMORY_GOAL and ratio <= TIME_GOAL) or options.small else 1


if __name__ == "__main__":
    sys.exit(main())
