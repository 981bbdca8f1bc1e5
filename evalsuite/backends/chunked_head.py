"""The head applied per chunk of positions, for windows whose logits would not fit in memory at once.

A 32 k-token window of a 248 k-token vocabulary is 32 GB of float32 logits: the model's own forward, asked
for the logits of every scored position (`logits_to_keep`), would hold them all. Here the forward runs with
the output embeddings replaced by a stand-in that keeps its input, the final hidden states at the scored
positions (after the final norm, as the head receives them), and returns nothing; the model's own head
module is then applied to a few rows of them at a time. Only `chunk × vocabulary` logits ever exist.

What the model's forward does to the head's output before returning it (Gemma's final soft-cap, Granite's
`logits_scaling`, Cohere's `logit_scale`, and whatever a class does next) is the model's own: each chunk of
logits is handed back through the model's forward as if its head had returned it (`after_head_of`: one token
through the model, its head standing in to return the chunk). A model whose forward returns its head's output
unchanged, found once per model by a probe, skips that forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from evalsuite.errors import InputError

AfterHead = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class ScoredStates:
    """One window's final hidden states at its scored positions, (positions, hidden), and the head that turns
    any rows of them into logits."""

    hidden: torch.Tensor
    head: nn.Module
    # What the model's forward does to the head's output (`after_head_of`); None where it does nothing.
    after_head: AfterHead | None = None

    def __len__(self) -> int:
        return int(self.hidden.shape[0])

    def logits(self, start: int, stop: int) -> torch.Tensor:
        """The logits of scored rows `start:stop`, shape (stop − start, vocab), the head's output dtype."""
        with torch.inference_mode():
            # As the forward hands it over, (batch, positions, hidden): compressed-tensors' dynamic per-token
            # activation quantization reads a 2-D input as one token.
            out = self.head(self.hidden[None, start:stop])[0]
        return out if self.after_head is None else self.after_head(out)

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


class _HeadOutput(nn.Module):
    """Stands in for the output embeddings during a forward: returns the logits it was given, whatever the
    hidden states (`after_head_of`)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits


_StandIn = Any  # _HeadInput or _HeadOutput


@contextlib.contextmanager
def _head_replaced(model: Any, stand_in: _StandIn) -> Iterator[_StandIn]:
    head = model.get_output_embeddings()
    if head is None:
        raise InputError(f"{type(model).__name__} has no output embeddings to apply per chunk of positions")
    parent, attr = _parent_and_name(model, head)
    setattr(parent, attr, stand_in)
    try:
        yield stand_in
    finally:
        setattr(parent, attr, head)


def head_input_kept(model: Any) -> contextlib.AbstractContextManager[_HeadInput]:
    """For the block, the model's output embeddings replaced by a stand-in that keeps their input; the head is
    put back afterwards, whatever happens."""
    return _head_replaced(model, _HeadInput())


# Where a model's `after_head_of` is kept: probed once per model object.
_AFTER_HEAD = "_evalsuite_after_head"
# The probe's values span the logits of real models (tens, either sign) at their dtype's spacing there.
_PROBE_RANGE = 64.0


def after_head_of(
    model: Any, forward_one_token: Callable[[], torch.Tensor], dtype: torch.dtype, device: torch.device
) -> AfterHead | None:
    """What the model's forward does to its head's output, as a function of that output (rows, vocab) → the
    logits the forward returns for them; None where the forward returns the head's output unchanged.

    `forward_one_token()` runs the model's forward on one token and returns its `.logits` (the backend's
    way: a streamed side stands in for its layers). During it the head is replaced by a module returning the
    given rows, so the forward applies to them exactly what it applies to its head's output, whatever the
    class (it cannot depend on the token: a transform of the logits reads the logits and the config). A probe
    of every vocabulary entry at values across the range of real logits decides once per model whether the
    forward does anything."""
    cached = model.__dict__.get(_AFTER_HEAD, ...)
    if cached is not ...:
        return cached

    def apply(logits: torch.Tensor) -> torch.Tensor:
        with _head_replaced(model, _HeadOutput(logits[None])), torch.inference_mode():
            out = forward_one_token()
        if tuple(out.shape[-2:]) != tuple(logits.shape):
            raise InputError(
                f"the forward of {type(model).__name__} returned logits of shape {tuple(out.shape)} for a "
                f"head output of {tuple(logits.shape)}: its head cannot be applied per chunk of positions"
            )
        return out.reshape(logits.shape)

    head = model.get_output_embeddings()
    vocab = getattr(head, "out_features", None) or model.config.get_text_config().vocab_size
    probe = torch.linspace(-_PROBE_RANGE, _PROBE_RANGE, 2 * vocab, device=device).to(dtype).reshape(2, vocab)
    returned = apply(probe)
    unchanged = returned.dtype == probe.dtype and torch.equal(returned, probe)
    found = None if unchanged else apply
    model.__dict__[_AFTER_HEAD] = found
    return found


def scored_states(
    model: Any, stand_in: _HeadInput, head: nn.Module, forward_one_token: Callable[[], torch.Tensor]
) -> ScoredStates:
    """The `ScoredStates` of the one window a forward under `head_input_kept` just ran; `forward_one_token`
    as `after_head_of` takes it."""
    if stand_in.hidden is None or stand_in.hidden.shape[0] != 1:
        raise InputError(f"the forward of {type(model).__name__} did not call its head once on one window")
    hidden = stand_in.hidden[0]
    after_head = after_head_of(model, forward_one_token, hidden.dtype, hidden.device)
    return ScoredStates(hidden=hidden, head=head, after_head=after_head)
