"""What a figure lets a report claim (`evalsuite.stats.claims`): t quantiles against scipy's, equivalence's
three
outcomes on constructed per-token arrays, Holm's correction and the minimum detectable effect worked by hand,
thresholds judged on a bound, and the tie-aware same-top-token event."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from evalsuite.contract.spec import Threshold, apply_threshold
from evalsuite.observers.kld_detail import TokenDetail, detail_metrics
from evalsuite.stats import claims, metrics, token_ranks

PER_WINDOW = 255


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 8, 15, 64, 501])
def test_t_distribution_matches_scipy(df):
    for t in (-40.0, -2.5, -1.96, -0.3, 0.0, 0.7, 1.96, 3.0, 250.0):
        assert claims.t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-12)
    for p in (0.05, 0.2, 0.5, 0.8, 0.9, 0.95, 0.975, 0.999):
        assert claims.t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9, abs=1e-12)


def test_with_8_windows_a_1_96_error_is_not_95_percent():
    # The reason for t: P(|t_7| > 1.96) is about 0.09, not 0.05.
    assert 2 * (1 - claims.t_cdf(1.96, 7)) == pytest.approx(0.0908, abs=1e-3)


def excess_tokens(true_excess: float, n_windows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-token KLD excesses over a floor: a window effect and a token effect around `true_excess`."""
    rng = np.random.default_rng(seed)
    window_effect = np.repeat(rng.normal(0.0, 0.002, n_windows), PER_WINDOW)
    x = true_excess + window_effect + rng.normal(0.0, 0.01, n_windows * PER_WINDOW)
    return x, metrics.window_labels(n_windows, PER_WINDOW)


def outcome(x: np.ndarray, labels: np.ndarray, margin: float) -> str:
    se = metrics.clustered_stderr(x, labels)
    return claims.equivalence(float(np.mean(x)), se, len(np.unique(labels)), margin)


def test_a_true_zero_excess_with_8_windows_is_within():
    x, labels = excess_tokens(0.0, 8)
    assert outcome(x, labels, margin=0.01) == "within"


