"""Greedy answers of one side to a list of prompts, as the side decodes them (`evalsuite.backends.greedy`).

A prompt is its token ids (through the side's chat template, made once by the task) and, for a question about
an image, the rest of the model's inputs. An answer is a fact about a side in a configuration, not about its
weights alone: a quantized model's INT8 activations round discontinuously, so the padding and the other rows
of a batch can move its tokens. So every answer is kept with the configuration it was decoded in
(`Configuration`), and a side decodes in the configurations it can afford:

- **alone**: each prompt as a batch of one, no padding, the answer a single request gets. A loaded side
  decodes every prompt so; it is the answer a report shows.
- **in batches**: `batch` prompts at a time, left-padded and masked as Transformers' batched generation is,
  in order of budget (a batch decodes until its largest budget is spent, so like budgets take fewer
  forwards), then length; a prompt with an image alone. A loaded side decodes these too, so that a prompt
  whose answer depends on the batch is found (`batch_sensitive`); a streamed side, where each forward reads
  every decoder layer and decoding alone would multiply the forwards by the batch, decodes only these, and
  they are its answers.

Each batch is saved as it completes, so an interrupted observation resumes at the next one: the batches are
fixed by the prompts and `batch`, so a resumed observation decodes what an uninterrupted one decodes, with the
same bits.

What an answer keeps: its tokens, its text (and where each token ends in it, so that a report can mark a
token inside the answer), per step the top-k ids and log-probs as the decoding saw them, and the full
log-prob rows of its first `full_steps` steps (of the answers shown).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from evalsuite.contract.observation import Observation
from evalsuite.files.run_folder import atomic_target, write_atomic
from evalsuite.protocol.task import Inputs, Progress

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


ALONE, IN_BATCHES = "alone", "batch"
# Where the answers of a second configuration lie beside the shown ones in an observation: arrays and meta
# keys with this prefix (the shown answers keep the plain names, which recordings and forced answers read).
_SECOND = "batch_"


@dataclass(frozen=True)
class Configuration:
    """How a side's answers were decoded: which configurations it decoded (`ALONE`, `IN_BATCHES`), the one
    its answers are shown in, the batch size and where it ran. Kept in the observation's meta."""

    decoded: tuple[str, ...]
    batch: int
    device: str
    dtype: str

    @property
    def shown(self) -> str:
        return self.decoded[0]

    def describe(self, configuration: str | None = None) -> str:
        """The configuration of an answer in words, as a report states it."""
        which = configuration or self.shown
        where = f"{self.device}, {self.dtype}"
        if which == ALONE:
            return f"decoded alone (batch of 1, no padding; {where})"
        return f"decoded in batches of up to {self.batch}, left-padded ({where})"

    def to_json(self) -> dict[str, Any]:
        return {
            "decoded": list(self.decoded),
            "batch": self.batch,
            "device": self.device,
            "dtype": self.dtype,
        }

    @classmethod
    def of(cls, obs: Observation) -> Configuration:
        """The configuration an observation of answers was decoded in."""
        doc = obs.meta.get("configuration") or {}
        return cls(
            decoded=tuple(doc.get("decoded") or (IN_BATCHES,)),
            batch=int(doc.get("batch", 1)),
            device=str(doc.get("device", "?")),
            dtype=str(doc.get("dtype", "?")),
        )


@dataclass(frozen=True)
class AnswerSet:
    """One configuration's answers of a side, prompt by prompt: tokens, text, where each token ends in the
    text, and per step the top-k ids, log-probs and their texts as the decoding saw them."""

    tokens: list[list[int]]
    texts: list[str]
    char_ends: list[list[int]]
    top_ids: list[np.ndarray]
    top_logp: list[np.ndarray]
    top_text: list[list[list[str]]]

    def __len__(self) -> int:
        return len(self.tokens)


def answer_set(obs: Observation, configuration: str | None = None) -> AnswerSet:
    """The answers of `obs` decoded in `configuration` (its shown answers when None)."""
    shown = Configuration.of(obs).shown
    prefix = "" if configuration in (None, shown) else _SECOND
    if prefix and configuration not in Configuration.of(obs).decoded:
        raise KeyError(f"no answers decoded {configuration!r} in {obs.name}")
    a, m = obs.arrays, obs.meta
    offsets = a[f"{prefix}offsets"]
    cut = [slice(int(offsets[i]), int(offsets[i + 1])) for i in range(len(offsets) - 1)]
    return AnswerSet(
        tokens=[a[f"{prefix}tokens"][c].tolist() for c in cut],
        texts=list(m[f"{prefix}texts"]),
        char_ends=list(m[f"{prefix}char_ends"]),
        top_ids=[a[f"{prefix}top_ids"][c] for c in cut],
        top_logp=[a[f"{prefix}top_logp"][c] for c in cut],
        top_text=list(m[f"{prefix}top_text"]),
    )


def answers_observation(
    name: str,
    documents: list[dict[str, Any]],
    full: list[np.ndarray] | None,
    top_k: int,
    meta: dict[str, Any],
    second: list[dict[str, Any]] | None = None,
) -> Observation:
    """The observation of answers in prompt order (`answer_document`s, and their full rows if kept); a second
    configuration's answers (`second`) beside them under prefixed names."""
    arrays, texts = _answer_arrays(documents, top_k, ""), _answer_texts(documents, "")
    if second is not None:
        arrays.update(_answer_arrays(second, top_k, _SECOND))
        texts.update(_answer_texts(second, _SECOND))
    if full is not None:
        arrays["full_logp"] = np.concatenate(full) if full else np.zeros((0, 0), np.float32)
        arrays["full_offsets"] = np.cumsum([0] + [len(f) for f in full]).astype(np.int64)
    return Observation(name=name, meta={**texts, **meta}, arrays=arrays)


