"""The `ppl` noise floor's observer: the reference's window logits with BF16-sized noise on every decoder
layer's output (`evalsuite.backends.layer_noise`), stored like any other window logits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field

from evalsuite.backends.layer_noise import BF16_ROUNDING, noisy_scored_states, noisy_window_logits, perturbed
from evalsuite.backends.layer_pass import LayerStep, LayerVisitor
from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import StrictModel
from evalsuite.observers.compact_window_logits import CANDIDATE_NAME, LogitsAtReference
from evalsuite.observers.window_logits import WindowLogits, WindowLogitsVisitor
from evalsuite.protocol.task import Inputs, Progress

if TYPE_CHECKING:
    from evalsuite.backends import Backend, ChunkedHead
    from evalsuite.backends.chunked_head import ScoredStates
    from evalsuite.backends.streamed import StreamedBackend, WindowCall

OBSERVER_NAME = "window-logits-noise"
AT_REFERENCE_NAME = f"{CANDIDATE_NAME}-noise"
NOISY = "noisy"


class NoiseFloorOptions(StrictModel):
    """`[noise_floor]` of the ppl spec: off in `run`, on in `compare` (the reference run again with noise).

    The floor is drawn `draws` times, with seeds `seed`, `seed` + 1, …: their per-token KLDs are averaged,
    and the spread of their means is reported beside the floor. A candidate is `within` the floor when its
    mean KLD is shown to be at most (1 + `margin`) × the floor's: the one-sided upper 95% bound of the mean
    of kld − (1 + `margin`) · floor, per token, paired by token and window-clustered, is at most 0
    (`evalsuite.stats.claims.FloorComparison`); `above` when the lower bound exceeds 0, else
    `undetermined`."""

    enabled: bool = False
    # Relative noise on each layer's output: positive (zero would make the floor 0 by construction) and
    # below 1 (noise as large as the signal is no rounding).
    scale: float = Field(default=BF16_ROUNDING, gt=0, lt=1)
    seed: int = 0
    draws: int = Field(default=2, ge=1, le=8)
    # One floor's worth: a candidate shown to diverge by at most twice the divergence that re-rounding every
    # layer's output to BF16 causes is as close to the reference as the measurement can tell apart.
    margin: float = Field(default=1.0, ge=0)

    def draw(self, index: int) -> NoiseFloorOptions:
        """The options of the `index`-th draw (its own seed)."""
        return self.model_copy(update={"seed": self.seed + index})

    @staticmethod
    def label(index: int, base: str = "floor") -> str:
        """The need label of the `index`-th draw: `floor`, `floor_1`, …"""
        return base if index == 0 else f"{base}_{index}"


class NoisyBackend:
    """A backend whose `window_logits` carry the noise; everything else is the backend's own."""

    def __init__(self, backend: Backend, options: NoiseFloorOptions) -> None:
        self.backend, self.options = backend, options
        self.vocab_size = backend.vocab_size

    def describe(self) -> dict[str, Any]:
        noise = f"decoder-layer outputs × (1 + {self.options.scale:g}·z), seed {self.options.seed}"
        return {**self.backend.describe(), "noise": noise}

    def window_logits(self, windows: Any, positions: Any) -> Any:
        return noisy_window_logits(self.backend, windows, positions, self.options.scale, self.options.seed)


class NoisyWindowLogits(WindowLogits):
    """Observer: `WindowLogits` of the reference forwarded with seeded noise on its decoder layers."""

    name = OBSERVER_NAME

    def __init__(self, *args: Any, noise: NoiseFloorOptions, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.noise = noise

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "noise": {"scale": self.noise.scale, "seed": self.noise.seed}}

    def observe(self, backend: Backend, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        from evalsuite.backends.streamed import StreamedBackend

        if isinstance(backend, StreamedBackend):
            return super().observe(backend, inputs, folder, progress)  # a layer pass, with `visitor` below
        return super().observe(NoisyBackend(backend, self.noise), inputs, folder, progress)

    def visitor(self, backend: StreamedBackend, inputs: Inputs, folder: Path) -> LayerVisitor:
        """The noisy forward during a shared streamed pass: its own trajectory of states, each layer run on it
        while the layer is resident, so that the floor reads no layer again."""
        return NoisyVisitor(self, backend, inputs, folder)


class NoisyVisitor(WindowLogitsVisitor):
    """Carries the noisy states: each layer's output on them, perturbed as `NoisyLayers` perturbs a loaded
    model's (the same draws), then the head on the last."""

    observer: NoisyWindowLogits

    def begin(self, calls: list[WindowCall], done: int, carry: dict[str, torch.Tensor]) -> None:
        if done == 0:
            self.noisy = [call.hidden for call in calls]
        else:
            stacked = carry[NOISY].to(self.backend.device)
            self.noisy = [stacked[w : w + 1] for w in range(len(calls))]

    def visit(self, step: LayerStep) -> None:
        noise = self.observer.noise
        self.noisy = [
            perturbed(
                step.backend.forward_layer(step.layer, step.index, hidden, call),
                call.window,
                step.index,
                noise.scale,
                noise.seed,
            )
            for hidden, call in zip(self.noisy, step.calls, strict=True)
        ]

    def carry(self) -> dict[str, torch.Tensor]:
        return {NOISY: torch.cat(self.noisy)}

    def finish(self, final: list[torch.Tensor], calls: list[WindowCall]) -> Observation:
        return super().finish(self.noisy, calls)


class NoisyLogitsAtReference(LogitsAtReference):
    """The floor on long windows: the reference forwarded with the seeded noise, observed as a candidate is
    (`LogitsAtReference`: its log-probs at the ids the reference's compact form kept, reduced chunk by chunk
    as the head makes them), so that it holds no window × vocabulary array either."""

    name = AT_REFERENCE_NAME
    what = "window logits with noise, at the reference's ids (chunked head)"

    def __init__(self, *args: Any, noise: NoiseFloorOptions, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.noise = noise

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "noise": {"scale": self.noise.scale, "seed": self.noise.seed}}

    def scored_states(
        self, backend: ChunkedHead, windows: torch.Tensor, positions: torch.Tensor
    ) -> Iterator[ScoredStates]:
        return noisy_scored_states(backend, windows, positions, self.noise.scale, self.noise.seed)
