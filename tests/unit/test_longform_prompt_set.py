"""The `longform` task's shipped prompt set (tasks/longform.toml) read as data: its size and mix (multi-step
mathematics with a final number, code with a function to check, explanations in Chinese and English, prompts
that invite repetition), its license, its `[[prompts]]` tables last, and expected answers that a non-answer or
an echo of the question cannot satisfy; every check is shown to fail on a copy of the set changed to fail it.
A bad spec is refused before any model loads: exit 2, one line naming the file and the line."""

from __future__ import annotations

import copy
import re
import tomllib
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from evalsuite.contract.spec import load_spec
from evalsuite.errors import InputError
from evalsuite.tasks.longform import LongformSpec
from tests.conftest import assert_refused, cli_in_process
from tests.unit.test_smoke_prompt_set import by_id, drop, set_field

SPEC = Path(__file__).resolve().parents[2] / "tasks" / "longform.toml"
LICENSE_LINE = "written for evalsuite; Apache-2.0, the project's license"
NON_ANSWERS = ["", "I don't know.", "Sorry, I cannot help with that.", "我不知道。", "1 2 3", "hello"]
MINIMA = {  # the mix: (what, at least)
    "prompts": 60,
    "mathematics with a final number": 12,
    "mathematics in Chinese": 4,
    "code with a named function or class": 10,
    "explanations in English": 6,
    "explanations in Chinese": 6,
    "repetition": 12,
    "repetition in Chinese": 4,
}


def has_cjk(text: str) -> bool:
    return any(unicodedata.name(ch, "").startswith("CJK UNIFIED IDEOGRAPH") for ch in text)


def found(pattern: str, text: str) -> bool:
    return re.search(pattern, text, flags=re.IGNORECASE) is not None  # the task's rule (smoke's)


def counts(prompts: list[dict[str, Any]]) -> dict[str, int]:
    by = Counter((p.get("category"), p.get("language")) for p in prompts)
    maths = [p for p in prompts if p.get("category") == "mathematics"]
    code = [p for p in prompts if p.get("category") == "code"]
    return {
        "prompts": len(prompts),
        "mathematics with a final number": sum(bool(re.search(r"\d", p.get("expect", ""))) for p in maths),
        "mathematics in Chinese": by["mathematics", "zh"],
        "code with a named function or class": sum(
            bool(re.search(r"def|function|class", p.get("expect", ""))) for p in code
        ),
        "explanations in English": by["explanation", "en"],
        "explanations in Chinese": by["explanation", "zh"],
        "repetition": by["repetition", "en"] + by["repetition", "zh"],
        "repetition in Chinese": by["repetition", "zh"],
    }


def prompt_problems(p: dict[str, Any]) -> list[str]:
    pid = p.get("id", "?")
    out = []
    if not isinstance(p.get("prompt"), str) or not p["prompt"].strip():
        return [f"{pid}: a long answer is asked by one `prompt`"]
    if has_cjk(p["prompt"]) != (p.get("language") == "zh"):
        out.append(f"{pid}: language {p.get('language')} does not fit the text")
    if "max_new_tokens" in p and p["max_new_tokens"] < 256:
        out.append(f"{pid}: a budget of {p['max_new_tokens']} leaves no room for a long answer")
    try:
        re.compile(p.get("expect", ""))
    except re.error as exc:
        return [*out, f"{pid}: expect does not compile: {exc}"]
    if not p.get("expect"):
        return [*out, f"{pid}: no expect"]
    out += [f"{pid}: expect matches the non-answer {a!r}" for a in NON_ANSWERS if found(p["expect"], a)]
    if found(p["expect"], p["prompt"]):
        out.append(f"{pid}: expect matches the question itself")
    return out


def problems(text: str, document: dict[str, Any]) -> list[str]:
    """Everything wrong with a prompt set, one line each; empty when it is fit to ship."""
    prompts = document.get("prompts", [])
    head, _, tail = text.partition("[[prompts]]")
    out = [] if LICENSE_LINE in head else ["the license line is missing"]
    if re.search(r"^\s*\[(?!\[prompts\]\])", tail, flags=re.MULTILINE):
        out.append("a table follows the [[prompts]] tables: they must come last")
    out += [f"{i}: id used {n} times" for i, n in Counter(p.get("id") for p in prompts).items() if n > 1]
    have = counts(prompts)
    out += [f"{what}: {have[what]} < {least}" for what, least in MINIMA.items() if have[what] < least]
    for p in prompts:
        out += prompt_problems(p)
    return out


