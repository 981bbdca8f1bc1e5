"""The `moe` task's observations, streamed one decoder layer at a time: the reference's (`MoeReference`:
each MoE block's input, its router's outputs, each chosen expert's and the shared expert's outputs) and the
candidate's errors against them (`MoeErrors`: routing agreement in three modes, each routed expert's and the
shared expert's error). What they mean and how they are compared: `evalsuite.tasks.moe`."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from evalsuite.backends.layer_pass import LayerStep, LayerVisitor, QuietVisitor, ReferenceInput, observe_alone
from evalsuite.contract.observation import Observation
from evalsuite.errors import InputError
from evalsuite.files.run_folder import atomic_target
from evalsuite.observers.boundary_states import (
    FedOptions,
    FedWindowObserver,
    ReferenceBoundaries,
    boundary_file,
    check_same_model,
    state_errors,
    write_boundary,
)
from evalsuite.observers.window_logits import log_softmax64, window_tensor
from evalsuite.protocol.task import Inputs, Progress
from evalsuite.stats import metrics, tensor_errors

if TYPE_CHECKING:
    from evalsuite.backends.streamed import StreamedBackend, WindowCall

ROUTER_OUTPUT = "router_logits"  # the name under which Transformers models declare their routers' output
# config.json fields that count a model's routed experts, by architecture family
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
MODES = ("own", "fed", "router")
# Per layer, window and mode: tokens, Σ top-k overlap, Σ top-1 agreement, Σ mass on the reference's experts,
# Σ router KL
ROUTING_COLUMNS = 5


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
    """Tensors to a safetensors file, replaced atomically (`run_folder.atomic_target`)."""
    from safetensors.torch import save_file

    with atomic_target(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))


@contextlib.contextmanager
def window_tapped(moe: MoeBlock, taps: list[Tap]) -> Iterator[None]:
    """`tapped` around one window's forward, the window's routes (one per call: a long window's MLP runs a
    chunk of positions at a time) joined into one and appended to `taps`."""
    with tapped(moe) as tap:
        yield
    routes = tuple(torch.cat([r[i] for r in tap.routes]) for i in range(3))
    taps.append(Tap([torch.cat(tap.inputs)], [routes]))  # type: ignore[list-item]


class MoeReference(FedWindowObserver):
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
        return MoeReferenceVisitor(backend, inputs, folder, self.fed)

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
    """`MoeReference` during the reference's layer pass: the MoE block tapped on the pass's own forward; the
    experts' outputs on the windows of `FedOptions`, the ones the candidate's experts are run on."""

    def __init__(self, backend: StreamedBackend, inputs: Inputs, folder: Path, fed: FedOptions) -> None:
        self.backend, self.inputs, self.folder = backend, inputs, folder
        self.fed_windows = fed.indices(len(inputs["windows"]))
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
        """One MoE layer's file: block inputs and routes of every window, the chosen and shared experts'
        outputs on the fed windows (in their order); usage counted over every window."""
        slot = self.moe_layers.index(index)
        logits = torch.cat([t.routes[0][0] for t in taps]).float()
        weights = torch.cat([t.routes[0][1] for t in taps]).float()
        chosen = torch.cat([t.routes[0][2] for t in taps])
        x = torch.stack([t.inputs[0] for t in taps])
        fed = list(self.fed_windows)
        flat = x[fed].reshape(-1, x.shape[-1])
        fed_chosen = torch.stack([taps[w].routes[0][2] for w in fed]).reshape(-1, chosen.shape[-1])
        with torch.inference_mode():
            doc = {
                "input": x,
                "logits": logits,
                "weights": weights,
                "index": chosen.to(torch.int32),
                "experts": chosen_expert_outputs(moe.experts, flat, fed_chosen),
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
        # per token of the text, the fed windows' share of the experts' outputs averaged over every token
        fed_share = len(self.fed_windows) / len(calls)
        per_token = (n + 1) * hidden * dtype.itemsize
        per_token += len(self.moe_layers) * (
            (1 + (self.top_k + 1) * fed_share) * hidden * dtype.itemsize
            + (self.n_experts + 2 * self.top_k) * 4
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
                "fed_windows": list(self.fed_windows),
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


class MoeErrors(FedWindowObserver):
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
        return MoeErrorsVisitor(backend, inputs, reference, self.fed)


class MoeErrorsVisitor(QuietVisitor):
    """`MoeErrors` during the candidate's layer pass: the router tapped on the pass's own forward (`own`) and
    on the layer's forward of the reference's input (`fed`), and the router alone on the reference's router
    input; the experts run on the reference's tokens. `fed` and the experts: the windows of `FedOptions`."""

    def __init__(
        self, backend: StreamedBackend, inputs: Inputs, reference: Observation, fed: FedOptions
    ) -> None:
        self.backend, self.inputs, self.reference = backend, inputs, reference
        meta = reference.meta
        self.fed_windows = fed.indices(len(inputs["windows"]))
        if meta.get("fed_windows") != list(self.fed_windows):
            raise InputError(
                f"the reference's experts were observed on windows {meta.get('fed_windows')}, the candidate "
                f"is fed windows {list(self.fed_windows)} (the two specs' [fed] differ)"
            )
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

    def reference_input(self, index: int) -> ReferenceInput | None:
        if index not in self.moe_layers:
            return None
        return ReferenceInput(self.boundaries.read(index), self.fed_windows)

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
        fed_taps = dict(zip(self.fed_windows, fed, strict=True))
        for w in range(len(step.calls)):
            self._window(moe, ref_moe, w, slot, own[w], fed_taps.get(w))

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
                "fed_windows": list(self.fed_windows),
                "execution": self.backend.describe(),
                "ref_execution": self.reference.meta.get("execution", {}),
            },
            arrays={"routing": self.routing, "experts": self.experts, "shared": self.shared},
        )

    def _window(
        self, moe: MoeBlock, ref: dict[str, torch.Tensor], w: int, slot: int, own: Tap, fed: Tap | None
    ) -> None:
        """One window of one MoE layer: the routing sums of the candidate on its own prefix and of its router
        alone on the reference's router input; on a fed window (`fed` given), also those of its layer fed the
        reference's input, and the experts' and the shared expert's error sums on the reference's tokens."""
        x = ref["input"][w].to(_device_of(moe.experts))
        tokens = slice(w * len(x), (w + 1) * len(x))
        ref_logits, ref_index = ref["logits"][tokens], ref["index"][tokens].long()
        with torch.inference_mode():
            alone = moe.router(x)
        self.routing[MODES.index("own"), slot, w] = routing_sums(ref_logits, ref_index, own.routes[0])
        self.routing[MODES.index("router"), slot, w] = routing_sums(ref_logits, ref_index, alone)
        if fed is None:
            return
        self.routing[MODES.index("fed"), slot, w] = routing_sums(ref_logits, ref_index, fed.routes[0])
        # The reference kept its experts' outputs for the fed windows only, in their order.
        j = self.fed_windows.index(w)
        k = ref_index.shape[1]
        cand = chosen_expert_outputs(moe.experts, x, ref_index.to(x.device))
        self.experts[slot] += tensor_errors.grouped_error_sums(
            ref["experts"][j * len(x) * k : (j + 1) * len(x) * k].float().numpy(),
            cand.float().cpu().numpy(),
            ref["weights"][tokens].reshape(-1).numpy(),
            ref_index.reshape(-1).numpy(),
            self.experts.shape[1],
        )
        if moe.shared is not None and "shared" in ref:
            with torch.inference_mode():
                self.shared[slot, w] = state_errors(
                    ref["shared"][j * len(x) : (j + 1) * len(x)], moe.shared(x)
                )


def _device_of(module: torch.nn.Module) -> torch.device:
    """Where a module's tensors are: integer experts (backend intref) hold buffers, not parameters."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    raise ValueError(f"{type(module).__name__} holds no tensors")
