"""Ctrl-C: one line, exit 130, and the next run resumes inside the task where the interrupted one stopped
(per window for `ppl`, per prompt for `smoke`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import CliResult, run_cli

TINY_BF16, TINY_W4A8 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8"


def interrupt_after(what: str, n: int, args: list) -> CliResult:
    """`evalsuite ARGS`, Ctrl-C'd the moment its progress reports the Nth step of the bar named `what`
    (`tests/interrupting.py`: the run raises the SIGINT itself at that point, so no poll races the run)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.interrupting", what, str(n), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        timeout=600,
        check=False,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def partial_files(out: Path, pattern: str) -> list[Path]:
    return sorted((out / "observations").glob(f".*.partial/{pattern}"))


def test_an_interrupted_ppl_run_resumes_at_the_next_window(tiny_pair, tmp_path):
    out = tmp_path / "run"
    args = ["run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "ppl"]
    args += ["--corpus", "python-docs", "--out", out, "--quiet"]
    stopped = interrupt_after("window logits", 2, args)
    assert stopped.returncode == 130, stopped.stderr
    assert stopped.stderr.strip().splitlines()[-1].startswith("evalsuite: interrupted"), stopped.stderr
    assert not (out / "results.json").exists()
    done = {p.name: p.stat().st_mtime_ns for p in partial_files(out, "logits-*.npy")}
    # Interrupted after the reference's second window: exactly those two windows' files were completed.
    assert sorted(done) == ["logits-0000.npy", "logits-0001.npy"]
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
    stopped = interrupt_after("smoke prompts", 3, args)
    assert stopped.returncode == 130, stopped.stderr
    done = {p.name: p.stat().st_mtime_ns for p in partial_files(out, "prompt-*.json")}
    assert len(done) == 3, sorted(done)
    resumed = run_cli(*args)
    # The same model on both sides: no prompt the reference passes is failed, nothing diverges.
    assert resumed.returncode == 0, resumed.stderr
    (ref_obs,) = (out / "observations").glob("ref-smoke-generations-*")
    assert {name: (ref_obs / name).stat().st_mtime_ns for name in done} == done
    smoke = json.loads((out / "results.json").read_text())["tasks"]["smoke"]
    assert smoke["metrics"]["identical"] == smoke["metrics"]["n_prompts"]  # the same model on both sides
