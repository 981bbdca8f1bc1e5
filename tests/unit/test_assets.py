"""The non-tensor files of a candidate against its source: JSON as data, text by line, bytes otherwise; every
difference named by file and key, the keys a quantized copy may change left out as the spec lists them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.tasks.tensors import TensorsSpec
from evalsuite.tasks.tensors._assets import SHOWN_PER_FILE, AssetRules, asset_files, compare_assets

SHIPPED = load_spec(TensorsSpec, default_spec_path("tensors")).assets

SOURCE = {
    "config.json": {
        "model_type": "m",
        "torch_dtype": "bfloat16",
        "text_config": {"dtype": "bfloat16", "n": 2},
    },
    "preprocessor_config.json": {"slice_mode": True, "downsample_mode": "16x", "image_mean": [0.5, 0.5, 0.5]},
    "generation_config.json": {"eos_token_id": 2, "transformers_version": "5.24.0"},
    "tokenizer_config.json": {"eos_token": "<|im_end|>", "add_bos_token": False, "model_max_length": 4096},
}
TEMPLATE = "{% for m in messages %}\n{{ m['content'] }}\n{% endfor %}\n"


def write(folder: Path, docs: dict, template: str | None = TEMPLATE) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, doc in docs.items():
        (folder / name).write_text(json.dumps(doc, indent=2))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "model.safetensors").write_bytes(b"weights differ: not an asset")
    (folder / "README.md").write_text("# a model card the pack rewrites\n")
    return folder


def compare(tmp_path: Path, candidate: dict, template: str | None = TEMPLATE, rules: AssetRules = SHIPPED):
    source = write(tmp_path / "source", SOURCE)
    theirs = write(tmp_path / "candidate", candidate, template)
    (theirs / "model.safetensors").write_bytes(b"other weights")
    return compare_assets(source, theirs, rules)


def rows(found) -> set[tuple[str, str, str]]:
    return {(d.kind, d.file, d.key) for d in found.differences}


def test_a_quantized_copy_that_changes_only_allowed_keys_and_formatting_is_equal(tmp_path):
    candidate = json.loads(json.dumps(SOURCE))
    candidate["config.json"] = {
        "quantization_config": {"quant_method": "compressed-tensors"},
        "text_config": {"n": 2.0, "dtype": "float16"},  # 2 == 2.0 as data; the dtype may change
        "model_type": "m",
        "dtype": "bfloat16",  # torch_dtype renamed
    }
    candidate["generation_config.json"]["transformers_version"] = "5.99.0"
    found = compare(tmp_path, candidate, template=TEMPLATE.replace("\n", "\r\n"))
    assert found.differences == [] and found.summary() == {
        "assets_compared": 5,
        "assets_missing": 0,
        "assets_changed": 0,
        "asset_differences": 0,
    }
    assert sorted(found.compared) == sorted([*SOURCE, "chat_template.jinja"])  # no weights, no README


def test_a_changed_slice_setting_fails_naming_the_file_and_key(tmp_path):
    candidate = json.loads(json.dumps(SOURCE))
    candidate["preprocessor_config.json"]["slice_mode"] = False
    candidate["preprocessor_config.json"]["image_mean"][2] = 0.45
    found = compare(tmp_path, candidate)
    assert rows(found) == {
        ("asset_changed", "preprocessor_config.json", "slice_mode"),
        ("asset_changed", "preprocessor_config.json", "image_mean[2]"),
    }
    assert found.summary()["assets_changed"] == 1 and found.summary()["asset_differences"] == 2
    detail = next(d.detail for d in found.differences if d.key == "slice_mode")
    assert detail == "source true → candidate false"


def test_a_deleted_chat_template_is_missing_by_name(tmp_path):
    found = compare(tmp_path, SOURCE, template=None)
    assert rows(found) == {("asset_missing", "chat_template.jinja", "")}
    assert found.summary()["assets_missing"] == 1


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda c: c["tokenizer_config.json"].pop("eos_token"), ("tokenizer_config.json", "eos_token")),
        (lambda c: c["tokenizer_config.json"].update(pad_token="x"), ("tokenizer_config.json", "pad_token")),
        (
            lambda c: c["tokenizer_config.json"].update(add_bos_token=0),
            ("tokenizer_config.json", "add_bos_token"),
        ),
        (lambda c: c["config.json"]["text_config"].update(n=3), ("config.json", "text_config.n")),
        (
            lambda c: c["preprocessor_config.json"]["image_mean"].pop(),
            ("preprocessor_config.json", "image_mean"),
        ),
        (
            lambda c: c["generation_config.json"].update(eos_token_id=[2, 3]),
            ("generation_config.json", "eos_token_id"),
        ),
    ],
    ids=["removed-key", "added-key", "false-is-not-0", "nested", "list-length", "type"],
)
def test_each_kind_of_json_difference_is_named(tmp_path, edit, expected):
    candidate = json.loads(json.dumps(SOURCE))
    edit(candidate)
    found = compare(tmp_path, candidate)
    assert {(d.file, d.key) for d in found.differences} == {expected}


def test_text_differs_by_its_first_differing_line_and_binary_by_bytes(tmp_path):
    rules = AssetRules(ignore_files=["*.md"])
    source = write(tmp_path / "source", {})
    (source / "tokenizer.model").write_bytes(b"\x00\x01\x02")
    candidate = write(tmp_path / "candidate", {}, template=TEMPLATE.replace("content", "text"))
    (candidate / "tokenizer.model").write_bytes(b"\x00\x01\x03\xff")
    (candidate / "config.json").write_text("{not json")
    (source / "config.json").write_text("{}")
    found = compare_assets(source, candidate, rules)
    details = {(d.file, d.key): d.detail for d in found.differences}
    assert set(details) == {("chat_template.jinja", "line 2"), ("tokenizer.model", ""), ("config.json", "")}
    assert details[("config.json", "")] == "not valid JSON in the candidate"
    assert "3 in the source, 4 here" in details[("tokenizer.model", "")]


def test_a_replaced_vocabulary_is_counted_in_full_and_listed_in_part(tmp_path):
    source = write(tmp_path / "source", {})
    (source / "tokenizer.json").write_text(json.dumps({"vocab": {f"t{i}": i for i in range(100)}}))
    candidate = write(tmp_path / "candidate", {})
    (candidate / "tokenizer.json").write_text(json.dumps({"vocab": {f"t{i}": i + 1 for i in range(100)}}))
    found = compare_assets(source, candidate, AssetRules())
    assert found.summary()["asset_differences"] == 100
    assert (
        len(found.differences) == SHOWN_PER_FILE + 1 and found.differences[-1].detail == "80 more differences"
    )


def test_shipped_rules_skip_tensor_maps_docs_manifests_and_weights(tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "original").mkdir(parents=True)
    for name in (
        "model.safetensors.index.json",
        "README.md",
        "SHA256SUMS",
        "UPLOAD_MANIFEST.json",
        ".gitattributes",
        "model-00001-of-00002.safetensors",
        "original/consolidated.pt",
        "tokenizer.json",
        "processor_config.json",
    ):
        (folder / name).write_text("{}")
    assert asset_files(folder, SHIPPED) == ["processor_config.json", "tokenizer.json"]


def test_loading_only_keys_are_no_difference_but_behaviour_is():
    from evalsuite.tasks.tensors._assets import as_loaded

    source = {"padding_side": "right", "image_token": "<img>", "model_max_length": 512}
    saved = {
        **source,
        "local_files_only": True,
        "is_local": True,
        "_commit_hash": "abc",
        "model_specific_special_tokens": {"image_token": "<img>"},
    }
    assert as_loaded(saved) == as_loaded(source)
    assert as_loaded({**saved, "padding_side": "left"}) != as_loaded(source)
    assert as_loaded({**saved, "model_specific_special_tokens": {"video_token": "<v>"}}) != as_loaded(source)
