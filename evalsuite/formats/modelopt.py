"""NVIDIA ModelOpt checkpoints on disk (`quant_method: modelopt`, what ModelOpt's `export_hf_checkpoint`
writes for TensorRT-LLM, vLLM and SGLang): what a quantized Linear stores and how it decodes. ModelOpt's
source is the specification (`modelopt/torch/quantization/qtensor/`: `FP8QTensor`, `NVFP4QTensor`); it
installs only beside its own pins, so the decode below is checked against ModelOpt's own dequantization
written beside the packs of the slow tier's fixtures.

config.json's `quantization_config` says `quant_algo` (`FP8` or `NVFP4`) and which modules stay in float
(`ignore`; `hf_quant_config.json`, written beside it, says the same under `quantization`). A module `X` of
`out` × `in` weights stores:

- FP8: `X.weight` FP8 E4M3 (out, in) and `X.weight_scale` float32, one per tensor:
  `W = fp8(weight) · weight_scale`, one float32 product.
- NVFP4: `X.weight` uint8 (out, in / 2), two E2M1 codes a byte, the even column in the low nibble;
  `X.weight_scale` FP8 E4M3 (out, in / 16), one per block of 16 inputs; `X.weight_scale_2` float32, one per
  tensor: `W[o, i] = e2m1(code) · (fp8(weight_scale[o, i // 16]) · weight_scale_2)`, the scales' product
  rounded to float32 first, as ModelOpt computes it.

Both store `X.input_scale` (float32, one per tensor) for the runtime's static activation quantization, which
a decode of the weights does not use.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint, TensorInfo
from evalsuite.files.safetensors_headers import read_json
from evalsuite.formats import FP8_E4M3_VALUES, split_at_last_dot

METHOD = "modelopt"
PARAMS = frozenset({"weight", "weight_scale", "weight_scale_2", "input_scale"})
MARKS = frozenset({"weight_scale"})
ALGOS = ("FP8", "NVFP4")
HF_QUANT_CONFIG = "hf_quant_config.json"
NVFP4_BLOCK = 16
# The FP4 E2M1 values by code (sign in the high bit of the nibble), as NVFP4 defines them.
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
SCALAR_SHAPES = ((), (1,))


class ModeloptFormat:
    """ModelOpt's layout as a `QuantizedFormat`, with the candidate's claims: `algo` (`FP8` or `NVFP4`), the
    modules it leaves in float (`ignore`), and what hf_quant_config.json says beside config.json."""

    name = METHOD
    params = PARAMS
    marks = MARKS
    split = staticmethod(split_at_last_dot)

    def __init__(self, candidate: Checkpoint) -> None:
        self.candidate = candidate
        self.config: dict[str, Any] = dict(candidate.quantization_config or {})
        self.beside = _hf_quant_config(candidate)
        claimed = self.config.get("quant_algo", self.beside.get("quant_algo"))
        if claimed not in ALGOS:
            raise InputError(
                f"ModelOpt quant_algo {claimed!r} is not read here (known: {', '.join(ALGOS)})",
                candidate.path / "config.json",
            )
        self.algo: str = claimed
        self.bits = 8 if self.algo == "FP8" else 4
        ignore = self.config.get("ignore", self.beside.get("exclude_modules")) or []
        self.ignore = [str(m) for m in ignore]


def _hf_quant_config(candidate: Checkpoint) -> dict[str, Any]:
    """hf_quant_config.json's `quantization`, or {} where there is none."""
    path = candidate.path / HF_QUANT_CONFIG
    content = read_json(path) if path.is_file() else None
    found = content.get("quantization") if isinstance(content, dict) else None
    return found if isinstance(found, dict) else {}


def layout_problems(fmt: ModeloptFormat, shape: tuple[int, ...], tensors: dict[str, TensorInfo]) -> list[str]:
    """What keeps a module's stored tensors (by part) from being a `fmt.algo` Linear of `shape` (out, in);
    empty when they are one. Read from headers."""
    out_features, in_features = shape
    weight, scale = tensors.get("weight"), tensors.get("weight_scale")
    if weight is None or scale is None:
        return ["a weight_scale but no weight"]
    found = []
    if fmt.algo == "FP8":
        expected = {"weight": ("F8_E4M3", (out_features, in_features)), "weight_scale": ("F32", None)}
    else:
        if in_features % NVFP4_BLOCK:
            return [f"rows of {in_features} inputs do not split into NVFP4 blocks of {NVFP4_BLOCK}"]
        expected = {
            "weight": ("U8", (out_features, in_features // 2)),
            "weight_scale": ("F8_E4M3", (out_features, in_features // NVFP4_BLOCK)),
            "weight_scale_2": ("F32", None),
        }
    if "input_scale" in tensors:
        expected["input_scale"] = ("F32", None)
    for part, (dtype, want) in expected.items():
        info = tensors.get(part)
        shape_ok = info is not None and (
            tuple(info.shape) in SCALAR_SHAPES if want is None else tuple(info.shape) == want
        )
        if info is None or info.dtype != dtype or not shape_ok:
            got = "none" if info is None else f"{info.dtype} {list(info.shape)}"
            wanted = f"a {dtype} scalar" if want is None else f"{dtype} {list(want)}"
            found.append(f"{part} is {got}, not {wanted} ({fmt.algo})")
    return found


def decode_fp8(weight: np.ndarray, scale: float) -> np.ndarray:
    """FP8 bytes (rows, in) as float32: each code's value times the tensor's scale."""
    return FP8_E4M3_VALUES[weight] * np.float32(scale)


def decode_nvfp4(packed: np.ndarray, block_scales: np.ndarray, scale_2: float) -> np.ndarray:
    """NVFP4 rows (uint8 (rows, in / 2); the blocks' FP8 scale bytes (rows, in / 16)) as float32, each
    block's factor `fp8(scale) · scale_2` rounded to float32 before it multiplies the codes' values."""
    rows = packed.shape[0]
    values = np.empty((rows, packed.shape[1] * 2), dtype=np.float32)
    values[:, 0::2] = E2M1_VALUES[packed & 0x0F]
    values[:, 1::2] = E2M1_VALUES[packed >> 4]
    factors = FP8_E4M3_VALUES[block_scales] * np.float32(scale_2)
    blocks = values.reshape(rows, -1, NVFP4_BLOCK) * factors[:, :, None]
    return blocks.reshape(rows, -1)


def decoded_numel(checkpoint: Checkpoint) -> int:
    """How many values the pack holds once decoded: each quantized module's `out × in` weights (its scales
    fold into them; NVFP4 packs two to a byte), every other tensor as stored: what the memory plan multiplies
    by the run's dtype."""
    fmt = ModeloptFormat(checkpoint)
    total = 0
    for name, info in checkpoint.tensors.items():
        module, _, part = name.rpartition(".")
        if part not in PARAMS or f"{module}.weight_scale" not in checkpoint.tensors:
            total += info.numel
        elif part == "weight":
            total += info.numel * (2 if fmt.algo == "NVFP4" else 1)
    return total
