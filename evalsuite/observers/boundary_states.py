"""The observation behind `layers` and `attribution`: a side's hidden states at every decoder-layer boundary.

The side is streamed (`evalsuite.backends.streamed`) over the windows of a `WindowProtocol`: boundary 0 is
what the first decoder layer receives (the embeddings), boundary i + 1 what layer i returns. Each boundary is
one safetensors file holding every window's states, (windows, tokens, hidden), in the compute dtype exactly
as the model produced them, so that the candidate's layer fed the reference's input is fed the very values
the reference's layer received. A file is written (atomically) as soon as its layer has run; the side's
layer pass (`evalsuite.backends.layer_pass`), shared with the other observations of its windows, resumes an
interrupted observation at the layer it stopped at.

Size: (layers + 1) × hidden × bytes per value, per token. MiniCPM-V 4.7's text model (40 layers, hidden
2,048, bf16) keeps 168 kB per token: 0.69 GB for the 4,096 tokens of the `ppl` protocol. That is what a
recording of the reference holds for these tasks: all of it is needed, since each layer's own error is that
layer fed the reference's input, compared with the reference's output.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import Field

from evalsuite.backends.layer_pass import LayerStep, LayerVisitor, QuietVisitor, observe_alone
from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import StrictModel
from evalsuite.errors import InputError
from evalsuite.files.run_folder import atomic_target
from evalsuite.observers.window_logits import WindowObserver, WindowProtocol, window_tensor
from evalsuite.protocol.task import Inputs, Progress
from evalsuite.stats import tensor_errors

if TYPE_CHECKING:
    from evalsuite.backends.streamed import StreamedBackend, WindowCall

OBSERVER_NAME = "boundary-states"
STATES = "states"


def boundary_file(folder: Path, boundary: int) -> Path:
    """Where boundary `boundary` (0: the embeddings; i + 1: the output of layer i) is written."""
    return folder / f"boundary-{boundary:03d}.safetensors"


def write_boundary(folder: Path, boundary: int, states: list[torch.Tensor]) -> Path:
    """Every window's states at one boundary, as one (windows, tokens, hidden) tensor, written atomically."""
    from safetensors.torch import save_file

    path = boundary_file(folder, boundary)
    with atomic_target(path) as tmp:
        save_file({STATES: torch.cat([s.detach().cpu() for s in states]).contiguous()}, str(tmp))
    return path


def read_boundary(observation: Observation, boundary: int) -> torch.Tensor:
    """The (windows, tokens, hidden) states of an observation at one boundary."""
    from safetensors.torch import load_file

    path = observation.files.get(f"boundary-{boundary:03d}")
    if path is None:
        raise InputError(f"the reference's states have no boundary {boundary}")
    return load_file(str(path))[STATES]


class ReferenceBoundaries:
    """The reference's states at each boundary, read from its observation's files as a pass asks for them:
    the last one read is kept, since a layer's output is the next layer's input."""

    def __init__(self, observation: Observation) -> None:
        self.observation = observation
        self._last: tuple[int, torch.Tensor] | None = None

    def read(self, boundary: int) -> torch.Tensor:
        """The (windows, tokens, hidden) states at `boundary`."""
        if self._last is None or self._last[0] != boundary:
            self._last = (boundary, read_boundary(self.observation, boundary))
        return self._last[1]


def check_same_model(states: Observation, backend: StreamedBackend, inputs: Inputs) -> None:
    """The reference's states fit this side: same layers, hidden size and tokens."""
    meta = states.meta
    if meta.get("tokens_sha256") != inputs["tokens_sha256"]:
        raise InputError("the reference's states were observed on other tokens")
    if meta.get("n_layers") != backend.n_layers:
        raise InputError(
            f"the sides differ in depth: the reference has {meta.get('n_layers')} decoder layers, the "
            f"candidate {backend.n_layers}"
        )


def state_errors(reference: torch.Tensor, candidate: torch.Tensor) -> np.ndarray:
    """`tensor_errors.ErrorSums` of two hidden-state tensors as one row: n, Σr², Σ(x−r)², Σx², Σr·x and
    max|x−r|."""
    r = reference.detach().float().cpu().numpy()
    x = candidate.detach().float().cpu().numpy()
    e = tensor_errors.error_sums(r, x)
    return np.array([e.n, e.ref_sq, e.err_sq, e.cand_sq, e.dot, e.max_abs], dtype=np.float64)


