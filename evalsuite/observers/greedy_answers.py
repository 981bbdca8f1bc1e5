"""Greedy answers of one side to a list of prompts, decoded in batches (`evalsuite.backends.greedy`).

A prompt is its token ids (through the side's chat template, made once by the task) and, for a question about
an image, the rest of the model's inputs. Prompts of token ids alone are decoded together, `batch` at a time,
in order of length (the least padding); a prompt with an image alone. Each batch is saved as it completes, so
an interrupted observation resumes at the next batch: the batches are fixed by the prompts and `batch`, so a
resumed observation decodes the batches an uninterrupted one decodes, with the same bits.

What an answer keeps: its tokens, its text (and where each token ends in it, so that a report can mark a
token inside the answer), per step the top-k ids and log-probs as the decoding saw them, and the full
log-prob rows of its first `full_steps` steps.

`Continuations` (`evalsuite.observers.forced_answers`) decodes a candidate's own answer where it parts from
the reference's: from the prompt, the reference's answer up to the divergence and the candidate's token there.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from evalsuite.observation import Observation
from evalsuite.run_folder import atomic_target, write_atomic
from evalsuite.task import Inputs, Progress

if TYPE_CHECKING:
    from evalsuite.backends import Backend

# What a task hands the observers in its inputs: per prompt {"ids": [...], "extra": {name: tensor} | None,
# "max_new_tokens": n}.
PROMPTS = "prompts"
# The labels under which observations of answers consume those they are made from (`Need.consumes`).
ANSWERS_LABEL = "answers"
# What a task says of its prompts that an observation of answers keeps in its meta (its recording with it).
ANSWERS_META = "answers_meta"


def model_inputs(
    ids: Sequence[int], extra: dict[str, Any] | None, prompt_length: int | None = None
) -> dict[str, Any]:
    """A prompt's token ids (and other inputs: its images) as the model takes one sequence. Where `ids`
    continue a prompt of `prompt_length` tokens (an answer after it), the processor's per-token inputs of the
    prompt (a (1, prompt_length) tensor: which tokens are an image's) go on as text."""
    tensor = torch.tensor([list(ids)], dtype=torch.long)
    out = {"input_ids": tensor, "attention_mask": torch.ones_like(tensor)}
    for name, value in (extra or {}).items():
        if (
            prompt_length is not None
            and isinstance(value, torch.Tensor)
            and value.dim() == 2
            and tuple(value.shape) == (1, prompt_length)
            and len(ids) > prompt_length
        ):
            value = torch.cat([value, value.new_zeros((1, len(ids) - prompt_length))], dim=1)
        out[name] = value
    return out


def batches(prompts: Sequence[dict[str, Any]], size: int, by_budget: bool = False) -> list[list[int]]:
    """The prompts' indices in decoding batches: prompts of token ids alone by length (then index), `size`
    at a time; a prompt with other inputs alone, where it stands. `by_budget` orders them by the tokens
    they may decode first: a batch decodes until its largest budget is spent (unless every prompt stops
    early), so prompts of like budgets together take fewer forwards."""

    def order(i: int) -> tuple[int, ...]:
        length = len(prompts[i]["ids"])
        return (int(prompts[i]["max_new_tokens"]), length, i) if by_budget else (length, i)

    text = sorted((i for i, p in enumerate(prompts) if not p.get("extra")), key=order)
    out = [text[i : i + max(size, 1)] for i in range(0, len(text), max(size, 1))]
    out += [[i] for i, p in enumerate(prompts) if p.get("extra")]
    return out


def generate_batch(
    backend: Backend, prompts: Sequence[dict[str, Any]], top_k: int, full_steps: int
) -> list[Any]:
    """Greedy answers of `prompts` as one batch, or one at a time on a backend that decodes no batches."""
    inputs = [model_inputs(p["ids"], p.get("extra"), p.get("prompt_length")) for p in prompts]
    limits = [int(p["max_new_tokens"]) for p in prompts]
    batched = getattr(backend, "generate_greedy_batch", None)
    if callable(batched):
        return batched(inputs, limits, top_k, full_steps)
    return [
        backend.generate_greedy(x, n, top_k=top_k, full_steps=full_steps)
        for x, n in zip(inputs, limits, strict=True)
    ]


def answer_document(
    tokenizer: Any, tokens: list[int], top_ids: np.ndarray, top_logp: np.ndarray
) -> dict[str, Any]:
    """What an answer keeps, as JSON: tokens, text, where each token ends in the text, per step the top-k ids,
    log-probs and texts."""
    return {
        "tokens": list(tokens),
        "text": tokenizer.decode(tokens, skip_special_tokens=True),
        "char_ends": [
            len(tokenizer.decode(tokens[: j + 1], skip_special_tokens=True)) for j in range(len(tokens))
        ],
        "top_text": [[tokenizer.decode([t]) for t in row] for row in np.asarray(top_ids).tolist()],
        "top_ids": np.asarray(top_ids).tolist(),
        # float32 → Python float → JSON → float32 is exact.
        "top_logp": [[float(v) for v in row] for row in np.asarray(top_logp, dtype=np.float32)],
    }


def answers_observation(
    name: str,
    documents: list[dict[str, Any]],
    full: list[np.ndarray] | None,
    top_k: int,
    meta: dict[str, Any],
) -> Observation:
    """The observation of answers in prompt order (`answer_document`s, and their full rows if kept)."""
    tokens = [t for d in documents for t in d["tokens"]]
    offsets = np.cumsum([0] + [len(d["tokens"]) for d in documents]).astype(np.int64)
    arrays = {
        "tokens": np.asarray(tokens, dtype=np.int64),
        "offsets": offsets,
        "top_ids": np.asarray([r for d in documents for r in d["top_ids"]], dtype=np.int64).reshape(
            -1, top_k
        ),
        "top_logp": np.asarray([r for d in documents for r in d["top_logp"]], dtype=np.float32).reshape(
            -1, top_k
        ),
    }
    if full is not None:
        arrays["full_logp"] = np.concatenate(full) if full else np.zeros((0, 0), np.float32)
        arrays["full_offsets"] = np.cumsum([0] + [len(f) for f in full]).astype(np.int64)
    return Observation(
        name=name,
        meta={
            "texts": [d["text"] for d in documents],
            "top_text": [d["top_text"] for d in documents],
            "char_ends": [d["char_ends"] for d in documents],
            **meta,
        },
        arrays=arrays,
    )


class GreedyAnswers:
    """Observer: each prompt's greedy answer (module docstring), decoded `batch` prompts at a time."""

    # Its recording is the observation itself: a replay plans it under the key it was made under.
    records_itself = True

    def __init__(
        self, name: str, what: str, identity: dict[str, Any], top_k: int, full_steps: int, batch: int
    ) -> None:
        self.name, self.what = name, what
        self._identity = identity
        self.top_k, self.full_steps, self.batch = top_k, full_steps, batch

    def identity(self) -> dict[str, Any]:
        return {**self._identity, "top_k": self.top_k, "full_steps": self.full_steps, "batch": self.batch}

    def prompts(self, inputs: Inputs) -> list[dict[str, Any]]:
        """The prompts this observation decodes."""
        return list(inputs[PROMPTS])

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        prompts = self.prompts(inputs)
        step = progress(self.what, len(prompts))
        documents, full = decoded(
            backend, prompts, batches(prompts, self.batch), folder, self.top_k, self.full_steps, step
        )
        meta = {"execution": backend.describe(), **self.meta(inputs)}
        return answers_observation(self.name, documents, full if self.full_steps else None, self.top_k, meta)

    def meta(self, inputs: Inputs) -> dict[str, Any]:
        """What the observation says of its inputs (a task's digest of its prompts)."""
        return {"prompts_sha256": inputs.get("prompts_sha256"), **inputs.get(ANSWERS_META, {})}

    def record(self, obs: Observation, folder: Path) -> Observation:
        """Answers are compact already: the observation is its own recording."""
        return Observation(name=obs.name, key=obs.key, meta=obs.meta, arrays=obs.arrays)


def decoded(
    backend: Backend,
    prompts: list[dict[str, Any]],
    plan: list[list[int]],
    folder: Path,
    top_k: int,
    full_steps: int,
    step: Any,
) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """Every prompt's answer document and full rows, decoding the batches of `plan` not yet saved in `folder`
    (each saved as it completes)."""
    documents: list[dict[str, Any]] = [{} for _ in prompts]
    full: list[np.ndarray] = [np.zeros((0, 0), np.float32) for _ in prompts]
    for b, members in enumerate(plan):
        saved = folder / f"batch-{b:04d}.json"
        if not saved.is_file():
            gens = generate_batch(backend, [prompts[i] for i in members], top_k, full_steps)
            docs = [answer_document(backend.tokenizer, g.tokens, g.top_ids, g.top_logp) for g in gens]
            if full_steps:
                rows = {
                    str(i): np.ascontiguousarray(g.full_logp, dtype=np.float32)
                    for i, g in zip(members, gens, strict=True)
                }
                from safetensors.numpy import save_file

                with atomic_target(folder / f"batch-{b:04d}.safetensors") as tmp:
                    save_file(rows, str(tmp))
            write_atomic(saved, json.dumps({"members": members, "answers": docs}))
        batch = json.loads(saved.read_text(encoding="utf-8"))
        if full_steps:
            from safetensors.numpy import load_file

            rows = load_file(str(folder / f"batch-{b:04d}.safetensors"))
        for i, doc in zip(batch["members"], batch["answers"], strict=True):
            documents[i] = doc
            if full_steps:
                full[i] = rows[str(i)]
            step()
    return documents, full
