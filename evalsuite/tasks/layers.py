"""Per-layer diff: where in the depth of the model the candidate's hidden states leave the reference's.

Both sides run streamed, one decoder layer resident at a time, over the `ppl` windows. Per decoder layer, over
every token of every window, the relative Frobenius error, cosine and SQNR of the candidate's hidden states
against the reference's:

- **drift**: each side on its own prefix (the candidate's layer fed the candidate's own states): the error
  accumulated up to and including this layer;
- **own**: the candidate's layer fed the reference's input for this layer: this layer's own error, whatever
  came before. An unchanged layer has exactly 0 here (same weights, same input, same arithmetic). That is a
  second forward of every candidate layer; it runs on the windows of the spec's `[fed]` (`FedOptions`).

Design (one model resident at a time): the reference's states at every layer boundary are one observation
(`BoundaryStates`, on the reference streamed alone, recordable); the candidate's observation consumes it
(`Need.consumes`) and streams the candidate alone, feeding each of its layers both its own states and the
reference's, read back from the boundary files. No moment holds a layer of each side, let alone two models,
and a recorded reference serves without its weights. The price is the reference's boundary states on disk:
(layers + 1) × hidden × 2 bytes per token in bf16 (`evalsuite.observers.boundary_states`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from evalsuite.backends.layer_pass import LayerStep, LayerVisitor, QuietVisitor, ReferenceInput, observe_alone
from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import TaskSpec
from evalsuite.observers.boundary_states import (
    BoundaryStates,
    FedOptions,
    FedWindowObserver,
    ReferenceBoundaries,
    check_same_model,
    state_errors,
    summed_errors,
)
from evalsuite.observers.window_logits import WindowProtocol, prepare_windows, window_tensor
from evalsuite.plotting import plots
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import Inputs, Need, Progress, RunContext, TaskResult, task

if TYPE_CHECKING:
    from evalsuite.backends.streamed import StreamedBackend, WindowCall


class LayersSpec(TaskSpec):
    protocol: WindowProtocol = WindowProtocol()
    fed: FedOptions = FedOptions()


class LayerErrors(FedWindowObserver):
    """Observer of the candidate: per layer and window, the error sums of its hidden states against the
    reference's (consumed as `inputs["observed"]["ref"]`), on its own prefix and fed the reference's input."""

    name = "layer-errors"

    def observe(
        self, backend: StreamedBackend, inputs: Inputs, folder: Path, progress: Progress
    ) -> Observation:
        return observe_alone(
            self.visitor(backend, inputs, folder), backend, window_tensor(inputs), folder, progress
        )

    def visitor(self, backend: StreamedBackend, inputs: Inputs, folder: Path) -> LayerVisitor:
        reference = inputs["observed"]["ref"]
        check_same_model(reference, backend, inputs)
        return LayerErrorsVisitor(backend, inputs, reference, self.fed)


class LayerErrorsVisitor(QuietVisitor):
    """`LayerErrors` during the candidate's layer pass: the pass's states are the candidate's own prefix; the
    layer is run on the reference's input to it (`reference_input`)."""

    def __init__(
        self, backend: StreamedBackend, inputs: Inputs, reference: Observation, fed: FedOptions
    ) -> None:
        self.backend, self.inputs, self.reference = backend, inputs, reference
        self.boundaries = ReferenceBoundaries(reference)
        self.fed_windows = fed.indices(len(inputs["windows"]))

    def begin(self, calls: list[WindowCall], done: int, carry: dict[str, torch.Tensor]) -> None:
        n, n_windows = self.backend.n_layers, len(calls)
        self.drift = carry["drift"].numpy() if done else np.zeros((n, n_windows, 6))
        self.own = carry["own"].numpy() if done else np.zeros((n, n_windows, 6))
        ref_in = self.boundaries.read(0)
        self.embeddings = np.stack([state_errors(ref_in[w], calls[w].hidden[0]) for w in range(n_windows)])

    def reference_input(self, index: int) -> ReferenceInput:
        return ReferenceInput(self.boundaries.read(index), self.fed_windows)

    def visit(self, step: LayerStep) -> None:
        assert step.fed is not None
        ref_out = self.boundaries.read(step.index + 1)
        for w in range(len(step.calls)):
            self.drift[step.index, w] = state_errors(ref_out[w], step.after[w][0])
        for w, out in step.fed.items():
            self.own[step.index, w] = state_errors(ref_out[w], out[0])

    def carry(self) -> dict[str, torch.Tensor]:
        return {"drift": torch.from_numpy(self.drift), "own": torch.from_numpy(self.own)}

    def finish(self, final: list[torch.Tensor], calls: list[WindowCall]) -> Observation:
        backend = self.backend
        return Observation(
            name=LayerErrors.name,
            meta={
                "n_layers": backend.n_layers,
                "layer_kinds": backend.layer_kinds(),
                "tokens_sha256": self.inputs["tokens_sha256"],
                "n_windows": len(calls),
                "fed_windows": list(self.fed_windows),
                "execution": backend.describe(),
                "ref_execution": self.reference.meta.get("execution", {}),
            },
            arrays={"drift": self.drift, "own": self.own, "embeddings": self.embeddings},
        )


