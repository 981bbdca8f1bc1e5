"""One model load at a time in the process.

Transformers' and compressed-tensors' loading change process-wide state while it runs: the default dtype
(`from_pretrained(dtype=...)` sets it), nn.Module's parameter registration (accelerate's empty-weight
initialisation patches it to put parameters on the meta device), compressed-tensors' decompression at the
first forward, Transformers' log verbosity. Two loads at once in one process (two `compare` calls in two
threads) broke each other ("Offload of type meta": one thread's decompressed parameters registered on the
meta device while the other built a skeleton), so loads, plan checks and skeletons that build a model take
turns; forwards of models already built run side by side.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

MODEL_LOADS = threading.RLock()

# Transformers' switch for reading a checkpoint's tensors in its worker threads as fast as they come, ahead of
# the conversions that consume them.
_ASYNC_SWITCH = "HF_DEACTIVATE_ASYNC_LOAD"
_in_order = threading.Lock()
_in_order_depth = 0
_async_setting: str | None = None


@contextlib.contextmanager
def tensors_read_when_converted() -> Iterator[None]:
    """For the duration of a load (nested and concurrent blocks included), each tensor read from the files
    only when Transformers' conversion of it starts, unless the user set Transformers' switch themselves.

    Why: Transformers otherwise submits every tensor of the load to 4 reader threads at once, and what they
    read waits in memory for the conversion (per-expert tensors fused into one, a W4A8 pack's experts
    dequantized) to reach it. On the seed's real shape that read-ahead was the largest part of a loaded
    peak's excess over the model (bench/real_shape.py measures the peak). On the CPU the conversion, not the
    reading, sets the pace, so the load takes about as long."""
    global _in_order_depth, _async_setting
    with _in_order:
        if _in_order_depth == 0:
            _async_setting = os.environ.get(_ASYNC_SWITCH)
            if _async_setting is None:
                os.environ[_ASYNC_SWITCH] = "1"
        _in_order_depth += 1
    try:
        yield
    finally:
        with _in_order:
            _in_order_depth -= 1
            if _in_order_depth == 0 and _async_setting is None:
                os.environ.pop(_ASYNC_SWITCH, None)
