"""The smoke task's shipped prompt set (tasks/smoke.toml) read as data: its size and mix, its prompts' shape,
and expected answers that a non-answer or an echo of the question cannot satisfy. Read with tomllib, not
through the task, so that the data is checked on its own; every check is shown to fail on a copy of the set
changed to fail it."""

from __future__ import annotations

import copy
import re
import tomllib
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

SPEC = Path(__file__).resolve().parents[2] / "tasks" / "smoke.toml"
LICENSE_LINE = "written for evalsuite; Apache-2.0, the project's license"
CATEGORIES = {"factual", "code", "arithmetic", "chinese", "instruction", "mathematics", "chat"}
ROLES = {"system", "user", "assistant"}
# The prompts the set started with: recordings and tests name them, so they stay.
FIRST_IDS = {
    "capital-france",
    "capital-japan",
    "largest-planet",
    "python-add",
    "python-reverse",
    "multiply",
    "add-small",
    "capital-china-zh",
    "one-plus-one-zh",
    "primary-colours",
    "say-yes",
}
# "Reply with the single word yes" names its own answer and asks for one token; it predates this set's rules.
GRANDFATHERED = {"say-yes"}
NON_ANSWERS = [
    "",
    "I don't know.",
    "Sorry, I cannot help with that.",
    "As an AI language model, I cannot answer that question.",
    "The weather is nice today.",
    "我不知道。",
    "抱歉，我无法回答这个问题。",
]
MINIMA = {  # the issue's mix: (what, at least)
    "prompts": 120,
    "chinese prompts in Chinese": 30,
    "English factual and instruction prompts": 30,
    "mathematics prompts": 25,
    "code prompts": 20,
    "chats": 15,
    "chats in Chinese": 5,
    "chats with a system message": 3,
}

# The prompts the failing copies are changed at.
CHAT = "chat-name-memory"
ONE = "capital-italy"  # any single-turn prompt


def has_cjk(text: str) -> bool:
    return any(unicodedata.name(ch, "").startswith("CJK UNIFIED IDEOGRAPH") for ch in text)


def question(prompt: dict[str, Any]) -> str:
    """What the user asks last: an answer that only repeats it must not pass."""
    if "messages" in prompt:
        return prompt["messages"][-1]["content"]
    return prompt["prompt"]


def found(pattern: str, text: str) -> bool:
    # The smoke task's rule: a case-insensitive search.
    return re.search(pattern, text, flags=re.IGNORECASE) is not None


def counts(prompts: list[dict[str, Any]]) -> dict[str, int]:
    chats = [p for p in prompts if p.get("category") == "chat"]
    by = Counter((p.get("category"), p.get("language")) for p in prompts)
    return {
        "prompts": len(prompts),
        "chinese prompts in Chinese": by["chinese", "zh"],
        "English factual and instruction prompts": by["factual", "en"] + by["instruction", "en"],
        "mathematics prompts": sum(n for (c, _), n in by.items() if c == "mathematics"),
        "code prompts": sum(n for (c, _), n in by.items() if c == "code"),
        "chats": len(chats),
        "chats in Chinese": sum(p.get("language") == "zh" for p in chats),
        "chats with a system message": sum(
            any(m.get("role") == "system" for m in p.get("messages", [])) for p in chats
        ),
    }


