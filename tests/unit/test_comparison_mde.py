"""`compare` judges a pair of candidates by their per-token difference, paired by token: two candidates closer
than one candidate's own MDE (`kld_vs_ref_mde`, its window-clustered error alone) are told apart where their
paired difference exceeds the pair's MDE, which is computed at the level Holm's correction tests at.

The candidates are two run folders as `evalsuite compare` leaves them (results.json's documents and the
per-token arrays `ppl` writes), with per-token KLDs built so that the texts' windows differ a lot in
difficulty while the two candidates differ by a little, token by token."""

from __future__ import annotations

import numpy as np
import pytest

from evalsuite.candidates.side_by_side import write_comparison
from evalsuite.observers.kld_detail import write_tokens
from evalsuite.stats import claims, metrics
from evalsuite.tasks.ppl import claim_metrics

WINDOWS, PER_WINDOW = 8, 255


def candidate(out, name: str, kld: np.ndarray, nll: np.ndarray, nll_ref: np.ndarray, bits: float) -> dict:
    """A candidate's run folder under `out` (its per-token arrays) and its results.json document."""
    windows = metrics.window_labels(WINDOWS, PER_WINDOW)
    artifacts = out / name / "artifacts"
    artifacts.mkdir(parents=True)
    tokens = write_tokens(artifacts, {"kld": kld, "nll_ref": nll_ref, "nll_ckpt": nll, "window": windows})
    values = {
        "n_windows": WINDOWS,
        "kld_mean": float(kld.mean()),
        "kld_mean_stderr_window": metrics.clustered_stderr(kld, windows),
        "same_top_p": 0.9,
        "same_top_p_stderr_window": 0.01,
        "ln_ppl_ratio": float(np.mean(nll - nll_ref)),
        "ln_ppl_ratio_stderr_window": metrics.clustered_stderr(nll - nll_ref, windows),
    }
    values["ppl_ratio"] = float(np.exp(values["ln_ppl_ratio"]))
    values.update(claim_metrics(values, WINDOWS))  # kld_vs_ref_mde as `ppl` computes it
    return {
        "ckpt": {"path": str(out / name), "format": "compressed-tensors"},
        "verdict": "pass",
        "tasks": {
            "tensors": {"metrics": {"avg_bits_per_weight_all": bits, "payload_bytes": int(bits * 1000)}},
            "ppl": {"metrics": values, "artifacts": {"tokens": tokens}},
        },
    }


def pair_of_candidates(tmp_path, step: float) -> tuple[dict, dict]:
    """Two candidates: B's per-token KLD is A's × (1 − `step`) plus a little noise of its own (B has more
    bits and diverges less), on a text whose windows differ tenfold in difficulty."""
    rng = np.random.default_rng(0)
    difficulty = np.repeat(np.exp(rng.normal(0.0, 1.0, WINDOWS)), PER_WINDOW)
    kld_a = 0.05 * difficulty * rng.gamma(2.0, 0.5, WINDOWS * PER_WINDOW)
    kld_b = kld_a * (1 - step) * np.exp(rng.normal(0.0, 0.05, kld_a.size) - 0.05**2 / 2)
    nll_ref = 2 + difficulty * rng.gamma(2.0, 0.5, kld_a.size)
    nll_a, nll_b = nll_ref + kld_a, nll_ref + kld_b
    docs = {
        "a": candidate(tmp_path, "a", kld_a, nll_a, nll_ref, 4.25),
        "b": candidate(tmp_path, "b", kld_b, nll_b, nll_ref, 8.5),
    }
    doc = write_comparison(tmp_path, "the-reference", ["a", "b"], docs, draw_plots=False)
    return docs, doc


def test_candidates_closer_than_one_s_own_mde_are_told_apart_by_their_paired_difference(tmp_path):
    docs, doc = pair_of_candidates(tmp_path, step=0.05)
    (pair,) = doc["pairs"]
    single_mde = docs["a"]["tasks"]["ppl"]["metrics"]["kld_vs_ref_mde"]
    # The two differ by less than what a test of one candidate's kld_mean alone detects ...
    assert abs(pair["kld_diff"]) < single_mde
    # ... and by more than the pair's own MDE: compare tells them apart, and says so.
    assert abs(pair["kld_diff"]) > pair["kld_mde"]
    assert pair["kld_outcome"] == "b_better" and pair["kld_p_holm"] < claims.ALPHA
    assert pair["kld_verdict"].startswith("b is better than a by ")
    assert "- b is better than a by " in (tmp_path / "compare.md").read_text(encoding="utf-8")


def test_the_pair_s_mde_is_at_the_level_holm_tests_at(tmp_path):
    _, doc = pair_of_candidates(tmp_path, step=0.004)
    (pair,) = doc["pairs"]
    # Two claims (KLD and NLL of the one pair): Holm's strictest step is α / 2.
    assert pair["mde_alpha"] == pytest.approx(claims.ALPHA / 2)
    expected = claims.minimum_detectable_effect(pair["kld_diff_stderr"], WINDOWS, claims.ALPHA / 2)
    assert pair["kld_mde"] == pytest.approx(expected)
    assert pair["kld_mde"] > claims.minimum_detectable_effect(pair["kld_diff_stderr"], WINDOWS)
    # A difference below it is undetermined, and the sentence names the level.
    assert abs(pair["kld_diff"]) < pair["kld_mde"] and pair["kld_outcome"] == "undetermined"
    assert "paired MDE" in pair["kld_verdict"] and "α = 0.025" in pair["kld_verdict"]
