"""The observation behind `layers` and `attribution`: a side's hidden states at every decoder-layer boundary.

The side is streamed (`evalsuite.backends.streamed`) over the windows of a `WindowProtocol`: boundary 0 is
what the first decoder layer receives (the embeddings), boundary i + 1 what layer i returns. Each boundary is
one safetensors file holding every window's states, (windows, tokens, hidden), in the compute dtype exactly
as the model produced them, so that the candidate's layer fed the reference's input is fed the very values
the reference's layer received. A file is written (atomically) as soon as its layer has run, and an
interrupted observation resumes from the last boundary written.

Size: (layers + 1) × hidden × bytes per value, per token. MiniCPM-V 4.7's text model (40 layers, hidden
2,048, bf16) keeps 168 kB per token: 0.69 GB for the 4,096 tokens of the `ppl` protocol. That is what a
recording of the reference holds for these tasks: all of it is needed, since each layer's own error is that
layer fed the reference's input, compared with the reference's output.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from evalsuite import metrics
from evalsuite.errors import InputError
from evalsuite.observation import Observation
from evalsuite.task import Inputs, Progress
from evalsuite.tasks.window_logits import WindowObserver, window_tensor

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
    tmp = path.with_suffix(".tmp")
    save_file({STATES: torch.cat([s.detach().cpu() for s in states]).contiguous()}, str(tmp))
    os.replace(tmp, path)
    return path


def read_boundary(observation: Observation, boundary: int) -> torch.Tensor:
    """The (windows, tokens, hidden) states of an observation at one boundary."""
    from safetensors.torch import load_file

    path = observation.files.get(f"boundary-{boundary:03d}")
    if path is None:
        raise InputError(f"the reference's states have no boundary {boundary}")
    return load_file(str(path))[STATES]


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
    """`metrics.ErrorSums` of two hidden-state tensors as a row (n, Σr², Σ(x−r)², Σx², Σr·x, max|x−r|)."""
    r = reference.detach().float().cpu().numpy()
    x = candidate.detach().float().cpu().numpy()
    e = metrics.error_sums(r, x)
    return np.array([e.n, e.ref_sq, e.err_sq, e.cand_sq, e.dot, e.max_abs], dtype=np.float64)


def summed_errors(rows: np.ndarray) -> metrics.ErrorSums:
    """Rows of `state_errors` (e.g. one per window) added into one `metrics.ErrorSums`."""
    total = metrics.ErrorSums(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    for n, ref_sq, err_sq, cand_sq, dot, max_abs in np.asarray(rows).reshape(-1, 6):
        total = total + metrics.ErrorSums(int(n), ref_sq, err_sq, cand_sq, dot, max_abs)
    return total


class BoundaryStates(WindowObserver):
    """Observer: the hidden states of every window at every decoder-layer boundary, one file per boundary.
    Needs a streamed side (`Need(..., streamed=True)`)."""

    name = OBSERVER_NAME

    def observe(
        self, backend: StreamedBackend, inputs: Inputs, folder: Path, progress: Progress
    ) -> Observation:
        windows = window_tensor(inputs)
        calls: list[WindowCall] = [backend.capture(window) for window in windows]
        n = backend.n_layers
        step = progress("layer boundaries", n + 1)
        # Resume from the last boundary of an unbroken run of them written by an interrupted observation.
        first_missing = next((b for b in range(n + 1) if not boundary_file(folder, b).is_file()), n + 1)
        if first_missing == 0:
            start, states = 0, [call.hidden for call in calls]
            write_boundary(folder, 0, states)
        else:
            from safetensors.torch import load_file

            start = first_missing - 1
            stacked = load_file(str(boundary_file(folder, start)))[STATES].to(backend.device)
            states = [stacked[w : w + 1] for w in range(len(windows))]
        for _ in range(start + 1):
            step()
        for index in range(start, n):
            with backend.resident(index) as layer:
                states = [
                    backend.forward_layer(layer, index, h, c) for h, c in zip(states, calls, strict=True)
                ]
            write_boundary(folder, index + 1, states)
            step()
        hidden, dtype = int(states[0].shape[-1]), states[0].dtype
        return Observation(
            name=self.name,
            meta={
                "n_layers": n,
                "layer_kinds": backend.layer_kinds(),
                "hidden_size": hidden,
                "dtype": str(dtype).removeprefix("torch."),
                "bytes_per_token": (n + 1) * hidden * dtype.itemsize,
                "n_windows": len(windows),
                "window_starts": list(inputs["starts"]),
                "tokens_sha256": inputs["tokens_sha256"],
                "corpus": inputs["corpus"],
                "execution": backend.describe(),
            },
            files={f"boundary-{b:03d}": boundary_file(folder, b) for b in range(n + 1)},
        )

    def record(self, observation: Observation, folder: Path) -> Observation:
        """All of it: every boundary is needed (see the module docstring for the size)."""
        meta = {**observation.meta, "kind": "recorded"}
        return Observation(
            name=observation.name, key=observation.key, meta=meta, files=dict(observation.files)
        )
