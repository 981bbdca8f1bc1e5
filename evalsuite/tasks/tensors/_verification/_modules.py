"""What kind of module a source tensor belongs to, in which part of the model and at which layer, told from
names and shapes alone, since no model is ever built."""

from __future__ import annotations

import re
from typing import Any

from evalsuite.contract.spec import StrictModel
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.formats import ModuleKind, Part


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    # compressed-tensors' own rule for a target: "re:" + a regex matched at the start, or an exact name.
    from compressed_tensors.utils.match import match_name

    return any(match_name(name, pattern) for pattern in patterns)


class ModuleRules(StrictModel):
    """How a module is told apart from its name and its source weight, since no model is ever built.

    A Linear is a module whose source `.weight` is 2-D, unless its name matches `embedding` (token and
    position tables), `router` (MoE gates: Linear layers whose few outputs pick experts, never quantized by
    a sound recipe) or `state` (linear-attention projections that feed the recurrent state, kept at source
    precision like the other state tensors). 1-D weights are norms; other shapes (convolutions) are `other`.
    `head`, `vision` and `mtp` say which part of the model a module belongs to; the rest is the text backbone.
    Patterns are compressed-tensors targets: `re:` + a regex matched at the start of the name, or a name.
    """

    embedding: tuple[str, ...] = ()
    router: tuple[str, ...] = ()
    state: tuple[str, ...] = ()
    head: tuple[str, ...] = ()
    vision: tuple[str, ...] = ()
    mtp: tuple[str, ...] = ()

    def kind(self, name: str, shape: tuple[int, ...]) -> ModuleKind:
        """The kind of module a source tensor's module is, from the tensor's name and shape."""
        if not name.endswith(".weight"):
            return "other"
        module = name.removesuffix(".weight")
        if len(shape) == 1:
            return "norm"
        if len(shape) != 2:
            return "other"
        for kind, patterns in (("embedding", self.embedding), ("router", self.router), ("state", self.state)):
            if _matches(module, patterns):
                return kind
        return "norm" if module.rsplit(".", 1)[-1].endswith("norm") else "linear"

    def part(self, module: str) -> Part:
        """Which part of the model a module belongs to."""
        for part, patterns in (("head", self.head), ("vision", self.vision), ("mtp", self.mtp)):
            if _matches(module, patterns):
                return part
        return "text"


_LAYER = re.compile(r"\.(?:layers|h|blocks|block)\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.\d+\.")


def layer_and_projection(module: str, part: Part) -> tuple[int | None, str]:
    """The layer index of a module (None outside the layer stacks) and its projection name, with the expert
    index replaced by `*` and, outside the text backbone, its part in front (`vision:mlp.fc1`)."""
    match = _LAYER.search(f".{module}.")
    if match is None:
        return None, module
    projection = _EXPERT.sub(".experts.*.", f".{module[match.end() - 1 :]}.").strip(".")
    return int(match.group(1)), projection if part == "text" else f"{part}:{projection}"


def skeleton_modules(checkpoint: Checkpoint) -> dict[str, Any]:
    """The modules of the model Transformers builds from the checkpoint's config, on the meta device, by
    name: what compressed-tensors matches class-name targets against. Empty when Transformers cannot build it
    (an architecture it does not know): matching then falls back to stand-ins of each module's kind."""
    from evalsuite.backends.hf import meta_model, transformers_config
    from evalsuite.backends.options import BackendOptions
    from evalsuite.errors import EvalsuiteError

    try:
        import torch

        config, _ = transformers_config(checkpoint, BackendOptions())
        model = meta_model(config, torch.bfloat16, checkpoint, buffers=False)
    except (EvalsuiteError, ImportError, ValueError, KeyError, TypeError, RuntimeError):
        return {}
    return dict(model.named_modules())
