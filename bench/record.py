"""Benchmark of recorded references on the SmolLM2 pair.

Prints, measured in this one run (compare ratios, not seconds; these machines are noisy):
  (a) wall time of `run` against the recording over `run` against the live BF16 reference, both in this
      process with nothing reused (goal <= 0.55: the reference side is no longer computed);
  (b) the recording's bytes per scored token over 2 x vocabulary size, the bytes llama.cpp's full-vocabulary
      uint16 logits file spends per token (goal <= 0.02 on SmolLM2's 49 k vocabulary);
  and how close the recording's KLD estimate comes to the full-vocabulary KLD of the live run.

    python bench/record.py [--fixtures DIR] [--quick] [--results DIR]

`--quick` runs the tiny MiniCPM-V 4.7 pair (seconds; checks the bench, its figures say nothing). The figures
go to bench/results/ as JSON (bench/figures.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from figures import TEST_FIXTURES, add_arguments, quick_ppl_spec, recorded

from evalsuite import tune_allocator
from evalsuite.cli.app import DEFAULT_FIXTURES
from evalsuite.fixtures import SMOLLM2_BF16, SMOLLM2_W4A8, TINY_BF16, TINY_W4A8, build_fixtures
from evalsuite.pipeline.runner import RecordRequest, RunRequest, record, run
from evalsuite.protocol.task import RunContext


def timed_run(ckpt: Path, ref: Path, out: Path, specs: dict[str, Path]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    result = run(
        RunRequest(
            ckpt=str(ckpt),
            ref=str(ref),
            tasks=["ppl"],
            out=out,
            context=RunContext(corpus_name="python-docs"),
            resume=False,
            specs=specs,
        )
    )
    return time.perf_counter() - t0, result.results["tasks"]["ppl"]["metrics"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    add_arguments(parser)
    args = parser.parse_args()
    tune_allocator()  # glibc's thresholds as the command line sets them, measured as it runs
    source, quantized = (TINY_BF16, TINY_W4A8) if args.quick else (SMOLLM2_BF16, SMOLLM2_W4A8)
    pair = build_fixtures(TEST_FIXTURES if args.quick else args.fixtures, [source, quantized])
    ref, ckpt = pair[source], pair[quantized]
    with tempfile.TemporaryDirectory() as tmp:
        specs = {"ppl": quick_ppl_spec(Path(tmp))} if args.quick else {}
        rec = record(
            RecordRequest(
                ckpt=str(ref),
                tasks=["ppl"],
                out=Path(tmp) / "rec",
                context=RunContext(corpus_name="python-docs"),
                specs=specs,
            )
        )
        live_s, live = timed_run(ckpt, ref, Path(tmp) / "live", specs)
        replay_s, replay = timed_run(ckpt, rec, Path(tmp) / "replay", specs)
        rec_bytes = sum(f.stat().st_size for f in rec.rglob("*") if f.is_file())
    config = json.loads((ref / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    per_token = rec_bytes / live["n_scored_tokens"]
    with recorded("record", __doc__, args) as figures:
        print(f"run against live ref {live_s:.1f} s, against the recording {replay_s:.1f} s")
        print(f"(a) time ratio recording / live = {replay_s / live_s:.3f}   (goal <= 0.55)")
        print(
            f"recording {rec_bytes:,} bytes, {live['n_scored_tokens']} scored tokens: "
            f"{per_token:.0f} bytes/token"
        )
        print(f"(b) bytes per token / (2 x vocab {vocab:,}) = {per_token / (2 * vocab):.4f}   (goal <= 0.02)")
        figures.add("(a) time, recording / live reference", replay_s / live_s, goal="<= 0.55")
        figures.add("recording bytes per scored token", per_token, "bytes")
        figures.add("(b) bytes per token / (2 x vocabulary)", per_token / (2 * vocab), goal="<= 0.02")
        for name in ("kld_mean", "kld_median", "kld_p99"):
            print(
                f"{name}: live {live[name]:.6g}, recording {replay[name]:.6g}, "
                f"relative difference {replay[name] / live[name] - 1:+.4%}"
            )
            figures.add(f"{name}, recording / live - 1", replay[name] / live[name] - 1)


if __name__ == "__main__":
    main()
