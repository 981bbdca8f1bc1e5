"""Every bench runs in its `--quick` mode on the tiny fixtures, writes its figures as JSON with the machine
and the commit, and that JSON renders into the benchmarks page.

The quick modes check the benches, not the tool: a bench whose code drifted from the package fails here, not
on the day someone measures with it. The benches that take tens of seconds even in quick mode (child processes
that each import torch, lm-eval's own CLI twice) are in the slow tier.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAST = ["digest", "manifest", "exl3_decode", "exl3_tiles", "tensors", "intref", "moe", "stream", "outliers"]
SLOW = ["ppl", "record", "drift", "compare", "lmeval", "long_context"]
# Benches that still write JSON of their own (not yet through bench/figures.py, so not yet on the page).
OWN_JSON = ["real_shape"]


def render_module():
    spec = importlib.util.spec_from_file_location(
        "render_benchmarks", ROOT / "scripts" / "render_benchmarks.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cgroup_v1_writable() -> bool:
    root = Path("/sys/fs/cgroup/memory")
    return root.is_dir() and os.access(root, os.W_OK)


def run_quick(bench: str, results: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{bench}.py"), "--quick", "--results", str(results)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
        timeout=900,
    )


def check_bench(bench: str, tmp_path: Path) -> None:
    if bench == "stream" and not cgroup_v1_writable():
        pytest.skip(
            "bench/stream.py runs under a cgroup-v1 memory limit: needs root and /sys/fs/cgroup/memory"
        )
    results = tmp_path / "results"
    done = run_quick(bench, results)
    assert done.returncode == 0, f"bench/{bench}.py --quick exited {done.returncode}:\n{done.stderr[-3000:]}"
    (path,) = results.glob(f"{bench}-*-quick.json")
    doc = json.loads(path.read_text())
    assert doc["schema"] == "evalsuite.bench/1" and doc["bench"] == bench and doc["mode"] == "quick"
    assert doc["figures"], "a bench records the figures it prints"
    assert all({"name", "value", "unit", "goal", "met"} <= set(f) for f in doc["figures"])
    assert doc["machine"]["cpu_model"] and doc["machine"]["cores"] and doc["machine"]["torch_cpu_capability"]
    assert doc["commit"] and len(doc["commit"]) == 40
    assert f"figures: {path}" in done.stdout
    assert doc["printed"] and "--results" not in doc["argv"]

    page = render_module().render(results)
    section = page[page.index(f"## {bench}\n") :]
    assert f"`{doc['commit'][:10]}`" in section
    assert doc["machine"]["cpu_model"] in section
    assert "**Quick mode**" in section
    for figure in doc["figures"]:
        assert figure["name"].replace("|", "\\|") in section


@pytest.mark.parametrize("bench", FAST)
def test_a_bench_runs_quick_and_its_json_renders_into_the_benchmarks_page(bench, tiny_pair, tmp_path) -> None:
    check_bench(bench, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("bench", SLOW)
def test_a_slower_bench_runs_quick_and_its_json_renders(bench, tiny_pair, tmp_path) -> None:
    check_bench(bench, tmp_path)


def test_every_bench_is_tested_and_known_to_the_page() -> None:
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")} - {"figures"}
    assert scripts == set(FAST) | set(SLOW) | set(OWN_JSON)
    assert scripts - set(OWN_JSON) <= set(render_module().BENCHES)
