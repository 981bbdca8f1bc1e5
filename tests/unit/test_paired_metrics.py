"""The paired per-document statistics of the lmeval task, on cases worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evalsuite.stats import metrics

# Ten documents, equal accuracy (5 of 10 on each side) and six flips:
# documents 0-2 correct → wrong, 5-7 wrong → correct, 3-4 right on both sides, 8-9 wrong on both.
REF = [1, 1, 1, 1, 1, 0, 0, 0, 0, 0]
CKPT = [0, 0, 0, 1, 1, 1, 1, 1, 0, 0]


def test_equal_accuracy_can_hide_many_flips():
    f = metrics.flip_counts(REF, CKPT)
    assert (f.c2w, f.w2c, f.n) == (3, 3, 10)
    assert f.rate == 0.6
    assert np.mean(REF) == np.mean(CKPT) == 0.5


def test_paired_stderr_by_hand():
    # d = ckpt − ref = (−1, −1, −1, 0, 0, 1, 1, 1, 0, 0): mean 0, population variance 6/10,
    # stderr sqrt(0.6 / 9) = 0.2581988897…
    est = metrics.paired_difference(REF, CKPT)
    assert est.value == 0.0
    assert est.stderr == pytest.approx(math.sqrt(0.6 / 9), rel=1e-15)
    assert est.n == 10


def test_mcnemar_exact_p_of_balanced_flips_is_one():
    # n = 6 discordant, k = 3: 2 · (C(6,0) + C(6,1) + C(6,2) + C(6,3)) / 2^6 = 2 · 42 / 64 > 1: capped at 1
    assert metrics.mcnemar_exact_p(3, 3) == 1.0


@pytest.mark.parametrize(
    ("c2w", "w2c", "p"),
    [
        (5, 1, 14 / 64),  # 2 · (1 + 6) / 2^6
        (1, 5, 14 / 64),  # two-sided: the direction does not matter
        (8, 0, 2 / 256),  # 2 · 1 / 2^8
        (0, 0, 1.0),  # no discordant document: no evidence of a change
        (7, 3, 2 * (1 + 10 + 45 + 120) / 1024),  # 0.34375
    ],
)
def test_mcnemar_exact_p_by_hand(c2w, w2c, p):
    assert metrics.mcnemar_exact_p(c2w, w2c) == pytest.approx(p, rel=1e-15)


def test_mcnemar_exact_p_agrees_with_scipy_binomial_test():
    stats = pytest.importorskip("scipy.stats")
    for c2w, w2c in [(5, 1), (12, 30), (200, 170), (1, 0)]:
        expected = stats.binomtest(c2w, c2w + w2c, 0.5).pvalue
        assert metrics.mcnemar_exact_p(c2w, w2c) == pytest.approx(expected, rel=1e-9)


def test_mcnemar_exact_p_refuses_negative_counts():
    with pytest.raises(ValueError):
        metrics.mcnemar_exact_p(-1, 2)


def test_identical_sides_have_no_flip_and_a_delta_of_exactly_zero():
    correct = np.array([1, 0, 1, 1, 0], dtype=float)
    f = metrics.flip_counts(correct, correct.copy())
    assert (f.c2w, f.w2c, f.rate) == (0, 0, 0.0)
    est = metrics.paired_difference(correct, correct.copy())
    assert est.value == 0.0 and est.stderr == 0.0
    assert metrics.mcnemar_exact_p(f.c2w, f.w2c) == 1.0


def test_a_single_changed_document_is_a_flip():
    f = metrics.flip_counts([1, 1, 0], [1, 0, 0])
    assert (f.c2w, f.w2c) == (1, 0)
    assert metrics.paired_difference([1, 1, 0], [1, 0, 0]).value == pytest.approx(-1 / 3)


def test_paired_samples_of_different_lengths_are_refused():
    with pytest.raises(ValueError):
        metrics.flip_counts([1, 0], [1, 0, 1])
    with pytest.raises(ValueError):
        metrics.paired_difference([1, 0], [1])


def test_choice_kl_divergence_by_hand():
    # P = softmax(ln 1, ln 1) = (1/2, 1/2), Q = softmax(ln 1, ln 3) = (1/4, 3/4): KL = ½ ln 2 + ½ ln(2/3).
    # Log-likelihoods are not normalised: shifting one side's by a constant changes nothing.
    expected = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    kld = metrics.choice_kl_divergence([-7.0, -7.0], [-2.0, -2.0 + math.log(3)])
    assert kld == pytest.approx(expected, rel=1e-12)


def test_choice_kl_divergence_of_identical_choices_is_exactly_zero():
    lls = [-4.5, -4.625, -4.5, -5.5]
    assert metrics.choice_kl_divergence(lls, list(lls)) == 0.0


def test_recovery_is_ckpt_over_ref_and_undefined_for_a_zero_reference():
    assert metrics.recovery(0.5, 0.45) == pytest.approx(0.9)
    assert math.isnan(metrics.recovery(0.0, 0.3))


def test_paired_proportion_difference_by_hand():
    # Ten cases: 4 parsed by both sides, 2 by the first only, none by the second only, 4 by neither.
    # p1 = 6/10, p2 = 4/10; their Wilson intervals (z = 1.959964) are 0.6 − 0.2873 … 0.6 + 0.2318 and
    # 0.4 − 0.2318 … 0.4 + 0.2873 (Wilson is symmetric about ½, so the two mirror each other).
    # ad − bc = 16 > n/2 = 5: φ = (16 − 5) / sqrt(6·4·4·6) = 11/24, and each half-width is the root of
    # x² + x² − 2φx² = x² (2 − 11/12) = x² · 13/12: 0.28733 · 1.04083 = 0.29906 below, 0.23182 · 1.04083 =
    # 0.24129 above the difference 0.2.
    diff, low, high = metrics.paired_proportion_difference(4, 2, 0, 4)
    l1 = 0.6 - metrics.proportion_interval(6, 10)[1]
    u1 = metrics.proportion_interval(6, 10)[2] - 0.6
    assert diff == pytest.approx(0.2, abs=1e-15)
    assert low == pytest.approx(0.2 - l1 * math.sqrt(13 / 12), rel=1e-12)
    assert high == pytest.approx(0.2 + u1 * math.sqrt(13 / 12), rel=1e-12)
    assert (round(low, 4), round(high, 4)) == (-0.0991, 0.4413)


def test_paired_proportion_difference_agrees_with_the_published_example():
    # Cavo et al. (2012), complete response before and after consolidation therapy, as Fagerland, Lydersen and
    # Laake (2017, ch. 8) report it: 59, 6, 16, 80 → −0.0621 (95% CI −0.1186 to −0.0046).
    diff, low, high = metrics.paired_proportion_difference(59, 6, 16, 80)
    assert (round(diff, 4), round(low, 4), round(high, 4)) == (-0.0621, -0.1186, -0.0046)


def test_paired_proportion_difference_of_identical_sides_is_zero_inside_its_interval():
    diff, low, high = metrics.paired_proportion_difference(30, 0, 0, 10)
    assert diff == 0.0 and low < 0 < high
    assert all(math.isnan(v) for v in metrics.paired_proportion_difference(0, 0, 0, 0))
    with pytest.raises(ValueError):
        metrics.paired_proportion_difference(1, -1, 0, 0)


def test_mcnemar_needs_six_discordant_documents_to_reach_5_percent():
    # All flips one way: p = 2 / 2^n, 0.0625 for n = 5 and 0.03125 for n = 6.
    assert metrics.mcnemar_exact_p(5, 0) == 0.0625 and metrics.mcnemar_exact_p(6, 0) == 0.03125
    assert metrics.mcnemar_min_discordant(0.05) == 6
    # 2 / 2^n < 0.01 from n = 8 (2 / 128 = 0.0156, 2 / 256 = 0.0078).
    assert metrics.mcnemar_min_discordant(0.01) == 8
