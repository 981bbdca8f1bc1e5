"""What the backends that build a model on the meta device and fill it from the files share: the model's
tensor slots by state-dict name, Transformers' fused experts, the tensors its class ignores on load, and the
refusal of files that do not match the model (`intref`, `exl3`, `streamed`, `decoded`)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable

import torch
from torch import nn

from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint, TensorInfo


def fused_experts(module: nn.Module) -> bool:
    """Transformers' fused routed experts: 3-D `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
        and hasattr(module, "act_fn")
    )


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter (tied ones under each name) and persistent buffer of `model`, by state-dict name."""
    params = list(model.named_parameters(remove_duplicate=False))
    persistent = [
        (f"{m}.{b}" if m else b, t)
        for m, module in model.named_modules()
        for b, t in module._buffers.items()
        if t is not None and b not in module._non_persistent_buffers_set
    ]
    return params + persistent


def tensor_slots(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """Every parameter and persistent buffer by its state-dict name: (owning module, kind, current tensor)."""
    slots: dict[str, tuple[nn.Module, str, torch.Tensor]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}." if module_name else ""
        for leaf, param in module._parameters.items():
            if param is not None:
                slots[prefix + leaf] = (module, "parameter", param)
        for leaf, buf in module._buffers.items():
            if buf is not None and leaf not in module._non_persistent_buffers_set:
                slots[prefix + leaf] = (module, "buffer", buf)
    return slots


def fill_slot(
    slots: dict[str, tuple[nn.Module, str, torch.Tensor]],
    name: str,
    value: torch.Tensor,
    checkpoint: Checkpoint,
) -> None:
    """Put `value` into the model's parameter or persistent buffer `name` (a `tensor_slots` entry), refusing
    a value whose shape is not the model's."""
    owner, kind, placeholder = slots[name]
    if tuple(value.shape) != tuple(placeholder.shape):
        raise InputError(
            f"tensor for {name} has shape {tuple(value.shape)}; the model expects {tuple(placeholder.shape)}",
            checkpoint.path,
        )
    leaf = name.rpartition(".")[2]
    if kind == "parameter":
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def refuse_mismatch(checkpoint: Checkpoint, missing: list[str], unexpected: list[str]) -> None:
    """InputError naming the tensors a model needs that the files lack, and those they hold in excess."""
    problems = []
    for what, names in (("missing from the files", missing), ("not in the model", unexpected)):
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            problems.append(f"{len(names)} tensors {what} ({shown})")
    if problems:
        raise InputError(
            "the files do not match the model Transformers builds from the config: " + "; ".join(problems),
            checkpoint.path,
        )


def ignored_on_load(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The names Transformers drops without a word when it loads `model`: those matching its class's
    `_keys_to_ignore_on_load_unexpected` (Qwen3.5's MTP head, `^mtp.*`, for one), in order."""
    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    return [name for name in names if any(p.search(name) for p in patterns)]


def ignored_on_load_patterns(config: dict) -> list[str]:
    """`_keys_to_ignore_on_load_unexpected` of the model classes a config.json names (`architectures`),
    read from the Transformers classes without building a model; empty for a class Transformers lacks."""
    import transformers

    patterns: list[str] = []
    for name in config.get("architectures") or ():
        model_class = getattr(transformers, str(name), None) if isinstance(name, str) else None
        patterns += list(getattr(model_class, "_keys_to_ignore_on_load_unexpected", None) or ())
    return patterns


def tie_weights(model: nn.Module) -> None:
    """Tie what the model ties (the head to the embedding) where the files store only the source, as a
    skeleton filled tensor by tensor has no `from_pretrained` to do it."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for target, source in tied.items():
        owner_name, _, leaf = target.rpartition(".")
        owner = model.get_submodule(owner_name)
        current = owner._parameters.get(leaf)
        if current is not None and current.is_meta:
            owner._parameters[leaf] = model.get_parameter(source)


def set_generation_config(model: nn.Module, checkpoint: Checkpoint) -> None:
    """The checkpoint's generation_config.json on the model, as `from_pretrained` would set it (the model
    class's defaults stay where the file cannot be read, as with `from_pretrained`)."""
    from transformers import GenerationConfig

    if (checkpoint.path / "generation_config.json").is_file():
        with contextlib.suppress(Exception):
            model.generation_config = GenerationConfig.from_pretrained(str(checkpoint.path))


class MarkedModules:
    """What the `WeightDecoding`s share: the modules stored quantized, found by their `marker` part, and the
    parts each stores."""

    parts: tuple[str, ...]
    marker: str
    optional_parts: tuple[str, ...]

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        suffix = f".{self.marker}"
        self._modules = sorted(n.removesuffix(suffix) for n in checkpoint.tensors if n.endswith(suffix))

    def modules(self) -> list[str]:
        """Every module stored with the marker part."""
        return self._modules

    def stored(self, module: str) -> dict[str, TensorInfo]:
        """The parts `module` stores, by part."""
        names = {part: f"{module}.{part}" for part in self.parts + self.optional_parts}
        return {part: self.checkpoint.tensors[n] for part, n in names.items() if n in self.checkpoint.tensors}
