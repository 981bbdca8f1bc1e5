"""Benchmark of streamed execution: a 3 GB model under a hard memory limit, and its time against a loaded run.

    python bench/stream.py [--fixtures DIR] [--exl3] [--quick] [--results DIR]

The pair is the tiny MiniCPM-V 4.7 architecture scaled to 3.1 GB in BF16 (28 hybrid MoE layers, hidden
1,024, 32 experts) and its W4A8 copy, built once by the fixtures code (`minicpmv47-3gb-{bf16,w4a8}`, 6 GB of
disk). Then, each `evalsuite run --tasks ppl` a child process of its own (the default `ppl` protocol):

1. the RSS of a process that has imported what `evalsuite run` imports before its first model loads;
2. `--stream` inside a cgroup-v1 memory cgroup whose hard limit is that RSS + 0.25 × the BF16 model's bytes
   (a run that needs more is killed by the kernel): it must finish. Printed: (peak RSS − RSS after imports) /
   model bytes (goal <= 0.2) and the cgroup's own peak (it counts the page cache of the files read too);
3. the same run loaded whole, without a limit: streamed time / loaded time (goal <= 1.3).

`--exl3`: the same with the EXL3 copy of the 3 GB model (`minicpmv47-3gb-exl3`, K=4, a K=6 head, random
trellis words: 0.8 GB on disk) as the candidate, run by the `exl3` backend's decoded path; the limit and the
ratio are taken against the candidate's decoded BF16 bytes (what a loaded run holds), not its file size.
`--ref DIR --ckpt DIR` run the same steps on another pair (a small one checks the script in seconds);
`--quick` runs them on the test suite's tiny MiniCPM-V 4.7 pair (2 windows, 1 GB more headroom). The figures
go to bench/results/ as JSON (bench/figures.py).

Both runs start with the files' digests cached and the files in the page cache, so the ratio compares
execution, not first reads. These machines are shared: compare the ratios, not the seconds. Needs root (the
cgroup); the cgroup is removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from figures import (
    TEST_FIXTURES,
    add_arguments,
    launched_pid,
    own_peak,
    quick_ppl_spec,
    recorded,
    with_own_peak,
)

from evalsuite.backends.memory import exl3_decoded_bytes
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.files.digest import DigestCache
from evalsuite.fixtures import build_fixtures
from evalsuite.fixtures.names import SCALED_BF16, SCALED_EXL3, SCALED_W4A8, TINY_BF16, TINY_W4A8

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
LIMIT_FRACTION = 0.25
# `--quick`'s limit above the full one: the tiny pair's bytes are a rounding error of a run's working memory.
QUICK_HEADROOM = 1 << 30
# What `evalsuite run` has imported when it loads its first model, streamed or not.
IMPORTS = (
    "import psutil, evalsuite.cli.app, evalsuite.pipeline.runner, evalsuite.pipeline.registry, "
    "evalsuite.backends.hf, evalsuite.backends.streamed, evalsuite.backends.intref, evalsuite.backends.exl3, "
    "transformers.models.minicpmv4_7, "
    "compressed_tensors.compressors; import re; status = open('/proc/self/status').read(); "
    "anon = sum(int(re.search(rf'{k}:\\s+(\\d+)', status).group(1)) * 1024 "
    "for k in ('RssAnon', 'RssShmem')); "
    "print(psutil.Process().memory_info().rss, anon)"
)


def anonymous_bytes(pid: int | str) -> int:
    """A process's resident anonymous memory (RssAnon + RssShmem of /proc/PID/status): what it holds that is
    not a page of a file it maps (0 once it has gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return sum(int(fields.get(k, "0 kB").split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))


def rss_after_imports() -> int:
    """RSS of a process that has imported what `evalsuite run` imports."""
    return imports_footprint()[0]


def imports_footprint() -> tuple[int, int]:
    """(RSS, anonymous memory) of a process that has imported what `evalsuite run` imports."""
    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True)
    rss, anon = out.stdout.strip().splitlines()[-1].split()
    return int(rss), int(anon)


