"""Checkpoint: indexing from safetensors headers, streaming, fingerprint, format detection, bad input.

Every checkpoint here is real files written into tmp_path; each negative test breaks a good one.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import evalsuite.files.checkpoint as checkpoint_module
from evalsuite.errors import DependencyError, InputError
from evalsuite.files.checkpoint import INDEX_FILE, Checkpoint

SHARD_1 = "model-00001-of-00002.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4}


def _tensors() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {
        SHARD_1: {
            "model.embed_tokens.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.down_proj.weight": torch.randn(4, 6, generator=g).to(torch.bfloat16),
            "model.layers.0.input_layernorm.weight": torch.ones(4, dtype=torch.bfloat16),
        },
        SHARD_2: {
            "lm_head.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.ones(4, dtype=torch.float32),
            "model.layers.0.step": torch.tensor(3, dtype=torch.int64),
        },
    }


def _write_checkpoint(
    folder: Path,
    shards: dict[str, dict[str, torch.Tensor]] | None = None,
    config: dict | None = None,
    *,
    index: bool = True,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shards = _tensors() if shards is None else shards
    for file_name, tensors in shards.items():
        save_file(tensors, str(folder / file_name), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    if index:
        weight_map = {name: file_name for file_name, tensors in shards.items() for name in tensors}
        (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return folder


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    return _write_checkpoint(tmp_path / "ckpt")


def _write_raw_shard(path: Path, header: dict, data: bytes, header_len: int | None = None) -> None:
    raw = json.dumps(header).encode()
    length = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", length) + raw + data)


def _single_shard(folder: Path, header: dict, data: bytes) -> Path:
    """A folder with config.json and one hand-written model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    _write_raw_shard(folder / "model.safetensors", header, data)
    return folder


def _rejected(source: str | Path) -> InputError:
    with pytest.raises(InputError) as excinfo:
        Checkpoint.open(source)
    message = str(excinfo.value)
    assert "\n" not in message, message
    return excinfo.value


# --- indexing and reading ---------------------------------------------------------------------------


def test_tensors_are_indexed_from_headers_and_offsets_agree_with_safe_open(ckpt_dir: Path) -> None:
    ckpt = Checkpoint.open(ckpt_dir)
    written = {name: t for tensors in _tensors().values() for name, t in tensors.items()}

    assert ckpt.path == ckpt_dir.resolve()
    assert list(ckpt.tensors) == sorted(written)
    for name, expected in written.items():
        info = ckpt.tensors[name]
        assert info.name == name
        assert info.shape == tuple(expected.shape)
        assert info.numel == expected.numel()
        assert info.nbytes == expected.numel() * expected.element_size()
        with safe_open(info.shard, framework="pt") as f:
            stored = f.get_tensor(name)
        raw = info.shard.read_bytes()[info.data_begin : info.data_end]
        assert raw == stored.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert ckpt.read_bytes(name) == raw
        assert torch.equal(ckpt.read_tensor(name), expected)
    assert ckpt.tensors["model.norm.weight"].dtype == "F32"
    assert ckpt.tensors["lm_head.weight"].dtype == "BF16"
    assert ckpt.tensors["model.layers.0.step"].shape == ()
    assert ckpt.tensors["lm_head.weight"].shard == ckpt_dir.resolve() / SHARD_2


def test_shards_are_listed_in_file_name_order(ckpt_dir: Path) -> None:
    ckpt = Checkpoint.open(ckpt_dir)
    assert ckpt.shards == [ckpt_dir.resolve() / SHARD_1, ckpt_dir.resolve() / SHARD_2]
    assert ckpt.total_bytes == sum(p.stat().st_size for p in ckpt.shards)


def test_a_folder_without_index_reads_every_safetensors_file(tmp_path: Path) -> None:
    ckpt = Checkpoint.open(_write_checkpoint(tmp_path / "ckpt", index=False))
    assert len(ckpt.shards) == 2
    assert len(ckpt.tensors) == 6


