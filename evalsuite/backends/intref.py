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

The activation convention (per-token divisor 127.5 or 127, rounding) is the `[activations]` table of
`tasks/intref.toml`, so `--backend intref` under any task and the `intref` task itself run the same model.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, ValidationError
from torch import nn

from evalsuite.backends._intlinear import MAX_IN_FEATURES, ActivationQuant, IntExpert, IntExperts, IntLinear
from evalsuite.backends.hf import DTYPES, HFBackend, _first_line, _model_class
from evalsuite.checkpoint import Checkpoint
from evalsuite.errors import DependencyError, InputError
from evalsuite.formats.compressed_tensors import SchemeLookup
from evalsuite.side import BackendOptions
from evalsuite.spec import StrictModel, default_spec_path

# Tensors of a quantized module in a compressed-tensors file; anything else under such a module is refused.
_INT_SUFFIXES = ("weight_packed", "weight_shape", "weight_scale", "weight")


class ActivationSpec(StrictModel):
    """`[activations]` of tasks/intref.toml: how the integer path quantizes activations, per token."""

    divisor: float = Field(default=127.5, gt=0)  # scale = max|x| / divisor (127.5: compressed-tensors' INT8)
    rounding: Literal["half_even", "half_away_from_zero"] = "half_even"

    def quant(self) -> ActivationQuant:
        return ActivationQuant(divisor=self.divisor, rounding=self.rounding)


def activation_convention(spec_file: Path | None = None) -> ActivationQuant:
    """The activation convention of the `intref` spec file (`[activations]`; defaults where it is absent)."""
    path = spec_file or default_spec_path("intref")
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8")).get("activations", {})
        return ActivationSpec.model_validate(table).quant()
    except FileNotFoundError:
        raise InputError("spec file does not exist", path) from None
    except (tomllib.TOMLDecodeError, ValidationError) as exc:
        raise InputError(f"invalid [activations] table: {_first_line(exc)}", path) from None


@dataclass(frozen=True)
class QuantizedModule:
    """A module the file stores quantized: its name, weight bits (4 packed or 8 as int8) and logical shape."""

    name: str
    bits: int
    out_features: int
    in_features: int


