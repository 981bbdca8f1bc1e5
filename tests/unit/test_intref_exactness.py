"""Exactness of the integer path, layer by layer, against an independent float64 emulation of the same math.

The emulation shares no code with `evalsuite.backends._intlinear`: weights are decoded from the checkpoint
files by compressed-tensors' own `unpack_from_int32`, activations are quantized in numpy float64 with explicit
FP32 roundings where the convention has them (a float64 division rounded once to FP32 is the correctly
rounded FP32 division, since 53 >= 2 × 24 + 2), and the product is a float64 matmul, exact because every
partial sum is an integer below 2^53. The INT32 accumulators must be equal, the FP32 outputs within 1e-6
relative of the exact float64 ones. The inputs include rows whose values fall exactly half-way between two
integers after scaling, so the divisor and the rounding mode both show in the accumulators: a wrong
convention fails these tests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from evalsuite.backends._intlinear import (
    MAX_IN_FEATURES,
    ActivationQuant,
    IntExperts,
    IntLinear,
    int_matmul,
    unpack_int4,
)
from evalsuite.backends.intref import IntrefBackend
from evalsuite.backends.options import BackendOptions
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures.llmcompressor_packs import INTEGER_PACKS
from tests.conftest import llmc_fixture

CARD = ActivationQuant(divisor=127.5, rounding="half_even")  # the convention of the MiniCPM-V 4.7 card
ROWS = 48


def activations(in_features: int, seed: int) -> torch.Tensor:
    """bf16 rows of varied magnitude, one row of zeros, and rows that scale to exact .5 ties under 127.5.

    A tie row holds 255 and odd integers up to ±253: its scale is 255 / 127.5 = 2 exactly, so x / s is k + 0.5
    and the rounding mode decides; under divisor 127 the same row has no ties but other integers.
    """
    g = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-3, 3, ROWS - 4)[:, None]
    x = torch.randn((ROWS - 4, in_features), generator=g) * magnitudes
    ties = torch.randint(-127, 127, (3, in_features), generator=g) * 2 + 1
    ties[:, 0] = 255
    zeros = torch.zeros((1, in_features))
    return torch.cat([x, ties.float(), zeros]).to(torch.bfloat16)


def emulate(x: torch.Tensor, w: np.ndarray, w_scale: np.ndarray, act: ActivationQuant) -> tuple:
    """(accumulator int64, output float64) of the integer convention, in numpy float64."""
    xd = x.float().numpy().astype(np.float64)  # bf16 → float64 is exact
    scale = (np.abs(xd).max(axis=1) / act.divisor).astype(np.float32).astype(np.float64)
    r = (xd / np.where(scale > 0, scale, 1.0)[:, None]).astype(np.float32).astype(np.float64)
    # numpy rounds half to even; |r| + 0.5 is exact in float64 for |r| <= 128.
    q = np.round(r) if act.rounding == "half_even" else np.sign(r) * np.floor(np.abs(r) + 0.5)
    q = np.clip(q, -128, 127)
    acc = q @ w.astype(np.float64).T
    return acc.astype(np.int64), acc * scale[:, None] * w_scale.reshape(1, -1)


def file_weights(checkpoint: Checkpoint, module: str, layer: IntLinear) -> tuple[np.ndarray, np.ndarray]:
    """A layer's integer weights and scales decoded from the files by compressed-tensors, not by evalsuite."""
    scale = checkpoint.read_tensor(f"{module}.weight_scale").double().numpy()
    if layer.bits == 4:
        packed = checkpoint.read_tensor(f"{module}.weight_packed")
        shape = torch.Size((layer.out_features, layer.in_features))
        return unpack_from_int32(packed, 4, shape).numpy(), scale
    return checkpoint.read_tensor(f"{module}.weight").numpy(), scale


def mismatches(layer: IntLinear, checkpoint: Checkpoint, module: str, emulated: ActivationQuant, seed: int):
    """(accumulators that differ, worst relative output error, whether forward == FP32 output cast)."""
    x = activations(layer.in_features, seed)
    acc, y = layer.run(x)
    w, w_scale = file_weights(checkpoint, module, layer)
    acc_ref, y_ref = emulate(x, w, w_scale, emulated)
    differ = int((acc.numpy().astype(np.int64) != acc_ref).sum())
    y64 = y.double().numpy()
    denom = np.where(y_ref != 0, np.abs(y_ref), 1.0)
    rel = float((np.abs(y64 - y_ref) / denom).max())
    cast_ok = torch.equal(layer(x), y.to(layer.out_dtype))
    return differ, rel, cast_ok


