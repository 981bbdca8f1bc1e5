"""`evalsuite run --tasks intref` and `--backend intref` on the fixture pairs (the shared tiny run is a child
process; the others run through the CLI's entry point in the test's process)."""

from __future__ import annotations

import json
import math
import re

import pytest
from safetensors import safe_open

from evalsuite.backends.intref import IntrefBackend
from evalsuite.backends.intref_plan import unsupported_reason
from evalsuite.backends.options import BackendOptions
from evalsuite.errors import InputError
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.inputs.corpus import python_docs_text
from tests.conftest import (
    cli_in_process,
    cli_run_in_process,
    config_edited_copy,
    copy_checkpoint,
    edit_tensors,
    rerun,
    weights_only,
    wrong_scale_copy,
)

METRICS = (
    "ppl_ref",
    "ppl_int",
    "ppl_int_ratio",
    "ppl_hf",
    "kld_int_vs_hf",
    "same_top_int_vs_hf",
    "int_layers",
    "int_experts",
)


def routed_experts_in_files(path) -> int:
    """Distinct `…mlp.experts.N` modules whose projections the checkpoint stores quantized."""
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        names = list(fh.keys())
    return len({m.group(0) for n in names if (m := re.match(r".*mlp\.experts\.\d+(?=\..*weight_scale$)", n))})


def intref_metrics(out) -> dict:
    results = json.loads((out / "results.json").read_text())
    return results["tasks"]["intref"]


def test_every_routed_expert_of_the_tiny_pair_runs_on_the_integer_path(tiny_pair, tiny_run):
    entry = tiny_run.task("intref")
    m = entry["metrics"]
    assert entry["status"] == "pass" and all(name in m for name in METRICS)
    config = json.loads((tiny_pair["tiny-minicpmv47-w4a8"] / "config.json").read_text())["text_config"]
    routed = config["num_experts"] * config["num_hidden_layers"]  # every Qwen3.5-MoE layer is an MoE layer
    assert routed == routed_experts_in_files(tiny_pair["tiny-minicpmv47-w4a8"]) == 8
    assert m["int_experts"] == m["int_experts_total"] == routed
    # 3 linear-attention + 4 attention projections, 2 x 3 shared-expert projections, the INT8 lm_head.
    assert m["int_layers"] == m["int_layers_total"] == 14
    assert m["n_scored_tokens"] == 2040
    assert all(math.isfinite(m[k]) for k in ("ppl_int", "ppl_hf", "kld_int_vs_hf"))
    assert m["activation_divisor"] == 127.5 and m["activation_rounding"] == "half_even"


def test_backend_intref_runs_ppl_as_the_intref_task_does(tiny_pair, tiny_run, tmp_path):
    """`--backend intref` gives `ppl` the same integer model: its candidate observation is the very one the
    `intref` task made (same key), so nothing is loaded and ppl_ckpt is ppl_int."""
    args = ("run", "--ckpt", tiny_pair["tiny-minicpmv47-w4a8"], "--ref", tiny_pair["tiny-minicpmv47-bf16"])
    again = rerun(
        tiny_run, tmp_path / "run", *args, "--tasks", "ppl", "--backend", "intref", "--corpus", "python-docs"
    )
    assert again.cli.returncode == 0 and again.loads == [], again.cli.stderr
    m = tiny_run.metrics("intref")
    assert (
        again.metrics("ppl")["ppl_ckpt"] == m["ppl_int"] and again.metrics("ppl")["ppl_ref"] == m["ppl_ref"]
    )
    assert "integer" in again.metrics("ppl")["ckpt_execution"]


def test_moe_runs_on_the_integer_experts_of_backend_intref(tiny_pair, tmp_path):
    """`moe` with `--backend intref`: the integer experts hold buffers, not parameters (an internal error
    once, where the task asked their parameters for a device)."""
    res = cli_run_in_process(
        "run", "--ckpt", tiny_pair["tiny-minicpmv47-w4a8"], "--ref", tiny_pair["tiny-minicpmv47-bf16"],
        "--tasks", "moe", "--backend", "intref", "--corpus", "python-docs", "--out", tmp_path, "--quiet",
        "--no-plots",
    )  # fmt: skip
    assert res.returncode in (0, 1), res.stderr
    entry = json.loads((tmp_path / "results.json").read_text())["tasks"]["moe"]
    assert entry["status"] in ("pass", "fail") and 0 < entry["metrics"]["mean_topk_overlap"] <= 1


