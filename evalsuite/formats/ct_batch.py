"""compressed-tensors weights of several modules decompressed together: one call of the library's own
decompression (`BaseCompressor.decompress`) for the rows of every module stored alike, where
`decompress_module` makes one call per module.

Why: a streamed decoding materialises a MoE layer's routed experts at every forward, up to 3 × 256 expert
projections a layer at the seed's shape, and each module's call costs its dispatch, a state dict and a
handful of small tensor operations before and after its arithmetic: at the seed's expert widths that was
more than the arithmetic. A layer's other quantized projections (attention, shared expert) are read in every
pass too.

Why the result is the library's, bit for bit: the decompression of the formats below is row-local. Each
output row is computed from that row's stored words (or bytes), its scale row and its zero points by the
library's unpacking (`unpack_from_int32`, `unpack_fp4_from_uint8`) and its `dequantize`: elementwise torch
operations whose value at an element does not depend on the other rows, nor on how many rows there are. So
the rows of modules stored alike (same format and quantization arguments, same columns and dtypes),
concatenated, decompress in one call into the concatenation of each module's decompressed rows. What is
per module rather than per row is given per row first: a `tensor` strategy's one scale, and NVFP4's global
scale as a (rows, 1, 1) tensor, which the library divides each row's group scales by elementwise (the
`tensors` task's `LibraryBatch` decodes samples of several tensors the same way). What cannot be
concatenated is decompressed alone, by the same call: zero points packed down the rows where a module's rows
do not fill whole int32 words, block scales whose blocks a module's rows do not fill, a stored `weight_g_idx`,
a format not listed. `tests/unit/test_ct_batch.py` holds the result equal to `decompress_module` on every
scheme the project reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from evalsuite.formats.compressed_tensors import DECODED_FORMATS

# The formats whose decompression is row-local (module docstring): every weight format of compressed-tensors
# 0.20 that llm-compressor writes for Linear layers, those the `tensors` task decodes with the library too.
ROW_LOCAL_FORMATS = DECODED_FORMATS
# The keys the decompression of those formats reads; any other key of a module (a bias, an activation scale)
# passes through it untouched, and is each module's own.
_READ = (
    "weight_packed",
    "weight",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_global_scale",
)

State = dict[str, torch.Tensor]


@dataclass
class Decompressed:
    """Modules decompressed together: `weight`, every module's decompressed weight, rows concatenated in the
    order the modules were given; `states`, each module's state dict as the library's `decompress` returns it
    for that module alone (its `weight` a view of its rows of `weight`)."""

    weight: torch.Tensor
    states: list[State]


def decompress_together(fmt: str, scheme: Any, states: Sequence[State]) -> Decompressed:
    """The modules' compressed state dicts (local names, `get_direct_state_dict`'s) decompressed by the
    compressor of format `fmt` under their shared `scheme`: in one library call where their rows can be
    concatenated (module docstring), one call per module otherwise."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(fmt)
    weights = getattr(scheme, "weights", None)
    if len(states) > 1 and fmt in ROW_LOCAL_FORMATS and weights is not None:
        together = _concatenated(states, weights, fmt)
        if together is not None:
            decompressed = _split(compressor.decompress(together[0], scheme), together, states)
            if decompressed is not None:
                return decompressed
    alone = [compressor.decompress(dict(state), scheme) for state in states]
    weight = alone[0]["weight"] if len(alone) == 1 else torch.cat([s["weight"] for s in alone])
    return Decompressed(weight, alone)


def _rows(state: State, fmt: str) -> int:
    """A module's weight rows, from what it stores."""
    shape = state.get("weight_shape")
    if fmt == "pack-quantized" and shape is not None:
        return int(shape[0])
    stored = state["weight_packed"] if "weight_packed" in state else state["weight"]
    return int(stored.shape[0])


