"""Metric functions on cases worked by hand."""

import math

import numpy as np
import pytest

from evalsuite.stats import metrics, tensor_errors


def test_mean_with_stderr_uses_n_minus_one():
    # x = 1, 2, 3, 4: mean 2.5, population variance 1.25, stderr sqrt(1.25 / 3)
    est = metrics.mean_with_stderr([1, 2, 3, 4])
    assert est.value == 2.5
    assert est.stderr == pytest.approx(math.sqrt(1.25 / 3), rel=1e-15)
    assert est.n == 4


def test_single_sample_has_no_stderr():
    assert math.isnan(metrics.mean_with_stderr([3.0]).stderr)


def test_perplexity_of_uniform_guess_over_four_tokens_is_four():
    assert metrics.perplexity([math.log(4)] * 10) == pytest.approx(4.0, rel=1e-15)


def test_paired_log_ratio_of_identical_sides_is_exactly_zero():
    nll = np.array([0.3, 1.7, 2.2])
    est = metrics.paired_log_ratio(nll, nll.copy())
    assert est.value == 0.0 and est.stderr == 0.0


def test_paired_log_ratio_by_hand():
    # differences 0.1, 0.3: mean 0.2, population variance 0.01, stderr sqrt(0.01 / 1) = 0.1
    est = metrics.paired_log_ratio([1.0, 2.0], [1.1, 2.3])
    assert est.value == pytest.approx(0.2)
    assert est.stderr == pytest.approx(0.1)


def test_kl_divergence_by_hand():
    # P = (1/2, 1/2), Q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3)
    p = np.log([[0.5, 0.5]])
    q = np.log([[0.25, 0.75]])
    expected = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    assert metrics.kl_divergence(p, q)[0] == pytest.approx(expected, rel=1e-12)


def test_kl_divergence_of_identical_rows_is_exactly_zero():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 7))
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    assert np.all(metrics.kl_divergence(logp, logp) == 0.0)


def test_kl_divergence_ignores_tokens_the_reference_never_gives():
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.log(np.array([[1.0, 0.0]]))  # log 0 = -inf
        q = np.log(np.array([[0.5, 0.5]]))
        assert metrics.kl_divergence(p, q)[0] == pytest.approx(math.log(2))


def test_same_top_rate_with_binomial_stderr():
    # 3 of 4 agree: p = 0.75, stderr sqrt(0.75 * 0.25 / 3) = 0.25
    est = metrics.same_top_rate([1, 2, 3, 4], [1, 2, 3, 5])
    assert est.value == 0.75
    assert est.stderr == pytest.approx(0.25)


def test_delta_p_by_hand():
    # p_ref = (0.5, 0.5), p_ckpt = (0.25, 0.75): Δp = (-0.25, 0.25); mean 0, RMS 0.25
    dp = metrics.delta_p(np.log([0.5, 0.5]), np.log([0.25, 0.75]))
    assert dp.mean.value == pytest.approx(0.0, abs=1e-15)
    assert dp.rms.value == pytest.approx(0.25)


def test_quantiles_interpolate_linearly():
    assert metrics.quantiles([0, 10], (0.5, 0.9)) == pytest.approx((5.0, 9.0))


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 5, 3], 1), ([1, 2], [1, 2, 3], 2), ([9], [1], 0)],
)
def test_first_divergence(a, b, expected):
    assert metrics.first_divergence(a, b) == expected


@pytest.mark.parametrize(
    ("answer", "edits"),
    [
        ("KAFKA 7351", 0),  # read exactly
        ("KAFKA 7857", 2),  # two digits substituted: 3 → 8, 1 → 7
        ("KAFKA7351", 1),  # the space deleted
        ("KAFKA 7351.", 1),  # a full stop inserted
        ("The text is KAFKA 7351", 12),  # "The text is " inserted: 12 characters
        ("", 10),  # nothing read: every character deleted
        ("7351 KAFKA", 10),  # the words swapped: Levenshtein counts 10 single-character edits here
    ],
)
def test_character_error_rate_by_hand(answer, edits):
    truth = "KAFKA 7351"  # 10 characters
    assert metrics.edit_distance(answer, truth) == edits
    assert metrics.character_error_rate(answer, truth) == edits / 10


