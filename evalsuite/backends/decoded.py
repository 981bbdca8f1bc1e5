"""A pack whose runtime does not run on this machine, run from its decoded weights by Transformers: the `hf`
backend's path for the formats in `DECODED_FORMATS` (MLX, GPTQ, AWQ, ModelOpt).

Their users run these packs in runtimes evalsuite cannot call on a Linux CPU (mlx-lm on Apple machines;
GPTQModel's and AutoAWQ's CUDA kernels; TensorRT-LLM or vLLM for ModelOpt's). What runs instead, named in
every report: every quantized weight decoded by evalsuite's decode of the format (the one `tensors` checks
bit for bit against the format's own dequantization), every other tensor as stored, into the Transformers
model of the source architecture built from the pack's config.json on the meta device. What the files must
hold is decided from the headers before anything loads (`check_decoded_load_plan`).

A format plugs in as a `WeightDecoding`: which modules it stores quantized, what each stores, what keeps
those tensors from decoding into a slot, and the decode itself.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from evalsuite.backends.hf import DTYPES, HFBackend, meta_model, package_version, transformers_config
from evalsuite.backends.options import ADD_ACTIVATION_QUANTIZATION, BackendOptions
from evalsuite.backends.skeleton import (
    fill_slot,
    named_tensors,
    refuse_mismatch,
    set_generation_config,
    tensor_slots,
    tie_weights,
)
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint

# The stored dtypes a float slot takes as values (FP8 and integers are codes: they need decoding).
LOADABLE_FLOATS = frozenset({"BF16", "F16", "F32", "F64"})
__all__ = ["DecodedBackend", "check_decoded_load_plan"]


class WeightDecoding(Protocol):
    """A format's quantized modules as the decoded path reads them."""

    label: str  # the format as a report names it: "MLX", "GPTQ"
    parts: tuple[str, ...]  # what every quantized module `X` stores, `X.<part>`
    marker: str  # the part whose presence marks a module as stored quantized
    optional_parts: tuple[str, ...]  # what it may store besides
    value_dtype: str  # the dtype the decoded values are exact in ("float16", or the scales' "bfloat16")

    def modules(self) -> list[str]:
        """The modules stored quantized, by name."""
        ...

    def problems(self, module: str, shape: tuple[int, ...]) -> list[str]:
        """What keeps `module`'s stored tensors (all `parts` present) from decoding into a weight of `shape`,
        from the headers and the config; empty when they decode."""
        ...

    def decode(self, module: str) -> torch.Tensor:
        """`module`'s weight (out, in) as the format decodes it, in float32 (exact: its values are
        `value_dtype`'s)."""
        ...

    def execution(self) -> str:
        """How the weights were decoded, for the report: whose decode, what codes."""
        ...


def weight_decoding(checkpoint: Checkpoint) -> WeightDecoding:
    """The `WeightDecoding` of a checkpoint whose format is in `DECODED_FORMATS`."""
    if checkpoint.format == "mlx":
        from evalsuite.backends.mlx_decoded import MlxDecoding

        return MlxDecoding(checkpoint)
    if checkpoint.format in ("gptq", "awq"):
        from evalsuite.backends.gptq_decoded import GptqDecoding

        return GptqDecoding(checkpoint)
    if checkpoint.format == "modelopt":
        from evalsuite.backends.modelopt_decoded import ModeloptDecoding

        return ModeloptDecoding(checkpoint)
    raise AssertionError(f"no decoded path for format {checkpoint.format}")


