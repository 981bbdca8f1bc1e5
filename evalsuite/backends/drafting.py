"""Greedy decoding with drafting, by Transformers' assisted generation, and what it cost the target model.

Speculative decoding lets something cheap propose several tokens (a draft) and the target model verify them
in one forward: it keeps the longest prefix of the draft its own greedy choices agree with, and one token of
its own after it (the bonus token). In exact arithmetic greedy drafting is lossless: the answer is the
target's greedy answer. In floating point it need not be: a forward that verifies k tokens over a cache is
not the arithmetic of k forwards of one token (other matrix shapes, kernels and orders of summation), so a
near tie can fall the other way; a model whose activations are rounded to INT8 at run time turns a last-bit
difference into a whole quantization step. Whether drafting changes a side's answers is what `specdec`
checks, so drafting here is the field's own, unchanged: Transformers' prompt lookup
(`prompt_lookup_num_tokens`: the tokens that followed an earlier occurrence of the last n-gram, no model) or
a draft model (`assistant_model`, `num_assistant_tokens` a round on a constant schedule with no confidence
cut-off, so that every round drafts the same number of tokens).

A round, counted without Transformers' internals: every forward of the target during the decoding is one
verification round (a pre-forward hook counts them), the first also the prompt's prefill. So rounds = target
forwards, and the mean accepted length = new tokens / rounds (tokens per round, the bonus token included).
The drafted tokens are read off each forward's input: a round that verifies k drafted tokens forwards k + 1
tokens, the first round the prompt and its draft.

Transformers drafts for one sequence at a time (batch 1): each prompt is decoded alone, with the same fresh
greedy configuration as `greedy.greedy_batch`. What each step ranked is read off the verification forwards'
own logits (`output_logits`), for the steps kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from evalsuite.backends.greedy import Generation, generation_settings, greedy_config, padded_batch


@dataclass(frozen=True)
class Drafting:
    """How a decoding drafts: prompt lookup (`lookup_tokens` a round, matching n-grams of up to `max_ngram`
    tokens) where `draft` is None, else the draft model `draft` (a loaded Transformers model sharing the
    target's tokenizer), `draft_tokens` a round."""

    lookup_tokens: int = 10
    max_ngram: int = 2
    draft: Any = None
    draft_tokens: int = 5

    def generate_arguments(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The generation config's settings and `generate`'s keyword arguments of this drafting. A draft
        model's own settings are set on it: Transformers reads them from the draft's generation config."""
        if self.draft is None:
            settings = {"prompt_lookup_num_tokens": self.lookup_tokens}
            settings["max_matching_ngram_size"] = self.max_ngram
            return settings, {}
        config = self.draft.generation_config
        config.num_assistant_tokens = self.draft_tokens
        # A constant schedule: "heuristic" would carry the draft length over from one prompt to the next.
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0  # no early stop: every round drafts `draft_tokens`
        return {}, {"assistant_model": self.draft}


class TargetForwards:
    """Counts the target's forwards while installed (`with`): each is a verification round; and the tokens
    each forwarded, from which the drafted ones are read (`drafted`)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.lengths: list[int] = []

    def __enter__(self) -> TargetForwards:
        self._handle = self.model.register_forward_pre_hook(self._seen, with_kwargs=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def _seen(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        given = kwargs.get("input_ids")
        if given is None:
            given = kwargs.get("inputs_embeds", args[0] if args else None)
        self.lengths.append(int(given.shape[1]) if given is not None else 0)

    def drafted(self, prompt_length: int) -> int:
        """The drafted tokens the rounds verified: the first forwarded the prompt and its draft, each later
        one its draft and the token before it."""
        if not self.lengths:
            return 0
        return self.lengths[0] - prompt_length + sum(n - 1 for n in self.lengths[1:])


T = TypeVar("T")


def wall_seconds(device: torch.device, run: Callable[[], T]) -> tuple[T, float]:
    """`run()` and the wall seconds it took, the device's queue drained before and after (on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


@torch.inference_mode()
def drafted_greedy(
    model: Any,
    device: torch.device,
    prompt: dict[str, Any],
    max_new_tokens: int,
    drafting: Drafting,
    top_k: int = 5,
    timed: bool = False,
) -> Generation:
    """Greedy decoding of one prompt (`input_ids` of shape (1, length)) with `drafting` (module docstring):
    its new tokens up to `max_new_tokens` or a stop token (kept), the top-k of every step, the target's
    forwards (`counts["rounds"]`) and the drafted tokens they verified (`"drafted"`); the wall seconds
    where `timed` (`"seconds"`)."""
    stops, pad = generation_settings(model)
    settings, arguments = drafting.generate_arguments()
    config = greedy_config(model, max_new_tokens, output_logits=True, **settings)
    batch = padded_batch([prompt], pad, device)
    width = batch["input_ids"].shape[1]
    with TargetForwards(model) as forwards:
        out, seconds = wall_seconds(
            device, lambda: model.generate(**batch, generation_config=config, **arguments)
        )
    new = out.sequences[0, width:].tolist()[:max_new_tokens]
    ends = [i for i, token in enumerate(new) if token in stops]
    tokens = new[: ends[0] + 1] if ends else new
    logp = torch.log_softmax(torch.cat([row.float() for row in out.logits[: len(tokens)]]), dim=-1)
    top_logp, top_ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    return Generation(
        tokens=tokens,
        top_ids=top_ids.cpu().numpy().astype(np.int64),
        top_logp=top_logp.cpu().numpy().astype(np.float32),
        full_logp=np.zeros((0, logp.shape[-1]), dtype=np.float32),
        counts={
            "rounds": len(forwards.lengths),
            "drafted": forwards.drafted(width),
            "seconds": seconds if timed else None,
        },
    )
