"""EXL3 packs end to end: the EXL3 fixtures through `tensors`, `ppl`, `smoke` and `vision` on the CPU path of
the `exl3` backend (chosen by `--backend auto`, the default), broken copies refused or failed with the tensor
named, and the SmolLM2 pack's perplexity on the CPU."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from evalsuite.cli.app import main
from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import MANIFEST_NAME, TINY_EXL3_POLICY, Exl3Policy, read_manifest, write_exl3_copy
from evalsuite.formats.exl3_decode import decode_weight, padded
from tests.conftest import (
    Models,
    cli_run_in_process,
    copy_checkpoint,
    demo_thresholds,
    edit_tensors,
    rerun,
    tiny_spec_args,
)

pytestmark = pytest.mark.format_evidence(format="exl3", writer="evalsuite's encoder of exllamav3's layout")

TINY_BF16, TINY_EXL3 = "tiny-minicpmv47-bf16", "tiny-minicpmv47-exl3"
SMOLLM2_BF16, SMOLLM2_EXL3 = "smollm2-135m-bf16", "smollm2-135m-exl3"
EXPERT_GATE = "model.language_model.layers.0.mlp.experts.0.gate_proj"  # K=2 in the tiny pack
EXPERT_DOWN = "model.language_model.layers.1.mlp.experts.1.down_proj"  # K=4
# What the CPU encoder reaches on the tiny pack's random Gaussian weights, by K (measured, with margin): the
# decoded weight's relative Frobenius error against the source. Shannon's bound for Gaussian data is 2^-K.
TINY_BOUNDS = {2: 0.30, 3: 0.17, 4: 0.11, 5: 0.075, 6: 0.06}
# SmolLM2's bounds. K=4: a 4 bpw trellis must do at least as well as round-to-nearest INT4 per output
# channel on Gaussian rows (about 0.135; 0.191 at worst on SmolLM2's own weights, the W4A8 fixture). The 6 bpw
# head: 0.05, since the head decides the perplexity (at 0.097 alone it took SmolLM2's from 17.7 to 40.8).
SMOLLM2_BOUNDS = {4: 0.135, 6: 0.05}


def results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def tensor_rows(folder: Path, entry: dict) -> dict[str, dict]:
    table = json.loads((folder / entry["artifacts"]["tensors"]).read_text())
    return {row["name"]: row for row in table["tensors"]}


def failed_checks(entry: dict) -> set[str]:
    return {c["name"] for c in entry["checks"] if not c["passed"]}


# ----------------------------------------------------------------------------------------------------------
# The tiny pack: one run of every model task, on the default backend
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tiny_exl3_pair, tiny_run, tmp_path_factory):
    """The pack against its source, in a copy of the shared tiny run's folder: the source's observations are
    reused, the pack's made."""
    out = tmp_path_factory.mktemp("tiny-exl3-run") / "run"
    args = ("run", "--ckpt", tiny_exl3_pair[TINY_EXL3], "--ref", tiny_exl3_pair[TINY_BF16])
    args += ("--tasks", "tensors,ppl,smoke,vision", *tiny_spec_args(), "--corpus", "python-docs")
    res = rerun(tiny_run, out, *args).cli
    return res, results(out), out


