"""Every bench runs in its `--quick` mode on the tiny fixtures, writes its figures as JSON with the machine
and the commit, and that JSON renders into the benchmarks page; the page gives the real shape's run
extrapolated to 40 layers with its machine.

The quick modes check the benches, not the tool: a bench whose code drifted from the package fails here, not
on the day someone measures with it. The benches that take tens of seconds even in quick mode (child processes
that each import torch, lm-eval's own CLI twice) are in the slow tier. bench/real_shape.py's quick run is also
checked for what its hour-long run on the wide fixtures ends with: the runs, the bare forwards and the
40-layer extrapolation.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evalsuite.fixtures.names import REAL_WIDE_BF16

ROOT = Path(__file__).resolve().parents[2]
FAST = ["digest", "manifest", "exl3_decode", "exl3_tiles"]
# Ten seconds or more each even in quick mode (moe and stream run whole passes of the tiny models under
# their own measurement; gpu_check rehearses five CLI runs; unpack decodes with three streamed models;
# tensors, intref and outliers verify or run a pack in child processes of their own).
SLOW = [
    *("ppl", "record", "drift", "compare", "lmeval", "long_context", "real_shape"),
    *("gpu_check", "moe", "stream", "unpack", "tensors", "intref", "outliers"),
]


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


def check_bench(bench: str, tmp_path: Path) -> tuple[dict, str]:
    """Run `bench` quick; its JSON and the page's section rendered from it."""
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
    return doc, section


def check_real_shape(doc: dict, section: str) -> None:
    """What the wide run ends with, from the tiny pair's quick run: the runs, both bare forwards layer by
    layer, the W4A8 validation extrapolated to 40 layers, on the page with the machine's memory."""
    data = doc["data"]
    assert set(data["runs"]) == {"tensors", "ppl-streamed"}
    assert all(run["exit"] == 0 and run["peak_rss"] > 0 for run in data["runs"].values())
    assert all(run["commit"].startswith(doc["commit"]) for run in data["runs"].values())
    sides = ("bare-ref", "bare-w4a8", "bare-exl3")
    assert [len(data["bare"][side]["layer_seconds"]) for side in sides] == [2, 2, 2]
    # The EXL3 pack's floor runs through backend exl3, as `evalsuite run` resolves it.
    assert [data["bare"][side]["backend"] for side in sides] == ["hf", "hf", "exl3"]
    assert data["extrapolated"]["validations"]["exl3"]["floor_seconds"] > 0
    w4a8 = data["extrapolated"]["validations"]["w4a8"]
    assert w4a8["runs"] == {"tensors": "tensors", "ppl": "ppl-streamed"}
    assert w4a8["missing"] == ["smoke", "vision", "moe", "intref"] and w4a8["floor_seconds"] > 0
    assert "extrapolated to 40 layers" in "\n".join(doc["printed"])
    assert "| 40 layers (35B), w4a8 validation: time |" in section
    # The floor's rates are measured in the same call, and each bare forward's layers are read against them.
    rates = data["floor_rates"]
    assert rates["measured"] == "with the runs" and rates["read_bytes_per_second"] > 0
    passes = data["floors"]["layer_pass"]
    assert set(passes) == {"ref", "w4a8", "exl3"}
    assert all(f["seconds"] > 0 and f["ratio"] > 0 for f in passes.values())
    assert "| layer pass, w4a8: measured / floor |" in section
    assert f"{doc['machine']['memory_bytes'] / 1e9:.1f} GB of memory" in section


@pytest.mark.parametrize("bench", FAST)
def test_a_bench_runs_quick_and_its_json_renders_into_the_benchmarks_page(bench, tiny_pair, tmp_path) -> None:
    check_bench(bench, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("bench", SLOW)
def test_a_slower_bench_runs_quick_and_its_json_renders(bench, tiny_pair, tmp_path) -> None:
    doc, section = check_bench(bench, tmp_path)
    if bench == "real_shape":
        check_real_shape(doc, section)


def test_every_bench_is_tested_and_known_to_the_page() -> None:
    # Modules the benches import (their JSON, the floor's rates, the serving tasks' forwards): no bench each.
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")} - {"figures", "floor", "serving_at_size"}
    assert scripts == set(FAST) | set(SLOW)
    assert scripts <= set(render_module().BENCHES)


def test_the_benchmarks_page_gives_the_35b_extrapolation_with_the_machine_it_was_measured_on() -> None:
    """The committed run of bench/real_shape.py on the wide fixtures, extrapolated to the 40-layer model."""
    docs = [json.loads(p.read_text()) for p in (ROOT / "bench" / "results").glob("real_shape-*.json")]
    wide = [d for d in docs if d["mode"] == "full" and d["data"]["fixtures"]["ref"] == REAL_WIDE_BF16]
    assert wide, "bench/results/ holds a run on the wide fixtures"
    doc = max(wide, key=lambda d: d["date"])
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    section = page[page.index("## real_shape\n") :].split("\n## ", 1)[0]
    assert f"- machine: {render_module().machine_text(doc['machine'])}\n" in section
    assert "GB of memory" in section and f"commit `{doc['commit'][:10]}`" in section
    for what in ("time", "peak RSS", "fits this machine's memory"):
        assert f"| 40 layers (35B), w4a8 validation: {what} |" in section
    assert "| 40 layers (35B), ppl-moe-layers-streamed: peak RSS |" in section
