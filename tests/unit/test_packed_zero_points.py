"""The meta skeleton of an asymmetric pack-quantized module, as evalsuite loads it, has the zero points' shape
and dtype that compressed-tensors' own compression writes to the files."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from evalsuite.backends.packed_zero_points import zero_points_packed_on_meta

ROWS, COLS, GROUP = 100, 128, 64  # 100 rows: the packed height rounds up (ceil(100 × 4 / 32) = 13)


def scheme(symmetric: bool, strategy: str) -> QuantizationScheme:
    args = QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=symmetric,
        strategy=strategy,
        group_size=GROUP if strategy == "group" else None,
    )
    return QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")


def state(groups: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn((ROWS, COLS), generator=g).to(torch.bfloat16)
    return {
        "weight": weight.to(device),
        "weight_scale": (torch.rand((ROWS, groups), generator=g) / 4 + 0.01).to(torch.bfloat16).to(device),
        "weight_zero_point": torch.randint(-8, 8, (ROWS, groups), generator=g, dtype=torch.int8).to(device),
    }


@pytest.mark.parametrize("strategy", ["group", "channel"])
def test_the_meta_skeleton_holds_the_zero_points_as_the_files_store_them(strategy):
    groups = COLS // GROUP if strategy == "group" else 1
    written = PackedQuantizationCompressor.compress(state(groups, "cpu"), scheme(False, strategy))
    with zero_points_packed_on_meta():
        skeleton = PackedQuantizationCompressor.compress(state(groups, "meta"), scheme(False, strategy))
    assert tuple(written["weight_zero_point"].shape) == (13, groups)
    for name, tensor in written.items():
        assert (tuple(skeleton[name].shape), skeleton[name].dtype) == (tuple(tensor.shape), tensor.dtype), (
            name
        )


def test_outside_the_load_and_for_symmetric_schemes_nothing_changes():
    original = PackedQuantizationCompressor.__dict__["compress"]
    with zero_points_packed_on_meta():
        symmetric = PackedQuantizationCompressor.compress(state(2, "meta"), scheme(True, "group"))
    assert "weight_zero_point" not in symmetric
    assert PackedQuantizationCompressor.__dict__["compress"] is original


def test_two_loads_in_two_threads_interleaved_leave_the_class_as_it_was():
    """Thread A enters, B enters, A leaves while B is still loading, then B leaves: B's load still sees the
    repair after A left, and the class ends with its own method (wrappers restored in the wrong order would
    leave one installed for good)."""
    import threading

    original = PackedQuantizationCompressor.__dict__["compress"]
    both_in, a_out = threading.Barrier(2), threading.Event()
    shapes: dict[str, tuple[int, ...]] = {}

    def load(name: str) -> None:
        with zero_points_packed_on_meta():
            both_in.wait()
            if name == "b":
                a_out.wait()
            skeleton = PackedQuantizationCompressor.compress(state(2, "meta"), scheme(False, "group"))
            shapes[name] = tuple(skeleton["weight_zero_point"].shape)
        if name == "a":
            a_out.set()

    threads = [threading.Thread(target=load, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert shapes == {"a": (13, 2), "b": (13, 2)}
    assert PackedQuantizationCompressor.__dict__["compress"] is original
