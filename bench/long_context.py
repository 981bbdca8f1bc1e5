"""Benchmark of long-context `ppl` (tasks/ppl-long.toml) on the SmolLM2 pair: whole-process peak memory, disk
per side, time per scored token.

Each protocol is one `evalsuite run --tasks ppl` of the W4A8 copy against its BF16 source, a CLI process of
its own under `/usr/bin/time -v` (its "Maximum resident set size": everything the process ever held at once,
the models, the Python heap, the allocator's arenas): the 512-token protocol (tasks/ppl.toml), and the long
protocol with one window of 2,048 and of 8,192 tokens. Writes the figures as JSON (`--json`), with the
machine and the commit, and prints:
  memory  the 8k spec's peak over the 512 protocol's, against the bound: 0.25 × one [8k × vocabulary]
          float32 tensor;
  disk    what each side's observation keeps, per scored token;
  time    seconds per scored token at 8k over the 512-token protocol's (these machines are shared and noisy:
          compare ratios, not seconds).

    flock /tmp/evalsuite-heavy.lock python bench/long_context.py [--fixtures DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from evalsuite.cli import DEFAULT_FIXTURES
from evalsuite.fixtures import SMOLLM2_BF16, SMOLLM2_W4A8, build_fixtures
from evalsuite.machine import describe_machine

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20


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


def measure(ref: Path, ckpt: Path, spec: Path | None, out: Path) -> dict[str, Any]:
    """One `evalsuite run --tasks ppl` under /usr/bin/time -v: its peak RSS and seconds, the run's ppl
    metrics, and the bytes each side's observation keeps on disk."""
    args = ["--ckpt", str(ckpt), "--ref", str(ref), "--tasks", "ppl", "--corpus", "python-docs"]
    if spec is not None:
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


def commit() -> str:
    """The checked-out commit, `+dirty` when the tree has changes."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True)
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "long_context.json")
    args = parser.parse_args()
    pair = build_fixtures(args.fixtures, [SMOLLM2_BF16, SMOLLM2_W4A8])
    ref, ckpt = pair[SMOLLM2_BF16], pair[SMOLLM2_W4A8]
    vocab = json.loads((ref / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name, window in (("512", 0), ("2k", 2048), ("8k", 8192)):
            spec = spec_for(window, folder) if window else None
            runs[name] = measure(ref, ckpt, spec, folder / name)
    unchunked = 8192 * vocab * 4
    bound = runs["512"]["peak_rss_bytes"] + unchunked // 4
    per_token = {name: run["seconds"] / run["n_scored_tokens"] for name, run in runs.items()}
    doc = {
        "schema": "evalsuite.bench.long_context/1",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": describe_machine("cpu"),
        "pair": {"ref": str(ref), "ckpt": str(ckpt), "vocab_size": vocab},
        "runs": runs,
        "peak_rss_8k_above_512_bytes": runs["8k"]["peak_rss_bytes"] - runs["512"]["peak_rss_bytes"],
        "bound_8k_peak_rss_bytes": bound,
        "within_bound": runs["8k"]["peak_rss_bytes"] <= bound,
        "seconds_per_token_8k_over_512": per_token["8k"] / per_token["512"],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    for name, run in runs.items():
        sides = ", ".join(
            f"{role} {size / MIB:.1f} MiB ({size / run['n_scored_tokens']:.0f} B per token)"
            for role, size in run["disk_bytes"].items()
        )
        print(
            f"{name:>4}: peak RSS {run['peak_rss_bytes'] / MIB:.0f} MiB, {run['seconds']:.1f} s, "
            f"{run['n_scored_tokens']} scored tokens per side; on disk: {sides}; "
            f"kld_mean {run['metrics']['kld_mean']:.5f} ({run['metrics']['kld_estimator']})"
        )
    print(
        f"8k peak {runs['8k']['peak_rss_bytes'] / MIB:.0f} MiB, bound {bound / MIB:.0f} MiB "
        f"(the 512 protocol's + 0.25 x one [8192 x {vocab}] float32 tensor, {unchunked / 4 / MIB:.0f} MiB): "
        f"{'within' if doc['within_bound'] else 'ABOVE'}"
    )
    print(f"time per scored token 8k / 512-token protocol = {doc['seconds_per_token_8k_over_512']:.3f}")
    print(f"figures: {args.json}")


if __name__ == "__main__":
    main()
