"""Slow tier: on the SmolLM2 W4A8 pair, a real model whose answers mean something, the divergence forcing
finds for every shipped smoke prompt is the one both sides' own greedy decoding (Transformers `generate`)
makes, or a step the report marks as within the logits' resolution; and the trajectory survival it measures
is in the report and the model card with its interval."""

from __future__ import annotations

from pathlib import Path

import pytest

from evalsuite import metrics
from evalsuite.fixtures.names import SMOLLM2_BF16, SMOLLM2_W4A8
from evalsuite.model_card import format_number
from tests.conftest import run_cli
from tests.e2e.test_forced_answers import SHIPPED, observation, own_answers, reference_answers

pytestmark = pytest.mark.slow


def marked_steps(row: dict) -> set[int]:
    """The answer steps a smoke detail row marks as decided within the candidate's logits' resolution."""
    marked = set()
    for key in ("agreement_within_resolution", "reference_ties"):
        marked |= {int(s) for s in str(row.get(key, "")).split(",") if s.strip()}
    if row.get("first_diff_token") is not None and row.get("within_resolution"):
        marked.add(row["first_diff_token"])
    return marked


def test_on_smollm2_forcing_finds_the_divergence_both_sides_own_decoding_makes(smollm2_pair, smollm2_run):
    smoke = smollm2_run.task("smoke")
    answers = observation(smollm2_run, "ref", "smoke-answers")
    refs = reference_answers(answers)
    # The reference's answers the run observed are its own `generate`'s, token for token.
    assert own_answers(smollm2_pair[SMOLLM2_BF16], SHIPPED, answers) == refs
    real = own_answers(smollm2_pair[SMOLLM2_W4A8], SHIPPED, answers)
    unmarked = []
    for row, ref, own in zip(smoke["details"], refs, real, strict=True):
        decoded, forced = metrics.first_divergence(ref, own), row["first_diff_token"]
        assert row["identical"] == (forced is None), row["id"]
        if decoded == forced:
            continue
        first = min(t for t in (decoded, forced) if t is not None)
        if first not in marked_steps(row):
            unmarked.append((row["id"], decoded, forced))
    assert not unmarked, unmarked
    # Some prompts keep their answer and some part: the survival figures rest on both outcomes.
    assert 0 < sum(bool(r["identical"]) for r in smoke["details"]) < len(refs)


def test_on_smollm2_trajectory_survival_is_in_the_report_and_the_card_with_its_interval(
    smollm2_pair, smollm2_run, tmp_path
):
    m = smollm2_run.metrics("smoke")
    for n in (8, 16, 32):
        low, share, high = m[f"survival_{n}_lower95"], m[f"survival_{n}"], m[f"survival_{n}_upper95"]
        assert 0 <= low <= share <= high <= 1 and low < high, (n, low, share, high)
        assert m[f"survival_{n}_n"] > 0
    report = (smollm2_run.out / "report.md").read_text(encoding="utf-8")
    assert "survival_8" in report
    res = run_cli("report", smollm2_run.out, "--format", "model-card")
    assert res.returncode == 0, res.stderr
    card = Path(res.stdout.strip()).read_text(encoding="utf-8")
    assert "trajectory survival" in card and "95% Wilson interval" in card
    interval = f"[{format_number(m['survival_8_lower95'])}, {format_number(m['survival_8_upper95'])}]"
    assert f"| 8 | {format_number(m['survival_8'])} | {interval} |" in card, card
