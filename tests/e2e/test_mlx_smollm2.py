"""SmolLM2-135M-Instruct as an MLX pack written by mlx-lm's own converter (4 bits, groups of 64, the tied
embedding quantized): `tensors` passes with every weight decoded bit for bit as
`mx.dequantize` decodes it, and `ppl` runs the decoded pack. Slow tier: the SmolLM2 fixture."""

from __future__ import annotations

from pathlib import Path

import pytest

from evalsuite.fixtures import SMOLLM2_BF16, build_fixtures
from evalsuite.fixtures.names import SMOLLM2_MLX
from tests.conftest import FIXTURES, import_or_skip, ppl_metrics
from tests.e2e.test_tensors import run_tensors

pytestmark = pytest.mark.slow
import_or_skip("mlx_lm", "MLX packs are written by mlx-lm's converter: pip install 'mlx-lm[cpu]'")


@pytest.fixture(scope="session")
def smollm2_mlx() -> tuple[Path, Path]:
    """(the SmolLM2 BF16 fixture, its MLX pack; read-only)."""
    built = build_fixtures(FIXTURES, [SMOLLM2_BF16, SMOLLM2_MLX])
    return built[SMOLLM2_BF16], built[SMOLLM2_MLX]


def test_the_smollm2_mlx_pack_passes_tensors_with_every_weight_decoded_as_mlx_decodes_it(
    smollm2_mlx, tmp_path
):
    source, pack = smollm2_mlx
    code, entry, err = run_tensors(pack, source, tmp_path / "run")
    assert code == 0, (err, entry.get("details"))
    m = entry["metrics"]
    # 30 layers × 7 projections and the embedding (the head is tied to it); 61 norms kept.
    assert (m["quantized_other"], m["protected_total"], m["protected_identical"]) == (211, 61, 61)
    assert m["decode_exact"] is True and m["decode_cross_checked_tensors"] == 211
    assert m["avg_bits_per_weight"] == 4 + 8 * (2 + 2) / 64


def test_ppl_runs_the_decoded_smollm2_pack(smollm2_mlx, tmp_path):
    source, pack = smollm2_mlx
    m = ppl_metrics(pack, source, tmp_path / "run")
    assert "MLX decoded on the CPU by evalsuite" in m["ckpt_execution"]
    assert m["n_scored_tokens"] == 2040 and 0 < m["kld_mean"] < 1
