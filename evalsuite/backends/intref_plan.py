"""Can the integer W4A8 / W8A8 path execute this checkpoint? Decided from config.json and the safetensors
headers alone, before any model is built (see `evalsuite.backends.intref` for the execution itself).

The checkpoint must be compressed-tensors with every config group symmetric per-channel INT4
(`pack-quantized`) or INT8 (`int-quantized`) weights and dynamic symmetric per-token INT8 activations; the
files and the config must agree on every quantized module, as compressed-tensors resolves it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from evalsuite.backends._intlinear import MAX_IN_FEATURES, ActivationQuant
from evalsuite.checkpoint import Checkpoint
from evalsuite.errors import InputError
from evalsuite.formats.compressed_tensors import SchemeLookup
from evalsuite.spec import StrictModel

# Tensors of a quantized module in a compressed-tensors file; anything else under such a module is refused.
_INT_SUFFIXES = ("weight_packed", "weight_shape", "weight_scale", "weight")


class ActivationConvention(StrictModel):
    """How the integer path quantizes activations, per token: the conventions backend `intref` takes from
    the task that runs it (the `[activations]` table of tasks/intref.toml)."""

    divisor: float = Field(default=127.5, gt=0)  # scale = max|x| / divisor (127.5: compressed-tensors' INT8)
    rounding: Literal["half_even", "half_away_from_zero"] = "half_even"

    def quant(self) -> ActivationQuant:
        return ActivationQuant(divisor=self.divisor, rounding=self.rounding)

    @classmethod
    def from_options(cls, conventions: dict[str, Any]) -> ActivationConvention:
        """The convention handed down in a side's options (defaults for what is not given)."""
        try:
            return cls.model_validate(conventions)
        except ValidationError as exc:
            raise InputError(f"invalid intref activation convention: {exc.errors()[0]['msg']}") from None


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
