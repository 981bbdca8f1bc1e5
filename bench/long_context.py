"""Benchmark of long-context `ppl` (tasks/ppl-long.toml) on the SmolLM2 pair: memory, time per scored token.

One child process per protocol (its peaks its own): the 512-token protocol (tasks/ppl.toml, the head on
every scored position at once), and the long protocol with one window of 2,048 and of 8,192 tokens (the head
applied 512 positions at a time). In each, per side: the model loads, then the peak resident memory above
that footprint is taken over the side's observation (Linux's VmHWM, reset through /proc/self/clear_refs), and
likewise over the comparison. Prints, from this one run (these machines are shared and noisy: compare
ratios, not seconds):
  memory  peak above the loaded model at 8k over the same at 2k (goal <= 1.5), and over the bytes of one
          unchunked [8k × vocabulary] float32 log-probability tensor (goal <= 0.25);
  time    seconds per scored token (both sides' observations and the comparison) at 8k over the 512-token
          protocol's (goal <= 1.5).

    flock /tmp/evalsuite-heavy.lock python bench/long_context.py [--fixtures DIR] [--quick] [--results DIR]

`--quick` runs the tiny MiniCPM-V 4.7 pair with 2 windows of 512 tokens and long windows of 1,024 and 2,048
(seconds; checks the bench, its figures say nothing). The figures go to bench/results/ as JSON
(bench/figures.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from figures import TEST_FIXTURES, add_arguments, quick_ppl_spec, recorded

from evalsuite.cli import DEFAULT_FIXTURES
from evalsuite.fixtures import SMOLLM2_BF16, SMOLLM2_W4A8, TINY_BF16, TINY_W4A8, build_fixtures

REPO = Path(__file__).resolve().parent.parent

# argv: spec file, window (0: the spec's own), ref, ckpt, work folder. Prints one JSON line.
CHILD = r"""
import ctypes, json, re, sys, time
from pathlib import Path
from evalsuite.backends import load_backend
from evalsuite.checkpoint import Checkpoint
from evalsuite.side import BackendOptions, Side
from evalsuite.spec import load_spec
from evalsuite.task import RunContext, no_progress
from evalsuite.tasks.ppl import Perplexity, PplSpec

def vm(field):
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

def reset_peak():
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")

spec_path, window, ref_path, ckpt_path, work = sys.argv[1:6]
window = int(window)
overrides = None
if window:
    overrides = {"protocol": {"window": window, "starts": {"first": 0, "step": window, "count": 1},
                              "scored": {"first": 0, "last": window - 2}}}
spec = load_spec(PplSpec, Path(spec_path), overrides)
task = Perplexity(spec, RunContext(corpus_name="python-docs"))
options = BackendOptions()
paths = {"ref": ref_path, "ckpt": ckpt_path}
sides = {role: Side(role, options, Checkpoint.open(path)) for role, path in paths.items()}
inputs = task.prepare(sides["ref"], sides["ckpt"])
observer = task.needs()[0].observer
doc, observed = {"n_scored": 0}, {}
for role, side in sides.items():
    backend = load_backend(side.checkpoint, options)
    reset_peak()
    base = vm("VmRSS")
    t0 = time.perf_counter()
    folder = Path(work) / role
    folder.mkdir(parents=True)
    observed[role] = observer.observe(backend, inputs, folder, no_progress)
    doc[f"{role}_seconds"] = time.perf_counter() - t0
    doc[f"{role}_peak_above"] = vm("VmHWM") - base
    backend.close()
    del backend
