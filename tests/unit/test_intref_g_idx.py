"""The integer path with a group index (`weight_g_idx`, GPTQ's `actorder: "group"`): each column is scaled by
its own group's scale, exactly, whatever order the groups' columns are scattered in; a g_idx that does not
give every group its columns is refused; a config carrying the removed `actorder: "group"` is still read."""

from __future__ import annotations

import pytest
import torch

from evalsuite.backends._intlinear import ActivationQuant, IntLinear, quantize_activations
from evalsuite.formats.compressed_tensors import SchemeLookup, readable_config

ACT = ActivationQuant(divisor=127.5, rounding="half_even")


def layer_with_g_idx(g_idx: torch.Tensor, seed: int = 0) -> tuple[IntLinear, torch.Tensor, torch.Tensor]:
    """An INT4 group-64 IntLinear of 192 inputs, its int8 weights and bf16 scales, with `g_idx` loaded."""
    g = torch.Generator().manual_seed(seed)
    out_features, in_features = 24, g_idx.numel()
    layer = IntLinear(
        in_features, out_features, 4, ACT, torch.float32, group_size=64, storage="int8", g_idx=True
    )
    w = torch.randint(-8, 8, (out_features, in_features), generator=g, dtype=torch.int8)
    scale = (torch.rand((out_features, 3), generator=g) * 0.1 + 0.01).to(torch.bfloat16)
    layer._buffers.update(weight=w, weight_scale=scale, weight_g_idx=g_idx.to(torch.int32))
    return layer, w, scale


def test_each_column_takes_its_own_groups_scale_exactly():
    g = torch.Generator().manual_seed(1)
    g_idx = (torch.arange(192) // 64)[torch.randperm(192, generator=g)]
    layer, w, scale = layer_with_g_idx(g_idx)
    x = (torch.randn((16, 192), generator=g) * torch.logspace(-2, 2, 16)[:, None]).to(torch.bfloat16)
    _, y = layer.run(x)
    q, s = quantize_activations(x, ACT)
    # The dequantized weight of the definition: column j scaled by its group g_idx[j].
    dense = w.double() * scale.double()[:, g_idx]
    terms = q.double() * s.double()[:, None]
    exact, magnitude = terms @ dense.T, terms.abs() @ dense.abs().T
    assert ((y.double() - exact).abs() <= 1e-6 * magnitude + 1e-30).all()
    # Consecutive groups instead are another weight: the index is what makes it right.
    layer.has_g_idx = False
    _, y_consecutive = layer.run(x)
    assert not torch.allclose(y_consecutive.double(), exact, rtol=1e-3)


@pytest.mark.parametrize("bad", ["all in one group", "a group past the last"])
def test_a_g_idx_that_does_not_fill_every_group_is_refused(bad):
    g_idx = torch.zeros(192, dtype=torch.long) if bad == "all in one group" else torch.arange(192) // 64 + 1
    layer, _, _ = layer_with_g_idx(g_idx)
    with pytest.raises(ValueError, match="does not assign 64 columns to each group"):
        layer.column_order()


def test_a_per_channel_layer_takes_no_group_index():
    with pytest.raises(ValueError, match="per-channel scales"):
        IntLinear(64, 8, 4, ACT, torch.float32, group_size=None, storage="int8", g_idx=True)


def test_a_config_with_the_removed_actorder_group_is_read_as_its_layout():
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**weights, "actorder": "group"}}},
    }
    readable = readable_config(qc)
    assert "actorder" not in readable["config_groups"]["group_0"]["weights"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "group"  # the caller's copy untouched
    coverage = SchemeLookup(qc).covering("model.layers.0.mlp.down_proj", "linear")
    assert coverage.group == "group_0" and coverage.scheme.weights.group_size == 64
    static = {
        **qc,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**weights, "actorder": "static"}}},
    }
    assert readable_config(static) is static
