"""Seeded multiplicative noise on each decoder layer's output: the forward a noise floor is measured with.

The reference run again with every decoder layer's output multiplied by (1 + ε·z), z standard normal and ε
= 2⁻⁹ (half BF16's unit roundoff u = 2⁻⁸, about the size of the relative error rounding to BF16 makes; the
scale exllamav3's `eval/qbench/measure.py` names `BF16_ROUNDING_EPS`), is a model that differs from the
reference by rounding-sized perturbations alone: its KL divergence from the reference is the scale a
candidate's divergence is read against (how small a difference a test on this text resolves is another
figure, the minimum detectable effect of `evalsuite.stats.claims`). The draws are seeded by the window's own
tokens and the layer's index, so a window gets the same noise whenever and in whichever order it is
forwarded (a resumed observation included).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from evalsuite.backends.streamed import StreamedBackend, decoder_layers
from evalsuite.errors import InputError

BF16_ROUNDING = 2.0**-9


def _seed(seed: int, window: torch.Tensor, layer: int) -> int:
    digest = hashlib.sha256(f"{seed}:{layer}:".encode())
    digest.update(np.ascontiguousarray(window.cpu().numpy(), dtype="<i8").tobytes())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def perturbed(
    hidden: torch.Tensor, window: torch.Tensor, layer: int, scale: float, seed: int
) -> torch.Tensor:
    """`hidden` (decoder layer `layer`'s output on `window`'s tokens) × (1 + scale·z) in float32, cast back to
    its dtype; z drawn from the seed, the window's tokens and the layer's index."""
    generator = torch.Generator(device=hidden.device).manual_seed(_seed(seed, window, layer))
    z = torch.randn(hidden.shape, generator=generator, device=hidden.device, dtype=torch.float32)
    return (hidden.float() * (1.0 + scale * z)).to(hidden.dtype)


class NoisyLayers:
    """Forward hooks on a Transformers model's decoder layers that multiply each layer's output (the hidden
    states, the first element of a tuple output) by 1 + scale·z in float32, cast back to its dtype."""

    def __init__(self, model: Any, checkpoint: Any, scale: float, seed: int) -> None:
        self.layers, _ = decoder_layers(model, checkpoint)
        self.scale, self.seed = scale, seed
        self.window: torch.Tensor | None = None

    def _perturb(self, index: int, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        assert self.window is not None
        noisy = perturbed(hidden, self.window, index, self.scale, self.seed)
        return (noisy, *output[1:]) if isinstance(output, tuple) else noisy

    @contextlib.contextmanager
    def attached(self) -> Iterator[NoisyLayers]:
        """The hooks, on for the duration of the block."""
        handles = [
            layer.register_forward_hook(lambda _m, _a, out, i=i: self._perturb(i, out))
            for i, layer in enumerate(self.layers)
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def noisy_window_logits(
    backend: Any, windows: torch.Tensor, positions: torch.Tensor, scale: float, seed: int
) -> Iterator[torch.Tensor]:
    """`backend.window_logits` of each window with seeded noise on every decoder layer's output. Needs a
    backend that runs a whole Transformers model (`model` and `checkpoint`)."""
    return _noisy_windows(backend, windows, scale, seed, lambda w: backend.window_logits(w, positions))


def noisy_scored_states(
    backend: Any, windows: torch.Tensor, positions: torch.Tensor, scale: float, seed: int
) -> Iterator[Any]:
    """`backend.window_scored_states` (the chunked head's states) of each window with the seeded noise of
    `noisy_window_logits`: by hooks on a loaded model, by replacing each layer's output on a streamed one."""
    if isinstance(backend, StreamedBackend):

        def after_layer(hidden: torch.Tensor, call: Any, index: int) -> torch.Tensor:
            return perturbed(hidden, call.window, index, scale, seed)

        return backend.window_scored_states(windows, positions, after_layer)
    return _noisy_windows(backend, windows, scale, seed, lambda w: backend.window_scored_states(w, positions))


EachWindow = Callable[[torch.Tensor], Iterator[Any]]


def _noisy_windows(
    backend: Any, windows: torch.Tensor, scale: float, seed: int, each: EachWindow
) -> Iterator[Any]:
    """What `each` yields for every window (a batch of one), run with `NoisyLayers` on the backend's model."""
    model = getattr(backend, "model", None)
    if model is None:
        raise InputError(
            f"the noise floor runs the reference through Transformers with hooks on its decoder layers; "
            f"backend {backend.describe().get('backend')} exposes no such model (streamed or exllamav3)"
        )
    return _hooked(NoisyLayers(model, backend.checkpoint, scale, seed), windows, each)


def _hooked(noisy: NoisyLayers, windows: torch.Tensor, each: EachWindow) -> Iterator[Any]:
    with noisy.attached():
        for window in windows:
            noisy.window = window
            yield from each(window[None])
