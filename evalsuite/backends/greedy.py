"""Greedy decoding of a batch of prompts by the model's own `generate`, with what each step ranked.

One call decodes every prompt of a batch together: the prompts left-padded to one length (the padding masked,
as Transformers' batched generation masks it), one forward per new token for the whole batch. That is what
makes generation affordable when each forward reads every decoder layer from the files
(`evalsuite.backends.streamed`): a step costs one pass over the layers whatever the batch size. A loaded
model decodes the same batches by the same call, so that a streamed run and a loaded run give the same
answers bit for bit.

What a step ranked is taken as the model's `generate` sees it, from the raw logits of each step (a
`LogitsProcessor` that changes nothing): the top-k log-probs of every row, and the full log-prob rows of the
first `full_steps` steps. A fresh `GenerationConfig`: the checkpoint's generation_config.json (sampling, a
repetition penalty) must not change what "greedy" means between two sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Generation:
    """A greedy generation: the new tokens and, per step, the top-k ids and log-probs (and optionally the
    full log-prob rows of the first steps); `counts`, what a decoding measured of itself beside its answer
    (a drafted decoding's rounds: `evalsuite.backends.drafting`)."""

    tokens: list[int]
    top_ids: np.ndarray  # (steps, k) int64
    top_logp: np.ndarray  # (steps, k) float32
    full_logp: np.ndarray  # (min(full_steps, steps), vocab) float32
    counts: dict[str, Any] = field(default_factory=dict)


class _StepRanks:
    """A logits processor that keeps, per step, the top-k log-probs of every row and the full rows of the
    first `full_steps` steps, and hands the scores on unchanged."""

    def __init__(self, top_k: int, full_steps: int) -> None:
        self.top_k, self.full_steps = top_k, full_steps
        self.top_ids: list[torch.Tensor] = []
        self.top_logp: list[torch.Tensor] = []
        self.full: list[torch.Tensor] = []
        self.vocab = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(scores.float(), dim=-1)
        self.vocab = logp.shape[-1]
        top_logp, top_ids = logp.topk(min(self.top_k, logp.shape[-1]), dim=-1)
        self.top_ids.append(top_ids.cpu())
        self.top_logp.append(top_logp.cpu())
        if len(self.full) < self.full_steps:
            self.full.append(logp.cpu())
        return scores


def generation_settings(model: Any) -> tuple[list[int], int]:
    """The ids greedy decoding stops at (the model's generation config) and the id that pads a batch."""
    eos = model.generation_config.eos_token_id
    stops = [eos] if isinstance(eos, int) else list(eos or [])
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = stops[0] if stops else 0
    return stops, int(pad)


def greedy_config(model: Any, max_new_tokens: int, **settings: Any) -> Any:
    """A fresh `GenerationConfig` for greedy decoding up to `max_new_tokens`, stopping at the model's eos
    ids: what "greedy" means on every side, whatever the checkpoint's generation_config.json says. `settings`
    add to it (a drafting's: `prompt_lookup_num_tokens`)."""
    from transformers import GenerationConfig

    stops, pad = generation_settings(model)
    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        eos_token_id=stops or None,
        pad_token_id=pad,
        return_dict_in_generate=True,
        **settings,
    )


def padded_batch(prompts: Sequence[dict[str, Any]], pad: int, device: torch.device) -> dict[str, Any]:
    """Prompts of token ids (`input_ids` of shape (1, length), perhaps an `attention_mask`) as one batch,
    left-padded with `pad` and masked; one prompt with other inputs (images) is handed on as it is."""
    if len(prompts) == 1:
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in prompts[0].items()}
    extra = {k for p in prompts for k in p if k not in ("input_ids", "attention_mask")}
    if extra:
        raise ValueError(f"only token-id prompts are decoded in batches (not {sorted(extra)})")
    rows = [p["input_ids"].reshape(-1) for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


@torch.inference_mode()
def greedy_batch(
    model: Any,
    device: torch.device,
    prompts: Sequence[dict[str, Any]],
    max_new_tokens: Sequence[int],
    top_k: int = 5,
    full_steps: int = 0,
) -> list[Generation]:
    """Greedy decoding of `prompts` as one batch (module docstring): per prompt its new tokens, up to its own
    `max_new_tokens` or a stop token (kept), and what each of its steps ranked. Greedy decoding is causal, so
    a prompt that stops early, or asks for fewer tokens than the batch decodes, has its own answer cut from
    the batch's."""
    from transformers import LogitsProcessorList

    stops, pad = generation_settings(model)
    config = greedy_config(model, max(max_new_tokens))
    batch = padded_batch(prompts, pad, device)
    ranks = _StepRanks(top_k, full_steps)
    out = model.generate(**batch, generation_config=config, logits_processor=LogitsProcessorList([ranks]))
    width = batch["input_ids"].shape[1]
    top_ids, top_logp = torch.stack(ranks.top_ids, dim=1), torch.stack(ranks.top_logp, dim=1)
    full = torch.stack(ranks.full, dim=1) if ranks.full else None
    generations = []
    for row, limit in enumerate(max_new_tokens):
        new = out.sequences[row, width:].tolist()[:limit]
        ends = [i for i, token in enumerate(new) if token in stops]
        tokens = new[: ends[0] + 1] if ends else new
        steps = len(tokens)
        generations.append(
            Generation(
                tokens=tokens,
                top_ids=top_ids[row, :steps].numpy().astype(np.int64),
                top_logp=top_logp[row, :steps].numpy().astype(np.float32),
                full_logp=(
                    np.ascontiguousarray(full[row, : min(full_steps, steps)].numpy())
                    if full is not None
                    else np.zeros((0, ranks.vocab), dtype=np.float32)
                ),
            )
        )
    return generations
