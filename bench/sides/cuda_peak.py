"""evalsuite's command line in this process, torch's peak CUDA memory written at exit (bench/gpu_check.py).

    CUDA_PEAK_FILE=peak.json python bench/sides/cuda_peak.py run --ckpt ... --device cuda

The file gets {"allocated": bytes, "reserved": bytes} (torch.cuda.max_memory_allocated / _reserved over the
whole process, which loads one model at a time), or nulls when the process never initialised CUDA. The exit
code is evalsuite's own.
"""

import atexit
import json
import os
import sys

import torch


def write_peak() -> None:
    used = torch.cuda.is_available() and torch.cuda.is_initialized()
    peak = {
        "allocated": torch.cuda.max_memory_allocated() if used else None,
        "reserved": torch.cuda.max_memory_reserved() if used else None,
    }
    with open(os.environ["CUDA_PEAK_FILE"], "w", encoding="utf-8") as f:
        json.dump(peak, f)


atexit.register(write_peak)
from evalsuite.cli.app import main  # noqa: E402  (after the handler, so that every exit writes the file)

sys.argv = ["evalsuite", *sys.argv[1:]]
main()
