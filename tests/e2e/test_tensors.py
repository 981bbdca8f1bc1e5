"""Task `tensors` through the CLI: the fixture pairs pass with the counts their recipes wrote, and every
broken candidate built here from a good one fails with the tensor named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from evalsuite.backends.options import BackendOptions
from evalsuite.contract.spec import default_spec_path, load_spec
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import MANIFEST_NAME, read_manifest
from evalsuite.protocol.side import Side
from evalsuite.protocol.task import RunContext, TaskSkipped
from evalsuite.tasks.tensors import Tensors, TensorsSpec
from tests.conftest import cli_in_process, copy_checkpoint, edit_tensors

TINY_BF16, TINY_W4A8 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8"


def run_tensors(ckpt: Path, ref: Path, out: Path) -> tuple[int, dict, str]:
    """Exit code, the `tensors` entry of results.json (empty when none was written) and stderr."""
    # A file-only task: through the CLI's entry point in this process (no model, no interpreter start-up).
    code, err, _ = cli_in_process(
        "run", "--ckpt", ckpt, "--ref", ref, "--tasks", "tensors", "--out", out, "--quiet"
    )
    path = out / "results.json"
    entry = json.loads(path.read_text())["tasks"]["tensors"] if path.is_file() else {}
    return code, entry, "\n".join(err)


def failed_checks(entry: dict) -> set[str]:
    return {c["name"] for c in entry["checks"] if not c["passed"]}


def named(entry: dict, check: str) -> dict[str, str]:
    """The problems of one kind in results.json's details, by tensor."""
    return {d["tensor"]: d["detail"] for d in entry.get("details", []) if d.get("check") == check}


def assert_counts_match_the_manifest(entry: dict, fixture: Path) -> None:
    counts = read_manifest(fixture)["counts"]
    m = entry["metrics"]
    assert m["source_tensors"] == counts["source_tensors"]
    assert m["protected_total"] == m["protected_identical"] == counts["protected_tensors"]
    assert m["quantized_int4"] == counts["int4_projections"]
    assert m["quantized_int8"] == counts["int8_projections"]
    assert (m["quantized_other"], m["missing"], m["unexpected"], m["config_mismatches"]) == (0, 0, 0, 0)
    assert m["decode_exact"] is True
    stored = sum(info.nbytes for info in Checkpoint.open(fixture).tensors.values())
    assert m["payload_bytes"] == stored


# ----------------------------------------------------------------------------------------------------------
# The fixture pairs
# ----------------------------------------------------------------------------------------------------------


def test_tiny_pair_counts_match_what_the_recipe_wrote(tiny_pair, tmp_path):
    code, entry, err = run_tensors(tiny_pair[TINY_W4A8], tiny_pair[TINY_BF16], tmp_path)
    assert code == 0, err
    assert entry["status"] == "pass"
    assert_counts_match_the_manifest(entry, tiny_pair[TINY_W4A8])
    m = entry["metrics"]
    assert 0.01 < m["worst_rel_err"] < 0.2 and m["worst_channel_rel_err"] < 1
    table = json.loads((tmp_path / entry["artifacts"]["tensors"]).read_text())
    assert len(table["tensors"]) == m["source_tensors"]
    assert {r["tensor_class"] for r in table["tensors"]} == {"quantized", "protected"}
    assert (tmp_path / entry["artifacts"]["rel_err_map"]).stat().st_size > 0


@pytest.mark.slow
def test_smollm2_pair_counts_match_what_the_recipe_wrote(smollm2_pair, tmp_path):
    code, entry, err = run_tensors(
        smollm2_pair["smollm2-135m-w4a8"], smollm2_pair["smollm2-135m-bf16"], tmp_path
    )
    assert code == 0, err
    assert_counts_match_the_manifest(entry, smollm2_pair["smollm2-135m-w4a8"])
    assert entry["metrics"]["avg_bits_per_weight"] == 5.0  # INT4 MLP and INT8 attention, by element count


# ----------------------------------------------------------------------------------------------------------
# Broken candidates, each built from the good tiny one
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def candidate(tiny_pair, tmp_path) -> Path:
    """A writable copy of the good tiny W4A8 candidate, without its fixture manifest."""
    path = copy_checkpoint(tiny_pair[TINY_W4A8], tmp_path / "candidate")
    (path / MANIFEST_NAME).unlink()
    return path


def edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


@pytest.mark.parametrize(
    "tensor",
    [
        "model.language_model.embed_tokens.weight",
        "model.vision_tower.encoder.layers.0.mlp.fc1.weight",
        "model.language_model.norm.weight",
    ],
)
def test_one_flipped_bit_in_a_protected_tensor_fails_naming_it(tiny_pair, candidate, tmp_path, tensor):
    info = Checkpoint.open(candidate).tensors[tensor]
    with open(info.shard, "r+b") as f:
        f.seek(info.data_begin + 6)  # the low byte of element 3
        byte = f.read(1)[0]
        f.seek(info.data_begin + 6)
        f.write(bytes([byte ^ 0x01]))
    code, entry, _ = run_tensors(candidate, tiny_pair[TINY_BF16], tmp_path / "run")
    assert code == 1
    assert failed_checks(entry) == {"protected_identical"}
    assert entry["metrics"]["protected_identical"] == entry["metrics"]["protected_total"] - 1
    problems = named(entry, "protected")
    assert list(problems) == [tensor]
    element = "[0, 3]" if len(info.shape) == 2 else "[3]"
    assert f"first differing element {element}" in problems[tensor]