reset_peak()
base = vm("VmRSS")
t0 = time.perf_counter()
artifacts = Path(work) / "artifacts"
artifacts.mkdir()
result = task.compare(observed, artifacts)
doc["compare_seconds"] = time.perf_counter() - t0
doc["compare_peak_above"] = vm("VmHWM") - base
doc["n_scored"] = result.metrics["n_scored_tokens"]
doc["vocab"] = observed["ref"].meta["vocab_size"]
doc["kld_mean"] = result.metrics["kld_mean"]
print(json.dumps(doc))
"""


def measure(spec: Path, window: int, ref: Path, ckpt: Path, work: Path) -> dict:
    # Every allocation of 128 KiB or more mapped on its own and unmapped when freed (glibc's threshold
    # fixed, not raised after frees): memory one side freed cannot hide the next side's peak.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(spec), str(window), str(ref), str(ckpt), str(work)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if proc.returncode != 0:
        raise SystemExit(f"the child for window {window or 512} failed:\n{proc.stderr[-3000:]}")
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    doc["peak_above"] = max(doc["ref_peak_above"], doc["ckpt_peak_above"], doc["compare_peak_above"])
    doc["seconds"] = doc["ref_seconds"] + doc["ckpt_seconds"] + doc["compare_seconds"]
    doc["seconds_per_token"] = doc["seconds"] / doc["n_scored"]
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    add_arguments(parser)
    args = parser.parse_args()
    source, quantized = (TINY_BF16, TINY_W4A8) if args.quick else (SMOLLM2_BF16, SMOLLM2_W4A8)
    pair = build_fixtures(TEST_FIXTURES if args.quick else args.fixtures, [source, quantized])
    ref, ckpt = pair[source], pair[quantized]
    # The long protocol at a short and a long window: 2k and 8k (1k and 2k for --quick).
    short, long = (1024, 2048) if args.quick else (2048, 8192)
    short_name, long_name = f"{short // 1024}k", f"{long // 1024}k"
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        protocol = quick_ppl_spec(Path(tmp)) if args.quick else REPO / "tasks" / "ppl.toml"
        for name, spec, window in (
            ("512", protocol, 0),
            (short_name, REPO / "tasks" / "ppl-long.toml", short),
            (long_name, REPO / "tasks" / "ppl-long.toml", long),
        ):
            runs[name] = measure(spec, window, ref, ckpt, Path(tmp) / name)
    mib = 2**20
    with recorded("long_context", __doc__, args) as figures:
        for name, doc in runs.items():
            print(
                f"{name:>4}: {doc['n_scored']} scored tokens per side; peak above the loaded model: ref "
                f"{doc['ref_peak_above'] / mib:.0f} MiB, ckpt {doc['ckpt_peak_above'] / mib:.0f} MiB, "
                f"compare "
                f"{doc['compare_peak_above'] / mib:.0f} MiB; {doc['seconds']:.1f} s "
                f"({doc['seconds_per_token'] * 1e3:.2f} ms per scored token), kld_mean {doc['kld_mean']:.5f}"
            )
            figures.add(f"{name}: peak above the loaded model", doc["peak_above"] / mib, "MiB")
            figures.add(f"{name}: time per scored token", doc["seconds_per_token"] * 1e3, "ms")
        vocab = runs[long_name]["vocab"]
        unchunked = long * vocab * 4
        memory = runs[long_name]["peak_above"] / runs[short_name]["peak_above"]
        print(f"memory ratio {long_name} / {short_name} = {memory:.3f}   (goal <= 1.5)")
        figures.add(f"memory, {long_name} / {short_name}", memory, goal="<= 1.5")
        over_unchunked = runs[long_name]["peak_above"] / unchunked
        print(
            f"memory ratio {long_name} / one [{long} x {vocab}] float32 tensor ({unchunked / mib:.0f} MiB) = "
            f"{over_unchunked:.3f}   (goal <= 0.25)"
        )
        figures.add(f"memory, {long_name} / one unchunked float32 tensor", over_unchunked, goal="<= 0.25")
        ratio = runs[long_name]["seconds_per_token"] / runs["512"]["seconds_per_token"]
        print(f"time per scored token ratio {long_name} / 512-token protocol = {ratio:.3f}   (goal <= 1.5)")
        figures.add(f"time per scored token, {long_name} / 512", ratio, goal="<= 1.5")


if __name__ == "__main__":
    main()
