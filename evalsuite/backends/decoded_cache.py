"""Weights a streamed decoding decoded from the files, kept across its steps within the side's memory budget.

A streamed side reads every decoder layer again at each forward of a decoding (`evalsuite.backends.streamed`).
What it converts as it reads, it converts again each time: a compressed-tensors module's decompression, a
MoE layer's routed experts fused from per-expert tensors (and decompressed, for a pack). Consecutive steps
route many of their tokens to the same experts, and a layer's other projections are the same at every step,
so what was converted is kept, keyed by layer and by expert (an int) or module (its name in the layer),
least recently used first out, within `budget` bytes (`memory.expert_cache_budget`: what the side's
`--max-memory` leaves beside its streamed peak). What a read takes as it is stored (a BF16 tensor, a view of
its file's mapping) is not kept: reading it again costs no conversion.

The values kept are the very values converted (copies of them), so a hit changes no bit of a forward.
`hits`, `misses` and `bytes_saved` (the files' bytes a hit did not read) are what results.json's
`model_loads` reports. Passes over fixed sequences (`ppl`, `moe`, `layers`) read each layer once and keep
nothing: a streamed pass's peak is what it was.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

# What is kept of one expert or module: its tensors by name (None where a module has none by that name: a
# Linear layer without a bias).
Kept = dict[str, torch.Tensor | None]


class DecodedCache:
    """Converted weights by (layer, expert or module), least recently used first out, within `budget` bytes
    (module docstring)."""

    def __init__(self, budget: int) -> None:
        self.budget = max(0, int(budget))
        self.held = 0
        self.hits = self.misses = self.bytes_saved = 0
        self._kept: OrderedDict[tuple[int, int | str], tuple[Kept, int, int]] = OrderedDict()

    def take(self, layer: int, key: int | str) -> Kept | None:
        """What is kept of `key` in `layer`, or None; a hit counts the bytes its read would have cost."""
        found = self._kept.get((layer, key))
        if found is None:
            self.misses += 1
            return None
        self._kept.move_to_end((layer, key))
        self.hits += 1
        self.bytes_saved += found[2]
        return found[0]

    def keep(self, layer: int, key: int | str, tensors: Kept, file_bytes: int) -> None:
        """Keep a copy of `tensors` (read from `file_bytes` of the files), evicting the least recently used
        while over the budget; what is larger than the budget is not kept."""
        size = sum(t.numel() * t.element_size() for t in tensors.values() if t is not None)
        if size > self.budget or (layer, key) in self._kept:
            return
        while self.held + size > self.budget and self._kept:
            _, (_, evicted, _) = self._kept.popitem(last=False)
            self.held -= evicted
        copies = {k: None if v is None else v.clone() for k, v in tensors.items()}
        self._kept[(layer, key)] = (copies, size, file_bytes)
        self.held += size

    def clear(self) -> None:
        self._kept.clear()
        self.held = 0

    def figures(self) -> dict[str, Any]:
        """What results.json's `model_loads` says of the cache."""
        asked = self.hits + self.misses
        return {
            "budget_bytes": self.budget,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": round(self.hits / asked, 4) if asked else None,
            "bytes_saved": self.bytes_saved,
        }
