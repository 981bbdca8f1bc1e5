"""results.json is strict JSON: a value that is not a finite number is null, with its reason."""

from __future__ import annotations

import json
import math

from evalsuite.contract.spec import Check
from evalsuite.protocol.task import TaskResult


def test_a_nan_metric_is_written_as_null_with_a_reason():
    result = TaskResult.from_checks(
        {"ppl_ref_stderr_window": float("nan"), "sqnr_db": math.inf, "kld_mean": 0.5},
        [Check(name="kld_mean", value=0.5, op="<=", threshold=1.0, passed=True)],
        null_reasons={"ppl_ref_stderr_window": "one window: no window-clustered error"},
    )
    doc = result.to_json()
    text = json.dumps(doc, allow_nan=False)  # a strict writer accepts it
    back = json.loads(text)
    assert back["metrics"] == {"ppl_ref_stderr_window": None, "sqnr_db": None, "kld_mean": 0.5}
    assert back["null_reasons"]["ppl_ref_stderr_window"] == "one window: no window-clustered error"
    assert back["null_reasons"]["sqnr_db"] == "+infinity"


def test_a_nan_check_value_is_null_and_the_check_fails():
    from evalsuite.contract.spec import Threshold, apply_threshold

    (check,) = apply_threshold("kld_mean", float("nan"), Threshold(max=1.0))
    doc = TaskResult.from_checks({"kld_mean": float("nan")}, [check]).to_json()
    assert doc["status"] == "fail" and doc["checks"][0]["value"] is None and not doc["checks"][0]["passed"]
    json.dumps(doc, allow_nan=False)
