"""Benchmark of backend `intref` on the SmolLM2 W4A8 checkpoint: time and resident weights against `hf`.

Prints ratios measured in this one run (these machines are noisy; compare ratios, not seconds):
  time    the `ppl` protocol's candidate observation (8 windows x 512 tokens, 2,040 scored logits) through the
          integer path over the same through the `hf` path, same process, same windows, the two alternating;
          each the fastest of `--repeats` observations (goal <= 1.0);
  memory  bytes of the integer model's parameters and buffers (each storage once) over those of the BF16
          source model as `hf` loads it (goal <= 0.35); also over the W4A8 checkpoint's file bytes, the floor
          for a backend that keeps every tensor as stored.

    python bench/intref.py [--fixtures DIR] [--repeats N] [--quick] [--results DIR]

`--quick` runs the tiny MiniCPM-V 4.7 pair on 2 windows, one repeat (seconds; checks the bench, its figures
say nothing). The figures go to bench/results/ as JSON (bench/figures.py).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import torch
from figures import TEST_FIXTURES, add_arguments, quick_ppl_spec, recorded

from evalsuite import tune_allocator
from evalsuite.backends import load_backend
from evalsuite.cli.app import DEFAULT_FIXTURES
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import SMOLLM2_BF16, SMOLLM2_W4A8, TINY_BF16, TINY_W4A8, build_fixtures
from evalsuite.pipeline.runner import build_tasks
from evalsuite.protocol.side import BackendOptions, Side
from evalsuite.protocol.task import RunContext, no_progress


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer storage of `model`, each counted once (tied weights share one)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if not tensor.is_meta:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    parser.add_argument("--repeats", type=int, default=3, help="observations per backend; the fastest counts")
    add_arguments(parser)
    args = parser.parse_args()
    tune_allocator()  # glibc's thresholds as the command line sets them, measured as it runs
    source, quantized = (TINY_BF16, TINY_W4A8) if args.quick else (SMOLLM2_BF16, SMOLLM2_W4A8)
    pair = build_fixtures(TEST_FIXTURES if args.quick else args.fixtures, [source, quantized])
    ref_ckpt, w4a8 = Checkpoint.open(pair[source]), Checkpoint.open(pair[quantized])
    spec_folder = tempfile.TemporaryDirectory()
    specs = {"ppl": quick_ppl_spec(Path(spec_folder.name))} if args.quick else {}
    if args.quick:
        args.repeats = 1
    (task,) = build_tasks(["ppl"], RunContext(corpus_name="python-docs"), {}, specs)
    ref = Side("ref", BackendOptions(), ref_ckpt)
    inputs = task.prepare(ref, Side("ckpt", BackendOptions(), w4a8))
    observer = task.needs()[0].observer

    # Both candidates stay loaded (a benchmark, not a run) so that their observations can alternate: on a
    # shared machine, load from other processes then slows both alike.
    sides = {backend: Side("ckpt", BackendOptions(backend=backend), w4a8) for backend in ("hf", "intref")}
    runs: dict[str, list[float]] = {backend: [] for backend in sides}
    loads: dict[str, float] = {}
    weights: dict[str, int] = {}
    loaded = load_backend(ref.checkpoint, ref.options)
    weights["bf16"] = resident_weight_bytes(loaded.model)
    loaded.close()
    del loaded
    backends = {}
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        for backend, side in sides.items():
            t0 = time.perf_counter()
            backends[backend] = load_backend(side.checkpoint, side.options)
            stack.callback(backends[backend].close)
            loads[backend] = time.perf_counter() - t0
            weights[backend] = resident_weight_bytes(backends[backend].model)
        for i in range(args.repeats):
            for backend in sides:
                folder = Path(tmp) / f"{backend}-{i}"
                folder.mkdir()
                t0 = time.perf_counter()
                observer.observe(backends[backend], inputs, folder, no_progress)
                runs[backend].append(time.perf_counter() - t0)
    seconds = {backend: min(times) for backend, times in runs.items()}

    spec_folder.cleanup()
    mib = 2**20
    windows = inputs["windows"]
    with recorded("intref", __doc__, args) as figures:
        print(
            f"{w4a8.path.name}, ppl protocol: {len(windows)} windows x {windows.shape[1]} tokens, "
            "one at a time"
        )
        print(
            f"load: hf {loads['hf']:.2f} s, intref {loads['intref']:.2f} s   "
            f"observe (fastest of {args.repeats}): hf {seconds['hf']:.2f} s, intref {seconds['intref']:.2f} s"
        )
        print(f"time ratio intref / hf = {seconds['intref'] / seconds['hf']:.3f}   (goal <= 1.0)")
        print(
            f"resident weights: intref {weights['intref'] / mib:.1f} MiB, hf (W4A8 decompressed) "
            f"{weights['hf'] / mib:.1f} MiB, bf16 source {weights['bf16'] / mib:.1f} MiB; "
            f"W4A8 files {w4a8.total_bytes / mib:.1f} MiB"
        )
        print(f"memory ratio intref / bf16 = {weights['intref'] / weights['bf16']:.3f}   (goal <= 0.35)")
        print(
            f"memory ratio intref / W4A8 file bytes = {weights['intref'] / w4a8.total_bytes:.3f}; "
            f"the files themselves are {w4a8.total_bytes / weights['bf16']:.3f} of the bf16 model"
        )
        figures.add("time, intref / hf", seconds["intref"] / seconds["hf"], goal="<= 1.0")
        figures.add("resident weights, intref / bf16", weights["intref"] / weights["bf16"], goal="<= 0.35")
        figures.add("resident weights, intref / W4A8 file bytes", weights["intref"] / w4a8.total_bytes)


if __name__ == "__main__":
    main()
