"""bench/serving_at_size.py: the serving tasks' forwards at the seed's real shape, counted from the shipped
specs as a streamed side decodes them, and priced at a measured forward."""

from __future__ import annotations

from types import ModuleType

import pytest

from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.tasks.longform import LongformSpec
from evalsuite.tasks.specdec import SpecdecSpec
from evalsuite.tasks.tools import ToolsSpec
from tests.conftest import bench_module


@pytest.fixture(scope="module")
def serving() -> ModuleType:
    return bench_module("serving_at_size")


def test_a_batch_costs_its_largest_budget_and_batches_gather_like_budgets(serving):
    # Sorted by budget, the four 10s go together and the two 100s together: 10 + 100, not 100 + 100.
    assert serving._batched([100, 10, 10, 100, 10, 10], 4) == 10 + 100
    assert serving._batched([512] * 66, 32) == 3 * 512
    assert serving._batched([7], 32) == 7


def test_the_shipped_specs_forwards_by_hand(serving):
    longform = load_spec(LongformSpec, default_spec_path("longform"))
    tools = load_spec(ToolsSpec, default_spec_path("tools"))
    specdec = load_spec(SpecdecSpec, default_spec_path("specdec"))
    one, two = serving.serving_forwards(False), serving.serving_forwards(True)
    budgets = sorted(longform.budget(p) for p in longform.prompts)
    batch = longform.generation.batch
    by_hand = sum(max(budgets[i : i + batch]) for i in range(0, len(budgets), batch))
    assert one["longform"]["forwards"] == by_hand and two["longform"]["forwards"] == 2 * by_hand
    cases = sorted(c.max_new_tokens for c in tools.cases)
    size = tools.generation.batch
    assert one["tools"]["forwards"] == sum(max(cases[i : i + size]) for i in range(0, len(cases), size))
    # Each prompt alone, plainly and drafted: a verification round per accepted run, at most its budget.
    assert one["specdec"]["forwards"] == 2 * sum(p.max_new_tokens for p in specdec.prompts)
    assert one["specdec"]["batch"] == 1 and one["longform"]["prompts"] == len(longform.prompts)


def test_priced_at_the_measured_forward_and_specdec_skipped_with_its_reason(serving):
    layers = [1.7e9, 1.7e9, 1.7e9, 1.6e9]
    doc = {
        "runs": {"validation-streamed": {"commit": "abc1234"}},
        "bytes": {"ref": {"rest": 3e9, "layers": layers}},
        "text_config": {},
        "decoding_batch": 32,
        "chat_template_thinking": False,
        "serving_skipped": {"specdec": "a stateful model"},
    }
    per_forward = {"ref": {"seconds": 24.0, "bytes": 25e9}, "ckpt": {"seconds": 48.0, "bytes": 6.5e9}}
    extrapolated = {"runs": {"validation-streamed": {"decoding_forward": per_forward}}}
    out = serving.serving_at_size(doc, extrapolated, lambda d: 1e9)
    longform = out["tasks"]["longform"]
    assert longform["sides"]["ckpt"] == {
        "seconds": longform["forwards"] * 48.0,
        "bytes_read": longform["forwards"] * 6.5e9,
    }
    assert longform["resident_bytes"] == 2 * 1.7e9 + 3e9 + 1e9 and longform["fits_gpu_24gb"]
    assert out["tasks"]["specdec"]["skipped"] == "a stateful model"
    assert "skipped on this model: a stateful model" in "\n".join(serving.serving_lines(out))
    # Without a measured decoding forward of both sides there is nothing to price.
    assert serving.serving_at_size(doc, {"runs": {}}, lambda d: 0.0) is None