def summed_errors(rows: np.ndarray) -> tensor_errors.ErrorSums:
    """Rows of `state_errors` (e.g. one per window) added into one `tensor_errors.ErrorSums`."""
    total = tensor_errors.ErrorSums(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    for n, ref_sq, err_sq, cand_sq, dot, max_abs in np.asarray(rows).reshape(-1, 6):
        total = total + tensor_errors.ErrorSums(int(n), ref_sq, err_sq, cand_sq, dot, max_abs)
    return total


class FedOptions(StrictModel):
    """Which windows the candidate's layers are run on a second time, fed the reference's input (`layers`'
    own error per layer; `moe`'s fed routing and each expert on the reference's tokens).

    That second forward of every candidate layer (and the experts' forward on the reference's tokens, on both
    sides) is what these tasks add to the two forwards `ppl` needs: on all eight windows of a wide MoE model
    it costs more than half again. It runs on `windows` of the protocol's windows, evenly spread (the first
    and the last for two), or on every window where the protocol has no more; what runs on every window
    (the accumulated drift, routing on the candidate's own prefix and by its router alone, expert usage)
    keeps every window. Changing it makes new observations."""

    windows: int = Field(2, ge=1)

    def indices(self, n_windows: int) -> tuple[int, ...]:
        """The windows fed the reference's input, of `n_windows`, evenly spread, in order."""
        k = min(self.windows, n_windows)
        if k == 1:
            return (0,)
        return tuple(sorted({round(i * (n_windows - 1) / (k - 1)) for i in range(k)}))


class FedWindowObserver(WindowObserver):
    """Base of the observers whose work on the reference's input runs on the windows of `FedOptions`: the
    protocol and those options are their identity."""

    def __init__(self, protocol: WindowProtocol, fed: FedOptions | None = None) -> None:
        super().__init__(protocol)
        self.fed = fed or FedOptions()

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "fed": self.fed.model_dump(mode="json")}


class BoundaryStates(WindowObserver):
    """Observer: the hidden states of every window at every decoder-layer boundary, one file per boundary.
    Needs a streamed side (`Need(..., streamed=True)`); rides the side's shared layer pass."""

    name = OBSERVER_NAME

    def observe(
        self, backend: StreamedBackend, inputs: Inputs, folder: Path, progress: Progress
    ) -> Observation:
        return observe_alone(
            self.visitor(backend, inputs, folder), backend, window_tensor(inputs), folder, progress
        )

    def visitor(self, backend: StreamedBackend, inputs: Inputs, folder: Path) -> LayerVisitor:
        return BoundaryVisitor(backend, inputs, folder)

    def record(self, observation: Observation, folder: Path) -> Observation:
        """All of it: every boundary is needed (see the module docstring for the size)."""
        meta = {**observation.meta, "kind": "recorded"}
        return Observation(
            name=observation.name, key=observation.key, meta=meta, files=dict(observation.files)
        )


class BoundaryVisitor(QuietVisitor):
    """`BoundaryStates` during a layer pass: each boundary's file written as soon as its layer has run."""

    def __init__(self, backend: StreamedBackend, inputs: Inputs, folder: Path) -> None:
        self.backend, self.inputs, self.folder = backend, inputs, folder

    def begin(self, calls: list[WindowCall], done: int, carry: dict[str, torch.Tensor]) -> None:
        if done == 0:
            write_boundary(self.folder, 0, [call.hidden for call in calls])

    def visit(self, step: LayerStep) -> None:
        write_boundary(self.folder, step.index + 1, step.after)

    def finish(self, final: list[torch.Tensor], calls: list[WindowCall]) -> Observation:
        backend, inputs, n = self.backend, self.inputs, self.backend.n_layers
        hidden, dtype = int(final[0].shape[-1]), final[0].dtype
        return Observation(
            name=OBSERVER_NAME,
            meta={
                "n_layers": n,
                "layer_kinds": backend.layer_kinds(),
                "hidden_size": hidden,
                "dtype": str(dtype).removeprefix("torch."),
                "bytes_per_token": (n + 1) * hidden * dtype.itemsize,
                "n_windows": len(calls),
                "window_starts": list(inputs["starts"]),
                "tokens_sha256": inputs["tokens_sha256"],
                "corpus": inputs["corpus"],
                "execution": backend.describe(),
            },
            files={f"boundary-{b:03d}": boundary_file(self.folder, b) for b in range(n + 1)},
        )
