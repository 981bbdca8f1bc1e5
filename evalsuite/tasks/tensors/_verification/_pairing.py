"""Which stored tensors of a candidate stand for each source tensor: the same name, or a quantized module's
parameters (`QuantizedFormat.params`) in place of its weight."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from evalsuite.files.checkpoint import TensorInfo
from evalsuite.formats import QuantizedFormat


@dataclass(frozen=True)
class Pair:
    """A source tensor and the candidate tensors it pairs with.

    `how` is `same` (`candidate` = {"": the tensor of the same name}), `quantized` (`candidate` maps each
    stored parameter of the module, e.g. "weight_packed", to its tensor) or `missing` (no candidate tensor).
    `tied_to` names the source tensor that stands for `source` when the source ties it to another and does
    not store it (an exllamav3 pack stores its own head even where the source ties it to the embedding).
    """

    source: str
    module: str
    how: Literal["same", "quantized", "missing"]
    candidate: dict[str, str] = field(default_factory=dict)
    tied_to: str | None = None


def tied_head(source: dict[str, TensorInfo], config: dict[str, Any]) -> dict[str, str]:
    """{"lm_head.weight": the input embedding} when the source ties its head to the embedding and stores
    the embedding only (config `tie_word_embeddings`, at the top or in `text_config`, not false); else {}."""
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    tie = config.get("tie_word_embeddings", text_config.get("tie_word_embeddings"))
    embeddings = [name for name in source if name.endswith("embed_tokens.weight")]
    if tie is False or "lm_head.weight" in source or len(embeddings) != 1:
        return {}
    return {"lm_head.weight": embeddings[0]}


def pair_tensors(
    source: dict[str, TensorInfo],
    candidate: dict[str, TensorInfo],
    format: QuantizedFormat | None,
    tied: dict[str, str] | None = None,
) -> tuple[list[Pair], list[str]]:
    """Pair every source tensor (in source order) and list the candidate tensors that pair with nothing.

    `tied` maps a weight the source does not store to the source tensor it is tied to: a candidate that
    quantizes that weight's module pairs it with that tensor (see `tied_head`).
    """
    quantized: dict[str, dict[str, str]] = {}
    if format is not None:
        by_module: dict[str, dict[str, str]] = {}
        for name in candidate:
            module, param = format.split(name) or ("", "")
            if param in format.params:
                by_module.setdefault(module, {})[param] = name
        quantized = {m: params for m, params in by_module.items() if format.marks & params.keys()}
    pairs, used = [], set()
    for weight, target in (tied or {}).items():
        module = weight.removesuffix(".weight")
        if weight not in source and target in source and module in quantized:
            pairs.append(Pair(weight, module, "quantized", quantized[module], tied_to=target))
            used.update(quantized[module].values())
    for name in source:
        module = name.rpartition(".")[0]
        # A module's weight in its place (`X.weight`), or a parameter stored in its own name's place (a
        # fused experts tensor `X.gate_up_proj` as `X.gate_up_proj_blocks`, `..._scales`: `split`).
        owner = module if name.endswith(".weight") and module in quantized else name
        if owner in quantized:
            pairs.append(Pair(name, owner, "quantized", quantized[owner]))
            used.update(quantized[owner].values())
        elif name in candidate:
            pairs.append(Pair(name, module, "same", {"": name}))
            used.add(name)
        else:
            pairs.append(Pair(name, module, "missing"))
    return pairs, [name for name in candidate if name not in used]
