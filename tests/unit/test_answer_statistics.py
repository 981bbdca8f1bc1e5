"""The rules `longform` reads a long answer by (`evalsuite.stats.answers`), on cases written by hand: the
loop rule at its edges (64 tokens, period 32) and no looser, invalid UTF-8 counted as a decoder replaces it,
the language of an answer by the share of its letters in the prompt language's script, where a thought
ends."""

from __future__ import annotations

import math

import pytest

from evalsuite.stats import metrics
from evalsuite.stats.answers import (
    LOOP_MAX_PERIOD,
    LOOP_WINDOW,
    in_language,
    invalid_utf8_sequences,
    loop_period,
    replacement_characters,
    script_share,
    thought_end,
    tokens_through,
)


def cycle(pattern: list[int], length: int) -> list[int]:
    return [pattern[i % len(pattern)] for i in range(length)]


def test_the_loop_rule_is_64_tokens_periodic_with_a_period_of_at_most_32():
    assert (LOOP_WINDOW, LOOP_MAX_PERIOD) == (64, 32)
    # One token 64 times: period 1. 63 times: too short to be called a loop.
    assert loop_period([7] * 64) == 1
    assert loop_period([7] * 63) is None
    # "a b c" repeated: period 3, whatever came before the last 64 tokens.
    assert loop_period(list(range(100, 140)) + cycle([1, 2, 3], 64)) == 3
    # The smallest period is given: a b a b … is periodic with 2, 4, 6, …
    assert loop_period(cycle([1, 2], 80)) == 2
    # Period 32 exactly (two full turns of 32 distinct tokens) is a loop; period 33 is not.
    assert loop_period(list(range(32)) * 2) == 32
    assert loop_period(cycle(list(range(33)), 66)) is None


def test_one_token_out_of_step_in_the_last_64_breaks_the_loop():
    tokens = cycle([1, 2, 3, 4], 90)
    assert loop_period(tokens) == 4
    for where in (-1, -30, -64):  # the last token, one inside, the first of the 64
        broken = list(tokens)
        broken[where] = 99
        assert loop_period(broken) is None, where
    # A token out of step before the last 64 changes nothing.
    broken = list(tokens)
    broken[-65] = 99
    assert loop_period(broken) == 4


def test_invalid_utf8_is_counted_as_a_decoder_replaces_it():
    assert invalid_utf8_sequences("plain text, 中文".encode()) == 0
    # A lone continuation byte, a lone lead byte followed by ASCII: one replacement each.
    assert invalid_utf8_sequences(b"a\x80b") == 1
    assert invalid_utf8_sequences(b"a\xe4b") == 1
    # 中 is E4 B8 AD: its first two bytes then a space are one maximal ill-formed subsequence (one U+FFFD).
    assert invalid_utf8_sequences(b"\xe4\xb8 x") == 1
    assert b"\xe4\xb8 x".decode("utf-8", errors="replace").count("\ufffd") == 1
    # Two bad bytes in a row that cannot start a sequence together: two.
    assert invalid_utf8_sequences(b"\xff\xfe") == 2
    # A U+FFFD that the text itself holds (EF BF BD) is valid UTF-8.
    assert invalid_utf8_sequences("\ufffd".encode()) == 0


def test_a_character_cut_by_the_budget_is_not_the_models_fault():
    cut = "答案是".encode() + "中".encode()[:2]
    assert invalid_utf8_sequences(cut, complete=True) == 1  # an answer that ended itself there: invalid
    assert invalid_utf8_sequences(cut, complete=False) == 0  # its budget cut it: not counted
    # An ill-formed sequence before the cut is counted either way.
    assert invalid_utf8_sequences(b"\x80" + cut, complete=False) == 1


