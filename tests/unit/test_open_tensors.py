"""`Checkpoint.open_tensors`: the handles Transformers' loader reads a model through give, for every tensor
of a checkpoint and every dtype it holds, the bytes safetensors reads; a whole read goes straight into the
tensor's storage, a partial index through safetensors' own slice."""

import torch

from evalsuite.checkpoint import Checkpoint
from evalsuite.fixtures import TINY_W4A8


def test_every_handle_reads_what_safetensors_reads(tiny_pair):
    checkpoint = Checkpoint.open(tiny_pair[TINY_W4A8])
    dtypes = set()
    with checkpoint.open_tensors(checkpoint.tensors) as handles:
        for name, info in checkpoint.tensors.items():
            whole = handles[name][...]
            expected = checkpoint.read_tensor(name)
            assert whole.dtype == expected.dtype and whole.shape == expected.shape, name
            assert torch.equal(whole.view(torch.uint8), expected.view(torch.uint8)), name
            if whole.dim() and whole.shape[0] > 1:
                assert torch.equal(handles[name][1:2], expected[1:2]), name
            assert handles[name].get_shape() == list(info.shape)
            dtypes.add(info.dtype)
    assert {"BF16", "I32"} <= dtypes  # the bf16 tensors and the packed int4 words at least
