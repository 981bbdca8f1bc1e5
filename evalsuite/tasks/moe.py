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
from evalsuite.errors import InputError
from evalsuite.observation import Observation
from evalsuite.side import Side
from evalsuite.spec import StrictModel, TaskSpec
from evalsuite.task import Inputs, Need, Progress, RunContext, TaskResult, TaskSkipped, task
from evalsuite.tasks.boundary_states import (
    boundary_file,
    check_same_model,
    read_boundary,
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
    from evalsuite.backends.streamed import StreamedBackend

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


def _write_atomic(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    import os

    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


class MoeReference(WindowObserver):
    """Observer of the reference, streamed alone: every layer boundary's hidden states and, per MoE layer, the
    block's inputs, the router's outputs, each chosen expert's and the shared expert's outputs (module
    docstring); expert usage as arrays."""

    name = "moe-reference"

    def observe(
        self, backend: StreamedBackend, inputs: Inputs, folder: Path, progress: Progress
    ) -> Observation:
        windows = window_tensor(inputs)
        calls = [backend.capture(window) for window in windows]
        router = router_class(backend.model)
        blocks = [moe_block(layer, router) for layer in backend.layers]  # the meta skeleton: nothing read
        moe_layers = [i for i, b in enumerate(blocks) if b is not None]
        if not moe_layers:
            raise InputError(
                "no decoder layer holds a router: nothing for the `moe` task", backend.checkpoint.path
            )
        n_experts, top_k = (
            int(blocks[moe_layers[0]].router.num_experts),
            int(blocks[moe_layers[0]].router.top_k),
        )
        usage = np.zeros((len(moe_layers), n_experts))
        usage_weight = np.zeros((len(moe_layers), n_experts))
        states = [call.hidden for call in calls]
        write_boundary(folder, 0, states)
        files = {"boundary-000": boundary_file(folder, 0)}
        step = progress("layers (reference)", backend.n_layers)
        for index in range(backend.n_layers):
            with backend.resident(index) as layer:
                moe = moe_block(layer, router)
                with contextlib.ExitStack() as stack:
                    tap = stack.enter_context(tapped(moe)) if moe is not None else None
                    states = [
                        backend.forward_layer(layer, index, h, c) for h, c in zip(states, calls, strict=True)
                    ]
                if moe is not None and tap is not None:
                    slot = moe_layers.index(index)
                    logits = torch.cat([r[0] for r in tap.routes]).float()
                    weights = torch.cat([r[1] for r in tap.routes]).float()
                    chosen = torch.cat([r[2] for r in tap.routes])
                    x = torch.stack([t for t in tap.inputs])
                    flat = x.reshape(-1, x.shape[-1])
                    with torch.inference_mode():
                        expert_out = chosen_expert_outputs(moe.experts, flat, chosen)
                        doc = {
                            "input": x,
                            "logits": logits,
                            "weights": weights,
                            "index": chosen.to(torch.int32),
                            "experts": expert_out,
                        }
                        if moe.shared is not None:
                            doc["shared"] = moe.shared(flat)
                    path = moe_file(folder, index)
                    _write_atomic(path, doc)
                    files[path.stem] = path
                    ids = chosen.reshape(-1).cpu().numpy()
                    np.add.at(usage[slot], ids, 1)
                    np.add.at(usage_weight[slot], ids, weights.reshape(-1).cpu().numpy())
            files[f"boundary-{index + 1:03d}"] = write_boundary(folder, index + 1, states)
            step()
        hidden, dtype = int(states[0].shape[-1]), states[0].dtype
        per_token = (backend.n_layers + 1) * hidden * dtype.itemsize
        per_token += len(moe_layers) * ((top_k + 2) * hidden * dtype.itemsize + (n_experts + 2 * top_k) * 4)
        return Observation(
            name=self.name,
            meta={
                "n_layers": backend.n_layers,
                "layer_kinds": backend.layer_kinds(),
                "moe_layers": moe_layers,
                "n_experts": n_experts,
                "top_k": top_k,
                "router": type(blocks[moe_layers[0]].router).__name__,
                "shared_expert": blocks[moe_layers[0]].shared is not None,
                "hidden_size": hidden,
                "bytes_per_token": per_token,
                "n_windows": len(windows),
                "tokens_sha256": inputs["tokens_sha256"],
                "corpus": inputs["corpus"],
                "execution": backend.describe(),
            },
            arrays={"usage": usage, "usage_weight": usage_weight},
            files=files,
        )

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


def _read_moe(reference: Observation, layer: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = reference.files.get(f"moe-{layer:03d}")
    if path is None:
        raise InputError(f"the reference's observation has no MoE layer {layer}")
    return load_file(str(path))


class MoeErrors(WindowObserver):
    """Observer of the candidate, streamed alone, consuming the reference's `MoeReference` observation (as
    `inputs["observed"]["ref"]`): routing agreement per MoE layer, window and mode, and per-expert error
    sums (module docstring)."""

    name = "moe-errors"

    def observe(
        self, backend: StreamedBackend, inputs: Inputs, folder: Path, progress: Progress
    ) -> Observation:
        reference = inputs["observed"]["ref"]
        check_same_model(reference, backend, inputs)
        meta = reference.meta
        router = router_class(backend.model)
        blocks = [moe_block(layer, router) for layer in backend.layers]
        moe_layers = [i for i, b in enumerate(blocks) if b is not None]
        if (
            moe_layers != meta["moe_layers"]
            or int(blocks[moe_layers[0]].router.num_experts) != meta["n_experts"]
        ):
            raise InputError(
                f"the sides differ in their experts: the reference has MoE layers {meta['moe_layers']} of "
                f"{meta['n_experts']} experts, the candidate {moe_layers}"
            )
        windows = window_tensor(inputs)
        calls = [backend.capture(window) for window in windows]
        n_windows, n_moe, n_experts = len(windows), len(moe_layers), int(meta["n_experts"])
        routing = np.zeros((len(MODES), n_moe, n_windows, ROUTING_COLUMNS))
        experts = np.zeros((n_moe, n_experts, 6))
        shared = np.zeros((n_moe, n_windows, 6))
        states = [call.hidden for call in calls]
        ref_in = read_boundary(reference, 0)
        step = progress("layers (candidate)", backend.n_layers)
        for index in range(backend.n_layers):
            ref_moe = _read_moe(reference, index) if index in moe_layers else None
            with backend.resident(index) as layer:
                moe = moe_block(layer, router)
                for w, call in enumerate(calls):
                    if moe is None or ref_moe is None:
                        states[w] = backend.forward_layer(layer, index, states[w], call)
                        continue
                    with tapped(moe) as own:
                        states[w] = backend.forward_layer(layer, index, states[w], call)
                    with tapped(moe) as fed:
                        backend.forward_layer(layer, index, ref_in[w : w + 1].to(backend.device), call)
                    self._window(moe, ref_moe, w, moe_layers.index(index), own, fed, routing, experts, shared)
            ref_in = read_boundary(reference, index + 1)
            step()
        return Observation(
            name=self.name,
            meta={
                "n_layers": backend.n_layers,
                "moe_layers": moe_layers,
                "n_experts": n_experts,
                "tokens_sha256": inputs["tokens_sha256"],
                "n_windows": n_windows,
                "execution": backend.describe(),
                "ref_execution": meta.get("execution", {}),
            },
            arrays={"routing": routing, "experts": experts, "shared": shared},
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