def test_replacement_characters_are_counted_in_the_text():
    assert replacement_characters("ok") == 0
    assert replacement_characters("a\ufffdb\ufffd") == 2
    # "苦" is E8 8B A6; a budget that cut it after two bytes leaves a decoder's U+FFFD at the end: not the
    # model's, unless the answer ended itself there. A U+FFFD before it (an invalid byte) still counts.
    cut = "苦苦".encode()[:5]
    assert replacement_characters(cut.decode(errors="replace"), cut, complete=False) == 0
    assert replacement_characters(cut.decode(errors="replace"), cut, complete=True) == 1
    assert replacement_characters(cut.decode(errors="replace"), None, complete=False) == 1  # bytes unknown
    bad = b"\x80" + cut
    assert replacement_characters(bad.decode(errors="replace"), bad, complete=False) == 1


def test_a_share_of_none_or_all_has_its_wilson_bound_exactly_at_0_or_1():
    # 0 of 5: centre = half = (z²/10)/(1 + z²/5) with z = 1.96, so the lower bound is 0 exactly; the upper
    # is 2·centre = 0.7683/1.7683 = 0.4345.
    share, low, high = metrics.proportion_interval(0, 5)
    assert (share, low) == (0.0, 0.0) and high == pytest.approx(0.4345, abs=1e-4)
    share, low, high = metrics.proportion_interval(5, 5)
    assert (share, high) == (1.0, 1.0) and low == pytest.approx(1 - 0.4345, abs=1e-4)


def test_the_language_of_an_answer_is_the_share_of_its_letters_in_the_prompts_script():
    # 5 Han characters (答案是, 单位) and 2 Latin letters; digits, spaces and punctuation are no language's.
    text = "答案是 42, 单位 cm。"
    assert script_share(text, "zh") == pytest.approx(5 / 7)
    assert script_share(text, "en") == pytest.approx(2 / 7)
    assert in_language(text, "zh", 0.5) is True
    assert in_language(text, "en", 0.5) is False
    # An English answer to a Chinese prompt is not in Chinese, and the other way round.
    assert in_language("The answer is 42.", "zh", 0.5) is False
    assert in_language("The answer is 42.", "en", 0.5) is True
    # Letters of another script are neither Chinese nor English.
    assert in_language("Ответ: сорок два", "en", 0.5) is False
    # No letters, no language: a bare number is not judged.
    assert math.isnan(script_share("= 42 ...", "zh"))
    assert in_language("= 42 ...", "zh", 0.5) is None
    # Exactly at the share: in the language (the bound is inclusive).
    assert in_language("中a", "zh", 0.5) is True


def test_a_thought_ends_after_its_first_close_and_an_unclosed_one_is_the_whole_answer():
    text = "<think>\nLet me count.\n</think>\n\nThe answer is 3."
    end = thought_end(text, opened=False)
    assert text[:end].endswith("</think>") and text[end:] == "\n\nThe answer is 3."
    # The template opened the thought: the answer starts inside it.
    assert thought_end("count.\n</think>\nThree.", opened=True) == len("count.\n</think>")
    # Never closed: all thought, whether the template or the answer opened it.
    assert thought_end("thinking on and on", opened=True) == len("thinking on and on")
    assert thought_end("<think>on and on", opened=False) == len("<think>on and on")
    # No thought at all.
    assert thought_end("Three.", opened=False) == 0


def test_the_tokens_of_a_thought_are_those_that_reach_its_end():
    # Tokens "<think>", "x", "</think>", "\n", "Hi" end at characters 7, 8, 16, 17, 19.
    ends = [7, 8, 16, 17, 19]
    assert tokens_through(ends, 16) == 3
    # A token that straddles the end belongs to the thought.
    assert tokens_through(ends, 15) == 3
    assert tokens_through(ends, 0) == 0
    assert tokens_through(ends, 19) == 5


def test_code_is_no_languages():
    from evalsuite.stats.answers import without_code

    answer = "下面是代码：\n```python\ndef add(a, b):\n    return a + b\n```\n函数 `add` 返回两数之和。"
    assert in_language(answer, "zh", 0.5) is False  # the code's Latin letters outnumber the Han
    prose = without_code(answer)
    assert "return" not in prose and "add" not in prose
    assert script_share(prose, "zh") == 1.0
    # An unclosed block (an answer cut by its budget) is code to the end.
    assert without_code("说明\n```python\nwhile True:\n    pass") == "说明\n "