def test_iter_tensors_streams_the_same_tensors_opening_each_shard_once(
    ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpoint.open(ckpt_dir)
    opened: list[Path] = []
    real_safe_open = checkpoint_module.safe_open

    def counting_safe_open(path, *args, **kwargs):
        opened.append(Path(path))
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "safe_open", counting_safe_open)
    streamed = list(ckpt.iter_tensors())

    assert opened == ckpt.shards
    assert sorted(name for name, _ in streamed) == list(ckpt.tensors)
    in_file_order = [name for name, _ in streamed]
    assert in_file_order == sorted(
        ckpt.tensors, key=lambda n: (ckpt.shards.index(ckpt.tensors[n].shard), ckpt.tensors[n].data_begin)
    )
    for name, tensor in streamed:
        assert torch.equal(tensor, ckpt.read_tensor(name))


def test_iter_tensors_with_names_yields_only_those_once(ckpt_dir: Path) -> None:
    ckpt = Checkpoint.open(ckpt_dir)
    wanted = ["model.norm.weight", "model.embed_tokens.weight", "model.norm.weight"]
    names = [name for name, _ in ckpt.iter_tensors(wanted)]
    assert names == ["model.embed_tokens.weight", "model.norm.weight"]


def test_unknown_tensor_name_is_rejected_before_reading(ckpt_dir: Path) -> None:
    ckpt = Checkpoint.open(ckpt_dir)
    with pytest.raises(InputError, match="no tensor named 'nope'"):
        ckpt.iter_tensors(["model.norm.weight", "nope"])
    with pytest.raises(InputError, match="no tensor named 'nope'"):
        ckpt.read_tensor("nope")
    with pytest.raises(InputError, match="no tensor named 'nope'"):
        ckpt.read_bytes("nope")


def test_config_properties_and_files_inside_the_folder(ckpt_dir: Path) -> None:
    (ckpt_dir / "tokenizer.json").write_text("{}")
    ckpt = Checkpoint.open(str(ckpt_dir))
    assert ckpt.config == CONFIG
    assert ckpt.model_type == "llama"
    assert ckpt.quantization_config is None
    assert ckpt.file("tokenizer.json") == ckpt_dir.resolve() / "tokenizer.json"
    with pytest.raises(InputError, match="missing from the checkpoint folder") as excinfo:
        ckpt.file("tokenizer_config.json")
    assert "tokenizer_config.json" in str(excinfo.value)
    with pytest.raises(InputError, match="not a file name inside"):
        ckpt.file("../ckpt/config.json")


# --- fingerprint ------------------------------------------------------------------------------------


def test_fingerprint_is_stable_across_opens_and_copies(ckpt_dir: Path, tmp_path: Path) -> None:
    first = Checkpoint.open(ckpt_dir).fingerprint
    assert Checkpoint.open(ckpt_dir).fingerprint == first
    # Same files in another folder, config.json written with other whitespace and key order.
    copy = _write_checkpoint(tmp_path / "copy", config=dict(reversed(list(CONFIG.items()))))
    (copy / "config.json").write_text(json.dumps(dict(reversed(list(CONFIG.items()))), indent=4))
    assert Checkpoint.open(copy).fingerprint == first
    assert len(first) == 64


def test_fingerprint_reads_headers_not_tensor_data(ckpt_dir: Path) -> None:
    before = Checkpoint.open(ckpt_dir)
    info = before.tensors["lm_head.weight"]
    raw = bytearray(info.shard.read_bytes())
    raw[info.data_begin] ^= 0xFF
    info.shard.write_bytes(bytes(raw))
    assert Checkpoint.open(ckpt_dir).fingerprint == before.fingerprint


def test_fingerprint_changes_when_a_header_changes(ckpt_dir: Path) -> None:
    before = Checkpoint.open(ckpt_dir).fingerprint
    shards = _tensors()
    shards[SHARD_2]["lm_head.weight"] = shards[SHARD_2]["lm_head.weight"].float()
    _write_checkpoint(ckpt_dir, shards)
    assert Checkpoint.open(ckpt_dir).fingerprint != before


def test_fingerprint_changes_when_config_changes(ckpt_dir: Path) -> None:
    before = Checkpoint.open(ckpt_dir).fingerprint
    (ckpt_dir / "config.json").write_text(json.dumps({**CONFIG, "hidden_size": 5}))
    assert Checkpoint.open(ckpt_dir).fingerprint != before