def test_a_recorded_reference_replays_the_live_intref_run(tiny_run, tiny_replay):
    live, replay = tiny_run.metrics("intref"), tiny_replay.metrics("intref")
    for name in ("ppl_ref", "ppl_int", "ppl_hf", "kld_int_vs_hf", "same_top_int_vs_hf", "int_experts"):
        assert replay[name] == live[name], name
    assert replay["kld_int_mean"] == pytest.approx(live["kld_int_mean"], rel=0.05)
    assert "recording" in replay["kld_int_estimator"]


def test_a_candidate_without_integer_weights_is_skipped_with_the_reason(tiny_pair, tmp_path):
    bf16 = tiny_pair["tiny-minicpmv47-bf16"]
    res = cli_run_in_process(
        "run", "--ckpt", bf16, "--ref", bf16, "--tasks", "intref", "--out", tmp_path, "--quiet"
    )
    assert res.returncode == 2  # nothing was compared
    entry = intref_metrics(tmp_path)
    assert entry["status"] == "skipped"
    assert "compressed-tensors" in entry["reason"] and "bf16" in entry["reason"]
    assert "loading" not in res.stderr  # decided from the files, no model loaded


def test_forcing_backend_intref_on_a_bf16_candidate_is_an_input_error(tiny_pair, tmp_path):
    bf16 = tiny_pair["tiny-minicpmv47-bf16"]
    text = tmp_path / "short.txt"  # the reference is observed before the candidate fails: keep it short
    text.write_text(python_docs_text()[:10_000])
    res = cli_run_in_process(
        "run",
        "--ckpt",
        bf16,
        "--ref",
        bf16,
        "--tasks",
        "ppl",
        "--backend",
        "intref",
        "--text-file",
        text,
        "--out",
        tmp_path / "run",
        "--quiet",
    )
    assert res.returncode == 2
    assert any("intref executes compressed-tensors" in line for line in res.error_lines), res.stderr


def test_a_tensor_missing_from_the_files_is_refused_not_left_random(tiny_pair, tmp_path):
    broken = copy_checkpoint(tiny_pair["tiny-minicpmv47-w4a8"], tmp_path / "no-final-norm")
    edit_tensors(broken, lambda tensors: tensors.pop("model.language_model.norm.weight"))
    with pytest.raises(InputError, match=r"1 tensors missing from the files \(model\.language_model\.norm"):
        IntrefBackend(Checkpoint.open(broken), BackendOptions(backend="intref"))


def edited_config(src, dst, edit) -> Checkpoint:
    """A copy of a fixture checkpoint whose quantization_config went through `edit`, opened."""
    return Checkpoint.open(config_edited_copy(src, dst, edit))


def test_a_layer_the_config_quantizes_but_the_files_store_dense_is_refused(tiny_pair, tmp_path):
    """PLATFORM.md's trap: an unanchored target also names the vision tower's attention, stored dense."""

    def unanchor(qc):
        qc["config_groups"]["int4_attention"]["targets"][0] = r"re:.*self_attn\.(q|k|v|o)_proj$"
        qc["ignore"] = []

    checkpoint = edited_config(tiny_pair["tiny-minicpmv47-w4a8"], tmp_path / "unanchored", unanchor)
    with pytest.raises(
        InputError, match=r"quantizes model\.vision_tower\..*self_attn.*the files store it unquantized"
    ):
        IntrefBackend(checkpoint, BackendOptions(backend="intref"))


def test_weight_only_quantization_runs_with_intrefs_own_activations(tiny_pair, tmp_path):
    """A W4A16 scheme has integer weights: intref runs it, quantizing activations itself, and says so."""
    from evalsuite.backends.intref_plan import integer_modules

    checkpoint = edited_config(tiny_pair["tiny-minicpmv47-w4a8"], tmp_path / "w4a16", weights_only)
    assert unsupported_reason(checkpoint) is None
    assert all(m.weight_only for m in integer_modules(checkpoint).values())


