"""Backend `intref`: the integer W4A8 / W8A8 reference execution of a compressed-tensors checkpoint.

Stock Transformers decompresses a compressed-tensors checkpoint to the compute dtype and runs its routed
experts without quantizing their activations, so its numbers are not those of the integer model a W4A8
kernel runs. This backend is that integer model, slow if need be but exact:

- the model is built from its config by Transformers' own model classes, on the meta device;
- every quantized Linear (a module the file stores with a `weight_scale`) becomes an `IntLinear`, and every
  fused routed-experts module whose experts are quantized becomes an `IntExperts`: both read the file's
  `weight_packed` / `weight` and `weight_scale` tensors as stored and compute in integer arithmetic (see
  `evalsuite.backends._intlinear`); nothing goes through Transformers' or compressed-tensors' decompression;
- every other tensor is loaded as stored (cast to the compute dtype, which for a bf16 checkpoint run in bf16
  is no cast at all), and a tensor the model needs but the file lacks, or the reverse, is an error;
- norms, attention, the linear-attention recurrence and routers are Transformers' own modules, which already
  compute what they choose in FP32: Qwen3.5's RMSNorm entirely in FP32, Llama's RMSNorm normalises in FP32
  and scales in the compute dtype, the Gated DeltaNet rule keeps q/k/v, gates and its recurrent state in
  FP32, softmax in attention and routing is FP32. This backend changes none of that.

The activation convention (per-token divisor 127.5 or 127, rounding) comes in the side's options, handed
down by the task that runs it (the `[activations]` table of tasks/intref.toml); this module reads no spec.
Whether the integer path can run a checkpoint at all is decided from its files by `intref_plan`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from evalsuite.backends._intlinear import ActivationQuant, IntExpert, IntExperts, IntLinear
from evalsuite.backends.hf import (
    DTYPES,
    HFBackend,
    meta_model,
    transformers_config,
)
from evalsuite.backends.intref_gptq import integer_names, integer_tensors
from evalsuite.backends.intref_plan import ActivationConvention, QuantizedModule, integer_modules
from evalsuite.backends.options import BackendOptions
from evalsuite.backends.skeleton import (
    fused_experts,
    named_tensors,
    refuse_mismatch,
    set_generation_config,
    tensor_slots,
    tie_weights,
)
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.formats.compressed_tensors import SchemeLookup
from evalsuite.formats.gptq import METHODS as GPTQ_METHODS


class IntegerSkeleton:
    """The model Transformers builds from the config, on the meta device, with the integer modules swapped
    in where the files store quantized weights: what the integer path will run, before any tensor is read."""

    def __init__(self, checkpoint: Checkpoint, options: BackendOptions) -> None:
        self.checkpoint = checkpoint
        self.plan = integer_modules(checkpoint)
        self.activations = ActivationConvention.from_options(options.convention_map).quant()
        self.dtype = DTYPES[options.dtype]
        self.config, _ = transformers_config(checkpoint, options)
        self.model = self._build()
        self._swap_in_integer_modules(self.model, self.plan, self.dtype)

    def _build(self) -> nn.Module:
        """The model from its config, parameters on the meta device."""
        # The integer modules replace what the quantization config would make Transformers build.
        return meta_model(self.config, self.dtype, self.checkpoint)

    def expected_tensors(self) -> tuple[list[str], list[str]]:
        """(missing, unexpected): tensors the model needs that the files lack, and the reverse, by name, from
        the safetensors headers; a tied target the files do not store is filled from its source."""
        slots = tensor_slots(self.model)
        if self.checkpoint.format in GPTQ_METHODS:
            stored = integer_names(self.checkpoint, self.plan)
        else:
            stored = {
                name
                for name in self.checkpoint.tensors
                if not (name.endswith(".weight_shape") and name.removesuffix(".weight_shape") in self.plan)
            }
        tied = getattr(self.model, "all_tied_weights_keys", None) or {}
        missing = sorted(n for n in slots if n not in stored and not (n in tied and tied[n] in stored))
        unexpected = sorted(n for n in stored if n not in slots)
        return missing, unexpected

    def _swap_in_integer_modules(
        self, model: nn.Module, plan: dict[str, QuantizedModule], dtype: torch.dtype
    ) -> None:
        """Replace the quantized Linear layers and the fused experts (which must be quantized)."""
        claimed: set[str] = set()
        replacements: dict[str, nn.Module] = {}
        # A GPTQ or AWQ config targets no modules by name: what its files store quantized is what runs so.
        lookup = (
            None
            if self.checkpoint.format in GPTQ_METHODS
            else SchemeLookup(self.checkpoint.quantization_config or {}, self.checkpoint.path / "config.json")
        )
        for name, module in model.named_modules():
            if fused_experts(module):
                first = f"{name}.0.gate_proj"
                if first not in plan:
                    raise InputError(
                        f"the routed experts of {name} are not quantized in the files; intref executes "
                        "quantized experts only",
                        self.checkpoint.path,
                    )
                experts = []
                num_experts, two_i, hidden = module.gate_up_proj.shape
                for e in range(num_experts):
                    projections = []
                    for proj, shape in (
                        ("gate_proj", (two_i // 2, hidden)),
                        ("up_proj", (two_i // 2, hidden)),
                        ("down_proj", (hidden, two_i // 2)),
                    ):
                        projections.append(self._int_linear(plan, f"{name}.{e}.{proj}", shape, False, dtype))
                        claimed.add(f"{name}.{e}.{proj}")
                    experts.append(IntExpert(*projections))
                replacements[name] = IntExperts(experts, module.act_fn, dtype)
            elif isinstance(module, nn.Linear) and name in plan:
                shape = (module.out_features, module.in_features)
                replacements[name] = self._int_linear(plan, name, shape, module.bias is not None, dtype)
                claimed.add(name)
            elif lookup is not None and isinstance(module, nn.Linear | nn.Embedding):
                # A layer the config quantizes but the files store dense would run dense here, silently.
                kind = "linear" if isinstance(module, nn.Linear) else "embedding"
                coverage = lookup.covering(name, kind)
                if coverage.group is not None:
                    raise InputError(
                        f"config group {coverage.group!r} quantizes {name}, but the files store it "
                        "unquantized",
                        self.checkpoint.path,
                    )
        unclaimed = sorted(set(plan) - claimed)
        if unclaimed:
            raise InputError(
                f"{len(unclaimed)} quantized modules of the files are not Linear layers or experts of the "
                f"model ({', '.join(unclaimed[:3])}); intref cannot execute them",
                self.checkpoint.path,
            )
        for name, replacement in replacements.items():
            model.set_submodule(name, replacement)

    def _int_linear(
        self,
        plan: dict[str, QuantizedModule],
        name: str,
        shape: tuple[int, int],
        bias: bool,
        dtype: torch.dtype,
    ) -> IntLinear:
        quantized = plan.get(name)
        if quantized is None:
            raise InputError(f"{name} is not quantized in the files", self.checkpoint.path)
        if (quantized.out_features, quantized.in_features) != shape:
            raise InputError(
                f"{name}: the files hold ({quantized.out_features}, {quantized.in_features}) weights, the "
                f"model's config a {shape} layer",
                self.checkpoint.path,
            )
        layer = IntLinear(
            shape[1],
            shape[0],
            quantized.bits,
            self.activations,
            dtype,
            bias=bias,
            group_size=quantized.group_size,
            zero_point=quantized.zero_point,
            storage="packed" if quantized.storage == "packed" else "int8",
            g_idx=quantized.g_idx,
        )
        # A weight-only scheme's activations are quantized by the integer path, not by the scheme.
        layer.weight_only = quantized.weight_only
        return layer

    def load(self, device: str) -> nn.Module:
        """Every tensor of the files into the skeleton, the generation config, then the device."""
        self._load_tensors(self.model, self.plan, self.dtype)
        set_generation_config(self.model, self.checkpoint)
        return self.model.to(device) if device != "cpu" else self.model

    def _load_tensors(self, model: nn.Module, plan: dict[str, QuantizedModule], dtype: torch.dtype) -> None:
        """Every tensor of the files into the model, by name; missing or unexpected tensors are refused."""
        self.load_named(model, plan, dtype)
        tie_weights(model)
        missing = sorted(n for n, t in named_tensors(model) if t.is_meta)
        refuse_mismatch(self.checkpoint, missing, [])

    def load_named(
        self,
        model: nn.Module,
        plan: dict[str, QuantizedModule],
        dtype: torch.dtype,
        names: Iterable[str] | None = None,
    ) -> None:
        """The tensors `names` of the files (default: all) into the model, by name, on the CPU; a tensor the
        model has no place for is refused. Streamed execution loads one decoder layer's names at a time."""
        keep_fp32 = list(model._get_dtype_plan(dtype)) if hasattr(model, "_get_dtype_plan") else []
        slots = tensor_slots(model)
        unexpected: list[str] = []
        read = (
            integer_tensors(self.checkpoint, plan, names)
            if self.checkpoint.format in GPTQ_METHODS
            else self.checkpoint.iter_tensors(names)
        )
        for name, tensor in read:
            module_name, _, leaf = name.rpartition(".")
            if leaf == "weight_shape" and module_name in plan:
                continue  # checked against the model's layer by integer_modules and _int_linear
            slot = slots.get(name)
            if slot is None:
                unexpected.append(name)
                continue
            owner, kind, placeholder = slot
            if tuple(tensor.shape) != tuple(placeholder.shape):
                raise InputError(
                    f"tensor {name} has shape {tuple(tensor.shape)}; the model expects "
                    f"{tuple(placeholder.shape)}",
                    self.checkpoint.path,
                )
            if isinstance(owner, IntLinear) and leaf != "bias":
                zero_point = leaf == "weight_zero_point" and not tensor.is_floating_point()
                if leaf != "weight_scale" and not zero_point and tensor.dtype != placeholder.dtype:
                    raise InputError(
                        f"tensor {name} is {tensor.dtype}, not {placeholder.dtype}", self.checkpoint.path
                    )
                value = tensor  # integer weights and their scales exactly as stored
            elif tensor.is_floating_point():
                fp32 = any(re.search(rf"(^|\.){re.escape(k)}(\.|$)", name) for k in keep_fp32)
                value = tensor.to(torch.float32 if fp32 else dtype)
            else:
                value = tensor
            if kind == "parameter":
                owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
            else:
                owner._buffers[leaf] = value
            if isinstance(owner, IntLinear) and leaf == "weight_g_idx":
                try:  # a bad group index is the file's fault, found here rather than at the first forward
                    owner.column_order()
                except ValueError as exc:
                    raise InputError(f"tensor {name}: {exc}", self.checkpoint.path) from None
        refuse_mismatch(self.checkpoint, [], unexpected)


