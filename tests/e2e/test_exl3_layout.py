"""EXL3 packs laid out as exllamav3 1.6.5 writes them: FP16 copies of the Linears it leaves unquantized, an
MTP head Transformers ignores on load, streamed execution, lm-eval on an EXL3 side, and a damaged tile found.

One run of `tensors,ppl,lmeval` on the tiny Qwen3.5 MoE pack with an MTP head (in-process), its `ppl` again
streamed, and broken copies checked with `tensors` alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import MANIFEST_NAME, read_manifest
from evalsuite.formats.exl3 import block_tile_errors, decoded_blocks
from tests.conftest import cli_in_process, copy_checkpoint, edit_tensors

MTP_BF16, MTP_EXL3 = "tiny-qwen35moe-mtp-bf16", "tiny-qwen35moe-mtp-exl3"
TINY_BF16, TINY_EXL3 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-exl3"
SMOLLM2_BF16, SMOLLM2_EXL3 = "smollm2-135m-bf16", "smollm2-135m-exl3"
FP16_LINEARS = ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_a", "linear_attn.in_proj_b")
MTP_EXPERT = "mtp.layers.0.mlp.experts.2.up_proj"  # K=4 (mtp_bits)
LMEVAL_SPEC = """tasks = ["evalsuite-mini"]
limit = 6
[thresholds]
evalsuite-mini.acc.flip_rate = { max = 1.0 }
"""
PPL_METRICS = ("ppl_ref", "ppl_ckpt", "ppl_ratio", "kld_mean", "same_top_p", "n_scored_tokens")


def results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def tensor_rows(folder: Path, entry: dict) -> dict[str, dict]:
    table = json.loads((folder / entry["artifacts"]["tensors"]).read_text())
    return {row["name"]: row for row in table["tensors"]}


def tensors_run(ckpt: Path, ref: Path, out: Path) -> dict:
    code, lines, _ = cli_in_process("run", "--ckpt", ckpt, "--ref", ref, "--tasks", "tensors", "--out", out)
    assert code in (0, 1), lines
    return results(out)["tasks"]["tensors"]


@pytest.fixture(scope="module")
def mtp_run(tiny_mtp_exl3_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp-exl3")
    spec = root / "lmeval.toml"
    spec.write_text(LMEVAL_SPEC)
    # The protocol is not under test: 3 windows of 512 instead of 8 halve the cost of the two ppl runs.
    ppl = root / "ppl-3-windows.toml"
    ppl.write_text(
        re.sub(r"count = 8", "count = 3", (Path(__file__).parents[2] / "tasks" / "ppl.toml").read_text())
    )
    out = root / "run"
    pair = (tiny_mtp_exl3_pair[MTP_EXL3], tiny_mtp_exl3_pair[MTP_BF16])
    args = ("--ckpt", pair[0], "--ref", pair[1], "--corpus", "python-docs", "--quiet", "--spec", f"ppl={ppl}")
    code, lines, _ = cli_in_process(
        "run", *args, "--tasks", "tensors,ppl,lmeval", "--spec", f"lmeval={spec}", "--out", out
    )
    streamed = root / "streamed"
    streamed_code, _, _ = cli_in_process("run", *args, "--tasks", "ppl", "--stream", "--out", streamed)
    return {
        "code": code,
        "lines": lines,
        "doc": results(out),
        "out": out,
        "streamed": (streamed_code, streamed),
    }


def test_the_mtp_pack_passes_tensors_and_ppl_with_fp16_linears_protected(tiny_mtp_exl3_pair, mtp_run):
    assert mtp_run["code"] == 0, mtp_run["lines"]
    entry = mtp_run["doc"]["tasks"]["tensors"]
    m, counts = entry["metrics"], read_manifest(tiny_mtp_exl3_pair[MTP_EXL3])["counts"]
    # FP16 copies are protected (value-equal after the cast), out of the bits average.
    # Per layer a router and a shared expert gate (the decoder's two and the MTP layer's), and the linear
    # attention layer's in_proj_a / in_proj_b.
    assert counts["fp16_linears"] == 3 * 2 + 2
    rows = tensor_rows(mtp_run["out"], entry)
    fp16 = [r for r in rows.values() if r["format"] == "f16"]
    assert len(fp16) == counts["fp16_linears"]
    assert all(r["tensor_class"] == "protected" and r["identical"] for r in fp16)
    assert all(any(r["module"].endswith(f) for f in FP16_LINEARS) for r in fp16)
    assert "value-equal to the source cast to FP16" in fp16[0]["note"]
    assert m["protected_total"] == m["protected_identical"] == counts["protected_tensors"] + len(fp16)
    assert m["bpw_claim_error"] <= 0.006 and m["claimed_bits"] == round(m["avg_bits_per_weight"], 2)
    assert m["tile_outliers"] == 0 and m["worst_tile_ratio"] < 8
    exl3 = [r for r in rows.values() if r["format"] == "exl3" and r["part"] == "text"]
    assert {r["bits"] for r in exl3} == {3, 4, 5, 6} and "bits_per_weight" in exl3[0]
    # The MTP head: quantized at mtp_bits, verified like any tensor, ignored on load and counted.
    mtp = [r for r in rows.values() if r["part"] == "mtp"]
    assert len(mtp) == 29 and {r["bits"] for r in mtp if r["format"] == "exl3"} == {4}
    stored = Checkpoint.open(tiny_mtp_exl3_pair[MTP_EXL3]).tensors
    mtp_stored = [info for name, info in stored.items() if name.startswith("mtp.")]
    assert m["ignored_on_load_tensors"] == len(mtp_stored) == 89
    assert m["ignored_on_load_bytes"] == sum(info.nbytes for info in mtp_stored)
    ppl = mtp_run["doc"]["tasks"]["ppl"]["metrics"]
    assert "tensors the model ignores on load not run" in ppl["ckpt_execution"]
    assert 0.9 < ppl["ppl_ratio"] < 1.1 and 0.8 < ppl["same_top_p"] < 1.0


def test_a_streamed_exl3_run_equals_the_loaded_one_on_every_ppl_metric(mtp_run):
    code, streamed = mtp_run["streamed"]
    assert code == 0
    loaded = mtp_run["doc"]["tasks"]["ppl"]["metrics"]
    again = results(streamed)["tasks"]["ppl"]["metrics"]
    numeric = [k for k, v in loaded.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert set(PPL_METRICS) <= set(numeric)
    assert {k: again[k] for k in numeric} == {k: loaded[k] for k in numeric}
    assert again["ckpt_execution"] == loaded["ckpt_execution"] + ", streamed one decoder layer at a time"


def test_lmeval_runs_on_an_exl3_side(mtp_run):
    entry = mtp_run["doc"]["tasks"]["lmeval"]
    assert entry["status"] == "pass", entry
    assert entry["metrics"]["evalsuite-mini.acc.n"] == 6


def test_a_flipped_trellis_word_in_an_mtp_tensor_fails_tensors_by_name(tiny_mtp_exl3_pair, tmp_path):
    copy = copy_checkpoint(tiny_mtp_exl3_pair[MTP_EXL3], tmp_path / "mtp-flipped")
    (copy / MANIFEST_NAME).unlink()

    def flip(tensors):
        tensors[f"{MTP_EXPERT}.trellis"][:, :, :32] ^= -1  # half the words of every tile

    edit_tensors(copy, flip)
    entry = tensors_run(copy, tiny_mtp_exl3_pair[MTP_BF16], tmp_path / "run")
    assert entry["status"] == "fail"
    failed = {c["name"] for c in entry["checks"] if not c["passed"]}
    assert failed == {"worst_rel_err", "worst_channel_gain_err"}
    named = {d["tensor"] for d in entry["details"] if d.get("check") in failed}
    assert len(named) == 2 and all(name.startswith(f"{MTP_EXPERT}.weight") for name in named), named


def half_tile_flip(name: str, tile: tuple[int, int]):
    """32 trellis words of one tile (half of a K=4 tile) inverted."""

    def flip(tensors):
        tensors[f"{name}.trellis"][tile[0], tile[1], :32] ^= -1

    return flip


def test_a_single_broken_tile_fails_tensors_naming_tensor_and_tile(tiny_exl3_pair, tmp_path):
    # A K=4 attention projection of the tiny pack: its relative error moves by less than the quantization
    # noise, so only the per-tile check can see it.
    name = "model.language_model.layers.1.self_attn.o_proj"
    copy = copy_checkpoint(tiny_exl3_pair[TINY_EXL3], tmp_path / "tile")
    (copy / MANIFEST_NAME).unlink()
    edit_tensors(copy, half_tile_flip(name, (3, 2)))
    entry = tensors_run(copy, tiny_exl3_pair[TINY_BF16], tmp_path / "run")
    failed = {c["name"] for c in entry["checks"] if not c["passed"]}
    assert failed == {"tile_outliers"}, entry["checks"]
    named = [d for d in entry["details"] if d.get("check") == "tile"]
    assert [d["tensor"] for d in named] == [f"{name}.weight"]
    assert "trellis[3, 2] (inputs 48.., outputs 32..)" in named[0]["detail"]
    assert entry["metrics"]["tile_outliers"] == 1


def clean_tile_scores(pack: Path, source: Path) -> list[tuple[str, int, float, float]]:
    """(tensor, K, worst tile over the median tile, worst tile error over the median tile signal) for every
    EXL3 Linear of a clean pack, computed here apart from the verification engine."""
    candidate, reference = Checkpoint.open(pack), Checkpoint.open(source)
    modules = sorted({n.removesuffix(".trellis") for n in candidate.tensors if n.endswith(".trellis")})
    scores = []
    for module in modules:
        stored = {p: candidate.read_tensor(f"{module}.{p}") for p in ("trellis", "suh", "svh")}
        stored["mul1"] = None
        name = f"{module}.weight" if f"{module}.weight" in reference.tensors else "model.embed_tokens.weight"
        weight = reference.read_tensor(name).float()
        errors, signal = [], []
        for first, block in decoded_blocks(stored, *weight.shape):
            rows = weight[first : first + block.shape[0]]
            errors.append(block_tile_errors(stored, first, block - rows, weight.shape[1]))
            signal.append(block_tile_errors(stored, first, rows, weight.shape[1]))
        e, s = torch.cat(errors), torch.cat(signal)
        median_e, median_s = e.nanmedian(), s.nanmedian()
        k = stored["trellis"].shape[-1] // 16
        worst = float(e.nan_to_num(0).max())
        scores.append((module, k, worst / float(median_e), worst / float(median_s)))
    return scores


@pytest.mark.slow  # the default tier's clean runs assert tile_outliers == 0 already; this adds the margins
def test_no_clean_tiny_pack_raises_the_tile_check(tiny_exl3_pair, tiny_mtp_exl3_pair):
    from evalsuite.tasks.tensors._verification._exl3 import TILE_OUTLIER_RATIO, TILE_SIGNAL_FRACTION

    for pack, source in (
        (tiny_exl3_pair[TINY_EXL3], tiny_exl3_pair[TINY_BF16]),
        (tiny_mtp_exl3_pair[MTP_EXL3], tiny_mtp_exl3_pair[MTP_BF16]),
    ):
        for module, k, ratio, fraction in clean_tile_scores(pack, source):
            assert not (ratio > TILE_OUTLIER_RATIO and fraction > TILE_SIGNAL_FRACTION), (module, k, ratio)
            assert fraction < TILE_SIGNAL_FRACTION / 2, (module, k, fraction)  # a margin of two


@pytest.mark.slow
def test_a_single_broken_tile_of_a_smollm2_projection_fails_tensors(smollm2_exl3_pair, tmp_path):
    name = "model.layers.11.mlp.down_proj"  # K=4, trellis [96, 40, 64]
    copy = copy_checkpoint(smollm2_exl3_pair[SMOLLM2_EXL3], tmp_path / "smollm2-tile")
    (copy / MANIFEST_NAME).unlink()
    edit_tensors(copy, half_tile_flip(name, (17, 9)))
    entry = tensors_run(copy, smollm2_exl3_pair[SMOLLM2_BF16], tmp_path / "run")
    failed = {c["name"] for c in entry["checks"] if not c["passed"]}
    assert failed == {"tile_outliers"}, entry["checks"]
    named = [d for d in entry["details"] if d.get("check") == "tile"]
    assert [d["tensor"] for d in named] == [f"{name}.weight"] and "trellis[17, 9]" in named[0]["detail"]
    clean = tensors_run(smollm2_exl3_pair[SMOLLM2_EXL3], smollm2_exl3_pair[SMOLLM2_BF16], tmp_path / "clean")
    assert clean["status"] == "pass" and clean["metrics"]["tile_outliers"] == 0


def test_a_pack_that_fits_only_packed_streams_by_itself(tiny_mtp_exl3_pair):
    from evalsuite.backends.memory import loaded_bytes, streamed_if_needed
    from evalsuite.backends.options import BackendOptions

    pack = Checkpoint.open(tiny_mtp_exl3_pair[MTP_EXL3])
    options = BackendOptions(backend="exl3")
    decoded = loaded_bytes(pack, options)
    # The trellises decode to about four times their bytes at 4 bpw; the MTP head is never loaded.
    assert decoded > 2 * pack.total_bytes
    budget = (pack.total_bytes + decoded) // 2  # room for the files, not for the decoded model
    chosen, reason = streamed_if_needed(pack, BackendOptions(backend="exl3", max_memory=budget))
    assert chosen.stream and "loaded whole" in reason
    chosen, reason = streamed_if_needed(pack, BackendOptions(backend="exl3", max_memory=4 * decoded))
    assert not chosen.stream and reason is None


def test_greedy_decoding_on_exllamav3_stops_at_generation_configs_eos_too(tiny_mtp_exl3_pair, tmp_path):
    from evalsuite.backends.exl3 import eos_token_ids

    copy = copy_checkpoint(tiny_mtp_exl3_pair[MTP_EXL3], tmp_path / "eos")
    config_eos = Checkpoint.open(copy).config["eos_token_id"]
    path = copy / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": [config_eos, 7]}))
    assert eos_token_ids(Checkpoint.open(copy)) == {config_eos, 7}
    path.unlink()
    assert eos_token_ids(Checkpoint.open(copy)) == {config_eos}
