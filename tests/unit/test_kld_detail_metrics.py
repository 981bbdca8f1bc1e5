"""The KLD detail statistics of `ppl` and `compare` (metrics.py), on cases worked by hand."""

import math

import numpy as np
import pytest

from evalsuite.stats import metrics


def test_delta_p_percentiles_are_named_as_llama_cpp_prints_them():
    # 0.00, 0.01, …, 1.00: the q-quantile with linear interpolation is q itself
    dp = np.linspace(0.0, 1.0, 101)
    got = metrics.delta_p_percentiles(dp)
    assert list(got) == [
        "max", "p99.9", "p99", "p95", "p90", "p75", "median", "p25", "p10", "p5", "p1", "p0.1", "min",
    ]  # fmt: skip
    assert got["max"] == 1.0 and got["min"] == 0.0
    assert got["p99.9"] == pytest.approx(0.999) and got["p5"] == pytest.approx(0.05)
    assert got["median"] == pytest.approx(0.5)


def test_top_k_agreement_counts_rows_whose_first_k_ranks_agree_in_order():
    ref = np.array([[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 5, 6]])
    ckpt = np.array([[1, 2, 3], [1, 3, 2], [2, 1, 3], [4, 5, 6]])
    # k = 1: rows 0, 1, 3 agree (3 of 4); k = 2: rows 0 and 3; k = 3: rows 0 and 3 (row 1 swaps ranks 2, 3)
    one = metrics.top_k_agreement(ref, ckpt, 1)
    assert one.value == 0.75 and one.n == 4
    assert one.stderr == pytest.approx(math.sqrt(0.75 * 0.25 / 3))
    assert metrics.top_k_agreement(ref, ckpt, 2).value == 0.5
    assert metrics.top_k_agreement(ref, ckpt, 3).value == 0.5
    with pytest.raises(ValueError, match="top-4 agreement needs 4"):
        metrics.top_k_agreement(ref, ckpt, 4)


def test_confidence_buckets_by_hand():
    kld = [0.4, 0.2, 0.1, 0.05, 0.01, 0.03]
    conf = [0.1, 0.2, 0.6, 0.8, 1.0, 0.96]
    buckets = metrics.confidence_buckets(kld, conf)
    assert [(b.lo, b.hi, b.n) for b in buckets] == [
        (0.0, 0.25, 2), (0.25, 0.5, 0), (0.5, 0.75, 1), (0.75, 0.95, 1), (0.95, 1.0, 2),
    ]  # fmt: skip
    low = buckets[0]
    assert low.share == pytest.approx(2 / 6)
    # 0.4 and 0.2: mean 0.3, population variance 0.01, stderr sqrt(0.01 / 1)
    assert low.mean.value == pytest.approx(0.3) and low.mean.stderr == pytest.approx(0.1)
    assert low.median == pytest.approx(0.3)
    assert buckets[1].mean is None and buckets[1].median is None and buckets[1].share == 0
    # p = 1 (a certain reference) is counted, in the last bucket
    assert buckets[4].median == pytest.approx(0.02)
    assert sum(b.n for b in buckets) == len(kld)


def test_ratio_to_floor():
    assert metrics.ratio_to_floor(0.03, 0.01) == pytest.approx(3.0)
    assert metrics.ratio_to_floor(0.0, 0.01) == 0.0
    assert metrics.ratio_to_floor(0.1, 0.0) == math.inf
    assert math.isnan(metrics.ratio_to_floor(0.0, 0.0))


def test_distinguishable_needs_more_than_z_standard_errors():
    assert metrics.distinguishable(metrics.Estimate(0.3, 0.1, 10))
    assert not metrics.distinguishable(metrics.Estimate(0.19, 0.1, 10))
    assert not metrics.distinguishable(metrics.Estimate(-0.19, 0.1, 10))
    assert metrics.distinguishable(metrics.Estimate(-0.3, 0.1, 10))
    # a clustered error replaces the per-sample one; no error estimate says nothing
    assert not metrics.distinguishable(metrics.Estimate(0.3, 0.1, 10), stderr=0.2)
    assert not metrics.distinguishable(metrics.Estimate(0.3, float("nan"), 1))


def test_pareto_front_by_hand():
    # (bpw, kld): A (3, 0.30), B (4, 0.10), C (4, 0.20) dominated by B, D (5, 0.10) dominated by B,
    # E (2, 0.50) cheapest
    front = metrics.pareto_front([3, 4, 4, 5, 2], [0.30, 0.10, 0.20, 0.10, 0.50])
    assert front == [True, True, False, False, True]
    # two identical points are both on the front
    assert metrics.pareto_front([1, 1], [0.5, 0.5]) == [True, True]


def test_reverse_kl_is_the_forward_kl_with_the_sides_swapped():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL(q ‖ p) = 1/4 ln(1/2) + 3/4 ln(3/2)
    p, q = np.log([[0.5, 0.5]]), np.log([[0.25, 0.75]])
    by_hand = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert metrics.kl_divergence(q, p)[0] == pytest.approx(by_hand, rel=1e-14)
    assert metrics.kl_divergence(q, p)[0] != pytest.approx(metrics.kl_divergence(p, q)[0])


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=np.float64).tobytes()


def test_both_kl_directions_at_once_are_bit_for_bit_the_two_single_ones():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((7, 300)) * 4
    p = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    q = p + rng.standard_normal(p.shape) * 0.1
    q[1] = p[1]  # identical rows: +0.0 both ways, never −0.0
    p[2, :5] = -np.inf  # tokens the first side never gives
    q[3, :5] = -np.inf  # … and the second: an infinite divergence one way
    q[4, 7] = np.nan
    p[5, :3], q[5, :3] = -800.0, -700.0  # e^-800 underflows to +0: terms 0 · (−100) = −0, not +0
    q[6, :3] = -900.0  # … the other way round
    for scratch in (None, (np.empty_like(p), np.empty_like(p))):
        with np.errstate(invalid="ignore"):  # −inf − −inf, as in the one-way function
            forward, reverse = metrics.kl_divergence_both(p, q, scratch)
            assert _bits(forward) == _bits(metrics.kl_divergence(p, q))
            assert _bits(reverse) == _bits(metrics.kl_divergence(q, p))
    assert np.signbit(reverse[1]) == np.signbit(forward[1]) == False  # noqa: E712
    one = metrics.kl_divergence_both(p[0], q[0])
    assert (one[0], one[1]) == (metrics.kl_divergence(p[0], q[0]), metrics.kl_divergence(q[0], p[0]))
