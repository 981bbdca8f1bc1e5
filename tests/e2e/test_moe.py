"""Task `moe` through the CLI (in process), on copies of the tiny MiniCPM-V 4.7 BF16 fixture (2 MoE layers of
4 routed experts, top 2, and a shared expert) built to be caught, all against one recording of the reference:

- a copy with the same tensors: top-k overlap 1 and expert error 0 everywhere;
- a copy with layer 1 expert 3's weights ×1.5: that expert is named worst and first of the hot-and-hurt table,
  every other expert's error exactly 0; routing untouched;
- a copy with layer 1's router weights perturbed by seeded noise: layer 1's overlap is the lowest (layer 0's
  is exactly 1), and the expert errors stay 0 (they are measured on the reference's routing);
- the W4A8 pack (compressed-tensors): its BF16 router routes the reference's router input identically, its
  INT4 routed experts carry an error of their own, its INT8 shared expert a smaller one;
- calibration coverage read from the candidate's folder, joined with usage and damage; a malformed file is
  refused before any model loads; a dense model is skipped with its reason;
- the EXL3 pack, once its side can be streamed (skipped until then, saying so).
"""

from __future__ import annotations

import csv
import json
import tomllib
from pathlib import Path

import pytest

from tests.conftest import assert_refused, cli_in_process, copy_checkpoint, edit_tensors, rerun, run_pair

BF16, W4A8, EXL3 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-w4a8", "tiny-minicpmv47-exl3"
SPEC = """
[protocol]
window = 512
starts = { first = 0, step = 4096, count = 2 }
scored = { first = 256, last = 510 }
[thresholds]
mean_topk_overlap = { min = 0.99 }
"""
SPEC_FILE = Path(__file__).parents[2] / "tasks" / "moe.toml"
SHIPPED_MOE_TOLERANCES = tuple(tomllib.loads(SPEC_FILE.read_text(encoding="utf-8"))["regression"])
LAYER1 = "model.language_model.layers.1.mlp."
PERTURBED_EXPERT = "layer 1 expert 3"  # hot: the reference routes more than the uniform share to it


def run_moe(ckpt: Path, ref: Path, out: Path, spec: Path) -> tuple[int, dict]:
    code, lines, _ = cli_in_process(
        "run", "--ref", ref, "--ckpt", ckpt, "--tasks", "moe", "--corpus", "python-docs", "--spec",
        f"moe={spec}", "--out", out, "--quiet",
    )  # fmt: skip
    assert code in (0, 1), lines
    return code, json.loads((out / "results.json").read_text())["tasks"]["moe"]


def expert_copy(src: Path, dst: Path, expert: int = 3) -> Path:
    copy_checkpoint(src, dst)
    prefix = LAYER1 + f"experts.{expert}."
    edit_tensors(
        dst,
        lambda t: t.update({k: (v.float() * 1.5).to(v.dtype) for k, v in t.items() if k.startswith(prefix)}),
    )
    return dst


def router_copy(src: Path, dst: Path) -> Path:
    import torch

    copy_checkpoint(src, dst)

    def perturb(tensors: dict) -> None:
        weight = tensors[LAYER1 + "gate.weight"].float()
        noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
        tensors[LAYER1 + "gate.weight"] = (weight + 2.0 * weight.std() * noise).to(torch.bfloat16)

    edit_tensors(dst, perturb)
    return dst


