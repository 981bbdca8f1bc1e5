"""A streamed decoding step's routed experts (backend `hf`): of a MoE layer read for one forward, only the
experts its tokens route to, read when the experts are first called (`RoutedExperts`), decoded together
(`FusedReader`), and kept across steps within the side's memory budget (`DecodedCache`).

Why not Transformers' loading for them: `convert_and_load_state_dict_in_model` renames each file tensor,
copies a converter for it and, for a compressed-tensors pack, decompresses each expert projection through
its own `decompress_module` call: at the seed's shape a step's experts were thousands of tensors a layer,
and that per-tensor work, not the arithmetic, was most of a W4A8 step's reading (bench/unpack.py). Where the
model's own conversion of its experts is the plain one (each fused parameter the per-expert projections
stacked by expert and concatenated along their rows: `MergeModulelist(dim=0)`, then `Concatenate(dim=1)` for
more than one, after compressed-tensors' `CompressedTensorsDequantize` for a pack), `FusedReader` does the
same with one stacked copy or one library decompression per parameter (`evalsuite.formats.ct_batch`): the
same values in the same places, bit for bit (`tests/unit/test_routed_experts.py` holds it equal to
Transformers' loading). Any other conversion is left to Transformers, expert tensor by expert tensor.

Why a cache: consecutive steps of a decoding route many of their tokens to the same experts (`DecodedCache`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from evalsuite.backends.decoded_cache import DecodedCache
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint

# A routed expert's tensor as the files store it: `…mlp.experts.<index>.<projection>.<tensor>`.
EXPERT = re.compile(r"\.experts\.(\d+)\.([^.]+)\.([^.]+)$")

# One expert's rows of each fused parameter, by parameter name.
Rows = dict[str, torch.Tensor]


def routed_experts(layer: nn.Module, names: list[str]) -> tuple[str, dict[int, list[str]]] | None:
    """The layer's module of fused routed experts (its name in the layer) and the files' tensors of each
    expert, where the files store the experts apart and the module is one whose forward takes the tokens'
    routing (`(hidden_states, top_k_index, top_k_weights)`, as Transformers' MoE experts do); else None."""
    found = [
        (name, module)
        for name, module in layer.named_modules()
        if name.endswith("experts")
        and isinstance(getattr(module, "num_experts", None), int)
        and hasattr(module, "gate_up_proj")
    ]
    if len(found) != 1:
        return None
    name, module = found[0]
    by_expert: dict[int, list[str]] = {}
    for tensor in names:  # the layer's own tensors (`units`): an expert's carries its index after `experts.`
        match = EXPERT.search(tensor)
        if match:
            by_expert.setdefault(int(match.group(1)), []).append(tensor)
    if len(by_expert) != module.num_experts:
        return None
    return name, by_expert


@dataclass(frozen=True)
class FusedPlan:
    """How the files' per-expert tensors make the experts module's parameters, where it is the plain
    conversion (module docstring): each parameter, the named projections of each expert concatenated along
    their rows, stacked by expert; stored in a float dtype (cast to `dtypes[param]` when not None, as
    Transformers casts what it reads) or compressed-tensors `fmt` under `scheme`."""

    params: dict[str, tuple[str, ...]]
    dtypes: dict[str, torch.dtype | None]
    fmt: str | None = None
    scheme: Any = None


def fused_plan(
    converters: dict[str, Any],
    target_of: Callable[[str], tuple[str, str | None]],
    dtype_of: Callable[[str], Any],
    module_name: str,
    module: nn.Module,
    first_expert: list[str],
) -> FusedPlan | None:
    """The plan of `module` (its full name `module_name`), from how Transformers renames and converts the
    first expert's tensors (`target_of(name)`: the target and the converter's source pattern, as
    `rename_source_key` gives them; `converters` by source pattern); None where the conversion is another.
    `dtype_of(target)`: the dtype Transformers casts a float tensor of that target to when it reads it."""
    from transformers.core_model_loading import Concatenate, MergeModulelist
    from transformers.integrations.compressed_tensors import CompressedTensorsDequantize, get_experts_scheme

    by_param: dict[str, tuple[Any, dict[str, str]]] = {}
    for name in first_expert:
        match = EXPERT.search(name)
        target, pattern = target_of(name)
        owner, _, param = target.rpartition(".")
        if match is None or pattern is None or owner != module_name or pattern not in converters:
            return None
        converter = converters[pattern]
        _, seen = by_param.setdefault(param, (converter, {}))
        if by_param[param][0] is not converter:
            return None
        seen[match.group(2)] = pattern
    params: dict[str, tuple[str, ...]] = {}
    dtypes: dict[str, torch.dtype | None] = {}
    fmt, scheme = None, None
    for param, (converter, seen) in by_param.items():
        ops = list(converter.operations)
        dequantize = ops.pop(0) if ops and isinstance(ops[0], CompressedTensorsDequantize) else None
        order = [p for p in dict.fromkeys(_projection(s) for s in converter.source_patterns) if p in seen]
        plain = [MergeModulelist] + ([Concatenate] if len(order) > 1 else [])
        if [type(op) for op in ops] != plain or ops[0].dim != 0 or (len(ops) > 1 and ops[1].dim != 1):
            return None
        if not isinstance(getattr(module, param, None), nn.Parameter) or sorted(order) != sorted(seen):
            return None
        params[param] = tuple(order)
        if dequantize is None:
            dtypes[param] = dtype_of(f"{module_name}.{param}")
            continue
        config = dequantize.hf_quantizer.compressor.quantization_config
        scheme = dequantize.scheme or get_experts_scheme(config)
        weights = scheme.weights
        fmt = scheme.format or config.format
        # compressed-tensors' FP8 experts are folded by Transformers' own arithmetic, not the library's.
        if fmt != "pack-quantized" or weights is None or weights.type != "int" or not weights.symmetric:
            return None
        dtypes[param] = None
    if len({d is None for d in dtypes.values()}) > 1:
        return None
    return FusedPlan(params, dtypes, fmt, scheme)


def _projection(pattern: str) -> str:
    """`mlp.experts.*.gate_proj.weight_packed` → `gate_proj`."""
    return pattern.rsplit(".", 2)[-2]


class FusedReader:
    """Experts of one layer read from the files and fused as `FusedPlan` says, several experts at once."""

    def __init__(self, checkpoint: Checkpoint, plan: FusedPlan, by_expert: dict[int, list[str]]) -> None:
        self.checkpoint, self.plan = checkpoint, plan
        # expert → projection → the tensor's name in the files, by its local name (`weight_packed`, …)
        self.files: dict[int, dict[str, dict[str, str]]] = {}
        for expert, names in by_expert.items():
            for name in names:
                match = EXPERT.search(name)
                assert match is not None  # `routed_experts` took these names by this expression
                self.files.setdefault(expert, {}).setdefault(match.group(2), {})[match.group(3)] = name

    def names(self, experts: list[int]) -> list[str]:
        """The files' tensors of `experts`."""
        return [n for e in experts for tensors in self.files[e].values() for n in tensors.values()]

    def read(self, experts: list[int], device: torch.device) -> dict[str, torch.Tensor]:
        """Each fused parameter's rows of `experts`, in that order: (len(experts), rows, columns)."""
        from evalsuite.formats.ct_batch import decompress_together

        fused: dict[str, torch.Tensor] = {}
        with self.checkpoint.open_tensors(self.names(experts)) as handles:
            for param, projections in self.plan.params.items():
                # As Transformers materialises what it reads: on the device, before any conversion.
                stored = [
                    [
                        {k: handles[n][...].to(device) for k, n in self.files[e][p].items()}
                        for p in projections
                    ]
                    for e in experts
                ]
                if self.plan.fmt is not None:
                    states = [state for by_projection in stored for state in by_projection]
                    weight = decompress_together(self.plan.fmt, self.plan.scheme, states).weight
                    fused[param] = weight.reshape(len(experts), -1, weight.shape[-1])
                    continue
                first = [s["weight"] for s in stored[0]]
                shape = (len(experts), sum(int(w.shape[0]) for w in first), int(first[0].shape[-1]))
                out = torch.empty(shape, dtype=self.plan.dtypes[param] or first[0].dtype, device=device)
                for i, by_projection in enumerate(stored):
                    at = 0
                    for state in by_projection:  # copy_ casts as Transformers' `.to(dtype)` does
                        rows = int(state["weight"].shape[0])
                        out[i, at : at + rows].copy_(state["weight"])
                        at += rows
                fused[param] = out
        return fused


# Reads the fused rows of the given experts of a layer, in that order: (experts, rows, columns) by parameter.
ReadRows = Callable[[list[int]], dict[str, torch.Tensor]]


class RoutedExperts:
    """A forward pre-hook on a layer's fused experts, for a decoding step: at each call, the experts the
    call's tokens route to that are not yet held are taken from the cache or read (`read`), and the module
    holds those experts only, in the order of their indices (a row per expert held, not one per expert of
    the model). The call's routing is renumbered to those rows and the module's expert count set to theirs:
    the forward runs each token through the same experts' weights, grouped in the same order, as with every
    expert present, and no tensor of the model's full expert count is made or filled. `restore` gives the
    module back its full shape (on the meta device) and count. `file_bytes[e]`: expert e's bytes in the
    files, added to `counted` (one element) when it is read."""

    def __init__(
        self,
        module: nn.Module,
        layer: int,
        read: ReadRows,
        file_bytes: dict[int, int],
        cache: DecodedCache | None,
        counted: list[int],
    ) -> None:
        self.module, self.layer, self.read_rows, self.cache = module, layer, read, cache
        self.file_bytes, self.counted = file_bytes, counted
        self.num_experts = int(module.num_experts)
        self.shapes = {k: v.shape for k, v in module.named_parameters(recurse=False)}
        self.dtypes = {k: v.dtype for k, v in module.named_parameters(recurse=False)}
        self.rows: list[int] = []  # the experts held, ascending: row i holds expert rows[i]
        self.read_seconds = 0.0

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        routed = args[1] if len(args) > 1 else None
        if not isinstance(routed, torch.Tensor):
            raise InputError(
                "the experts' forward did not get the tokens' routing: it cannot be read sparsely"
            )
        wanted = {int(e) for e in routed.reshape(-1).tolist() if 0 <= int(e) < self.num_experts}
        todo = sorted(wanted - set(self.rows))
        if todo:
            started = time.perf_counter()
            self._hold(module, todo)
            self.read_seconds += time.perf_counter() - started
        # Expert e → its row; an index outside the model's experts (a sentinel) stays past the last row.
        table = torch.full((self.num_experts + 1,), len(self.rows), dtype=routed.dtype)
        table[torch.tensor(self.rows, dtype=torch.long)] = torch.arange(len(self.rows), dtype=routed.dtype)
        renumbered = table.to(routed.device)[routed.clamp(0, self.num_experts)]
        module.num_experts = len(self.rows)
        return (args[0], renumbered, *args[2:])

    def _hold(self, module: nn.Module, todo: list[int]) -> None:
        """The module's rows become those of the experts held so far and `todo`, in the order of indices."""
        held = {k: getattr(module, k).data for k in self.shapes}
        found: dict[int, Rows] = {}
        if self.cache is not None:
            for e in todo:
                rows = self.cache.take(self.layer, e)
                if rows is not None:
                    found[e] = rows
        missing = [e for e in todo if e not in found]
        new = self.read_rows(missing) if missing else {}
        self.counted[0] += sum(self.file_bytes[e] for e in missing)
        if self.cache is not None:
            for i, e in enumerate(missing):
                self.cache.keep(self.layer, e, {k: v[i] for k, v in new.items()}, self.file_bytes[e])
        merged = sorted([*self.rows, *todo])
        at = {e: i for i, e in enumerate(merged)}
        for key in self.shapes:
            if not self.rows and not found:
                whole = new[key]
            else:
                # A later call of the same read (a prompt's forward after another's) or experts from the
                # cache: the rows gathered in the order of their indices.
                parts = [(self.rows, held[key]), (missing, new.get(key))]
                parts += [([e], rows[key][None]) for e, rows in found.items()]
                sample = next(t for experts, t in parts if experts)
                whole = torch.empty(
                    (len(merged), *sample.shape[1:]), dtype=sample.dtype, device=sample.device
                )
                for experts, rows in parts:
                    if experts:
                        whole[torch.tensor([at[e] for e in experts], device=whole.device)] = rows
            if tuple(whole.shape[1:]) != tuple(self.shapes[key][1:]):
                raise InputError(
                    f"the experts' {key} read from the files has rows of shape {tuple(whole.shape[1:])}, "
                    f"not the model's {tuple(self.shapes[key][1:])}"
                )
            setattr(module, key, nn.Parameter(whole, requires_grad=False))
        self.rows = merged

    def restore(self) -> None:
        """The module's full expert count, and its experts' parameters on the meta device in full shape."""
        self.module.num_experts = self.num_experts
        for key, shape in self.shapes.items():
            empty = torch.empty(shape, device="meta", dtype=self.dtypes[key])
            setattr(self.module, key, nn.Parameter(empty, requires_grad=False))
