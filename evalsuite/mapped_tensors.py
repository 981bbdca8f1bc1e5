"""Tensors handed to Transformers' loader as private mappings of their own bytes in a shard, one mapping per
tensor.

Why a mapping per tensor: Transformers converts most of what it reads (a MoE layer's per-expert tensors fused
into one, a compressed-tensors module decompressed) and frees the read tensor at once. Read into memory of its
own, every such tensor costs a fresh allocation, a page fault per page and a copy; mapped, it costs a mapping
of pages already in the page cache, gone again with the tensor (bench/ppl.py measures the whole run on the
real shape's wide pair). Unlike mapping whole shards, as Transformers does given a folder, nothing outlives
its tensor: a shard's pages count in resident memory only while a tensor of them is alive, so a load peaks
at its model and the layer being converted, not at its model plus its files.

A tensor Transformers keeps as it was read (an unconverted parameter in its stored dtype: embeddings, norms,
a BF16 model's attention) stays a mapping of the file, as llama.cpp's models run from theirs: its pages are
read when the forward first touches them, and the kernel may drop and read them again under memory pressure
instead of keeping a second copy. Copying them after the load was measured instead: seconds of page faults
on the wide pair for nothing the run uses. The mappings are copy-on-write (`ACCESS_COPY`): nothing written to
a tensor reaches the checkpoint. The one risk a copy would not carry: a shard truncated in place while a run
holds its model ends the process with SIGBUS (a file replaced by a rename, as downloads do, is not).
"""

from __future__ import annotations

import mmap
import os
from typing import TYPE_CHECKING, Any

from evalsuite.errors import InputError
from evalsuite.safetensors_files import TensorInfo

if TYPE_CHECKING:
    import torch

# safetensors' dtype names as torch dtypes, for the tensors mapped in their own storage.
_TORCH_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8", "I16": "int16",
    "I32": "int32", "I64": "int64", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}  # fmt: skip


class MappedRead:
    """A safetensors slice whose whole read (`handle[...]`, what Transformers' loader asks) is the tensor's
    own private mapping of its bytes (module docstring); any other index, and everything else, is the
    slice's."""

    def __init__(self, inner: Any, fd: int, info: TensorInfo) -> None:
        self._inner, self._fd, self._info = inner, fd, info

    def __getitem__(self, index: Any) -> torch.Tensor:
        import torch

        info = self._info
        dtype_name = _TORCH_DTYPES.get(info.dtype)
        if index is not Ellipsis or dtype_name is None:
            return self._inner[index]
        dtype = getattr(torch, dtype_name)
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        # The header was checked against the file's size when the checkpoint was opened; a file cut short
        # since would turn a read of the mapping into a signal, so its size is asked again here.
        if os.fstat(self._fd).st_size < info.data_end:
            raise InputError(f"shard ends inside tensor {info.name!r} (cut short since opened)", info.shard)
        start = info.data_begin - info.data_begin % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(self._fd, info.data_end - start, access=mmap.ACCESS_COPY, offset=start)
        # The tensor holds the mapping: it is unmapped when the tensor's storage is freed.
        tensor = torch.frombuffer(mapping, dtype=dtype, count=info.numel, offset=info.data_begin - start)
        return tensor.view(info.shape)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
