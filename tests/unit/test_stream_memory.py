"""When a side streams: `--max-memory` sizes, the loaded-size estimate from the files, and the decision."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest

from evalsuite.backends.memory import (
    FIT_FRACTION,
    loaded_bytes,
    loaded_peak_bytes,
    parse_memory_size,
    streamed_if_needed,
)
from evalsuite.backends.options import BackendOptions
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GB", 24 * 10**9),
        ("24 GiB", 24 * 2**30),
        ("1.5tb", 1_500_000_000_000),
        ("512MiB", 512 * 2**20),
        ("100kB", 100_000),
        ("4096", 4096),
        ("2G", 2 * 10**9),
    ],
)
def test_sizes_read_in_decimal_and_binary_units(text, expected):
    assert parse_memory_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "GB", "-1GB", "0", "0.4", "3 XB", "1e9", "nan"])
def test_a_size_that_is_not_one_is_refused_naming_it(text):
    with pytest.raises(InputError, match="--max-memory") as err:
        parse_memory_size(text)
    assert repr(text) in str(err.value)


def test_hf_holds_a_w4a8_pack_decompressed_as_large_as_its_source_and_intref_holds_it_packed(tiny_pair):
    bf16 = Checkpoint.open(tiny_pair["tiny-minicpmv47-bf16"])
    w4a8 = Checkpoint.open(tiny_pair["tiny-minicpmv47-w4a8"])
    hf = BackendOptions()
    # bf16 weights: the files' bytes exactly (every tensor is a bf16 weight).
    assert loaded_bytes(bf16, hf) == bf16.total_bytes - _header_bytes(bf16)
    # Decompressed, the W4A8 copy is its source again, plus the per-channel scales it stores.
    scales = sum(i.numel for n, i in w4a8.tensors.items() if n.endswith("weight_scale")) * 2
    assert loaded_bytes(w4a8, hf) == loaded_bytes(bf16, hf) + scales
    assert loaded_bytes(w4a8, hf.with_backend("intref")) == w4a8.total_bytes < loaded_bytes(w4a8, hf)
    assert loaded_bytes(bf16, dataclasses.replace(hf, dtype="float32")) == 2 * loaded_bytes(bf16, hf)


def _header_bytes(ckpt: Checkpoint) -> int:
    return ckpt.total_bytes - sum(i.nbytes for i in ckpt.tensors.values())


def test_a_side_streams_when_its_model_does_not_fit_the_budget(tiny_pair):
    ckpt = Checkpoint.open(tiny_pair["tiny-minicpmv47-bf16"])
    needed = loaded_peak_bytes(ckpt, BackendOptions())
    fits = BackendOptions(max_memory=int(needed / FIT_FRACTION) + 1)
    assert streamed_if_needed(ckpt, fits) == (fits, None)
    tight = BackendOptions(max_memory=needed)
    options, reason = streamed_if_needed(ckpt, tight)
    assert options.stream and "more than --max-memory" in reason
    asked = BackendOptions(stream=True)
    assert streamed_if_needed(ckpt, asked) == (asked, "--stream")
    # The budget decides the execution; it is no part of an observation's key, streaming is.
    assert "max_memory" not in tight.to_json() and options.to_json()["stream"] is True


def sparse_bf16_checkpoint(folder: Path, layers: int, layer_bytes: int, rest_bytes: int) -> Checkpoint:
    """A checkpoint of one BF16 tensor per decoder layer and an embedding and a head, whose shard declares
    every byte and stores none (a sparse file): a 70 GB model in a few kB of disk, for its headers."""
    sizes = {"model.language_model.embed_tokens.weight": rest_bytes // 2, "lm_head.weight": rest_bytes // 2}
    sizes |= {f"model.language_model.layers.{i}.mlp.experts.weight": layer_bytes for i in range(layers)}
    header, offset = {}, 0
    for name, nbytes in sizes.items():
        header[name] = {"dtype": "BF16", "shape": [nbytes // 2], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header).encode()
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe_text"}))
    with open(folder / "model.safetensors", "wb") as shard:
        shard.write(struct.pack("<Q", len(encoded)) + encoded)
        shard.truncate(8 + len(encoded) + offset)
    return Checkpoint.open(folder)


GB = 10**9


def test_the_35b_model_streams_on_a_24gb_machine_and_the_wide_fixture_loads_unless_memory_is_short(tmp_path):
    # MiniCPM-V-4.7-35B-A3B in BF16: 40 layers of 1.68 GB (256 experts of 3 × 2,048 × 512) + 2 GB of embedding
    # and head, 69 GB; the wide fixture: 4 such layers, 8.7 GB.
    real = sparse_bf16_checkpoint(tmp_path / "35b", layers=40, layer_bytes=int(1.68 * GB), rest_bytes=2 * GB)
    wide = sparse_bf16_checkpoint(tmp_path / "wide", layers=4, layer_bytes=int(1.68 * GB), rest_bytes=2 * GB)
    machine = BackendOptions(max_memory=24 * GB)
    # The peak of a load: the weights, and the largest layer once more while it is converted.
    assert loaded_peak_bytes(wide, machine) == loaded_bytes(wide, machine) + int(1.68 * GB)

    options, reason = streamed_if_needed(real, machine)
    assert options.stream and "to be loaded whole, more than --max-memory 24.0 GB" in reason
    assert streamed_if_needed(wide, machine) == (machine, None)  # 10.4 GB at its peak: loaded
    # A machine busy enough that the peak would not fit with room for the windows' logits: streamed.
    busy = BackendOptions(max_memory=11 * GB)
    options, reason = streamed_if_needed(wide, busy)
    assert options.stream and "10.4 GB to be loaded whole" in reason
