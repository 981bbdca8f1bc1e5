"""Slow tier: `specdec` on the SmolLM2 BF16 / W4A8 pair over the whole shipped prompt set (the eight workloads
of exllamav3's eval/spec_decode.py, five prompts or more each): each side's answers drafted by prompt lookup
against its own plain answers, per workload each side's mean accepted length with its interval and the paired
difference, in results.json, report.md and the model card; a side whose answers drafting changed fails its
lossless check. And a draft checkpoint (the BF16 model drafting for both sides) on a few prompts."""

from __future__ import annotations

import math

import pytest

from evalsuite.fixtures.names import SMOLLM2_BF16, SMOLLM2_W4A8
from evalsuite.reporting.model_card import render_model_card
from evalsuite.tasks.specdec import CATEGORIES
from tests.conftest import Run, run_pair
from tests.e2e.test_specdec import prompt_rows, specdec_subset_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_specdec(smollm2_pair, tmp_path_factory) -> Run:
    out = tmp_path_factory.mktemp("specdec-smollm2") / "run"
    # In this process, as the other whole-set runs: a child would be held to the launcher's wall-clock limit,
    # which the whole set outlasts on a busy 2-core machine.
    return run_pair(smollm2_pair[SMOLLM2_W4A8], smollm2_pair[SMOLLM2_BF16], out, "specdec")


def test_on_smollm2_the_whole_set_gives_each_workloads_acceptance_with_intervals(smollm2_specdec):
    run = smollm2_specdec
    assert run.cli.returncode in (0, 1), run.cli.stderr
    task = run.task("specdec")
    m = task["metrics"]
    assert m["n_prompts"] == len(prompt_rows(run)) >= 5 * len(CATEGORIES)
    for side in ("ref", "ckpt"):
        changed = [r for r in prompt_rows(run) if not r[f"{side}_lossless"]]
        assert m[f"{side}_drafting_changed"] == len(changed)
        assert m[f"{side}_lossless"] is (not changed)
        # The check: no change at a step that was no near tie of the side's plain decoding.
        beyond = [r for r in changed if not r[f"{side}_change_near_tie"]]
        assert m[f"{side}_drafting_changed_beyond_near_tie"] == len(beyond)
        check = next(c for c in task["checks"] if c["name"] == f"{side}_drafting_changed_beyond_near_tie")
        assert check["passed"] is (not beyond)
    for category in CATEGORIES:
        assert m[f"n_prompts_{category}"] >= 5
        for name in (f"ref_accept_{category}", f"ckpt_accept_{category}", f"accept_diff_{category}"):
            low, value, high = m[f"{name}_lower95"], m[name], m[f"{name}_upper95"]
            assert math.isfinite(low) and low <= value <= high, (name, low, value, high)
        # What the report says of the difference is what its interval shows.
        said = m[f"accept_diff_{category}_direction"]
        low, high = m[f"accept_diff_{category}_lower95"], m[f"accept_diff_{category}_upper95"]
        # A workload's direction is said by the Bonferroni interval over the workloads: within the 95% one.
        assert said in ("undetermined", "same") or (low > 0 if said == "higher" else high < 0)
    # Answers that copy the prompt are where prompt lookup drafts well, better than where code is written
    # anew. A point estimate: a t interval over a workload's five prompts is too wide to order them.
    assert m["ref_accept_trivial_repetition"] > m["ref_accept_coding"]
    report = (run.out / "report.md").read_text(encoding="utf-8")
    assert "ref_accept_mean" in report and "accept_diff_trivial_repetition" in report
    card = render_model_card(run.results)
    assert f"each side decoded {m['n_prompts']} prompts" in card and f"| all | {m['n_prompts']} |" in card
    assert all(f"| {c.replace('_', ' ')} | {m[f'n_prompts_{c}']} |" in card for c in CATEGORIES)


def test_on_smollm2_a_draft_checkpoint_drafts_for_both_sides(smollm2_pair, tmp_path):
    """The BF16 model drafting for itself and for its W4A8 copy on one prompt of each workload: the
    reference, drafted by its own weights, keeps more than one token a round."""
    spec = specdec_subset_spec(tmp_path, tokens=24)
    run = run_pair(
        smollm2_pair[SMOLLM2_W4A8], smollm2_pair[SMOLLM2_BF16], tmp_path / "run", "specdec",
        "--spec", f"specdec={spec}", "--draft", smollm2_pair[SMOLLM2_BF16],
    )  # fmt: skip
    assert run.cli.returncode in (0, 1), run.cli.stderr
    m = run.metrics("specdec")
    assert "draft checkpoint" in m["drafting"] and m["n_prompts"] == len(CATEGORIES)
    assert m["ref_accept_mean"] > 1 and m["ckpt_accept_mean"] >= 1