def test_edit_distance_counts_characters_not_bytes():
    assert metrics.edit_distance("kitten", "sitting") == 3  # k → s, e → i, + g
    # One Chinese character substituted: one edit of four, though it is three bytes in UTF-8.
    assert metrics.character_error_rate("评测套装", "评测套件") == 0.25
    with pytest.raises(ValueError):
        metrics.character_error_rate("anything", "")


def test_statistics_of_nothing_are_refused():
    with pytest.raises(ValueError):
        metrics.mean_with_stderr([])


def test_top_k_tail_kl_is_exact_when_the_tail_samples_cover_the_tail_evenly():
    # P = (0.5, 0.25, 0.125, 0.125), Q = (0.25, 0.25, 0.25, 0.25); top-2 of P, tail {2, 3} of mass 0.25.
    # Drawing each tail id once is the mean under q = (0.5, 0.5): the estimate equals the full KL.
    p = np.log([0.5, 0.25, 0.125, 0.125])
    q = np.log([0.25] * 4)
    full = metrics.kl_divergence(p[None], q[None])[0]
    est = metrics.kl_divergence_top_k_tail(p[None, :2], q[None, :2], [0.25], p[None, 2:], q[None, 2:])[0]
    assert est == pytest.approx(full, rel=1e-12)
    assert full == pytest.approx(0.5 * math.log(2) + 0 + 2 * 0.125 * math.log(0.5))


def test_top_k_tail_kl_without_tail_samples_is_the_top_k_part():
    p, q = np.log([[0.5, 0.5]]), np.log([[0.25, 0.75]])
    est = metrics.kl_divergence_top_k_tail(p, q, [0.0], np.empty((1, 0)), np.empty((1, 0)))
    assert est[0] == pytest.approx(metrics.kl_divergence(p, q)[0])


def test_error_metrics_by_hand():
    a, b = np.array([3.0, 4.0]), np.array([3.0, 5.0])
    assert tensor_errors.relative_frobenius_error(a, b) == pytest.approx(1 / 5)
    assert tensor_errors.max_abs_error(a, b) == 1.0
    assert tensor_errors.cosine_similarity(a, b) == pytest.approx((9 + 20) / (5 * math.sqrt(34)))


def test_identical_arrays_have_cosine_exactly_one_and_no_error():
    x = np.random.default_rng(1).normal(size=(20, 64)).astype(np.float32)
    assert tensor_errors.cosine_similarity(x, x.copy()) == 1.0
    assert tensor_errors.relative_frobenius_error(x, x.copy()) == 0.0
    assert tensor_errors.max_abs_error(x, x.copy()) == 0.0


def test_error_sums_by_hand():
    # r = (3, 4), x = (3, 5): error (0, 1), Σe² = 1, Σr² = 25, Σx² = 34, Σr·x = 29
    sums = tensor_errors.error_sums([3.0, 4.0], [3.0, 5.0])
    assert sums == tensor_errors.ErrorSums(n=2, ref_sq=25.0, err_sq=1.0, cand_sq=34.0, dot=29.0, max_abs=1.0)
    assert sums.relative_frobenius_error == pytest.approx(1 / 5)
    assert sums.sqnr_db == pytest.approx(10 * math.log10(25))  # 13.98 dB
    assert sums.cosine == pytest.approx(29 / (5 * math.sqrt(34)))
    assert tensor_errors.sqnr_db([3.0, 4.0], [3.0, 5.0]) == pytest.approx(10 * math.log10(25))


