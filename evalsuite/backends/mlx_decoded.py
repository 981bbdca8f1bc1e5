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
from evalsuite.formats.mlx import MlxFormat, decode, layout_problems

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
        if not self.problems:
            self.problems = [p for module in self.quantized for p in self._layout_problems(module)]

    def _layout_problems(self, module: str) -> list[str]:
        """What keeps a module's stored parts from decoding into its slot (`formats.mlx.layout_problems`,
        from headers); a module the model lacks, or the config leaves in float, is refused elsewhere."""
        slot, scheme = self.slots.get(f"{module}.weight"), self.format.scheme(module)
        if slot is None or slot[2].dim() != 2 or scheme is None:
            return []
        infos = [self.checkpoint.tensors[f"{module}.{part}"] for part in QUANTIZED_PARTS]
        found = layout_problems(tuple(slot[2].shape), *infos, *scheme)
        if infos[2].dtype != infos[1].dtype:  # decoded in the scales' dtype, as mx.dequantize requires
            found.append(f"biases are {infos[2].dtype}, the scales {infos[1].dtype}")
        return [f"{module}: {problem}" for problem in found]

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
        """A quantized module's weight decoded as MLX decodes it (values of the scales' dtype); its layout
        was checked from the headers (`_layout_problems`)."""
        scheme = self.format.scheme(module)
        assert scheme is not None, module  # `refuse_problems` refused a quantized module left in float
        group, bits = scheme
        packed, scales, biases = (self.checkpoint.read_tensor(f"{module}.{part}") for part in QUANTIZED_PARTS)
        dtype = self.checkpoint.tensors[f"{module}.scales"].dtype
        weight = decode(packed.numpy(), scales.float().numpy(), biases.float().numpy(), dtype, group, bits)
        return torch.from_numpy(weight).to(self.dtype)

    def _place(self, name: str, value: torch.Tensor) -> None:
        fill_slot(
            self.slots, name, value.to(self.dtype) if value.is_floating_point() else value, self.checkpoint
        )


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
