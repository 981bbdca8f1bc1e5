"""`Checkpoint.open_tensors`: the handles Transformers' loader reads a model through give, for every tensor
of a checkpoint and every dtype it holds, the bytes safetensors reads; a whole read is a view of its shard's
one private mapping, whose pages are handed back as each tensor is freed; a partial index is a copy, as
safetensors' own slice gives it."""

import gc
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from evalsuite.errors import DependencyError, InputError
from evalsuite.files.checkpoint import Checkpoint
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
        with pytest.raises(InputError, match=r"changed while evalsuite ran \(cut short: "):
            handles[info.name][...]


def _shard(folder: Path, tensors: dict[str, torch.Tensor]) -> Checkpoint:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return Checkpoint.open(folder)


def _shard_rss_kib(shard: Path) -> int:
    """Resident KiB of this process's mappings of `shard` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.endswith(str(shard))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


LINUX_PROC = pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads Linux's /proc/self")


@LINUX_PROC
def test_a_freed_tensors_pages_leave_resident_memory_while_its_neighbours_stay_mapped(tmp_path):
    checkpoint = _shard(
        tmp_path / "ckpt",
        {"a": torch.ones(1024, dtype=torch.float32), "b": torch.ones(16 << 20, dtype=torch.uint8)},
    )
    shard = checkpoint.shards[0]
    with checkpoint.open_tensors(["a", "b"]) as handles:
        a, b = handles["a"][...], handles["b"][...]
    assert int(b.sum()) == 16 << 20  # every page of b read
    assert _shard_rss_kib(shard) >= 16 << 10
    del b
    gc.collect()
    # b's pages are gone from the mapping that a still holds: at most the page b shared with a stays.
    assert _shard_rss_kib(shard) <= 16
    assert float(a.sum()) == 1024


def test_a_tensor_read_twice_keeps_what_was_written_to_one_read_when_the_other_is_freed(tmp_path):
    checkpoint = _shard(tmp_path / "ckpt", {"w": torch.zeros(1 << 20, dtype=torch.float32)})
    with checkpoint.open_tensors(["w"]) as handles:
        first, second = handles["w"][...], handles["w"][...]
    second.fill_(3.0)  # copy-on-write: these pages are the process's own now, shared by both reads
    del first
    gc.collect()
    assert torch.all(second == 3.0)


@LINUX_PROC
def test_a_hundred_thousand_tensors_are_one_mapping_and_two_descriptors_under_a_limit_of_64(tmp_path):
    n = 100_000
    _shard(tmp_path / "ckpt", {f"t{i:06d}": torch.full((2,), i, dtype=torch.float32) for i in range(n)})
    # In a process of its own, as a user's shell would start it: at most 64 open files.
    script = f"""
import os, resource
from pathlib import Path
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from evalsuite.files.checkpoint import Checkpoint
checkpoint = Checkpoint.open({str(tmp_path / "ckpt")!r})
with checkpoint.open_tensors(checkpoint.tensors) as handles:
    kept = [handles[name][...] for name in checkpoint.tensors]
assert all(int(t[1]) == i for i, t in enumerate(kept))
shard = str(checkpoint.shards[0])
maps = sum(line.endswith(shard) for line in Path("/proc/self/maps").read_text().splitlines())
files = sum(os.path.realpath(f"/proc/self/fd/{{fd}}") == shard for fd in os.listdir("/proc/self/fd"))
print(len(kept), maps, files)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(n), "1", "2"]


def test_a_big_endian_host_is_refused_in_one_line(tiny_pair, monkeypatch):
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(DependencyError, match="this host is big-endian") as caught:
        Checkpoint.open(tiny_pair[TINY_W4A8])
    assert "\n" not in str(caught.value)
