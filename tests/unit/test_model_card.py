"""The model card's validation section: every number from results.json, caveats from what was (not) run."""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import yaml

from evalsuite.reporting.model_card import model_index, render_model_card
from tests.documents import PPL_METRICS, ppl_task, results_document

# A number as the card writes it: a sign, thousands separators, decimals, an exponent. Not one glued to a word
# or a hyphen (`W4A8`, `WikiText-2`, `kld_p90`): those are names, not measurements.
NUMBER = re.compile(r"(?<![\w.\-])[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.(\d+))?(?:[eE]([-+]?\d+))?")
CODE_SPAN = re.compile(r"`[^`]*`")


def document_numbers(doc: Any) -> list[float]:
    """Every number of a JSON document: its numeric values and the numbers written inside its strings."""
    if isinstance(doc, dict):
        return [x for key, value in doc.items() for x in document_numbers(key) + document_numbers(value)]
    if isinstance(doc, list):
        return [x for item in doc for x in document_numbers(item)]
    if isinstance(doc, bool) or doc is None:
        return []
    if isinstance(doc, int | float):
        return [float(doc)]
    return [float(m.group(0).replace(",", "")) for m in NUMBER.finditer(str(doc))]


def numbers_not_in(results: dict[str, Any], card: str) -> list[str]:
    """The numbers on the card (outside code spans) that no value of results.json rounds to.

    The one derived number allowed is the relative PPL increase, (`ppl_ratio` − 1) × 100.
    """
    allowed = document_numbers(results)
    ratio = results["tasks"].get("ppl", {}).get("metrics", {}).get("ppl_ratio")
    if ratio is not None:
        allowed.append((ratio - 1) * 100)
    invented = []
    for m in NUMBER.finditer(CODE_SPAN.sub("", card)):
        shown = float(m.group(0).replace(",", ""))
        # Half a unit of the last digit shown: the rounding a value may have had on its way to the card.
        tolerance = 0.5 * 10.0 ** (-len(m.group(1) or "") + int(m.group(2) or 0))
        if not any(math.isclose(shown, v, rel_tol=0, abs_tol=tolerance * (1 + 1e-9)) for v in allowed):
            invented.append(m.group(0))
    return invented


def front_matter(card: str) -> dict[str, Any]:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def caveats(card: str) -> str:
    return card.split("### Caveats")[1].split("###")[0]


def test_every_number_on_the_card_is_a_value_of_results_json():
    results = results_document()
    card = render_model_card(results)
    assert "2,040" in card and "+81.51 %" in card  # the provenance check sees formatted numbers
    assert numbers_not_in(results, card) == []


def test_a_number_not_in_results_json_is_caught_by_the_provenance_check():
    results = results_document()
    card = render_model_card(results).replace("21.08 ±", "19.9 ±")
    assert numbers_not_in(results, card) == ["19.9"]


def test_front_matter_is_model_index_yaml_named_after_the_ckpt_folder():
    results = results_document()
    data = front_matter(render_model_card(results))
    assert data == model_index(results)
    (model,) = data["model-index"]
    assert model["name"] == "MiniCPM-V-4.7-W4A8"
    (result,) = model["results"]
    assert result["task"] == {"type": "text-generation"}
    assert result["dataset"]["type"] == "Salesforce/wikitext"
    assert result["dataset"]["config"] == "wikitext-2-raw-v1"
    metrics = {m["type"]: m for m in result["metrics"]}
    # Rounded to the 4 significant digits the report shows, never 17.
    assert metrics["perplexity"]["value"] == 21.08 and metrics["kl_divergence"]["value"] == 0.4528
    assert "21.078134" not in render_model_card(results)
    assert all(set(m) == {"type", "value", "name"} for m in result["metrics"])


def test_front_matter_has_no_results_when_ppl_could_not_run():
    results = results_document(ppl={"status": "error", "reason": "CUDA out of memory"})
    card = render_model_card(results)
    assert front_matter(card)["model-index"][0]["results"] == []
    assert "`ppl` failed to run: CUDA out of memory" in card


def test_run_with_only_ppl_has_a_caveat_for_each_known_task_not_run():
    text = caveats(render_model_card(results_document(ppl=ppl_task())))
    assert "No vision check was run" in text
    assert "No greedy smoke prompts" in text
    assert "not verified tensor by tensor (`tensors` not run)" in text
    assert "No integer W4A8 reference execution: the quantized PPL is that of Transformers' execution" in text
    assert "`ppl` not run" not in text


def test_run_with_a_vision_entry_has_no_vision_caveat():
    vision = {"status": "pass", "metrics": {"same_answer_p": 1.0}, "checks": []}
    text = caveats(render_model_card(results_document(ppl=ppl_task(), vision=vision)))
    assert "vision" not in text


def test_skipped_and_error_tasks_are_caveats_with_their_reasons():
    text = caveats(render_model_card(results_document()))
    assert "No vision check was run" in text
    assert "`vision` skipped: exllamav3 needs CUDA 12: no GPU on this machine" in text
    assert "`tensors` failed to run: shard model-00003-of-00007.safetensors is truncated" in text


def test_unknown_task_that_was_skipped_is_a_caveat_too():
    results = results_document(ppl=ppl_task(), mmlu={"status": "skipped", "reason": "lm-eval not installed"})
    assert "`mmlu` skipped: lm-eval not installed" in caveats(render_model_card(results))


def test_caveats_always_say_ppl_is_not_accuracy_and_give_the_window_length():
    text = caveats(render_model_card(results_document(ppl=ppl_task())))
    assert "A PPL increase is not an accuracy drop: downstream accuracy was not measured." in text
    assert "No long-context evaluation: windows of 512 tokens." in text


