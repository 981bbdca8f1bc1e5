"""Two `evalsuite.compare` calls in two threads of one process, made to interleave, give what each gives
alone, and leave the process's settings as they found them: torch's thread count and compressed-tensors'
compressor class (which a load patches while it runs)."""

from __future__ import annotations

import threading
import traceback

import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

import evalsuite
from evalsuite.fixtures import TINY_BF16, TINY_W4A8

TASKS = ["ppl", "tensors"]


def test_two_compares_in_two_threads_give_what_each_gives_alone(tiny_pair, tmp_path):
    threads_before = torch.get_num_threads()
    compress_before = PackedQuantizationCompressor.__dict__["compress"]
    ckpt, ref = tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16]
    arguments = dict(tasks=TASKS, corpus="python-docs", plots=False)
    solo = evalsuite.compare([ckpt], ref, tmp_path / "solo", **arguments)

    # Every pass of one call waits for the same pass of the other: loads, observations and the detail of
    # the two calls overlap instead of running one after the other.
    barrier = threading.Barrier(2)
    met = [0]

    def progress(description: str, total: int):
        try:
            barrier.wait(timeout=120)
            met[0] += 1
        except threading.BrokenBarrierError:
            pass
        return lambda: None

    outcomes: dict[str, evalsuite.CompareOutcome] = {}
    errors: list[str] = []

    def compare(name: str) -> None:
        try:
            outcomes[name] = evalsuite.compare([ckpt], ref, tmp_path / name, progress=progress, **arguments)
        except BaseException:  # shown by the assertion below, with where it was raised
            errors.append(traceback.format_exc())

    workers = [threading.Thread(target=compare, args=(name,)) for name in ("a", "b")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors, "\n".join(errors)
    assert met[0] >= 4  # the two calls met at two passes at least: they did interleave
    name = ckpt.name
    for outcome in outcomes.values():
        for task in TASKS:
            assert (
                outcome.candidates[name].tasks[task].metrics == solo.candidates[name].tasks[task].metrics
            ), task
        assert outcome.comparison.candidates[0].verdict == solo.comparison.candidates[0].verdict
    assert torch.get_num_threads() == threads_before
    assert PackedQuantizationCompressor.__dict__["compress"] is compress_before
