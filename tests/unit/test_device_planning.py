"""Devices decided once, from the plan: a need that streams a side under `--device auto` runs on one device,
and on this CPU-only machine every CUDA and auto device is refused in one line before any model loads."""

from __future__ import annotations

import pytest
import torch

from evalsuite.backends.options import STREAMED_AUTO_DEVICE, BackendOptions
from evalsuite.errors import DependencyError
from evalsuite.observers.boundary_states import BoundaryStates
from evalsuite.observers.window_logits import WindowLogits, WindowProtocol
from evalsuite.pipeline.plan import side_options
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import Need


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "auto"])
def test_a_streamed_need_runs_on_one_device_whatever_the_side_runs_on(device):
    # The bug: `--device auto` passed the check (no --stream), then a `moe` or `layers` need streamed the side
    # and the streamed backend ran torch.device("auto"): exit 3.
    side = Side("ref", BackendOptions(device=device))
    options = side_options(side, Need("ref", "ref", BoundaryStates(WindowProtocol()), streamed=True))
    assert options.stream
    assert options.device == (STREAMED_AUTO_DEVICE if device == "auto" else device)
    torch.device(options.device)  # a device torch accepts, not "auto"
    loaded = side_options(side, Need("ref", "ref", WindowLogits(WindowProtocol())))
    assert not loaded.stream and loaded.device == device


def test_stream_with_device_auto_streams_on_the_first_gpu_rather_than_refusing():
    assert BackendOptions(device="auto", stream=True).streamed().device == STREAMED_AUTO_DEVICE


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "auto"])
def test_without_cuda_every_cuda_and_auto_device_is_refused_before_anything_loads(device):
    for stream in (False, True):
        with pytest.raises(DependencyError, match="needs CUDA"):
            BackendOptions(device=device, stream=stream).check()
