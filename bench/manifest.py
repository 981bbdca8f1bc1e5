"""Benchmark of manifest verification: does it read at disk speed, and does the digest cache spare a re-read?

Prints ratios measured in this one run (these machines are noisy; compare ratios, not seconds):
  cold    `verify_manifest` of a folder of shards against its SHA256SUMS, every file hashed, over
          coreutils' `sha256sum -c` on the same files, alternating, each the fastest of `--repeats`
          (goal <= 1.1);
  warm    the same verification again through the cache that hashed them, over the cold one (goal <= 0.01).

    python bench/manifest.py [--gib 1.0] [--shards 4] [--repeats 3] [--quick] [--results DIR]

`--quick`: 32 MiB in 2 shards, one repeat (seconds). The figures go to bench/results/ as JSON
(bench/figures.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from figures import add_arguments, fastest, recorded

from evalsuite.files.digest import DigestCache
from evalsuite.files.manifest import read_manifest, verify_manifest, write_sha256sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="total size of the shards")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.gib, args.shards, args.repeats = 0.03125, 2, 1
    with tempfile.TemporaryDirectory(prefix="evalsuite-bench-manifest-") as tmp:
        folder = Path(tmp) / "ckpt"
        folder.mkdir()
        size = int(args.gib * 2**30) // args.shards
        for i in range(args.shards):
            with (folder / f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors").open("wb") as fh:
                for _ in range(size // 2**24):
                    fh.write(os.urandom(2**24))
        write_sha256sums(folder, DigestCache())
        manifest = read_manifest(folder / "SHA256SUMS")

        def cold() -> None:
            assert verify_manifest(manifest, DigestCache()).ok  # no cache folder: every byte is read

        def coreutils() -> None:
            subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=folder, check=True)

        cache = DigestCache(Path(tmp) / "digests")
        verify_manifest(manifest, cache)
        times: dict[str, list[float]] = {"cold": [], "sha256sum": []}
        for _ in range(args.repeats):  # alternating, so that both see the same page cache and load
            times["cold"].append(fastest(cold, 1, warm_up=False))
            times["sha256sum"].append(fastest(coreutils, 1, warm_up=False))
        warm = fastest(
            lambda: verify_manifest(manifest, DigestCache(Path(tmp) / "digests")), args.repeats, warm_up=False
        )
        total = size * args.shards
        best_cold, best_core = min(times["cold"]), min(times["sha256sum"])
        with recorded("manifest", __doc__, args) as figures:
            print(f"files {args.shards} x {size / 2**20:.0f} MiB; {os.cpu_count()} CPUs")
            mib = total / 2**20
            print(f"cold verify {mib / best_cold:.0f} MiB/s, sha256sum -c {mib / best_core:.0f} MiB/s")
            print(f"cold / sha256sum = {best_cold / best_core:.2f}  (goal <= 1.1)")
            print(f"warm / cold      = {warm / best_cold:.4f}  (goal <= 0.01)")
            figures.add("shards", total / 2**20, "MiB")
            figures.add("cold verify", mib / best_cold, "MiB/s")
            figures.add("sha256sum -c", mib / best_core, "MiB/s")
            figures.add("cold / sha256sum", best_cold / best_core, goal="<= 1.1")
            figures.add("warm / cold", warm / best_cold, goal="<= 0.01")


if __name__ == "__main__":
    main()
