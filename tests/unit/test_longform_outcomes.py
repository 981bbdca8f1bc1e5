"""`longform`'s outcomes from answers built by hand (no model): how an answer stopped, whether it loops (and
the candidate that loops where the reference does not fails), right answers lost judged by McNemar only where
the sample can show it, the length ratio worked by hand, the language and UTF-8 of an answer, and a thinking
mode's thought measured apart from the answer after it (its loop failing the check of its own)."""

from __future__ import annotations

import math

import pytest

from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import load_spec
from evalsuite.observers.greedy_answers import answers_observation
from evalsuite.protocol.task import RunContext
from evalsuite.stats import claims
from evalsuite.tasks.longform import Longform, LongformSpec, modes_of

K = 2
EOS = 2
THRESHOLDS = (
    "[thresholds]\nckpt_loops_not_ref = { max = 0 }\nckpt_thought_loops_not_ref = { max = 0 }\n"
    "right_lost_shown = { max = 0 }\n"
)


class Template:
    """A tokenizer as far as `modes_of` reads it: its chat template's source."""

    def __init__(self, source: str) -> None:
        self.chat_template = source


def longform(tmp_path, prompts: list[tuple[str, str]], budget: int, thinking: bool = False) -> Longform:
    """The task on a spec of `prompts` (language, expect), prepared as a run would prepare it: one mode, or
    both for a template that takes `enable_thinking`; EOS the stop token; each token its own byte."""
    tables = "".join(
        f'\n[[prompts]]\nid = "p{i}"\ncategory = "explanation"\nlanguage = "{lang}"\nprompt = "q{i}"\n'
        f'expect = "{expect}"\n'
        for i, (lang, expect) in enumerate(prompts)
    )
    path = tmp_path / "longform.toml"
    path.write_text(f"[generation]\nmax_new_tokens = {budget}\n{THRESHOLDS}{tables}", encoding="utf-8")
    task = Longform(load_spec(LongformSpec, path), RunContext())
    task.modes = modes_of(Template("{% if enable_thinking %}<think>{% endif %}" if thinking else "{{ x }}"))
    task.stops = frozenset({EOS})
    task.bytes = {t: bytes([t]) for t in range(256)}
    task.opened = [False] * len(prompts) * len(task.modes)
    return task


def document(tokens: list[int], pieces: list[str] | None = None) -> dict:
    """An answer: its tokens, each token's text (by default a letter, EOS nothing) and where each ends."""
    pieces = pieces or [("" if t == EOS else chr(ord("a") + t % 26)) for t in tokens]
    assert len(pieces) == len(tokens)
    ends = [sum(len(p) for p in pieces[: j + 1]) for j in range(len(pieces))]
    return {
        "tokens": tokens,
        "text": "".join(pieces),
        "char_ends": ends,
        "top_text": [["x"] * K for _ in tokens],
        "top_ids": [[t, 0] for t in tokens],
        "top_logp": [[0.0, -9.0] for _ in tokens],
    }


def observed(ref: list[dict], ckpt: list[dict]) -> dict[str, Observation]:
    configuration = {"decoded": ["alone"], "batch": 1, "device": "cpu", "dtype": "bfloat16"}
    meta = {"configuration": configuration}
    return {
        "answers": answers_observation("longform-answers", ref, None, K, meta),
        "ckpt-answers": answers_observation("longform-answers", ckpt, None, K, meta),
    }


def looped(period: int, length: int = 70) -> list[int]:
    return [10 + i % period for i in range(length)]


def plain(length: int) -> list[int]:
    return [10 + i for i in range(length)]


def test_a_candidate_that_loops_where_the_reference_does_not_fails(tmp_path):
    task = longform(tmp_path, [("en", "x")] * 3, budget=70)
    # Prompt 0: the candidate loops (period 3), the reference does not; prompt 1: both loop; prompt 2: the
    # reference loops and the candidate stops early with EOS.
    ref = [document(plain(70)), document(looped(1)), document(looped(2))]
    ckpt = [document(looped(3)), document(looped(5)), document([11, 12, EOS])]
    result = task.compare(observed(ref, ckpt), tmp_path)
    m = result.metrics
    assert (m["loops_ref"], m["loops_ckpt"], m["ckpt_loops_not_ref"], m["ref_loops_not_ckpt"]) == (2, 2, 1, 1)
    assert m["loop_flips_p"] == 1.0
    assert [r["ckpt_loop_period"] for r in result.details] == [3, 5, None]
    assert [(r["ref_stop"], r["ckpt_stop"]) for r in result.details][2] == ("budget", "eos")
    check = next(c for c in result.checks if c.name == "ckpt_loops_not_ref")
    assert not check.passed and result.status == "fail"
    # The same answers with the sides' roles swapped: the candidate loops nowhere the reference does not.
    swapped = task.compare(observed(ckpt[:1] + ref[1:], ref[:1] + ckpt[1:]), tmp_path)
    assert next(c for c in swapped.checks if c.name == "ckpt_loops_not_ref").passed