@pytest.mark.format_evidence(claim="ppl")
def test_an_exl3_pack_runs_on_the_decoded_cpu_path_by_default(tiny_run):
    res, doc, _ = tiny_run
    # The random tiny model names no shapes in the vision answer, on either side: that fails. Its 2..6-bit
    # tensors part the decoded smoke answers from the reference's, nearly always on a token of the
    # reference's top 5 (the random model's distributions are nearly flat: near ties); where one parts
    # outside the top 5, smoke fails it, rightly, and the reference's own top 5 there lie within a tenth of a
    # nat of each other: a flat distribution, not a broken pack.
    assert res.returncode == 1, res.stderr
    failed = {(name, c) for name, entry in doc["tasks"].items() for c in failed_checks(entry)}
    smoke = doc["tasks"]["smoke"]["metrics"]
    outside = {("smoke", "diverged_outside_top5")} if smoke["diverged_outside_top5"] else set()
    assert failed == {("vision", "ref_pass"), ("vision", "ckpt_pass")} | outside
    assert smoke["identical"] < smoke["n_prompts"] and smoke["diverged_outside_top5"] <= max(
        1, 0.05 * smoke["n_prompts"]
    )
    assert smoke["near_ties"] >= 0.8 * (smoke["n_prompts"] - smoke["identical"])
    for row in doc["tasks"]["smoke"]["details"]:
        if row.get("ckpt_token_in_ref_top5") is False:
            # Beyond its top 5 only a bound is known: the spread of the reference's own top 5.
            assert float(row["ref_logp_gap"].removeprefix(">= ")) < 0.1, row
    assert "loading ckpt: " in res.stderr and "(exl3, backend exl3)" in res.stderr
    ppl = doc["tasks"]["ppl"]["metrics"]
    assert ppl["ckpt_execution"] == (
        "EXL3 decoded on the CPU by evalsuite (38 Linear layers, mul1, K 2, 3, 4, 5, 6) into Transformers "
        f"{doc['environment']['packages']['transformers']} (MiniCPMV4_7ForConditionalGeneration); "
        "exllamav3 not run"
    )
    assert ppl["ref_execution"].startswith("Transformers ")
    # Random weights at 2..6 bits: close to the source, not equal to it.
    assert 0.8 < ppl["same_top_p"] < 1.0 and 0.9 < ppl["ppl_ratio"] < 1.1 and ppl["kld_mean"] > 0
    assert doc["tasks"]["smoke"]["status"] == ("fail" if outside else "pass")
    vision = doc["tasks"]["vision"]["metrics"]
    assert vision["vision_cosine"] == 1.0 and vision["vision_rel_err"] == 0.0  # the BF16 tower, as stored


def test_every_observation_of_the_pack_says_which_path_ran(tiny_run):
    _, _, out = tiny_run
    executions = {}
    for path in sorted((out / "observations").glob("*/observation.json")):
        meta = json.loads(path.read_text())["meta"]
        if meta.get("execution") is None:  # a case skipped for want of its processor (video, no torchvision)
            continue
        executions[path.parent.name.split("-")[0], meta["execution"]["backend"]] = meta["execution"]
    assert set(executions) == {("ref", "hf"), ("ckpt", "exl3")}
    ckpt = executions["ckpt", "exl3"]
    assert (ckpt["path"], ckpt["exl3_linears"], ckpt["bits"]) == ("decoded", 38, [2, 3, 4, 5, 6])


