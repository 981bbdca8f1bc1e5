"""A ModelOpt pack (FP8 or NVFP4) as the decoded path reads it (`backends.decoded`).

Its users run it in TensorRT-LLM, vLLM or SGLang on NVIDIA GPUs, with activations quantized by the stored
input scales; Transformers does not read it (it loads an FP8 pack's codes unscaled). Here every quantized
weight is decoded by `evalsuite.formats.modelopt` (ModelOpt's own dequantization, checked bit for bit in the
slow tier) into float32, and the activations stay in the run's dtype: the report says so.
"""

from __future__ import annotations

import numpy as np
import torch

from evalsuite.backends.skeleton import MarkedModules
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.formats.modelopt import ModeloptFormat, decode_fp8, decode_nvfp4, layout_problems


def _raw(tensor: torch.Tensor) -> np.ndarray:
    """A stored tensor as numpy: FP8 as its raw bytes, which `formats.modelopt` widens by a table."""
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8).numpy()
    return tensor.numpy()


class ModeloptDecoding(MarkedModules):
    """ModelOpt's quantized Linear layers as a `WeightDecoding`: `weight`, `weight_scale`, NVFP4's
    `weight_scale_2`, and the activations' `input_scale` (read by no decode)."""

    parts = ("weight", "weight_scale")
    marker = "weight_scale"
    optional_parts = ("weight_scale_2", "input_scale")
    value_dtype = "float32"

    def __init__(self, checkpoint: Checkpoint) -> None:
        super().__init__(checkpoint)
        self.format = ModeloptFormat(checkpoint)
        self.label = f"ModelOpt {self.format.algo}"

    def problems(self, module: str, shape: tuple[int, ...]) -> list[str]:
        """`formats.modelopt.layout_problems` of the module's stored tensors against the slot's shape."""
        return layout_problems(self.format, shape, self.stored(module))

    def decode(self, module: str) -> torch.Tensor:
        """The weight (out, in) as ModelOpt dequantizes it; its layout was checked from the headers."""
        read = self.checkpoint.read_tensor
        weight, scale = _raw(read(f"{module}.weight")), _raw(read(f"{module}.weight_scale"))
        if self.format.algo == "FP8":
            decoded = decode_fp8(weight, float(scale.reshape(-1)[0]))
        else:
            scale_2 = float(read(f"{module}.weight_scale_2").reshape(-1)[0])
            decoded = decode_nvfp4(weight, scale, scale_2)
        return torch.from_numpy(np.ascontiguousarray(decoded))

    def execution(self) -> str:
        """Whose decode, what codes, and what is not run."""
        codes = (
            "FP8 E4M3 codes, one scale per tensor"
            if self.format.algo == "FP8"
            else "E2M1 codes in blocks of 16, FP8 block scales times one scale per tensor"
        )
        return (
            f"{self.label} decoded on the CPU by evalsuite as ModelOpt's dequantization computes it "
            f"({len(self._modules)} modules, {codes}; the activations unquantized, their stored input "
            "scales not applied)"
        )