def test_an_answer_is_cut_by_the_budget_unless_its_last_token_is_a_stop_token(tmp_path):
    task = longform(tmp_path, [("en", "x")] * 2, budget=4)
    ref = [document([11, 12, 13, EOS]), document([11, 12, 13, 14])]
    result = task.compare(observed(ref, ref), tmp_path)
    assert [r["ref_stop"] for r in result.details] == ["eos", "budget"]
    assert [r["ref_length"] for r in result.details] == [4, 4]
    assert result.metrics["budget_stops_ref"] == 1


def test_right_answers_lost_fail_only_where_mcnemar_can_show_it(tmp_path):
    # Six prompts the reference gets right ("a" in its answer) and the candidate wrong: p = 2 / 64 < 0.05.
    task = longform(tmp_path, [("en", "a")] * 6, budget=8)
    right, wrong = document([0, 1, EOS]), document([1, 1, EOS])
    result = task.compare(observed([right] * 6, [wrong] * 6), tmp_path)
    m = result.metrics
    assert (m["right_ref"], m["right_ckpt"], m["right_lost"], m["right_gained"]) == (6, 0, 6, 0)
    assert m["right_flips_p"] == 0.03125 and m["right_lost_shown"] is True
    assert not next(c for c in result.checks if c.name == "right_lost_shown").passed
    (difference,) = [d for d in task.paired_differences(m) if d.name == "longform right final answers"]
    assert difference.worse and difference.p == 0.03125
    # Five: no count of flips could reach 0.05, so the check is not made, and says why.
    result = task.compare(observed([right] * 5 + [wrong], [wrong] * 6), tmp_path)
    assert result.metrics["right_lost_shown"] is None
    assert "right_lost_shown" in result.not_measured
    assert "5 discordant prompt(s)" in result.null_reasons["right_lost_shown"]
    assert all(c.name != "right_lost_shown" for c in result.checks)


def test_the_length_ratio_is_a_paired_log_ratio_with_its_t_interval(tmp_path):
    task = longform(tmp_path, [("en", "x")] * 3, budget=50)
    # Lengths (stop token included) 10, 20, 40 against 20, 20, 20: ln 2, 0, −ln 2, mean 0, ratio 1; the
    # log-ratios' population variance 2 ln²2 / 3, stderr sqrt(var / 2) = ln 2 / sqrt(3).
    ref = [document([*plain(n - 1), EOS]) for n in (10, 20, 40)]
    ckpt = [document([*plain(19), EOS])] * 3
    m = task.compare(observed(ref, ckpt), tmp_path).metrics
    assert m["length_ratio"] == pytest.approx(1.0) and m["length_ratio_n"] == 3
    assert m["length_log_ratio_stderr"] == pytest.approx(math.log(2) / math.sqrt(3))
    half = claims.t_quantile(0.975, 2) * math.log(2) / math.sqrt(3)
    assert m["length_ratio_upper95"] == pytest.approx(math.exp(half))
    assert m["length_ratio_lower95"] == pytest.approx(math.exp(-half))
    assert m["length_mean_ref"] == pytest.approx(70 / 3) and m["length_mean_ckpt"] == 20


def test_language_and_invalid_utf8_are_read_per_answer(tmp_path):
    task = longform(tmp_path, [("zh", "x"), ("en", "x")], budget=8)
    # The Chinese prompt answered in Chinese by the reference, in English by the candidate; the English
    # prompt's candidate answer holds a lone continuation byte (0x80) and its text the U+FFFD it became.
    ref = [document([1, 2, 3, EOS], ["中文", "回", "答", ""]), document([65, 66, EOS], ["a", "b", ""])]
    ckpt = [document([1, 2, 3, EOS], ["eng", "li", "sh", ""]), document([65, 0x80, EOS], ["a", "\ufffd", ""])]
    result = task.compare(observed(ref, ckpt), tmp_path)
    m, rows = result.metrics, result.details
    assert (rows[0]["ref_in_language"], rows[0]["ckpt_in_language"]) == (True, False)
    assert (m["language_n"], m["language_lost"], m["off_language_ckpt"]) == (2, 1, 1)
    assert (rows[1]["ckpt_fffd"], rows[1]["ckpt_invalid_utf8"], rows[1]["ref_invalid_utf8"]) == (1, 1, 0)
    assert (m["invalid_text_ref"], m["invalid_text_ckpt"]) == (0, 1)