def test_one_changed_scale_fails_naming_the_tensor(tiny_pair, candidate, tmp_path):
    module = "model.language_model.layers.1.self_attn.q_proj"

    def scale_one_channel(tensors):
        tensors[f"{module}.weight_scale"][5] *= 4

    edit_tensors(candidate, scale_one_channel)
    code, entry, _ = run_tensors(candidate, tiny_pair[TINY_BF16], tmp_path / "run")
    assert code == 1
    assert "worst_channel_gain_err" in failed_checks(entry)
    m = entry["metrics"]
    assert m["worst_channel_rel_err_tensor"] == f"{module}.weight (output channel 5)"
    assert m["worst_channel_rel_err"] == pytest.approx(3.0, rel=0.2)  # ×4 scale: error 3× the channel
    assert m["worst_channel_err_tensor"] == f"{module}.weight (output channel 5)"
    assert m["worst_channel_err"] > 1.5  # 3× a channel of about the tensor's RMS norm
    # all of it along the channel itself: its gain is off by 3 (less where the channel is under the RMS norm)
    assert m["worst_channel_gain_err"] > 1.5
    assert m["decode_exact"] is True  # both decoders read the same (wrong) scale
    assert list(named(entry, "worst_channel_gain_err")) == [f"{module}.weight (output channel 5)"]


def test_every_scale_of_one_expert_a_fifth_too_large_fails_as_an_outlier_among_its_siblings(
    tiny_pair, candidate, tmp_path
):
    # One expert's scales all 1.2× theirs: its channels stay alike and its error (about 0.23) stays under
    # every absolute bound, but it is twice that of the other down projections of the experts (`outlier`).
    module = "model.language_model.layers.0.mlp.experts.1.down_proj"

    def scale_the_tensor(tensors):
        tensors[f"{module}.weight_scale"] *= 1.2

    edit_tensors(candidate, scale_the_tensor)
    code, entry, _ = run_tensors(candidate, tiny_pair[TINY_BF16], tmp_path / "run")
    assert code == 1
    assert failed_checks(entry) == {"outlier_tensors"}
    assert entry["metrics"]["worst_sibling_z_tensor"] == f"{module}.weight"
    detail = named(entry, "outlier")[f"{module}.weight"]
    assert "the median" in detail and "mlp.experts.*.down_proj tensors of its scheme" in detail


def test_one_dropped_tensor_fails_naming_it(tiny_pair, candidate, tmp_path):
    tensor = "model.language_model.layers.0.mlp.gate.weight"
    edit_tensors(candidate, lambda tensors: tensors.pop(tensor))
    code, entry, _ = run_tensors(candidate, tiny_pair[TINY_BF16], tmp_path / "run")
    assert code == 1
    assert failed_checks(entry) == {"missing"}
    assert list(named(entry, "missing")) == [tensor]


def test_one_dropped_weight_scale_fails_naming_the_module(tiny_pair, candidate, tmp_path):
    module = "model.language_model.layers.0.mlp.experts.2.up_proj"
    edit_tensors(candidate, lambda tensors: tensors.pop(f"{module}.weight_scale"))
    code, entry, _ = run_tensors(candidate, tiny_pair[TINY_BF16], tmp_path / "run")
    assert code == 1
    assert "config_mismatches" in failed_checks(entry)
    assert "stores weight_packed but no weight_scale" in named(entry, "config")[f"{module}.weight"]


def test_one_extra_tensor_fails_naming_it(tiny_pair, candidate, tmp_path):
    tensor = "model.language_model.layers.0.mlp.extra_bias"
    edit_tensors(candidate, lambda tensors: tensors.update({tensor: torch.zeros(64, dtype=torch.bfloat16)}))
    code, entry, _ = run_tensors(candidate, tiny_pair[TINY_BF16], tmp_path / "run")
    assert code == 1
    assert failed_checks(entry) == {"unexpected"}
    assert named(entry, "unexpected") == {tensor: "BF16 [64] pairs with no source tensor"}


def test_a_group_whose_targets_no_longer_match_what_is_stored_fails_naming_the_tensors(
    tiny_pair, candidate, tmp_path
):
    # o_proj is stored INT4, but the attention group no longer targets it.
    def drop_o_proj(config):
        targets = config["quantization_config"]["config_groups"]["int4_attention"]["targets"]
        targets[0] = targets[0].replace("(q|k|v|o)", "(q|k|v)")

    edit_config(candidate, drop_o_proj)
    code, entry, _ = run_tensors(candidate, tiny_pair[TINY_BF16], tmp_path / "run")
    assert code == 1
    assert failed_checks(entry) == {"config_mismatches"}
    problems = named(entry, "config")
    assert problems == {
        "model.language_model.layers.1.self_attn.o_proj.weight": (
            "stored as pack-quantized, but no config group targets it"
        )
    }


