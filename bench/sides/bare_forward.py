"""The bare side of bench/ppl.py: load each model, forward the windows, log-softmax the scored rows. Nothing
else: what any perplexity script must do, for `evalsuite run --tasks ppl` to be measured against.

    python bench/sides/bare_forward.py WINDOWS.npy FIRST LAST MODEL_DIR [MODEL_DIR ...]

WINDOWS.npy: int64 token ids, one window per row; FIRST..LAST: the scored positions. Prints the seconds spent
forwarding (the loops below, every model's, without imports or loads): the least time any perplexity run of
these windows with these models takes on this machine.
"""

import sys
import time

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

windows_file, first, last, *models = sys.argv[1:]
windows = torch.from_numpy(np.load(windows_file))
positions = torch.arange(int(first), int(last) + 1)
forwarding = 0.0
for folder in models:
    # A vision-language checkpoint (MiniCPM-V 4.7) is a causal LM with an image tower beside it.
    vision = "vision_config" in AutoConfig.from_pretrained(folder).to_dict()
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(folder, dtype=torch.bfloat16)
    start = time.perf_counter()
    with torch.inference_mode():
        for window in windows:
            logits = model(input_ids=window[None], logits_to_keep=positions, use_cache=False).logits
            torch.log_softmax(logits.float(), dim=-1)
    forwarding += time.perf_counter() - start
    del model
print(f"forward_seconds {forwarding:.4f}")
