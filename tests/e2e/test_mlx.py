"""MLX packs: the tiny Llama converted by mlx-lm's own converter (`mlx_lm.convert -q`: 4 bits, groups of 64;
fixture `tiny-llama-mlx`) is detected, and `tensors` passes with every weight
decoded by evalsuite and by MLX's `mx.dequantize` bit for bit; a scale multiplied in one group and a flipped
code word each fail, naming the tensor; `ppl` runs the pack's decoded weights through Transformers, the
execution named in the report; a pack short of a tensor is refused in one line before any model loads."""

# ruff: noqa: F811  (pytest fixtures named as the session fixture they take)
from __future__ import annotations

from pathlib import Path

import pytest

from evalsuite.files.checkpoint import Checkpoint
from evalsuite.fixtures import build_fixtures
from evalsuite.fixtures.names import TINY_LLAMA_MLX
from tests.conftest import (
    FIXTURES,
    assert_ppl_refused_before_any_load,
    copy_checkpoint,
    edit_tensors,
    import_or_skip,
    ppl_metrics,
    tensor_edited_copy,
)
from tests.e2e.test_gguf import TINY_LLAMA, tiny_llama  # noqa: F401 (the session fixture)
from tests.e2e.test_tensors import failed_checks, named, run_tensors

pytestmark = pytest.mark.format_evidence(format="mlx", writer="mlx-lm's converter (mlx_lm.convert)")
# A corrupted scale and a corrupted code word: each a claim of docs/formats.md's table.
WHERE = [pytest.param(w, marks=pytest.mark.format_evidence(claim=w)) for w in ("scale", "code")]

import_or_skip("mlx_lm", "MLX packs are written by mlx-lm's converter: pip install 'mlx-lm[cpu]'")
Q_PROJ = "model.layers.1.self_attn.q_proj"
DOWN_PROJ = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def mlx_pack(tiny_llama) -> Path:
    """The tiny Llama's MLX pack (read-only: copy before changing)."""
    return build_fixtures(FIXTURES, [TINY_LLAMA_MLX])[TINY_LLAMA_MLX]


@pytest.mark.format_evidence(claim=["tensors", "decode"])
def test_an_mlx_pack_is_detected_and_every_weight_decodes_as_mlx_decodes_it(mlx_pack, tiny_llama, tmp_path):
    from evalsuite.backends.memory import loaded_bytes
    from evalsuite.backends.options import BackendOptions

    pack = Checkpoint.open(mlx_pack)
    assert pack.format == "mlx"
    # The memory plan counts the decoded model: the source's shapes in the run's dtype.
    assert loaded_bytes(pack, BackendOptions()) == loaded_bytes(Checkpoint.open(tiny_llama), BackendOptions())
    code, entry, err = run_tensors(mlx_pack, tiny_llama, tmp_path / "run")
    assert code == 0, (err, entry.get("details"))
    m = entry["metrics"]
    # 2 layers × 7 projections, the embedding and the untied head; 5 norms kept.
    assert (m["quantized_other"], m["protected_total"], m["protected_identical"]) == (16, 5, 5)
    assert (m["missing"], m["unexpected"], m["config_mismatches"]) == (0, 0, 0)
    assert m["decode_exact"] is True and m["decode_cross_checked_tensors"] == 16
    assert m["avg_bits_per_weight"] == 4 + 8 * (2 + 2) / 64  # bf16 scales and biases per group of 64
    assert 0 < m["worst_rel_err"] < 0.2


@pytest.mark.parametrize("where", WHERE)
def test_a_corrupted_scale_or_code_word_fails_naming_the_tensor(where, mlx_pack, tiny_llama, tmp_path):
    if where == "scale":
        pack = tensor_edited_copy(mlx_pack, tmp_path / "pack", f"{Q_PROJ}.scales", lambda s: s[3, 1].mul_(8))
        tensor = f"{Q_PROJ}.weight"
    else:  # the high bits of two codes of one word
        pack = tensor_edited_copy(
            mlx_pack, tmp_path / "pack", f"{DOWN_PROJ}.weight", lambda w: w[5, 2].bitwise_xor_(0xF0F00000)
        )
        tensor = f"{DOWN_PROJ}.weight"
    code, entry, err = run_tensors(pack, tiny_llama, tmp_path / "run")
    assert code == 1, (err, entry.get("details"))
    assert "outlier_channels" in failed_checks(entry)
    assert list(named(entry, "outlier")) == [tensor]


@pytest.mark.format_evidence(claim="ppl")
def test_ppl_runs_the_decoded_pack_and_names_the_execution(mlx_pack, tiny_llama, tmp_path):
    m = ppl_metrics(mlx_pack, tiny_llama, tmp_path / "run")
    assert m["ckpt_execution"].startswith("MLX decoded on the CPU by evalsuite as mx.dequantize decodes it")
    assert "MLX runtime not run" in m["ckpt_execution"]
    assert 0 < m["kld_mean"] < 0.01  # 4-bit groups of 64 on a random model: near, not equal


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda t: t.pop(f"{Q_PROJ}.biases"), "biases missing beside its scales"),
        # one group's scales and biases dropped from every row: the headers no longer fit the weight
        (
            lambda t: t.update(
                {f"{Q_PROJ}.{p}": t[f"{Q_PROJ}.{p}"][:, :-1].clone() for p in ("scales", "biases")}
            ),
            "scales is BF16",
        ),
    ],
    ids=["missing", "grid"],
)
@pytest.mark.format_evidence(claim="refused")
def test_a_pack_that_cannot_fill_its_model_is_refused_in_one_line_before_any_model_loads(
    edit, said, mlx_pack, tiny_llama, tmp_path
):
    pack = copy_checkpoint(mlx_pack, tmp_path / "pack")
    edit_tensors(pack, edit)
    assert_ppl_refused_before_any_load(pack, tiny_llama, tmp_path / "o", f"MLX module {Q_PROJ}: {said}")


def test_biases_in_another_dtype_than_the_scales_fail_tensors_naming_the_module(
    mlx_pack, tiny_llama, tmp_path
):
    # mx.dequantize computes in the scales' dtype: biases stored wider would be decoded as some other value.
    pack = copy_checkpoint(mlx_pack, tmp_path / "pack")
    edit_tensors(pack, lambda t: t.update({f"{Q_PROJ}.biases": t[f"{Q_PROJ}.biases"].float()}))
    code, entry, _ = run_tensors(pack, tiny_llama, tmp_path / "run")
    assert code == 1
    said = [d for d in entry["details"] if "biases are F32, the scales BF16" in str(d)]
    assert said and Q_PROJ in str(said[0]), entry["details"]
