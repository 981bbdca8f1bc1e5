"""Benchmark of a streamed decoding's unpacking: evalsuite's batched reads against the per-module ones they
replaced, and a W4A8 decoding forward against its BF16 source's, each pair measured in one run.

In one process, on the narrow real-depth W4A8 pack (256 experts a layer at the seed's depth) and the SmolLM2
pair (`--quick`: the tiny MiniCPM-V 4.7 pair), each the fastest of `--repeats`:

- `layer modules`: a decoder layer's compressed-tensors modules decompressed by compressed-tensors'
  `decompress_module`, one call per module (what a streamed read did), against `decompress_modules` (the rows
  of the modules stored alike in one call of the library's decompression, `evalsuite.formats.ct_batch`);
- `routed experts`: `--experts` experts of a MoE layer (a decoding step's share) read and fused by
  Transformers' loading (a converter copied per tensor, one `decompress_module` per expert projection) against
  evalsuite's `FusedReader`, which holds both equal bit for bit (tests/unit/test_routed_experts.py);
- `intref pass`: a streamed `intref` pass over two windows with each packed weight unpacked at every forward
  (as before) against once for the layer's residency, a MoE layer's experts together
  (`IntExperts.unpack_together`): the same logits, bit for bit (tests/e2e/test_streamed.py);
- `decoding forward`: the seconds per forward of a streamed greedy decoding of `--prompts` prompts, the W4A8
  side over its BF16 source (goal <= 1 on the SmolLM2 pair), with what a step converted kept across steps
  (`DecodedCache`) and without (a budget of 0).

These machines are shared and noisy: compare the figures of one run with each other. Single-threaded
(`torch.set_num_threads(1)`): a second thread only spins while other work holds the other core.

    python bench/unpack.py [--repeats N] [--experts N] [--prompts N] [--tokens N] [--quick] [--results DIR]
"""

from __future__ import annotations

import argparse
import copy
import functools
import time
from collections.abc import Callable
from pathlib import Path

import torch
from figures import add_arguments, fastest, recorded
from torch import nn

from evalsuite.backends._intlinear import IntLinear
from evalsuite.backends.decoded_cache import DecodedCache
from evalsuite.backends.options import BackendOptions
from evalsuite.backends.streamed import StreamedBackend
from evalsuite.backends.streamed_layers import IntegerLayers, TransformersLayers
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import TINY_BF16, TINY_W4A8, build_fixtures
from evalsuite.fixtures.names import REAL_NARROW_W4A8, SMOLLM2_BF16, SMOLLM2_W4A8
from evalsuite.formats.ct_batch import decompress_modules

FIXTURES = Path.home() / ".cache" / "evalsuite" / "test-fixtures"


def layer_modules(loader: TransformersLayers, index: int, repeats: int) -> tuple[float, float]:
    """(seconds one `decompress_module` per module, seconds together) for layer `index`'s modules, each the
    fastest of `repeats` decompressions of a fresh copy of the layer as read (the copies made beforehand)."""
    from compressed_tensors.compressors import decompress_module
    from compressed_tensors.quantization.utils import is_module_quantized

    fmt = loader.compressor.force_compression_format
    built = copy.deepcopy(loader.layers[index])
    loader._load(loader.units[index])
    read = loader.layers[index]
    loader.layers[index] = built

    def best(decompress: Callable[[list[nn.Module]], object]) -> float:
        copies = [copy.deepcopy(read) for _ in range(repeats + 1)]
        quantized = [[m for m in layer.modules() if is_module_quantized(m)] for layer in copies]
        return fastest(lambda: decompress(quantized.pop()), repeats)

    return best(lambda modules: [decompress_module(m, fmt) for m in modules]), best(
        lambda modules: decompress_modules(modules, fmt)
    )


