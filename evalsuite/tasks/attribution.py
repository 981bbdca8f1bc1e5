"""End-to-end KL attribution: which decoder layers (or module groups) of the candidate cost the most.

For each unit (a decoder layer; with `[units] by = "group"`, a module group of a layer: attention, routed
experts, shared expert, MLP), the reference is run with that unit alone replaced by the candidate's, and the
KL divergence of its next-token distribution from the reference's is measured on the `ppl` windows, at the
scored positions, over the full vocabulary. The units are sorted by their mean KLD; `additivity` is their sum
over the whole candidate's KLD (1 when the units' effects add up; the head is a unit of its own, and the
embeddings too when the sides' differ).

How it runs, both sides streamed in lockstep (one decoder layer of each resident at a time, `Need` role
`pair`): the reference's hidden states at every layer boundary are one observation (`BoundaryStates`, shared
with the `layers` task). The swap pass reads the reference's input to layer j from it, so each swap starts at
its own layer: the swapped unit's output, then the reference's later layers. All swaps advance together,
layer-major: at layer j the reference's layer j and the candidate's are resident, every swap started before j
goes through the reference's layer j, and the swaps of layer j's units start. Each layer of each side is read
once; the cost is a pass per unit through the layers after it (about layers² / 2 layer passes in all), and
memory holds the hidden states of every started swap. A unit whose tensors and modules are the same on both
sides gives exactly the reference's output and is not run (its KLD is exactly 0).

The swaps run the reference's own later layers, so the reference must be a checkpoint: against a recording
this task is skipped (record `layers` to replay the per-layer diff).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field, field_validator
from torch import nn

from evalsuite.contract.observation import Observation
from evalsuite.contract.spec import StrictModel, TaskSpec
from evalsuite.errors import InputError
from evalsuite.observers.boundary_states import BoundaryStates, check_same_model, read_boundary
from evalsuite.observers.window_logits import (
    WindowProtocol,
    log_softmax64,
    prepare_windows,
    window_tensor,
)
from evalsuite.plotting import plots
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import Inputs, Need, Progress, RunContext, TaskResult, TaskSkipped, task
from evalsuite.stats import metrics
from evalsuite.tasks.ppl import CompareOptions

if TYPE_CHECKING:
    from evalsuite.backends.streamed import StreamedPair


class UnitsSpec(StrictModel):
    """What a unit is: a whole decoder layer, or a module group of one. A group is the modules of a layer
    whose names (relative to the layer) match one of its patterns; a match that contains another group's match
    is left out, so an MoE layer's `mlp` splits into routed and shared experts while a dense layer's `mlp` is
    one unit."""

    by: Literal["layer", "group"] = "layer"
    groups: dict[str, list[str]] = Field(
        default_factory=lambda: {
            "attention": [r"^(self_attn|linear_attn|attn|attention)$"],
            "routed_experts": [r"^mlp\.experts$"],
            "shared_expert": [r"^mlp\.shared_experts?$"],
            "mlp": [r"^mlp$"],
        }
    )

    @field_validator("groups")
    @classmethod
    def _compile(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, patterns in value.items():
            for pattern in patterns:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ValueError(
                        f"group {name}: {pattern!r} is not a regular expression: {exc}"
                    ) from None
        return value


class AttributionSpec(TaskSpec):
    protocol: WindowProtocol = WindowProtocol()
    units: UnitsSpec = UnitsSpec()
    compare: CompareOptions = CompareOptions()


def module_groups(layer: nn.Module, spec: UnitsSpec) -> list[tuple[str, list[str]]]:
    """(group, module names inside the layer) of each group present in the layer, in the spec's order."""
    if spec.by == "layer":
        return [("", [""])]
    matches = {
        group: [n for n, _ in layer.named_modules() if n and any(re.search(p, n) for p in patterns)]
        for group, patterns in spec.groups.items()
    }
    claimed = {n for names in matches.values() for n in names}
    found = []
    for group, names in matches.items():
        kept = [n for n in names if not any(c != n and c.startswith(n + ".") for c in claimed)]
        if kept:
            found.append((group, kept))
    return found