def _answer_arrays(documents: list[dict[str, Any]], top_k: int, prefix: str) -> dict[str, np.ndarray]:
    tokens = [t for d in documents for t in d["tokens"]]
    offsets = np.cumsum([0] + [len(d["tokens"]) for d in documents]).astype(np.int64)
    top_ids = np.asarray([r for d in documents for r in d["top_ids"]], dtype=np.int64).reshape(-1, top_k)
    top_logp = np.asarray([r for d in documents for r in d["top_logp"]], dtype=np.float32).reshape(-1, top_k)
    return {
        f"{prefix}tokens": np.asarray(tokens, dtype=np.int64),
        f"{prefix}offsets": offsets,
        f"{prefix}top_ids": top_ids,
        f"{prefix}top_logp": top_logp,
    }


def _answer_texts(documents: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    return {
        f"{prefix}texts": [d["text"] for d in documents],
        f"{prefix}top_text": [d["top_text"] for d in documents],
        f"{prefix}char_ends": [d["char_ends"] for d in documents],
    }


def configuration_of(backend: Any, batch: int) -> Configuration:
    """The configurations `backend` decodes `batch`-sized batches in (module docstring): a streamed side in
    batches only; a backend that decodes one prompt at a time, or a batch of one, alone only; a loaded side
    both, alone first (the answers shown)."""
    from evalsuite.backends.streamed import StreamedBackend

    options = getattr(backend, "options", None)
    device, dtype = str(getattr(options, "device", "?")), str(getattr(options, "dtype", "?"))
    if not callable(getattr(backend, "generate_greedy_batch", None)) or batch <= 1:
        return Configuration((ALONE,), 1, device, dtype)
    if isinstance(backend, StreamedBackend):
        return Configuration((IN_BATCHES,), batch, device, dtype)
    return Configuration((ALONE, IN_BATCHES), batch, device, dtype)


class GreedyAnswers:
    """Observer: each prompt's greedy answer (module docstring), alone and `batch` prompts at a time, as the
    side can afford."""

    # Its recording is the observation itself: a replay plans it under the key it was made under.
    records_itself = True

    def __init__(
        self, name: str, what: str, identity: dict[str, Any], top_k: int, full_steps: int, batch: int
    ) -> None:
        self.name, self.what = name, what
        self._identity = identity
        self.top_k, self.full_steps, self.batch = top_k, full_steps, batch

    def identity(self) -> dict[str, Any]:
        return {
            **self._identity,
            "top_k": self.top_k,
            "full_steps": self.full_steps,
            "batch": self.batch,
            # Alone where the side can afford it, in batches by budget (`Configuration`).
            "decoding": "alone+batches-by-budget",
        }

    def prompts(self, inputs: Inputs) -> list[dict[str, Any]]:
        """The prompts this observation decodes."""
        return list(inputs[PROMPTS])

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        prompts = self.prompts(inputs)
        configuration = configuration_of(backend, self.batch)
        step = progress(self.what, len(prompts) * len(configuration.decoded))
        found = {}
        for which in configuration.decoded:
            plan = (
                [[i] for i in range(len(prompts))] if which == ALONE else batches(prompts, self.batch, True)
            )
            full_steps = self.full_steps if which == configuration.shown else 0
            found[which] = decoded(backend, prompts, plan, folder, self.top_k, full_steps, step, which)
        documents, full = found[configuration.shown]
        second = [found[c][0] for c in configuration.decoded[1:]]
        meta = {
            "execution": backend.describe(),
            "configuration": configuration.to_json(),
            **self.meta(inputs),
        }
        return answers_observation(
            self.name,
            documents,
            full if self.full_steps else None,
            self.top_k,
            meta,
            second[0] if second else None,
        )

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
    label: str = IN_BATCHES,
    generate: Callable[[list[dict[str, Any]]], list[Any]] | None = None,
) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """Every prompt's answer document and full rows, decoding the batches of `plan` not yet saved in `folder`
    (each saved as it completes, under `label`): by `generate` where given (a batch's prompts in, their
    generations out), else greedily (`generate_batch`). What a generation measured of itself (its
    `counts`: a drafted decoding's rounds) is kept in its document."""
    documents: list[dict[str, Any]] = [{} for _ in prompts]
    full: list[np.ndarray] = [np.zeros((0, 0), np.float32) for _ in prompts]
    for b, members in enumerate(plan):
        saved = folder / f"{label}-{b:04d}.json"
        rows_file = folder / f"{label}-{b:04d}.safetensors"
        if not saved.is_file():
            chosen = [prompts[i] for i in members]
            gens = generate(chosen) if generate else generate_batch(backend, chosen, top_k, full_steps)
            docs = [answer_document(backend.tokenizer, g.tokens, g.top_ids, g.top_logp) for g in gens]
            for doc, g in zip(docs, gens, strict=True):
                doc.update(getattr(g, "counts", {}))
            if full_steps:
                rows = {
                    str(i): np.ascontiguousarray(g.full_logp, dtype=np.float32)
                    for i, g in zip(members, gens, strict=True)
                }
                from safetensors.numpy import save_file

                with atomic_target(rows_file) as tmp:
                    save_file(rows, str(tmp))
            write_atomic(saved, json.dumps({"members": members, "answers": docs}))
        batch = json.loads(saved.read_text(encoding="utf-8"))
        if full_steps:
            from safetensors.numpy import load_file

            rows = load_file(str(rows_file))
        for i, doc in zip(batch["members"], batch["answers"], strict=True):
            documents[i] = doc
            if full_steps:
                full[i] = rows[str(i)]
            step()
    return documents, full