def prompt_problems(p: dict[str, Any]) -> list[str]:
    pid = p.get("id", "?")
    out = []
    if ("prompt" in p) == ("messages" in p):
        return [f"{pid}: needs exactly one of prompt and messages"]
    if "messages" in p:
        messages = p["messages"]
        roles = [m.get("role") for m in messages]
        if not messages or roles[-1] != "user":
            out.append(f"{pid}: messages must end with a user turn")
        if set(roles) - ROLES:
            out.append(f"{pid}: unknown role in {roles}")
        if "system" in roles[1:]:
            out.append(f"{pid}: a system message comes first")
        if "assistant" not in roles:
            out.append(f"{pid}: a chat has an earlier assistant turn")
        if not all(isinstance(m.get("content"), str) and m["content"].strip() for m in messages):
            out.append(f"{pid}: every message needs content")
        if p.get("category") != "chat":
            out.append(f"{pid}: messages belong to the chat category")
        text = " ".join(m.get("content", "") for m in messages)
    else:
        text = p["prompt"]
        if p.get("category") == "chat":
            out.append(f"{pid}: a chat is given as messages")
    if p.get("category") not in CATEGORIES:
        out.append(f"{pid}: unknown category {p.get('category')!r}")
    language = p.get("language")
    if language not in {"en", "zh"}:
        out.append(f"{pid}: language must be en or zh, not {language!r}")
    elif has_cjk(text) != (language == "zh"):
        out.append(f"{pid}: language {language} does not fit the text")
    tokens = p.get("max_new_tokens")
    if pid not in GRANDFATHERED and not (isinstance(tokens, int) and 16 <= tokens <= 48):
        out.append(f"{pid}: max_new_tokens {tokens!r} outside 16..48")
    for field in ("expect", "reject"):
        if field in p:
            try:
                re.compile(p[field])
            except (re.error, TypeError) as exc:
                out.append(f"{pid}: {field} does not compile: {exc}")
                return out
    if "expect" not in p:
        return [*out, f"{pid}: no expect"]
    out += [f"{pid}: expect matches the non-answer {a!r}" for a in NON_ANSWERS if found(p["expect"], a)]
    if pid not in GRANDFATHERED and found(p["expect"], question(p)):
        out.append(f"{pid}: expect matches the question itself")
    if "reject" in p and found(p["reject"], question(p)):
        out.append(f"{pid}: reject matches the question, so an answer that repeats it fails")
    return out


def problems(text: str, document: dict[str, Any]) -> list[str]:
    """Everything wrong with a prompt set, one line each; empty when it is fit to ship."""
    prompts = document.get("prompts", [])
    out = [] if LICENSE_LINE in text.split("[[prompts]]")[0] else ["the license line is missing"]
    ids = [p.get("id") for p in prompts]
    out += [f"{i}: id used {n} times" for i, n in Counter(ids).items() if n > 1]
    out += [f"{i}: a first prompt is gone" for i in sorted(FIRST_IDS - set(ids))]
    have = counts(prompts)
    out += [f"{what}: {have[what]} < {least}" for what, least in MINIMA.items() if have[what] < least]
    long_enough = sum(p.get("max_new_tokens", 0) >= 32 for p in prompts)
    if long_enough * 3 < len(prompts) * 2:
        out.append(f"only {long_enough} of {len(prompts)} prompts run 32 tokens, where Divergence@32 is read")
    for p in prompts:
        out += prompt_problems(p)
    return out


def shipped() -> tuple[str, dict[str, Any]]:
    text = SPEC.read_text(encoding="utf-8")
    return text, tomllib.loads(text)


def test_shipped_prompt_set_has_no_problems():
    text, document = shipped()
    assert problems(text, document) == []


def test_shipped_prompt_set_keeps_its_tables_and_has_the_issues_mix():
    _, document = shipped()
    assert {"description", "generation", "thresholds", "regression", "prompts"} <= document.keys()
    have = counts(document["prompts"])
    assert all(have[what] >= least for what, least in MINIMA.items()), have


def by_id(document: dict[str, Any], pid: str) -> dict[str, Any]:
    return next(p for p in document["prompts"] if p["id"] == pid)


def drop(category: str, language: str | None = None):
    def change(doc: dict[str, Any]) -> None:
        doc["prompts"] = [
            p
            for p in doc["prompts"]
            if p["category"] != category or (language is not None and p["language"] != language)
        ]

    return change


def set_field(pid: str, **fields: Any):
    def change(doc: dict[str, Any]) -> None:
        by_id(doc, pid).update(fields)

    return change


def remove_field(pid: str, field: str):
    def change(doc: dict[str, Any]) -> None:
        del by_id(doc, pid)[field]

    return change


def duplicate_id(doc: dict[str, Any]) -> None:
    doc["prompts"].append(copy.deepcopy(by_id(doc, ONE)))


def drop_system_messages(doc: dict[str, Any]) -> None:
    for p in doc["prompts"]:
        if "messages" in p:
            p["messages"] = [m for m in p["messages"] if m["role"] != "system"]


def shorten_all(doc: dict[str, Any]) -> None:
    for p in doc["prompts"]:
        p["max_new_tokens"] = 16