@pytest.mark.format_evidence(claim="tensors")
def test_tensors_on_the_tiny_pack_pass_with_the_counts_its_recipe_wrote(tiny_exl3_pair, tiny_run):
    _, doc, out = tiny_run
    entry = doc["tasks"]["tensors"]
    assert entry["status"] == "pass"
    m, counts = entry["metrics"], read_manifest(tiny_exl3_pair[TINY_EXL3])["counts"]
    assert m["source_tensors"] == counts["source_tensors"] == 115
    assert m["quantized_other"] == counts["exl3_linears"] == 38
    # The routers, shared expert gates and in_proj_a/b are stored FP16 (protected, equal after the cast).
    assert counts["fp16_linears"] == 6
    assert m["protected_total"] == m["protected_identical"] == counts["protected_tensors"] + 6 == 77
    assert (m["missing"], m["unexpected"], m["config_mismatches"], m["assets_changed"]) == (0, 0, 0, 0)
    # No manifest ships with the pack, and no second decoder exists to compare with.
    assert m["decode_exact"] is None and "decode_exact" in entry["not_measured"]
    rows = tensor_rows(out, entry)
    exl3_rows = [r for r in rows.values() if r["format"] == "exl3"]
    # exllamav3 weighs its claim by the padded size of each Linear (conversion/allocation.py).
    size = {r["name"]: padded(r["shape"][0]) * padded(r["shape"][1]) for r in exl3_rows}
    numel = sum(size[r["name"]] for r in exl3_rows if r["part"] == "text")
    average = sum(size[r["name"]] * r["bits"] for r in exl3_rows if r["part"] == "text") / numel
    assert m["avg_bits_per_weight"] == pytest.approx(average) and m["claimed_bits"] == round(average, 2)
    storage_file = tiny_exl3_pair[TINY_EXL3] / "quantization_config.json"
    storage = json.loads(storage_file.read_text())["tensor_storage"]
    for row in exl3_rows:
        claimed = storage[row["module"]]["bits_per_weight"]
        assert row["bits"] == claimed == TINY_EXL3_POLICY.bits_of(row["module"])
        assert row["codebook"] == "mul1" and row["cosine"] > 0.95 and row["sqnr_db"] > 10
    vision = [r for r in rows.values() if "vision_tower" in r["name"]]
    assert vision and all(r["tensor_class"] == "protected" and r["identical"] for r in vision)


def test_decoded_tiny_weights_are_within_the_bound_of_their_bits(tiny_exl3_pair, tiny_run):
    _, doc, out = tiny_run
    rows = tensor_rows(out, doc["tasks"]["tensors"])
    by_bits: dict[int, list[float]] = {}
    for row in rows.values():
        if row["format"] == "exl3":
            by_bits.setdefault(row["bits"], []).append(row["rel_err"])
    assert sorted(by_bits) == [2, 3, 4, 5, 6]
    for bits, errors in by_bits.items():
        assert 2.0**-bits < max(errors) <= TINY_BOUNDS[bits], (bits, max(errors))
    means = [sum(e) / len(e) for _, e in sorted(by_bits.items())]
    assert means == sorted(means, reverse=True)  # every extra bit lowers the error
    # The build measured the same decode: its worst error per K is tensors' own.
    recorded = read_manifest(tiny_exl3_pair[TINY_EXL3])["checks"]["worst_rel_err"]
    assert recorded == {f"k{b}": pytest.approx(max(e), abs=1e-4) for b, e in by_bits.items()}


# ----------------------------------------------------------------------------------------------------------
# Broken copies: a failed check naming the tensor, or a refusal before any model loads
# ----------------------------------------------------------------------------------------------------------


def cli(capsys, *args) -> tuple[int, list[str]]:
    """Exit code and stderr lines of `evalsuite ARGS` run in this process."""
    with pytest.raises(SystemExit) as stop:
        main([str(a) for a in args])
    return stop.value.code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.format_evidence(claim="code")