def test_recorded_reference_makes_kld_an_estimate():
    card = render_model_card(results_document(ppl=ppl_task()))
    assert "- KLD estimator: top-k + sampled tail" in card
    assert "KLD is an estimate (top-k + sampled tail)" in caveats(card)


def test_full_vocabulary_kld_is_not_called_an_estimate():
    card = render_model_card(results_document(ppl=ppl_task(kld_estimator="full-vocabulary")))
    assert "- KLD estimator: full-vocabulary" in card
    assert "estimate" not in caveats(card)


def test_corpus_other_than_wikitext_is_not_comparable_with_published_figures():
    card = render_model_card(results_document(ppl=ppl_task(corpus="python-docs")))
    assert "Python Language Reference topics shipped with CPython (offline corpus)" in card
    assert "not comparable with published WikiText-2 figures" in caveats(card)
    wikitext = render_model_card(results_document(ppl=ppl_task()))
    assert "not comparable" not in wikitext


def test_text_file_corpus_is_named():
    card = render_model_card(results_document(ppl=ppl_task(corpus="file:novel.txt")))
    assert "the text file `novel.txt`" in card


def test_protocol_states_windows_starts_and_scored_positions_from_results():
    card = render_model_card(results_document(ppl=ppl_task()))
    protocol = card.split("### Protocol")[1].split("###")[0]
    assert "WikiText-2 raw test split: 8 windows of 512 tokens starting at tokens 0, 4096, 8192" in protocol
    assert "positions 256 to 510 are scored, each predicting the next token; 2,040 scored tokens" in protocol
    assert PPL_METRICS["tokens_sha256"] in protocol


def test_protocol_leaves_out_what_results_json_does_not_state():
    missing = dict.fromkeys(("window_tokens", "window_starts", "scored_first", "scored_last"))
    card = render_model_card(results_document(ppl=ppl_task(**missing)))
    protocol = card.split("### Protocol")[1].split("###")[0]
    assert "8 windows; 2,040 scored tokens in all." in protocol
    assert "512" not in card and "positions" not in protocol
    assert "- No long-context evaluation." in caveats(card)


def test_protocol_note_is_a_caveat():
    note = "3 of the 8 windows did not fit in the text and were not scored"
    assert f"- {note}." in caveats(render_model_card(results_document(ppl=ppl_task(protocol_note=note))))


def test_results_table_has_reference_and_candidate_rows_with_stderr():
    card = render_model_card(results_document(ppl=ppl_task()))
    assert "| `minicpm-v-4.7-bf16` (reference, recording) | 11.61 ± 0.6669 | — | — | — |" in card
    assert (
        "| `MiniCPM-V-4.7-W4A8` (candidate, compressed-tensors) | 21.08 ± 1.224 "
        "| +81.51 % (ln PPL ratio 0.5961 ± 0.02219) | 0.4528 ± 0.00791 | 0.6642 ± 0.01046 |"
    ) in card
    assert "- sample size: 2,040 scored tokens per side" in card


def test_no_error_bar_is_shown_where_results_json_has_no_stderr():
    card = render_model_card(results_document(ppl=ppl_task(same_top_p_stderr=None)))
    assert "| 0.6642 |" in card and "0.6642 ±" not in card


def test_checks_table_lists_every_check_with_its_result():
    card = render_model_card(results_document())
    checks = card.split("### Checks")[1].split("###")[0]
    assert "| ppl | ppl_ratio | 1.815 | <= | 1.7 | **FAIL** |" in checks
    assert "| ppl | same_top_p | 0.6642 | >= | 0.6 | pass |" in checks
    assert "| vision | (no checks) | — | — | — | skipped: exllamav3 needs CUDA 12" in checks
    assert "| tensors | (no checks) | — | — | — | failed to run: shard" in checks


def test_environment_lists_packages_device_and_dtype():
    env = render_model_card(results_document()).split("### Environment")[1]
    assert "evalsuite `0.1.0`, torch `2.13.0+cu128`, transformers `5.24.0`" in env
    assert "gguf" not in env  # a package that is not installed has no version to show
    assert "- device: cuda:0 (NVIDIA H200)" in env
    assert "- dtype: bfloat16" in env


def test_rendering_does_not_change_the_results_document():
    results = results_document()
    before = copy.deepcopy(results)
    render_model_card(results)
    assert results == before


def test_chat_splits_are_a_row_each_tags_first_and_the_calibration_verdicts_beside_them():
    splits = {
        f"{name}_{metric}": value
        for name, chats in (("turn_1", 30), ("tag_zh", 12), ("tag_en", 18))
        for metric, value in (
            ("n_windows", chats),
            ("n_tokens", chats * 40),
            ("kld_mean", 0.0123),
            ("kld_mean_upper95", 0.0171),
            ("same_top_p", 0.9312),
        )
    }
    calibration = {
        "calibration_source": "calibration.jsonl",
        "calibration_ngram": 13,
        "calibration_overlap_share": 0.0667,
        "calibration_flag_share": 0.5,
        "calibration_flagged_chats": 2,
        "verdict_with_flagged": "pass",
        "verdict_without_flagged": "fail",
    }
    card = render_model_card(results_document(ppl=ppl_task(**splits, **calibration)))
    rows = [line for line in card.splitlines() if line.startswith(("| tag ", "| turn "))]
    assert rows == [
        "| tag `en` | 18 | 720 | 0.0123 | 0.0171 | 0.9312 |",
        "| tag `zh` | 12 | 480 | 0.0123 | 0.0171 | 0.9312 |",
        "| turn 1 | 30 | 1,200 | 0.0123 | 0.0171 | 0.9312 |",
    ], card
    assert "2 chats overlap it by more than 0.5 (verdict with them: pass, without them: fail)." in card
    assert "calibration" not in render_model_card(results_document(ppl=ppl_task())).lower()
