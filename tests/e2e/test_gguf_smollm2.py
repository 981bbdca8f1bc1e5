"""Task `tensors` on SmolLM2-135M-Instruct re-quantized to GGUF by the `gguf` package (Q4_0, Q8_0, Q5_1 from
the BF16 fixture, `smollm2-135m-gguf`) and to a Q4_K_M mix whose k-quant blocks llama.cpp's own
`ggml_quantize_chunk` wrote: each passes with its per-type counts and bits per weight, and a
flipped byte in one block's scale or in its codes fails, naming the tensor. Slow tier: the BF16 fixture and
the packs take minutes to build (once, into the fixture cache)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from evalsuite.fixtures import SMOLLM2_BF16, build_fixtures
from evalsuite.fixtures.gguf_packs import SMOLLM2_GGUF_TYPES
from evalsuite.fixtures.names import SMOLLM2_GGUF
from tests.conftest import FIXTURES
from tests.e2e.test_gguf import flip_block_byte, rows
from tests.e2e.test_tensors import failed_checks, named, run_tensors

pytestmark = pytest.mark.slow
DOWN = "model.layers.12.mlp.down_proj.weight"  # stored as blk.12.ffn_down.weight


@pytest.fixture(scope="session")
def smollm2_ggufs() -> tuple[Path, Path]:
    """(the SmolLM2 BF16 fixture, the folder of its GGUF packs: one sub-folder per type; read-only)."""
    built = build_fixtures(FIXTURES, [SMOLLM2_BF16, SMOLLM2_GGUF])
    return built[SMOLLM2_BF16], built[SMOLLM2_GGUF]


@pytest.fixture(scope="session")
def smollm2_gguf_runs(smollm2_ggufs, tmp_path_factory) -> dict[str, tuple[int, dict, Path]]:
    """`tensors` on every pack, once per session: exit code, results.json's entry, the run folder."""
    source, packs = smollm2_ggufs
    runs = {}
    for pack in SMOLLM2_GGUF_TYPES:
        out = tmp_path_factory.mktemp(f"smollm2-gguf-{pack}")
        code, entry, _ = run_tensors(packs / pack, source, out / "run")
        runs[pack] = (code, entry, out / "run")
    return runs


@pytest.mark.parametrize("pack", list(SMOLLM2_GGUF_TYPES))
def test_each_smollm2_gguf_passes_with_its_counts_and_bits(pack, smollm2_gguf_runs):
    code, entry, out = smollm2_gguf_runs[pack]
    assert code == 0, entry.get("details")
    m = entry["metrics"]
    linear, embedding = SMOLLM2_GGUF_TYPES[pack]
    # 30 layers × 7 projections in the Linear type; the tied head is not stored; 61 norms in F32.
    counts = {linear: 210, "F32": 61}
    counts[embedding or linear] = counts.get(embedding or linear, 0) + 1
    if linear == "Q4_K_M":
        # llama.cpp's mix: ffn_down and attn_v in Q6_K on 14 of the 30 layers, the rest Q4_K; rows 576 wide
        # (every projection but ffn_down, the embedding) fall back to Q5_0 and Q8_0 as llama.cpp's do.
        counts, linear = {"F32": 61, "Q4_K": 16, "Q5_0": 166, "Q6_K": 14, "Q8_0": 15}, "Q4_K"
    assert m["gguf_tensor_types"] == ", ".join(f"{t} {n}" for t, n in sorted(counts.items()))
    assert (m["missing"], m["unexpected"], m["config_mismatches"], m["tile_outliers"]) == (0, 0, 0, 0)
    assert m["protected_total"] == m["protected_identical"] == 61
    found = rows(out)
    assert found[DOWN]["format"] == linear.lower()
    assert "rows unpermuted" in found["model.layers.0.self_attn.k_proj.weight"]["note"]


@pytest.mark.parametrize("where", ["scale", "code"])
def test_a_flipped_byte_in_one_smollm2_block_fails_naming_the_tensor(where, smollm2_ggufs, tmp_path):
    """Q4_0: the high byte of one block's F16 scale, or the byte holding its largest weight's code."""
    source, packs = smollm2_ggufs
    shutil.copytree(packs / "q4_0", tmp_path / "pack")
    path = next((tmp_path / "pack").glob("*.gguf"))
    row, block = 100, 5
    flip_block_byte(path, "blk.12.ffn_down.weight", row, block, where)
    code, entry, err = run_tensors(tmp_path / "pack", source, tmp_path / "run")
    assert code == 1, (err, entry.get("details"))
    assert "tile_outliers" in failed_checks(entry)
    blocks = named(entry, "block")
    assert list(blocks) == [DOWN]
    assert f"row {row}, weights {32 * block}..{32 * block + 31}" in blocks[DOWN]


def test_compare_of_smollm2_against_two_ggufs_a_compressed_tensors_pack_the_exl3_pack_and_an_mlx_pack(
    smollm2_ggufs, smollm2_pair, smollm2_exl3_pair, tmp_path
):
    """One `compare` run: `ppl` through Transformers' dequantization of each GGUF (backend `hf`) and the MLX
    pack's decoded weights, `tensors` for the bits per weight of every candidate (one convention: every
    stored bit over the source's weights); one table, one KLD-vs-bpw plot."""
    from evalsuite.fixtures import SMOLLM2_EXL3, SMOLLM2_W4A8
    from evalsuite.fixtures.names import SMOLLM2_MLX
    from tests.conftest import import_or_skip, run_cli

    import_or_skip("mlx_lm", "the MLX pack is written by mlx-lm's converter: pip install 'mlx-lm[cpu]'")

    source, packs = smollm2_ggufs
    mlx_pack = build_fixtures(FIXTURES, [SMOLLM2_MLX])[SMOLLM2_MLX]
    ckpts = [
        packs / "q4_0",
        packs / "q8_0",
        smollm2_pair[SMOLLM2_W4A8],
        smollm2_exl3_pair[SMOLLM2_EXL3],
        mlx_pack,
    ]
    out = tmp_path / "cmp"
    args = ["compare", "--ref", source, "--tasks", "ppl,tensors", "--corpus", "python-docs", "--out", out]
    done = run_cli(*args, *[a for c in ckpts for a in ("--ckpt", c)], "--quiet")
    assert done.returncode in (0, 1), done.stderr
    doc = json.loads((out / "compare.json").read_text(encoding="utf-8"))
    rows = {r["name"]: r for r in doc["candidates"]}
    assert set(rows) == {"q4_0", "q8_0", SMOLLM2_W4A8, SMOLLM2_EXL3, SMOLLM2_MLX}, list(rows)
    assert rows[SMOLLM2_MLX]["bits_per_weight"] == pytest.approx(4.5, abs=0.01)
    for row in rows.values():
        assert row["kld_mean"] > 0 and row["bits_per_weight_from"] == "tensors", row
    # more bits, less divergence: Q8_0 (8.5 bpw) against Q4_0 (4.5 bpw, its embedding Q8_0)
    assert rows["q4_0"]["bits_per_weight"] < rows["q8_0"]["bits_per_weight"]
    assert rows["q8_0"]["kld_mean"] < rows["q4_0"]["kld_mean"]
    assert (out / "kld_vs_bpw.png").is_file()
    print(
        json.dumps(
            {n: {k: r[k] for k in ("bits_per_weight", "kld_mean", "ppl_ratio")} for n, r in rows.items()}
        )
    )
