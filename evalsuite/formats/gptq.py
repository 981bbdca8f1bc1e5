"""GPTQ and AWQ checkpoints on disk (`quant_method: gptq | awq`): what a quantized Linear stores and how it
decodes, from the writers' own packing code (AutoGPTQ / GPTQModel's `QuantLinear`, AutoAWQ's GEMM layout, as
auto-round's exporters write them), which is the specification: no decoder of these formats imports here
(GPTQModel and AutoAWQ build CUDA extensions), so the decode below is checked against the writer's own
dequantization written beside the packs of the slow tier's fixtures.

A module `X` of `in` inputs and `out` outputs, `b` bits, groups of `group_size` inputs, `G` groups:

- GPTQ: `X.qweight` int32 (in·b/32, out), codes packed down the input dimension, least significant bits
  first; `X.qzeros` int32 (G, out·b/32), zero points packed along the outputs the same way, stored minus one
  (`checkpoint_format` "gptq", the v1 layout every runtime reads; "gptq_v2" stores them as they are);
  `X.scales` float16 (G, out); `X.g_idx` int32 (in,), the group of every input column (`desc_act` packs
  scatter a group's columns). `W[o, i] = scales[g, o] · (q[i, o] − z[g, o])`, `g = g_idx[i]`.
- AWQ (GEMM, the layout AutoAWQ and Transformers read): `X.qweight` int32 (in, out·b/32) packed along the
  outputs in the interleaved order 0, 2, 4, 6, 1, 3, 5, 7 of each word's nibbles; `X.qzeros` int32
  (G, out·b/32) the same way, as they are; `X.scales` float16 (G, out); no g_idx (groups are consecutive).

The decoded value is the product of an integer of at most b + 1 bits and a float16 scale, exact in float32,
then rounded once to float16: what the writers' float16 arithmetic computes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from evalsuite.files.checkpoint import Checkpoint, TensorInfo
from evalsuite.formats import split_at_last_dot

METHODS = ("gptq", "awq")
PARAMS = frozenset({"qweight", "qzeros", "scales", "g_idx"})
MARKS = frozenset({"qweight"})
# AWQ's GEMM packing: nibble k of a word holds the word's column (0, 2, 4, 6, 1, 3, 5, 7)[k], so column j is
# in nibble AWQ_ORDER[j] (AutoAWQ's `AWQ_REVERSE_ORDER`).
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


class GptqFormat:
    """GPTQ or AWQ as a `QuantizedFormat`, with the candidate's claims (config.json's `quantization_config`):
    `method`, `bits`, `group_size` (-1: one group), `sym`, `desc_act`, and GPTQ's zero-point layout."""

    params = PARAMS
    marks = MARKS
    split = staticmethod(split_at_last_dot)

    def __init__(self, candidate: Checkpoint) -> None:
        self.candidate = candidate
        self.config: dict[str, Any] = dict(candidate.quantization_config or {})
        self.method = str(self.config.get("quant_method"))
        self.name = self.method
        self.bits = int(self.config.get("bits", self.config.get("w_bit", 4)))
        self.group_size = int(self.config.get("group_size", self.config.get("q_group_size", 128)))
        self.symmetric = bool(self.config.get("sym", self.method == "gptq"))
        self.desc_act = bool(self.config.get("desc_act", False))
        # v1 stores zero points minus one (an AutoGPTQ quirk every later writer kept for compatibility).
        self.zero_offset = (
            1 if self.method == "gptq" and self.config.get("checkpoint_format") != "gptq_v2" else 0
        )


def stored_shape(method: str, bits: int, tensors: dict[str, TensorInfo]) -> tuple[int, int] | None:
    """(out, in) of the Linear a module's qweight holds, or None when its shape cannot hold one."""
    qweight = tensors.get("qweight")
    if qweight is None or qweight.dtype != "I32" or len(qweight.shape) != 2 or 32 % bits:
        return None
    rows, cols = qweight.shape
    per_word = 32 // bits
    return (cols, rows * per_word) if method == "gptq" else (cols * per_word, rows)