def shipped() -> tuple[str, dict[str, Any]]:
    text = SPEC.read_text(encoding="utf-8")
    return text, tomllib.loads(text)


def test_the_shipped_prompt_set_has_no_problems_and_the_task_reads_it():
    text, document = shipped()
    assert problems(text, document) == []
    spec = load_spec(LongformSpec, SPEC)
    assert len(spec.prompts) >= 60 and spec.generation.max_new_tokens == 512
    assert {"ckpt_loops_not_ref", "ckpt_thought_loops_not_ref", "right_lost_shown"} <= spec.thresholds.keys()


MATHS, CODE, REPEAT = "leaking-tank", "python-gcd", "count-to-forty"
CHANGES = {
    "duplicate id": (
        lambda d: d["prompts"].append(copy.deepcopy(by_id(d, MATHS))),
        f"{MATHS}: id used 2 times",
    ),
    "too few prompts": (lambda d: d.update(prompts=d["prompts"][:59]), "prompts: 59 < 60"),
    "no Chinese mathematics": (drop("mathematics", "zh"), "mathematics in Chinese: 0 < 4"),
    "no explanations in Chinese": (drop("explanation", "zh"), "explanations in Chinese: 0 < 6"),
    "no repetition": (drop("repetition"), "repetition: 0 < 12"),
    "code without a function": (
        lambda d: [p.update(expect="return") for p in d["prompts"] if p["category"] == "code"],
        "code with a named function or class: 0 < 10",
    ),
    "wrong language": (set_field(MATHS, language="zh"), f"{MATHS}: language zh does not fit"),
    "short budget": (set_field(MATHS, max_new_tokens=64), f"{MATHS}: a budget of 64"),
    "bad regex": (set_field(MATHS, expect="4(8"), f"{MATHS}: expect does not compile"),
    "matches a non-answer": (set_field(MATHS, expect="\\d"), f"{MATHS}: expect matches the non-answer"),
    "matches the question": (set_field(REPEAT, expect="\\b40\\b"), f"{REPEAT}: expect matches the question"),
    "a chat instead of a prompt": (
        lambda d: by_id(d, CODE).pop("prompt"),
        f"{CODE}: a long answer is asked by one `prompt`",
    ),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_each_check_fails_on_a_set_changed_to_fail_it(change):
    edit, expected = CHANGES[change]
    text, document = shipped()
    document = copy.deepcopy(document)
    edit(document)
    assert any(expected in line for line in problems(text, document)), (expected, problems(text, document))


def test_a_missing_license_or_a_table_after_the_prompts_is_caught():
    text, document = shipped()
    assert "the license line is missing" in problems(
        text.replace(LICENSE_LINE, "written somewhere"), document
    )
    after = text + "\n[generation]\nbatch = 4\n"
    assert "a table follows the [[prompts]] tables: they must come last" in problems(after, document)


def line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_a_bad_spec_is_refused_before_any_model_loads_naming_the_file_and_the_line(tiny_pair, tmp_path):
    text = SPEC.read_text(encoding="utf-8")
    bad = text.replace('category = "code"', 'category = "poetry"', 1)
    spec = tmp_path / "longform.toml"
    spec.write_text(bad, encoding="utf-8")
    with pytest.raises(InputError):
        load_spec(LongformSpec, spec)
    ref = tiny_pair["tiny-minicpmv47-bf16"]
    args = ("run", "--ckpt", ref, "--ref", ref, "--tasks", "longform", "--spec", f"longform={spec}")
    code, errors, _ = cli_in_process(*args, "--out", tmp_path / "out", "--quiet")
    assert_refused(code, errors, str(spec), f"(line {line_of(bad, 'poetry')})", "category")
    assert not any(line.startswith("loading") for line in errors)