def test_trellis_words_flipped_in_one_tensor_fail_tensors_naming_it(tiny_exl3_pair, tiny_run, tmp_path):
    """One trellis word flipped in every tile of the K=2 expert gate takes it past the bound; the same word
    flipped in a single tile of a K=4 projection is measured (its error rises) but stays within the
    quantization noise: 7 of its 16,384 rotated values change."""
    _, doc, clean_out = tiny_run
    clean = tensor_rows(clean_out, doc["tasks"]["tensors"])
    copy = copy_checkpoint(tiny_exl3_pair[TINY_EXL3], tmp_path / "flipped")
    (copy / MANIFEST_NAME).unlink()

    def flip(tensors):
        tensors[f"{EXPERT_GATE}.trellis"][:, :, 5] ^= -1
        tensors[f"{EXPERT_DOWN}.trellis"][0, 0, 5] ^= -1

    edit_tensors(copy, flip)
    out = tmp_path / "run"
    ref = tiny_exl3_pair[TINY_BF16]
    res = cli_run_in_process(
        "run", "--ckpt", copy, "--ref", ref, "--tasks", "tensors", "--out", out, "--quiet"
    )
    assert res.returncode == 1, res.stderr
    entry = results(out)["tasks"]["tensors"]
    # The damaged tensor may also stand out from the gate projections of its K (1.6× their median here, at
    # the rule's ratio): an outlier then names it and nothing else.
    assert (
        {"worst_rel_err"} <= failed_checks(entry) <= {"worst_rel_err", "outlier_tensors", "outlier_channels"}
    )
    named = {d["tensor"]: d["detail"] for d in entry["details"] if d.get("check") == "worst_rel_err"}
    assert list(named) == [f"{EXPERT_GATE}.weight"]
    assert {d["tensor"] for d in entry["details"] if d.get("check") == "outlier"} <= {f"{EXPERT_GATE}.weight"}
    rows = tensor_rows(out, entry)
    assert rows[f"{EXPERT_GATE}.weight"]["rel_err"] > 0.35
    down = f"{EXPERT_DOWN}.weight"
    assert clean[down]["rel_err"] < rows[down]["rel_err"] < clean[down]["rel_err"] + 0.01
    unchanged = set(rows) - {f"{EXPERT_GATE}.weight", down}
    assert all(rows[name]["rel_err"] == clean[name]["rel_err"] for name in unchanged)


@pytest.fixture(scope="module")
def broken_packs(tiny_exl3_pair, tmp_path_factory):
    """Copies of the tiny pack, each broken one way, named by what is broken."""
    root = tmp_path_factory.mktemp("broken-exl3")
    q = "model.language_model.layers.1.self_attn.q_proj"  # (out 256, in 64): trellis [8, 16, 64]
    k = "model.language_model.layers.1.self_attn.k_proj"
    packs: dict[str, Path] = {}

    def broken(name, edit=None, storage=None, config=None):
        folder = copy_checkpoint(tiny_exl3_pair[TINY_EXL3], root / name)
        (folder / MANIFEST_NAME).unlink()
        if edit is not None:
            edit_tensors(folder, edit)
            # A pack written broken lists what it holds: only the edit itself is wrong.
            storage = storage or (lambda s: None)
        if config is not None:
            document = json.loads((folder / "config.json").read_text())
            config(document["quantization_config"])
            (folder / "config.json").write_text(json.dumps(document, indent=2))
        if storage is not None:
            path = folder / "quantization_config.json"
            document = json.loads(path.read_text())
            stored = Checkpoint.open(folder).tensors
            for entry in document["tensor_storage"].values():
                for tensor, meta in entry["stored_tensors"].items():
                    meta.update(shape=list(stored[tensor].shape), n_bytes=stored[tensor].nbytes)
            storage(document["tensor_storage"])
            path.write_text(json.dumps(document, indent=4))
        packs[name] = folder

    # exllamav3's shape before padding: (in/16, out/16, 16·K) for a 64-input Linear is [4, 16, 64].
    broken("unpadded", lambda t: t.update({f"{q}.trellis": t[f"{q}.trellis"][:4].clone()}))
    nine = lambda t: torch.cat([t] * 3, -1)[..., :144].contiguous()  # noqa: E731 - 16·9 words per tile
    broken("k9", lambda t: t.update({f"{q}.trellis": nine(t[f"{q}.trellis"])}))
    broken("marker", lambda t: t.update({f"{q}.mul1": torch.tensor(0x12345678, dtype=torch.int32)}))
    broken("storage", storage=lambda s: s[k].update(bits_per_weight=5))
    broken("claim", config=lambda qc: qc.update(bits=4.15))
    return packs