def unpack_words(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words → their codes (int16), least significant bits first, spread along `axis`."""
    per_word = 32 // bits
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    codes = (words.astype(np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)  # (..., per_word)
    codes = codes.astype(np.int16)
    if axis == 0:  # (rows, cols, k) → (rows·k, cols): code k of word r is row r·per_word + k
        return codes.transpose(0, 2, 1).reshape(words.shape[0] * per_word, words.shape[1])
    return codes.reshape(words.shape[0], words.shape[1] * per_word)


def _awq_columns(values: np.ndarray, bits: int) -> np.ndarray:
    """AWQ's interleaved codes (…, out) put back in column order."""
    per_word = 32 // bits
    order = np.array(AWQ_ORDER) if bits == 4 else np.arange(per_word)
    words = values.reshape(*values.shape[:-1], -1, per_word)
    return words[..., order].reshape(values.shape)


def codes(fmt: GptqFormat, qweight: np.ndarray) -> np.ndarray:
    """A module's unsigned codes (in, out), int16, in column order."""
    if fmt.method == "gptq":
        return unpack_words(qweight, fmt.bits, axis=0)
    return _awq_columns(unpack_words(qweight, fmt.bits, axis=1), fmt.bits)


def zero_points(fmt: GptqFormat, qzeros: np.ndarray, out_features: int) -> np.ndarray:
    """A module's zero points (groups, out), int16, as the decode subtracts them (GPTQ v1's stored minus
    one undone); the packing's padding columns dropped."""
    if fmt.method == "gptq":
        return unpack_words(qzeros, fmt.bits, axis=1)[:, :out_features] + fmt.zero_offset
    return _awq_columns(unpack_words(qzeros, fmt.bits, axis=1), fmt.bits)[:, :out_features]


def decode(
    fmt: GptqFormat, qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None
) -> np.ndarray:
    """The weight (out, in) a module stores, as float32 holding float16 values (see the module docstring)."""
    q = codes(fmt, qweight)  # (in, out)
    zeros = zero_points(fmt, qzeros, scales.shape[1])  # (G, out)
    cols = q.shape[0]
    # AWQ's groups are consecutive; GPTQ's are its g_idx where it stores one.
    use_g_idx = fmt.method == "gptq" and g_idx is not None
    groups = g_idx.astype(np.int64) if use_g_idx else np.arange(cols) // _group(fmt, cols)
    scales32 = scales.astype(np.float32)
    exact = (q.astype(np.float32) - zeros[groups].astype(np.float32)) * scales32[groups]
    return exact.astype(np.float16).astype(np.float32).T


def _group(fmt: GptqFormat, cols: int) -> int:
    return cols if fmt.group_size <= 0 else fmt.group_size


def layout_problems(fmt: GptqFormat, shape: tuple[int, ...], tensors: dict[str, TensorInfo]) -> list[str]:
    """What keeps a module's stored tensors (by part: `qweight`, `qzeros`, `scales`, `g_idx`) from being a
    `fmt` Linear of `shape` (out, in); empty when they are one. Read from headers."""
    missing = sorted({"qweight", "qzeros", "scales"} - tensors.keys())
    if missing:
        return [f"no {', '.join(missing)} beside its qweight"]
    out_features, in_features = shape
    if stored_shape(fmt.method, fmt.bits, tensors) != (out_features, in_features):
        return [
            f"qweight {tensors['qweight'].dtype} {list(tensors['qweight'].shape)} does not hold "
            f"INT{fmt.bits} weights of the source's shape {[out_features, in_features]}"
        ]
    group = fmt.group_size if fmt.group_size > 0 else in_features
    groups = -(-in_features // group)
    expected = {
        "scales": ("F16", (groups, out_features)),
        "qzeros": ("I32", (groups, -(-out_features * fmt.bits // 32))),
    }
    if "g_idx" in tensors or (fmt.method == "gptq" and fmt.desc_act):
        expected["g_idx"] = ("I32", (in_features,))
    found = []
    for param, (dtype, want) in expected.items():
        info = tensors.get(param)
        if info is None or info.dtype != dtype or tuple(info.shape) != want:
            got = "none" if info is None else f"{info.dtype} {list(info.shape)}"
            found.append(f"{param} is {got}, not {dtype} {list(want)} (group size {fmt.group_size})")
    return found


def decoded_numel(checkpoint: Checkpoint) -> int:
    """How many values the pack holds once decoded: each quantized module's `out × in` weights (qzeros,
    scales and g_idx fold into them), every other tensor as stored: what the memory plan multiplies by the
    run's dtype."""
    fmt = GptqFormat(checkpoint)
    total = 0
    for name, info in checkpoint.tensors.items():
        module, _, part = name.rpartition(".")
        if part not in PARAMS or f"{module}.qweight" not in checkpoint.tensors:
            total += info.numel
        elif part == "qweight":
            shape = stored_shape(fmt.method, fmt.bits, {"qweight": info})
            total += shape[0] * shape[1] if shape else info.numel
    return total
