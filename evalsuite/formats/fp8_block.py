"""Block-wise FP8 checkpoints on disk (`quant_method: fp8` with `weight_block_size`, the layout of DeepSeek's
and Qwen's own FP8 releases, read by Transformers' `FineGrainedFP8Config`): what a quantized Linear stores and
how it decodes, with Transformers' own dequantization as the library decode it is checked against.

A module `X` of `out` × `in` weights with blocks of `bm` × `bn` stores `X.weight` in FP8 E4M3 (out, in) and
`X.weight_scale_inv` float32 (ceil(out / bm), ceil(in / bn)), the factor each block's codes are multiplied
by: `W[o, i] = fp8(weight[o, i]) · weight_scale_inv[o // bm, i // bn]`, one float32 product (exact up to the
product's single rounding, as Transformers computes it). A `scale_fmt` of `ue8m0` stores the factors as powers
of two; the decode is the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from evalsuite.files.checkpoint import Checkpoint
from evalsuite.formats import FP8_E4M3_VALUES, split_at_last_dot

METHOD = "fp8"
PARAMS = frozenset({"weight", "weight_scale_inv", "input_scale"})
MARKS = frozenset({"weight_scale_inv"})


class Fp8BlockFormat:
    """Block-wise FP8 as a `QuantizedFormat`, with the candidate's claims (`quantization_config`):
    `block` (`weight_block_size`, None when the config gives none), `activation_scheme`, `scale_fmt`."""

    name = METHOD
    params = PARAMS
    marks = MARKS
    split = staticmethod(split_at_last_dot)

    def __init__(self, candidate: Checkpoint) -> None:
        self.candidate = candidate
        self.config: dict[str, Any] = dict(candidate.quantization_config or {})
        block = self.config.get("weight_block_size")
        self.block: tuple[int, int] | None = (int(block[0]), int(block[1])) if block else None


def decode(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], row0: int = 0) -> np.ndarray:
    """Rows of a weight (FP8 bytes, rows from `row0`) as float32: each code's value times its block's factor
    (`scale_inv` the whole tensor's factors)."""
    rows, cols = weight.shape
    values = FP8_E4M3_VALUES[weight]
    block_rows = (np.arange(row0, row0 + rows) // block[0])[:, None]
    block_cols = (np.arange(cols) // block[1])[None, :]
    return values * scale_inv.astype(np.float32)[block_rows, block_cols]


def library_decode(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """The weight (whole tensor: FP8 bytes, float32 factors) as Transformers dequantizes it at load
    (`Fp8Dequantize`), float32."""
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    codes = torch.from_numpy(np.ascontiguousarray(weight)).view(torch.float8_e4m3fn)
    scales = torch.from_numpy(np.ascontiguousarray(scale_inv, dtype=np.float32))
    return Fp8Dequantize(None)._dequantize_one(codes, scales, torch.float32).numpy()