def same_modules(a: nn.Module, b: nn.Module) -> bool:
    """Whether two modules compute the same function: same classes and quantization schemes throughout,
    and bit-identical tensors."""
    modules_a, modules_b = list(a.modules()), list(b.modules())
    if len(modules_a) != len(modules_b):
        return False
    for x, y in zip(modules_a, modules_b, strict=True):
        if type(x) is not type(y) or repr(getattr(x, "quantization_scheme", None)) != repr(
            getattr(y, "quantization_scheme", None)
        ):
            return False
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]) for k in sa
    )


@contextlib.contextmanager
def swapped(ref_layer: nn.Module, ckpt_layer: nn.Module, names: list[str]) -> Iterator[nn.Module]:
    """The reference's layer with the modules `names` (relative; "" is the whole layer) the candidate's."""
    if names == [""]:
        yield ckpt_layer
        return
    originals = {name: ref_layer.get_submodule(name) for name in names}
    try:
        for name in names:
            ref_layer.set_submodule(name, ckpt_layer.get_submodule(name))
        yield ref_layer
    finally:
        for name, module in originals.items():
            ref_layer.set_submodule(name, module)


def kld_rows(ref_logits: torch.Tensor, logits: torch.Tensor, chunk: int) -> np.ndarray:
    """KL(P_ref ‖ P) of each row, full vocabulary, float64, `chunk` rows at a time."""
    out = []
    for start in range(0, len(ref_logits), chunk):
        rows = slice(start, start + chunk)
        p = log_softmax64(ref_logits[rows].cpu()).numpy()
        q = log_softmax64(logits[rows].cpu()).numpy()
        out.append(metrics.kl_divergence(p, q))
    return np.concatenate(out)


class UnitSwaps:
    """Observer of both sides in lockstep (role `pair`): per unit and scored token, the KLD of the reference
    with that unit swapped for the candidate's, and of the whole candidate (see the module docstring)."""

    name = "unit-swaps"

    def __init__(self, protocol: WindowProtocol, units: UnitsSpec, chunk_rows: int) -> None:
        self.protocol, self.units, self.chunk_rows = protocol, units, chunk_rows

    def identity(self) -> dict[str, Any]:
        return {
            "protocol": self.protocol.model_dump(mode="json"),
            "units": self.units.model_dump(mode="json"),
        }

    def observe(self, pair: StreamedPair, inputs: Inputs, folder: Path, progress: Progress) -> Observation:
        ref, ckpt = pair.ref, pair.ckpt
        states = inputs["observed"]["ref"]
        check_same_model(states, ref, inputs)
        check_same_model(states, ckpt, inputs)
        windows = window_tensor(inputs)
        positions = self.protocol.positions
        calls = [ref.capture(w) for w in windows]
        own_calls = [ckpt.capture(w) for w in windows]
        names: list[str] = []
        identical: list[str] = []
        swaps: dict[int, list[torch.Tensor]] = {}
        if any(not torch.equal(r.hidden, c.hidden) for r, c in zip(calls, own_calls, strict=True)):
            names.append("embeddings")
            swaps[0] = [c.hidden for c in own_calls]
        whole = [c.hidden for c in own_calls]
        step = progress("layers (both sides)", ref.n_layers)
        for j in range(ref.n_layers):
            ref_in = read_boundary(states, j).to(ref.device)
            with ref.resident(j) as ref_layer, ckpt.resident(j) as ckpt_layer:
                for u, hidden in swaps.items():
                    swaps[u] = [
                        ref.forward_layer(ref_layer, j, h, c) for h, c in zip(hidden, calls, strict=True)
                    ]
                for group, modules in module_groups(ref_layer, self.units):
                    name = f"layer {j}" + (f" {group}" if group else "")
                    names.append(name)
                    if all(
                        same_modules(ref_layer.get_submodule(m), ckpt_layer.get_submodule(m)) for m in modules
                    ):
                        identical.append(name)
                        continue
                    with swapped(ref_layer, ckpt_layer, modules) as hybrid:
                        swaps[len(names) - 1] = [
                            ref.forward_layer(hybrid, j, ref_in[w : w + 1], c) for w, c in enumerate(calls)
                        ]
                whole = [
                    ckpt.forward_layer(ckpt_layer, j, h, c) for h, c in zip(whole, own_calls, strict=True)
                ]
            step()
        names.append("head")
        head = len(names) - 1
        final = read_boundary(states, ref.n_layers).to(ref.device)
        n_scored = len(positions)
        kld = np.zeros((len(names), len(windows) * n_scored))
        kld_whole = np.zeros(len(windows) * n_scored)
        for w, call in enumerate(calls):
            rows = slice(w * n_scored, (w + 1) * n_scored)
            ref_logits = ref.head_logits(final[w : w + 1], call, positions)
            for u, hidden in swaps.items():
                kld[u, rows] = kld_rows(
                    ref_logits, ref.head_logits(hidden[w], call, positions), self.chunk_rows
                )
            kld[head, rows] = kld_rows(
                ref_logits, ckpt.head_logits(final[w : w + 1], own_calls[w], positions), self.chunk_rows
            )
            kld_whole[rows] = kld_rows(
                ref_logits, ckpt.head_logits(whole[w], own_calls[w], positions), self.chunk_rows
            )
        return Observation(
            name=self.name,
            meta={
                "units": names,
                "identical_units": identical,
                "n_windows": len(windows),
                "tokens_sha256": inputs["tokens_sha256"],
                "execution": pair.describe(),
            },
            arrays={"kld": kld, "kld_whole": kld_whole},
        )


