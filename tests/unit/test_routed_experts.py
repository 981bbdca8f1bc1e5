"""A streamed decoding's routed experts (`evalsuite.backends.routed_experts`): read and fused by evalsuite,
they are the parameters Transformers' own loading makes of the same files, bit for bit (BF16 experts and the
seed's INT4 pack-quantized ones, decompressed by the library in one call per parameter); kept across steps,
they change no answer, and the cache says what it saved."""

from __future__ import annotations

import pytest
import torch

from evalsuite.backends import load_backend
from evalsuite.backends.decoded_cache import DecodedCache
from evalsuite.backends.options import BackendOptions
from evalsuite.backends.streamed import StreamedBackend
from evalsuite.backends.streamed_layers import TransformersLayers
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import TINY_BF16, TINY_W4A8, build_fixtures
from evalsuite.fixtures.names import REAL_NARROW_W4A8
from tests.conftest import FIXTURES


def every_expert_both_ways(checkpoint: Checkpoint, layers: range | None = None) -> int:
    """Each layer's experts, all of them, read by evalsuite's reader and by Transformers' loading, compared;
    the count of layers compared."""
    loader = TransformersLayers(checkpoint, BackendOptions(stream=True))
    compared = 0
    for index in layers or range(len(loader.layers)):
        layout = loader._routed_layout(index)
        assert layout is not None and layout.reader is not None  # the plain conversion: read by evalsuite
        experts = sorted(layout.by_expert)
        loader._remember_compressed(index)
        module = loader.layers[index].get_submodule(layout.module)
        ours = layout.reader.read(experts, loader.device)
        theirs = loader._read_experts(module, layout.by_expert, experts)
        assert list(ours) == list(theirs) or sorted(ours) == sorted(theirs)
        for key, value in theirs.items():
            assert (ours[key].dtype, ours[key].shape) == (value.dtype, value.shape), key
            assert torch.equal(ours[key].view(torch.uint8), value.view(torch.uint8)), key
        loader.free_layer(index)
        compared += 1
    return compared


@pytest.mark.parametrize("side", [TINY_BF16, TINY_W4A8])
def test_experts_read_by_evalsuite_are_transformers_own_bit_for_bit(tiny_pair, side):
    assert every_expert_both_ways(Checkpoint.open(tiny_pair[side])) == 2


@pytest.mark.slow
def test_the_narrow_real_depth_packs_experts_read_by_evalsuite_are_transformers_own(tmp_path):
    """256 INT4 experts a layer, at the seed's depth: the first, a middle and the last layer."""
    built = build_fixtures(FIXTURES, [REAL_NARROW_W4A8])
    assert every_expert_both_ways(Checkpoint.open(built[REAL_NARROW_W4A8]), range(0, 40, 19)) == 3


def test_the_cache_keeps_the_least_recently_used_out_first_and_what_fits_only():
    rows = {"w": torch.zeros(4, dtype=torch.bfloat16)}  # 8 bytes
    cache = DecodedCache(budget=20)
    cache.keep(0, 1, rows, file_bytes=3)
    cache.keep(0, 2, rows, file_bytes=3)
    assert cache.take(0, 1) is not None  # expert 2 is now the least recently used
    cache.keep(1, 1, rows, file_bytes=3)  # over the budget: expert 2 goes
    assert cache.take(0, 2) is None and cache.take(1, 1) is not None and cache.take(0, 1) is not None
    cache.keep(0, 3, {"w": torch.zeros(16, dtype=torch.bfloat16)}, file_bytes=9)  # larger than the budget
    assert cache.take(0, 3) is None
    assert cache.figures() == {
        "budget_bytes": 20, "hits": 3, "misses": 2, "hit_rate": 0.6, "bytes_saved": 9,
    }  # fmt: skip
    kept = cache.take(0, 1)
    assert kept is not None and kept["w"] is not rows["w"]  # a copy: the step's rows are freed with it


@pytest.mark.parametrize("side", [TINY_BF16, TINY_W4A8])
def test_a_decoding_with_its_experts_kept_answers_as_without_and_as_loaded(tiny_pair, side):
    checkpoint = Checkpoint.open(tiny_pair[side])
    prompts = [
        {"input_ids": torch.tensor([[5, 17, 99, 3, 42, 7]])},
        {"input_ids": torch.tensor([[8, 1, 250]])},
    ]
    answers, figures, read = [], [], []
    for budget in (0, None):
        backend = StreamedBackend(checkpoint, BackendOptions(stream=True))
        if budget is not None:
            backend.loader.decoded_cache = DecodedCache(budget)
        answers.append([g.tokens for g in backend.generate_greedy_batch(prompts, [6, 6], 5, 0)])
        figures.append(backend.loader.decoded_cache.figures())
        read.append(backend.generation_bytes)
        backend.close()
    without, kept = figures
    assert answers[0] == answers[1]
    assert without["hits"] == 0 and without["bytes_saved"] == 0
    # Four experts, two a token: every later step finds what earlier ones read.
    assert kept["hits"] > 0 and kept["bytes_saved"] == read[0] - read[1] > 0
    assert kept["hits"] + kept["misses"] == without["misses"]
    loaded = load_backend(checkpoint, BackendOptions())
    assert answers[1] == [g.tokens for g in loaded.generate_greedy_batch(prompts, [6, 6], 5, 0)]
    loaded.close()