CHANGES = {
    "duplicate id": (duplicate_id, f"{ONE}: id used 2 times"),
    "a first prompt removed": (drop("arithmetic"), "multiply: a first prompt is gone"),
    "both prompt and messages": (set_field(CHAT, prompt="Hi"), f"{CHAT}: needs exactly one"),
    "neither prompt nor messages": (remove_field(ONE, "prompt"), f"{ONE}: needs exactly one"),
    "ends with the assistant": (
        lambda d: by_id(d, CHAT)["messages"].append({"role": "assistant", "content": "Hi."}),
        f"{CHAT}: messages must end with a user turn",
    ),
    "unknown role": (
        lambda d: by_id(d, CHAT)["messages"][0].update(role="narrator"),
        f"{CHAT}: unknown role",
    ),
    "system message not first": (
        lambda d: by_id(d, CHAT)["messages"].insert(1, {"role": "system", "content": "Be brief."}),
        f"{CHAT}: a system message comes first",
    ),
    "single-turn chat": (
        lambda d: by_id(d, CHAT).update(messages=[{"role": "user", "content": "Hi"}]),
        f"{CHAT}: a chat has an earlier assistant turn",
    ),
    "empty message": (
        lambda d: by_id(d, CHAT)["messages"][0].update(content=" "),
        f"{CHAT}: every message needs content",
    ),
    "messages outside chat": (set_field(CHAT, category="factual"), f"{CHAT}: messages belong to the chat"),
    "chat given as a prompt": (set_field(ONE, category="chat"), f"{ONE}: a chat is given as"),
    "unknown category": (set_field(ONE, category="trivia"), f"{ONE}: unknown category"),
    "no language": (remove_field(ONE, "language"), f"{ONE}: language must be en or zh"),
    "wrong language": (set_field(ONE, language="zh"), f"{ONE}: language zh does not fit"),
    "too many tokens": (set_field(ONE, max_new_tokens=64), f"{ONE}: max_new_tokens 64"),
    "too few tokens": (set_field(ONE, max_new_tokens=8), f"{ONE}: max_new_tokens 8"),
    "expect does not compile": (set_field(ONE, expect="rom(e"), f"{ONE}: expect does not"),
    "reject does not compile": (set_field(ONE, reject="[a-"), f"{ONE}: reject does not"),
    "expect matches nothing at all": (set_field(ONE, expect="rome|"), "non-answer ''"),
    "expect matches a refusal": (set_field(ONE, expect="rome|sorry"), "non-answer 'Sorry"),
    "expect matches any word": (set_field(ONE, expect="rome|\\w+"), "non-answer \"I don't"),
    "expect matches the question": (
        set_field("multiply-9-8", expect="(?<![\\d.])8(?!\\.?\\d)"),
        "multiply-9-8: expect matches the question itself",
    ),
    "reject matches the question": (
        set_field("multiply-9-8", reject="(?<![\\d.])9(?!\\.?\\d)"),
        "multiply-9-8: reject matches the question",
    ),
    "no expect": (remove_field(ONE, "expect"), f"{ONE}: no expect"),
    "too few prompts": (lambda d: d.update(prompts=d["prompts"][:119]), "prompts: 119 < 120"),
    "too few Chinese": (drop("chinese", "zh"), "chinese prompts in Chinese: 0 < 30"),
    "too few English factual": (drop("factual"), "English factual and instruction prompts"),
    "too few mathematics": (drop("mathematics"), "mathematics prompts: 0 < 25"),
    "too few code": (drop("code"), "code prompts: 0 < 20"),
    "too few chats": (drop("chat"), "chats: 0 < 15"),
    "too few Chinese chats": (drop("chat", "zh"), "chats in Chinese: 0 < 5"),
    "too few system messages": (drop_system_messages, "chats with a system message: 0 < 3"),
    "answers too short for Divergence@32": (shorten_all, "prompts run 32 tokens"),
}


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_each_check_catches_a_set_changed_to_fail_it(change):
    text, document = shipped()
    mutate, expected = CHANGES[change]
    document = copy.deepcopy(document)
    mutate(document)
    found_problems = problems(text, document)
    assert any(expected in line for line in found_problems), found_problems


def test_a_set_without_its_license_line_is_caught():
    text, document = shipped()
    unlicensed = text.replace(LICENSE_LINE, "written somewhere")
    assert "the license line is missing" in problems(unlicensed, document)
