"""lm-eval's side of bench/ppl.py: its rolling log-likelihood (HF backend, batch 1, windows of the protocol's
length) of each window's text, for each model in turn: what a user would run with lm-eval to get a
perplexity of the same text.

    python bench/sides/lmeval_rolling.py WINDOWS.npy WINDOW_TOKENS MODEL_DIR [MODEL_DIR ...]

The windows are given to lm-eval as their decoded text (lm-eval takes strings and tokenizes them itself).
"""

import sys

import numpy as np
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

windows_file, window_tokens, *models = sys.argv[1:]
windows = np.load(windows_file)
for folder in models:
    lm = HFLM(pretrained=folder, dtype="bfloat16", batch_size=1, max_length=int(window_tokens), device="cpu")
    texts = [lm.tokenizer.decode(window.tolist()) for window in windows]
    requests = [
        Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=i)
        for i, text in enumerate(texts)
    ]
    lm.loglikelihood_rolling(requests, disable_tqdm=True)
    del lm