# --- format detection -------------------------------------------------------------------------------


def test_bf16_checkpoint_is_detected_by_its_dominant_float_dtype(ckpt_dir: Path) -> None:
    # An F32 norm and an I64 counter beside BF16 weights do not change the answer.
    assert Checkpoint.open(ckpt_dir).format == "bf16"


@pytest.mark.parametrize(("dtype", "expected"), [(torch.float32, "fp32"), (torch.float16, "fp16")])
def test_fp32_and_fp16_checkpoints_are_detected(tmp_path: Path, dtype: torch.dtype, expected: str) -> None:
    shards = {
        name: {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        for name, tensors in _tensors().items()
    }
    assert Checkpoint.open(_write_checkpoint(tmp_path / "ckpt", shards)).format == expected


def test_compressed_tensors_is_detected_from_quantization_config(tmp_path: Path) -> None:
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}
    shards = {
        "model.safetensors": {
            "model.layers.0.mlp.down_proj.weight_packed": torch.zeros(4, 1, dtype=torch.int32),
            "model.layers.0.mlp.down_proj.weight_scale": torch.ones(4, 1, dtype=torch.bfloat16),
            "model.layers.0.mlp.down_proj.weight_shape": torch.tensor([4, 8], dtype=torch.int32),
        }
    }
    ckpt = Checkpoint.open(
        _write_checkpoint(tmp_path / "ckpt", shards, {**CONFIG, "quantization_config": qc})
    )
    assert ckpt.format == "compressed-tensors"
    assert ckpt.quantization_config == qc
    assert ckpt.tensors["model.layers.0.mlp.down_proj.weight_packed"].dtype == "I32"


def test_exl3_is_detected_from_config_quant_method(tmp_path: Path) -> None:
    config = {**CONFIG, "quantization_config": {"quant_method": "exl3", "bits": 4.15}}
    assert Checkpoint.open(_write_checkpoint(tmp_path / "ckpt", config=config)).format == "exl3"


def test_exl3_is_detected_from_its_quantization_config_json(ckpt_dir: Path) -> None:
    storage = {
        "model.layers.0.mlp.down_proj": {
            "stored_tensors": {"model.layers.0.mlp.down_proj.trellis": {"shape": [1, 1, 64]}},
            "quant_format": "exl3",
            "bits_per_weight": 4,
        }
    }
    (ckpt_dir / "quantization_config.json").write_text(json.dumps({"tensor_storage": storage}))
    assert Checkpoint.open(ckpt_dir).format == "exl3"


def test_gguf_folder_is_detected_and_records_its_file(tmp_path: Path) -> None:
    folder = tmp_path / "gguf"
    folder.mkdir()
    (folder / "SmolLM2.Q4_1.gguf").write_bytes(b"GGUF" + bytes(60))
    ckpt = Checkpoint.open(folder)
    assert ckpt.format == "gguf"
    assert ckpt.gguf_file == folder.resolve() / "SmolLM2.Q4_1.gguf"
    assert ckpt.tensors == {}
    assert ckpt.shards == []
    assert ckpt.total_bytes == 64
    first = ckpt.fingerprint
    (folder / "SmolLM2.Q4_1.gguf").write_bytes(b"GGUF" + bytes(59) + b"\x01")
    assert Checkpoint.open(folder).fingerprint != first


def test_unsupported_quant_method_is_rejected(tmp_path: Path) -> None:
    config = {**CONFIG, "quantization_config": {"quant_method": "hqq"}}
    error = _rejected(_write_checkpoint(tmp_path / "ckpt", config=config))
    assert "'hqq' is not supported" in str(error)
    assert error.path == (tmp_path / "ckpt" / "config.json").resolve()


def test_checkpoint_without_floating_point_weights_has_no_format(tmp_path: Path) -> None:
    shards = {"model.safetensors": {"w": torch.zeros(4, dtype=torch.int8)}}
    assert "cannot tell the format" in str(_rejected(_write_checkpoint(tmp_path / "c", shards, index=False)))


