"""The demo pair: SmolLM2-135M-Instruct BF16 against its W4A8 copy, through the CLI with fixture names."""

from __future__ import annotations

import json

import pytest

from tests.conftest import FIXTURES, run_cli
from tests.e2e.test_run_ppl import CONTRACT

pytestmark = pytest.mark.slow


def test_smollm2_pair_writes_every_contract_metric_on_2040_tokens(smollm2_pair, tmp_path):
    res = run_cli(
        "run",
        "--ckpt",
        "smollm2-135m-w4a8",
        "--ref",
        "smollm2-135m-bf16",
        "--tasks",
        "ppl",
        "--fixtures",
        FIXTURES,
        "--corpus",
        "python-docs",
        "--out",
        tmp_path,
        "--quiet",
    )
    assert res.returncode == 0, res.stderr  # the default thresholds are calibrated on this pair
    results = json.loads((tmp_path / "results.json").read_text())
    m = results["tasks"]["ppl"]["metrics"]
    assert all(name in m for name in CONTRACT)
    assert m["n_scored_tokens"] == 2040
    assert 1.0 < m["ppl_ratio"] < 1.7 and m["kld_mean"] > 0 and 0.6 < m["same_top_p"] < 1.0
    assert results["ckpt"]["format"] == "compressed-tensors"