@pytest.fixture(scope="module")
def moe_recording(tiny_pair, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny BF16 reference recorded for `moe`, and the spec it was recorded with."""
    root = tmp_path_factory.mktemp("moe-rec")
    spec = root / "moe.toml"
    spec.write_text(SPEC)
    rec = root / "rec"
    code, lines, _ = cli_in_process(
        "record", "--ckpt", tiny_pair[BF16], "--tasks", "moe", "--corpus", "python-docs", "--spec",
        f"moe={spec}", "--out", rec, "--quiet",
    )  # fmt: skip
    assert code == 0, lines
    return rec, spec


@pytest.fixture(scope="module")
def moe_runs(tiny_pair, moe_recording, tmp_path_factory) -> dict[str, tuple[int, dict]]:
    root = tmp_path_factory.mktemp("moe")
    rec, spec = moe_recording
    expert = expert_copy(tiny_pair[BF16], root / "expert")
    (expert / "calibration_coverage.json").write_text(
        json.dumps(
            {
                "schema": "evalsuite.calibration-coverage/1",
                "tokens": {"0.0": 100, "0.1": 100, "0.2": 100, "0.3": 100, "1.0": 40.5, "1.2": 100, "1.3": 1},
            }
        )
    )
    copies = {
        "same": copy_checkpoint(tiny_pair[BF16], root / "same"),
        "expert": expert,
        "router": router_copy(tiny_pair[BF16], root / "router"),
        "w4a8": tiny_pair[W4A8],
    }
    runs = {name: run_moe(ckpt, rec, root / f"out-{name}", spec) for name, ckpt in copies.items()}
    runs["recording"] = (0, json.loads((rec / "manifest.json").read_text()))
    return runs


def layer_rows(result: dict) -> list[dict]:
    return [row for row in result["details"] if row["table"].startswith("routing per MoE layer")]


def expert_rows(result: dict) -> list[dict]:
    return [row for row in result["details"] if row["table"].startswith("hot and hurt")]


def test_a_copy_with_the_same_tensors_routes_identically_with_zero_expert_error(moe_runs):
    code, moe = moe_runs["same"]
    m = moe["metrics"]
    assert code == 0 and moe["status"] == "pass"
    assert m["n_moe_layers"] == 2 and m["top_k"] == 2 and m["n_tokens"] == 2 * 512
    for name in ("mean_topk_overlap", "own_mean_topk_overlap", "router_mean_topk_overlap"):
        assert m[name] == 1.0
    assert m["worst_layer_topk_overlap"] == 1.0 and m["mean_top1_agreement"] == 1.0
    assert m["mean_mass_on_ref_experts"] == 1.0 and m["mean_router_kl"] == 0.0
    assert m["worst_expert_rel_err"] == 0.0 and m["worst_shared_expert_rel_err"] == 0.0
    assert m["hot_hurt_experts"] == 0 and m["experts_unused"] == 0
    for row in layer_rows(moe):
        assert row["topk_overlap"] == row["own_topk_overlap"] == row["router_alone_topk_overlap"] == 1.0
        assert row["worst_expert_rel_err"] == 0.0 and row["shared_expert_rel_err"] == 0.0
    rows = expert_rows(moe)
    assert len(rows) == 8 and all(
        row["rel_err"] == 0.0 and row["cosine"] == pytest.approx(1.0) for row in rows
    )
    assert sum(row["tokens"] for row in rows) == 2 * 2 * 1024  # every token to k experts in each layer
    assert (
        m["coverage_below_floor"] is None
        and "calibration coverage" in moe["null_reasons"]["coverage_below_floor"]
    )
    assert moe["artifacts"]["expert_rel_err"].endswith(".png")


def test_the_reference_is_replayed_from_its_recording(moe_runs):
    manifest = moe_runs["recording"][1]
    assert set(manifest["observations"]) == {"moe-reference"}
    assert moe_runs["same"][1]["metrics"]["ref_bytes_per_token"] == 3 * 64 * 2 + 2 * (
        (2 + 2) * 64 * 2 + 8 * 4
    )


def test_a_perturbed_expert_is_named_first_and_no_other_expert_has_an_error(moe_runs):
    code, moe = moe_runs["expert"]
    m = moe["metrics"]
    assert code == 0  # the routing threshold passes: expert damage is for reading, not gated by default
    assert m["worst_expert"] == PERTURBED_EXPERT and m["worst_expert_rel_err"] > 0.1
    rows = expert_rows(moe)
    assert rows[0]["expert"] == PERTURBED_EXPERT and rows[0]["hot"] and rows[0]["hurt"]
    assert all(row["rel_err"] == 0.0 for row in rows[1:])
    assert m["hot_hurt_experts"] == 1
    # Routing is untouched: layer 1's router sees the reference's input, and layer 0 is the reference's.
    assert m["mean_topk_overlap"] == 1.0 and m["router_mean_topk_overlap"] == 1.0
    assert m["worst_shared_expert_rel_err"] == 0.0


def test_calibration_coverage_flags_the_experts_below_the_floor_and_whether_they_are_hurt(moe_runs):
    _, moe = moe_runs["expert"]
    m = moe["metrics"]
    assert m["coverage_below_floor"] == 2  # 1.3 (1 token) and 1.1 (not listed: none)
    assert m["coverage_hot_hurt_below_floor"] == 1  # 1.3 is the hurt one
    flagged = {
        row["expert"]: row for row in moe["details"] if row["table"].startswith("calibration coverage")
    }
    assert set(flagged) == {"layer 1 expert 1", "layer 1 expert 3"}
    assert flagged["layer 1 expert 3"]["calibration_tokens"] == 1 and flagged["layer 1 expert 3"]["hurt"]
    assert flagged["layer 1 expert 1"]["calibration_tokens"] == 0 and not flagged["layer 1 expert 1"]["hurt"]
    assert expert_rows(moe)[0]["below_floor"] and expert_rows(moe)[0]["calibration_tokens"] == 1


def test_a_perturbed_router_puts_its_layer_lowest(moe_runs):
    code, moe = moe_runs["router"]
    m = moe["metrics"]
    first, second = layer_rows(moe)
    assert m["worst_layer"] == 1 and m["worst_layer_topk_overlap"] == second["topk_overlap"] < 0.9
    assert first["topk_overlap"] == first["own_topk_overlap"] == 1.0  # layer 0 is the reference's own
    assert second["router_alone_topk_overlap"] == second["topk_overlap"]  # the router alone is to blame
    assert second["router_kl"] > 0 and second["mass_on_ref_experts"] < 1.0
    assert m["worst_expert_rel_err"] == 0.0  # the experts themselves are the reference's
    assert code == 1 and [c["name"] for c in moe["checks"] if not c["passed"]] == ["mean_topk_overlap"]


def test_the_w4a8_pack_routes_with_its_bf16_router_and_its_int4_experts_carry_the_error(moe_runs):
    _, moe = moe_runs["w4a8"]
    m = moe["metrics"]
    assert m["router_mean_topk_overlap"] == 1.0  # the router is stored BF16, fed the reference's input
    assert 0.9 < m["mean_topk_overlap"] < 1.0  # INT4 attention shifts the router's input
    assert 0.05 < m["worst_expert_rel_err"] < 0.5
    assert 0 < m["worst_shared_expert_rel_err"] < m["median_expert_rel_err"]  # INT8 against INT4


def test_an_exl3_pack_is_compared_once_its_side_can_be_streamed(tiny_exl3_pair, moe_recording, tmp_path):
    rec, spec = moe_recording
    code, lines, _ = cli_in_process(
        "run", "--ref", rec, "--ckpt", tiny_exl3_pair[EXL3], "--tasks", "moe", "--corpus", "python-docs",
        "--spec", f"moe={spec}", "--out", tmp_path / "out", "--quiet",
    )  # fmt: skip
    if code == 2 and "tensors missing from the files" in lines[-1]:
        # Today's streamed execution reads Transformers' own tensors only; streamed EXL3 (its Linears
        # decoded as each layer loads) comes with the EXL3 backend's streaming.
        pytest.skip("streamed execution of an EXL3 side is not available in this tree")
    assert code in (0, 1), lines
    m = json.loads((tmp_path / "out" / "results.json").read_text())["tasks"]["moe"]["metrics"]
    assert m["n_moe_layers"] == 2 and m["worst_expert"].startswith("layer ")
    assert 0 < m["worst_expert_rel_err"] < 1 and 0.5 < m["mean_topk_overlap"] <= 1


def expert_csv(out: Path) -> dict[str, dict[str, str]]:
    with (out / "artifacts" / "moe_experts.csv").open(encoding="utf-8") as fh:
        return {f"layer {row['layer']} expert {row['expert']}": row for row in csv.DictReader(fh)}


def test_every_worst_expert_rests_on_at_least_the_spec_s_minimum_of_tokens(moe_runs):
    for name, (_, moe) in moe_runs.items():
        if name == "recording":
            continue
        m = moe["metrics"]
        assert m["worst_expert_measured_tokens"] >= m["min_expert_tokens"] == 32, name
        assert (
            m["n_fed_tokens"] == 1024
            and "on the fed windows 0, 1 of 2: 1,024 tokens" in (moe["descriptions"]["mean_topk_overlap"])
        ), name


def test_an_expert_measured_on_fewer_tokens_than_the_minimum_is_counted_apart_never_named_worst(
    tiny_pair, tmp_path
):
    """Built to fail the former rule (the worst of every expert measured at all): on one fed window, layer 1
    expert 1 is routed fewer tokens than a minimum of 250, and is the one expert perturbed."""
    spec = tmp_path / "few.toml"
    spec.write_text(SPEC + "[fed]\nwindows = 1\n[compare]\nmin_expert_tokens = 250\n")
    few = "layer 1 expert 1"
    ckpt = expert_copy(tiny_pair[BF16], tmp_path / "few", expert=1)
    code, moe = run_moe(ckpt, tiny_pair[BF16], tmp_path / "out", spec)
    m, rows = moe["metrics"], expert_csv(tmp_path / "out")
    measured = {name: int(row["measured_tokens"]) for name, row in rows.items()}
    assert 0 < measured[few] < 250 and float(rows[few]["rel_err"]) > 0.1  # the largest error, on few tokens
    assert all(float(row["rel_err"]) == 0.0 for name, row in rows.items() if name != few)
    assert m["worst_expert"] != few and m["worst_expert_measured_tokens"] >= 250
    assert m["experts_few_tokens"] == sum(1 for t in measured.values() if 0 < t < 250) >= 1
    assert m["experts_hurt"] == 0 and rows[few]["judged"] == "False" and rows[few]["hurt"] == "False"
    assert few not in {row["expert"] for row in expert_rows(moe)}
    assert "fed windows 0 of 2: 512 tokens per MoE layer" in moe["descriptions"]["worst_expert"]
    assert code == 0


def test_a_baseline_made_under_another_fed_setting_is_not_compared_on_the_moe_metrics(tiny_pair, tmp_path):
    """A baseline measured with `[fed] windows = 8`, a run with the shipped 2: every moe tolerance is listed
    as not comparable (with the windows each measured on), never compared; ppl's are compared. A baseline of
    the run's own identity is compared on every one."""
    from evalsuite.reporting.model_card import render_model_card

    spec = tmp_path / "fed8.toml"
    spec.write_text(SPEC_FILE.read_text(encoding="utf-8").replace("windows = 2 ", "windows = 8 "))
    base = run_pair(tiny_pair[W4A8], tiny_pair[BF16], tmp_path / "base", "ppl,moe", "--spec", f"moe={spec}")
    assert base.cli.returncode == 0, base.cli.stderr
    assert base.metrics("moe")["fed_windows"] == "0, 1, 2, 3, 4, 5, 6, 7"
    args = ("run", "--ckpt", tiny_pair[W4A8], "--ref", tiny_pair[BF16], "--tasks", "ppl,moe")
    args += ("--corpus", "python-docs", "--baseline", base.out / "results.json")
    again = rerun(base, tmp_path / "again", *args)
    assert again.cli.returncode == 0, again.cli.stderr
    moe, ppl = again.task("moe"), again.task("ppl")
    assert set(moe["not_comparable"]) == set(SHIPPED_MOE_TOLERANCES)
    assert not [c for c in moe["checks"] if c["name"].endswith("_vs_baseline")]
    why = moe["not_comparable"]["mean_topk_overlap"]
    assert "it on the fed windows 0, 1, 2, 3, 4, 5, 6, 7 of 8: 4,096 tokens" in why
    assert "this run on the fed windows 0, 7 of 8: 1,024 tokens" in why
    compared = {c["name"] for c in ppl["checks"] if c["name"].endswith("_vs_baseline")}
    assert compared == {f"{name}_vs_baseline" for name in ("ppl_ratio", "kld_mean", "same_top_p")}
    assert "not_comparable" not in ppl
    report = (again.out / "report.md").read_text(encoding="utf-8")
    card = render_model_card(again.results)
    for text in (report, card):
        assert "`moe.mean_topk_overlap` was not compared with the baseline" in text
        assert "mean_topk_overlap (on the fed windows 0, 7 of 8: 1,024 tokens per MoE layer)" in text
    # The run's own results as the baseline: the same identity, every tolerance compared.
    same = rerun(again, tmp_path / "same", *args[:-1], again.out / "results.json")
    assert same.cli.returncode == 0 and same.loads == [], same.cli.stderr
    checked = {c["name"] for c in same.task("moe")["checks"] if c["name"].endswith("_vs_baseline")}
    assert checked == {f"{name}_vs_baseline" for name in SHIPPED_MOE_TOLERANCES}
    assert "not_comparable" not in same.task("moe")


def test_a_malformed_coverage_file_is_refused_with_its_path(tiny_pair, tmp_path):
    ckpt = copy_checkpoint(tiny_pair[BF16], tmp_path / "ckpt")
    bad = ckpt / "calibration_coverage.json"
    bad.write_text(json.dumps({"schema": "evalsuite.calibration-coverage/1", "tokens": {"1.9": 3}}))
    code, lines, _ = cli_in_process(
        "run",
        "--ref",
        tiny_pair[BF16],
        "--ckpt",
        ckpt,
        "--tasks",
        "moe",
        "--out",
        tmp_path / "out",
        "--quiet",
    )
    assert_refused(code, lines, str(bad), "1.9", "4 routed experts")
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_dense_model_is_skipped_with_its_reason(smollm2_pair, tmp_path):
    names = sorted(smollm2_pair)
    _, _, _ = cli_in_process(
        "run", "--ref", smollm2_pair[names[0]], "--ckpt", smollm2_pair[names[0]], "--tasks", "moe",
        "--out", tmp_path / "out", "--quiet",
    )  # fmt: skip
    moe = json.loads((tmp_path / "out" / "results.json").read_text())["tasks"]["moe"]
    assert moe["status"] == "skipped" and "dense" in moe["reason"] and "num_experts" in moe["reason"]
