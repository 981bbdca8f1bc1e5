"""Greedy smoke prompts with expected answers, compared side by side, with the first divergence explained."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import field_validator, model_validator

from evalsuite import metrics
from evalsuite.errors import InputError
from evalsuite.observation import Observation
from evalsuite.run_folder import write_atomic
from evalsuite.side import Side
from evalsuite.spec import StrictModel, TaskSpec
from evalsuite.task import Inputs, Need, Progress, RunContext, TaskResult, skip_if_cannot_generate, task

if TYPE_CHECKING:
    from evalsuite.backends import Backend

DIVERGENCE_MARK = "⟦"  # where the two answers part, inside each answer in report.md
Category = Literal["factual", "code", "arithmetic", "chinese", "instruction", "mathematics", "chat"]


class Message(StrictModel):
    role: Literal["system", "user", "assistant"]
    content: str


class Prompt(StrictModel):
    id: str
    category: Category
    language: Literal["en", "zh"] = "en"
    # One user turn (`prompt`), or a whole chat (`messages`, ending with the user's turn): either way through
    # the side's chat template, with its generation prompt.
    prompt: str | None = None
    messages: list[Message] | None = None
    max_new_tokens: int
    expect: str
    # An answer that also matches `reject` fails: "Jupiter, but it's actually Saturn" names the expected
    # word and still answers wrongly.
    reject: str | None = None

    @field_validator("expect", "reject")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from None
        return value

    @field_validator("max_new_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if not 1 <= value <= 4096:
            raise ValueError("must be between 1 and 4096")
        return value

    @model_validator(mode="after")
    def _one_form(self) -> Prompt:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` (one user turn) and `messages` (a chat)")
        if self.messages is not None and (not self.messages or self.messages[-1].role != "user"):
            raise ValueError("`messages` must end with the user's turn")
        return self

    def chat(self) -> list[dict[str, str]]:
        """The prompt as chat messages."""
        if self.messages is not None:
            return [m.model_dump() for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]

    def matches(self, answer: str) -> bool:
        """The answer holds the expected answer and nothing the prompt rejects (case-insensitive)."""
        if self.reject is not None and re.search(self.reject, answer, flags=re.IGNORECASE):
            return False
        return re.search(self.expect, answer, flags=re.IGNORECASE) is not None


class GenerationOptions(StrictModel):
    top_k: int = 5
    near_tie: float = 1.0


class SmokeSpec(TaskSpec):
    generation: GenerationOptions = GenerationOptions()
    prompts: list[Prompt]

    def model_post_init(self, _: Any) -> None:
        ids = [p.id for p in self.prompts]
        if len(set(ids)) != len(ids):
            raise ValueError(f"prompt ids must be unique: {sorted({i for i in ids if ids.count(i) > 1})}")


def prompt_ids(side: Side, prompt: Prompt) -> list[int]:
    """The prompt through the side's chat template (generation prompt on), or, without a template, its turns'
    text one after the other."""
    tokenizer = side.tokenizer
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(prompt.chat(), add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer("\n".join(m["content"] for m in prompt.chat()))["input_ids"])


def ids_sha256(prompts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()


class SmokeGenerations:
    """Observer: each prompt's greedy answer (tokens, text, and the top-k log-probs of every step). Each
    prompt is saved as it completes, so an interrupted observation resumes at the next prompt."""

    name = "smoke-generations"

    def __init__(self, spec: SmokeSpec) -> None:
        self.spec = spec

    def identity(self) -> dict[str, Any]:
        # The expected answers are compare-only: changing a regex never re-runs a model.
        prompts = [
            p.model_dump(
                mode="json", include={"id", "prompt", "messages", "max_new_tokens"}, exclude_none=True
            )
            for p in self.spec.prompts
        ]
        return {"top_k": self.spec.generation.top_k, "prompts": prompts}

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        k = self.spec.generation.top_k
        step = progress("smoke prompts", len(self.spec.prompts))
        answers = []
        for i, (prompt, ids) in enumerate(zip(self.spec.prompts, inputs["prompt_ids"], strict=True)):
            saved = folder / f"prompt-{i:04d}.json"
            if not saved.is_file():
                batch = {
                    "input_ids": torch.tensor([ids]),
                    "attention_mask": torch.ones((1, len(ids)), dtype=torch.long),
                }
                gen = backend.generate_greedy(batch, prompt.max_new_tokens, top_k=k)
                write_atomic(saved, json.dumps(self._answer(backend.tokenizer, gen)))
            answers.append(json.loads(saved.read_text(encoding="utf-8")))
            step()
        tokens = [t for a in answers for t in a["tokens"]]
        offsets = np.cumsum([0] + [len(a["tokens"]) for a in answers])
        return Observation(
            name=self.name,
            meta={
                "texts": [a["text"] for a in answers],
                "top_text": [a["top_text"] for a in answers],
                "char_ends": [a["char_ends"] for a in answers],
                "prompts_sha256": inputs["prompts_sha256"],
                "execution": backend.describe(),
            },
            arrays={
                "tokens": np.asarray(tokens, dtype=np.int64),
                "offsets": offsets.astype(np.int64),
                "top_ids": np.asarray([r for a in answers for r in a["top_ids"]], dtype=np.int64).reshape(
                    -1, k
                ),
                "top_logp": np.asarray([r for a in answers for r in a["top_logp"]], dtype=np.float32).reshape(
                    -1, k
                ),
            },
        )

    @staticmethod
    def _answer(tokenizer: Any, gen: Any) -> dict[str, Any]:
        return {
            "tokens": list(gen.tokens),
            "text": tokenizer.decode(gen.tokens, skip_special_tokens=True),
            # Where each token ends in the text, so the report can mark the divergence inside the answer.
            "char_ends": [
                len(tokenizer.decode(gen.tokens[: j + 1], skip_special_tokens=True))
                for j in range(len(gen.tokens))
            ],
            # The top-k as text, so a report can say which words the reference hesitated between.
            "top_text": [[tokenizer.decode([t]) for t in row] for row in gen.top_ids.tolist()],
            "top_ids": gen.top_ids.tolist(),
            # float32 → Python float → JSON → float32 is exact.
            "top_logp": [[float(v) for v in row] for row in gen.top_logp],
        }

    def record(self, obs: Observation, folder: Path) -> Observation:
        """A smoke observation is already compact: it is its own recording."""
        return Observation(name=obs.name, key=obs.key, meta=obs.meta, arrays=obs.arrays)


@task("smoke")
class Smoke:
    """Greedy answers of both sides to the spec's prompts: pass/fail per side and where they diverge."""

    spec_model: ClassVar[type[TaskSpec]] = SmokeSpec
    metric_names: ClassVar[tuple[str, ...]] = (
        "n_prompts",
        "ref_pass",
        "ckpt_pass",
        "identical",
        "diverged_outside_top5",
        "ref_pass_ckpt_fail",
    )

    metric_descriptions: ClassVar[dict[str, str]] = {
        "n_prompts": "greedy prompts answered by both sides",
        "ref_pass": "prompts whose reference answer matches the expected answer",
        "ckpt_pass": "prompts whose candidate answer matches the expected answer",
        "identical": "prompts answered token for token the same",
        "diverged_outside_top5": "answers parting on a token outside the reference's top-5 (real divergence)",
        "ref_pass_ckpt_fail": "prompts the reference gets right and the candidate gets wrong",
    }

    def __init__(self, spec: SmokeSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """Prompt ids made once (with the reference tokenizer), hashed; the candidate must agree."""
        skip_if_cannot_generate(ref, ckpt, "smoke")
        source = ckpt if ref.is_recorded else ref
        ids = [prompt_ids(source, p) for p in self.spec.prompts]
        if not ref.is_recorded and ref.checkpoint.tokenizer_sha256 != ckpt.checkpoint.tokenizer_sha256:
            other = [prompt_ids(ckpt, p) for p in self.spec.prompts]
            for prompt, a, b in zip(self.spec.prompts, ids, other, strict=True):
                if a != b:
                    raise InputError(
                        f"its tokenizer or chat template disagrees with the reference's on prompt "
                        f"{prompt.id!r}; the sides cannot be compared",
                        ckpt.checkpoint.path,
                    )
        return {"prompt_ids": ids, "prompts_sha256": ids_sha256(ids), "n_prompts": len(ids)}

    def needs(self) -> list[Need]:
        observer = SmokeGenerations(self.spec)
        return [Need("ref", "ref", observer), Need("ckpt", "ckpt", observer)]

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        ref, ckpt = observed["ref"], observed["ckpt"]
        if ref.meta["prompts_sha256"] != ckpt.meta["prompts_sha256"]:
            raise InputError("the sides were given different prompt tokens")
        rows, n = [], len(self.spec.prompts)
        counts = {
            "ref_pass": 0,
            "ckpt_pass": 0,
            "identical": 0,
            "diverged_outside_top5": 0,
            "ref_pass_ckpt_fail": 0,
        }
        for i, prompt in enumerate(self.spec.prompts):
            row = self.compare_prompt(i, prompt, ref, ckpt)
            counts["ref_pass"] += row["ref_pass"]
            counts["ckpt_pass"] += row["ckpt_pass"]
            counts["identical"] += row["identical"]
            counts["diverged_outside_top5"] += row["ckpt_token_in_ref_top5"] is False
            counts["ref_pass_ckpt_fail"] += row["ref_pass"] and not row["ckpt_pass"]
            rows.append(row)
        values: dict[str, Any] = {"n_prompts": n, **counts}
        checks, _ = self.spec.threshold_checks(values)
        return TaskResult.from_checks(values, checks, details=rows)

    def compare_prompt(self, i: int, prompt: Prompt, ref: Observation, ckpt: Observation) -> dict[str, Any]:
        """One prompt: both answers, pass/fail, and the reference's view at the first differing token."""

        def span(obs: Observation) -> slice:
            return slice(int(obs.arrays["offsets"][i]), int(obs.arrays["offsets"][i + 1]))

        a, b = ref.arrays["tokens"][span(ref)], ckpt.arrays["tokens"][span(ckpt)]
        ref_text, ckpt_text = ref.meta["texts"][i], ckpt.meta["texts"][i]
        d = metrics.first_divergence(a, b)
        row: dict[str, Any] = {
            "id": prompt.id,
            "category": prompt.category,
            "ref_answer": ref_text,
            "ckpt_answer": ckpt_text,
            "ref_pass": prompt.matches(ref_text),
            "ckpt_pass": prompt.matches(ckpt_text),
            "identical": d is None,
            "first_diff_token": d,
            "ckpt_token_in_ref_top5": None,
            "ref_logp_gap": None,
            "divergence": "",
        }
        if d is None or d >= min(len(a), len(b)):
            return row
        for side, obs, text in (("ref_answer", ref, ref_text), ("ckpt_answer", ckpt, ckpt_text)):
            cut = obs.meta["char_ends"][i][d - 1] if d > 0 else 0
            row[side] = f"{text[:cut]}{DIVERGENCE_MARK}{text[cut:]}"
        step = span(ref).start + d
        top_ids, top_logp = ref.arrays["top_ids"][step], ref.arrays["top_logp"][step]
        chosen = int(b[d])
        inside = bool(chosen in top_ids)
        # The reference's preference for its own token over the candidate's: small is a near tie, large an
        # error. Outside the top-k only a lower bound is known (the gap to the k-th token).
        gap = float(top_logp[0] - (top_logp[list(top_ids).index(chosen)] if inside else top_logp[-1]))
        near = inside and gap < self.spec.generation.near_tie
        row.update(
            ckpt_token_in_ref_top5=inside,
            ref_logp_gap=gap if inside else f">= {gap:.4g}",
            divergence=("near tie" if near else "real divergence") + f" at token {d}",
            ref_top5=", ".join(
                f"{text!r} {float(lp):.3g}"
                for text, lp in zip(ref.meta["top_text"][i][d], top_logp, strict=True)
            ),
            # The tokens each side chose, as text (from where each token ends in its answer): greedy
            # decoding's argmax, not the top-k list, whose order among tied logits is not the argmax's.
            ref_token=repr(_token_text(ref, i, d, ref_text)),
            ckpt_token=repr(_token_text(ckpt, i, d, ckpt_text)),
        )
        return row


def _token_text(obs: Observation, prompt: int, step: int, text: str) -> str:
    """The text of the token an answer chose at `step`."""
    ends = obs.meta["char_ends"][prompt]
    start = ends[step - 1] if step > 0 else 0
    return text[start : ends[step]]