def test_a_thinking_template_is_asked_both_ways_and_the_thought_measured_apart(tmp_path):
    task = longform(tmp_path, [("en", "yes")], budget=80, thinking=True)
    assert [m.name for m in task.modes] == ["answer", "thinking"]
    # Without thinking, both answer "yes". Thinking: the reference thinks 6 tokens and answers "yes"; the
    # candidate's thought loops (period 2) for 79 tokens and is never closed.
    answer = document([1, 2, 3, EOS], ["y", "e", "s", ""])
    thought = ["<think>", "x", "x", "x", "x", "</think>", "\n", "yes", ""]
    ref_thought = document([5, 1, 1, 1, 1, 6, 7, 8, EOS], thought)
    ckpt_thought = document([5, *looped(2, 79)], ["<think>"] + ["ab"[i % 2] for i in range(79)])
    result = task.compare(observed([answer, ref_thought], [answer, ckpt_thought]), tmp_path)
    m = result.metrics
    assert m["thinking_modes"].startswith("both")
    assert [r["mode"] for r in result.details] == ["answer", "thinking"]
    assert m["ckpt_thought_loops_not_ref"] is None  # no thought asked without thinking
    assert "enable_thinking false" in result.null_reasons["ckpt_thought_loops_not_ref"]
    row = result.details[1]
    assert (row["ref_thought_tokens"], row["ref_thought_loop"], row["ref_right"]) == (6, False, True)
    assert (row["ckpt_thought_loop"], row["ckpt_thought_unclosed"], row["ckpt_right"]) == (True, True, False)
    # The loop is in the thought, not in an answer after it: the answer has no tokens to loop in.
    assert row["ckpt_loop"] is False and m["thinking_ckpt_thought_loops_not_ref"] == 1
    failed = {c.name for c in result.checks if not c.passed}
    assert failed == {"thinking_ckpt_thought_loops_not_ref"}
    assert m["thinking_thought_tokens_mean_ckpt"] == 80 and m["thinking_thought_unclosed_ckpt"] == 1


def test_report_and_card_give_each_outcome_with_its_sample_and_interval_and_name_the_looping_prompt(tmp_path):
    from evalsuite.reporting.diff_report import render_markdown
    from evalsuite.reporting.model_card import render_model_card
    from tests.documents import results_document
    from tests.unit.test_model_card import numbers_not_in

    task = longform(tmp_path, [("en", "x")] * 3, budget=70)
    ref = [document(plain(70)), document(looped(1)), document(looped(2))]
    ckpt = [document(looped(3)), document(looped(5)), document([11, 12, EOS])]
    result = task.compare(observed(ref, ckpt), tmp_path)
    result.descriptions = dict(Longform.metric_descriptions)
    entry = result.to_json()
    entry["differences"] = [d.to_json() for d in task.paired_differences(result.metrics)]
    results = results_document(longform=entry)
    card, report = render_model_card(results), render_markdown(results)
    # Each side's count of the 3 prompts with the 95% Wilson interval of its share (2 of 3: [0.21, 0.94]).
    row = next(line for line in card.splitlines() if line.startswith("| answers ending in a loop"))
    assert "| 2 of 3 [0.21, 0.94] | 2 of 3 [0.21, 0.94] | 1 | 1 | 1 |" in row
    assert "ratio" in card and "paired log-ratio over 3 prompts" in card
    # Only p0's reference answer holds the expected "x" (token 23): one discordant prompt, too few.
    assert (
        "right answers lost more often than gained (exact McNemar, p < 0.05): undetermined: 1 discordant"
        in card
    )
    assert numbers_not_in(results, card) == []
    for text in (card.lower(), report.lower()):
        assert "longform prompt `p0`: the candidate's answer loops, the reference's does not" in text
        assert "`p1`: the candidate's" not in text  # both loop there
        assert "longform prompt `p0`: the reference's final answer is right, the candidate's is not" in text
    assert "## longform: fail" in report and "| ckpt_loops_not_ref | 1 |" in report
