"""A GPTQ or AWQ pack as the decoded path reads it (`backends.decoded`).

Its users run it through GPTQModel's or AutoAWQ's kernels (CUDA extensions, not installed here); here every
`qweight` is decoded by `evalsuite.formats.gptq`, the writers' packing code read as the specification and
checked bit for bit against the writer's own dequantization in the slow tier: float16 values, as the
writers' float16 arithmetic computes them, `g_idx` followed where the pack stores one.
"""

from __future__ import annotations

import numpy as np
import torch

from evalsuite.backends.skeleton import MarkedModules
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.formats.gptq import GptqFormat, decode, layout_problems


class GptqDecoding(MarkedModules):
    """GPTQ's or AWQ's quantized Linear layers as a `WeightDecoding`: `qweight`, `qzeros`, `scales`, and
    GPTQ's `g_idx`."""

    parts = ("qweight", "qzeros", "scales")
    marker = "qweight"
    optional_parts = ("g_idx",)
    value_dtype = "float16"

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(checkpoint)
        self.format = GptqFormat(checkpoint)
        self.label = self.format.method.upper()

    def problems(self, module: str, shape: tuple[int, ...]) -> list[str]:
        """`formats.gptq.layout_problems` of the module's stored tensors against the slot's shape."""
        return layout_problems(self.format, shape, self.stored(module))

    def decode(self, module: str) -> torch.Tensor:
        """The weight (out, in) as the writers dequantize it; its layout was checked from the headers."""
        read = self.checkpoint.read_tensor
        g_idx = f"{module}.g_idx"
        weight = decode(
            self.format,
            *(read(f"{module}.{part}").numpy() for part in self.parts),
            read(g_idx).numpy().astype(np.int64) if g_idx in self.checkpoint.tensors else None,
        )
        return torch.from_numpy(np.ascontiguousarray(weight))

    def execution(self) -> str:
        """Whose decode, what codes."""
        fmt = self.format
        groups = f"groups of {fmt.group_size}" if fmt.group_size > 0 else "one group per row"
        order = ", g_idx followed" if fmt.desc_act else ""
        return (
            f"{self.label} decoded on the CPU by evalsuite from the writers' packing code "
            f"({len(self._modules)} modules, INT{fmt.bits} in {groups}{order})"
        )
