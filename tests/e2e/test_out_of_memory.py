"""Exit codes by cause: an allocation that fails, wherever it fails, is exit 4 ("out of resources": a bigger
machine or `--stream` helps) with one line, never exit 2 ("bad input") nor a bare exit 3. A bad checkpoint
stays exit 2.

Fault injection: the CLI runs in this process on the tiny pair, with the one function of each place made to
fail as PyTorch's allocators fail (their own exception types and messages): a whole load, a streamed
layer's materialisation, a forward.
"""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_utils import PreTrainedModel

from evalsuite.backends import hf, streamed
from tests.conftest import cli_in_process, copy_checkpoint

TINY_BF16, TINY_W4A8 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8"
CPU_ALLOCATOR = (
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 2147483648 bytes. Error code 12 (Cannot allocate memory)"
)


def run_args(pair, tmp_path, *extra):
    return (
        "run", "--ckpt", pair[TINY_W4A8], "--ref", pair[TINY_BF16], "--tasks", "ppl",
        "--corpus", "python-docs", "--out", tmp_path / "run", "--quiet", *extra,
    )  # fmt: skip


def assert_out_of_resources(code: int, lines: list[str]) -> None:
    assert code == 4, lines
    # What ran before ("loading ref: …") may precede it; the failure itself is one line, the last.
    errors = [line for line in lines if line.startswith("evalsuite: ")]
    assert errors == [lines[-1]] and lines[-1].startswith("evalsuite: error: "), lines
    assert "out of memory" in lines[-1] and "--stream" in lines[-1], lines[-1]


def test_a_load_that_runs_out_of_memory_is_exit_4_not_bad_input(tiny_pair, tmp_path, monkeypatch):
    real = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        if kwargs.get("device_map") == "meta":  # the plan's skeleton: no memory to run out of
            return real(cls, *args, **kwargs)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
    code, lines, _ = cli_in_process(*run_args(tiny_pair, tmp_path))
    assert_out_of_resources(code, lines)
    assert str(tiny_pair[TINY_BF16]) in lines[-1]  # the side that did not fit


def test_a_streamed_layer_that_runs_out_of_memory_is_exit_4(tiny_pair, tmp_path, monkeypatch):
    def load_layer(self, index):
        raise RuntimeError(CPU_ALLOCATOR)

    monkeypatch.setattr(streamed.TransformersLayers, "load_layer", load_layer)
    code, lines, _ = cli_in_process(*run_args(tiny_pair, tmp_path, "--stream"))
    assert_out_of_resources(code, lines)
    assert (tmp_path / "run" / "traceback.txt").is_file()


def test_a_forward_that_runs_out_of_memory_is_exit_4(tiny_pair, tmp_path, monkeypatch):
    def window_logits(self, windows, positions):
        raise MemoryError

    monkeypatch.setattr(hf.HFBackend, "window_logits", window_logits)
    code, lines, _ = cli_in_process(*run_args(tiny_pair, tmp_path))
    assert_out_of_resources(code, lines)


def test_a_bad_checkpoint_stays_exit_2(tiny_pair, tmp_path):
    broken = copy_checkpoint(tiny_pair[TINY_W4A8], tmp_path / "broken")
    (broken / "config.json").write_text("{ not json")
    code, lines, _ = cli_in_process(
        "run", "--ckpt", broken, "--ref", tiny_pair[TINY_BF16], "--tasks", "ppl", "--out", tmp_path / "run"
    )
    assert code == 2 and len(lines) == 1 and "out of memory" not in lines[0], lines


@pytest.mark.parametrize(
    "exc",
    [MemoryError(), torch.OutOfMemoryError("CUDA out of memory"), RuntimeError(CPU_ALLOCATOR)],
    ids=["MemoryError", "torch.OutOfMemoryError", "DefaultCPUAllocator"],
)
def test_every_allocator_failure_is_recognised_even_when_wrapped(exc):
    from evalsuite.errors import is_out_of_memory

    try:
        try:
            raise exc
        except Exception as inner:
            raise ValueError("a library wrapped it") from inner
    except ValueError as outer:
        assert is_out_of_memory(outer)
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
