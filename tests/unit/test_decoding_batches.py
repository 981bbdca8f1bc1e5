"""Decoding batches (`evalsuite.observers.greedy_answers.batches`): every prompt in exactly one batch of at
most the batch size, a prompt with an image alone; ordered by budget, a set's batches take fewer forwards (a
batch decodes until its largest budget is spent) than ordered by prompt length, on the shipped smoke set."""

from __future__ import annotations

import itertools
import tomllib
from pathlib import Path

from evalsuite.observers.greedy_answers import batches

SPEC = Path(__file__).resolve().parents[2] / "tasks" / "smoke.toml"


def shipped_prompts() -> list[dict]:
    """The shipped set's budgets, with its prompts' characters standing for their token ids."""
    prompts = tomllib.loads(SPEC.read_text(encoding="utf-8"))["prompts"]
    return [
        {"ids": list(str(p.get("prompt") or p.get("messages"))), "max_new_tokens": p["max_new_tokens"]}
        for p in prompts
    ]


def forwards(prompts: list[dict], plan: list[list[int]]) -> int:
    return sum(max(prompts[i]["max_new_tokens"] for i in members) for members in plan)


def test_every_prompt_lands_in_one_batch_and_an_image_alone() -> None:
    prompts = shipped_prompts()[:40]
    prompts[7]["extra"] = {"pixel_values": None}
    for by_budget in (False, True):
        plan = batches(prompts, 16, by_budget=by_budget)
        assert sorted(i for members in plan for i in members) == list(range(len(prompts)))
        assert all(len(members) <= 16 for members in plan)
        assert [7] in plan


def test_batches_of_like_budgets_take_fewer_forwards_on_the_shipped_set() -> None:
    prompts = shipped_prompts()
    by_length, by_budget = batches(prompts, 32), batches(prompts, 32, by_budget=True)
    assert forwards(prompts, by_budget) < forwards(prompts, by_length)
    budgets = [[prompts[i]["max_new_tokens"] for i in members] for members in by_budget]
    assert all(max(a) <= min(b) for a, b in itertools.pairwise(budgets))
