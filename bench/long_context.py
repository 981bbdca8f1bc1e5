"""Benchmark of long-context `ppl` (tasks/ppl-long.toml) on the SmolLM2 pair: whole-process peak memory, disk
per side, time per scored token.

Each protocol is one `evalsuite run --tasks ppl` of the W4A8 copy against its BF16 source, a CLI process of
its own under `/usr/bin/time -v` (its "Maximum resident set size": everything the process ever held at once,
the models, the Python heap, the allocator's arenas): the 512-token protocol (tasks/ppl.toml), and the long
protocol with one window of 2,048 and of 8,192 tokens. Prints:
  memory  the longest window's peak over the 512 protocol's, against the bound: 0.25 × one [window ×
          vocabulary] float32 tensor;
  disk    what each side's observation keeps, per scored token;
  time    seconds per scored token at the longest window over the 512-token protocol's (these machines are
          shared and noisy: compare ratios, not seconds);
  floor   at the longest window, the noise floor (`[noise_floor] enabled`, its default draws) observed alone
          against the candidate observed alone (each a run in a copy of the longest window's folder, its
          other observations reused): the floor's peak over the candidate's (goal: within 10%).

    flock /tmp/evalsuite-heavy.lock python bench/long_context.py [--fixtures DIR] [--quick] [--results DIR]

`--quick` runs the tiny MiniCPM-V 4.7 pair: 2 windows of the 512-token protocol, long windows of 1,024 and
2,048 tokens (seconds; checks the bench, its figures say nothing). The figures go to bench/results/ as JSON
(bench/figures.py), the runs' own measurements under `data`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from figures import REPO, TEST_FIXTURES, Figures, add_arguments, quick_ppl_spec, recorded

from evalsuite.cli.app import DEFAULT_FIXTURES
from evalsuite.fixtures import SMOLLM2_BF16, SMOLLM2_W4A8, TINY_BF16, TINY_W4A8, build_fixtures

MIB = 2**20
LONG_WINDOWS = (2048, 8192)
QUICK_LONG_WINDOWS = (1024, 2048)
# The longest window's peak may exceed the 512 protocol's by this share of one [window × vocabulary] float32
# tensor: the head's logits are reduced a chunk of positions at a time, never held whole.
MEMORY_GOAL = 0.25
# The floor on long windows is observed as the candidate is (at the reference's ids): its peak within 10%.
FLOOR_GOAL = 1.10


def spec_for(window: int, folder: Path) -> Path:
    """tasks/ppl-long.toml with one window of `window` tokens, every position scored."""
    text = (REPO / "tasks" / "ppl-long.toml").read_text(encoding="utf-8")
    text = re.sub(r"(?m)^window = \d+", f"window = {window}", text)
    text = re.sub(r"step = \d+", f"step = {window}", text)
    text = re.sub(
        r"scored = \{ first = 0, last = \d+ \}", f"scored = {{ first = 0, last = {window - 2} }}", text
    )
    path = folder / f"ppl-long-{window}.toml"
    path.write_text(text, encoding="utf-8")
    return path


def measure(ref: Path, ckpt: Path, spec: Path, out: Path) -> dict[str, Any]:
    """One `evalsuite run --tasks ppl` under /usr/bin/time -v: its peak RSS and seconds, the run's ppl
    metrics, and the bytes each side's observation keeps on disk."""
    args = ["--ckpt", str(ckpt), "--ref", str(ref), "--tasks", "ppl", "--corpus", "python-docs"]
    args += ["--spec", f"ppl={spec}"]
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "evalsuite.cli", "run", *args, "--out", str(out)]
    proc = subprocess.run([*cmd, "--quiet"], capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 1):  # 1: a threshold failed, which a W4A8 copy may do
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    wall = re.search(
        r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", proc.stderr
    )
    if rss is None or wall is None:
        raise SystemExit(f"no figures from /usr/bin/time -v:\n{proc.stderr[-2000:]}")
    hours, minutes, seconds = (float(g or 0) for g in wall.groups())
    metrics = json.loads((out / "results.json").read_text(encoding="utf-8"))["tasks"]["ppl"]["metrics"]
    disk = {}
    for folder in sorted((out / "observations").iterdir()):
        role = folder.name.split("-", 1)[0]
        disk[role] = disk.get(role, 0) + sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return {
        "peak_rss_bytes": int(rss.group(1)) * 1024,
        "seconds": hours * 3600 + minutes * 60 + seconds,
        "n_scored_tokens": metrics["n_scored_tokens"],
        "disk_bytes": disk,
        "metrics": {
            k: metrics.get(k)
            for k in ("window_tokens", "ppl_ref", "ppl_ckpt", "kld_mean", "kld_estimator", "same_top_p")
        },
    }


def alone(ref: Path, ckpt: Path, spec: Path, done: Path, folder: Path) -> dict[str, dict[str, Any]]:
    """The candidate's observation and the noise floor's, each made alone in a copy of the finished run
    `done` (the run reuses every other observation by its key): their processes' figures."""
    candidate = folder / "candidate-alone"
    shutil.copytree(done, candidate)
    for observation in (candidate / "observations").glob("ckpt-*"):
        shutil.rmtree(observation)
    floor_spec = spec.with_name(f"{spec.stem}-floor.toml")
    floor_spec.write_text(
        spec.read_text(encoding="utf-8") + "\n[noise_floor]\nenabled = true\n", encoding="utf-8"
    )
    floor = folder / "floor-alone"
    shutil.copytree(done, floor)
    return {"candidate": measure(ref, ckpt, spec, candidate), "floor": measure(ref, ckpt, floor_spec, floor)}


