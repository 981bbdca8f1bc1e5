"""Asymmetric `pack-quantized` checkpoints loaded by Transformers: the zero points' skeleton given the shape
compressed-tensors itself writes.

compressed-tensors packs an asymmetric group or channel scheme's zero points down the output rows
(`pack_to_int32(zero_point, bits, packed_dim=0)`: int32, ceil(rows × bits / 32) rows); llm-compressor's
packs are written that way and the library's decompression unpacks them that way. Transformers builds the
model to load into on the meta device and calls the same library's `PackedQuantizationCompressor.compress`
to give each module its compressed parameters; the meta branch of that method (compressed-tensors 0.19 and
0.20) sets `weight_packed` and `weight_shape` but leaves `weight_zero_point` as initialised: unpacked
(rows, groups), int8. Transformers 5.17 overwrote that slot with the stored tensor without comparing shapes;
5.24 compares them and refuses the load ("size mismatch" on every `weight_zero_point`). So the files are
right, Transformers' check is right, and the bug is that one meta branch.

`zero_points_packed_on_meta()` wraps the method while a model loads: where its meta result holds an
asymmetric group / channel zero point still unpacked (one row per output row), the slot becomes the packed
int32 shape. Nothing else changes, no data is touched, and where the method already returns the packed
shape (a fixed release) or is gone, the wrapper does nothing.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

PACKED_ZERO_POINT_STRATEGIES = ("group", "channel")


def packed_zero_point_shape(unpacked: tuple[int, ...], bits: int) -> tuple[int, ...]:
    """The stored shape of zero points of `unpacked` shape (rows, groups): rows packed into int32 words."""
    return (math.ceil(unpacked[0] * bits / 32), *unpacked[1:])


def _repaired(state_dict: dict[str, Any], scheme: Any) -> dict[str, Any]:
    import torch

    weights = getattr(scheme, "weights", None)
    zero_point, packed_weight = state_dict.get("weight_zero_point"), state_dict.get("weight_packed")
    if (
        weights is None
        or weights.symmetric
        or str(getattr(weights.strategy, "value", weights.strategy)) not in PACKED_ZERO_POINT_STRATEGIES
        or zero_point is None
        or packed_weight is None
        or zero_point.device.type != "meta"
        or zero_point.dim() != 2
    ):
        return state_dict
    rows = packed_weight.shape[0]
    # Only the unpacked slot (one zero point per output row) is the bug; any other shape is left for
    # Transformers' load report to name.
    if zero_point.shape[0] != rows:
        return state_dict
    packed = packed_zero_point_shape((rows, zero_point.shape[1]), weights.num_bits)
    return {**state_dict, "weight_zero_point": torch.empty(packed, dtype=torch.int32, device="meta")}


class _CountedPatch:
    """The wrapper installed on the compressor class while at least one load needs it: the first load in
    installs it, the last one out restores the original, both under one lock. Loads in several threads
    (two comparisons in one process) share the one wrapper instead of wrapping each other's and restoring
    in the wrong order, which would leave the class patched for good."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.original: Any = None

    def enter(self, owner: type) -> bool:
        """Install the wrapper if none is; False where the class has no `compress` classmethod to wrap."""
        with self.lock:
            if self.users == 0:
                original = owner.__dict__.get("compress")
                if not isinstance(original, classmethod):
                    return False

                def compress(cls: type, state_dict: dict[str, Any], scheme: Any) -> dict[str, Any]:
                    return _repaired(original.__func__(cls, state_dict, scheme), scheme)

                self.original = original
                owner.compress = classmethod(compress)  # type: ignore[attr-defined]
            self.users += 1
            return True

    def leave(self, owner: type) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                owner.compress = self.original  # type: ignore[attr-defined]
                self.original = None


_PATCH = _CountedPatch()


@contextlib.contextmanager
def zero_points_packed_on_meta() -> Iterator[None]:
    """While the block runs, compressed-tensors' meta compression of a `pack-quantized` module gives an
    asymmetric zero point the packed shape its files store (module docstring). Safe to enter from several
    threads at once: the class is patched while any of them is inside, and restored after the last."""
    try:
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    except ImportError:
        yield
        return
    if not _PATCH.enter(PackedQuantizationCompressor):
        yield
        return
    try:
        yield
    finally:
        _PATCH.leave(PackedQuantizationCompressor)
