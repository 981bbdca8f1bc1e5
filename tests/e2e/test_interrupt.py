"""Ctrl-C: one line, exit 130, and the next run resumes inside the task where the interrupted one stopped
(per window for `ppl`, per prompt decoded alone and per batch for `smoke`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import TINY_SMOKE_PROMPTS, CliResult, cli_env, run_cli, tiny_spec_args

TINY_BF16, TINY_W4A8 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8"
# The kernels of the 2-core Xeon the resumed run was first seen to differ on (AVX-512 VNNI, neither BF16
# instructions nor AMX): there oneDNN's bf16 head of the tiny model rounds one logit of the second window the
# other way with one thread and with two. A cap: a CPU without these instructions keeps its own kernels.
VNNI_KERNELS = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}


def interrupt_after(what: str, n: int, args: list, env: dict[str, str] | None = None) -> CliResult:
    """`evalsuite ARGS`, Ctrl-C'd the moment its progress reports the Nth step of the bar named `what`
    (`tests/interrupting.py`: the run raises the SIGINT itself at that point, so no poll races the run), in
    the environment `run_cli` gives its children (`env` added)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.interrupting", what, str(n), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        env=cli_env(env),
        timeout=600,
        check=False,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def partial_files(out: Path, pattern: str) -> list[Path]:
    return sorted((out / "observations").glob(f".*.partial/{pattern}"))


def ppl_args(tiny_pair: dict[str, Path], out: Path) -> list:
    """`evalsuite` arguments of the tiny pair's `ppl` into `out` (the last three: `--out OUT --quiet`)."""
    return [
        "run", "--ckpt", tiny_pair[TINY_W4A8], "--ref", tiny_pair[TINY_BF16], "--tasks", "ppl",
        "--corpus", "python-docs", "--out", out, "--quiet",
    ]  # fmt: skip


def ppl_metrics(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())["tasks"]["ppl"]["metrics"]


def test_an_interrupted_ppl_run_resumes_at_the_next_window(tiny_pair, tiny_run, tmp_path):
    out = tmp_path / "run"
    args = ppl_args(tiny_pair, out)
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
    # The session's whole run of the same pair (every task, under the same thread count) scored the same.
    assert ppl_metrics(out) == tiny_run.metrics("ppl")


def test_a_run_resumed_under_another_thread_count_equals_a_whole_run_under_it(tiny_pair, tmp_path):
    out = tmp_path / "run"
    args = ppl_args(tiny_pair, out)
    one, two = {**VNNI_KERNELS, "OMP_NUM_THREADS": "1"}, {**VNNI_KERNELS, "OMP_NUM_THREADS": "2"}
    stopped = interrupt_after("window logits", 2, args, env=one)
    assert stopped.returncode == 130, stopped.stderr
    done = {p.name: p.stat().st_mtime_ns for p in partial_files(out, "logits-*.npy")}
    assert sorted(done) == ["logits-0000.npy", "logits-0001.npy"]
    resumed = run_cli(*args, env=two)
    assert resumed.returncode == 0, resumed.stderr
    # The windows one thread made are another execution's: observed again under two, not mixed in.
    (ref_obs,) = (out / "observations").glob("ref-window-logits-*")
    assert all((ref_obs / name).stat().st_mtime_ns != mtime for name, mtime in done.items())
    whole = run_cli(*args[:-3], "--out", tmp_path / "whole", "--quiet", "--no-resume", env=two)
    assert whole.returncode == 0, whole.stderr
    assert ppl_metrics(out) == ppl_metrics(tmp_path / "whole")


def test_an_interrupted_smoke_run_resumes_at_the_next_batch(tiny_pair, tmp_path):
    out = tmp_path / "run"
    ref = tiny_pair[TINY_BF16]
    args = [
        "run",
        "--ckpt",
        ref,
        "--ref",
        ref,
        "--tasks",
        "smoke",
        *tiny_spec_args(),
        "--out",
        out,
        "--quiet",
    ]
    # A loaded side decodes every prompt alone (each saved as it completes), then in the spec's batches (each
    # batch saved as it completes): the third prompt done in batches is in the first batch.
    n_prompts = TINY_SMOKE_PROMPTS
    stopped = interrupt_after("smoke prompts", n_prompts + 3, args)
    assert stopped.returncode == 130, stopped.stderr
    done = {p.name: p.stat().st_mtime_ns for p in partial_files(out, "*-*.json")}
    assert sorted(n for n in done if n.startswith("batch-")) == ["batch-0000.json"]
    assert len([n for n in done if n.startswith("alone-")]) == n_prompts
    resumed = run_cli(*args)
    # The same model on both sides: no prompt the reference passes is failed, nothing diverges.
    assert resumed.returncode == 0, resumed.stderr
    (ref_obs,) = (out / "observations").glob("ref-smoke-answers-*")
    assert {name: (ref_obs / name).stat().st_mtime_ns for name in done} == done
    smoke = json.loads((out / "results.json").read_text())["tasks"]["smoke"]
    assert smoke["metrics"]["identical"] == smoke["metrics"]["n_prompts"]  # the same model on both sides
