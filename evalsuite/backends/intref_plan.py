"""Can the integer path execute this checkpoint? Decided from config.json and the safetensors headers alone,
before any model is built (see `evalsuite.backends.intref` for the execution itself).

The checkpoint must be compressed-tensors with every config group's weights integers: INT4 or INT8, per
output channel or per group of input columns, symmetric or asymmetric (integer zero points), stored packed
(`pack-quantized`) or as int8 (`int-quantized`, INT4 values too); solved in any order. GPTQ's
`actorder: "static"` (alias `"weight"`) changes the order the columns were solved in, not the layout, so it
needs nothing; `actorder: "group"` scatters a group's columns and stores `weight_g_idx`, which the integer
path then uses to gather each group (per group only: a per-channel scale spans every column). Activations
dynamic symmetric per-token INT8, or none (a weight-only W4A16 / W8A16 scheme, whose activations the integer
path then quantizes per token itself, and says so). The files and the config must agree on every quantized
module, as compressed-tensors resolves it. FP8 and FP4 weights have no integer path. GPTQ and AWQ packs
(INT4 / INT8 codes with zero points, weight-only) are planned from their own headers (`_gptq_modules`) and
handed to the integer path in compressed-tensors' int-quantized layout (`backends.intref_gptq`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from evalsuite.backends._intlinear import MAX_IN_FEATURES, ActivationQuant
from evalsuite.contract.spec import StrictModel
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.formats.compressed_tensors import SchemeLookup

# Tensors of a quantized module in a compressed-tensors file; anything else under such a module is refused.
_INT_SUFFIXES = (
    "weight_packed",
    "weight_shape",
    "weight_scale",
    "weight",
    "weight_zero_point",
    "weight_g_idx",
)
# `actorder` values that leave the stored layout as it is without activation order.
SOLVE_ORDER_ONLY = (None, "static", "weight")
# `actorder` values whose weights store the group of every input column (`weight_g_idx`).
SCATTERED_GROUPS = ("group", "dynamic")


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


# The input activations the integer path executes: dynamic symmetric per-token INT8, as compressed-tensors
# writes them in a config group. Backend `hf` gives a weight-only group these very ones when a task asks it
# to run a candidate as intref does (`ADD_ACTIVATION_QUANTIZATION`).
DYNAMIC_INT8_PER_TOKEN = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "token",
    "dynamic": True,
}


@dataclass(frozen=True)
class QuantizedModule:
    """A module the file stores quantized: its name, weight bits and logical shape, and how it is stored:
    packed int32 words or int8, the group size (None: per channel), whether it has zero points, and whether
    its scheme leaves activations unquantized (the integer path then quantizes them itself), and whether it
    stores `weight_g_idx` (its groups' columns scattered by activation order)."""

    name: str
    bits: int
    out_features: int
    in_features: int
    storage: str = "packed"
    group_size: int | None = None
    zero_point: bool = False
    weight_only: bool = False
    g_idx: bool = False


def integer_modules(checkpoint: Checkpoint) -> dict[str, QuantizedModule]:
    """Every quantized module of a compressed-tensors checkpoint the integer path can execute, by name.

    Reads the config and the safetensors headers only. Raises `InputError`, with the reason, for a checkpoint
    that is not integer W4A8/W8A8 with dynamic symmetric per-token INT8 activations and symmetric per-channel
    INT4 (`pack-quantized`) or INT8 (`int-quantized`) weights.
    """
    if checkpoint.format in ("gptq", "awq"):
        return _gptq_modules(checkpoint)
    if checkpoint.format != "compressed-tensors":
        raise InputError(
            f"intref executes compressed-tensors integer checkpoints; this one is {checkpoint.format}, "
            "whose files the integer path does not read",
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
    lookup = SchemeLookup(qc, checkpoint.path / "config.json")
    modules: dict[str, QuantizedModule] = {}
    for module in quantized:
        extra = sorted(leaves[module] - {*_INT_SUFFIXES, "bias"})
        if extra:
            raise InputError(
                f"{module} has {', '.join(extra)}: only weights with dynamic activations (no static "
                "activation scales) execute on the integer path",
                checkpoint.path,
            )
        # The files and the config must agree on every quantized module, as compressed-tensors resolves it.
        coverage = lookup.covering(module, "linear")
        if coverage.group is None:
            raise InputError(f"{module} is stored quantized but no config group targets it", checkpoint.path)
        weights = coverage.scheme.weights
        bits = int(weights.num_bits)
        scale = tensors[f"{module}.weight_scale"]
        if (packed := tensors.get(f"{module}.weight_packed")) is not None:
            stored, storage = "pack-quantized", "packed"
            shape = shapes.get(module)
            if packed.dtype != "I32" or shape is None or len(shape) != 2:
                raise InputError(
                    f"{module}: pack-quantized weights need int32 words and a weight_shape", checkpoint.path
                )
            out_features, in_features = shape
            if packed.shape != (out_features, math.ceil(in_features * bits / 32)):
                raise InputError(
                    f"{module}: {packed.shape} int32 words do not hold INT{bits} weights of shape "
                    f"({out_features}, {in_features})",
                    checkpoint.path,
                )
        elif (weight := tensors.get(f"{module}.weight")) is not None and weight.dtype == "I8":
            stored, storage = "int-quantized", "int8"
            if len(weight.shape) != 2:
                raise InputError(f"{module}: int8 weight of shape {weight.shape}", checkpoint.path)
            out_features, in_features = weight.shape
        else:
            raise InputError(f"{module} has a weight_scale but no INT4 or INT8 weight", checkpoint.path)
        if coverage.format not in (None, stored):
            raise InputError(
                f"{module} is stored {stored} but its config group {coverage.group!r} says {coverage.format}",
                checkpoint.path,
            )
        group_size = int(weights.group_size) if str(weights.strategy) == "group" else None
        groups = 1 if group_size is None else math.ceil(in_features / group_size)
        if scale.shape != (out_features, groups):
            what = (
                "one scale per output channel" if group_size is None else f"one scale per {group_size} inputs"
            )
            raise InputError(f"{module}: weight_scale of shape {scale.shape} is not {what}", checkpoint.path)
        g_idx = tensors.get(f"{module}.weight_g_idx")
        # Read from the config as written: compressed-tensors >= 0.19 no longer knows "group" (SchemeLookup).
        actorder = (
            ((qc.get("config_groups") or {}).get(coverage.group) or {}).get("weights", {}).get("actorder")
        )
        scattered = actorder in SCATTERED_GROUPS
        if g_idx is not None and group_size is None:
            raise InputError(
                f"{module}: weight_g_idx stored for per-channel scales, which have no groups to index",
                checkpoint.path,
            )
        if (g_idx is not None) != scattered:
            raise InputError(
                f"{module}: weight_g_idx {'stored' if g_idx is not None else 'missing'} for actorder "
                f"{actorder!r}",
                checkpoint.path,
            )
        if g_idx is not None and (g_idx.dtype != "I32" or g_idx.shape != (in_features,)):
            raise InputError(
                f"{module}: weight_g_idx is {g_idx.dtype} {g_idx.shape}, not one int32 group per column",
                checkpoint.path,
            )
        zero_point = f"{module}.weight_zero_point" in tensors
        if zero_point == bool(weights.symmetric):
            raise InputError(
                f"{module}: zero points {'stored' if zero_point else 'missing'} for a "
                f"{'symmetric' if weights.symmetric else 'asymmetric'} scheme",
                checkpoint.path,
            )
        if in_features > MAX_IN_FEATURES:
            raise InputError(
                f"{module}: {in_features} inputs could overflow INT32 accumulation", checkpoint.path
            )
        modules[module] = QuantizedModule(
            module,
            bits,
            out_features,
            in_features,
            storage=storage,
            group_size=group_size,
            zero_point=zero_point,
            weight_only=coverage.scheme.input_activations is None,
            g_idx=g_idx is not None,
        )
    return modules


def _gptq_modules(checkpoint: Checkpoint) -> dict[str, QuantizedModule]:
    """Every `qweight` module of a GPTQ or AWQ pack, read as the integer path reads compressed-tensors'
    int-quantized layout (`backends.intref_gptq` hands it the tensors so): INT4 or INT8 codes with integer
    zero points, per group or per channel, GPTQ's `g_idx` followed; weight-only, so the integer path
    quantizes the activations itself."""
    from evalsuite.formats.gptq import GptqFormat, layout_problems, stored_shape

    fmt = GptqFormat(checkpoint)
    if fmt.bits not in (4, 8):
        raise InputError(f"{fmt.method} packs of {fmt.bits}-bit codes have no integer path", checkpoint.path)
    modules: dict[str, QuantizedModule] = {}
    for name in sorted(n for n in checkpoint.tensors if n.endswith(".qweight")):
        module = name.removesuffix(".qweight")
        parts = {
            part: info
            for part in ("qweight", "qzeros", "scales", "g_idx")
            if (info := checkpoint.tensors.get(f"{module}.{part}")) is not None
        }
        shape = stored_shape(fmt.method, fmt.bits, parts)
        problems = layout_problems(fmt, shape, parts) if shape else ["qweight is not a 2-D int32 tensor"]
        if problems:
            raise InputError(f"{module}: {problems[0]}", checkpoint.path)
        assert shape is not None
        out_features, in_features = shape
        if in_features > MAX_IN_FEATURES:
            raise InputError(
                f"{module}: {in_features} inputs could overflow INT32 accumulation", checkpoint.path
            )
        group_size = fmt.group_size if 0 < fmt.group_size < in_features else None
        modules[module] = QuantizedModule(
            module,
            fmt.bits,
            out_features,
            in_features,
            storage="int8",
            group_size=group_size,
            zero_point=not fmt.symmetric,
            weight_only=True,
            g_idx="g_idx" in parts and group_size is not None,
        )
    if not modules:
        raise InputError("no quantized module in the files (no qweight tensor)", checkpoint.path)
    return modules


def _check_quantization_config(qc: dict[str, Any], path: Path) -> None:
    """Every config group's weights must be INT4/INT8 per channel or group, its inputs dynamic per-token INT8
    or unquantized."""
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
        w_ok = (
            weights.get("type") == "int"
            and weights.get("strategy") in ("channel", "group")
            and not weights.get("dynamic")
            and (
                weights.get("actorder") in SOLVE_ORDER_ONLY
                or (weights.get("actorder") in SCATTERED_GROUPS and weights.get("strategy") == "group")
            )
            and weights.get("num_bits") in (4, 8)
            and fmt in (None, "pack-quantized", "int-quantized")
        )
        if not w_ok:
            raise InputError(
                f"{where}: weights {weights.get('num_bits')}-bit {weights.get('type')} "
                f"{weights.get('strategy')} actorder={weights.get('actorder')} as {fmt}; the integer path "
                "executes INT4 / INT8 weights per channel or per group (pack-quantized or int-quantized, "
                "groups scattered by activation order only with groups), not FP8 or FP4",
                path,
            )
        if inputs is None:
            continue  # weight-only: the integer path quantizes activations itself (and reports so)
        # The flags must be JSON `true` itself (a 1 is not), the rest equal.
        a_ok = all(
            inputs.get(key) is value if isinstance(value, bool) else inputs.get(key) == value
            for key, value in DYNAMIC_INT8_PER_TOKEN.items()
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


def integer_modules_or_reason(checkpoint: Checkpoint) -> dict[str, QuantizedModule] | str:
    """`integer_modules`, or why the integer path cannot execute this checkpoint (from its files)."""
    try:
        return integer_modules(checkpoint)
    except InputError as exc:
        return str(exc).removeprefix(f"{checkpoint.path}: ")


def unsupported_reason(checkpoint: Checkpoint) -> str | None:
    """Why the integer path cannot execute this checkpoint (from its files), or None when it can."""
    found = integer_modules_or_reason(checkpoint)
    return found if isinstance(found, str) else None
