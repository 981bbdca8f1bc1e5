"""Mixture of experts: does the candidate route like the reference, and which routed experts did it hurt?

Both sides run streamed over the `ppl` windows, like `layers`: first the reference alone, then the candidate
alone, consuming the reference's observation, so that at no moment more than one decoder layer of one side is
resident, and a recorded reference serves without its weights.

The router and the experts are the model's own modules, found through the model's own declaration of what it
records as `router_logits` (`_can_record_outputs`, the class `output_router_logits` collects; in Transformers
5.24's `qwen3_5_moe`, `Qwen3_5MoeTopKRouter`: a linear layer, a float32 softmax, top-k, the top-k weights
renormalised to sum 1, returned as (logits, weights, indices); modeling_qwen3_5_moe.py lines 894-910). Its MoE
block is the router's parent module: `experts` (fused 3-D weights, called as `experts(x, indices, weights)`)
and, where present, `shared_expert` (an MLP; Qwen3.5 scales its output by a sigmoid gate, left out here: the
shared expert's damage is that of the module). Nothing is computed outside those modules' own forwards:

- **reference** (`MoeReference`): per MoE layer and token, the block's input (captured by a forward pre-hook),
  the router's (logits, weights, indices) (a forward hook), each chosen expert's own output on that token (the
  experts module called on the token once per chosen expert, with weight 1) and the shared expert's output;
  with the hidden states at every layer boundary, in the `layers` format. Size per token: (layers + 1) ×
  hidden + MoE layers × (k + 2) × hidden values in the compute dtype, plus MoE layers × (experts + 2k) × 4
  bytes.
- **candidate** (`MoeErrors`): its layer on its own prefix (`own`), its layer fed the reference's input to the
  layer (`fed`, as `layers` does: router inputs shifted by its attention show here) and its router alone on
  the reference's router input (`router`); each routed expert on the tokens the reference routes to it,
  against the reference's expert output, weighted by the reference's routing weight; the shared expert on
  every token.

Routing agreement per MoE layer and mode: mean top-k set overlap |A∩B|/k, top-1 agreement, the candidate's
routing weight on the reference's chosen experts, KL(softmax(ref logits) ‖ softmax(ckpt logits)). Expert usage
(tokens routed to each expert) is the reference's. Calibration coverage, when the candidate's folder ships a
JSON of per-expert calibration token counts (`read_coverage`), is joined with usage and damage.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from pydantic import Field
from torch import nn

from evalsuite import metrics, plots
from evalsuite.backends.layer_pass import LayerStep, LayerVisitor, QuietVisitor, observe_alone
from evalsuite.errors import InputError
from evalsuite.observation import Observation
from evalsuite.side import Side
from evalsuite.spec import StrictModel, TaskSpec
from evalsuite.task import Inputs, Need, Progress, RunContext, TaskResult, TaskSkipped, task
from evalsuite.tasks.boundary_states import (
    ReferenceBoundaries,
    boundary_file,
    check_same_model,
    state_errors,
    summed_errors,
    write_boundary,
)
from evalsuite.tasks.window_logits import (
    WindowObserver,
    WindowProtocol,
    log_softmax64,
    prepare_windows,
    window_tensor,
)

if TYPE_CHECKING:
    from evalsuite.backends.streamed import StreamedBackend, WindowCall

ROUTER_OUTPUT = "router_logits"  # the name under which Transformers models declare their routers' output
# config.json fields that count a model's routed experts, by architecture family
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
COVERAGE_SCHEMA = "evalsuite.calibration-coverage/1"
COVERAGE_KEY = re.compile(r"^(\d+)\.(\d+)$")
MODES = ("own", "fed", "router")
# Per layer, window and mode: tokens, Σ top-k overlap, Σ top-1 agreement, Σ mass on the reference's experts,
# Σ router KL
ROUTING_COLUMNS = 5


class MoeCompareOptions(StrictModel):
    """How the comparison reads the observations (compare-only: changing it never invalidates one).

    An expert is **hurt** when its weighted relative error exceeds both `hurt_min_rel_err` and
    `hurt_factor` × the median error of the used experts, and **hot** when the reference routes at least
    `hot_usage` × the uniform share of tokens to it (tokens × k / experts of its layer)."""

    hurt_factor: float = Field(2.0, gt=0)
    hurt_min_rel_err: float = Field(0.01, ge=0)
    hot_usage: float = Field(1.0, ge=0)
    worst_experts: int = Field(10, ge=1)  # rows of the hot-and-hurt table
    coverage_file: str = "calibration_coverage.json"  # in the candidate's folder, read when present
    coverage_floor: float = Field(32.0, ge=0)  # calibration tokens below which an expert is flagged


class MoeSpec(TaskSpec):
    protocol: WindowProtocol = WindowProtocol()
    compare: MoeCompareOptions = MoeCompareOptions()


def expert_count(config: Mapping[str, Any]) -> int:
    """How many routed experts a checkpoint's config.json declares (its text config's); 0: a dense model."""
    for doc in (config.get("text_config") or {}, config):
        for key in EXPERT_COUNT_FIELDS:
            value = doc.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def router_class(model: nn.Module) -> type[nn.Module]:
    """The router module class the model declares as the producer of its `router_logits` output."""
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get(ROUTER_OUTPUT)
        if recorder is not None:
            return getattr(recorder, "target_class", recorder)
    raise InputError(
        f"{type(model).__name__} declares no `{ROUTER_OUTPUT}` output (no router module to observe): the "
        "`moe` task reads Transformers MoE models that do"
    )


@dataclass
class MoeBlock:
    """The MoE block of one decoder layer: its router, its routed experts and its shared expert (or None)."""

    block: nn.Module
    router: nn.Module
    experts: nn.Module
    shared: nn.Module | None


def moe_block(layer: nn.Module, router: type[nn.Module]) -> MoeBlock | None:
    """The layer's MoE block (the parent of its router), None for a dense layer."""
    for name, module in layer.named_modules():
        if isinstance(module, router):
            block = layer.get_submodule(name.rpartition(".")[0])
            experts = getattr(block, "experts", None)
            if not isinstance(experts, nn.Module):
                raise InputError(
                    f"the router {name} of {type(layer).__name__} has no sibling `experts` module"
                )
            shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
            return MoeBlock(block, module, experts, shared if isinstance(shared, nn.Module) else None)
    return None


