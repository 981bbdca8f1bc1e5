"""Benchmark of the `lmeval` task on the SmolLM2 pair: its wall time over lm-eval's own CLI.

Runs, each as a fresh process with the same environment (offline, same threads):
  evalsuite   `evalsuite run --tasks lmeval` on the W4A8 candidate against its BF16 reference (both sides,
              one model resident at a time, per-document samples kept, the paired comparison);
  lm-eval     `lm_eval --model hf --model_args pretrained=REF,dtype=bfloat16 ...` then the same for the
              candidate: the same tasks, batch size and document limit, per-document samples logged.
Prints the ratio evalsuite / (lm-eval ref + lm-eval ckpt) measured in this one run (goal <= 1.05: the wrapper
adds nothing measurable), and checks that both tools report the same accuracies.

    python bench/lmeval.py [--fixtures DIR] [--limit N] [--quick] [--results DIR]

`--quick` runs the tiny random Llama against itself, 2 documents per task (checks the bench, its figures say
nothing). The figures go to bench/results/ as JSON (bench/figures.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from figures import TEST_FIXTURES, add_arguments, recorded

from evalsuite.cli.app import DEFAULT_FIXTURES
from evalsuite.fixtures import build_fixtures
from evalsuite.fixtures.names import SMOLLM2_BF16, SMOLLM2_W4A8, TINY_LLAMA_BF16
from evalsuite.tasks.lmeval import shipped_task_folder

TASKS = ["evalsuite-mini", "evalsuite-mini-gen"]
# lm-eval's aggregate key → evalsuite's metric of the same score.
SCORES = {
    ("evalsuite-mini", "acc,none"): "evalsuite-mini.acc",
    ("evalsuite-mini", "acc_norm,none"): "evalsuite-mini.acc_norm",
    ("evalsuite-mini-gen", "exact_match,none"): "evalsuite-mini-gen.exact_match",
}


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - t0
    if proc.returncode not in (0, 1):  # evalsuite exits 1 when a check fails: still a complete run
        sys.exit(f"{' '.join(cmd[:4])} … failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return elapsed


def lm_eval_scores(out: Path) -> dict[tuple[str, str], float]:
    (results,) = out.rglob("results_*.json")
    doc = json.loads(results.read_text())["results"]
    return {key: float(doc[key[0]][key[1]]) for key in SCORES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.limit = 2
        ref = ckpt = build_fixtures(TEST_FIXTURES, [TINY_LLAMA_BF16])[TINY_LLAMA_BF16]
    else:
        pair = build_fixtures(args.fixtures, [SMOLLM2_BF16, SMOLLM2_W4A8])
        ref, ckpt = pair[SMOLLM2_BF16], pair[SMOLLM2_W4A8]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "lmeval.toml"
        limit = "" if args.limit is None else f"limit = {args.limit}\n"
        spec.write_text(f"tasks = {json.dumps(TASKS)}\nbatch_size = 1\n{limit}")
        out = Path(tmp) / "evalsuite"
        evalsuite = [sys.executable, "-m", "evalsuite.cli", "run", "--ckpt", str(ckpt), "--ref", str(ref)]
        evalsuite += ["--tasks", "lmeval", "--spec", f"lmeval={spec}", "--out", str(out), "--quiet"]
        evalsuite += ["--no-resume"]
        t_evalsuite = timed(evalsuite, env)
        metrics = json.loads((out / "results.json").read_text())["tasks"]["lmeval"]["metrics"]

        t_lm_eval, scores = {}, {}
        for role, path in (("ref", ref), ("ckpt", ckpt)):
            out_role = Path(tmp) / f"lm-eval-{role}"
            cmd = [sys.executable, "-m", "lm_eval", "--model", "hf"]
            cmd += ["--model_args", f"pretrained={path},dtype=bfloat16", "--tasks", ",".join(TASKS)]
            cmd += ["--include_path", str(shipped_task_folder()), "--batch_size", "1", "--device", "cpu"]
            cmd += ["--output_path", str(out_role), "--log_samples"]
            if args.limit is not None:
                cmd += ["--limit", str(args.limit)]
            t_lm_eval[role] = timed(cmd, env)
            scores[role] = lm_eval_scores(out_role)

    total = t_lm_eval["ref"] + t_lm_eval["ckpt"]
    docs = "all documents" if args.limit is None else f"{args.limit} documents per task"
    with recorded("lmeval", __doc__, args) as figures:
        print(f"tasks: {', '.join(TASKS)} ({docs}), batch size 1, bf16, CPU, {os.cpu_count()} cores")
        print(
            f"evalsuite run --tasks lmeval: {t_evalsuite:.1f} s   "
            f"lm_eval CLI: ref {t_lm_eval['ref']:.1f} s + ckpt {t_lm_eval['ckpt']:.1f} s = {total:.1f} s"
        )
        print(f"time ratio evalsuite / lm_eval CLI (both sides) = {t_evalsuite / total:.3f}   (goal <= 1.05)")
        figures.add("time, evalsuite / lm_eval CLI (both sides)", t_evalsuite / total, goal="<= 1.05")
        different = 0
        for (task, key), name in SCORES.items():
            for role in ("ref", "ckpt"):
                ours, theirs = metrics[f"{name}.{role}"], scores[role][(task, key)]
                same = "same" if ours == theirs else "DIFFERENT"
                different += ours != theirs
                print(f"  {name}.{role}: evalsuite {ours:.4f}, lm_eval CLI {theirs:.4f} ({same})")
        figures.add("accuracies that differ from lm_eval CLI's", different, goal="<= 0")


if __name__ == "__main__":
    main()
