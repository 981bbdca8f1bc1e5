"""Slow tier: `longform` on its whole shipped prompt set, SmolLM2-135M-Instruct W4A8 against its BF16 source
(a real model whose long answers mean something): every row says what each side decoded alone and is read by
the rules of `evalsuite.stats.answers`; the task's figures, with their sample sizes and intervals, reach
report.md and the model card. SmolLM2's chat template takes no `enable_thinking`: one mode, said so."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from evalsuite.contract.observation import Observation
from evalsuite.fixtures.names import SMOLLM2_BF16, SMOLLM2_W4A8
from evalsuite.observers.greedy_answers import answer_set
from evalsuite.reporting.model_card import format_number, render_model_card
from evalsuite.stats import answers
from tests.conftest import Run, run_pair
from tests.e2e.test_longform import SHIPPED, replacement_characters

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_longform(smollm2_pair, tmp_path_factory) -> Run:
    run = run_pair(
        smollm2_pair[SMOLLM2_W4A8],
        smollm2_pair[SMOLLM2_BF16],
        tmp_path_factory.mktemp("longform-smollm2") / "run",
        "longform",
    )
    assert run.cli.returncode in (0, 1), run.cli.stderr
    return run


def test_every_row_is_read_off_what_each_side_decoded(smollm2_pair, smollm2_longform):
    import tomllib

    entry = smollm2_longform.task("longform")
    m, rows = entry["metrics"], entry["details"]
    folders = {"ref": smollm2_pair[SMOLLM2_BF16], "ckpt": smollm2_pair[SMOLLM2_W4A8]}
    shipped = tomllib.loads(SHIPPED.read_text(encoding="utf-8"))["prompts"]
    assert [r["id"] for r in rows] == [p["id"] for p in shipped] and m["n_prompts"] == len(shipped)
    assert m["thinking_modes"].startswith("one") and m["ref_answers_decoded"].startswith("decoded alone")
    for side in ("ref", "ckpt"):
        (folder,) = (smollm2_longform.out / "observations").glob(f"{side}-longform-answers-*")
        shown = answer_set(Observation.load(folder))
        for row, tokens, text in zip(rows, shown.tokens, shown.texts, strict=True):
            assert row[f"{side}_answer"] == text and row[f"{side}_length"] == len(tokens)
            content = tokens if row[f"{side}_stop"] == "budget" else tokens[:-1]
            assert row[f"{side}_loop_period"] == answers.loop_period(content), row["id"]
            assert row[f"{side}_fffd"] == replacement_characters(
                folders[side], tokens, text, row[f"{side}_stop"]
            )
    # A real model answers some prompts right: the final-answer figures rest on outcomes, not on nothing.
    assert m["right_ref"] > 0 and m["length_ratio_n"] == len(shipped)
    assert m["length_ratio_lower95"] <= m["length_ratio"] <= m["length_ratio_upper95"]


def test_the_figures_reach_the_report_and_the_card_with_sizes_and_intervals(smollm2_longform):
    entry = smollm2_longform.task("longform")
    m, n = entry["metrics"], entry["metrics"]["n_prompts"]
    report = (smollm2_longform.out / "report.md").read_text(encoding="utf-8")
    assert "## longform:" in report and "| loops_ckpt |" in report and "| length_ratio |" in report
    card = render_model_card(smollm2_longform.results)
    assert f"Long greedy answers to {n} prompts (`longform`)" in card
    share = "[{}, {}]".format(*(format_number(m[f"loops_ckpt_share_{e}"], 2) for e in ("lower95", "upper95")))
    assert f"{m['loops_ckpt']} of {n} {share}" in card, card
    assert all(math.isfinite(m[k]) for k in ("length_ratio_lower95", "length_ratio_upper95"))
    assert format_number(m["length_ratio"]) in card
    Path(smollm2_longform.out / "model-card.md").write_text(card, encoding="utf-8")  # for a reader of the run