def report(data: dict[str, Any], figures: Figures) -> None:
    """Print the runs' figures and record them: `data` is {"pair": {"ref", "ckpt", "vocab_size"}, "runs":
    {"512": run, then one per long window, shortest first}} (runs as `measure` returns them)."""
    runs, vocab = data["runs"], data["pair"]["vocab_size"]
    longest = list(runs)[-1]
    window = runs[longest]["metrics"]["window_tokens"]
    unchunked = window * vocab * 4
    above = runs[longest]["peak_rss_bytes"] - runs["512"]["peak_rss_bytes"]
    bound = runs["512"]["peak_rss_bytes"] + unchunked // 4
    per_token = {name: run["seconds"] / run["n_scored_tokens"] for name, run in runs.items()}
    print(f"{data['pair']['ckpt']} against {data['pair']['ref']} (vocabulary {vocab:,})")
    for name, run in runs.items():
        n = run["n_scored_tokens"]
        disk = run["disk_bytes"]
        sides = ", ".join(
            f"{side} {size / MIB:.1f} MiB ({size / n:.0f} B per token)" for side, size in disk.items()
        )
        print(
            f"{name:>4}: peak RSS {run['peak_rss_bytes'] / MIB:.0f} MiB, {run['seconds']:.1f} s, "
            f"{n} scored tokens per side; on disk: {sides}; "
            f"kld_mean {run['metrics']['kld_mean']:.5f} ({run['metrics']['kld_estimator']})"
        )
        figures.add(f"{name}: peak RSS", run["peak_rss_bytes"] / MIB, "MiB")
        figures.add(f"{name}: seconds per scored token", per_token[name], "s")
        figures.add(f"{name}: scored tokens per side", n)
        for role, size in disk.items():
            figures.add(f"{name}: {role} on disk per scored token", round(size / n), "B")
        figures.add(f"{name}: kld_mean", run["metrics"]["kld_mean"])
    print(
        f"{longest} peak {runs[longest]['peak_rss_bytes'] / MIB:.0f} MiB, bound {bound / MIB:.0f} MiB "
        f"(the 512 protocol's + {MEMORY_GOAL} x one [{window} x {vocab}] float32 tensor, "
        f"{unchunked / 4 / MIB:.0f} MiB): {'within' if above <= unchunked * MEMORY_GOAL else 'ABOVE'}"
    )
    slower = per_token[longest] / per_token["512"]
    print(f"time per scored token {longest} / 512-token protocol = {slower:.3f}")
    figures.add(
        f"{longest} peak RSS − the 512 protocol's, over one [{window} × vocabulary] float32 tensor",
        above / unchunked,
        goal=f"<= {MEMORY_GOAL}",
    )
    figures.add(f"time per scored token, {longest} / 512-token protocol", slower)
    if "alone" in data:
        candidate, floor = (data["alone"][k]["peak_rss_bytes"] for k in ("candidate", "floor"))
        print(
            f"{longest}, each observed alone: the noise floor peaks {floor / MIB:.0f} MiB, the candidate "
            f"{candidate / MIB:.0f} MiB: {floor / candidate:.3f} x (goal <= {FLOOR_GOAL})"
        )
        figures.add(
            f"{longest}: noise floor's peak RSS / the candidate's, each observed alone",
            floor / candidate,
            goal=f"<= {FLOOR_GOAL}",
        )


def window_name(window: int) -> str:
    return f"{window // 1024}k" if window % 1024 == 0 else str(window)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    add_arguments(parser)
    args = parser.parse_args()
    names = [TINY_BF16, TINY_W4A8] if args.quick else [SMOLLM2_BF16, SMOLLM2_W4A8]
    pair = build_fixtures(TEST_FIXTURES if args.quick else args.fixtures, names)
    ref, ckpt = pair[names[0]], pair[names[1]]
    config = json.loads((ref / "config.json").read_text(encoding="utf-8"))
    vocab = config.get("text_config", config)["vocab_size"]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="evalsuite-bench-long-context-") as tmp:
        folder = Path(tmp)
        base = quick_ppl_spec(folder) if args.quick else REPO / "tasks" / "ppl.toml"
        runs["512"] = measure(ref, ckpt, base, folder / "512")
        for window in QUICK_LONG_WINDOWS if args.quick else LONG_WINDOWS:
            name = window_name(window)
            spec = spec_for(window, folder)
            runs[name] = measure(ref, ckpt, spec, folder / name)
        by_itself = alone(ref, ckpt, spec, folder / name, folder)
    with recorded("long_context", __doc__, args) as figures:
        pair = {"ref": ref.name, "ckpt": ckpt.name, "vocab_size": vocab}
        figures.data = {"pair": pair, "runs": runs, "alone": by_itself}
        report(figures.data, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
