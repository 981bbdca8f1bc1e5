"""The float32 KLD detail (`evalsuite.stats.logit_rows`) against the float64 definition on the fixture pairs'
real logits: `kld_mean` within 1e-4 relative (or 1e-9 absolute, whichever is larger), and every ranked id and
same-top event exactly the definition's."""

from pathlib import Path

import numpy as np
import pytest

from evalsuite.contract.observation import Observation
from evalsuite.observers.kld_detail import token_detail


def _live_pairs(run_folder: Path) -> list[tuple[Observation, Observation]]:
    """Every (reference, other side) pair of full-vocabulary window-logits observations a run kept, on the
    same tokens (an observation's folder is named by its label: `ref-…`, `ckpt-…`, `floor-…`)."""
    folders = [
        folder
        for folder in sorted((run_folder / "observations").iterdir())
        if (folder / "logits-0000.npy").is_file() and Observation.is_complete(folder)
    ]
    loaded = {folder.name: Observation.load(folder) for folder in folders}
    return [
        (ref, other)
        for name, ref in loaded.items()
        if name.startswith("ref-")
        for other_name, other in loaded.items()
        if other_name != name and other.meta.get("tokens_sha256") == ref.meta.get("tokens_sha256")
    ]


def _check(pairs: list[tuple[Observation, Observation]]) -> None:
    assert pairs, "no pair of live window-logits observations in the run"
    for ref, other in pairs:
        d32 = token_detail(ref, other, chunk_rows=16, precision="float32")
        d64 = token_detail(ref, other, chunk_rows=16, precision="float64")
        assert d32.kld is not None and d64.kld is not None
        for name in ("kld", "reverse_kld"):
            m32, m64 = float(np.mean(getattr(d32, name))), float(np.mean(getattr(d64, name)))
            assert abs(m32 - m64) <= max(1e-4 * abs(m64), 1e-9), (name, m32, m64)
        for name in ("top_ref", "top_ckpt", "same_top"):
            assert np.array_equal(getattr(d32, name), getattr(d64, name)), name


def test_float32_detail_keeps_the_definition_on_the_tiny_pair(tiny_run):
    _check(_live_pairs(tiny_run.out))


@pytest.mark.slow
def test_float32_detail_keeps_the_definition_on_the_smollm2_pair(smollm2_run):
    _check(_live_pairs(smollm2_run.out))