def integer_layers(backend: IntrefBackend) -> dict[str, IntLinear]:
    """Every integer Linear of the model (routed expert projections included), by the checkpoint's name."""
    return {name: m for name, m in backend.model.named_modules() if isinstance(m, IntLinear)}


@pytest.fixture(scope="module")
def tiny_intref(tiny_pair):
    checkpoint = Checkpoint.open(tiny_pair["tiny-minicpmv47-w4a8"])
    backend = IntrefBackend(
        checkpoint, BackendOptions().with_backend("intref", {"divisor": 127.5, "rounding": "half_even"})
    )
    yield checkpoint, backend
    backend.close()


def test_every_tiny_layer_and_expert_projection_is_exact(tiny_intref):
    checkpoint, backend = tiny_intref
    layers = integer_layers(backend)
    # 14 Linear layers + 2 MoE layers x 4 experts x 3 projections, each checked.
    assert len(layers) == 14 + 2 * 4 * 3
    assert {m.bits for m in layers.values()} == {4, 8}
    for i, (name, layer) in enumerate(layers.items()):
        differ, rel, cast_ok = mismatches(layer, checkpoint, name, CARD, seed=i)
        assert differ == 0, f"{name}: {differ} accumulators differ"
        assert rel <= 1e-6, f"{name}: output off by {rel:.3g} relative"
        assert cast_ok, name


def test_integer_layers_match_compressed_tensors_fake_quantization(tiny_pair, tiny_intref):
    """The card's convention is compressed-tensors' own: Transformers' FP32 execution of each quantized Linear
    (weights decompressed, activations fake-quantized per token) gives the integer layer's output."""
    from transformers import AutoModelForImageTextToText

    _, backend = tiny_intref
    hf = AutoModelForImageTextToText.from_pretrained(tiny_pair["tiny-minicpmv47-w4a8"], dtype=torch.float32)
    with torch.no_grad():  # compressed-tensors decompresses at the first call
        hf(input_ids=torch.zeros((1, 1), dtype=torch.long))
    layers = {n: m for n, m in integer_layers(backend).items() if ".experts." not in n}
    assert len(layers) == 14
    for i, (name, layer) in enumerate(layers.items()):
        x = activations(layer.in_features, seed=i)
        _, y = layer.run(x)
        with torch.no_grad():
            # 3-D: compressed-tensors reads "per token" along the last axis of (batch, tokens, features).
            y_hf = hf.get_submodule(name)(x.float()[None])[0]
        assert torch.allclose(y, y_hf, rtol=1e-5, atol=1e-6 * float(y_hf.abs().max())), name


@pytest.mark.slow
def test_every_smollm2_layer_is_exact(smollm2_pair):
    checkpoint = Checkpoint.open(smollm2_pair["smollm2-135m-w4a8"])
    backend = IntrefBackend(
        checkpoint, BackendOptions().with_backend("intref", {"divisor": 127.5, "rounding": "half_even"})
    )
    try:
        layers = integer_layers(backend)
        assert len(layers) == 30 * 7  # INT8 q/k/v/o and INT4 gate/up/down in each of 30 layers
        worst = 0.0
        for i, (name, layer) in enumerate(layers.items()):
            differ, rel, cast_ok = mismatches(layer, checkpoint, name, CARD, seed=i)
            assert differ == 0, f"{name}: {differ} accumulators differ"
            assert cast_ok, name
            worst = max(worst, rel)
        assert worst <= 1e-6
    finally:
        backend.close()


@pytest.mark.parametrize(
    "wrong",
    [ActivationQuant(127.0, "half_even"), ActivationQuant(127.5, "half_away_from_zero")],
    ids=["divisor-127", "ties-away-from-zero"],
)
def test_a_wrong_activation_convention_changes_the_accumulators(tiny_intref, wrong):
    """The test above can fail: the same layer run with another convention disagrees with the card's."""
    checkpoint, backend = tiny_intref
    name, layer = next((n, m) for n, m in integer_layers(backend).items() if m.bits == 4)
    layer.act = wrong
    try:
        differ, _, _ = mismatches(layer, checkpoint, name, CARD, seed=0)
        assert differ > 0
        # ...and matches an emulation of its own convention: both are exact, the divisor is a parameter.
        assert mismatches(layer, checkpoint, name, wrong, seed=0)[:2] == (0, pytest.approx(0, abs=1e-6))
    finally:
        layer.act = CARD


