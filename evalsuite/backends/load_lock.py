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

import threading

MODEL_LOADS = threading.RLock()
