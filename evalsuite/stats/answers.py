"""What a long greedy answer is, read off its tokens, its text and its bytes: whether it ends in a loop, how
many of its bytes are not UTF-8, in which script it is written, and where a model's thought ends in it. Pure
functions on sequences and strings; no model, no tokenizer, no I/O.

- **A loop** (`loop_period`): the answer has at least `LOOP_WINDOW` (64) tokens and its last 64 are periodic
  with a period k ≤ `LOOP_MAX_PERIOD` (32): each of them after the first k equals the token k before it. The
  smallest such k is the loop's period. The rule is fixed here, not in a spec, so that no run loosens it: a
  shorter window or a longer period would call more answers loops.
- **Invalid UTF-8** (`invalid_utf8_sequences`): the maximal ill-formed subsequences of the answer's bytes
  (the Unicode Standard's "best practice for U+FFFD substitution", ch. 3.9, which Python's decoder follows):
  each is one U+FFFD a decoder writes. A sequence cut by the end of an answer that was itself cut (its token
  budget spent) is the budget's doing, not the model's, and is not counted there, nor is the U+FFFD a
  decoder writes for it (`replacement_characters`).
- **Script** (`script_share`): of the answer's letters (Unicode category L*), the share in the script of a
  language: Han ideographs for Chinese (CJK Unified and Compatibility Ideographs), Latin letters for English.
  Digits, punctuation, symbols and spaces are no language's, nor is code (`without_code`: fenced blocks and
  inline spans); an answer without letters has no share (NaN).
- **A thought** (`thought_end`): the part of an answer a model decoded between `<think>` and `</think>`
  (Qwen3's and MiniCPM-V's thinking mode), measured apart from the answer after it.
"""

from __future__ import annotations

import math
import re
import unicodedata
from bisect import bisect_left
from collections.abc import Sequence

LOOP_WINDOW = 64
LOOP_MAX_PERIOD = 32
THOUGHT_OPEN, THOUGHT_CLOSE = "<think>", "</think>"
# The script of each prompt language, by a word of its letters' Unicode names.
SCRIPTS = {"zh": ("CJK UNIFIED IDEOGRAPH", "CJK COMPATIBILITY IDEOGRAPH"), "en": ("LATIN ",)}


def loop_period(tokens: Sequence[int]) -> int | None:
    """The smallest period k ≤ `LOOP_MAX_PERIOD` of an answer's last `LOOP_WINDOW` tokens (token i equals
    token i − k for each of them after the first k), or None: fewer than `LOOP_WINDOW` tokens, or no such
    period."""
    if len(tokens) < LOOP_WINDOW:
        return None
    tail = list(tokens[-LOOP_WINDOW:])
    for k in range(1, LOOP_MAX_PERIOD + 1):
        if all(tail[i] == tail[i - k] for i in range(k, LOOP_WINDOW)):
            return k
    return None


def invalid_utf8_sequences(data: bytes, complete: bool = True) -> int:
    """The maximal ill-formed subsequences in `data` (module docstring). With `complete` False (the bytes
    were cut by a token budget), a sequence left unfinished at the very end is not counted."""
    count, start = 0, 0
    while start < len(data):
        try:
            data[start:].decode("utf-8")
            break
        except UnicodeDecodeError as exc:
            if not complete and start + exc.end == len(data) and exc.reason == "unexpected end of data":
                break
            count += 1
            start += exc.end
    return count


def replacement_characters(text: str, data: bytes | None = None, complete: bool = True) -> int:
    """How many U+FFFD (the replacement character a decoder writes for bytes it cannot read) a text holds;
    with `complete` False (a token budget cut the answer) and its bytes `data` known, not the last one where
    it stands for a character the cut left unfinished: the budget's doing, as in `invalid_utf8_sequences`."""
    count = text.count("\ufffd")
    if not complete and data is not None and text.endswith("\ufffd"):
        count -= invalid_utf8_sequences(data) - invalid_utf8_sequences(data, complete=False)
    return count


def script_share(text: str, language: str) -> float:
    """The share of `text`'s letters written in `language`'s script (`SCRIPTS`: "zh" Han, "en" Latin); NaN
    for a text without letters."""
    marks = SCRIPTS[language]
    letters = [ch for ch in text if unicodedata.category(ch).startswith("L")]
    if not letters:
        return math.nan
    return sum(unicodedata.name(ch, "").startswith(marks) for ch in letters) / len(letters)


def in_language(text: str, language: str, min_share: float) -> bool | None:
    """Whether `text` is written in `language`: at least `min_share` of its letters in that language's
    script; None for a text without letters (a bare number is in no language)."""
    share = script_share(text, language)
    return None if math.isnan(share) else share >= min_share


def thought_end(text: str, opened: bool) -> int:
    """Where an answer's thought ends in its text: just after its first `</think>`; with none, the whole
    answer where the thought was opened (by the prompt's template, `opened`, or by the answer's first
    characters) and never closed, else 0 (no thought)."""
    close = text.find(THOUGHT_CLOSE)
    if close >= 0:
        return close + len(THOUGHT_CLOSE)
    if opened or text.lstrip().startswith(THOUGHT_OPEN):
        return len(text)
    return 0


def tokens_through(char_ends: Sequence[int], cut: int) -> int:
    """How many of an answer's tokens it takes to reach character `cut` of its text (`char_ends[j]`: where
    token j's text ends): the tokens up to and including the first that ends at or past it; 0 for `cut` 0."""
    if cut <= 0:
        return 0
    return min(len(char_ends), bisect_left(char_ends, cut) + 1)


def without_code(text: str) -> str:
    """An answer's prose: its fenced code blocks (```…```, an unclosed one to the end) and inline code spans
    taken out, since code is written in Latin letters whatever language explains it."""
    text = re.sub(r"```.*?(?:```|\Z)", " ", text, flags=re.DOTALL)
    return re.sub(r"`[^`\n]*`", " ", text)