@task("layers")
class Layers:
    """Hidden-state error per decoder layer: on the candidate's own prefix, and fed the reference's input.

    Both sides run streamed; the reference's boundary states are its observation (recordable)."""

    spec_model: ClassVar[type[TaskSpec]] = LayersSpec
    metric_names: ClassVar[tuple[str, ...]] = (
        "n_layers",
        "worst_layer",
        "worst_layer_rel_err",
        "final_hidden_rel_err",
        "final_hidden_cosine",
        "final_hidden_sqnr_db",
        "embeddings_rel_err",
    )

    def __init__(self, spec: LayersSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """The `ppl` windows, tokenized once."""
        return prepare_windows(self.spec.protocol, self.context.corpus, ref, ckpt, self.context.shared)

    def needs(self) -> list[Need]:
        return [
            Need("ref", "ref", BoundaryStates(self.spec.protocol), streamed=True),
            Need(
                "ckpt",
                "ckpt",
                LayerErrors(self.spec.protocol, self.spec.fed),
                streamed=True,
                consumes=("ref",),
            ),
        ]

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        ref, ckpt = observed["ref"], observed["ckpt"]
        drift = [summed_errors(rows) for rows in ckpt.arrays["drift"]]
        own = [summed_errors(rows) for rows in ckpt.arrays["own"]]
        kinds = ckpt.meta["layer_kinds"]
        rows = [
            {
                "layer": i,
                "kind": kinds[i],
                "own_rel_err": o.relative_frobenius_error,
                "own_cosine": o.cosine,
                "own_sqnr_db": o.sqnr_db,
                "drift_rel_err": d.relative_frobenius_error,
                "drift_cosine": d.cosine,
                "drift_sqnr_db": d.sqnr_db,
            }
            for i, (o, d) in enumerate(zip(own, drift, strict=True))
        ]
        own_err = np.array([o.relative_frobenius_error for o in own])
        worst = int(np.argmax(own_err))  # the first of equals
        final = drift[-1]
        values: dict[str, Any] = {
            "corpus": ref.meta["corpus"],
            "n_windows": ckpt.meta["n_windows"],
            "n_tokens": int(final.n // ref.meta["hidden_size"]),
            # the windows the layers' own errors were measured on (the spec's [fed])
            "own_windows": ", ".join(str(w) for w in ckpt.meta["fed_windows"]),
            "n_layers": len(rows),
            "worst_layer": worst,
            "worst_layer_kind": kinds[worst],
            "worst_layer_rel_err": float(own_err[worst]),
            "final_hidden_rel_err": final.relative_frobenius_error,
            "final_hidden_cosine": final.cosine,
            "final_hidden_sqnr_db": final.sqnr_db,
            "embeddings_rel_err": summed_errors(ckpt.arrays["embeddings"]).relative_frobenius_error,
            "ref_state_bytes_per_token": ref.meta["bytes_per_token"],
            "tokens_sha256": ckpt.meta["tokens_sha256"],
        }
        checks, _ = self.spec.threshold_checks(values)
        made = {}
        if self.context.plots:
            plots.layer_errors(
                own_err, [d.relative_frobenius_error for d in drift], artifacts / "layers_rel_err.png", kinds
            )
            made["rel_err_by_layer"] = f"{artifacts.name}/layers_rel_err.png"
        return TaskResult.from_checks(values, checks, details=rows, artifacts=made)
