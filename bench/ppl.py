"""Benchmark of the `ppl` task on the SmolLM2 pair: overhead over bare forward passes, and peak memory.

Prints ratios measured in this one run (these machines are noisy; compare ratios, not seconds):
  time    the task's observe + compare over bare forward passes of the same windows, computing the same
          scored logits, by the same loaded models in the same process (goal <= 1.15);
  memory  peak resident memory of a whole run (a child process), above its footprint before the first model
          loads, over the same figure for observing the larger side alone (goal <= 1.3: it holds only if one
          model is resident at a time). Also printed over the bytes of the larger model's parameters.

    python bench/ppl.py [--fixtures DIR] [--quick] [--results DIR]

`--quick` runs the tiny MiniCPM-V 4.7 pair on 2 windows (seconds; checks the bench, its figures say nothing).
The figures go to bench/results/ as JSON (bench/figures.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from figures import TEST_FIXTURES, add_arguments, quick_ppl_spec, recorded

from evalsuite.backends import load_backend
from evalsuite.checkpoint import Checkpoint
from evalsuite.cli import DEFAULT_FIXTURES
from evalsuite.fixtures import SMOLLM2_BF16, SMOLLM2_W4A8, TINY_BF16, TINY_W4A8, build_fixtures
from evalsuite.runner import build_tasks
from evalsuite.side import BackendOptions, Side
from evalsuite.task import RunContext, no_progress

# A child process per measurement, so each peak is its own. argv: mode (run | ref | ckpt), ckpt, ref, out,
# and the ppl spec file ("" for the shipped one).
CHILD = r"""
import json, resource, sys
from pathlib import Path
import psutil
from evalsuite.backends import load_backend
from evalsuite.checkpoint import Checkpoint
from evalsuite.runner import RunRequest, build_tasks, run
from evalsuite.side import BackendOptions, Side
from evalsuite.task import RunContext, no_progress
mode, ckpt, ref, out, spec = sys.argv[1:6]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    add_arguments(parser)
    args = parser.parse_args()
    source, quantized = (TINY_BF16, TINY_W4A8) if args.quick else (SMOLLM2_BF16, SMOLLM2_W4A8)
    pair = build_fixtures(TEST_FIXTURES if args.quick else args.fixtures, [source, quantized])
    ref_path, ckpt_path = pair[source], pair[quantized]
    spec_folder = tempfile.TemporaryDirectory()
    spec = quick_ppl_spec(Path(spec_folder.name)) if args.quick else None
    (task,) = build_tasks(["ppl"], RunContext(corpus_name="python-docs"), {}, {"ppl": spec} if spec else {})
    ref = Side("ref", BackendOptions(), Checkpoint.open(ref_path))
    ckpt = Side("ckpt", BackendOptions(), Checkpoint.open(ckpt_path))
    observer = task.needs()[0].observer
    inputs = task.prepare(ref, ckpt)
    windows = torch.from_numpy(inputs["windows"])
    scored = task.spec.protocol.scored
    positions = torch.arange(scored.first, scored.last + 1)

    bare = observe = 0.0
    param_bytes = 0
    observations = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in (ref, ckpt):
            backend = load_backend(side.checkpoint, side.options)
            try:
                model = backend.model
                with torch.inference_mode():
                    model(
                        input_ids=windows[:1], logits_to_keep=positions
                    )  # compressed-tensors decompresses here
                    t0 = time.perf_counter()
                    for window in windows:
                        model(input_ids=window[None], logits_to_keep=positions, use_cache=False)
                    bare += time.perf_counter() - t0
                param_bytes = max(param_bytes, sum(p.numel() * p.element_size() for p in model.parameters()))
                folder = Path(tmp) / side.role
                folder.mkdir()
                t0 = time.perf_counter()
                observations[side.role] = observer.observe(backend, inputs, folder, no_progress)
                observe += time.perf_counter() - t0
            finally:
                backend.close()
        t0 = time.perf_counter()
        artifacts = Path(tmp) / "artifacts"
        artifacts.mkdir()
        task.compare(observations, artifacts)
        compare = time.perf_counter() - t0

        peaks = {
            mode: child_peak(mode, ckpt_path, ref_path, Path(tmp) / mode, spec)
            for mode in ("ref", "ckpt", "run")
        }
    spec_folder.cleanup()
    single = max(peaks["ref"], peaks["ckpt"])
    mib = 2**20
    with recorded("ppl", __doc__, args) as figures:
        print(f"windows: {len(windows)} x {windows.shape[1]} tokens per side, {len(positions)} scored each")
        print(f"bare forward: {bare:.2f} s   task observe: {observe:.2f} s   compare: {compare:.2f} s")
        print(
            f"time ratio (observe + compare) / bare forward = {(observe + compare) / bare:.3f}   "
            "(goal <= 1.15)"
        )
        print(
            f"peak above baseline: run {peaks['run'] / mib:.0f} MiB, ref alone {peaks['ref'] / mib:.0f} MiB, "
            f"ckpt alone {peaks['ckpt'] / mib:.0f} MiB; larger model's parameters {param_bytes / mib:.0f} MiB"
        )
        print(f"memory ratio run / larger side alone = {peaks['run'] / single:.3f}   (goal <= 1.3)")
        print(
            f"memory ratio run / larger model's parameters = {peaks['run'] / param_bytes:.3f}   "
            "(includes activations, logits and compressed-tensors' decompression)"
        )
        figures.add("time, (observe + compare) / bare forward", (observe + compare) / bare, goal="<= 1.15")
        figures.add("memory, run / larger side alone", peaks["run"] / single, goal="<= 1.3")
        figures.add("memory, run / larger model's parameters", peaks["run"] / param_bytes)
        figures.add("peak above baseline, whole run", peaks["run"] / mib, "MiB")


if __name__ == "__main__":
    main()
