"""The head applied per chunk of positions, for windows whose logits would not fit in memory at once.

A 32 k-token window of a 248 k-token vocabulary is 32 GB of float32 logits: the model's own forward, asked
for the logits of every scored position (`logits_to_keep`), would hold them all. Here the forward runs with
the output embeddings replaced by a stand-in that keeps its input, the final hidden states at the scored
positions (after the final norm, as the head receives them), and returns nothing; the model's own head
module is then applied to a few rows of them at a time. Only `chunk × vocabulary` logits ever exist.

What the model does to the head's output before returning it is repeated here where a config says so:
Gemma-style final logit soft-capping (`transformers/models/gemma2/modeling_gemma2.py`,
`Gemma2ForCausalLM.forward`: divide by the cap, tanh, multiply by the cap).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from evalsuite.errors import InputError


@dataclass
class ScoredStates:
    """One window's final hidden states at its scored positions, (positions, hidden), and the head that turns
    any rows of them into logits."""

    hidden: torch.Tensor
    head: nn.Module
    softcap: float | None = None

    def __len__(self) -> int:
        return int(self.hidden.shape[0])

    def logits(self, start: int, stop: int) -> torch.Tensor:
        """The logits of scored rows `start:stop`, shape (stop − start, vocab), the head's output dtype."""
        with torch.inference_mode():
            # As the forward hands it over, (batch, positions, hidden): compressed-tensors' dynamic per-token
            # activation quantization reads a 2-D input as one token.
            out = self.head(self.hidden[None, start:stop])[0]
            if self.softcap:
                out = torch.tanh(out / self.softcap) * self.softcap
        return out

    def chunks(self, rows: int) -> Iterator[torch.Tensor]:
        """The logits of every scored position, `rows` positions at a time, in order."""
        for start in range(0, len(self), rows):
            yield self.logits(start, min(start + rows, len(self)))


class _HeadInput(nn.Module):
    """Stands in for the output embeddings during a forward: keeps the hidden states handed to the head and
    returns an empty logits tensor (no vocabulary-sized product is made)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.hidden = hidden_states
        return hidden_states.new_empty((*hidden_states.shape[:-1], 0))


def _parent_and_name(model: nn.Module, module: nn.Module) -> tuple[nn.Module, str]:
    for name, candidate in model.named_modules():
        if candidate is module and name:
            parent_name, _, attr = name.rpartition(".")
            return model.get_submodule(parent_name), attr
    raise InputError(f"{type(model).__name__} has no head module to apply per chunk of positions")


def final_logit_softcap(model: Any) -> float | None:
    """The cap the model applies to its logits after the head (Gemma 2 and 3), None where it applies none."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


@contextlib.contextmanager
def head_input_kept(model: Any) -> Iterator[_HeadInput]:
    """For the block, the model's output embeddings replaced by a stand-in that keeps their input; the head is
    put back afterwards, whatever happens."""
    head = model.get_output_embeddings()
    if head is None:
        raise InputError(f"{type(model).__name__} has no output embeddings to apply per chunk of positions")
    parent, attr = _parent_and_name(model, head)
    stand_in = _HeadInput()
    setattr(parent, attr, stand_in)
    try:
        yield stand_in
    finally:
        setattr(parent, attr, head)


def scored_states(model: Any, stand_in: _HeadInput, head: nn.Module) -> ScoredStates:
    """The `ScoredStates` of the one window a forward under `head_input_kept` just ran."""
    if stand_in.hidden is None or stand_in.hidden.shape[0] != 1:
        raise InputError(f"the forward of {type(model).__name__} did not call its head once on one window")
    return ScoredStates(hidden=stand_in.hidden[0], head=head, softcap=final_logit_softcap(model))
