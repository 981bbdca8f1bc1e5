"""An MLX pack (mlx-lm's layout) as the decoded path reads it (`backends.decoded`).

MLX's users run the pack in mlx-lm, on MLX's own kernels, which evalsuite does not call; here every
quantized weight is decoded by `evalsuite.formats.mlx`, equal bit for bit to `mx.dequantize`: values of the
scales' dtype.
"""

from __future__ import annotations

import torch

from evalsuite.backends.skeleton import MarkedModules
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.formats.mlx import MlxFormat, decode, layout_problems

# The scales' stored dtype → the dtype MLX computes the decoded values in.
VALUE_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class MlxDecoding(MarkedModules):
    """mlx-lm's quantized modules as a `WeightDecoding`: `weight` (packed codes), `scales`, `biases`."""

    label = "MLX"
    parts = ("weight", "scales", "biases")
    marker = "scales"
    optional_parts = ()

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(checkpoint)
        self.format = MlxFormat(checkpoint)
        stored = {checkpoint.tensors[f"{m}.scales"].dtype for m in self._modules}
        # A pack whose scales mix dtypes has values exact only in float32.
        self.value_dtype = VALUE_DTYPES.get(stored.pop(), "float32") if len(stored) == 1 else "float32"

    def problems(self, module: str, shape: tuple[int, ...]) -> list[str]:
        """`formats.mlx.layout_problems`, and a config that leaves the module in float."""
        scheme = self.format.scheme(module)
        if scheme is None:
            return ["stored quantized, but config.json's `quantization` leaves it in float"]
        infos = [self.checkpoint.tensors[f"{module}.{part}"] for part in self.parts]
        return layout_problems(shape, *infos, *scheme)

    def decode(self, module: str) -> torch.Tensor:
        """The weight as MLX decodes it; its layout was checked from the headers (`problems`)."""
        scheme = self.format.scheme(module)
        assert scheme is not None, module  # `problems` refused a quantized module left in float
        group, bits = scheme
        packed, scales, biases = (self.checkpoint.read_tensor(f"{module}.{part}") for part in self.parts)
        dtype = self.checkpoint.tensors[f"{module}.scales"].dtype
        weight = decode(packed.numpy(), scales.float().numpy(), biases.float().numpy(), dtype, group, bits)
        return torch.from_numpy(weight)

    def execution(self) -> str:
        """Whose decode, what codes."""
        return (
            f"MLX decoded on the CPU by evalsuite as mx.dequantize decodes it ({len(self._modules)} modules, "
            f"{self.format.bits}-bit codes in groups of {self.format.group_size})"
        )
