"""An MLX pack (mlx-lm's layout) run from its decoded weights by Transformers: the `hf` backend's path for
format `mlx`.

MLX's users run the pack in mlx-lm, which installs MLX's Metal build and pins its own Transformers; on a
Linux CPU the model is run the way a format with no CPU runtime here is: every quantized weight decoded by
`evalsuite.formats.mlx` (equal bit for bit to `mx.dequantize`, values of the scales' dtype, so exact in the
run's bf16 or float32), every other tensor as stored, into the Transformers model of the source
architecture built from the pack's config.json on the meta device. `describe()` says so, so every report
names the execution. What the files must hold is decided before anything loads (`check_mlx_load_plan`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from evalsuite.backends.hf import DTYPES, HFBackend, meta_model, package_version, transformers_config
from evalsuite.backends.options import BackendOptions
from evalsuite.backends.skeleton import (
    fill_slot,
    named_tensors,
    refuse_mismatch,
    set_generation_config,
    tensor_slots,
    tie_weights,
)
from evalsuite.checkpoint import Checkpoint
from evalsuite.errors import InputError
from evalsuite.formats import as_float32
from evalsuite.formats.mlx import MlxFormat, decode

QUANTIZED_PARTS = ("weight", "scales", "biases")


class MlxSkeleton:
    """The pack's model on the meta device, and what fills each of its tensors: a quantized module's
    decoded weight, or a stored tensor as it is."""

    def __init__(self, checkpoint: Checkpoint, options: BackendOptions) -> None:
        self.checkpoint = checkpoint
        self.format = MlxFormat(checkpoint)
        self.dtype = DTYPES[options.dtype]
        self.config, _ = transformers_config(checkpoint, options)
        self.model = meta_model(self.config, self.dtype, checkpoint)
        self.slots = tensor_slots(self.model)
        names = set(checkpoint.tensors)
        self.quantized = sorted(
            name.removesuffix(".scales") for name in names if name.endswith(".scales")
        )  # modules stored as codes
        stored_parts = {f"{m}.{part}" for m in self.quantized for part in QUANTIZED_PARTS}
        self.dense = sorted(names - stored_parts)
        self.problems = [
            f"{module}: {part} missing beside its scales"
            for module in self.quantized
            for part in QUANTIZED_PARTS
            if f"{module}.{part}" not in names
        ]

    def refuse_problems(self) -> None:
        """InputError naming what makes the files unloadable; nothing when they load faithfully."""
        if self.problems:
            raise InputError(f"MLX module {self.problems[0]}", self.checkpoint.path)
        filled = {f"{m}.weight" for m in self.quantized} | set(self.dense)
        tied = getattr(self.model, "all_tied_weights_keys", None) or {}
        missing = sorted(n for n in self.slots if n not in filled and not (n in tied and tied[n] in filled))
        unexpected = sorted(n for n in filled if n not in self.slots)
        refuse_mismatch(self.checkpoint, missing, unexpected)
        for module in self.quantized:
            if self.format.scheme(module) is None:
                raise InputError(
                    f"{module} is stored quantized, but config.json's `quantization` leaves it in float",
                    self.checkpoint.path,
                )

    def load(self, device: str) -> nn.Module:
        """Every decoded weight and every stored tensor into the model, the generation config, the device."""
        self.refuse_problems()
        for module in self.quantized:
            self._place(f"{module}.weight", self._decoded(module))
        for name, tensor in self.checkpoint.iter_tensors(self.dense):
            self._place(name, tensor)
        tie_weights(self.model)
        leftover = sorted(n for n, t in named_tensors(self.model) if t.is_meta)
        refuse_mismatch(self.checkpoint, leftover, [])
        set_generation_config(self.model, self.checkpoint)
        return self.model.to(device) if device != "cpu" else self.model

    def _decoded(self, module: str) -> torch.Tensor:
        """A quantized module's weight decoded as MLX decodes it (values of the scales' dtype)."""
        group, bits = self.format.scheme(module) or (self.format.group_size, self.format.bits)
        infos = {part: self.checkpoint.tensors[f"{module}.{part}"] for part in QUANTIZED_PARTS}
        scales_dtype = infos["scales"].dtype
        if scales_dtype not in ("F32", "F16", "BF16") or infos["biases"].dtype != scales_dtype:
            raise InputError(
                f"{module}: scales {scales_dtype} and biases {infos['biases'].dtype} are not one float dtype",
                self.checkpoint.path,
            )
        packed = self.checkpoint.read_tensor(infos["weight"].name)
        if packed.dtype != torch.uint32 or packed.dim() != 2:
            raise InputError(f"{module}.weight is {packed.dtype}, not uint32 codes", self.checkpoint.path)
        scales, biases = (
            as_float32(_raw(self.checkpoint.read_tensor(infos[part].name)), scales_dtype)
            for part in ("scales", "biases")
        )
        if packed.shape[1] * 32 != scales.shape[1] * group * bits or scales.shape != biases.shape:
            raise InputError(
                f"{module}: {packed.shape[1]} words per row do not hold {scales.shape[1]} groups of {group} "
                f"{bits}-bit codes",
                self.checkpoint.path,
            )
        weight = decode(packed.numpy(), scales, biases, scales_dtype, group, bits)
        return torch.from_numpy(weight).to(self.dtype)

    def _place(self, name: str, value: torch.Tensor) -> None:
        fill_slot(
            self.slots, name, value.to(self.dtype) if value.is_floating_point() else value, self.checkpoint
        )


def _raw(tensor: torch.Tensor) -> np.ndarray:
    """A stored float tensor as `as_float32` takes it (bf16 as its 16 bits)."""
    return (tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def check_mlx_load_plan(checkpoint: Checkpoint, options: BackendOptions) -> None:
    """Refuse, from the configs and headers alone, an MLX pack whose tensors do not fill its model."""
    if options.stream:
        raise InputError("an MLX pack is not run streamed (--stream): it loads whole", checkpoint.path)
    MlxSkeleton(checkpoint, options).refuse_problems()


class DecodedMlxBackend(HFBackend):
    """The pack's Transformers model, every MLX-quantized weight decoded; every `HFBackend` primitive runs
    on it."""

    def load_model(self, kwargs: dict[str, Any]) -> Any:
        """Build on the meta device, then decode and load every tensor from the files."""
        skeleton = MlxSkeleton(self.checkpoint, self.options)
        self.decoded_modules = len(skeleton.quantized)
        self.scheme = (skeleton.format.group_size, skeleton.format.bits)
        return skeleton.load(self.options.device)

    def describe(self) -> dict[str, Any]:
        """The decoded path: what was decoded, and the Transformers model that runs it."""
        group, bits = self.scheme
        return {
            "backend": "hf",
            "path": "decoded",
            "execution": (
                f"MLX decoded on the CPU by evalsuite as mx.dequantize decodes it ({self.decoded_modules} "
                f"modules, {bits}-bit codes in groups of {group}) into Transformers "
                f"{package_version('transformers')} ({type(self.model).__name__}) in {self.options.dtype}; "
                "MLX not run"
            ),
            "format": self.checkpoint.format,
        }
