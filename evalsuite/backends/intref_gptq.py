"""A GPTQ or AWQ pack's tensors as the integer path takes them: each module's stored codes, zero points,
scales and group index handed to `IntLinear` in compressed-tensors' int-quantized layout, so that the pack
runs through the same integer arithmetic as every other.

GPTQ and AWQ store unsigned `b`-bit codes `q` and zero points `z` (`W = s · (q − z)`); `IntLinear` holds
signed codes and zero points (`W = s · (w − zp)`): both are recentred by 2^(b−1), which leaves every
difference, and so every product and sum, as it was. A symmetric pack's zero points must all be 2^(b−1)
(then none is passed); the scales are transposed to (out, groups) and kept in their stored float16.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from evalsuite.backends.intref_plan import QuantizedModule
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.formats.gptq import PARAMS, GptqFormat, codes, zero_points


def _module_of(name: str, plan: dict[str, QuantizedModule]) -> str | None:
    """The planned module a stored tensor belongs to, or None for a tensor loaded as it is."""
    module, _, part = name.rpartition(".")
    return module if part in PARAMS and module in plan else None


def integer_names(checkpoint: Checkpoint, plan: dict[str, QuantizedModule]) -> set[str]:
    """The tensor names the integer model receives: every stored tensor but the planned modules' parts, and
    each planned module's `IntLinear` buffers."""
    names = {name for name in checkpoint.tensors if _module_of(name, plan) is None}
    for module, quantized in plan.items():
        names |= {f"{module}.weight", f"{module}.weight_scale"}
        if quantized.zero_point:
            names.add(f"{module}.weight_zero_point")
        if quantized.g_idx:
            names.add(f"{module}.weight_g_idx")
    return names


def integer_tensors(
    checkpoint: Checkpoint, plan: dict[str, QuantizedModule], names: Iterable[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of the stored `names` (default: all) as the integer model takes them: a planned module's
    parts once as its `IntLinear` buffers, everything else as stored."""
    wanted = list(checkpoint.tensors) if names is None else list(names)
    yield from checkpoint.iter_tensors(n for n in wanted if _module_of(n, plan) is None)
    fmt = GptqFormat(checkpoint)
    for module in sorted({m for n in wanted if (m := _module_of(n, plan)) is not None}):
        yield from _module_tensors(checkpoint, fmt, module, plan[module])


def _module_tensors(
    checkpoint: Checkpoint, fmt: GptqFormat, module: str, quantized: QuantizedModule
) -> Iterator[tuple[str, torch.Tensor]]:
    read = checkpoint.read_tensor
    centre = 1 << (fmt.bits - 1)
    stored = codes(fmt, read(f"{module}.qweight").numpy()).T  # (out, in)
    zeros = zero_points(fmt, read(f"{module}.qzeros").numpy(), quantized.out_features)  # (G, out)
    scales = read(f"{module}.scales")
    yield f"{module}.weight", torch.from_numpy(np.ascontiguousarray(stored - centre, dtype=np.int8))
    yield f"{module}.weight_scale", scales.t().contiguous()
    if quantized.zero_point:
        yield (
            f"{module}.weight_zero_point",
            torch.from_numpy(np.ascontiguousarray(zeros.T - centre, dtype=np.int8)),
        )
    elif (zeros != centre).any():
        raise InputError(
            f"{module}: zero points other than {centre} in a symmetric {fmt.method} pack", checkpoint.path
        )
    if quantized.g_idx:
        yield f"{module}.weight_g_idx", read(f"{module}.g_idx").to(torch.int32)
