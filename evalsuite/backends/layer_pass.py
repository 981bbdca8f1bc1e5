"""One streamed pass over a side's decoder layers, shared by every observation the side makes in it.

A streamed side reads each decoder layer from the files, runs it and frees it (`evalsuite.backends.streamed`).
Reading a layer is most of a streamed run's time on a large model, and `ppl`, `moe`, `layers` and the noise
floor push the same windows through the same layers, while `smoke` and `vision` push the reference's answers
(`evalsuite.observers.forced_answers`); so they ride one pass: each layer is materialised once, every
sequence any of them asks for goes through it once (`PassSequence`: a window, a prompt with its answer, an
image with its question and answer), and every observation taking part (a `LayerVisitor`) sees the layer
while it is resident, on its own sequences:

- `tap(index, layer)`: hooks around the pass's own forward of each of its sequences (a router's outputs);
- `reference_input(index)`: the reference's input to this layer and the windows to run it on, for
  observations of the candidate that feed the candidate's layer the reference's states; the layer runs on each
  such window once whichever observations ask, with every visitor's `fed_tap` on;
- `visit(step)`: the layer's inputs and outputs on the pass's own states (and on the reference's input);
- `finish(final)`: the last layer's outputs, from which an observation of logits applies the head.

Resuming: after each layer, each visitor's folder receives what it carries (`carry`: its accumulated sums, a
trajectory of its own) and the first visitor's folder every sequence's states at that boundary, written
atomically. An interrupted pass over the same sequences resumes at the first layer its visitors have not
seen; any other starts again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from evalsuite.backends.token_chunks import mlp_in_chunks
from evalsuite.contract.observation import Observation

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


@dataclass(frozen=True)
class PassSequence:
    """One sequence a pass runs through the layers: its token ids and, for a multimodal one, the rest of the
    model's inputs (its images, processed); `key` names it across observations, so that two observations
    asking for the same sequence share its forward."""

    key: str
    ids: torch.Tensor
    inputs: dict[str, Any] | None = None

    def capture(self, backend: StreamedBackend) -> WindowCall:
        """The model's own forward on this sequence up to its decoder layers (`StreamedBackend.capture`)."""
        if self.inputs is None:
            return backend.capture(self.ids)
        return backend.capture_inputs(self.inputs)


def window_sequences(windows: torch.Tensor, tokens_sha256: str) -> list[PassSequence]:
    """A protocol's windows (rows of token ids) as the sequences of a pass, keyed by their tokens' digest."""
    return [PassSequence(f"window:{tokens_sha256}:{w}", window) for w, window in enumerate(windows)]


def _keys_digest(sequences: Sequence[PassSequence]) -> str:
    return hashlib.sha256("\n".join(s.key for s in sequences).encode()).hexdigest()


def _saved(folder: Path) -> tuple[int, dict[str, torch.Tensor], dict[str, str]]:
    """(layers done, tensors, metadata) of a visitor's pass state; (0, {}, {}) when it has none."""
    path = folder / PASS_STATE
    if not path.is_file():
        return 0, {}, {}
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata() or {})
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    return int(metadata.get("done", "0")), tensors, metadata


def _save(
    folder: Path, done: int, carry: dict[str, torch.Tensor], states: list[torch.Tensor] | None, keys: str
) -> None:
    """A visitor's carry after `done` layers and, in the pass's first visitor's folder, every sequence's
    states at that boundary (`states`), replacing the previous ones atomically (a resumed pass needs one
    consistent boundary, never the newest bytes: no fsync)."""
    from safetensors.torch import save_file

    tensors = {_CARRY + name: t.detach().cpu().contiguous() for name, t in carry.items()}
    metadata = {"done": str(done), "sequences": keys}
    if states is not None:
        # Sequences differ in length: their states are kept end to end along the token axis.
        tensors[_STATES] = torch.cat([s.detach().cpu().reshape(-1, s.shape[-1]) for s in states]).contiguous()
        metadata["lengths"] = ",".join(str(s.reshape(-1, s.shape[-1]).shape[0]) for s in states)
    path = folder / PASS_STATE
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _restored(
    visitors: Sequence[tuple[LayerVisitor, Path, Sequence[PassSequence]]],
    sequences: list[PassSequence],
    calls: list[WindowCall],
    device: torch.device,
) -> tuple[int, list[torch.Tensor], list[tuple[int, dict[str, torch.Tensor]]]]:
    """Where an interrupted pass resumes: the first layer one of its visitors has not seen, every sequence's
    states at that boundary (from the first visitor's folder), and each visitor's (layers seen, carry). A
    pass whose saved states are not those of this pass's sequences at that boundary starts again."""
    keys = _keys_digest(sequences)
    saved = [_saved(folder) for _, folder, _ in visitors]
    mine = [(done, carry, meta) for done, carry, meta in saved if meta.get("sequences") == keys]
    start = min((done for done, _, _ in mine), default=0) if len(mine) == len(saved) else 0
    first_done, first, first_meta = saved[0]
    if start == 0 or first_done != start or _STATES not in first:
        fresh = [(0, {}) for _ in visitors]
        return 0, [call.hidden for call in calls], fresh
    lengths = [int(n) for n in first_meta["lengths"].split(",")]
    rows = first[_STATES].split(lengths)
    states = [r.reshape(call.hidden.shape).to(device) for r, call in zip(rows, calls, strict=True)]
    progress = []
    for done, tensors, _ in saved:
        progress.append(
            (done, {k.removeprefix(_CARRY): t for k, t in tensors.items() if k.startswith(_CARRY)})
        )
    return start, states, progress


