"""Bad input: exit 2, one line naming the file and what is wrong, and no report written."""

from __future__ import annotations

import json
import struct

import pytest

from tests.conftest import assert_refused as assert_exit_2
from tests.conftest import cli_in_process, copy_checkpoint


@pytest.fixture
def run_against():
    """`evalsuite run --ckpt CKPT --ref REF --out OUT` through the CLI's entry point (in this process)."""

    def run(ckpt, ref, out):
        return cli_in_process(
            "run", "--ckpt", ckpt, "--ref", ref, "--corpus", "python-docs", "--out", out, "--quiet"
        )

    return run


def assert_refused(res, *fragments: str) -> None:
    code, lines, _ = res
    assert not any("Traceback" in line for line in lines)
    assert_exit_2(code, lines, *fragments)


@pytest.fixture
def ref(tiny_pair):
    return tiny_pair["tiny-minicpmv47-bf16"]


@pytest.fixture
def broken(ref, tmp_path):
    return copy_checkpoint(ref, tmp_path / "broken")


def test_missing_path_is_refused(ref, tmp_path, run_against):
    res = run_against(tmp_path / "nowhere", ref, tmp_path / "out")
    assert_refused(res, str(tmp_path / "nowhere"), "does not exist")
    assert not (tmp_path / "out" / "results.json").exists()


def test_folder_without_config_is_refused(broken, ref, tmp_path, run_against):
    (broken / "config.json").unlink()
    assert_refused(run_against(broken, ref, tmp_path / "out"), "config.json")


def test_invalid_config_json_is_refused_with_its_position(broken, ref, tmp_path, run_against):
    (broken / "config.json").write_text('{"model_type": "minicpmv4_7",\n  oops}')
    assert_refused(run_against(broken, ref, tmp_path / "out"), "config.json", "line 2")


def test_truncated_shard_is_rejected_with_its_path(broken, ref, tmp_path, run_against):
    shard = broken / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    assert_refused(run_against(broken, ref, tmp_path / "out"), "model.safetensors")


def test_header_claiming_more_bytes_than_the_file_is_rejected(broken, ref, tmp_path, run_against):
    shard = broken / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", len(data) * 2)
    shard.write_bytes(bytes(data))
    assert_refused(run_against(broken, ref, tmp_path / "out"), "model.safetensors")


def test_shard_index_path_leaving_the_folder_is_rejected(broken, ref, tmp_path, run_against):
    shard = broken / "model.safetensors"
    outside = tmp_path / "outside.safetensors"
    shard.rename(outside)
    from safetensors import safe_open

    with safe_open(str(outside), "pt") as fh:
        names = list(fh.keys())
    index = {"metadata": {}, "weight_map": {n: "../outside.safetensors" for n in names}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_refused(run_against(broken, ref, tmp_path / "out"), "model.safetensors.index.json", "outside")


def test_mismatched_tokenizer_is_refused(broken, ref, tmp_path, run_against):
    # Drop the last BPE merges: the vocabulary is unchanged, but the text tokenizes differently.
    tok = json.loads((broken / "tokenizer.json").read_text())
    tok["model"]["merges"] = tok["model"]["merges"][:-50]
    (broken / "tokenizer.json").write_text(json.dumps(tok))
    res = run_against(broken, ref, tmp_path / "out")
    assert_refused(res, str(broken), "tokenizer disagrees")


def test_config_targeting_an_unquantized_module_is_refused(tiny_pair, ref, tmp_path, run_against):
    """The silent-random-weights trap: the vision tower's q_proj is stored in BF16 but a group targets it."""
    ckpt = copy_checkpoint(tiny_pair["tiny-minicpmv47-w4a8"], tmp_path / "ct")
    config = json.loads((ckpt / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    first = next(iter(groups.values()))
    first["targets"] = [*first["targets"], r"re:.*vision_tower.*self_attn\.q_proj$"]
    config["quantization_config"]["ignore"] = [
        i for i in config["quantization_config"].get("ignore", []) if "vision" not in i
    ]
    (ckpt / "config.json").write_text(json.dumps(config, indent=2))
    res = run_against(ckpt, ref, tmp_path / "out")
    assert_refused(res, str(ckpt), "randomly initialised")