def _concatenated(states: Sequence[State], weights: Any, fmt: str) -> tuple[State, list[int]] | None:
    """One state dict holding every module's rows, and each module's row count; None where the modules cannot
    be decompressed as one (module docstring)."""
    keys = [k for k in states[0] if k in _READ]
    if any([k for k in state if k in _READ] != keys for state in states) or "weight_g_idx" in states[0]:
        return None
    rows = [_rows(state, fmt) for state in states]
    strategy = str(getattr(weights.strategy, "value", weights.strategy))
    if strategy == "block":
        height = int(weights.block_structure[0])
        if any(r % height for r in rows):
            return None
    together: State = {}
    for key in keys:
        tensors = [state[key] for state in states]
        first = tensors[0]
        if any(t.dtype != first.dtype or t.shape[1:] != first.shape[1:] for t in tensors):
            return None
        if key == "weight_shape":
            if any(int(t[1]) != int(first[1]) for t in tensors):
                return None
            together[key] = torch.tensor([sum(rows), int(first[1])], dtype=first.dtype)
        elif key == "weight_global_scale" or (key == "weight_scale" and strategy == "tensor"):
            # One value per module, given to each of its rows: (rows, 1, 1) for a global scale, which divides
            # the (rows, groups, 1) group scales; (rows, 1) for a tensor's scale, which multiplies its rows.
            shape = (-1, 1, 1) if key == "weight_global_scale" else (-1, 1)
            if any(t.numel() != 1 for t in tensors):
                return None
            together[key] = torch.cat([t.reshape(1).expand(r) for t, r in zip(tensors, rows, strict=True)])
            together[key] = together[key].reshape(shape)
        elif key == "weight_zero_point" and fmt == "pack-quantized":
            # Packed down the rows, 32 / bits rows to an int32 word: modules concatenate where each one's rows
            # fill whole words.
            if any(r * int(weights.num_bits) % 32 for r in rows):
                return None
            together[key] = torch.cat(tensors)
        else:
            together[key] = torch.cat(tensors)
    return together, rows


def _split(result: State, together: tuple[State, list[int]], states: Sequence[State]) -> Decompressed | None:
    """Each module's share of the library's result: the rows of what the decompression made, the module's
    own tensors where it passed its input through; None where a made tensor is not by row."""
    given, rows = together
    total = sum(rows)
    pieces: dict[str, tuple[torch.Tensor, ...]] = {}
    for key, value in result.items():
        if given.get(key) is not value:
            if value.ndim == 0 or value.shape[0] != total:
                return None
            pieces[key] = torch.split(value, rows)
    out: list[State] = []
    for i, state in enumerate(states):
        own: State = {}
        for key in result:
            own[key] = pieces[key][i] if key in pieces else state[key]
        for key, value in state.items():
            if key not in _READ:
                own.setdefault(key, value)
        out.append(own)
    return Decompressed(result["weight"], out)


def decompress_modules(modules: Sequence[torch.nn.Module], force_format: Any | None = None) -> None:
    """What `compressed_tensors.compressors.decompress_module(module, force_format)` does to each module, with
    the modules of one scheme and format decompressed together (`decompress_together`): each module's format
    resolved and recorded on its scheme as that function does, its parameters replaced by its decompressed
    state (`replace_direct_state_dict`), its status set to decompressed. A format whose decompression is not
    known to be row-local goes through the library's `decompress_module`, one module at a time."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationScheme, QuantizationStatus
    from compressed_tensors.utils import get_direct_state_dict, replace_direct_state_dict

    groups: list[tuple[str, Any, list[torch.nn.Module]]] = []
    for module in modules:
        scheme = getattr(module, "quantization_scheme", None)
        if not isinstance(scheme, QuantizationScheme):
            continue
        scheme.format = CompressionFormat(
            force_format or scheme.format or infer_module_format(type(module), scheme)
        )
        fmt = scheme.format.value
        if fmt not in ROW_LOCAL_FORMATS:
            BaseCompressor.get_value_from_registry(fmt).decompress_module(module)
            continue
        for group_format, group_scheme, members in groups:
            if group_format == fmt and (group_scheme is scheme or group_scheme == scheme):
                members.append(module)
                break
        else:
            groups.append((fmt, scheme, [module]))
    for fmt, scheme, members in groups:
        by_columns: dict[tuple[Any, ...], list[torch.nn.Module]] = {}
        for module in members:
            state = get_direct_state_dict(module)
            stored = state.get("weight_packed", state.get("weight"))
            key = (None,) if stored is None else (tuple(stored.shape[1:]), stored.dtype, stored.device)
            by_columns.setdefault(key, []).append(module)
        for alike in by_columns.values():
            decompressed = decompress_together(fmt, scheme, [get_direct_state_dict(m) for m in alike])
            for module, state in zip(alike, decompressed.states, strict=True):
                replace_direct_state_dict(module, state)
                module.quantization_status = QuantizationStatus.DECOMPRESSED
