"""One streamed pass over a side's decoder layers, shared by every observation that forwards the same windows.

A streamed side reads each decoder layer from the files, runs it and frees it (`evalsuite.backends.streamed`).
Reading a layer is most of a streamed run's time on a large model, and `ppl`, `moe`, `layers` and the noise
floor all push the same windows through the same layers; so they ride one pass: each layer is materialised
once, the windows' hidden states go through it once, and every observation taking part (a `LayerVisitor`)
sees the layer while it is resident:

- `tap(index, layer)`: hooks around the pass's own forward of each window (a router's outputs, say);
- `reference_input(index)`: the reference's input to this layer and the windows to run it on, for
  observations of the candidate that feed the candidate's layer the reference's states; the layer runs on each
  such window once whichever observations ask, with every visitor's `fed_tap` on;
- `visit(step)`: the layer's inputs and outputs on the pass's own states (and on the reference's input);
- `finish(final)`: the last layer's outputs, from which an observation of logits applies the head.

Resuming: after each layer, each visitor's folder receives the pass's states at that boundary with what the
visitor carries (`carry`: its accumulated sums, a trajectory of its own), written atomically. An interrupted
pass resumes at the first layer one of its visitors has not seen, from the states of that boundary; a visitor
that had gone further skips the layers it has seen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from evalsuite.backends.token_chunks import mlp_in_chunks
from evalsuite.observation import Observation

if TYPE_CHECKING:
    from evalsuite.backends.streamed import StreamedBackend, WindowCall

PASS_STATE = "layer-pass.safetensors"
_STATES = "pass.states"
_CARRY = "carry."


@dataclass
class LayerStep:
    """What a visitor sees of one decoder layer: the resident layer, every window's input and output on the
    pass's own states, and, where some visitor asked for it, the layer's output on the reference's input."""

    index: int
    layer: nn.Module
    before: list[torch.Tensor]
    after: list[torch.Tensor]
    calls: list[WindowCall]
    backend: StreamedBackend
    reference_input: ReferenceInput | None = None
    fed: dict[int, torch.Tensor] | None = None  # window → the layer's output on the reference's input


@dataclass(frozen=True)
class ReferenceInput:
    """The reference's input to one layer, every window's (windows, tokens, hidden) on the CPU, and the
    windows a visitor wants the candidate's layer run on."""

    states: torch.Tensor
    windows: tuple[int, ...]


@runtime_checkable
class LayerVisitor(Protocol):
    """One observation made during a shared layer pass (module docstring)."""

    def begin(self, calls: list[WindowCall], done: int, carry: dict[str, torch.Tensor]) -> None:
        """Before the first layer: the windows' captured calls (`calls[w].hidden`: the embeddings), how many
        layers an interrupted pass had shown this visitor, and what it carried then (empty if `done` is 0)."""
        ...

    def tap(self, index: int, layer: nn.Module) -> AbstractContextManager[Any]:
        """Hooks around the pass's forward of one window through layer `index` (entered once per window, in
        window order)."""
        ...

    def reference_input(self, index: int) -> ReferenceInput | None:
        """The reference's input to layer `index` and the windows to run the layer on, when this visitor wants
        the layer run on it; else None."""
        ...

    def fed_tap(self, index: int, layer: nn.Module) -> AbstractContextManager[Any]:
        """Hooks around the layer's forward of one window of the reference's input (once per window asked
        for, in window order)."""
        ...

    def visit(self, step: LayerStep) -> None:
        """Layer `step.index` while it is resident; files the visitor writes per layer are written here."""
        ...

    def carry(self) -> dict[str, torch.Tensor]:
        """What the visitor needs to resume after this layer (tensors; saved with the pass's states)."""
        ...

    def finish(self, final: list[torch.Tensor], calls: list[WindowCall]) -> Observation:
        """The observation, from every window's last-layer output."""
        ...


class QuietVisitor:
    """Defaults for a `LayerVisitor` that needs no hook, no reference input and carries nothing."""

    def begin(self, calls: list[WindowCall], done: int, carry: dict[str, torch.Tensor]) -> None:
        return None

    def tap(self, index: int, layer: nn.Module) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def reference_input(self, index: int) -> ReferenceInput | None:
        return None

    def fed_tap(self, index: int, layer: nn.Module) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def visit(self, step: LayerStep) -> None:
        return None

    def carry(self) -> dict[str, torch.Tensor]:
        return {}