def run_layer_pass(
    backend: StreamedBackend,
    visitors: Sequence[tuple[LayerVisitor, Path, Sequence[PassSequence]]],
    step: Callable[[], None] | None = None,
) -> list[Observation]:
    """Every visitor's sequences through every decoder layer of a streamed side once, each layer read from
    the files once, shown to every visitor (module docstring); each visitor's observation, in order. A
    sequence several visitors ask for (by key) is forwarded once; each visitor sees its own sequences, in
    its own order. `step` is called once per layer (a progress line)."""
    sequences: list[PassSequence] = []
    where: dict[str, int] = {}
    for _, _, own in visitors:
        for sequence in own:
            if sequence.key not in where:
                where[sequence.key] = len(sequences)
                sequences.append(sequence)
    mine = [[where[s.key] for s in own] for _, _, own in visitors]
    calls = [sequence.capture(backend) for sequence in sequences]
    backend.set_aside_vision()  # the captures merged the images' features; the layers never run the tower
    keys = _keys_digest(sequences)
    start, states, progress = _restored(visitors, sequences, calls, backend.device)
    for (visitor, _, _), (done, carry), own in zip(visitors, progress, mine, strict=True):
        visitor.begin([calls[i] for i in own], done, carry)
    for _ in range(start):
        if step is not None:
            step()
    length = max((int(call.hidden.shape[1]) for call in calls), default=1)
    for index in range(start, backend.n_layers):
        active = [
            (i, v, f)
            for i, ((v, f, _), (done, _)) in enumerate(zip(visitors, progress, strict=True))
            if index >= done
        ]
        with backend.resident(index) as layer, mlp_in_chunks(layer, length=length):
            after = []
            for s, (hidden, call) in enumerate(zip(states, calls, strict=True)):
                # Hooks go on around each sequence's forward alone, for the visitors that asked for it: what
                # they collect is that sequence's.
                with contextlib.ExitStack() as taps:
                    for i, visitor, _ in active:
                        if s in mine[i]:
                            taps.enter_context(visitor.tap(index, layer))
                    after.append(backend.forward_layer(layer, index, hidden, call))
            own_steps = [
                LayerStep(
                    index,
                    layer,
                    [states[s] for s in mine[i]],
                    [after[s] for s in mine[i]],
                    [calls[s] for s in mine[i]],
                    backend,
                )
                for i, _, _ in active
            ]
            steps = _fed_reference(
                own_steps, [v for _, v, _ in active], [tuple(mine[i]) for i, _, _ in active]
            )
            for n, ((i, visitor, folder), visitor_step) in enumerate(zip(active, steps, strict=True)):
                visitor.visit(visitor_step)
                first = i == 0
                _save(folder, index + 1, visitor.carry(), after if first else None, keys)
                del n
        states = after
        if step is not None:
            step()
    return [
        visitor.finish([states[s] for s in own], [calls[s] for s in own])
        for (visitor, _, _), own in zip(visitors, mine, strict=True)
    ]


def observe_alone(
    visitor: LayerVisitor,
    backend: StreamedBackend,
    windows: torch.Tensor | Sequence[PassSequence],
    folder: Path,
    progress: Callable[[str, int], Callable[[], None]],
    tokens_sha256: str = "",
) -> Observation:
    """One observation made by a layer pass of its own (when no other observation of the side shares it):
    over a protocol's windows (rows of token ids), or over sequences."""
    sequences = (
        window_sequences(windows, tokens_sha256) if isinstance(windows, torch.Tensor) else list(windows)
    )
    step = progress("layers", backend.n_layers)
    return run_layer_pass(backend, [(visitor, folder, sequences)], step)[0]


def _fed_reference(
    steps: list[LayerStep], visitors: list[LayerVisitor], sequences: list[tuple[int, ...]]
) -> list[LayerStep]:
    """The step each visitor sees: with the layer run on the reference's input to it, once per window asked
    for, for the visitors that ask (visitors of the same sequences handing the same states and windows share
    one run, their `fed_tap`s on)."""
    groups: list[tuple[ReferenceInput, tuple[int, ...], list[int]]] = []
    for i, visitor in enumerate(visitors):
        reference = visitor.reference_input(steps[i].index)
        if reference is None:
            continue
        group = next(
            (
                g
                for g in groups
                if g[1] == sequences[i]
                and g[0].windows == reference.windows
                and torch.equal(g[0].states, reference.states)
            ),
            None,
        )
        if group is None:
            groups.append((reference, sequences[i], [i]))
        else:
            group[2].append(i)
    out = list(steps)
    for reference, _, members in groups:
        step = steps[members[0]]
        fed = {}
        for w in reference.windows:
            with contextlib.ExitStack() as taps:
                for i in members:
                    taps.enter_context(visitors[i].fed_tap(step.index, step.layer))
                hidden = reference.states[w : w + 1].to(step.backend.device)
                fed[w] = step.backend.forward_layer(step.layer, step.index, hidden, step.calls[w])
        for i in members:
            out[i] = dataclasses.replace(steps[i], reference_input=reference, fed=fed)
    return out
