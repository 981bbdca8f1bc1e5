"""`bench/gpu_check.sh --dry-run` on this CPU machine: every part listed with what it runs and the memory plan
of each fixture it uses (the tiny ones built here; the real-shape ones are said to be built on the device)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_gpu_check_lists_its_parts_and_their_memory_plans_without_a_gpu(tiny_pair):
    fixtures = next(iter(tiny_pair.values())).parent
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        env={**os.environ, "EVALSUITE_TEST_FIXTURES": str(fixtures)},
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for part in ("tiny-cuda", "exl3", "auto", "wide"):
        assert f"part {part}:" in lines, proc.stdout
    tasks = "ppl,smoke,vision,tensors,intref,moe,layers"
    assert f"  cuda: run --tasks {tasks} --device cuda (metrics against cpu)" in lines
    assert any(line.startswith("    tiny-minicpmv47-w4a8: plan ") for line in lines), proc.stdout
    assert any("minicpmv47-35b-a3b-wide" in line for line in lines), proc.stdout


def test_an_unknown_part_is_one_line_exit_2():
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "nonsense"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown part nonsense" in proc.stderr
