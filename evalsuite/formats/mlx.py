"""MLX checkpoints on disk (mlx-lm's layout, what `mlx_lm.convert -q` writes): what a quantized Linear or
Embedding stores and how it decodes, with MLX's own `mx.dequantize` as the library decode it is checked
against where `mlx` is installed (`pip install 'mlx[cpu]'` on Linux).

config.json says `quantization: {group_size, bits}` (mlx-lm writes the same under `quantization_config`,
with no `quant_method`); an entry named by a module path overrides it for that module (`{group_size, bits}`)
or leaves the module in float (`false`). A module `X` of `out` × `in` weights stores `X.weight` uint32
(out, in · bits / 32): each row a little-endian bit stream of `bits`-bit codes, the first weight in the
lowest bits; `X.scales` and `X.biases` (out, in / group_size) in the model's float dtype. A weight decodes
as `scales · q + biases`, computed as MLX computes it: in the scales' dtype, the product rounded, then the
sum (two roundings; in bf16 for a bf16 pack).
"""

from __future__ import annotations

import threading

import numpy as np

from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint, TensorInfo, mlx_quantization
from evalsuite.formats import split_at_last_dot

METHOD = "mlx"
PARAMS = frozenset({"weight", "scales", "biases"})
MARKS = frozenset({"scales"})
BITS = (2, 3, 4, 5, 6, 8)


class MlxFormat:
    """mlx-lm's layout as a `QuantizedFormat`, with the candidate's claims: the default `group_size` and
    `bits`, and the modules whose own entry overrides them."""

    name = METHOD
    params = PARAMS
    marks = MARKS
    split = staticmethod(split_at_last_dot)

    def __init__(self, candidate: Checkpoint) -> None:
        self.candidate = candidate
        claimed = mlx_quantization(candidate.config)
        if claimed is None:
            raise InputError("config.json has no mlx-lm `quantization` {group_size, bits}", candidate.path)
        self.config = dict(claimed)
        self.group_size, self.bits = int(claimed["group_size"]), int(claimed["bits"])
        self.overrides = {k: v for k, v in claimed.items() if k not in ("group_size", "bits", "mode")}

    def scheme(self, module: str) -> tuple[int, int] | None:
        """(group_size, bits) the config gives `module`; None where it leaves the module in float."""
        own = self.overrides.get(module)
        if own is False:
            return None
        if isinstance(own, dict):
            return int(own.get("group_size", self.group_size)), int(own.get("bits", self.bits))
        return self.group_size, self.bits


def decoded_numel(checkpoint: Checkpoint) -> int:
    """How many values the pack holds once decoded: each quantized module's `out × in` weights (its scales
    and biases fold into them), every other tensor as stored: what the memory plan multiplies by the run's
    dtype."""
    fmt = MlxFormat(checkpoint)
    quantized = {name.removesuffix(".scales") for name in checkpoint.tensors if name.endswith(".scales")}
    total = 0
    for name, info in checkpoint.tensors.items():
        module, _, part = name.rpartition(".")
        if module not in quantized:
            total += info.numel
        elif part == "weight":
            bits = (fmt.scheme(module) or (fmt.group_size, fmt.bits))[1]
            total += info.numel * 32 // bits
    return total


def unpack(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """The codes of rows of packed words (uint32, rows × words), float32 (rows, cols)."""
    stream = np.unpackbits(
        np.ascontiguousarray(packed, dtype="<u4").view(np.uint8).reshape(len(packed), -1),
        axis=1,
        bitorder="little",
    )
    fields = stream[:, : cols * bits].reshape(len(packed), cols, bits)
    return (fields * (1 << np.arange(bits, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32).astype(np.float32)


def decode(
    packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, dtype: str, group: int, bits: int
) -> np.ndarray:
    """Rows of a weight as float32: `scales · q + biases` in the scales' stored dtype `dtype` (F32, F16 or
    BF16; `scales` and `biases` given as float32 holding its values), as MLX computes it."""
    import torch

    torch_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype]
    cols = scales.shape[1] * group
    codes = torch.from_numpy(unpack(packed, bits, cols)).to(torch_dtype)
    s = torch.from_numpy(np.ascontiguousarray(scales)).to(torch_dtype).repeat_interleave(group, dim=1)
    b = torch.from_numpy(np.ascontiguousarray(biases)).to(torch_dtype).repeat_interleave(group, dim=1)
    return (s * codes + b).float().numpy()


def library_decode(
    packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, dtype: str, group: int, bits: int
) -> np.ndarray | None:
    """The same rows as MLX's `mx.dequantize` decodes them, float32; None where `mlx` is not installed."""
    try:
        import mlx.core as mx
    except ImportError:
        return None
    mlx_dtype = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}[dtype]
    # One MLX evaluation at a time: the verifier's threads share MLX's one default stream.
    with _MLX_CALLS:
        out = mx.dequantize(
            mx.array(np.ascontiguousarray(packed, dtype=np.uint32)),
            mx.array(np.ascontiguousarray(scales)).astype(mlx_dtype),
            mx.array(np.ascontiguousarray(biases)).astype(mlx_dtype),
            group_size=group,
            bits=bits,
        )
        return np.array(out.astype(mx.float32))


_MLX_CALLS = threading.Lock()


# Bytes of a scale or bias by stored dtype: the float dtypes MLX stores them in.
SCALE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def layout_problems(
    shape: tuple[int, ...],
    weight: TensorInfo | None,
    scales: TensorInfo | None,
    biases: TensorInfo | None,
    group: int,
    bits: int,
) -> list[str]:
    """What keeps a module's stored `weight`, `scales` and `biases` from being an MLX-quantized weight of
    `shape` (out, in) in groups of `group` `bits`-bit codes; empty when they are one. Read from headers."""
    if weight is None or scales is None or biases is None:
        return ["scales without a packed weight and biases beside them"]
    out_features, in_features = shape
    if bits not in BITS or in_features % group:
        return [f"{bits}-bit codes in groups of {group} cannot hold rows of {in_features} weights"]
    found = []
    words = in_features * bits // 32
    if weight.dtype != "U32" or tuple(weight.shape) != (out_features, words):
        found.append(f"weight is {weight.dtype} {list(weight.shape)}, not U32 {[out_features, words]}")
    grid = (out_features, in_features // group)
    for name, info in (("scales", scales), ("biases", biases)):
        if info.dtype not in SCALE_BYTES or tuple(info.shape) != grid:
            found.append(f"{name} is {info.dtype} {list(info.shape)}, not a float {list(grid)}")
    if not found and biases.dtype != scales.dtype:  # mx.dequantize computes in one dtype, the scales'
        found.append(f"biases are {biases.dtype}, the scales {scales.dtype}")
    return found