def check_intref_load_plan(checkpoint: Checkpoint, options: BackendOptions) -> None:
    """Refuse, from the files alone, a checkpoint whose tensors do not match the integer model (missing
    tensors would be left on the meta device, unexpected ones would be ignored)."""
    missing, unexpected = IntegerSkeleton(checkpoint, options).expected_tensors()
    refuse_mismatch(checkpoint, missing, unexpected)


class IntrefBackend(HFBackend):
    """The candidate built by Transformers' model classes, its quantized layers run in integer arithmetic.

    Every primitive of `HFBackend` runs unchanged on this model: only `load_model` differs.
    """

    def load_model(self, kwargs: dict[str, Any]) -> Any:
        """Build on the meta device, swap in the integer modules, then load every tensor from the files.

        `kwargs` (what `from_pretrained` would be given) go unused: nothing passes through `from_pretrained`.
        """
        skeleton = IntegerSkeleton(self.checkpoint, self.options)
        self.activations: ActivationQuant = skeleton.activations
        return skeleton.load(self.options.device)

    def describe(self) -> dict[str, Any]:
        """The integer execution: its activation convention, and how many integer layers and routed experts
        exist and have run so far."""
        return integer_execution(self.model, self.activations, self.checkpoint)

    def integer_counters(self) -> dict[str, int]:
        """Cumulative use of the integer path: forwards per integer Linear, tokens per routed expert.

        Keys: the names of Linear layers outside the routed experts, and `<experts module>.<e>` for experts.
        """
        return integer_counters(self.model)

    def integer_inventory(self) -> dict[str, int]:
        """How many integer Linear layers (outside routed experts) and routed experts the model holds."""
        linears, experts = _integer_modules(self.model)
        return {"int_layers": len(linears), "int_experts": sum(m.num_experts for m in experts.values())}


