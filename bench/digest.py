"""Content digests at disk speed: evalsuite's digest of a checkpoint's shards against `sha256sum` of the same
files, and a rerun over unchanged files.

Goals (issue 9): cold-cache digest time / sha256sum time <= 1.1; rerun (every file unchanged) <= 0.05 of
the cold time. "Cold" is evalsuite's digest cache, empty; the page cache is warmed for both sides alike by
reading the files once first, so the ratio compares hashing, not the disk. Both figures are ratios measured
in one run (the machines are shared and noisy).

    python bench/digest.py [--gigabytes 2] [--shards 4] [--folder DIR] [--quick] [--results DIR]

`--quick`: 32 MB in 2 shards (seconds). The figures go to bench/results/ as JSON (bench/figures.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from figures import add_arguments, recorded

from evalsuite.files.digest import DigestCache


def make_shards(folder: Path, gigabytes: float, shards: int) -> list[Path]:
    """Shard-sized files of random bytes (random so that no layer of the storage can compress them)."""
    size = int(gigabytes * (1 << 30)) // shards
    paths = []
    block = os.urandom(1 << 24)
    for i in range(shards):
        path = folder / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        with path.open("wb") as fh:
            written = 0
            while written < size:
                n = min(len(block), size - written)
                fh.write(block[:n])
                written += n
        paths.append(path)
    return paths


def warm(paths: list[Path]) -> None:
    for path in paths:
        with path.open("rb") as fh:
            while fh.read(1 << 24):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=2.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--folder", type=Path, default=None, help="where to write the shards (a temp dir)")
    add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.gigabytes, args.shards = 0.03125, 2
    root = Path(tempfile.mkdtemp(prefix="evalsuite-bench-digest-", dir=args.folder))
    try:
        data = root / "checkpoint"
        data.mkdir()
        paths = make_shards(data, args.gigabytes, args.shards)
        warm(paths)
        started = time.perf_counter()
        subprocess.run(["sha256sum", *map(str, paths)], check=True, capture_output=True)
        sha256sum = time.perf_counter() - started
        cache = DigestCache(root / "cache")
        started = time.perf_counter()
        cache.sha256_many(paths)
        cold = time.perf_counter() - started
        again = DigestCache(root / "cache")
        started = time.perf_counter()
        again.sha256_many(paths)
        rerun = time.perf_counter() - started
        total = sum(p.stat().st_size for p in paths)
        with recorded("digest", __doc__, args) as figures:
            print(f"{args.shards} shards, {total / 1e9:.2f} GB, page cache warm for both")
            print(f"sha256sum            {sha256sum:8.2f} s  ({total / sha256sum / 1e9:.2f} GB/s)")
            print(
                f"evalsuite, cold      {cold:8.2f} s  ({total / cold / 1e9:.2f} GB/s, {os.cpu_count()} cores)"
            )
            print(f"evalsuite, unchanged {rerun:8.4f} s  (bytes read: {again.hashed_bytes})")
            print(f"cold / sha256sum     {cold / sha256sum:8.3f}   (goal <= 1.1)")
            print(f"unchanged / cold     {rerun / cold:8.4f}   (goal <= 0.05)")
            figures.add("checkpoint", total / 1e9, "GB")
            figures.add("sha256sum", total / sha256sum / 1e9, "GB/s")
            figures.add("evalsuite, cold cache", total / cold / 1e9, "GB/s")
            figures.add("cold / sha256sum", cold / sha256sum, goal="<= 1.1")
            figures.add("unchanged / cold", rerun / cold, goal="<= 0.05")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