def integer_modules(checkpoint: Checkpoint) -> dict[str, QuantizedModule]:
    """Every quantized module of a compressed-tensors checkpoint the integer path can execute, by name.

    Reads the config and the safetensors headers only. Raises `InputError`, with the reason, for a checkpoint
    that is not integer W4A8/W8A8 with dynamic symmetric per-token INT8 activations and symmetric per-channel
    INT4 (`pack-quantized`) or INT8 (`int-quantized`) weights.
    """
    if checkpoint.format != "compressed-tensors":
        raise InputError(
            f"intref executes compressed-tensors integer checkpoints; this one is {checkpoint.format}, "
            "which has no integer weights to execute",
            checkpoint.path,
        )
    qc = checkpoint.quantization_config or {}
    _check_quantization_config(qc, checkpoint.path)
    tensors = checkpoint.tensors
    leaves: dict[str, set[str]] = {}
    for name in tensors:
        module, _, leaf = name.rpartition(".")
        leaves.setdefault(module, set()).add(leaf)
    quantized = sorted(m for m, names in leaves.items() if "weight_scale" in names)
    if not quantized:
        raise InputError("no quantized module in the files (no weight_scale tensor)", checkpoint.path)
    # One pass over the shards for the small weight_shape tensors, not one open per module.
    shapes = {
        name.removesuffix(".weight_shape"): tuple(int(v) for v in t.tolist())
        for name, t in checkpoint.iter_tensors(
            f"{m}.weight_shape" for m in quantized if "weight_shape" in leaves[m]
        )
    }
    modules: dict[str, QuantizedModule] = {}
    for module in quantized:
        extra = sorted(leaves[module] - {*_INT_SUFFIXES, "bias"})
        if extra:
            raise InputError(
                f"{module} has {', '.join(extra)}: only symmetric weights with dynamic activations "
                "(no zero points, no static activation scales) execute on the integer path",
                checkpoint.path,
            )
        scale = tensors[f"{module}.weight_scale"]
        if (packed := tensors.get(f"{module}.weight_packed")) is not None:
            shape = shapes.get(module)
            if packed.dtype != "I32" or shape is None or len(shape) != 2:
                raise InputError(
                    f"{module}: pack-quantized weights need int32 words and a weight_shape", checkpoint.path
                )
            out_features, in_features = shape
            if packed.shape != (out_features, math.ceil(in_features / 8)):
                raise InputError(
                    f"{module}: {packed.shape} int32 words do not hold INT4 weights of shape "
                    f"({out_features}, {in_features})",
                    checkpoint.path,
                )
            bits = 4
        elif (weight := tensors.get(f"{module}.weight")) is not None and weight.dtype == "I8":
            if len(weight.shape) != 2:
                raise InputError(f"{module}: int8 weight of shape {weight.shape}", checkpoint.path)
            out_features, in_features = weight.shape
            bits = 8
        else:
            raise InputError(f"{module} has a weight_scale but no INT4 or INT8 weight", checkpoint.path)
        if scale.shape != (out_features, 1):
            raise InputError(
                f"{module}: weight_scale of shape {scale.shape} is not one scale per output channel",
                checkpoint.path,
            )
        if in_features > MAX_IN_FEATURES:
            raise InputError(
                f"{module}: {in_features} inputs could overflow INT32 accumulation", checkpoint.path
            )
        modules[module] = QuantizedModule(module, bits, out_features, in_features)
    lookup = SchemeLookup(qc, checkpoint.path / "config.json")
    for module, quantized in modules.items():
        # The files and the config must agree on every quantized module, as compressed-tensors resolves it.
        coverage = lookup.covering(module, "linear")
        stored = "pack-quantized" if quantized.bits == 4 else "int-quantized"
        if coverage.group is None:
            raise InputError(f"{module} is stored quantized but no config group targets it", checkpoint.path)
        if coverage.format not in (None, stored):
            raise InputError(
                f"{module} is stored {stored} but its config group {coverage.group!r} says {coverage.format}",
                checkpoint.path,
            )
    return modules


def _check_quantization_config(qc: dict[str, Any], path: Path) -> None:
    """Every config group must be W4A8/W8A8: symmetric per-channel weights, dynamic per-token INT8 inputs."""
    if qc.get("quantization_status") != "compressed":
        raise InputError(
            f"quantization_status is {qc.get('quantization_status')!r}: only compressed weights are integers",
            path,
        )
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qc.get(key):
            raise InputError(f"quantization_config.{key} is set; the integer path executes none", path)
    groups = qc.get("config_groups") or {}
    if not groups:
        raise InputError("quantization_config has no config_groups", path)
    for name, group in groups.items():
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        fmt = group.get("format") or qc.get("format")
        where = f"config group {name!r}"
        if inputs is None:
            raise InputError(f"{where} quantizes weights only: there is no integer activation path", path)
        w_ok = (
            weights.get("type") == "int"
            and weights.get("symmetric") is True
            and weights.get("strategy") == "channel"
            and not weights.get("dynamic")
            and (weights.get("num_bits"), fmt)
            in ((4, "pack-quantized"), (4, "int-quantized"), (8, "int-quantized"))
        )
        if not w_ok:
            raise InputError(
                f"{where}: weights {weights.get('num_bits')}-bit {weights.get('type')} "
                f"{weights.get('strategy')} symmetric={weights.get('symmetric')} as {fmt}; the integer path "
                "executes symmetric per-channel INT4 pack-quantized or INT8 int-quantized weights",
                path,
            )
        a_ok = (
            inputs.get("num_bits") == 8
            and inputs.get("type") == "int"
            and inputs.get("symmetric") is True
            and inputs.get("strategy") == "token"
            and inputs.get("dynamic") is True
        )
        if not a_ok:
            raise InputError(
                f"{where}: activations {inputs.get('num_bits')}-bit {inputs.get('type')} "
                f"{inputs.get('strategy')} dynamic={inputs.get('dynamic')}; the integer path executes "
                "dynamic symmetric per-token INT8 activations",
                path,
            )
        if group.get("output_activations"):
            raise InputError(f"{where} quantizes output activations; the integer path does not", path)


