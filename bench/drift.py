"""Execution drift: the SmolLM2 BF16 reference against itself, recorded under the default kernels and run
again under other kernels on this same machine.

A recording made on another machine carries that machine's kernels in its logits; a replay against it
counts the drift as the candidate's. This measures how large that drift is: the reference is recorded once
(`evalsuite record --tasks ppl`, the demo's protocol on the offline python-docs text) and then run, as the
candidate, against its own recording in a child process per variant:
  ONEDNN_MAX_CPU_ISA=AVX2      oneDNN limited to AVX2 (no AVX-512 kernels; the same as the default on a
                               machine without AVX-512)
  ATEN_CPU_CAPABILITY=default  torch's own kernels without AVX2 / AVX-512 (the vector width of reductions)
  OMP_NUM_THREADS=1            one thread instead of the machine's
A variant the machine cannot run is printed with its reason and left out (on an AVX-512 CPU, torch 2.13's
bf16 attention under `ATEN_CPU_CAPABILITY=default` stops with "pack_vnni2 is only supported when avx512 is
supported").
Prints kld_mean, ppl of the recording and of the live run, and same_top_p per variant, and writes them to
`evalsuite/measured_drift.json`, the figure a replay under another environment quotes in its caveats.

    flock /tmp/evalsuite-heavy.lock python bench/drift.py [--fixtures DIR] [--no-write] [--quick]
                                                        [--results DIR]

`--quick` runs the tiny MiniCPM-V 4.7 BF16 fixture on 2 windows, one variant (OMP_NUM_THREADS=1), and
writes nothing to evalsuite/ (checks the bench, its figures say nothing). The figures also go to
bench/results/ as JSON (bench/figures.py).
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

from evalsuite.cli.app import DEFAULT_FIXTURES
from evalsuite.fixtures import SMOLLM2_BF16, TINY_BF16, build_fixtures
from evalsuite.machine import DRIFT_FILE, describe_machine

VARIANTS = {
    "ONEDNN_MAX_CPU_ISA=AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
}
METRICS = ("kld_mean", "ppl_ref", "ppl_ckpt", "same_top_p")
CORPUS = "python-docs"


def evalsuite(*args: str, env: dict[str, str] | None = None) -> str | None:
    """One CLI call in a child process (its own kernels, chosen at import from its environment); its error
    line when it did not write its results."""
    command = [sys.executable, "-m", "evalsuite.cli", *args, "--quiet"]
    proc = subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    out = Path(args[args.index("--out") + 1])
    # 1: a threshold failed, which a drift measurement does not mind, as long as it wrote its results.
    if proc.returncode not in (0, 1) or (args[0] == "run" and not (out / "results.json").is_file()):
        lines = proc.stderr.strip().splitlines()
        return f"exited {proc.returncode}: {lines[-1] if lines else ''}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    parser.add_argument("--no-write", action="store_true", help=f"Print only; leave evalsuite/{DRIFT_FILE}.")
    add_arguments(parser)
    args = parser.parse_args()
    source = TINY_BF16 if args.quick else SMOLLM2_BF16
    reference = build_fixtures(TEST_FIXTURES if args.quick else args.fixtures, [source])[source]
    variants = {"OMP_NUM_THREADS=1": VARIANTS["OMP_NUM_THREADS=1"]} if args.quick else VARIANTS
    args.no_write = args.no_write or args.quick
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="evalsuite-drift-") as tmp:
        spec = ("--spec", f"ppl={quick_ppl_spec(Path(tmp))}") if args.quick else ()
        recording = Path(tmp) / "recording"
        # The candidate is the recorded checkpoint itself: a live run of it is observed, never read from the
        # recording.
        candidate = reference
        failed = evalsuite(
            "record", "--ckpt", str(reference), "--tasks", "ppl", "--corpus", CORPUS, "--out", str(recording),
            *spec,
        )  # fmt: skip
        if failed:
            raise SystemExit(f"the recording {failed}")
        not_runnable: dict[str, str] = {}
        for name, env in variants.items():
            out = Path(tmp) / name.replace("=", "-")
            failed = evalsuite(
                "run", "--ckpt", str(candidate), "--ref", str(recording), "--tasks", "ppl",
                "--corpus", CORPUS, "--out", str(out), *spec, env=env,
            )  # fmt: skip
            if failed:
                not_runnable[name] = failed
                continue
            doc = json.loads((out / "results.json").read_text(encoding="utf-8"))
            results[name] = {key: doc["tasks"]["ppl"]["metrics"][key] for key in METRICS}
    machine = describe_machine("cpu")
    with recorded("drift", __doc__, args) as figures:
        print(f"{reference.name} against its own recording; {machine['cpu_model']}, torch kernels "
              f"{machine['torch_cpu_capability']}, oneDNN {machine['onednn_isa']}")  # fmt: skip
        heading = "variant (recording: default kernels)"
        print(f"{heading:40} {'kld_mean':>10} {'ppl rec':>9} {'ppl run':>9} {'same top':>9}")
        for name, row in results.items():
            print(
                f"{name:40} {row['kld_mean']:10.3g} {row['ppl_ref']:9.4f} {row['ppl_ckpt']:9.4f} "
                f"{row['same_top_p']:9.4f}"
            )
            figures.add(f"{name}: kld_mean", row["kld_mean"])
            figures.add(f"{name}: ppl recorded / run", row["ppl_ref"] / row["ppl_ckpt"])
            figures.add(f"{name}: same_top_p", row["same_top_p"])
        for name, reason in not_runnable.items():
            print(f"{name:40} not runnable here: {reason}")
            figures.add(f"{name}", "not runnable here")
    if not args.no_write:
        doc = {
            "what": "SmolLM2-135M BF16 fixture run against its own recording made under the default kernels",
            "corpus": CORPUS,
            "measured_on": {
                key: machine[key] for key in ("cpu_model", "cpu_flags", "torch_cpu_capability", "onednn_isa")
            },
            "variants": results,
            "not_runnable": not_runnable,
        }
        path = Path(__file__).resolve().parents[1] / "evalsuite" / DRIFT_FILE
        path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(f"written: {path}")


if __name__ == "__main__":
    main()