def test_float_weights_have_no_integer_path(tiny_pair, tmp_path):
    def fp8(qc):
        for group in qc["config_groups"].values():
            group["weights"]["type"] = "float"

    checkpoint = edited_config(tiny_pair["tiny-minicpmv47-w4a8"], tmp_path / "fp8", fp8)
    assert "not FP8 or FP4" in unsupported_reason(checkpoint)


@pytest.mark.slow
def test_smollm2_pair_passes_intref_with_every_layer_integer(smollm2_demo_rerun):
    entry = smollm2_demo_rerun.task("intref")
    assert entry["status"] == "pass", entry  # under the demo's thresholds (the shipped defaults fail it)
    m = entry["metrics"]
    assert m["int_layers"] == m["int_layers_total"] == 30 * 7 and m["int_experts"] == 0
    assert 1.0 < m["ppl_int_ratio"] < 1.7
    # One W4A8 model executed twice: they differ by rounding, which W4A8 amplifies (see intref.toml).
    assert abs(math.log(m["ppl_int"] / m["ppl_hf"])) < 0.05 and m["same_top_int_vs_hf"] > 0.8


def test_intref_checks_fail_on_a_candidate_built_to_fail_them(tiny_pair, tiny_run, tmp_path):
    """Every weight scale ×4: bounds the good tiny copy meets (1.0008, 1.5e-6, 0.978) all fail, and so do the
    bounds beyond the `hf` execution's own rounding floor (the shipped top-token one; the KLD one tightened to
    the tiny pair's scale)."""
    broken = wrong_scale_copy(tiny_pair["tiny-minicpmv47-w4a8"], tmp_path / "wrong-scale")
    bounds = tmp_path / "tiny.toml"
    bounds.write_text(
        "[intref]\nppl_int_ratio = { max = 1.01 }\nkld_int_vs_hf = { max = 1e-4 }\n"
        "same_top_int_vs_hf = { min = 0.95 }\nkld_int_vs_hf_above_floor = { max = 1e-4 }\n"
    )
    args = (
        "--ref",
        tiny_pair["tiny-minicpmv47-bf16"],
        "--tasks",
        "intref",
        "--corpus",
        "python-docs",
        "--thresholds",
        bounds,
        "--quiet",
    )
    good = rerun(tiny_run, tmp_path / "good", "run", "--ckpt", tiny_pair["tiny-minicpmv47-w4a8"], *args[:-1])
    bad = cli_run_in_process("run", "--ckpt", broken, "--out", tmp_path / "bad", *args)
    assert good.cli.returncode == 0 and good.loads == [], good.cli.stderr
    assert bad.returncode == 1, bad.stderr
    checks = json.loads((tmp_path / "bad" / "results.json").read_text())["tasks"]["intref"]["checks"]
    assert {c["name"] for c in checks if not c["passed"]} == {
        "ppl_int_ratio",
        "kld_int_vs_hf",
        "same_top_int_vs_hf",
        "kld_int_vs_hf_above_floor",
        "same_top_int_vs_hf_below_floor",
    }


@pytest.mark.parametrize(
    ("task", "table", "value"),
    [("intref", "hf_floor", "0.0"), ("intref", "hf_floor", "1.5"), ("ppl", "noise_floor", "-0.001")],
)
def test_a_noise_floor_scale_that_is_no_rounding_is_refused_naming_the_file(
    tiny_pair, tmp_path, task, table, value
):
    from evalsuite.contract.spec import default_spec_path

    text = default_spec_path(task).read_text()
    if f"[{table}]" in text:
        text = re.sub(rf"(\[{table}\][^\[]*?)scale = [^\n#]+", rf"\g<1>scale = {value}", text, count=1)
    else:
        text += f"\n[{table}]\nscale = {value}\n"
    assert f"scale = {value}" in text
    spec = tmp_path / f"{task}.toml"
    spec.write_text(text)
    pair = (tiny_pair["tiny-minicpmv47-w4a8"], tiny_pair["tiny-minicpmv47-bf16"])
    args = ("run", "--ckpt", pair[0], "--ref", pair[1], "--tasks", task, "--spec", f"{task}={spec}")
    code, errors, _ = cli_in_process(*args, "--out", tmp_path / "out", "--quiet")
    assert code == 2 and len(errors) == 1, errors
    assert str(spec) in errors[0] and "scale" in errors[0], errors
    assert not (tmp_path / "out" / "results.json").exists()