def routed_experts(loader: TransformersLayers, index: int, experts: int, repeats: int) -> tuple[float, float]:
    """(seconds by Transformers' loading, seconds by `FusedReader`) for `experts` experts of layer `index`."""
    layout = loader._routed_layout(index)
    assert layout is not None and layout.reader is not None
    chosen = sorted(layout.by_expert)[:: max(1, len(layout.by_expert) // experts)][:experts]
    loader._remember_compressed(index)
    module = loader.layers[index].get_submodule(layout.module)
    transformers = fastest(lambda: loader._read_experts(module, layout.by_expert, chosen), repeats)
    ours = fastest(lambda: layout.reader.read(chosen, loader.device), repeats)
    loader.free_layer(index)
    return transformers, ours


def intref_pass(folder: Path, windows: int, once: bool) -> float:
    """Seconds of a streamed `intref` pass over `windows` windows of 128 tokens, each packed weight unpacked
    once for the layer's residency (`once`, as `IntegerLayers` reads a layer) or at every forward."""
    load = IntegerLayers.load_layer

    def per_forward_unpacking(self: IntegerLayers, index: int) -> None:
        load(self, index)
        for module in self.layers[index].modules():
            if isinstance(module, IntLinear):
                module.keep_unpacked = False
                module.drop_unpacked()

    backend = StreamedBackend(Checkpoint.open(folder), BackendOptions(stream=True, backend="intref"))
    if not once:
        backend.loader.load_layer = functools.partial(per_forward_unpacking, backend.loader)
    tokens = torch.randint(5, 400, (windows, 128), generator=torch.Generator().manual_seed(0))
    started = time.perf_counter()
    for _ in backend.window_logits(tokens, torch.arange(64, 127)):
        pass
    seconds = time.perf_counter() - started
    backend.close()
    return seconds


def per_forward(folder: Path, prompts: int, tokens: int, keep: bool) -> float:
    """Seconds per forward of a streamed greedy decoding of `prompts` prompts, `tokens` new tokens each."""
    backend = StreamedBackend(Checkpoint.open(folder), BackendOptions(stream=True))
    if not keep:
        backend.loader.decoded_cache = DecodedCache(0)
    generator = torch.Generator().manual_seed(0)
    batch = [{"input_ids": torch.randint(5, 400, (1, 12), generator=generator)} for _ in range(prompts)]
    started = time.perf_counter()
    backend.generate_greedy_batch(batch, [tokens] * prompts, 5, 0)
    seconds = (time.perf_counter() - started) / backend.generation_forwards
    backend.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="calls per measure; the fastest counts")
    parser.add_argument("--experts", type=int, default=64, help="experts of a layer read per step")
    parser.add_argument("--prompts", type=int, default=4, help="prompts decoded in one batch")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per prompt")
    add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.repeats, args.tokens = 1, 4
        moe, pair = TINY_W4A8, (TINY_BF16, TINY_W4A8)
    else:
        moe, pair = REAL_NARROW_W4A8, (SMOLLM2_BF16, SMOLLM2_W4A8)
    built = build_fixtures(FIXTURES, [moe, *pair])

    with recorded("unpack", __doc__, args) as figures:
        loader = TransformersLayers(Checkpoint.open(built[moe]), BackendOptions(stream=True))
        each, together = layer_modules(loader, 0, args.repeats)
        print(f"{moe}, layer 0's compressed modules: one call each {each * 1e3:.2f} ms, "
              f"together {together * 1e3:.2f} ms")  # fmt: skip
        figures.add(f"{moe}: a layer's modules, one call each / together", each / together, "x")
        transformers, ours = routed_experts(loader, 0, args.experts, args.repeats)
        print(f"{moe}, {args.experts} routed experts of layer 0: Transformers' loading "
              f"{transformers * 1e3:.1f} ms, evalsuite's reader {ours * 1e3:.1f} ms")  # fmt: skip
        figures.add(
            f"{moe}: {args.experts} experts, Transformers' loading / evalsuite's", transformers / ours, "x"
        )
        each, once = (min(intref_pass(built[moe], 2, o) for _ in range(args.repeats)) for o in (False, True))
        print(f"{moe}, a streamed intref pass over 2 windows: unpacking at every forward {each:.2f} s, "
              f"once a layer (experts together) {once:.2f} s")  # fmt: skip
        figures.add(f"{moe}: intref pass, unpacking at every forward / once a layer", each / once, "x")
        reference, candidate = (built[name] for name in pair)
        ref = per_forward(reference, args.prompts, args.tokens, keep=True)
        for keep in (False, True):
            ckpt = per_forward(candidate, args.prompts, args.tokens, keep=keep)
            kept = "kept" if keep else "not kept"
            print(f"{pair[1]} / {pair[0]}, seconds per decoding forward, converted weights {kept}: "
                  f"{ckpt:.3f} / {ref:.3f} = {ckpt / ref:.2f}")  # fmt: skip
            goal = "<= 1" if keep and not args.quick else None
            figures.add(f"{pair[1]} / {pair[0]} per decoding forward, {kept}", ckpt / ref, "x", goal=goal)


if __name__ == "__main__":
    main()
