"""Slow tier: on the SmolLM2 W4A8 pair, a real model whose answers mean something and whose INT8 activations
round discontinuously, every shipped smoke prompt's row says what each side decoded alone by Transformers'
`generate` (or marks the row batch-sensitive with both answers); no divergence where the reference's own gap
is at least `near_tie` is called a near tie; survival at N rests on the prompts whose budget reaches N; the
batch-sensitive counts and trajectory survival are in the report and the model card."""

from __future__ import annotations

from pathlib import Path

import pytest

from evalsuite.fixtures.names import SMOLLM2_BF16, SMOLLM2_W4A8
from evalsuite.reporting.model_card import format_number
from tests.conftest import run_cli
from tests.e2e.test_decoded_answers import SHIPPED, answers_as_decoded

pytestmark = pytest.mark.slow


def test_on_smollm2_every_row_says_what_each_side_decoded_alone(smollm2_pair, smollm2_run):
    folders = {"ref": smollm2_pair[SMOLLM2_BF16], "ckpt": smollm2_pair[SMOLLM2_W4A8]}
    answers_as_decoded(smollm2_run, SHIPPED, folders)
    rows = smollm2_run.task("smoke")["details"]
    # Some prompts keep their answer and some part: the survival figures rest on both outcomes.
    assert 0 < sum(bool(r["identical"]) for r in rows if "id" in r) < len(rows)


def test_on_smollm2_batch_sensitivity_and_survival_are_in_the_report_and_the_card(smollm2_run):
    m = smollm2_run.metrics("smoke")
    for n in (8, 16, 32):
        low, share, high = m[f"survival_{n}_lower95"], m[f"survival_{n}"], m[f"survival_{n}_upper95"]
        assert 0 <= low <= share <= high <= 1 and low < high, (n, low, share, high)
        assert m[f"survival_{n}_n"] > 0
    report = (smollm2_run.out / "report.md").read_text(encoding="utf-8")
    assert "survival_8" in report
    counts = f"reference {m['ref_batch_sensitive']}, candidate {m['ckpt_batch_sensitive']}"
    assert counts in report, report
    res = run_cli("report", smollm2_run.out, "--format", "model-card")
    assert res.returncode == 0, res.stderr
    card = Path(res.stdout.strip()).read_text(encoding="utf-8")
    assert "trajectory survival" in card and "95% Wilson interval" in card
    interval = f"[{format_number(m['survival_8_lower95'])}, {format_number(m['survival_8_upper95'])}]"
    assert f"| 8 | {format_number(m['survival_8'])} | {interval} |" in card, card
    assert counts in card, card
