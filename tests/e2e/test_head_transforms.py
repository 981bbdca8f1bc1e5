"""The chunked head is the model's own: on tiny models of the Transformers classes that transform their
logits after the head (Granite divides by `logits_scaling`, Cohere multiplies by `logit_scale`, Gemma 2
soft-caps), the logits a long window's head makes a few rows at a time are those the model's own forward
returns for every scored position at once, loaded and streamed; a class that returns its head's output
unchanged (Llama) skips the per-chunk forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig, LlamaConfig

from evalsuite.backends.hf import HFBackend
from evalsuite.backends.options import BackendOptions
from evalsuite.backends.streamed import StreamedBackend
from evalsuite.files.checkpoint import Checkpoint

SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CLASSES = {
    "llama": (LlamaConfig(**SHAPE), False),
    "granite": (GraniteConfig(**SHAPE, logits_scaling=8.0), True),
    "cohere": (CohereConfig(**SHAPE, logit_scale=0.0625), True),
    "gemma2": (Gemma2Config(**SHAPE, head_dim=16, final_logit_softcapping=4.0), True),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny random checkpoint of each class, its head's weights wide enough (std 1) that the logits span
    tens: where a transform after the head matters."""
    folders = {}
    for name, (config, _) in CLASSES.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        with torch.no_grad():
            model.get_output_embeddings().weight.normal_(0.0, 1.0)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        folders[name] = folder
    return folders


def window() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, SHAPE["vocab_size"], (1, 96), generator=generator), torch.arange(40, 95)


@pytest.mark.parametrize("name", list(CLASSES))
def test_the_head_per_chunk_is_the_model_s_own_forward_loaded_and_streamed(tiny_models, name):
    checkpoint = Checkpoint.open(tiny_models[name])
    windows, positions = window()
    backend = HFBackend(checkpoint, BackendOptions())
    try:
        whole = next(iter(backend.window_logits(windows, positions)))
        states = next(iter(backend.window_scored_states(windows, positions)))
        assert torch.equal(torch.cat(list(states.chunks(16))), whole)
        assert (states.after_head is not None) == CLASSES[name][1]
    finally:
        backend.close()
    streamed = StreamedBackend(checkpoint, BackendOptions(stream=True))
    try:
        states = next(iter(streamed.window_scored_states(windows, positions)))
        assert torch.equal(torch.cat(list(states.chunks(16))), whole)
    finally:
        streamed.close()
