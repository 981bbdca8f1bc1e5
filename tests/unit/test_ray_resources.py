"""What each candidate of `compare --executor ray` asks Ray for, and how its devices read inside the task:
CPUs for its torch threads, GPUs under `cuda`, `cuda:N` and `auto` (as many as its load plan fills), the
driver's `cuda:N` as the task's `cuda:0` (Ray shows a task only its GPUs, from 0); and `tensors` does not
fork its workers from a process that has initialised CUDA. No GPU and no Ray needed: these are the requests
and the remapping, not their execution (the slow tier runs a real local cluster)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from evalsuite.backends.memory import loaded_bytes
from evalsuite.backends.options import BackendOptions
from evalsuite.candidates.executors import candidate_resources, in_ray_task
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.pipeline.plan import RunRequest
from evalsuite.tasks.tensors._verification._engine import default_worker_kind

TINY_BF16, TINY_W4A8 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8"


def request(pair: dict[str, Path], device: str) -> RunRequest:
    options = BackendOptions(device=device)
    return RunRequest(
        ckpt=str(pair[TINY_W4A8]),
        ref=str(pair[TINY_BF16]),
        tasks=["ppl"],
        out=Path("unused"),
        ckpt_options=options,
        ref_options=options,
    )


def test_a_cpu_candidate_asks_for_its_threads_and_its_loaded_memory(tiny_pair):
    asked = candidate_resources(request(tiny_pair, "cpu"), threads=2)
    needed = loaded_bytes(Checkpoint.open(tiny_pair[TINY_W4A8]), BackendOptions())
    assert asked == {"num_cpus": 2, "memory": needed}


def test_a_cuda_candidate_asks_for_one_gpu_and_runs_on_the_tasks_first(tiny_pair):
    for device in ("cuda", "cuda:3"):
        assert candidate_resources(request(tiny_pair, device), threads=4) == {"num_cpus": 4, "num_gpus": 1}
    remapped = in_ray_task(request(tiny_pair, "cuda:3"))
    assert remapped.ckpt_options.device == remapped.ref_options.device == "cuda:0"
    assert in_ray_task(request(tiny_pair, "cuda")).ckpt_options.device == "cuda"


def test_an_auto_candidate_asks_for_as_many_gpus_as_its_load_fills(tiny_pair):
    # The bug: `--device auto` asked Ray for no GPU at all.
    needed = loaded_bytes(Checkpoint.open(tiny_pair[TINY_W4A8]), BackendOptions(device="auto"))
    small_gpu = needed // 3 + 1
    asked = candidate_resources(request(tiny_pair, "auto"), threads=1, gpu_bytes=small_gpu)
    assert asked == {"num_cpus": 1, "num_gpus": math.ceil(needed / small_gpu)} and asked["num_gpus"] == 3
    assert candidate_resources(request(tiny_pair, "auto"), threads=1)["num_gpus"] == 1
    assert in_ray_task(request(tiny_pair, "auto")).ckpt_options.device == "auto"


def test_tensors_uses_threads_in_a_process_that_initialised_cuda(monkeypatch):
    assert default_worker_kind(2) == "process"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert default_worker_kind(2) == "thread"
