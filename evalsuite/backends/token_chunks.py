"""Each decoder layer's MLP (and the Linears outside it) applied a chunk of positions at a time, for windows
longer than the chunk.

An MLP (dense, or a mixture of experts routed token by token) is position-wise: its output at a position
depends only on its input there. Its intermediate activations are the largest a decoder layer makes, (window ×
intermediate size) for the gate, the up projection and their product, and with compressed-tensors' dynamic
activation quantization float32 copies of its inputs besides: on a long window they, not the weights, set the
peak memory above the loaded model, and they grow with the window. Applied `rows` positions at a time, those
intermediates stay the size of one chunk; only the layer's input and output are whole-window tensors.

The split changes nothing a model computes at a position, but a matrix product over fewer rows may take
another kernel and round differently (an ulp of the compute dtype, which the later layers carry on). So it
applies only to windows longer than `rows` positions, never to the 512-token protocol, and a window of one
length is split alike on both sides, loaded or streamed. A module whose activation quantization takes one
scale over the whole input is not position-wise, and is never split.
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


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules holding an `mlp` (the Transformers convention for a decoder layer's position-wise block)
    under a model's decoder, or `model` itself when it is one decoder layer."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return [module for module in decoder.modules() if isinstance(getattr(module, "mlp", None), nn.Module)]


def _position_wise(module: nn.Module) -> bool:
    """Whether every quantized Linear in `module` quantizes its inputs token by token (or statically): one
    whose activation scale is computed over the whole input at run time (compressed-tensors' dynamic
    per-tensor strategy) would get another scale per chunk, so a module holding one is never split."""
    for sub in module.modules():
        activations = getattr(getattr(sub, "quantization_scheme", None), "input_activations", None)
        if activations is None or activations.dynamic is not True:
            continue
        strategy = getattr(activations.strategy, "value", activations.strategy)
        if strategy not in ("token", "group", "tensor_group"):
            return False
    return True


def _split_modules(layer: nn.Module) -> list[nn.Module]:
    """What of one decoder layer is applied per chunk: the MLP whole (its intermediates are the largest), and
    each Linear outside it (the attention's projections: their outputs stay whole-window, the float32 copies
    a quantized Linear makes of its input do not)."""
    inside_mlp = {id(m) for m in layer.mlp.modules()}
    linears = [m for m in layer.modules() if isinstance(m, nn.Linear) and id(m) not in inside_mlp]
    return [m for m in [layer.mlp, *linears] if _position_wise(m)]


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


_NO_FORWARD = object()


@contextlib.contextmanager
def mlp_in_chunks(model: nn.Module, length: int | None = None, rows: int | None = None) -> Iterator[int]:
    """For the block, in every decoder layer of `model` (a model, or one decoder layer), the MLP and the
    Linears outside it applied `rows` positions at a time to inputs longer than that (`_split_modules`);
    yields how many MLPs are split, and restores the modules' forwards afterwards, whatever happens. `rows`
    None: `MLP_CHUNK_ROWS`. Given the window's `length`, nothing is wrapped for a window that fits one chunk
    (the 512-token protocol's), so its forward pays no walk over the model's modules."""
    rows = MLP_CHUNK_ROWS if rows is None else rows
    fits = length is not None and length <= rows
    layers = _decoder_layers(model) if rows > 0 and not fits else []
    modules = [m for layer in layers for m in _split_modules(layer)]
    # compressed-tensors sets a quantized module's forward on the instance: it is wrapped, then put back.
    previous = [m.__dict__.get("forward", _NO_FORWARD) for m in modules]
    for module in modules:
        # An instance attribute shadows the class's forward for this module only; `nn.Module.__call__` (and
        # its hooks) still runs around it.
        module.forward = _chunked(module.forward, rows)
    try:
        yield sum(1 for layer in layers if any(m is layer.mlp for m in modules))
    finally:
        for module, forward in zip(modules, previous, strict=True):
            if forward is _NO_FORWARD:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = forward
