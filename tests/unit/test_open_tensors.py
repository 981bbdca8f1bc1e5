"""`Checkpoint.open_tensors`: the handles Transformers' loader reads a model through give, for every tensor
of a checkpoint and every dtype it holds, the bytes safetensors reads; a whole read is a private mapping of
the tensor's bytes, a partial index goes through safetensors' own slice."""

import shutil

import pytest
import torch

from evalsuite.checkpoint import Checkpoint
from evalsuite.errors import InputError
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


def test_writing_to_a_mapped_tensor_leaves_the_shard_as_it_was(tiny_pair, tmp_path):
    folder = shutil.copytree(tiny_pair[TINY_W4A8], tmp_path / "copy")
    checkpoint = Checkpoint.open(folder)
    name = next(n for n, info in checkpoint.tensors.items() if info.dtype == "BF16" and info.nbytes > 4096)
    before = checkpoint.read_bytes(name)
    with checkpoint.open_tensors([name]) as handles:
        tensor = handles[name][...]
    tensor.fill_(3.0)  # copy-on-write: the page written becomes the process's own
    assert torch.all(tensor == 3.0)
    assert checkpoint.read_bytes(name) == before


def test_a_shard_cut_short_after_opening_is_refused_by_name(tiny_pair, tmp_path):
    folder = shutil.copytree(tiny_pair[TINY_W4A8], tmp_path / "copy")
    checkpoint = Checkpoint.open(folder)
    info = max(checkpoint.tensors.values(), key=lambda i: i.data_end)
    with checkpoint.open_tensors([info.name]) as handles:
        with info.shard.open("r+b") as fh:
            fh.truncate(info.data_end - 1)
        with pytest.raises(InputError, match=f"shard ends inside tensor {info.name!r}"):
            handles[info.name][...]
