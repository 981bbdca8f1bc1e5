"""MXFP4 as gpt-oss ships it (`quant_method: mxfp4`): what its routed experts store and how they decode, with
Transformers' own dequantization (`convert_moe_packed_tensors`, what it runs at load on a machine without
MXFP4 kernels) as the library decode they are checked against.

OpenAI's writer is not published and Transformers' quantizer needs Triton kernels on a GPU, so the layout's
specification is what Transformers reads (`transformers.integrations.mxfp4`) and the OCP Microscaling spec:
a fused experts parameter `X.gate_up_proj` (E, in, out) in the model is stored as `X.gate_up_proj_blocks`
uint8 (E, out, in / 32, 16), 32 FP4 E2M1 codes per block, two to a byte with the first weight in the low
nibble, and `X.gate_up_proj_scales` uint8 (E, out, in / 32), one E8M0 exponent per block (the block's
factor 2^(e − 127)); `X.down_proj` likewise. Everything else (attention, router, embeddings, head, the
experts' biases) is stored as in the source (`modules_to_not_convert`).
"""

from __future__ import annotations

import numpy as np

from evalsuite.files.checkpoint import Checkpoint

METHOD = "mxfp4"
PARAMS = frozenset({"blocks", "scales"})
MARKS = frozenset({"scales"})
BLOCK = 32
# The FP4 E2M1 values by code (sign in the high bit of the nibble), as the OCP MX spec defines them.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)


def split_name(name: str) -> tuple[str, str] | None:
    """(the model parameter, `blocks` or `scales`) of a stored MXFP4 tensor name, else None."""
    for part in PARAMS:
        if name.endswith(f"_{part}"):
            return name.removesuffix(f"_{part}"), part
    return None


class Mxfp4Format:
    """gpt-oss's MXFP4 as a `QuantizedFormat` whose stored tensors pair with the model parameter their name
    extends (`split`), with the candidate's claims (`modules_to_not_convert`)."""

    name = METHOD
    params = PARAMS
    marks = MARKS

    def __init__(self, candidate: Checkpoint) -> None:
        self.candidate = candidate
        self.config = dict(candidate.quantization_config or {})

    @staticmethod
    def split(name: str) -> tuple[str, str] | None:
        return split_name(name)


def decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Rows of codes (uint8 (rows, groups, 16)) and their exponents (uint8 (rows, groups)) as float32
    (rows, groups · 32): each code's E2M1 value times its block's 2^(e − 127)."""
    rows, groups, _ = blocks.shape
    values = np.empty((rows, groups, 2 * 16), dtype=np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(rows, groups * 2 * 16)


def library_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The same rows as Transformers dequantizes them at load (`convert_moe_packed_tensors`, in float32),
    in `decode`'s orientation (rows, groups · 32)."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out = convert_moe_packed_tensors(
        torch.from_numpy(np.ascontiguousarray(blocks))[None],
        torch.from_numpy(np.ascontiguousarray(scales))[None],
        dtype=torch.float32,
    )
    return out[0].transpose(0, 1).numpy()  # Transformers returns (in, out), the parameter's orientation


def encode(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of float32 weights (rows, cols; cols a multiple of 32) as MXFP4 codes and exponents, by the OCP
    MX spec's rule: each block's exponent is floor(log2(its largest magnitude)) − 2 (E2M1's largest value is
    1.5 · 2^2), the values divided by it and rounded to the nearest E2M1 value (ties to the even code),
    clamped at ±6. The fixtures' writer (no writer of the format runs on a CPU)."""
    rows, cols = weight.shape
    x = weight.reshape(rows, cols // BLOCK, BLOCK).astype(np.float32)
    amax = np.abs(x).max(axis=-1)
    with np.errstate(divide="ignore"):
        exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127)
    exponent = np.clip(exponent, -127, 127).astype(np.int32)
    scaled = np.ldexp(x, -exponent[..., None])
    magnitudes = FP4_VALUES[:8]
    # Nearest E2M1 magnitude; on a tie the even code (lower index, as codes alternate even and odd).
    distance = np.abs(np.abs(scaled)[..., None] - magnitudes)
    code = np.argmin(distance + (np.arange(8) % 2) * 1e-7, axis=-1).astype(np.uint8)
    code |= (np.signbit(scaled) & (code > 0)).astype(np.uint8) << 3
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exponent + 127).astype(np.uint8)
