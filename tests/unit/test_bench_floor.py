"""bench/floor.py: the floor a streamed forward's bytes and arithmetic set, by hand on made-up rates, and its
rates measured (each positive, the matmul's counted two operations per multiply-add)."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.conftest import bench_module

CONFIG = {"hidden_size": 64, "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def floor() -> ModuleType:
    return bench_module("floor")


def test_a_token_goes_through_all_but_the_routed_experts_it_does_not_use(floor):
    expert = 3 * 64 * 16
    layer_bytes = 2 * (1000 + 8 * expert)  # 1,000 parameters besides the experts, in BF16
    assert floor.active_parameters(layer_bytes, CONFIG) == 1000 + 2 * expert


def test_the_floor_is_its_three_parts_in_sequence(floor):
    rates = {
        "read_bytes_per_second": 2e9,
        "write_bytes_per_second": 10e9,
        "matmul_flops_per_second": {"decoding": 20e9, "window": 40e9},
    }
    f = floor.floor_seconds(rates, read=4e9, written=5e9, tokens=32, parameters=1e9, shape="decoding")
    assert f == {"seconds": 2.0 + 0.5 + 3.2, "read": 2.0, "write": 0.5, "matmul": 3.2}
    window = floor.floor_seconds(rates, read=0, written=0, tokens=32, parameters=1e9, shape="window")
    assert window["matmul"] == 1.6 and window["seconds"] == 1.6


def test_the_rates_are_measured_on_this_machine(floor, tmp_path):
    assert floor.page_cache_read_rate(4 << 20, tmp_path) > 0 and list(tmp_path.iterdir()) == []
    assert floor.bf16_write_rate(4 << 20) > 0
    assert floor.matmul_rate(4, 64, 16) > 0
