"""Ctrl-C: one line, exit 130, and the next run resumes inside the task where the interrupted one stopped
(per window for `ppl`, per prompt for `smoke`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import run_cli

TINY_BF16, TINY_W4A8 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8"


def interrupt_when(args: list[str], ready, timeout: float = 600) -> subprocess.CompletedProcess:
    """Start `evalsuite ARGS`, send SIGINT (Ctrl-C) once `ready()` is true, and wait for it to end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "evalsuite.cli", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the run ended before the point to interrupt: {proc.communicate()}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def partial_files(out: Path, pattern: str) -> list[Path]:
    return sorted((out / "observations").glob(f".*.partial/{pattern}"))


def test_an_interrupted_ppl_run_resumes_at_the_next_window(tiny_pair, tmp_path):
    out = tmp_path / "run"
    args = ["run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "ppl"]
    args += ["--corpus", "python-docs", "--out", out, "--quiet"]
    stopped = interrupt_when(args, lambda: len(partial_files(out, "logits-*.npy")) >= 2)
    assert stopped.returncode == 130, stopped.stderr
    assert stopped.stderr.strip().splitlines()[-1].startswith("evalsuite: interrupted"), stopped.stderr
    assert not (out / "results.json").exists()
    done = {p.name: p.stat().st_mtime_ns for p in partial_files(out, "logits-*.npy")}
    assert 2 <= len(done) < 8
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    (ref_obs,) = (out / "observations").glob("ref-window-logits-*")
    # The windows observed before Ctrl-C were kept as they were, not observed again.
    assert {name: (ref_obs / name).stat().st_mtime_ns for name in done} == done
    again = run_cli(*args[:-3], "--out", tmp_path / "whole", "--quiet", "--no-resume")
    assert again.returncode == 0, again.stderr
    metrics = [
        json.loads((d / "results.json").read_text())["tasks"]["ppl"]["metrics"]
        for d in (out, tmp_path / "whole")
    ]
    assert metrics[0] == metrics[1]


def test_an_interrupted_smoke_run_resumes_at_the_next_prompt(tiny_pair, tmp_path):
    out = tmp_path / "run"
    ref = tiny_pair[TINY_BF16]
    args = ["run", "--ckpt", ref, "--ref", ref, "--tasks", "smoke", "--out", out, "--quiet"]
    stopped = interrupt_when(args, lambda: len(partial_files(out, "prompt-*.json")) >= 3)
    assert stopped.returncode == 130, stopped.stderr
    done = {p.name: p.stat().st_mtime_ns for p in partial_files(out, "prompt-*.json")}
    resumed = run_cli(*args)
    # The same model on both sides: no prompt the reference passes is failed, nothing diverges.
    assert resumed.returncode == 0, resumed.stderr
    (ref_obs,) = (out / "observations").glob("ref-smoke-generations-*")
    assert {name: (ref_obs / name).stat().st_mtime_ns for name in done} == done
    smoke = json.loads((out / "results.json").read_text())["tasks"]["smoke"]
    assert smoke["metrics"]["identical"] == smoke["metrics"]["n_prompts"]  # the same model on both sides
