"""Backend `hf` with `add_activation_quantization` (what `intref` asks of it for a weight-only candidate): the
groups that keep 16-bit activations are loaded with compressed-tensors' dynamic per-token INT8 activation
quantization, the rest of the config and the checkpoint untouched, and the execution says so."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from evalsuite.backends.hf import HFBackend, with_activation_quantization
from evalsuite.backends.intref_plan import DYNAMIC_INT8_PER_TOKEN
from evalsuite.backends.options import ADD_ACTIVATION_QUANTIZATION, BackendOptions
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint

ADDED = BackendOptions().with_backend("hf", {ADD_ACTIVATION_QUANTIZATION: True})


def test_only_weight_only_groups_gain_activation_quantization(llmc_tiny):
    mixed = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "a16": json.loads((llmc_tiny["tiny-llama-llmc"] / "w8a16" / "config.json").read_text())[
                "quantization_config"
            ]["config_groups"]["group_0"],
            "a8": {"targets": ["Linear"], "input_activations": {"num_bits": 8, "strategy": "tensor"}},
        },
    }
    before = copy.deepcopy(mixed)
    added = with_activation_quantization(mixed, Checkpoint.open(llmc_tiny["tiny-llama-llmc"] / "w8a16"))
    assert mixed == before  # a copy: the config read from the files is not edited
    assert added["config_groups"]["a16"]["input_activations"] == DYNAMIC_INT8_PER_TOKEN
    assert added["config_groups"]["a8"] == before["config_groups"]["a8"]
    assert added["config_groups"]["a16"]["weights"] == before["config_groups"]["a16"]["weights"]


def test_a_config_without_groups_is_refused_naming_the_checkpoint(llmc_tiny):
    source = Checkpoint.open(llmc_tiny["tiny-llama-bf16"])
    with pytest.raises(InputError, match="config_groups") as refused:
        with_activation_quantization(None, source)
    assert str(source.path) in str(refused.value)


def test_the_weight_only_pack_runs_its_activations_in_int8_and_says_so(llmc_tiny):
    path = llmc_tiny["tiny-llama-llmc"] / "w8a16"
    stock = HFBackend(Checkpoint.open(path), BackendOptions())
    added = HFBackend(Checkpoint.open(path), ADDED)
    down = "model.layers.1.mlp.down_proj"
    assert stock.model.get_submodule(down).quantization_scheme.input_activations is None
    inputs = added.model.get_submodule(down).quantization_scheme.input_activations
    assert (inputs.num_bits, inputs.strategy, inputs.dynamic, inputs.symmetric) == (8, "token", True, True)
    assert "INT8 activations added" in added.describe()["execution"]
    assert "added" not in stock.describe()["execution"]
    ids = torch.arange(1, 33).reshape(1, -1)
    with torch.inference_mode():
        a = stock.model(input_ids=ids, use_cache=False).logits
        b = added.model(input_ids=ids, use_cache=False).logits
    # The weights are the same; only the activations' rounding differs: close, and not equal.
    assert not torch.equal(a, b)
    assert torch.allclose(a.float(), b.float(), atol=0.5)
