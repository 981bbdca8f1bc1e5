"""compressed-tensors modules decompressed together (`evalsuite.formats.ct_batch`) against the library's own
`decompress_module`, one module at a time: the same parameters, bit for bit, on every scheme llm-compressor
writes (its packs of the tiny Llama), on the seed's W4A8 layout (the tiny MiniCPM-V 4.7), and on the layouts
that cannot be concatenated (a tensor's one scale, block scales, zero points packed down an odd number of
rows), written by the library's own compressors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from evalsuite.backends.options import BackendOptions
from evalsuite.backends.streamed_layers import TransformersLayers
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import TINY_W4A8, build_fixtures
from evalsuite.fixtures.names import REAL_NARROW_W4A8
from evalsuite.formats.ct_batch import decompress_modules, decompress_together
from tests.conftest import FIXTURES

LLMC_SCHEMES = [
    "w4a8-gptq",
    "w4a8-g64",
    "w4a16-asym-g64",
    "w8a8",
    "w8a16",
    "fp8-dynamic",
    "nvfp4a16",
    "mxfp4a16",
]


def assert_same_parameters(ours: nn.Module, theirs: nn.Module) -> None:
    """Every parameter and buffer of every module: the same names, dtypes, shapes and bits."""
    a = dict(ours.named_parameters()) | dict(ours.named_buffers())
    b = dict(theirs.named_parameters()) | dict(theirs.named_buffers())
    assert list(a) == list(b)
    for name, value in a.items():
        other = b[name]
        assert (value.dtype, value.shape) == (other.dtype, other.shape), name
        if value.is_meta:
            continue
        assert torch.equal(value.view(torch.uint8), other.view(torch.uint8)), name
    for (name, module), other in zip(ours.named_modules(), theirs.modules(), strict=True):
        assert getattr(module, "quantization_status", None) == getattr(other, "quantization_status", None), (
            name
        )


def each_layer_both_ways(checkpoint: Checkpoint, layers: range | None = None) -> int:
    """Each decoder layer (of `layers`) read compressed, as the streamed loader reads it, then decompressed
    both ways and compared; the count of quantized modules seen."""
    from compressed_tensors.compressors import decompress_module
    from compressed_tensors.quantization.utils import is_module_quantized

    loader = TransformersLayers(checkpoint, BackendOptions(stream=True))
    fmt = loader.compressor.force_compression_format
    seen = 0
    for index in layers or range(len(loader.layers)):
        skeleton = copy.deepcopy(loader.layers[index])
        loader._load(loader.units[index])
        ours = loader.layers[index]
        theirs = copy.deepcopy(ours)
        quantized = [m for m in theirs.modules() if is_module_quantized(m)]
        seen += len(quantized)
        for module in quantized:
            decompress_module(module, fmt)
        decompress_modules([m for m in ours.modules() if is_module_quantized(m)], fmt)
        assert_same_parameters(ours, theirs)
        loader.layers[index] = skeleton
    return seen


@pytest.mark.parametrize("scheme", LLMC_SCHEMES)
def test_llmcompressor_packs_decompress_together_as_the_library_does_module_by_module(llmc_tiny, scheme):
    assert each_layer_both_ways(Checkpoint.open(llmc_tiny["tiny-llama-llmc"] / scheme)) > 0


def test_the_seed_layout_decompresses_together_as_the_library_does_module_by_module(tiny_pair):
    # INT4 pack-quantized attention and INT8 int-quantized shared experts (the routed ones are fused experts,
    # `tests/unit/test_routed_experts.py`).
    assert each_layer_both_ways(Checkpoint.open(tiny_pair[TINY_W4A8])) > 0


@pytest.mark.slow
def test_the_narrow_real_depth_pack_decompresses_together_as_the_library_does_module_by_module():
    """Gated DeltaNet and full-attention layers at the seed's depth: layers 0, 13, 26 and 39."""
    built = build_fixtures(FIXTURES, [REAL_NARROW_W4A8])
    # INT4 in_proj_qkv / in_proj_z / out_proj or q / k / v / o, INT8 shared experts: 6 or 7 a layer.
    assert each_layer_both_ways(Checkpoint.open(built[REAL_NARROW_W4A8]), range(0, 40, 13)) >= 4 * 6


