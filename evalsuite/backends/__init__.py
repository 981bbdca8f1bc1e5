"""Backends: how a side is executed. A backend exposes the few primitives tasks need.

`hf` runs the checkpoint through Transformers as users run it (bf16, or compressed-tensors as Transformers
executes it). Backends are loaded by the runner for one side at a time and closed before the other side loads.
"""

from __future__ import annotations

from typing import Protocol

import torch

from evalsuite.errors import InputError
from evalsuite.side import BackendOptions


class Backend(Protocol):
    """The primitives a task may ask of a loaded model."""

    vocab_size: int

    def next_token_logits(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits (shape (len(positions), vocab), the model's output dtype) at `positions` of one sequence.

        Row i scores the token at `positions[i] + 1` given the tokens up to `positions[i]`.
        """
        ...

    def close(self) -> None:
        """Free the model (and the accelerator memory it holds)."""
        ...


BACKENDS = ("hf", "intref")


def load_backend(checkpoint, options: BackendOptions) -> Backend:
    """Load `checkpoint` with the backend `options.backend` names."""
    if options.backend == "hf":
        from evalsuite.backends.hf import HFBackend

        return HFBackend(checkpoint, options)
    if options.backend == "intref":
        from evalsuite.backends.intref import IntrefBackend

        return IntrefBackend(checkpoint, options)
    raise InputError(f"unknown backend {options.backend!r}; known backends: {', '.join(BACKENDS)}")
