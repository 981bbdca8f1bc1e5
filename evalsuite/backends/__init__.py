"""Backends: how a side is executed. A backend exposes the few primitives tasks need.

`hf` runs the checkpoint through Transformers as users run it (bf16, or compressed-tensors as Transformers
executes it). Backends are loaded by the runner for one side at a time and closed before the other side loads.
"""

from __future__ import annotations

from typing import Any, Protocol

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

    def generate_greedy(
        self, inputs: dict[str, torch.Tensor], max_new_tokens: int, top_k: int = 5, full_steps: int = 0
    ) -> Any:
        """Greedy decoding of one prompt with the top-k log-probs of every step (see `hf.Generation`)."""
        ...

    def image_features(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The vision tower and merger's output for the image inputs, float32, one row per visual token."""
        ...

    def close(self) -> None:
        """Free the model (and the accelerator memory it holds)."""
        ...


BACKENDS = ("hf", "intref")


def backend_identity(options: BackendOptions) -> dict[str, Any]:
    """What, beyond its options, decides a backend's numbers: part of every observation's key, so that a
    resumed run never reuses observations made under another convention."""
    if options.backend == "intref":
        from evalsuite.backends.intref import activation_convention

        convention = activation_convention()
        return {"activations": {"divisor": convention.divisor, "rounding": convention.rounding}}
    return {}


def load_backend(checkpoint, options: BackendOptions) -> Backend:
    """Load `checkpoint` with the backend `options.backend` names."""
    if options.backend == "hf":
        from evalsuite.backends.hf import HFBackend

        return HFBackend(checkpoint, options)
    if options.backend == "intref":
        from evalsuite.backends.intref import IntrefBackend

        return IntrefBackend(checkpoint, options)
    raise InputError(f"unknown backend {options.backend!r}; known backends: {', '.join(BACKENDS)}")
