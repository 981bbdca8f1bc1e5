"""The units a streamed model is materialised by (`evalsuite.backends.streamed`): each decoder layer; the
rest of the text path (embeddings, final norm, head), resident for the whole run; and what a text forward
never runs (a vision-language model's vision tower and projector), read only when an image is. At the real
shape of the model this project exists for the vision tower is as large as a decoder layer: resident for a
text-only pass, it would be one more layer's worth of memory for nothing."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint

REST = None  # the unit of the text path outside the decoder layers
VISION = "vision"  # the unit of what the text path never runs
Unit = int | str | None


def text_modules(model: Any) -> tuple[str, ...]:
    """The module names of the text path outside the decoder layers' own: the decoder (`get_decoder()`, the
    language model of an image-text-to-text model) and the output embeddings. Empty when the decoder is the
    model itself, or cannot be named: then every tensor is of the text path."""
    names = {id(module): name for name, module in model.named_modules()}
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = [names.get(id(decoder))] + ([names.get(id(head))] if head is not None else [])
    return () if any(not name for name in found) else tuple(n for n in found if n)


def unit_of(name: str, prefix: str, text: tuple[str, ...]) -> Unit:
    """The unit a state-dict name belongs to: its decoder layer's index, `REST` on the text path, `VISION`
    off it (`text`: `text_modules`)."""
    layer = layer_of(name, prefix)
    if layer is not None or not text or any(name.startswith(t + ".") for t in text):
        return layer
    return VISION


def vision_modules(model: Any, text: tuple[str, ...]) -> list[Any]:
    """The modules off the text path: neither a text module, nor inside one, nor one that holds one."""

    def on_path(name: str) -> bool:
        return any(name == t or name.startswith(t + ".") or t.startswith(name + ".") for t in text)

    return [m for n, m in model.named_modules() if n and text and not on_path(n)]


def layer_of(name: str, prefix: str) -> int | None:
    """The decoder layer a state-dict name belongs to, None outside the layers."""
    if not name.startswith(prefix + "."):
        return None
    head = name[len(prefix) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def refuse_missing_in_layers(
    checkpoint: Checkpoint, prefix: str, missing: Iterable[str], unexpected: Iterable[str]
) -> None:
    """One line naming the first decoder layer whose tensors the files lack (or hold in excess); names
    outside the decoder layers are left to the whole-checkpoint check."""
    by_layer: dict[str, dict[int, list[str]]] = {"missing": {}, "unexpected": {}}
    for what, names in (("missing", missing), ("unexpected", unexpected)):
        for name in names:
            layer = layer_of(name, prefix)
            if layer is not None:
                by_layer[what].setdefault(layer, []).append(name)
    for layer in sorted({*by_layer["missing"], *by_layer["unexpected"]}):
        problems = []
        for what, local_names in (
            ("missing from the files", by_layer["missing"].get(layer)),
            ("not in the model", by_layer["unexpected"].get(layer)),
        ):
            if local_names:
                local = sorted(n.removeprefix(f"{prefix}.{layer}.") for n in local_names)
                shown = ", ".join(local[:3]) + (f" and {len(local) - 3} more" if len(local) > 3 else "")
                problems.append(f"{len(local)} tensors {what} ({shown})")
        raise InputError(f"decoder layer {layer} ({prefix}.{layer}): " + "; ".join(problems), checkpoint.path)
