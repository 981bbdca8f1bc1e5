"""Each decoder layer's MLP applied a chunk of positions at a time, for windows longer than the chunk.

An MLP (dense, or a mixture of experts routed token by token) is position-wise: its output at a position
depends only on its input there. Its intermediate activations are the largest a decoder layer makes, (window ×
intermediate size) for the gate, the up projection and their product, and with compressed-tensors' dynamic
activation quantization float32 copies of its inputs besides: on a long window they, not the weights, set the
peak memory above the loaded model, and they grow with the window. Applied `rows` positions at a time, those
intermediates stay the size of one chunk; only the layer's input and output are whole-window tensors.

The split changes nothing a model computes at a position, but a matrix product over fewer rows may take
another kernel and round differently (at most an ulp of the compute dtype). So it applies only to windows
longer than `rows` positions, never to the 512-token protocol, and every window of one length is split alike
on both sides.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

# Positions per chunk: the intermediates of 1,024 positions are a few MB on a small model and a few tens on a
# large one, while matrix products of 1,024 rows still run at full speed.
MLP_CHUNK_ROWS = 1024


def _decoder_mlps(model: nn.Module) -> list[nn.Module]:
    """The `mlp` module of every decoder layer (the Transformers convention for the position-wise block) of a
    model, or of one decoder layer."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return [module.mlp for module in decoder.modules() if isinstance(getattr(module, "mlp", None), nn.Module)]


def _chunked(forward: Callable[..., Any], rows: int) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or hidden_states.dim() != 3 or hidden_states.shape[1] <= rows:
            return forward(hidden_states, *args, **kwargs)
        first = forward(hidden_states[:, :rows])
        if not isinstance(first, torch.Tensor) or first.shape[:2] != (hidden_states.shape[0], rows):
            # Not a plain position-wise block (it returns more than its output): run it as the model does.
            return forward(hidden_states)
        rest = [forward(hidden_states[:, s : s + rows]) for s in range(rows, hidden_states.shape[1], rows)]
        return torch.cat([first, *rest], dim=1)

    return run


@contextlib.contextmanager
def mlp_in_chunks(model: nn.Module, rows: int | None = None) -> Iterator[int]:
    """For the block, every decoder layer's MLP of `model` (a model, or one decoder layer) applied `rows`
    positions at a time to inputs longer than that; yields how many MLPs are split, and restores their own
    forwards afterwards, whatever happens. `rows` None: `MLP_CHUNK_ROWS`."""
    rows = MLP_CHUNK_ROWS if rows is None else rows
    mlps = _decoder_mlps(model) if rows > 0 else []
    for mlp in mlps:
        # An instance attribute shadows the class's forward for this module only; `nn.Module.__call__` (and
        # its hooks) still runs around it.
        mlp.forward = _chunked(mlp.forward, rows)
    try:
        yield len(mlps)
    finally:
        for mlp in mlps:
            mlp.__dict__.pop("forward", None)