def integer_execution(
    model: nn.Module, activations: ActivationQuant, checkpoint: Checkpoint
) -> dict[str, Any]:
    """How a model with integer modules ran: the activation convention, and how many integer layers and
    routed experts it holds and has run so far (`describe()` of the loaded and streamed backends)."""
    linears, experts = _integer_modules(model)
    ran = {name for name, n in integer_counters(model).items() if n > 0}
    layers = [m for m in model.modules() if isinstance(m, IntLinear)]
    added = any(getattr(m, "weight_only", False) for m in layers)
    return {
        "backend": "intref",
        "execution": "evalsuite integer reference (INT8 per-token activations, exact integer accumulation)",
        # Which integer arithmetic ran: the weight schemes, and whose activation quantization it was.
        "convention": integer_convention(layers, activations, added),
        "format": checkpoint.format,
        "activations": {"divisor": activations.divisor, "rounding": activations.rounding},
        # Experts are counted as `<experts module>.<e>`; Linear layers by their own names.
        "int_layers": sum(1 for name in ran if not name.rsplit(".", 1)[-1].isdigit()),
        "int_experts": sum(1 for name in ran if name.rsplit(".", 1)[-1].isdigit()),
        "int_layers_total": len(linears),
        "int_experts_total": sum(m.num_experts for m in experts.values()),
    }


