"""The memory plan of every format against what Transformers actually allocates: a tiny pack of each (INT4
and INT8 in compressed-tensors' packed and plain formats, FP8 per tensor and per block, NVFP4, MXFP4,
EXL3) loaded whole, its parameters and buffers summed. NVFP4's `weight_packed` holds two weights a byte
and an 8-bit pack-quantized word four: both were counted as INT4 words once (a quarter and twice the
bytes); MXFP4's E8M0 scales are held in the compute dtype."""

from __future__ import annotations

import pytest

from evalsuite.backends import load_backend
from evalsuite.backends.memory import loaded_bytes
from evalsuite.backends.options import BackendOptions
from evalsuite.files.checkpoint import Checkpoint
from tests.conftest import TINY_BF16, TINY_EXL3, TINY_W4A8

LLMC_PACKS = (
    *("fp8-dynamic", "nvfp4a16", "mxfp4a16", "w4a16-asym-g64"),
    *("w4a8-g64", "w4a8-gptq", "w8a16", "w8a8"),
)


def allocated_bytes(folder) -> tuple[int, int]:
    """(the plan's loaded bytes, the bytes of the loaded model's parameters and buffers)."""
    checkpoint = Checkpoint.open(folder)
    options = BackendOptions(backend="auto").for_format(checkpoint.format)
    backend = load_backend(checkpoint, options)
    try:
        seen, actual = set(), 0
        for tensor in [*backend.model.parameters(), *backend.model.buffers()]:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                actual += tensor.numel() * tensor.element_size()
    finally:
        backend.close()
    return loaded_bytes(checkpoint, options), actual


@pytest.mark.parametrize("scheme", LLMC_PACKS)
def test_the_plan_of_each_compressed_tensors_pack_is_what_transformers_allocates(llmc_tiny, scheme):
    planned, actual = allocated_bytes(llmc_tiny["tiny-llama-llmc"] / scheme)
    assert abs(planned - actual) <= 0.01 * actual, (scheme, planned, actual)


def test_the_plan_of_bf16_w4a8_and_block_fp8_is_what_transformers_allocates(tiny_pair, fp8_block_tiny):
    for folder in (tiny_pair[TINY_BF16], tiny_pair[TINY_W4A8], fp8_block_tiny["tiny-llama-fp8-block"]):
        planned, actual = allocated_bytes(folder)
        assert abs(planned - actual) <= 0.01 * actual, (folder.name, planned, actual)


def test_the_plan_of_an_exl3_pack_bounds_its_decoded_weights(tiny_exl3_pair):
    """EXL3 tiles pad each Linear to 128 features from the headers alone: an upper bound, exact at widths
    that are multiples of 128 (the real model's), three times the decoded weights at the tiny one's."""
    planned, actual = allocated_bytes(tiny_exl3_pair[TINY_EXL3])
    assert actual <= planned <= 3 * actual
