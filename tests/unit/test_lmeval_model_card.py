"""The model card with paired downstream accuracy beside the PPL numbers: every number from results.json."""

from __future__ import annotations

from evalsuite.reporting.model_card import render_model_card
from tests.unit.test_lmeval_compare import CKPT, REF, lmeval_task, observation
from tests.unit.test_model_card import caveats, numbers_not_in, ppl_task, results_document


def lmeval_entry(tmp_path) -> dict:
    result = lmeval_task().compare({"ref": observation(REF), "ckpt": observation(CKPT)}, tmp_path)
    return result.to_json()


def test_paired_accuracy_follows_the_ppl_table_and_every_number_is_from_results_json(tmp_path):
    results = results_document(ppl=ppl_task(), lmeval=lmeval_entry(tmp_path))
    card = render_model_card(results)
    section = card.split("### Results")[1].split("### Checks")[0]
    assert section.index("| checkpoint | PPL |") < section.index("Downstream accuracy (lm-eval)")
    row = next(line for line in section.splitlines() if line.startswith("| `toy.acc` |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # documents, ref ± stderr, ckpt ± stderr, paired Δ ± stderr, recovery, c→w, w→c, McNemar p, choice KLD
    assert cells[1:9] == ["10", "0.5 ± 0.1667", "0.5 ± 0.1667", "0 ± 0.2582", "1", "3", "3", "1"]
    assert numbers_not_in(results, card) == []


def test_the_caveat_names_the_tasks_measured_instead_of_saying_accuracy_was_not_measured(tmp_path):
    card = render_model_card(results_document(ppl=ppl_task(), lmeval=lmeval_entry(tmp_path)))
    notes = caveats(card)
    assert "downstream accuracy was not measured" not in notes
    assert "Downstream accuracy was measured on `toy` only (10 documents)" in notes
    without = caveats(render_model_card(results_document(ppl=ppl_task())))
    assert "downstream accuracy was not measured" in without


def test_a_skipped_lmeval_leaves_the_ppl_card_as_it_was_with_its_reason(tmp_path):
    skipped = {"status": "skipped", "reason": "the ckpt side runs on backend 'exl3'"}
    card = render_model_card(results_document(ppl=ppl_task(), lmeval=skipped))
    assert "Downstream accuracy (lm-eval)" not in card
    assert "`lmeval` skipped: the ckpt side runs on backend 'exl3'" in caveats(card)