@pytest.mark.parametrize(
    ("pack", "fragments"),
    [
        (
            "unpadded",
            (
                "EXL3 Linear model.language_model.layers.1.self_attn.q_proj: trellis [4, 16, 64] does not "
                "tile the weight (out=256, in=64) padded to multiples of 128: expected [8, 16, 16·K]",
            ),
        ),
        ("k9", ("q_proj: trellis width 144 words is no EXL3 bitrate",)),
        ("marker", ("q_proj: mul1 marker holds 0x12345678, not 0x83dcd12d",)),
        (
            "storage",
            (
                "quantization_config.json disagrees with the files: "
                "model.language_model.layers.1.self_attn.k_proj.trellis: tensor_storage says 5 bpw, "
                "the trellis shape gives 4 bpw",
            ),
        ),
    ],
)
@pytest.mark.format_evidence(claim="refused")
def test_a_broken_pack_is_refused_in_one_line_before_any_model(
    capsys, monkeypatch, tiny_exl3_pair, broken_packs, tmp_path, pack, fragments
):
    models = Models().watch(monkeypatch)
    code, lines = cli(
        capsys,
        "run",
        "--ckpt",
        broken_packs[pack],
        "--ref",
        tiny_exl3_pair[TINY_BF16],
        "--tasks",
        "ppl",
        "--out",
        tmp_path / "r",
        "--quiet",
    )
    assert code == 2 and len(lines) == 1 and lines[0].startswith("evalsuite: error: "), lines
    assert str(broken_packs[pack]) in lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert models.loads == []


def test_the_same_broken_packs_fail_tensors_naming_the_tensor(capsys, tiny_exl3_pair, broken_packs, tmp_path):
    q = "model.language_model.layers.1.self_attn.q_proj.weight"
    k = "model.language_model.layers.1.self_attn.k_proj.weight"
    expected = {
        "unpadded": (q, "does not tile the weight (out=256, in=64) padded to multiples of 128"),
        "k9": (q, "trellis width 144 words is no EXL3 bitrate"),
        "marker": (q, "mul1 marker holds 0x12345678, not 0x83dcd12d"),
        "storage": (k, "tensor_storage says 5 bpw, the trellis shape gives 4 bpw"),
    }
    for pack, (tensor, fragment) in expected.items():
        out = tmp_path / pack
        ref = tiny_exl3_pair[TINY_BF16]
        args = ("--ckpt", broken_packs[pack], "--ref", ref, "--tasks", "tensors", "--out", out, "--quiet")
        code, _ = cli(capsys, "run", *args)
        assert code == 1, pack
        entry = results(out)["tasks"]["tensors"]
        assert failed_checks(entry) >= {"config_mismatches"}, pack
        named = [d for d in entry["details"] if d.get("check") == "config"]
        assert {d["tensor"] for d in named} == {tensor}, (pack, named)
        assert any(fragment in d["detail"] for d in named), (pack, named)


def test_a_bits_claim_the_trellises_do_not_hold_fails_tensors(capsys, tiny_exl3_pair, broken_packs, tmp_path):
    ref, out = tiny_exl3_pair[TINY_BF16], tmp_path / "claim"
    args = ("--ckpt", broken_packs["claim"], "--ref", ref, "--tasks", "tensors", "--out", out, "--quiet")
    code, _ = cli(capsys, "run", *args)
    assert code == 1
    entry = results(out)["tasks"]["tensors"]
    assert failed_checks(entry) == {"bpw_claim_error"}
    detail = {d["tensor"]: d["detail"] for d in entry["details"] if "detail" in d}[
        "config.json: quantization_config.bits"
    ]
    assert "claims 4.15 bpw, the text backbone's trellises hold 3.5263 bpw" in detail


def test_backend_exl3_refuses_a_checkpoint_that_is_not_an_exl3_pack(capsys, monkeypatch, tiny_pair, tmp_path):
    models = Models().watch(monkeypatch)
    w4a8, bf16 = tiny_pair["tiny-minicpmv47-w4a8"], tiny_pair[TINY_BF16]
    args = ("--ckpt", w4a8, "--ref", bf16, "--backend", "exl3", "--out", tmp_path / "r", "--quiet")
    code, lines = cli(capsys, "run", *args)
    assert code == 2 and len(lines) == 1
    assert "is a compressed-tensors checkpoint, not an EXL3 pack: run it with --backend hf" in lines[0]
    assert models.loads == []