def _saved(folder: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """(layers done, tensors) of a visitor's pass state; (0, {}) when it has none."""
    path = folder / PASS_STATE
    if not path.is_file():
        return 0, {}
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        done = int((handle.metadata() or {}).get("done", "0"))
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    return done, tensors


def _save(folder: Path, done: int, states: list[torch.Tensor], carry: dict[str, torch.Tensor]) -> None:
    """The pass's states after `done` layers and the visitor's carry, replacing the previous ones atomically
    (a resumed pass needs one consistent boundary, never the newest bytes: no fsync)."""
    from safetensors.torch import save_file

    tensors = {_STATES: torch.cat([s.detach().cpu() for s in states]).contiguous()}
    tensors.update({_CARRY + name: t.detach().cpu().contiguous() for name, t in carry.items()})
    path = folder / PASS_STATE
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"done": str(done)})
    os.replace(tmp, path)


def run_layer_pass(
    backend: StreamedBackend,
    windows: torch.Tensor,
    visitors: Sequence[tuple[LayerVisitor, Path]],
    step: Callable[[], None] | None = None,
) -> list[Observation]:
    """Every window through every decoder layer of a streamed side once, each layer read from the files once,
    shown to every visitor (module docstring); each visitor's observation, in order. `step` is called once per
    layer (a progress line)."""
    calls = [backend.capture(window) for window in windows]
    saved = [_saved(folder) for _, folder in visitors]
    start = min(done for done, _ in saved)
    if start == 0:
        states = [call.hidden for call in calls]
    else:
        stacked = next(tensors for done, tensors in saved if done == start)[_STATES].to(backend.device)
        states = [stacked[w : w + 1] for w in range(len(windows))]
    for (visitor, _), (done, tensors) in zip(visitors, saved, strict=True):
        carry = {k.removeprefix(_CARRY): t for k, t in tensors.items() if k.startswith(_CARRY)}
        visitor.begin(calls, done, carry)
    for _ in range(start):
        if step is not None:
            step()
    length = int(windows.shape[-1])
    for index in range(start, backend.n_layers):
        active = [(v, f) for (v, f), (done, _) in zip(visitors, saved, strict=True) if index >= done]
        with backend.resident(index) as layer, mlp_in_chunks(layer, length=length):
            after = []
            for hidden, call in zip(states, calls, strict=True):
                # Hooks go on around each window's forward alone: what they collect is that window's.
                with contextlib.ExitStack() as taps:
                    for visitor, _ in active:
                        taps.enter_context(visitor.tap(index, layer))
                    after.append(backend.forward_layer(layer, index, hidden, call))
            layer_step = LayerStep(index, layer, states, after, calls, backend)
            steps = _fed_reference(layer_step, [v for v, _ in active])
            for (visitor, folder), visitor_step in zip(active, steps, strict=True):
                visitor.visit(visitor_step)
                _save(folder, index + 1, after, visitor.carry())
        states = after
        if step is not None:
            step()
    return [visitor.finish(states, calls) for visitor, _ in visitors]


def observe_alone(
    visitor: LayerVisitor,
    backend: StreamedBackend,
    windows: torch.Tensor,
    folder: Path,
    progress: Callable[[str, int], Callable[[], None]],
) -> Observation:
    """One observation made by a layer pass of its own (when no other observation of the side shares it)."""
    return run_layer_pass(backend, windows, [(visitor, folder)], progress("layers", backend.n_layers))[0]


def _fed_reference(step: LayerStep, visitors: list[LayerVisitor]) -> list[LayerStep]:
    """The step each visitor sees: with the layer run on the reference's input to it, once per window asked
    for, for the visitors that ask (visitors handing the same states and windows share one run, their
    `fed_tap`s on)."""
    groups: list[tuple[ReferenceInput, list[int]]] = []
    for i, visitor in enumerate(visitors):
        reference = visitor.reference_input(step.index)
        if reference is None:
            continue
        group = next(
            (
                g
                for g in groups
                if g[0].windows == reference.windows and torch.equal(g[0].states, reference.states)
            ),
            None,
        )
        if group is None:
            groups.append((reference, [i]))
        else:
            group[1].append(i)
    steps = [step] * len(visitors)
    for reference, members in groups:
        fed = {}
        for w in reference.windows:
            with contextlib.ExitStack() as taps:
                for i in members:
                    taps.enter_context(visitors[i].fed_tap(step.index, step.layer))
                hidden = reference.states[w : w + 1].to(step.backend.device)
                fed[w] = step.backend.forward_layer(step.layer, step.index, hidden, step.calls[w])
        for i in members:
            steps[i] = dataclasses.replace(step, reference_input=reference, fed=fed)
    return steps
