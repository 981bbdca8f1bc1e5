"""GPTQ's and AWQ's packing on words worked by hand (the writers' layouts; the slow tier checks whole packs
against the writer's own dequantization, tests/e2e/test_gptq_awq.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from evalsuite.formats.gptq import GptqFormat, decode

WORD = np.int32(0x76543210)  # codes 0, 1, …, 7 from the least significant nibble


def fmt(method: str, **config) -> GptqFormat:
    candidate = SimpleNamespace(
        quantization_config={"quant_method": method, "bits": 4, "group_size": 8, **config}
    )
    return GptqFormat(candidate)


def test_gptq_packs_codes_down_the_inputs_and_stores_zero_points_minus_one():
    qweight = np.array([[WORD]], dtype=np.int32)  # 8 inputs of 1 output
    qzeros = np.array([[7]], dtype=np.int32)  # stored 7: zero point 8
    scales = np.array([[0.5]], dtype=np.float16)
    weight = decode(fmt("gptq", sym=True), qweight, qzeros, scales, None)
    assert weight.shape == (1, 8)
    assert weight.tolist() == [[0.5 * (i - 8) for i in range(8)]]
    v2 = decode(fmt("gptq", sym=True, checkpoint_format="gptq_v2"), qweight, qzeros, scales, None)
    assert v2.tolist() == [[0.5 * (i - 7) for i in range(8)]]


def test_gptq_g_idx_picks_each_inputs_group():
    qweight = np.array([[WORD]] * 2, dtype=np.int32)  # 16 inputs, two groups of 8
    qzeros = np.array([[7], [7]], dtype=np.int32)
    scales = np.array([[1.0], [2.0]], dtype=np.float16)
    g_idx = np.array([1, 0] * 8)
    weight = decode(fmt("gptq", sym=True, desc_act=True), qweight, qzeros, scales, g_idx)
    codes = list(range(8)) * 2
    assert weight.tolist() == [[(1.0, 2.0)[g] * (q - 8) for q, g in zip(codes, g_idx, strict=True)]]


def test_awq_packs_outputs_in_its_interleaved_order_with_plain_zero_points():
    qweight = np.array([[WORD]], dtype=np.int32)  # 1 input of 8 outputs
    qzeros = np.array([[0x11111111]], dtype=np.int32)  # zero point 1 for every output
    scales = np.ones((1, 8), dtype=np.float16)
    weight = decode(fmt("awq", zero_point=True), qweight, qzeros, scales, None)
    assert weight.shape == (8, 1)
    # Nibble k holds output (0, 2, 4, 6, 1, 3, 5, 7)[k]: output j reads nibble (0, 4, 1, 5, 2, 6, 3, 7)[j].
    assert weight[:, 0].tolist() == [c - 1 for c in (0, 4, 1, 5, 2, 6, 3, 7)]