def test_a_group_targeting_the_vision_tower_it_does_not_quantize_fails(tiny_pair, candidate, tmp_path):
    # The trap of PLATFORM.md: an unanchored target and no ignore entry reach the BF16 vision attention.
    def unanchor(config):
        qc = config["quantization_config"]
        qc["config_groups"]["int4_attention"]["targets"][0] = r"re:.*self_attn\.(q|k|v|o)_proj$"
        qc["ignore"] = [r"re:.*merger.*"]

    edit_config(candidate, unanchor)
    code, entry, _ = run_tensors(candidate, tiny_pair[TINY_BF16], tmp_path / "run")
    assert code == 1
    problems = named(entry, "config")
    q_proj = "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"
    assert problems[q_proj].startswith("config group `int4_attention` says int4 pack-quantized channel, but")
    fc1 = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"
    assert problems[fc1] == (
        "a Linear left unquantized: no config group targets it and no `ignore` entry names it"
    )


def test_a_group_whose_bits_disagree_with_the_stored_codes_fails(tiny_pair, candidate, tmp_path):
    def eight_bits(config):
        config["quantization_config"]["config_groups"]["int4_routed_experts"]["weights"]["num_bits"] = 8

    edit_config(candidate, eight_bits)
    code, entry, _ = run_tensors(candidate, tiny_pair[TINY_BF16], tmp_path / "run")
    assert code == 1
    expert = "model.language_model.layers.0.mlp.experts.0.gate_proj.weight"
    assert named(entry, "config")[expert] == (
        "stored as int4 pack-quantized channel, but config group `int4_routed_experts` says "
        "int8 pack-quantized channel"
    )
    assert entry["metrics"]["config_mismatches"] == 24  # 2 layers × 4 experts × 3 projections


# ----------------------------------------------------------------------------------------------------------
# Sides that cannot be compared
# ----------------------------------------------------------------------------------------------------------


def test_another_architecture_is_refused_in_one_line(tiny_pair, candidate, tmp_path):
    edit_config(
        candidate, lambda config: config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    )
    code, _, err = run_tensors(candidate, tiny_pair[TINY_BF16], tmp_path / "run")
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "architecture" in lines[0] and "not a copy of that source" in lines[0]


def test_another_vocabulary_is_refused_in_one_line(tiny_pair, candidate, tmp_path):
    edit_config(candidate, lambda config: config["text_config"].update(vocab_size=520))
    code, _, err = run_tensors(candidate, tiny_pair[TINY_BF16], tmp_path / "run")
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "vocabulary size (520) differs from the reference's (512)" in lines[0]


def test_a_recorded_reference_is_skipped_with_its_reason(tiny_pair):
    spec = load_spec(TensorsSpec, default_spec_path("tensors"))
    task = Tensors(spec, RunContext())
    recorded = Side("ref", BackendOptions(), recording=object())
    ckpt = Side("ckpt", BackendOptions(), checkpoint=Checkpoint.open(tiny_pair[TINY_W4A8]))
    with pytest.raises(TaskSkipped, match="recording, which holds no tensors"):
        task.prepare(recorded, ckpt)


def test_a_plain_linear_target_on_an_moe_model_never_takes_its_routers(tiny_pair, candidate, tmp_path):
    """llm-compressor's layout for an MoE model: one `targets: ["Linear"]` group (and a more specific one), an
    ignore list without the routers. Targets are matched on the model Transformers builds, where the router is
    no Linear, so no router is said to be targeted; a stand-in Linear would have said so for each of them."""
    from evalsuite.formats.compressed_tensors import SchemeLookup
    from evalsuite.tasks.tensors._verification._modules import skeleton_modules

    config = json.loads((candidate / "config.json").read_text())
    qc = config["quantization_config"]
    groups = qc["config_groups"]
    int8 = groups["int8_shared_experts_lm_head"]
    int4 = groups["int4_attention"]
    qc["config_groups"] = {
        "int8": {**int8, "targets": [r"re:.*mlp\.shared_expert\.(gate|up|down)_proj$", "lm_head"]},
        "int4": {**int4, "targets": ["Linear"]},
    }
    qc["ignore"] = [
        r"re:.*vision_tower.*",
        r"re:.*merger.*",
        r"re:.*shared_expert_gate$",
        r"re:.*in_proj_(a|b)$",
    ]
    (candidate / "config.json").write_text(json.dumps(config))
    code, entry, err = run_tensors(candidate, tiny_pair[TINY_BF16], tmp_path / "run")
    assert code == 0, (err, entry.get("details"))
    assert entry["metrics"]["config_mismatches"] == 0
    router = "model.language_model.layers.0.mlp.gate"
    lookup = SchemeLookup(qc)
    assert lookup.covering(router, "router").group == "int4"  # what a stand-in Linear would claim
    skeleton = skeleton_modules(Checkpoint.open(candidate))
    assert lookup.covering(router, "router", skeleton[router]).group is None