class DecodedSkeleton:
    """The pack's model on the meta device, and what fills each of its tensors: a quantized module's
    decoded weight, or a stored tensor as it is."""

    def __init__(self, checkpoint: Checkpoint, options: BackendOptions) -> None:
        self.checkpoint = checkpoint
        self.decoding = weight_decoding(checkpoint)
        self.dtype = DTYPES[options.dtype]
        # Added by `fake_quantized_activations` on the decoded modules, not by a quantization config.
        self.add_activation_quantization = bool(options.convention_map.get(ADD_ACTIVATION_QUANTIZATION))
        self.config, _ = transformers_config(checkpoint, options)
        self.model = meta_model(self.config, self.dtype, checkpoint)
        self.slots = tensor_slots(self.model)
        names = set(checkpoint.tensors)
        self.quantized = self.decoding.modules()
        every_part = self.decoding.parts + self.decoding.optional_parts
        stored_parts = {f"{m}.{part}" for m in self.quantized for part in every_part} & names
        self.dense = sorted(names - stored_parts)
        self.problems = [
            f"{module}: {part} missing beside its {self.decoding.marker}"
            for module in self.quantized
            for part in self.decoding.parts
            if f"{module}.{part}" not in names
        ]
        if not self.problems:
            self.problems = [p for module in self.quantized for p in self._layout_problems(module)]
        self.problems += self._undecoded_codes()

    def _undecoded_codes(self) -> list[str]:
        """Codes stored without what decodes them (a `weight` of FP8 or packed integers whose module lacks
        its marker): loading them as they are would give the model the codes, not the weights."""
        found = []
        for name in self.dense:
            info, slot = self.checkpoint.tensors[name], self.slots.get(name)
            if slot is not None and slot[2].is_floating_point() and info.dtype not in LOADABLE_FLOATS:
                module, _, part = name.rpartition(".")
                found.append(
                    f"{module}: {info.dtype} {part} stored without the {self.decoding.marker} to decode it"
                )
        return found

    def _layout_problems(self, module: str) -> list[str]:
        """What keeps a module's stored parts from decoding into its slot; a module the model lacks is
        refused as unexpected (`refuse_problems`)."""
        slot = self.slots.get(f"{module}.weight")
        if slot is None or slot[2].dim() != 2:
            return []
        return [f"{module}: {p}" for p in self.decoding.problems(module, tuple(slot[2].shape))]

    def refuse_problems(self) -> None:
        """InputError naming what makes the files unloadable; nothing when they load faithfully."""
        if self.problems:
            raise InputError(f"{self.decoding.label} module {self.problems[0]}", self.checkpoint.path)
        filled = {f"{m}.weight" for m in self.quantized} | set(self.dense)
        tied = getattr(self.model, "all_tied_weights_keys", None) or {}
        missing = sorted(n for n in self.slots if n not in filled and not (n in tied and tied[n] in filled))
        unexpected = sorted(n for n in filled if n not in self.slots)
        refuse_mismatch(self.checkpoint, missing, unexpected)

    def load(self, device: str) -> nn.Module:
        """Every decoded weight and every stored tensor into the model, the generation config, the device."""
        self.refuse_problems()
        for module in self.quantized:
            self._place(f"{module}.weight", self.decoding.decode(module))
        for name, tensor in self.checkpoint.iter_tensors(self.dense):
            self._place(name, tensor)
        tie_weights(self.model)
        leftover = sorted(n for n, t in named_tensors(self.model) if t.is_meta)
        refuse_mismatch(self.checkpoint, leftover, [])
        set_generation_config(self.model, self.checkpoint)
        if self.add_activation_quantization:
            fake_quantized_activations(self.model, self.quantized)
        return self.model.to(device) if device != "cpu" else self.model

    def _place(self, name: str, value: torch.Tensor) -> None:
        fill_slot(
            self.slots, name, value.to(self.dtype) if value.is_floating_point() else value, self.checkpoint
        )


def fake_quantized_activations(model: nn.Module, modules: list[str]) -> None:
    """The input of each of `modules` quantized per token to INT8 and back, as intref quantizes it
    (`ActivationQuant`'s defaults: compressed-tensors' dynamic symmetric INT8): how backend `intref`'s
    comparison runs a weight-only pack under `hf`, so that the two are two executions of one model."""
    from evalsuite.backends._intlinear import ActivationQuant, quantize_activations

    act = ActivationQuant()

    def quantized_input(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        q, scale = quantize_activations(x.reshape(-1, x.shape[-1]), act)
        return ((q.float() * scale[:, None]).to(x.dtype).reshape(x.shape), *args[1:])

    for name in modules:
        model.get_submodule(name).register_forward_pre_hook(quantized_input)


def check_decoded_load_plan(checkpoint: Checkpoint, options: BackendOptions) -> None:
    """Refuse, from the configs and headers alone, a pack of `DECODED_FORMATS` whose tensors do not fill its
    model, or a run the decoded path cannot make."""
    label = weight_decoding(checkpoint).label
    if options.backend != "hf":
        raise InputError(
            f"a {label} pack runs from its decoded weights on backend hf, not {options.backend}",
            checkpoint.path,
        )
    if options.stream:
        raise InputError(f"a {label} pack is not run streamed (--stream): it loads whole", checkpoint.path)
    DecodedSkeleton(checkpoint, options).refuse_problems()


class DecodedBackend(HFBackend):
    """The pack's Transformers model, every quantized weight decoded; every `HFBackend` primitive runs on
    it."""

    def load_model(self, kwargs: dict[str, Any]) -> Any:
        """Build on the meta device, then decode and load every tensor from the files."""
        skeleton = DecodedSkeleton(self.checkpoint, self.options)
        self.decoding = skeleton.decoding
        return skeleton.load(self.options.device)

    def describe(self) -> dict[str, Any]:
        """The decoded path: what was decoded, the Transformers model that runs it, and whether the run's
        dtype holds the decoded values exactly."""
        dtype, exact_in = self.options.dtype, self.decoding.value_dtype
        added = (
            "; activations quantized per token to INT8 and back as intref quantizes them (the pack stores "
            "none)"
            if self.options.convention_map.get(ADD_ACTIVATION_QUANTIZATION)
            else ""
        )
        held = (
            f"the {exact_in} values held exactly"
            if dtype in ("float32", exact_in)
            else f"the {exact_in} values rounded to {dtype} (--dtype {exact_in} or float32 holds them"
            " exactly)"
        )
        return {
            "backend": "hf",
            "path": "decoded",
            "execution": (
                f"{self.decoding.execution()} into Transformers {package_version('transformers')} "
                f"({type(self.model).__name__}) in {dtype}, {held}; "
                f"{self.decoding.label} runtime not run{added}"
            ),
            "format": self.checkpoint.format,
        }