def integer_convention(layers: list[IntLinear], activations: ActivationQuant, added: bool) -> str:
    """The integer arithmetic in words, e.g. `W4 group 64 asymmetric × A8 per token (divisor 127.5,
    half_even; added by intref: the scheme keeps 16-bit activations)`."""
    weights = " + ".join(sorted({m.convention() for m in layers})) or "no integer layers"
    source = "added by intref: the scheme keeps 16-bit activations" if added else "the scheme's"
    return f"{weights} × A8 per token (divisor {activations.divisor:g}, {activations.rounding}; {source})"


def integer_counters(model: nn.Module) -> dict[str, int]:
    """Forwards per integer Linear (outside routed experts) and tokens per routed expert `<experts>.<e>`."""
    linears, experts = _integer_modules(model)
    counters = {name: module.calls for name, module in linears.items()}
    for name, module in experts.items():
        counters.update({f"{name}.{e}": n for e, n in enumerate(module.tokens)})
    return counters


def _integer_modules(model: nn.Module) -> tuple[dict[str, IntLinear], dict[str, IntExperts]]:
    """The integer Linear layers outside routed experts, and the routed-experts modules, by name."""
    experts = {name: m for name, m in model.named_modules() if isinstance(m, IntExperts)}
    inside = {id(linear) for m in experts.values() for linear in m.modules() if isinstance(linear, IntLinear)}
    linears = {
        name: m for name, m in model.named_modules() if isinstance(m, IntLinear) and id(m) not in inside
    }
    return linears, experts