def test_error_sums_of_chunks_add_up_to_the_whole():
    # r = (1, 2, 2), x = (1, 2, 0): chunks (1, 2) | (2,) against (1, 2) | (0,); ‖e‖ = 2, ‖r‖ = 3, r·x = 5
    whole = tensor_errors.error_sums([1, 2, 2], [1, 2, 0])
    assert tensor_errors.error_sums([1, 2], [1, 2]) + tensor_errors.error_sums([2], [0]) == whole
    assert whole.relative_frobenius_error == pytest.approx(2 / 3)
    assert whole.cosine == pytest.approx(5 / (3 * math.sqrt(5)))


def test_an_exact_float32_copy_has_no_error_and_infinite_sqnr():
    x = np.random.default_rng(2).normal(size=(8, 32)).astype(np.float32)
    sums = tensor_errors.error_sums(x, x.copy())
    assert (sums.relative_frobenius_error, sums.sqnr_db, sums.max_abs) == (0.0, math.inf, 0.0)
    assert sums.cosine == pytest.approx(1.0, abs=1e-6)


def test_zeroing_a_weight_is_a_relative_error_of_one_at_zero_db():
    sums = tensor_errors.error_sums([1.0, -1.0], [0.0, 0.0])
    assert sums.relative_frobenius_error == 1.0
    assert sums.sqnr_db == 0.0
    assert math.isnan(sums.cosine)


def test_window_clustered_stderr_by_hand():
    # Two windows of three tokens: mean 4, deviation sums -6 and +6, so sqrt(2/1 · 72) / 6 = 2; for equal
    # windows that is the standard error of the window means 2 and 6: sqrt(8) / sqrt(2) = 2.
    x = [1.0, 2.0, 3.0, 4.0, 5.0, 9.0]
    assert metrics.clustered_stderr(x, metrics.window_labels(2, 3)) == pytest.approx(2.0, rel=1e-15)
    # Unequal clusters: mean 3, sums -2 and +2: sqrt(2 · 8) / 3.
    assert metrics.clustered_stderr([1.0, 3.0, 5.0], ["a", "a", "b"]) == pytest.approx(4 / 3, rel=1e-15)


def test_window_clustered_stderr_exceeds_the_per_token_one_when_windows_differ():
    # Within-window values agree, windows differ: the per-token error treats 6 samples as independent.
    x = [1.0, 1.0, 1.0, 3.0, 3.0, 3.0]
    per_token = metrics.mean_with_stderr(x).stderr
    assert metrics.clustered_stderr(x, metrics.window_labels(2, 3)) > 1.5 * per_token


def test_one_window_has_no_clustered_stderr():
    assert math.isnan(metrics.clustered_stderr([1.0, 2.0], [0, 0]))


def test_top_k_tail_kl_is_unbiased_on_a_random_distribution():
    """Monte Carlo: P and Q over 300 tokens, the top-16 of P exact, 8 ids drawn from P's tail per row; over
    20,000 independent rows the estimates average to the full KL within 4 Monte Carlo standard errors, and
    that error is small enough (< 1% of the KL) for a bias of that size to fail the test."""
    rng = np.random.default_rng(7)
    vocab, k, m, rows = 300, 16, 8, 20_000
    logits = rng.normal(size=vocab) * 2.0
    p = logits - np.logaddexp.reduce(logits)
    q_logits = logits + rng.normal(size=vocab) * 0.5
    q = q_logits - np.logaddexp.reduce(q_logits)
    full = metrics.kl_divergence(p[None], q[None])[0]
    order = np.argsort(-p)
    top, tail = order[:k], order[k:]
    tail_p = np.exp(p[tail])
    draws = rng.choice(tail, size=(rows, m), p=tail_p / tail_p.sum())
    est = metrics.kl_divergence_top_k_tail(
        np.broadcast_to(p[top], (rows, k)),
        np.broadcast_to(q[top], (rows, k)),
        np.full(rows, tail_p.sum()),
        p[draws],
        q[draws],
    )
    mc = metrics.mean_with_stderr(est)
    assert mc.stderr < 0.01 * full
    assert abs(mc.value - full) < 4 * mc.stderr