def written(
    fmt: str, weights: dict, rows: list[int], cols: int = 64, seed: int = 0
) -> tuple[object, list[dict]]:
    """Modules of `rows` output rows compressed by the library's own compressor of `fmt` (their scales and
    zero points computed by the library from random weights): the scheme and each one's state dict."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format=fmt)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    gen = torch.Generator().manual_seed(seed)
    states = []
    for r in rows:
        weight = torch.randn((r, cols), generator=gen, dtype=torch.float32).to(torch.bfloat16)
        if args.strategy == "tensor":
            low, high = weight.float().amin().reshape(1), weight.float().amax().reshape(1)
        elif args.strategy == "block":
            bh, bw = args.block_structure
            padded = torch.nn.functional.pad(weight.float(), (0, 0, 0, -r % bh))  # the library pads so
            blocks = padded.reshape(-1, bh, cols // bw, bw).transpose(1, 2)
            low, high = blocks.amin(dim=(-1, -2)), blocks.amax(dim=(-1, -2))
        elif args.strategy == "group":
            groups = weight.float().reshape(r, -1, args.group_size)
            low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        else:
            low, high = weight.float().amin(dim=1, keepdim=True), weight.float().amax(dim=1, keepdim=True)
        scale, zero_point = calculate_qparams(low, high, args)
        state = {"weight": weight, "weight_scale": scale.to(torch.bfloat16)}
        if not args.symmetric:
            state["weight_zero_point"] = zero_point
        states.append(compressor.compress(state, scheme))
    return scheme, states


# case → (format, quantization arguments, each module's rows, whether they decompress in one call)
WRITTEN = {
    "int4 channel": ("pack-quantized", {"num_bits": 4, "strategy": "channel"}, [16, 24, 8], True),
    "int4 tensor": ("pack-quantized", {"num_bits": 4, "strategy": "tensor"}, [16, 24, 8], True),
    "int4 asymmetric channel, odd rows": (
        "pack-quantized", {"num_bits": 4, "strategy": "channel", "symmetric": False}, [16, 13, 8], False,
    ),
    "int4 asymmetric group": (
        "pack-quantized", {"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False},
        [16, 24], True,
    ),
    "int8 tensor": ("int-quantized", {"num_bits": 8, "strategy": "tensor"}, [16, 24], True),
    "fp8 block": (
        "float-quantized", {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [8, 32]},
        [16, 24, 8], True,
    ),
    "fp8 block, rows short of a block": (
        "float-quantized", {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [16, 32]},
        [16, 24], False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(WRITTEN))
def test_written_layouts_decompress_together_as_the_library_does_module_by_module(case):
    fmt, weights, rows, batched = WRITTEN[case]
    from compressed_tensors.compressors import BaseCompressor

    scheme, states = written(fmt, weights, rows)
    together = decompress_together(fmt, scheme, states)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    for state, ours in zip(states, together.states, strict=True):
        theirs = compressor.decompress(dict(state), scheme)
        assert list(ours) == list(theirs)
        for key, value in theirs.items():
            assert value.dtype == ours[key].dtype and value.shape == ours[key].shape, key
            assert torch.equal(value.view(torch.uint8), ours[key].view(torch.uint8)), key
    assert torch.equal(together.weight, torch.cat([s["weight"] for s in together.states]))
    # Decompressed in one call, each module's weight is a view of its rows of the one result.
    shared = (
        together.states[-1]["weight"].untyped_storage().data_ptr()
        == together.weight.untyped_storage().data_ptr()
    )
    assert shared == batched