def test_an_exl3_copy_is_the_same_bytes_when_written_twice(tiny_exl3_pair, tmp_path):
    # Two Linear layers in two threads, in either order: the files must not depend on which finished first.
    policy = Exl3Policy(
        bits=((r".*layers\.1\.self_attn\.(q|k)_proj", 3),), head_bits=5, effort=((3, 16), (5, 32)), seed=7
    )
    for name in ("a", "b"):
        write_exl3_copy(tiny_exl3_pair[TINY_BF16], tmp_path / name, policy)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "exl3",
        "version": "1.6.5",
        "bits": 3,
        "head_bits": 5,
        "out_scales": "never",
        "codebook": "mul1",
    }


# ----------------------------------------------------------------------------------------------------------
# SmolLM2 at 4 bpw: one run of tensors and ppl (2 windows) on the CPU
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_run(smollm2_exl3_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-exl3")
    # The protocol is not under test here: 2 windows of 512 instead of 8 keep the run short.
    spec = Path(__file__).resolve().parents[2] / "tasks" / "ppl.toml"
    short = root / "ppl-2-windows.toml"
    short.write_text(re.sub(r"count = 8", "count = 2", spec.read_text()))
    out = root / "run"
    res = cli_run_in_process(
        "run",
        "--ckpt",
        smollm2_exl3_pair[SMOLLM2_EXL3],
        "--ref",
        smollm2_exl3_pair[SMOLLM2_BF16],
        "--tasks",
        "tensors,ppl",
        "--spec",
        f"ppl={short}",
        # A 4 bpw pack of a 135 M model encoded without calibration data loses more than a good pack of a
        # large one (ppl_ratio 1.38): judged, like the W4A8 demo pack, by the demo's looser thresholds.
        "--thresholds",
        demo_thresholds("ppl", root),
        "--corpus",
        "python-docs",
        "--out",
        out,
        "--quiet",
    )
    return res, results(out), out


@pytest.mark.slow
def test_smollm2_at_4_bpw_passes_ppl_on_the_cpu(smollm2_run):
    res, doc, _ = smollm2_run
    assert res.returncode == 0, res.stderr
    m = doc["tasks"]["ppl"]["metrics"]
    assert m["n_windows"] == 2 and m["n_scored_tokens"] == 2 * 255
    decoded = "EXL3 decoded on the CPU by evalsuite (211 Linear layers, mul1, K 4, 6)"
    assert m["ckpt_execution"].startswith(decoded)
    assert 1.0 < m["ppl_ratio"] < 1.7 and 0.6 < m["same_top_p"] < 1.0 and m["kld_mean"] > 0
    assert doc["ckpt"]["format"] == "exl3"


@pytest.mark.slow
def test_decoded_smollm2_weights_are_within_the_4_bit_bound(smollm2_exl3_pair, smollm2_run):
    _, doc, out = smollm2_run
    entry = doc["tasks"]["tensors"]
    assert entry["status"] == "pass"
    m = entry["metrics"]
    assert (m["quantized_other"], m["protected_total"], m["missing"], m["unexpected"]) == (211, 62, 0, 0)
    assert m["source_tensors"] == 273  # 272 stored; the head, tied in the source, is stored apart
    rows = tensor_rows(out, entry)
    head = rows["lm_head.weight"]
    assert (head["bits"], head["part"]) == (6, "head") and head["rel_err"] <= SMOLLM2_BOUNDS[6]
    body = [r for r in rows.values() if r["format"] == "exl3" and r["part"] == "text"]
    assert len(body) == 210 and all(r["bits"] == 4 for r in body)
    assert max(r["rel_err"] for r in body) <= SMOLLM2_BOUNDS[4]
    # The statistics of tensors.json against a decode done here, apart from the verification engine.
    pack = Checkpoint.open(smollm2_exl3_pair[SMOLLM2_EXL3])
    source = Checkpoint.open(smollm2_exl3_pair[SMOLLM2_BF16])
    for module, stored_as in (
        ("model.layers.7.self_attn.k_proj", "model.layers.7.self_attn.k_proj.weight"),
        ("lm_head", "model.embed_tokens.weight"),
    ):
        with safe_open(str(pack.tensors[f"{module}.trellis"].shard), "pt") as f:
            parts = {p: f.get_tensor(f"{module}.{p}") for p in ("trellis", "suh", "svh")}
        weight = source.read_tensor(stored_as).float()
        out_features, in_features = weight.shape
        decoded = decode_weight(
            parts["trellis"], parts["suh"], parts["svh"], "mul1", in_features, out_features
        )
        own = float((decoded.double() - weight.double()).norm() / weight.double().norm())
        assert rows[f"{module}.weight"]["rel_err"] == pytest.approx(own, rel=1e-5)


@pytest.mark.slow
def test_a_single_broken_tile_of_a_smollm2_projection_fails_tensors_naming_it(
    smollm2_exl3_pair, smollm2_run, tmp_path
):
    """Half of one 16×16 tile's trellis words inverted in a K=4 projection of the SmolLM2 pack: 256 of its
    884,736 weights, far below what its relative error can show, so only the per-tile check sees it; the
    clean pack raises no tile."""
    _, doc, _ = smollm2_run
    assert doc["tasks"]["tensors"]["metrics"]["tile_outliers"] == 0
    name = "model.layers.12.mlp.down_proj"
    copy = copy_checkpoint(smollm2_exl3_pair[SMOLLM2_EXL3], tmp_path / "tile")
    (copy / MANIFEST_NAME).unlink()

    def flip(tensors):
        tensors[f"{name}.trellis"][5, 3, :32] ^= -1

    edit_tensors(copy, flip)
    out = tmp_path / "run"
    res = cli_run_in_process(
        "run", "--ckpt", copy, "--ref", smollm2_exl3_pair[SMOLLM2_BF16], "--tasks", "tensors", "--out", out,
        "--quiet",
    )  # fmt: skip
    assert res.returncode == 1, res.stderr
    entry = results(out)["tasks"]["tensors"]
    assert failed_checks(entry) == {"tile_outliers"}, entry["checks"]
    named = [d for d in entry["details"] if d.get("check") == "tile"]
    assert [d["tensor"] for d in named] == [f"{name}.weight"]
    assert "trellis[5, 3]" in named[0]["detail"]


@pytest.mark.slow
def test_the_smollm2_pack_still_knows_paris(smollm2_exl3_pair):
    checks = read_manifest(smollm2_exl3_pair[SMOLLM2_EXL3])["checks"]
    assert "Paris" in checks["greedy_answer"]
    assert set(checks["worst_rel_err"]) == {"k4", "k6"}


def test_the_fixture_recipe_changes_with_the_encoder_settings(monkeypatch):
    # The cache key holds every setting that changes the bytes: another effort rebuilds the fixture.
    import dataclasses

    from evalsuite.fixtures import exl3, fixture_recipe
    from evalsuite.fixtures.cache import recipe_sha256

    before = fixture_recipe(SMOLLM2_EXL3)
    assert before["policy"]["default_effort"] == 256 and before["source"]["name"] == SMOLLM2_BF16
    faster = dataclasses.replace(exl3.SMOLLM2_EXL3_POLICY, default_effort=64)
    monkeypatch.setattr(exl3, "SMOLLM2_EXL3_POLICY", faster)
    assert recipe_sha256(fixture_recipe(SMOLLM2_EXL3)) != recipe_sha256(before)