def unsupported_reason(checkpoint: Checkpoint) -> str | None:
    """Why the integer path cannot execute this checkpoint (from its files), or None when it can."""
    try:
        integer_modules(checkpoint)
    except InputError as exc:
        return str(exc).removeprefix(f"{checkpoint.path}: ")
    return None


def _fused_experts(module: nn.Module) -> bool:
    """Transformers' fused routed experts: 3-D `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
        and hasattr(module, "act_fn")
    )


class IntrefBackend(HFBackend):
    """The candidate built by Transformers' model classes, its quantized layers run in integer arithmetic.

    Every primitive of `HFBackend` runs unchanged on this model: only `load_model` differs.
    """

    def __init__(
        self, checkpoint: Checkpoint, options: BackendOptions, activations: ActivationQuant | None = None
    ) -> None:
        self.activations = activations or activation_convention()
        super().__init__(checkpoint, options)

    def load_model(self, kwargs: dict[str, Any]) -> Any:
        """Build on the meta device, swap in the integer modules, then load every tensor from the files.

        `kwargs` (what `from_pretrained` would be given) go unused: nothing passes through `from_pretrained`.
        """
        checkpoint, options = self.checkpoint, self.options
        plan = integer_modules(checkpoint)
        device = self._device(options.device)
        dtype = DTYPES[options.dtype]
        model = self._build(dtype)
        self._swap_in_integer_modules(model, plan, dtype)
        self._load_tensors(model, plan, dtype)
        self._generation_config(model)
        return model.to(device) if device.type != "cpu" else model

    @staticmethod
    def _device(device: str) -> torch.device:
        if device == "cpu":
            return torch.device("cpu")
        if device == "cuda" or device.startswith("cuda:"):
            if not torch.cuda.is_available():
                raise DependencyError(f"--device {device} needs CUDA, and this machine has none")
            return torch.device(device)
        raise InputError(f"backend intref runs on one device: cpu, cuda or cuda:N, not {device!r}")

    def _build(self, dtype: torch.dtype) -> nn.Module:
        """The model from its config, parameters on the meta device (buffers such as RoPE's are computed)."""
        from accelerate import init_empty_weights
        from transformers.utils import logging as hf_logging

        config = copy.deepcopy(self.config)
        # The integer modules replace what the quantization config would make Transformers build.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        cls = _model_class(config)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            with init_empty_weights(include_buffers=False), contextlib.redirect_stderr(io.StringIO()):
                return cls.from_config(config, dtype=dtype, trust_remote_code=False)
        except Exception as exc:
            raise InputError(
                f"Transformers cannot build the model from its config: {_first_line(exc)}",
                self.checkpoint.path,
            ) from None
        finally:
            hf_logging.set_verbosity(verbosity)

    def _swap_in_integer_modules(
        self, model: nn.Module, plan: dict[str, QuantizedModule], dtype: torch.dtype
    ) -> None:
        """Replace the quantized Linear layers and the fused experts (which must be quantized)."""
        claimed: set[str] = set()
        replacements: dict[str, nn.Module] = {}
        lookup = SchemeLookup(self.checkpoint.quantization_config or {}, self.checkpoint.path / "config.json")
        for name, module in model.named_modules():
            if _fused_experts(module):
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
            elif isinstance(module, nn.Linear | nn.Embedding):
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
        return IntLinear(shape[1], shape[0], quantized.bits, self.activations, dtype, bias=bias)

    def _load_tensors(self, model: nn.Module, plan: dict[str, QuantizedModule], dtype: torch.dtype) -> None:
        """Every tensor of the files into the model, by name; missing or unexpected tensors are refused."""
        keep_fp32 = list(model._get_dtype_plan(dtype)) if hasattr(model, "_get_dtype_plan") else []
        slots = _tensor_slots(model)
        unexpected: list[str] = []
        for name, tensor in self.checkpoint.iter_tensors():
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
                if leaf != "weight_scale" and tensor.dtype != placeholder.dtype:
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
        self._tie(model)
        missing = sorted(n for n, t in _named_tensors(model) if t.is_meta)
        if missing or unexpected:
            problems = []
            for what, names in (("missing from the files", missing), ("not in the model", unexpected)):
                if names:
                    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                    problems.append(f"{len(names)} tensors {what} ({shown})")
            raise InputError(
                "the files do not match the model Transformers builds from the config: "
                + "; ".join(problems),
                self.checkpoint.path,
            )

    @staticmethod
    def _tie(model: nn.Module) -> None:
        """Tie what the model ties (e.g. lm_head to the embedding) where the files do not store the target."""
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        for target, source in tied.items():
            owner_name, _, leaf = target.rpartition(".")
            owner = model.get_submodule(owner_name)
            current = owner._parameters.get(leaf)
            if current is not None and current.is_meta:
                owner._parameters[leaf] = model.get_parameter(source)

    def _generation_config(self, model: nn.Module) -> None:
        """The checkpoint's generation_config.json, as `from_pretrained` would set it."""
        from transformers import GenerationConfig

        if (self.checkpoint.path / "generation_config.json").is_file():
            with contextlib.suppress(Exception):
                model.generation_config = GenerationConfig.from_pretrained(str(self.checkpoint.path))

    def integer_counters(self) -> dict[str, int]:
        """Cumulative use of the integer path: forwards per integer Linear, tokens per routed expert.

        Keys: the names of Linear layers outside the routed experts, and `<experts module>.<e>` for experts.
        """
        linears, experts = _integer_modules(self.model)
        counters = {name: module.calls for name, module in linears.items()}
        for name, module in experts.items():
            counters.update({f"{name}.{e}": n for e, n in enumerate(module.tokens)})
        return counters

    def integer_inventory(self) -> dict[str, int]:
        """How many integer Linear layers (outside routed experts) and routed experts the model holds."""
        linears, experts = _integer_modules(self.model)
        return {"int_layers": len(linears), "int_experts": sum(m.num_experts for m in experts.values())}


def _integer_modules(model: nn.Module) -> tuple[dict[str, IntLinear], dict[str, IntExperts]]:
    """The integer Linear layers outside routed experts, and the routed-experts modules, by name."""
    experts = {name: m for name, m in model.named_modules() if isinstance(m, IntExperts)}
    inside = {id(linear) for m in experts.values() for linear in m.modules() if isinstance(linear, IntLinear)}
    linears = {
        name: m for name, m in model.named_modules() if isinstance(m, IntLinear) and id(m) not in inside
    }
    return linears, experts


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    params = list(model.named_parameters(remove_duplicate=False))
    persistent = [
        (f"{m}.{b}" if m else b, t)
        for m, module in model.named_modules()
        for b, t in module._buffers.items()
        if t is not None and b not in module._non_persistent_buffers_set
    ]
    return params + persistent


def _tensor_slots(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """Every parameter and persistent buffer by its state-dict name: (owning module, kind, current tensor)."""
    slots: dict[str, tuple[nn.Module, str, torch.Tensor]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for leaf, param in module._parameters.items():
            if param is not None:
                slots[prefix + leaf] = (module, "parameter", param)
        for leaf, buf in module._buffers.items():
            if buf is not None and leaf not in module._non_persistent_buffers_set:
                slots[prefix + leaf] = (module, "buffer", buf)
    return slots