@task("attribution")
class Attribution:
    """KLD of the reference with each decoder layer (or module group) swapped for the candidate's, sorted.

    Both sides run streamed in lockstep; the reference must be a checkpoint, not a recording."""

    spec_model: ClassVar[type[TaskSpec]] = AttributionSpec
    metric_names: ClassVar[tuple[str, ...]] = (
        "n_units",
        "top_unit",
        "top_unit_kld",
        "top_unit_share",
        "sum_unit_kld",
        "whole_kld",
        "additivity",
    )

    def __init__(self, spec: AttributionSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """The `ppl` windows; skipped against a recorded reference, whose layers the swaps need."""
        if ref.is_recorded:
            raise TaskSkipped(
                "attribution runs the reference's own layers after each swapped unit, and a recording holds "
                "the reference's outputs, not its weights: give the reference checkpoint"
            )
        return prepare_windows(self.spec.protocol, self.context.corpus, ref, ckpt, self.context.shared)

    def needs(self) -> list[Need]:
        return [
            Need("ref", "ref", BoundaryStates(self.spec.protocol), streamed=True),
            Need(
                "swaps",
                "pair",
                UnitSwaps(self.spec.protocol, self.spec.units, self.spec.compare.kld_chunk_rows),
                consumes=("ref",),
            ),
        ]

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        swaps = observed["swaps"]
        names: list[str] = swaps.meta["units"]
        kld, whole = swaps.arrays["kld"], swaps.arrays["kld_whole"]
        if kld.shape[0] != len(names):
            raise InputError(f"the swap observation holds {kld.shape[0]} units for {len(names)} names")
        means = [metrics.mean_with_stderr(row) for row in kld]
        whole_mean = metrics.mean_with_stderr(whole)
        order = sorted(range(len(names)), key=lambda u: -means[u].value)
        total = float(sum(m.value for m in means))
        top = order[0]
        identical = set(swaps.meta.get("identical_units", []))
        rows = [
            {
                "rank": rank + 1,
                "unit": names[u],
                "kld_mean": means[u].value,
                "kld_mean_stderr": means[u].stderr,
                "share": means[u].value / total if total > 0 else 0.0,
                "identical": names[u] in identical,
            }
            for rank, u in enumerate(order)
        ]
        values: dict[str, Any] = {
            "n_units": len(names),
            "n_identical_units": len(identical),
            "n_scored_tokens": int(whole.size),
            "units_by": self.spec.units.by,
            "top_unit": names[top],
            "top_unit_kld": means[top].value,
            "top_unit_kld_stderr": means[top].stderr,
            "top_unit_share": means[top].value / total if total > 0 else 0.0,
            "sum_unit_kld": total,
            "whole_kld": whole_mean.value,
            "whole_kld_stderr": whole_mean.stderr,
            "additivity": total / whole_mean.value if whole_mean.value > 0 else float("nan"),
            "tokens_sha256": swaps.meta["tokens_sha256"],
        }
        checks, _ = self.spec.threshold_checks(values)
        made = {}
        if self.context.plots:
            plots.unit_bars(
                names, [m.value for m in means], artifacts / "attribution_units.png", whole_mean.value
            )
            made["kld_by_unit"] = f"{artifacts.name}/attribution_units.png"
        return TaskResult.from_checks(values, checks, details=rows, artifacts=made)