def timed_run(args: list[str], cgroup: Path | None) -> tuple[int, float, int]:
    """(exit status, wall seconds, peak RSS in bytes) of `evalsuite ARGS`, in `cgroup` when given."""
    code, seconds, peak, _ = sampled_run(args, cgroup)
    return code, seconds, peak


def sampled_run(args: list[str], cgroup: Path | None) -> tuple[int, float, int, int]:
    """`timed_run`, with the peak of the run's anonymous memory sampled every 20 ms besides. The RSS peak
    counts the pages of the safetensors files a run maps while it reads them, though they are page cache the
    kernel reclaims at will (a run under a cgroup limit never needs them resident); the anonymous peak is
    what the run itself holds."""
    command = [sys.executable, "-m", "evalsuite.cli", *args]
    if cgroup is not None:
        # The shell joins the cgroup and becomes the run (exec): the limit applies from its first byte.
        script = f'echo $$ > {cgroup / "cgroup.procs"} && exec "$@"'
        command = ["sh", "-c", script, "sh", *command]
    with tempfile.TemporaryDirectory() as tmp:
        usage_file = Path(tmp) / "usage.json"
        start = time.perf_counter()
        # The run's own peak: this process built the fixtures and would lend it its own (`with_own_peak`).
        child = subprocess.Popen(
            with_own_peak(command, usage_file), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        peak_anon = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.02):
                pid = launched_pid(child.pid)
                if pid is not None:
                    peak_anon[0] = max(peak_anon[0], anonymous_bytes(pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, errors = child.communicate()
        done.set()
        sampler.join()
        seconds = time.perf_counter() - start
        peak = own_peak(usage_file)
    if child.returncode not in (0, 1):
        tail = errors.decode(errors="replace")[-2000:] if errors else ""
        print(f"run exited with {child.returncode}:\n{tail}", file=sys.stderr)
    return child.returncode, seconds, peak, peak_anon[0]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--fixtures", type=Path, default=Path.home() / ".cache" / "evalsuite" / "bench-fixtures"
    )
    parser.add_argument("--exl3", action="store_true", help="the EXL3 copy as the candidate")
    parser.add_argument("--ref", type=Path, help="another reference (with --ckpt): a quick check")
    parser.add_argument("--ckpt", type=Path, help="another candidate (with --ref)")
    parser.add_argument("--streamed-only", action="store_true", help="skip step 3 (the loaded run)")
    add_arguments(parser)
    options = parser.parse_args()
    with recorded("stream" + ("_exl3" if options.exl3 else ""), __doc__, options) as figures:
        return measure(options, figures)


def measure(options: argparse.Namespace, figures) -> int:
    """Steps 1 to 3; the figures recorded as they are printed."""
    if options.quick:
        built = build_fixtures(TEST_FIXTURES, [TINY_BF16, TINY_W4A8], progress=print)
        ref, ckpt = built[TINY_BF16], built[TINY_W4A8]
    elif options.ref is not None and options.ckpt is not None:
        ref, ckpt = options.ref, options.ckpt
    else:
        candidate = SCALED_EXL3 if options.exl3 else SCALED_W4A8
        built = build_fixtures(options.fixtures, [SCALED_BF16, candidate], progress=print)
        ref, ckpt = built[SCALED_BF16], built[candidate]
    model_bytes = Checkpoint.open(ref).total_bytes
    what = "model (BF16)"
    if Checkpoint.open(ckpt).format == "exl3":
        # What a loaded EXL3 side holds: its Linears decoded to BF16 (the files are a quarter of that).
        model_bytes = exl3_decoded_bytes(Checkpoint.open(ckpt), 2)
        what = f"EXL3 candidate decoded to BF16 (files {Checkpoint.open(ckpt).total_bytes / 1e9:.2f} GB)"
    for folder in (ref, ckpt):  # digests cached, files read once: both runs start alike
        Checkpoint.open(folder).content_sha256(DigestCache.default())

    baseline, baseline_anon = imports_footprint()
    limit = baseline + int(LIMIT_FRACTION * model_bytes)
    if options.quick:  # a tiny model's quarter is nothing beside a run's working memory: check the bench only
        limit += QUICK_HEADROOM
    print(f"{what} {model_bytes / 1e9:.2f} GB; RSS after imports {baseline / 1e6:.0f} MB")
    headroom = f" + {QUICK_HEADROOM / 1e6:.0f} MB (--quick)" if options.quick else ""
    print(f"limit: {limit / 1e6:.0f} MB = RSS after imports + {LIMIT_FRACTION} × those bytes{headroom}")

    with tempfile.TemporaryDirectory(prefix="evalsuite-bench-stream-") as tmp:
        base = ["run", "--ref", str(ref), "--ckpt", str(ckpt), "--tasks", "ppl", "--corpus", "python-docs"]
        base += ["--no-resume", "--quiet"]
        if options.quick:
            base += ["--spec", f"ppl={quick_ppl_spec(Path(tmp))}"]
        cgroup = CGROUP_ROOT / f"evalsuite-bench-{os.getpid()}"
        cgroup.mkdir()
        try:
            (cgroup / "memory.limit_in_bytes").write_text(str(limit))
            code, streamed_s, streamed_peak, streamed_anon = sampled_run(
                [*base, "--stream", "--out", f"{tmp}/streamed"], cgroup
            )
            cgroup_peak = int((cgroup / "memory.max_usage_in_bytes").read_text())
            failcnt = int((cgroup / "memory.failcnt").read_text())
        finally:
            cgroup.rmdir()
        if code not in (0, 1):
            print(f"FAILED: the streamed run did not finish under the limit (exit {code})")
            return 2
        print(
            f"streamed: finished under the limit in {streamed_s:.0f} s "
            f"(cgroup peak {cgroup_peak / 1e6:.0f} MB, page cache included; {failcnt} times at the limit); "
            f"peak RSS {streamed_peak / 1e6:.0f} MB; "
            f"(peak RSS − RSS after imports) / model bytes = {(streamed_peak - baseline) / model_bytes:.3f}; "
            f"anonymous memory: peak {streamed_anon / 1e6:.0f} MB, "
            f"after imports {baseline_anon / 1e6:.0f} MB, "
            f"(peak − after imports) / model bytes = {(streamed_anon - baseline_anon) / model_bytes:.3f}"
            "  (goal <= 0.2)",
            flush=True,
        )
        figures.add(what, model_bytes / 1e9, "GB")
        figures.add("streamed: finished under the limit", True)
        figures.add(
            "streamed: (peak RSS − RSS after imports) / model bytes", (streamed_peak - baseline) / model_bytes
        )
        figures.add(
            "streamed: (peak anonymous − after imports) / model bytes",
            (streamed_anon - baseline_anon) / model_bytes,
            goal="<= 0.2",
        )
        if options.streamed_only:
            return 0
        code, loaded_s, loaded_peak = timed_run([*base, "--out", f"{tmp}/loaded"], None)
        if code not in (0, 1):
            print(f"FAILED: the loaded run exited with {code}")
            return 2
        same = [
            json.loads(Path(f"{tmp}/{name}/results.json").read_text())["tasks"]["ppl"]["metrics"]
            for name in ("streamed", "loaded")
        ]
    metrics = ("ppl_ref", "ppl_ckpt", "kld_mean", "same_top_p")
    print(
        f"loaded: {loaded_s:.0f} s, peak RSS {loaded_peak / 1e6:.0f} MB; "
        f"(peak RSS − RSS after imports) / model bytes = {(loaded_peak - baseline) / model_bytes:.3f}"
    )
    print(f"streamed time / loaded time = {streamed_s / loaded_s:.2f}  (goal <= 1.3)")
    figures.add(
        "loaded: (peak RSS − RSS after imports) / model bytes", (loaded_peak - baseline) / model_bytes
    )
    figures.add("streamed time / loaded time", streamed_s / loaded_s, goal="<= 1.3")
    figures.add("same metrics streamed and loaded", all(same[0][m] == same[1][m] for m in metrics))
    print(
        "same metrics streamed and loaded: " + ", ".join(f"{m} {same[0][m] == same[1][m]}" for m in metrics)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