@dataclass
class Tap:
    """What one forward through a layer handed its MoE block: its input, and the router's output."""

    inputs: list[torch.Tensor]
    routes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@contextlib.contextmanager
def tapped(moe: MoeBlock) -> Iterator[Tap]:
    """Hooks on the block (its input) and its router (logits, weights, indices) for the duration."""
    tap = Tap([], [])

    def block_input(module: nn.Module, args: tuple) -> None:
        tap.inputs.append(args[0].reshape(-1, args[0].shape[-1]))

    def router_output(module: nn.Module, args: tuple, output: Any) -> None:
        if not (isinstance(output, tuple) and len(output) == 3):
            raise InputError(
                f"the router {type(module).__name__} returns {type(output).__name__}, not (logits, weights, "
                "indices): the `moe` task reads top-k routers that do"
            )
        tap.routes.append(output)

    handles = [
        moe.block.register_forward_pre_hook(block_input),
        moe.router.register_forward_hook(router_output),
    ]
    try:
        yield tap
    finally:
        for handle in handles:
            handle.remove()


def chosen_expert_outputs(experts: nn.Module, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Each token's output from each of its chosen experts, unweighted, (tokens × k, hidden): the experts
    module's own forward on every token repeated k times, one expert per row, with weight 1."""
    k = index.shape[1]
    rows = x.repeat_interleave(k, dim=0)
    ones = torch.ones(rows.shape[0], 1, dtype=x.dtype, device=x.device)
    with torch.inference_mode():
        return experts(rows, index.reshape(-1, 1), ones)


def routing_sums(
    ref_logits: torch.Tensor, ref_index: torch.Tensor, route: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> np.ndarray:
    """(tokens, Σ top-k overlap, Σ top-1 agreement, Σ mass on the reference's experts, Σ router KL) of the
    candidate's routes against the reference's, over one window's tokens."""
    logits, weights, index = route
    a, b = ref_index.cpu().numpy(), index.cpu().numpy()
    overlap = metrics.topk_overlap(a, b)
    top1 = a[:, 0] == b[:, 0]
    mass = metrics.mass_on_chosen(weights.float().cpu().numpy(), b, a)
    kl = metrics.kl_divergence(log_softmax64(ref_logits.cpu()).numpy(), log_softmax64(logits.cpu()).numpy())
    return np.array([len(a), overlap.sum(), top1.sum(), mass.sum(), kl.sum()], dtype=np.float64)


def moe_file(folder: Path, layer: int) -> Path:
    return folder / f"moe-{layer:03d}.safetensors"


def write_atomic_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    import os

    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


@contextlib.contextmanager
def window_tapped(moe: MoeBlock, taps: list[Tap]) -> Iterator[None]:
    """`tapped` around one window's forward, the window's routes (one per call: a long window's MLP runs a
    chunk of positions at a time) joined into one and appended to `taps`."""
    with tapped(moe) as tap:
        yield
    routes = tuple(torch.cat([r[i] for r in tap.routes]) for i in range(3))
    taps.append(Tap([torch.cat(tap.inputs)], [routes]))  # type: ignore[list-item]


class MoeReference(WindowObserver):
    """Observer of the reference, streamed: every layer boundary's hidden states and, per MoE layer, the
    block's inputs, the router's outputs, each chosen expert's and the shared expert's outputs (module
    docstring); expert usage as arrays. Rides the side's shared layer pass."""

    name = "moe-reference"

    def observe(
        self, backend: StreamedBackend, inputs: Inputs, folder: Path, progress: Progress
    ) -> Observation:
        return observe_alone(
            self.visitor(backend, inputs, folder), backend, window_tensor(inputs), folder, progress
        )

    def visitor(self, backend: StreamedBackend, inputs: Inputs, folder: Path) -> LayerVisitor:
        return MoeReferenceVisitor(backend, inputs, folder)

    def record(self, observation: Observation, folder: Path) -> Observation:
        """All of it: the candidate's experts are compared with these outputs (size: module docstring)."""
        meta = {**observation.meta, "kind": "recorded"}
        return Observation(
            name=observation.name,
            key=observation.key,
            meta=meta,
            arrays=dict(observation.arrays),
            files=dict(observation.files),
        )


class MoeReferenceVisitor(QuietVisitor):
    """`MoeReference` during the reference's layer pass: the MoE block tapped on the pass's own forward."""

    def __init__(self, backend: StreamedBackend, inputs: Inputs, folder: Path) -> None:
        self.backend, self.inputs, self.folder = backend, inputs, folder
        self.router = router_class(backend.model)
        # The meta skeleton's layers: nothing is read to find the blocks.
        self.blocks = [moe_block(layer, self.router) for layer in backend.layers]
        self.moe_layers = [i for i, b in enumerate(self.blocks) if b is not None]
        if not self.moe_layers:
            raise InputError(
                "no decoder layer holds a router: nothing for the `moe` task", backend.checkpoint.path
            )
        first = self.blocks[self.moe_layers[0]]
        assert first is not None
        self.n_experts, self.top_k = int(first.router.num_experts), int(first.router.top_k)
        self.taps: list[Tap] = []

    def begin(self, calls: list[WindowCall], done: int, carry: dict[str, torch.Tensor]) -> None:
        if done:
            self.usage, self.usage_weight = carry["usage"].numpy(), carry["usage_weight"].numpy()
        else:
            self.usage = np.zeros((len(self.moe_layers), self.n_experts))
            self.usage_weight = np.zeros((len(self.moe_layers), self.n_experts))
            write_boundary(self.folder, 0, [call.hidden for call in calls])

    def tap(self, index: int, layer: nn.Module) -> contextlib.AbstractContextManager[Any]:
        moe = moe_block(layer, self.router) if index in self.moe_layers else None
        return window_tapped(moe, self.taps) if moe is not None else contextlib.nullcontext()

    def visit(self, step: LayerStep) -> None:
        taps, self.taps = self.taps, []
        if step.index in self.moe_layers:
            moe = moe_block(step.layer, self.router)
            assert moe is not None
            self._write_layer(step.index, moe, taps)
        write_boundary(self.folder, step.index + 1, step.after)

    def _write_layer(self, index: int, moe: MoeBlock, taps: list[Tap]) -> None:
        """One MoE layer's file: block inputs, routes, chosen and shared experts' outputs; usage counted."""
        slot = self.moe_layers.index(index)
        logits = torch.cat([t.routes[0][0] for t in taps]).float()
        weights = torch.cat([t.routes[0][1] for t in taps]).float()
        chosen = torch.cat([t.routes[0][2] for t in taps])
        x = torch.stack([t.inputs[0] for t in taps])
        flat = x.reshape(-1, x.shape[-1])
        with torch.inference_mode():
            doc = {
                "input": x,
                "logits": logits,
                "weights": weights,
                "index": chosen.to(torch.int32),
                "experts": chosen_expert_outputs(moe.experts, flat, chosen),
            }
            if moe.shared is not None:
                doc["shared"] = moe.shared(flat)
        write_atomic_tensors(moe_file(self.folder, index), doc)
        ids = chosen.reshape(-1).cpu().numpy()
        np.add.at(self.usage[slot], ids, 1)
        np.add.at(self.usage_weight[slot], ids, weights.reshape(-1).cpu().numpy())

    def carry(self) -> dict[str, torch.Tensor]:
        return {"usage": torch.from_numpy(self.usage), "usage_weight": torch.from_numpy(self.usage_weight)}

    def finish(self, final: list[torch.Tensor], calls: list[WindowCall]) -> Observation:
        backend, n = self.backend, self.backend.n_layers
        first = self.blocks[self.moe_layers[0]]
        assert first is not None
        hidden, dtype = int(final[0].shape[-1]), final[0].dtype
        per_token = (n + 1) * hidden * dtype.itemsize
        per_token += len(self.moe_layers) * (
            (self.top_k + 2) * hidden * dtype.itemsize + (self.n_experts + 2 * self.top_k) * 4
        )
        files = {f"boundary-{b:03d}": boundary_file(self.folder, b) for b in range(n + 1)}
        files.update({moe_file(self.folder, i).stem: moe_file(self.folder, i) for i in self.moe_layers})
        return Observation(
            name=MoeReference.name,
            meta={
                "n_layers": n,
                "layer_kinds": backend.layer_kinds(),
                "moe_layers": self.moe_layers,
                "n_experts": self.n_experts,
                "top_k": self.top_k,
                "router": type(first.router).__name__,
                "shared_expert": first.shared is not None,
                "hidden_size": hidden,
                "bytes_per_token": per_token,
                "n_windows": len(calls),
                "tokens_sha256": self.inputs["tokens_sha256"],
                "corpus": self.inputs["corpus"],
                "execution": backend.describe(),
            },
            arrays={"usage": self.usage, "usage_weight": self.usage_weight},
            files=files,
        )


def _read_moe(reference: Observation, layer: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = reference.files.get(f"moe-{layer:03d}")
    if path is None:
        raise InputError(f"the reference's observation has no MoE layer {layer}")
    return load_file(str(path))


class MoeErrors(WindowObserver):
    """Observer of the candidate, streamed, consuming the reference's `MoeReference` observation (as
    `inputs["observed"]["ref"]`): routing agreement per MoE layer, window and mode, and per-expert error
    sums (module docstring). Rides the side's shared layer pass."""

    name = "moe-errors"

    def observe(
        self, backend: StreamedBackend, inputs: Inputs, folder: Path, progress: Progress
    ) -> Observation:
        return observe_alone(
            self.visitor(backend, inputs, folder), backend, window_tensor(inputs), folder, progress
        )

    def visitor(self, backend: StreamedBackend, inputs: Inputs, folder: Path) -> LayerVisitor:
        reference = inputs["observed"]["ref"]
        check_same_model(reference, backend, inputs)
        return MoeErrorsVisitor(backend, inputs, reference)


class MoeErrorsVisitor(QuietVisitor):
    """`MoeErrors` during the candidate's layer pass: the router tapped on the pass's own forward (`own`) and
    on the layer's forward of the reference's input (`fed`); the experts run on the reference's tokens."""

    def __init__(self, backend: StreamedBackend, inputs: Inputs, reference: Observation) -> None:
        self.backend, self.inputs, self.reference = backend, inputs, reference
        meta = reference.meta
        self.router = router_class(backend.model)
        blocks = [moe_block(layer, self.router) for layer in backend.layers]
        self.moe_layers = [i for i, b in enumerate(blocks) if b is not None]
        if (
            self.moe_layers != meta["moe_layers"]
            or int(blocks[self.moe_layers[0]].router.num_experts) != meta["n_experts"]
        ):
            raise InputError(
                f"the sides differ in their experts: the reference has MoE layers {meta['moe_layers']} of "
                f"{meta['n_experts']} experts, the candidate {self.moe_layers}"
            )
        self.boundaries = ReferenceBoundaries(reference)
        self.own: list[Tap] = []
        self.fed: list[Tap] = []

    def begin(self, calls: list[WindowCall], done: int, carry: dict[str, torch.Tensor]) -> None:
        n_windows, n_moe, n_experts = len(calls), len(self.moe_layers), int(self.reference.meta["n_experts"])
        if done:
            self.routing = carry["routing"].numpy()
            self.experts = carry["experts"].numpy()
            self.shared = carry["shared"].numpy()
        else:
            self.routing = np.zeros((len(MODES), n_moe, n_windows, ROUTING_COLUMNS))
            self.experts = np.zeros((n_moe, n_experts, 6))
            self.shared = np.zeros((n_moe, n_windows, 6))

    def tap(self, index: int, layer: nn.Module) -> contextlib.AbstractContextManager[Any]:
        moe = moe_block(layer, self.router) if index in self.moe_layers else None
        return window_tapped(moe, self.own) if moe is not None else contextlib.nullcontext()

    def reference_input(self, index: int) -> torch.Tensor | None:
        return self.boundaries.read(index) if index in self.moe_layers else None

    def fed_tap(self, index: int, layer: nn.Module) -> contextlib.AbstractContextManager[Any]:
        moe = moe_block(layer, self.router)
        return window_tapped(moe, self.fed) if moe is not None else contextlib.nullcontext()

    def visit(self, step: LayerStep) -> None:
        own, fed = self.own, self.fed
        self.own, self.fed = [], []
        if step.index not in self.moe_layers:
            return
        moe = moe_block(step.layer, self.router)
        assert moe is not None
        ref_moe = _read_moe(self.reference, step.index)
        slot = self.moe_layers.index(step.index)
        for w in range(len(step.calls)):
            self._window(moe, ref_moe, w, slot, own[w], fed[w], self.routing, self.experts, self.shared)

    def carry(self) -> dict[str, torch.Tensor]:
        return {
            "routing": torch.from_numpy(self.routing),
            "experts": torch.from_numpy(self.experts),
            "shared": torch.from_numpy(self.shared),
        }

    def finish(self, final: list[torch.Tensor], calls: list[WindowCall]) -> Observation:
        return Observation(
            name=MoeErrors.name,
            meta={
                "n_layers": self.backend.n_layers,
                "moe_layers": self.moe_layers,
                "n_experts": int(self.reference.meta["n_experts"]),
                "tokens_sha256": self.inputs["tokens_sha256"],
                "n_windows": len(calls),
                "execution": self.backend.describe(),
                "ref_execution": self.reference.meta.get("execution", {}),
            },
            arrays={"routing": self.routing, "experts": self.experts, "shared": self.shared},
        )

    @staticmethod
    def _window(
        moe: MoeBlock,
        ref: dict[str, torch.Tensor],
        w: int,
        slot: int,
        own: Tap,
        fed: Tap,
        routing: np.ndarray,
        experts: np.ndarray,
        shared: np.ndarray,
    ) -> None:
        """One window of one MoE layer: the routing sums of each mode, the experts' and shared expert's."""
        x = ref["input"][w].to(next(moe.experts.parameters()).device)
        tokens = slice(w * len(x), (w + 1) * len(x))
        ref_logits, ref_index = ref["logits"][tokens], ref["index"][tokens].long()
        with torch.inference_mode():
            alone = moe.router(x)
        for m, route in enumerate((own.routes[0], fed.routes[0], alone)):
            routing[m, slot, w] = routing_sums(ref_logits, ref_index, route)
        rows = slice(w * len(x) * ref_index.shape[1], (w + 1) * len(x) * ref_index.shape[1])
        cand = chosen_expert_outputs(moe.experts, x, ref_index.to(x.device))
        experts[slot] += metrics.grouped_error_sums(
            ref["experts"][rows].float().numpy(),
            cand.float().cpu().numpy(),
            ref["weights"][tokens].reshape(-1).numpy(),
            ref_index.reshape(-1).numpy(),
            experts.shape[1],
        )
        if moe.shared is not None and "shared" in ref:
            with torch.inference_mode():
                shared[slot, w] = state_errors(ref["shared"][tokens], moe.shared(x))


def read_coverage(path: Path, layers: Collection[int], n_experts: int) -> dict[tuple[int, int], float]:
    """A pack's calibration coverage: `{"schema": COVERAGE_SCHEMA, "tokens": {"L.E": count}}`, where L is a
    decoder layer holding routed experts, E an expert index below the layer's expert count and count the
    (possibly weighted, so fractional) number of calibration tokens routed to that expert; an expert not
    listed had none. Anything else is refused, naming the file."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"calibration coverage is not readable JSON: {exc}", path) from None
    if (
        not isinstance(doc, dict)
        or doc.get("schema") != COVERAGE_SCHEMA
        or not isinstance(doc.get("tokens"), dict)
    ):
        raise InputError(
            f'calibration coverage must be {{"schema": "{COVERAGE_SCHEMA}", '
            '"tokens": {"LAYER.EXPERT": count}}',
            path,
        )
    coverage: dict[tuple[int, int], float] = {}
    for key, value in doc["tokens"].items():
        match = COVERAGE_KEY.match(key)
        if match is None:
            raise InputError(f'calibration coverage key {key!r} is not LAYER.EXPERT (e.g. "3.17")', path)
        layer, expert = int(match[1]), int(match[2])
        if layer not in layers or expert >= n_experts:
            raise InputError(
                f"calibration coverage names expert {key}, which the model lacks ({len(layers)} decoder "
                f"layers, {n_experts} routed experts each)",
                path,
            )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise InputError(f"calibration coverage of {key} is {value!r}, not a count >= 0", path)
        coverage[(layer, expert)] = float(value)
    return coverage


def _expert_name(layer: int, expert: int) -> str:
    return f"layer {layer} expert {expert}"


@task("moe")
class MixtureOfExperts:
    """Routing agreement per MoE layer, expert usage, per-expert damage and calibration coverage.

    Both sides run streamed, one after the other; the reference's observation is recordable."""

    spec_model: ClassVar[type[TaskSpec]] = MoeSpec
    metric_names: ClassVar[tuple[str, ...]] = (
        "n_moe_layers",
        "worst_layer",
        "worst_layer_topk_overlap",
        "mean_topk_overlap",
        "mean_top1_agreement",
        "mean_mass_on_ref_experts",
        "mean_router_kl",
        "own_mean_topk_overlap",
        "router_mean_topk_overlap",
        "worst_expert",
        "worst_expert_rel_err",
        "worst_expert_cosine",
        "experts_unused",
        "hot_hurt_experts",
        "worst_shared_expert_rel_err",
        "coverage_below_floor",
        "coverage_hot_hurt_below_floor",
    )
    metric_descriptions: ClassVar[dict[str, str]] = {
        "worst_layer": "the MoE layer whose router, fed the reference's input, shares the fewest top-k "
        "experts with the reference's (its decoder-layer index)",
        "worst_layer_topk_overlap": "that layer's mean |A∩B|/k: 1 when every token goes to the same experts",
        "mean_topk_overlap": "mean top-k set overlap over every token of every MoE layer, each candidate "
        "layer fed the reference's input to it",
        "own_mean_topk_overlap": "the same with the candidate on its own prefix: routing flips accumulated "
        "through the depth",
        "worst_expert": "the routed expert (of those the reference uses) whose output, on the tokens the "
        "reference routes to it, is furthest from the reference expert's",
        "worst_expert_rel_err": "its relative output error ‖y_ckpt − y_ref‖ / ‖y_ref‖, weighted by the "
        "reference's routing weights",
        "experts_unused": "routed experts the reference sends no token of the text to (their damage is not "
        "measured)",
        "hot_hurt_experts": "experts both hot (at least the uniform share of tokens) and hurt (error above "
        "the spec's factor × the median expert error): quantization damage the text actually meets",
        "coverage_below_floor": "experts with fewer calibration tokens than the spec's floor, by the pack's "
        "calibration coverage file",
        "coverage_hot_hurt_below_floor": "hot and hurt experts that are also below the calibration floor",
    }

    def __init__(self, spec: MoeSpec, context: RunContext) -> None:
        self.spec = spec
        self.context = context
        self.coverage_path: Path | None = None
        self.coverage: dict[tuple[int, int], float] | None = None

    def prepare(self, ref: Side, ckpt: Side) -> Inputs:
        """The `ppl` windows; a dense model is skipped; the candidate's calibration coverage file found."""
        for side in (ckpt, ref):
            if side.checkpoint is not None and expert_count(side.checkpoint.config) == 0:
                raise TaskSkipped(
                    f"the {side.role} model is dense: its config.json declares no routed experts "
                    f"({', '.join(EXPERT_COUNT_FIELDS)})"
                )
        if ckpt.checkpoint is not None:
            path = ckpt.checkpoint.path / self.spec.compare.coverage_file
            if path.is_file():
                config = ckpt.checkpoint.config
                depth = (config.get("text_config") or config).get("num_hidden_layers")
                layers = range(depth) if isinstance(depth, int) else range(0)
                self.coverage = read_coverage(path, layers, expert_count(config))
                self.coverage_path = path
        return prepare_windows(self.spec.protocol, self.context.corpus, ref, ckpt)

    def needs(self) -> list[Need]:
        return [
            Need("ref", "ref", MoeReference(self.spec.protocol), streamed=True),
            Need("ckpt", "ckpt", MoeErrors(self.spec.protocol), streamed=True, consumes=("ref",)),
        ]

    def compare(self, observed: Mapping[str, Observation], artifacts: Path) -> TaskResult:
        ref, ckpt = observed["ref"], observed["ckpt"]
        options = self.spec.compare
        moe_layers: list[int] = ref.meta["moe_layers"]
        kinds = ref.meta["layer_kinds"]
        routing, experts, shared = ckpt.arrays["routing"], ckpt.arrays["experts"], ckpt.arrays["shared"]
        usage = ref.arrays["usage"]
        summed = routing.sum(axis=2)  # (mode, layer, column)
        n_tokens = summed[..., 0]
        means = {
            mode: summed[m, :, 1:] / n_tokens[m, :, None] for m, mode in enumerate(MODES)
        }  # (layer, overlap/top1/mass/kl)
        fed = means["fed"]
        worst = int(np.argmin(fed[:, 0]))  # the first of equals
        every = summed.sum(axis=1)  # (mode, column)
        mean = {mode: every[m, 1:] / every[m, 0] for m, mode in enumerate(MODES)}

        with np.errstate(divide="ignore", invalid="ignore"):
            rel_err = np.where(experts[..., 3] == 0, 0.0, np.sqrt(experts[..., 3] / experts[..., 2]))
            cosine = experts[..., 5] / np.sqrt(experts[..., 2] * experts[..., 4])
        used = usage > 0
        tokens_per_layer = usage.sum(axis=1, keepdims=True)
        uniform = tokens_per_layer / usage.shape[1]
        median = float(np.median(rel_err[used])) if used.any() else 0.0
        hurt_floor = max(options.hurt_min_rel_err, options.hurt_factor * median)
        hurt = used & (rel_err > hurt_floor)
        hot = used & (usage >= options.hot_usage * uniform)
        score = rel_err * usage / tokens_per_layer  # error × share of the layer's routed tokens
        masked = np.where(used, rel_err, -1.0)
        worst_slot, worst_e = np.unravel_index(int(np.argmax(masked)), masked.shape)

        coverage = self.coverage
        stray = sorted({layer for layer, _ in coverage or {}} - set(moe_layers))
        if stray:
            raise InputError(
                f"calibration coverage names layers {stray}, which hold no routed experts (MoE layers "
                f"{moe_layers})",
                self.coverage_path,
            )
        below = np.zeros_like(used)
        if coverage is not None:
            for s, layer in enumerate(moe_layers):
                for e in range(usage.shape[1]):
                    below[s, e] = coverage.get((layer, e), 0.0) < options.coverage_floor

        rows: list[dict[str, Any]] = []
        for s, layer in enumerate(moe_layers):
            sh = summed_errors(shared[s]) if shared[s, :, 0].sum() else None
            rows.append(
                {
                    "table": "routing per MoE layer (fed: the candidate's layer on the reference's input)",
                    "layer": layer,
                    "kind": kinds[layer],
                    "topk_overlap": float(fed[s, 0]),
                    "top1_agreement": float(fed[s, 1]),
                    "mass_on_ref_experts": float(fed[s, 2]),
                    "router_kl": float(fed[s, 3]),
                    "own_topk_overlap": float(means["own"][s, 0]),
                    "router_alone_topk_overlap": float(means["router"][s, 0]),
                    "experts_unused": int((~used[s]).sum()),
                    "shared_expert_rel_err": sh.relative_frobenius_error if sh else None,
                    "worst_expert": int(np.argmax(masked[s])),
                    "worst_expert_rel_err": float(rel_err[s].max()),
                }
            )
        order = sorted(
            ((s, e) for s in range(len(moe_layers)) for e in range(usage.shape[1]) if used[s, e]),
            key=lambda se: (-score[se], -rel_err[se]),
        )
        for rank, (s, e) in enumerate(order[: options.worst_experts]):
            row = {
                "table": "hot and hurt: the worst experts by error × usage",
                "rank": rank + 1,
                "expert": _expert_name(moe_layers[s], e),
                "tokens": int(usage[s, e]),
                "usage_share": float(usage[s, e] / tokens_per_layer[s, 0]),
                "rel_err": float(rel_err[s, e]),
                "cosine": float(cosine[s, e]),
                "hot": bool(hot[s, e]),
                "hurt": bool(hurt[s, e]),
            }
            if coverage is not None:
                row["calibration_tokens"] = coverage.get((moe_layers[s], e), 0.0)
                row["below_floor"] = bool(below[s, e])
            rows.append(row)
        if coverage is not None:
            for s, e in zip(*np.nonzero(below), strict=True):
                rows.append(
                    {
                        "table": f"calibration coverage below {options.coverage_floor:g} tokens",
                        "expert": _expert_name(moe_layers[s], e),
                        "calibration_tokens": coverage.get((moe_layers[s], e), 0.0),
                        "tokens": int(usage[s, e]),
                        "rel_err": float(rel_err[s, e]) if used[s, e] else None,
                        "hot": bool(hot[s, e]),
                        "hurt": bool(hurt[s, e]),
                    }
                )
        shared_errors = [summed_errors(shared[s]).relative_frobenius_error for s in range(len(moe_layers))]
        values: dict[str, Any] = {
            "corpus": ref.meta["corpus"],
            "n_windows": ckpt.meta["n_windows"],
            "n_tokens": int(n_tokens[0, 0]),
            "n_moe_layers": len(moe_layers),
            "n_experts": int(usage.size),
            "top_k": ref.meta["top_k"],
            "worst_layer": moe_layers[worst],
            "worst_layer_kind": kinds[moe_layers[worst]],
            "worst_layer_topk_overlap": float(fed[worst, 0]),
            "mean_topk_overlap": float(mean["fed"][0]),
            "mean_top1_agreement": float(mean["fed"][1]),
            "mean_mass_on_ref_experts": float(mean["fed"][2]),
            "mean_router_kl": float(mean["fed"][3]),
            "own_mean_topk_overlap": float(mean["own"][0]),
            "router_mean_topk_overlap": float(mean["router"][0]),
            "worst_expert": _expert_name(moe_layers[int(worst_slot)], int(worst_e)),
            "worst_expert_rel_err": float(rel_err[worst_slot, worst_e]),
            "worst_expert_cosine": float(cosine[worst_slot, worst_e]),
            "worst_expert_tokens": int(usage[worst_slot, worst_e]),
            "median_expert_rel_err": median,
            "experts_unused": int((~used).sum()),
            "hot_hurt_experts": int((hot & hurt).sum()),
            "worst_shared_expert_rel_err": float(max(shared_errors)) if ref.meta["shared_expert"] else None,
            "coverage_below_floor": int(below.sum()) if coverage is not None else None,
            "coverage_hot_hurt_below_floor": int((below & hot & hurt).sum())
            if coverage is not None
            else None,
            "ref_bytes_per_token": ref.meta["bytes_per_token"],
            "tokens_sha256": ckpt.meta["tokens_sha256"],
        }
        null_reasons = {}
        if coverage is None:
            for name in ("coverage_below_floor", "coverage_hot_hurt_below_floor"):
                null_reasons[name] = f"the candidate ships no calibration coverage ({options.coverage_file})"
        measurable = frozenset(self.metric_names) - (set(null_reasons) | {"worst_shared_expert_rel_err"})
        checks, not_measured = self.spec.threshold_checks(values, measurable)
        plots.expert_heatmap(
            np.where(used, rel_err, np.nan), moe_layers, artifacts / "moe_expert_rel_err.png"
        )
        return TaskResult.from_checks(
            values,
            checks,
            details=rows,
            null_reasons=null_reasons,
            not_measured=not_measured,
            artifacts={"expert_rel_err": f"{artifacts.name}/moe_expert_rel_err.png"},
        )
