"""`bench/real_shape.py --quick`: the benchmark's own plumbing on the tiny pair (its figures mean nothing
there), so that the hour-long run on the wide fixtures does not fail at its end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "real_shape.py"


@pytest.mark.slow
def test_quick_bench_writes_runs_floors_and_a_40_layer_extrapolation_with_its_machine(tmp_path, tiny_pair):
    out = tmp_path / "real_shape.json"
    command = [sys.executable, str(BENCH), "--quick", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert set(doc["runs"]) == {"tensors", "ppl-streamed"}
    assert all(run["exit"] == 0 and run["peak_rss"] > 0 for run in doc["runs"].values())
    assert [len(doc["bare"][side]["layer_seconds"]) for side in ("bare-ref", "bare-w4a8")] == [2, 2]
    w4a8 = doc["extrapolated"]["validations"]["w4a8"]
    assert w4a8["runs"] == {"tensors": "tensors", "ppl": "ppl-streamed"}
    assert w4a8["missing"] == ["smoke", "moe", "intref"] and w4a8["floor_seconds"] > 0
    assert doc["machine"]["cpu_model"] and doc["machine"]["cores"] and len(doc["commit"]) >= 40
    assert "extrapolated to 40 layers" in done.stdout