def test_int4_unpacking_matches_compressed_tensors_for_any_width():
    g = torch.Generator().manual_seed(0)
    for in_features in (8, 36, 61, 576):
        q = torch.randint(-8, 8, (5, in_features), generator=g, dtype=torch.int8)
        packed = pack_to_int32(q, 4)
        assert packed.shape == (5, (in_features + 7) // 8)
        assert torch.equal(unpack_int4(packed, in_features), q)


def test_int32_accumulation_is_exact_at_the_extremes():
    """Worst-case products (−128 × −128 and −128 × 127) over the longest K the loader accepts."""
    k = MAX_IN_FEATURES
    q = torch.full((17, k), -128, dtype=torch.int8)
    w = torch.stack([torch.full((k,), -128, dtype=torch.int8), torch.full((k,), 127, dtype=torch.int8)])
    acc = int_matmul(q, w)
    assert acc.dtype == torch.int32
    assert acc[:, 0].tolist() == [k * 128 * 128] * 17 and acc[:, 1].tolist() == [-k * 128 * 127] * 17


def test_experts_reduce_in_fp32_in_expert_order_whatever_the_batch(tiny_intref):
    """A batch through IntExperts equals each token alone, summed over its experts in index order."""
    _, backend = tiny_intref
    experts = next(m for m in backend.model.modules() if isinstance(m, IntExperts))
    g = torch.Generator().manual_seed(1)
    tokens, hidden = 40, experts.experts()[0].gate_proj.in_features
    x = (torch.randn((tokens, hidden), generator=g) * 3).to(torch.bfloat16)
    index = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand((tokens, 2), generator=g).to(torch.bfloat16)
    batched = experts(x, index, weights)
    # Another batch order gives every token the same bits: the reduction does not depend on the batch.
    order = torch.randperm(tokens, generator=g)
    assert torch.equal(experts(x[order], index[order], weights[order])[order.argsort()], batched)
    for t in range(tokens):
        total = torch.zeros((1, hidden), dtype=torch.float32)
        for slot in sorted(range(2), key=lambda s: int(index[t, s])):
            expert = experts.experts()[int(index[t, slot])]
            gate = expert.gate_proj(x[t : t + 1])
            up = expert.up_proj(x[t : t + 1])
            _, y = expert.down_proj.run(experts.act_fn(gate) * up)
            total += y * weights[t, slot].float()
        assert torch.equal(batched[t : t + 1], total.to(torch.bfloat16)), t


# ----------------------------------------------------------------------------------------------------------
# Packs written by llm-compressor: per-group scales, zero points, INT4 values in int8 storage, packed INT8
# ----------------------------------------------------------------------------------------------------------


def file_integers(
    checkpoint: Checkpoint, module: str, layer: IntLinear
) -> tuple[np.ndarray, np.ndarray | None]:
    """A layer's integer weights and zero points decoded from the files by compressed-tensors' own unpacking
    (zero points are packed along the rows), not by evalsuite."""
    shape = torch.Size((layer.out_features, layer.in_features))
    if layer.storage == "packed":
        w = unpack_from_int32(checkpoint.read_tensor(f"{module}.weight_packed"), layer.bits, shape).numpy()
    else:
        w = checkpoint.read_tensor(f"{module}.weight").numpy()
    if not layer.has_zero_point:
        return w, None
    zp = checkpoint.read_tensor(f"{module}.weight_zero_point")
    if layer.storage == "packed":
        groups = checkpoint.tensors[f"{module}.weight_scale"].shape[1]
        zp = unpack_from_int32(zp, layer.bits, torch.Size((layer.out_features, groups)), packed_dim=0)
    return w, zp.numpy()


def emulate_groups(
    x: torch.Tensor, w: np.ndarray, zp, w_scale: np.ndarray, group_size: int, act: ActivationQuant
):
    """(per-group accumulators int64 (G, M, N), FP32-rounded output float64, exact output float64, the sum of
    the terms' magnitudes) of the group convention, in numpy: integers exact in float64, each FP32 rounding
    of the convention explicit (numpy float32 arithmetic is IEEE's)."""
    xd = x.float().numpy().astype(np.float64)
    scale = (np.abs(xd).max(axis=1) / act.divisor).astype(np.float32)
    r = (
        (xd / np.where(scale > 0, scale, 1.0)[:, None].astype(np.float64))
        .astype(np.float32)
        .astype(np.float64)
    )
    q = np.clip(np.round(r), -128, 127)
    groups = w_scale.shape[1]
    accs, y32 = [], np.zeros((x.shape[0], w.shape[0]), dtype=np.float32)
    exact, magnitude = np.zeros_like(y32, dtype=np.float64), np.zeros_like(y32, dtype=np.float64)
    for g in range(groups):
        cols = slice(g * group_size, (g + 1) * group_size)
        wg = w[:, cols].astype(np.float64)
        if zp is not None:
            wg = wg - zp[:, g : g + 1].astype(np.float64)
        acc = q[:, cols] @ wg.T
        accs.append(acc.astype(np.int64))
        y32 += (acc.astype(np.float32) * scale[:, None]) * w_scale[:, g].astype(np.float32)[None, :]
        term = acc * scale[:, None].astype(np.float64) * w_scale[:, g][None, :]
        exact += term
        magnitude += np.abs(term)
    return np.stack(accs), y32.astype(np.float64), exact, magnitude


@pytest.mark.parametrize(
    ("fixture", "scheme"),
    [("tiny", s) for s in ("w4a8-g64", "w4a16-asym-g64", "w4a8-gptq", "w8a16")]
    + [pytest.param("smollm2", s, marks=pytest.mark.slow) for s in INTEGER_PACKS],
)
def test_llmcompressor_integer_layers_are_exact(request, fixture, scheme):
    """Every integer layer of the pack: accumulators equal the float64 integers, the FP32 output equals the
    emulation of its roundings bit for bit and lies within 1e-6 of the exact sum (relative to its terms)."""
    _, packs = llmc_fixture(request, fixture)
    checkpoint = Checkpoint.open(packs / scheme)
    backend = IntrefBackend(checkpoint, BackendOptions().with_backend("intref", {"divisor": 127.5}))
    try:
        layers = integer_layers(backend)
        assert len(layers) == {"tiny": 2, "smollm2": 30}[fixture] * 7
        for i, (name, layer) in enumerate(layers.items()):
            x = activations(layer.in_features, seed=i)
            acc, y = layer.run(x)
            w, zp = file_integers(checkpoint, name, layer)
            w_scale = checkpoint.read_tensor(f"{name}.weight_scale").double().numpy()
            group_size = layer.group_size or layer.in_features
            acc_ref, y32, exact, magnitude = emulate_groups(x, w, zp, w_scale, group_size, CARD)
            acc = acc.numpy().reshape(acc_ref.shape) if acc.dim() == 3 else acc.numpy()[None]
            assert np.array_equal(acc.astype(np.int64), acc_ref), f"{name}: accumulators differ"
            assert np.array_equal(y.double().numpy(), y32), f"{name}: FP32 output differs from the emulation"
            assert (np.abs(y32 - exact) <= 1e-6 * magnitude + 1e-30).all(), name
    finally:
        backend.close()


def test_a_wrong_zero_point_changes_the_asymmetric_accumulators(llmc_tiny):
    """The test above can fail: the emulation with the zero points off by one disagrees."""
    checkpoint = Checkpoint.open(llmc_tiny["tiny-llama-llmc"] / "w4a16-asym-g64")
    backend = IntrefBackend(checkpoint, BackendOptions().with_backend("intref", {"divisor": 127.5}))
    try:
        name, layer = next(iter(integer_layers(backend).items()))
        x = activations(layer.in_features, seed=0)
        acc, _ = layer.run(x)
        w, zp = file_integers(checkpoint, name, layer)
        w_scale = checkpoint.read_tensor(f"{name}.weight_scale").double().numpy()
        acc_ref, *_ = emulate_groups(x, w, zp + 1, w_scale, layer.group_size, CARD)
        assert not np.array_equal(acc.numpy().astype(np.int64), acc_ref)
    finally:
        backend.close()