@pytest.mark.parametrize("n_windows", [1, 2])
def test_the_same_data_with_1_or_2_windows_is_undetermined(n_windows):
    x, _ = excess_tokens(0.0, 8)
    labels = metrics.window_labels(n_windows, x.size // n_windows)
    assert outcome(x, labels, margin=0.01) == "undetermined"
    assert math.isnan(
        claims.bound(float(np.mean(x)), metrics.clustered_stderr(x, labels), n_windows, "upper95")
    )
    assert claims.too_few_reason(n_windows) is not None


def test_a_small_true_excess_beyond_the_margin_is_above():
    x, labels = excess_tokens(0.02, 8)
    assert outcome(x, labels, margin=0.01) == "above"


def test_an_excess_at_the_margin_is_undetermined_rather_than_within():
    x, labels = excess_tokens(0.01, 8)
    assert outcome(x, labels, margin=0.01) == "undetermined"


def test_bounds_use_t_with_windows_minus_one_degrees_of_freedom():
    assert claims.bound(1.0, 0.1, 8, "upper95") == pytest.approx(1.0 + stats.t.ppf(0.95, 7) * 0.1)
    assert claims.bound(1.0, 0.1, 8, "lower95") == pytest.approx(1.0 - stats.t.ppf(0.95, 7) * 0.1)


def test_a_two_sided_interval_is_t_at_975_with_windows_minus_one_degrees_of_freedom():
    # t_{0.975, 2} = 4.302652729911275 (tables): 0 ± 4.3027 · 1 over 3 clusters; too few clusters: no interval
    assert claims.interval(0.0, 1.0, 3) == pytest.approx((-4.302652729911275, 4.302652729911275))
    assert claims.interval(1.0, 0.1, 8) == pytest.approx(
        (1.0 - stats.t.ppf(0.975, 7) * 0.1, 1.0 + stats.t.ppf(0.975, 7) * 0.1)
    )
    assert all(math.isnan(end) for end in claims.interval(1.0, 0.1, 2))


def test_holm_adjusts_step_down_and_keeps_nan_out_of_the_family():
    # sorted 0.005, 0.01, 0.03, 0.04 (m = 4): 0.02, 0.03, max(0.03, 0.06), max(0.06, 0.04)
    adjusted = claims.holm([0.01, 0.04, 0.03, float("nan"), 0.005])
    assert adjusted[:3] == pytest.approx([0.03, 0.06, 0.06])
    assert math.isnan(adjusted[3]) and adjusted[4] == pytest.approx(0.02)


def test_the_minimum_detectable_effect_is_the_sum_of_two_t_quantiles_times_the_error():
    expected = (stats.t.ppf(0.975, 7) + stats.t.ppf(0.8, 7)) * 0.01
    assert claims.minimum_detectable_effect(0.01, 8) == pytest.approx(expected)
    assert math.isnan(claims.minimum_detectable_effect(0.01, 2))


def test_the_minimum_detectable_effect_at_holm_s_level_is_larger():
    expected = (stats.t.ppf(1 - 0.05 / 8, 7) + stats.t.ppf(0.8, 7)) * 0.01
    assert claims.minimum_detectable_effect(0.01, 8, alpha=0.05 / 4) == pytest.approx(expected)
    assert expected > claims.minimum_detectable_effect(0.01, 8)


def floor_and_candidate(candidate: float) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """A floor whose window means are 0.7 and 1.3 in turn (its mean 1, uncertain by ±0.11 over 8 windows)
    drawn twice alike, and a candidate at `candidate` on every token of every window."""
    labels = metrics.window_labels(8, PER_WINDOW)
    floor = np.repeat(np.tile([0.7, 1.3], 4), PER_WINDOW)
    return np.full(floor.size, candidate), [floor, floor.copy()], labels


def test_within_the_floor_counts_the_floor_s_own_error_in_the_margin():
    # 1.75 against (1 + 1) × a floor of 1 ± 0.11: the allowed 2 is itself only known to ±0.23, so that 1.75
    # is not shown to be under it. Testing the excess 0.75 against a known margin of 1 said `within`.
    kld, draws, labels = floor_and_candidate(1.75)
    floor = claims.against_floor(kld, draws, labels, margin=1.0)
    assert floor.beyond.value == pytest.approx(-0.25) and floor.allowed == pytest.approx(2.0)
    assert floor.outcome == "undetermined"
    old = claims.equivalence(floor.excess.value, floor.excess_stderr, 8, 1.0 * floor.mean.value)
    assert old == "within"  # the former rule, on the same input
    assert claims.against_floor(*floor_and_candidate(1.4), margin=1.0).outcome == "within"
    assert claims.against_floor(*floor_and_candidate(2.6), margin=1.0).outcome == "above"
    metrics_of = floor.metrics("kld", "noise_floor")
    assert metrics_of["noise_floor"] == "undetermined" and metrics_of["kld_floor_margin"] == 1.0
    assert metrics_of["kld_beyond_allowed_upper95"] > 0 > metrics_of["kld_beyond_allowed"]


def test_two_sided_p_of_a_paired_t():
    assert claims.two_sided_p(0.2, 0.1, 8) == pytest.approx(2 * stats.t.sf(2.0, 7))
    assert claims.two_sided_p(0.0, 0.0, 8) == 1.0
    assert math.isnan(claims.two_sided_p(0.2, 0.1, 2))


def test_a_threshold_on_the_upper_bound_passes_only_what_is_shown_under_it():
    values = {"kld_mean": 0.04, "kld_mean_stderr_window": 0.01, "n_windows": 8}
    (estimate,) = apply_threshold("kld_mean", 0.04, Threshold(max=0.05), values)
    (release,) = apply_threshold("kld_mean", 0.04, Threshold(max=0.05, on="upper95"), values)
    (nightly,) = apply_threshold("kld_mean", 0.04, Threshold(max=0.05, on="lower95"), values)
    assert estimate.passed and estimate.on is None
    # 0.04 + 1.895 · 0.01 > 0.05: not shown to stay under; 0.04 − 0.019 is not shown to exceed it.
    assert not release.passed and release.on == "upper95"
    assert release.value == pytest.approx(0.0590, abs=1e-3)
    assert nightly.passed and nightly.on == "lower95"
    # A task's own bound is preferred (ppl_ratio's comes from ln_ppl_ratio's error).
    (own,) = apply_threshold(
        "ppl_ratio", 1.01, Threshold(max=1.02, on="upper95"), {"ppl_ratio_upper95": 1.03}
    )
    assert not own.passed and own.value == 1.03


def test_a_threshold_on_a_bound_that_cannot_be_computed_does_not_pass():
    values = {"kld_mean": 0.0, "kld_mean_stderr_window": 0.01, "n_windows": 2}
    (check,) = apply_threshold("kld_mean", 0.0, Threshold(max=0.05, on="upper95"), values)
    assert not check.passed and math.isnan(check.value)


def tied_rows() -> tuple[np.ndarray, np.ndarray]:
    """Four positions of a 6-token vocabulary. Row 0: the same unique top. Row 1: the reference ties tokens
    2 and 4, the candidate's top is 4. Row 2: the reference ties {1, 3}, the candidate {3, 5}: token 3 is top
    on both, though the first maxima by index are 1 and 3. Row 3: different tops, no tie."""
    ref = np.log(
        np.array(
            [
                [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],
                [0.1, 0.1, 0.3, 0.1, 0.3, 0.1],
                [0.1, 0.3, 0.1, 0.3, 0.1, 0.1],
                [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],
            ]
        )
    )
    ckpt = np.log(
        np.array(
            [
                [0.4, 0.2, 0.1, 0.1, 0.1, 0.1],
                [0.1, 0.1, 0.2, 0.1, 0.4, 0.1],
                [0.1, 0.1, 0.1, 0.35, 0.05, 0.35],
                [0.1, 0.5, 0.1, 0.1, 0.1, 0.1],
            ]
        )
    )
    return ref, ckpt


def test_same_top_counts_a_token_top_on_both_sides_whatever_the_tie_break():
    ref, ckpt = tied_rows()
    assert token_ranks.same_top_tied(ref, ckpt).tolist() == [True, True, True, False]
    # argmax takes the first index of a tie: it would call rows 1 and 2 disagreements
    assert (ref.argmax(1) == ckpt.argmax(1)).tolist() == [True, False, False, False]


def test_top1_agreement_and_same_top_p_are_one_figure():
    ref, ckpt = tied_rows()
    same = token_ranks.same_top_tied(ref, ckpt)
    top_ref, top_ckpt = np.argsort(-ref, axis=1, kind="stable"), np.argsort(-ckpt, axis=1, kind="stable")
    detail = TokenDetail(np.exp(ref.max(1)), top_ref, top_ckpt, None, same_top=same)
    kld = metrics.kl_divergence(ref, ckpt)
    nll = np.full(4, 1.0)
    values = detail_metrics(detail, kld, nll, nll, metrics.window_labels(2, 2))
    assert values["top1_agreement"] == pytest.approx(float(np.mean(same))) == 0.75
    assert "top1_agreement_stderr_window" in values and "top5_agreement_stderr_window" in values


def _brute_force_top_k_tied(a: np.ndarray, b: np.ndarray, k: int) -> bool:
    """Whether some tie-break of each side ranks the same k tokens first in the same order: every sequence
    of k distinct tokens tried against both sides' weak orders."""
    ids = range(len(a))
    for seq in itertools.permutations(ids, k):
        rest = [i for i in ids if i not in seq]
        for v in (a, b):
            if any(v[seq[j]] < v[seq[j + 1]] for j in range(k - 1)) or any(v[r] > v[seq[-1]] for r in rest):
                break
        else:
            return True
    return False


def test_top_k_agreement_counts_a_ranking_both_sides_allow_whatever_the_tie_break():
    # Ranked as torch might among equal values, these rows disagree from rank 2; some tie-break agrees.
    a = np.array([[1.0, 5.0, 5.0, 0.0], [5.0, 4.0, 4.0, 0.0], [5.0, 5.0, 0.0, 1.0]])
    b = np.array([[1.0, 5.0, 6.0, 0.0], [5.0, 3.0, 4.0, 0.0], [6.0, 4.0, 5.0, 1.0]])
    top_a = np.array([[1, 2], [0, 1], [0, 1]])
    top_b = np.array([[2, 1], [0, 2], [0, 2]])
    hits = token_ranks.top_k_hits_tied(a, b, top_a, top_b)
    # Row 0: a's tie goes b's way; row 1: the tie at rank 2 reaches past a's given ranking; row 2: b ranks
    # token 2 second, which no tie-break of a puts above token 1.
    assert hits.tolist() == [[True, True], [True, True], [True, False]]
    assert token_ranks.top_k_hits(top_a, top_b, 2).tolist() == [False, False, False]


def test_top_k_agreement_ties_included_is_the_brute_force_answer_on_coarse_random_rows():
    rng = np.random.default_rng(7)
    # Few distinct values: ties at every rank, as BF16 logits have them.
    a = rng.integers(0, 4, size=(400, 7)).astype(np.float32)
    b = np.where(rng.random((400, 7)) < 0.7, a, rng.integers(0, 4, size=(400, 7))).astype(np.float32)
    k = 3
    top_a, top_b = (np.argsort(-v, axis=1, kind="stable")[:, :k] for v in (a, b))
    hits = token_ranks.top_k_hits_tied(a, b, top_a, top_b)
    expected = [[_brute_force_top_k_tied(a[i], b[i], j) for j in range(1, k + 1)] for i in range(len(a))]
    assert hits.tolist() == expected
    # Given each side's largest entries, ties are found from them: the same answer, whether they hold every
    # tied token (all 7) or leave rows to be looked at whole (k + 1).
    order = [np.argsort(-v, axis=1, kind="stable") for v in (a, b)]
    for width in (k + 1, 7):
        ranked = tuple(
            (o[:, :width], np.take_along_axis(v, o[:, :width], axis=1))
            for o, v in zip(order, (a, b), strict=True)
        )
        assert token_ranks.top_k_hits_tied(a, b, top_a, top_b, ranked=ranked).tolist() == expected, width
    assert np.array_equal(hits[:, 0], token_ranks.same_top_tied(a, b))
    # The given rankings alone would call some of these rows disagreements.
    assert (hits[:, k - 1] & ~token_ranks.top_k_hits(top_a, top_b, k)).any()