# --- bad input: the folder --------------------------------------------------------------------------


def test_missing_path_is_rejected_with_its_path(tmp_path: Path) -> None:
    error = _rejected(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(error)
    assert "does not exist" in str(error)


def test_a_file_is_not_a_checkpoint_folder(ckpt_dir: Path) -> None:
    assert "is not a folder" in str(_rejected(ckpt_dir / "config.json"))


def test_folder_without_config_json_is_rejected(ckpt_dir: Path) -> None:
    (ckpt_dir / "config.json").unlink()
    error = _rejected(ckpt_dir)
    assert "no config.json" in str(error)
    assert error.path == ckpt_dir.resolve()


def test_invalid_config_json_is_rejected_with_line_and_column(ckpt_dir: Path) -> None:
    (ckpt_dir / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": ,\n}')
    error = _rejected(ckpt_dir)
    assert error.path == ckpt_dir.resolve() / "config.json"
    assert "line 3, column 18" in str(error)


def test_folder_with_no_weights_is_rejected(tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    error = _rejected(folder)
    assert "no weights" in str(error)
    assert error.path == folder.resolve()


def test_several_gguf_files_are_ambiguous(tmp_path: Path) -> None:
    folder = tmp_path / "gguf"
    folder.mkdir()
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        (folder / name).write_bytes(b"GGUF")
    assert "several .gguf files" in str(_rejected(folder))


def test_duplicate_tensor_names_across_shards_are_rejected(tmp_path: Path) -> None:
    shards = _tensors()
    shards[SHARD_2]["model.embed_tokens.weight"] = shards[SHARD_1]["model.embed_tokens.weight"]
    error = _rejected(_write_checkpoint(tmp_path / "ckpt", shards, index=False))
    assert "'model.embed_tokens.weight' is also stored in " + SHARD_1 in str(error)
    assert error.path == (tmp_path / "ckpt").resolve() / SHARD_2


# --- bad input: the index ---------------------------------------------------------------------------


def _edit_index(folder: Path, edit) -> None:
    index = json.loads((folder / INDEX_FILE).read_text())
    edit(index["weight_map"])
    (folder / INDEX_FILE).write_text(json.dumps(index))


def test_invalid_index_json_is_rejected_with_line_and_column(ckpt_dir: Path) -> None:
    (ckpt_dir / INDEX_FILE).write_text('{"weight_map": {"a": "b"}')
    error = _rejected(ckpt_dir)
    assert error.path == ckpt_dir.resolve() / INDEX_FILE
    assert "line 1, column 26" in str(error)


@pytest.mark.parametrize("bad", ["../elsewhere.safetensors", "/etc/model.safetensors", "sub/../../x"])
def test_index_path_that_leaves_the_folder_is_rejected_naming_the_index(ckpt_dir: Path, bad: str) -> None:
    _edit_index(ckpt_dir, lambda wm: wm.update({"lm_head.weight": bad}))
    error = _rejected(ckpt_dir)
    assert error.path == ckpt_dir.resolve() / INDEX_FILE
    assert "leaves the checkpoint folder" in str(error)


def test_index_symlink_resolving_outside_the_folder_is_rejected(ckpt_dir: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    (ckpt_dir / SHARD_2).rename(outside)
    (ckpt_dir / SHARD_2).symlink_to(outside)
    error = _rejected(ckpt_dir)
    assert error.path == ckpt_dir.resolve() / INDEX_FILE
    assert "resolves outside the checkpoint folder" in str(error)


def test_symlinked_shard_inside_the_folder_is_accepted(ckpt_dir: Path) -> None:
    (ckpt_dir / "blobs").mkdir()
    (ckpt_dir / SHARD_2).rename(ckpt_dir / "blobs" / "abc123")
    (ckpt_dir / SHARD_2).symlink_to(ckpt_dir / "blobs" / "abc123")
    assert Checkpoint.open(ckpt_dir).tensors["lm_head.weight"].shard == ckpt_dir.resolve() / SHARD_2


def test_loose_shard_symlink_resolving_outside_is_rejected(tmp_path: Path) -> None:
    folder = _write_checkpoint(tmp_path / "ckpt", index=False)
    (folder / SHARD_1).rename(tmp_path / "outside.safetensors")
    (folder / SHARD_1).symlink_to(tmp_path / "outside.safetensors")
    error = _rejected(folder)
    assert error.path == folder.resolve() / SHARD_1


def test_shard_listed_in_the_index_but_missing_is_rejected_naming_it(ckpt_dir: Path) -> None:
    (ckpt_dir / SHARD_2).unlink()
    error = _rejected(ckpt_dir)
    assert error.path == ckpt_dir.resolve() / SHARD_2
    assert "does not exist" in str(error)


def test_index_tensor_absent_from_the_shard_headers_is_rejected(ckpt_dir: Path) -> None:
    _edit_index(ckpt_dir, lambda wm: wm.update({"model.ghost.weight": SHARD_1}))
    error = _rejected(ckpt_dir)
    assert error.path == ckpt_dir.resolve() / INDEX_FILE
    assert "'model.ghost.weight'" in str(error)


def test_header_tensor_absent_from_the_index_is_rejected(ckpt_dir: Path) -> None:
    _edit_index(ckpt_dir, lambda wm: wm.pop("model.norm.weight"))
    error = _rejected(ckpt_dir)
    assert error.path == ckpt_dir.resolve() / INDEX_FILE
    assert "'model.norm.weight' of " + SHARD_2 + " is not in the weight_map" in str(error)


def test_index_mapping_a_tensor_to_the_wrong_shard_is_rejected(ckpt_dir: Path) -> None:
    _edit_index(ckpt_dir, lambda wm: wm.update({"model.norm.weight": SHARD_1}))
    assert "mapped to " + SHARD_1 + " but stored in " + SHARD_2 in str(_rejected(ckpt_dir))


def test_index_with_a_duplicate_tensor_key_is_rejected(ckpt_dir: Path) -> None:
    text = (ckpt_dir / INDEX_FILE).read_text()
    entry = f'"lm_head.weight": "{SHARD_2}"'
    (ckpt_dir / INDEX_FILE).write_text(text.replace(entry, f"{entry}, {entry}", 1))
    assert "appears twice" in str(_rejected(ckpt_dir))


# --- bad input: the safetensors headers -------------------------------------------------------------


def test_truncated_shard_is_rejected_with_its_path(ckpt_dir: Path) -> None:
    shard = ckpt_dir / SHARD_1
    shard.write_bytes(shard.read_bytes()[:-10])
    error = _rejected(ckpt_dir)
    assert error.path == ckpt_dir.resolve() / SHARD_1
    assert "truncated shard" in str(error)


def test_shard_shorter_than_its_length_prefix_is_rejected(ckpt_dir: Path) -> None:
    (ckpt_dir / SHARD_1).write_bytes(b"\x10\x00")
    assert "truncated shard" in str(_rejected(ckpt_dir))


def test_header_claiming_more_bytes_than_the_file_has_is_rejected(tmp_path: Path) -> None:
    header = {"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}
    folder = _single_shard(tmp_path / "c", header, b"xx")
    _write_raw_shard(folder / "model.safetensors", header, b"xx", header_len=10_000)
    error = _rejected(folder)
    assert "header claims 10000 bytes" in str(error)
    assert error.path == folder.resolve() / "model.safetensors"


def test_header_length_over_the_cap_is_rejected(tmp_path: Path) -> None:
    folder = _single_shard(tmp_path / "c", {}, b"")
    _write_raw_shard(folder / "model.safetensors", {}, b"", header_len=2**40)
    assert "exceeds the 100000000-byte cap" in str(_rejected(folder))


def test_header_that_is_not_json_is_rejected(tmp_path: Path) -> None:
    folder = _single_shard(tmp_path / "c", {}, b"")
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope")
    assert "invalid JSON in header at line 1, column 2" in str(_rejected(folder))


def test_header_with_a_duplicate_tensor_name_is_rejected(tmp_path: Path) -> None:
    folder = _single_shard(tmp_path / "c", {}, b"")
    entry = b'"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    raw = b"{" + entry + b", " + entry + b"}"
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"x")
    assert "'w' appears twice" in str(_rejected(folder))


@pytest.mark.parametrize(
    ("entry", "data", "message"),
    [
        ({"dtype": "Q4", "shape": [2], "data_offsets": [0, 2]}, b"xx", "unknown dtype 'Q4'"),
        ({"dtype": "U8", "shape": [-2], "data_offsets": [0, 2]}, b"xx", "non-negative integers"),
        ({"dtype": "U8", "shape": [2.0], "data_offsets": [0, 2]}, b"xx", "non-negative integers"),
        ({"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}, b"x", "non-negative integers"),
        ({"dtype": "U8", "shape": [2], "data_offsets": [0]}, b"xx", "not two non-negative integers"),
        ({"dtype": "U8", "shape": [2], "data_offsets": [2, 0]}, b"xx", "end before they begin"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 2]}, b"xx", "spans 2 bytes but F32 (2,) needs 8"),
        ({"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, b"xxxx", "2 bytes after the last tensor"),
        ({"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}, b"xxxx", "0..2 belong to no tensor"),
        ({"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, b"x", "truncated shard"),
        ([1, 2], b"", "is not an object"),
    ],
)
def test_malformed_header_entry_is_rejected_naming_the_shard(
    tmp_path: Path, entry: object, data: bytes, message: str
) -> None:
    folder = _single_shard(tmp_path / "c", {"w": entry}, data)
    error = _rejected(folder)
    assert message in str(error)
    assert error.path == folder.resolve() / "model.safetensors"


def test_overlapping_tensors_are_rejected(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "b": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]},
    }
    assert "tensors 'a' and 'b' overlap" in str(_rejected(_single_shard(tmp_path / "c", header, b"xxxx")))


def test_non_string_metadata_is_rejected(tmp_path: Path) -> None:
    header = {"__metadata__": {"format": 1}, "w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    assert "__metadata__" in str(_rejected(_single_shard(tmp_path / "c", header, b"x")))


def test_hand_written_valid_shard_is_read_like_safetensors_reads_it(tmp_path: Path) -> None:
    header = {
        "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]},
        "a": {"dtype": "I16", "shape": [2], "data_offsets": [0, 4]},
        "empty": {"dtype": "F32", "shape": [0, 3], "data_offsets": [6, 6]},
    }
    data = struct.pack("<hh", -1, 7) + b"\x05\x06"
    folder = _single_shard(tmp_path / "c", header, data)
    ckpt = Checkpoint.open(folder)
    assert ckpt.read_tensor("a").tolist() == [-1, 7]
    assert ckpt.read_bytes("b") == b"\x05\x06"
    assert ckpt.tensors["empty"].nbytes == 0
    assert ckpt.format == "fp32"


# --- the Hugging Face cache -------------------------------------------------------------------------


def test_hub_id_not_in_the_cache_is_a_dependency_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(DependencyError) as excinfo:
        Checkpoint.open("someone/not-cached")
    assert str(excinfo.value) == (
        "someone/not-cached is not a folder and not in the local Hugging Face cache (no network)"
    )


def _cache_repo(cache: Path, repo_id: str, source: Path) -> Path:
    """Lay out `source` the way huggingface_hub caches a repo: files are symlinks into blobs/."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for i, file in enumerate(sorted(source.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def test_hub_id_in_the_cache_opens_its_snapshot(
    ckpt_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    snapshot = _cache_repo(tmp_path / "hf-home" / "hub", "org/tiny", ckpt_dir)
    ckpt = Checkpoint.open("org/tiny")
    assert ckpt.path == snapshot.resolve()
    assert ckpt.shards == [snapshot.resolve() / SHARD_1, snapshot.resolve() / SHARD_2]
    assert ckpt.fingerprint == Checkpoint.open(ckpt_dir).fingerprint
    assert torch.equal(ckpt.read_tensor("lm_head.weight"), _tensors()[SHARD_2]["lm_head.weight"])


def test_local_folder_named_like_a_hub_id_wins(ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ckpt_dir.parent.parent)
    assert Checkpoint.open(f"{ckpt_dir.parent.name}/{ckpt_dir.name}").path == ckpt_dir.resolve()
