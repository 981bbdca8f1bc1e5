"""What a figure lets a report claim: confidence bounds, equivalence, tests between candidates, and how small
a difference the text could have shown. Pure functions on numbers and arrays; no model, no I/O.

Every per-token statistic of a window protocol is clustered by window (the tokens of one window are not
independent): its standard error comes from G window clusters, and the reference distribution of
(estimate − truth) / stderr is Student's t with G − 1 degrees of freedom, not the normal (with 8 windows,
P(|t₇| > 1.96) ≈ 0.09, not 0.05). Below `MIN_CLUSTERS` clusters an error estimate is too unstable to claim
anything from, and every function here says `undetermined` rather than guess.

- **Bounds**: estimate ± t_{level, G−1} · stderr, one-sided.
- **Equivalence** to a margin (is a candidate within the noise floor?): `within` only when the one-sided
  upper 95% bound of the difference lies at or below the margin, `above` when the lower bound lies above it,
  else `undetermined`. Failing to show a difference is never taken for showing its absence (Schuirmann's
  one-sided tests; Wellek, *Testing Statistical Hypotheses of Equivalence and Noninferiority*, 2010).
  Against a floor measured on the same tokens (`against_floor`), the difference is the per-token
  kld − (1 + margin) · floor, and the margin 0: the floor's own error is part of the test.
- **Tests** between candidates: the two-sided p-value of a paired, clustered t statistic, with Holm's
  step-down correction when several pairs are claimed at once (Holm 1979).
- **Minimum detectable effect**: the smallest true difference a two-sided test at level α finds with 80%
  power, (t_{1−α/2, G−1} + t_{0.80, G−1}) · stderr, with the stderr of the comparison it describes (a pair
  of candidates: their per-token difference, paired by token) and the α its verdict uses (Holm's over m
  claims: α / m, its strictest step, so that the difference is found whatever the other claims show).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from evalsuite.stats import metrics

MIN_CLUSTERS = 3
LEVEL = 0.95
POWER = 0.80
ALPHA = 0.05

Outcome = Literal["within", "above", "undetermined"]
Bound = Literal["upper95", "lower95"]


def t_cdf(t: float, df: int) -> float:
    """P(T ≤ t) for Student's t with `df` (a positive integer) degrees of freedom, exactly, from the finite
    series of Abramowitz & Stegun 26.7.3 / 26.7.4 in θ = atan(t / √df)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, not {df}")
    if math.isnan(t):
        return float("nan")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 1:
        series, term = 0.0, 1.0
        if df > 1:
            series = 1.0
            for k in range(3, df - 1, 2):  # the terms (2·4…(k−1)) / (1·3…k) cos^(k−1)θ
                term *= c2 * (k - 1) / k
                series += term
        central = (2 / math.pi) * (theta + s * math.cos(theta) * series) if df > 1 else 2 * theta / math.pi
    else:
        series, term = 1.0, 1.0
        for k in range(2, df - 1, 2):  # (1·3…(k−1)) / (2·4…k) cos^k θ
            term *= c2 * (k - 1) / k
            series += term
        central = s * series
    central = min(1.0, max(0.0, central))  # P(|T| ≤ |t|)
    return 0.5 + central / 2 if t >= 0 else 0.5 - central / 2


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (bisection on `t_cdf` to 1e-12)."""
    if not 0 < p < 1:
        raise ValueError(f"a quantile needs 0 < p < 1, not {p}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    if p == 0.5:
        return 0.0
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def enough_clusters(clusters: int, stderr: float) -> bool:
    """Whether an estimate from `clusters` windows has an error usable for a claim."""
    return clusters >= MIN_CLUSTERS and math.isfinite(stderr)


def too_few_reason(clusters: int) -> str | None:
    """Why no claim is made from `clusters` windows (None when they are enough): results.json's null
    reason for a bound or test left undefined."""
    if clusters >= MIN_CLUSTERS:
        return None
    return f"{clusters} window(s): a confidence bound or test needs at least {MIN_CLUSTERS} (undetermined)"


def bound(value: float, stderr: float, clusters: int, which: Bound) -> float:
    """The one-sided 95% confidence bound of an estimate with a window-clustered `stderr`; NaN with too few
    clusters (`MIN_CLUSTERS`)."""
    if not enough_clusters(clusters, stderr):
        return float("nan")
    half = t_quantile(LEVEL, clusters - 1) * stderr
    return value + half if which == "upper95" else value - half


def interval(value: float, stderr: float, clusters: int, level: float = LEVEL) -> tuple[float, float]:
    """The two-sided `level` confidence interval of an estimate with a clustered `stderr`: value ± t_{(1 +
    level) / 2, G−1} · stderr; NaN ends with too few clusters (`MIN_CLUSTERS`)."""
    if not enough_clusters(clusters, stderr):
        return float("nan"), float("nan")
    half = t_quantile((1 + level) / 2, clusters - 1) * stderr
    return value - half, value + half


def equivalence(value: float, stderr: float, clusters: int, margin: float) -> Outcome:
    """Whether a difference (a candidate's KLD excess over the noise floor, say) lies within `margin`:
    `within` when its upper 95% bound is at or below the margin, `above` when its lower 95% bound is above
    the margin, `undetermined` otherwise, and always with fewer than `MIN_CLUSTERS` windows."""
    if not enough_clusters(clusters, stderr):
        return "undetermined"
    if bound(value, stderr, clusters, "upper95") <= margin:
        return "within"
    if bound(value, stderr, clusters, "lower95") > margin:
        return "above"
    return "undetermined"


@dataclass(frozen=True)
class Interval:
    """A mean over `n` independent units (prompts) with its two-sided 95% confidence interval; NaN bounds
    where the units are too few to claim anything from (`MIN_CLUSTERS`)."""

    value: float
    lower: float
    upper: float
    n: int


Direction = Literal["higher", "lower", "same", "undetermined"]


def mean_interval(x: Any, level: float = LEVEL) -> Interval:
    """The mean of `x`, one value per independent unit (a prompt, or a paired difference of one), with its
    two-sided interval (95% by default) mean ± t_{(1+level)/2, n−1} · stderr (`metrics.mean_with_stderr`); NaN
    bounds below `MIN_CLUSTERS` units. A lower `1 − (1 − LEVEL) / k` level is Bonferroni's for k claims."""
    estimate = metrics.mean_with_stderr(x)
    if not enough_clusters(estimate.n, estimate.stderr):
        return Interval(estimate.value, float("nan"), float("nan"), estimate.n)
    half = t_quantile(0.5 + level / 2, estimate.n - 1) * estimate.stderr
    return Interval(estimate.value, estimate.value - half, estimate.value + half, estimate.n)


def direction(difference: Interval) -> Direction:
    """What a paired difference's interval lets a report say: `higher` or `lower` only where it excludes 0;
    `same` where every paired difference is exactly 0 (the interval is the point 0); else `undetermined`,
    never taken for "equal"."""
    if difference.lower > 0:
        return "higher"
    if difference.upper < 0:
        return "lower"
    if difference.lower == difference.upper == difference.value == 0:
        return "same"
    return "undetermined"


def two_sided_p(value: float, stderr: float, clusters: int) -> float:
    """The two-sided p-value of `value` against 0 (a paired, window-clustered t test, G − 1 degrees of
    freedom); NaN with too few clusters. A zero error with a nonzero value is 0, with a zero value 1."""
    if not enough_clusters(clusters, stderr):
        return float("nan")
    if stderr == 0:
        return 1.0 if value == 0 else 0.0
    return 2 * (1 - t_cdf(abs(value) / stderr, clusters - 1))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (NaN stays NaN and is not counted among the tests): reject where
    the adjusted value is below α, and the family-wise error rate stays at α."""
    order = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    m = len(order)
    adjusted = [float("nan")] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def minimum_detectable_effect(stderr: float, clusters: int, alpha: float = ALPHA) -> float:
    """The smallest true difference a two-sided test at level `alpha` of an estimate with this clustered
    `stderr` detects with 80% power; NaN with too few clusters."""
    if not enough_clusters(clusters, stderr):
        return float("nan")
    df = clusters - 1
    return (t_quantile(1 - alpha / 2, df) + t_quantile(POWER, df)) * stderr


@dataclass
class FloorComparison:
    """A per-token KLD against a noise floor drawn one or more times (`against_floor`).

    The margin is a multiple of the floor, and the floor is measured on the same tokens as the candidate: so
    the claim `within` (the candidate's mean KLD at most (1 + margin) × the floor's) is tested on the
    per-token statistic d = kld − (1 + margin) · floor, paired by token, window-clustered, with Student's t
    on windows − 1 degrees of freedom, whose mean is ≤ 0 exactly when the claim holds. Testing the excess
    kld − floor against margin × mean(floor) instead treats an estimated margin as known, and says `within`
    at the boundary far more often than 5% where the two sides' window difficulties are independent
    (docs/statistics.md, the simulation)."""

    kld: np.ndarray  # the floor's per-token KLD, averaged over its draws
    mean: metrics.Estimate  # of `kld`
    draws: int
    draw_spread: float  # max − min of the draws' means; NaN for one draw
    excess: metrics.Estimate  # of the per-token KLD − the floor's, paired by token
    excess_stderr: float  # window-clustered
    ratio: float  # mean KLD / the floor's mean
    clusters: int
    margin: float  # the spec's margin: within means at most (1 + margin) × the floor's mean KLD
    beyond: metrics.Estimate  # of the per-token KLD − (1 + margin) × the floor's: the tested statistic
    beyond_stderr: float  # window-clustered

    @property
    def allowed(self) -> float:
        """The mean KLD a candidate within the floor may have: (1 + margin) × the floor's."""
        return (1 + self.margin) * self.mean.value

    def bound(self, which: Bound) -> float:
        """A one-sided 95% bound of the tested statistic, mean(kld − (1 + margin) · floor)."""
        return bound(self.beyond.value, self.beyond_stderr, self.clusters, which)

    @property
    def outcome(self) -> Outcome:
        """`within` when the upper 95% bound of mean(kld − (1 + margin) · floor) is at most 0, `above` when
        its lower bound exceeds 0, else `undetermined` (`claims.equivalence`)."""
        return equivalence(self.beyond.value, self.beyond_stderr, self.clusters, 0.0)

    def metrics(self, prefix: str, outcome: str) -> dict[str, Any]:
        """The margin, the KLD allowed, the tested statistic with its error and bounds, and the outcome, named
        `{prefix}_floor_margin`, `{prefix}_floor_allowed`, `{prefix}_beyond_allowed[…]` and `outcome`."""
        return {
            f"{prefix}_floor_margin": self.margin,
            f"{prefix}_floor_allowed": self.allowed,
            f"{prefix}_beyond_allowed": self.beyond.value,
            f"{prefix}_beyond_allowed_stderr_window": self.beyond_stderr,
            f"{prefix}_beyond_allowed_upper95": self.bound("upper95"),
            f"{prefix}_beyond_allowed_lower95": self.bound("lower95"),
            outcome: self.outcome,
        }


def against_floor(
    kld: np.ndarray, draws: list[np.ndarray], windows: np.ndarray, margin: float
) -> FloorComparison:
    """A per-token KLD against a floor's per-token KLDs, one array per noise draw (averaged by token): the
    excess paired by token with its window-clustered error, the ratio of the means, and the statistic
    `within` is tested on, kld − (1 + `margin`) · floor per token (`FloorComparison`)."""
    floor_kld = np.mean(draws, axis=0) if len(draws) > 1 else draws[0]
    mean = metrics.mean_with_stderr(floor_kld)
    means = [float(np.mean(d)) for d in draws]
    beyond = kld - (1 + margin) * floor_kld
    return FloorComparison(
        kld=floor_kld,
        mean=mean,
        draws=len(draws),
        draw_spread=max(means) - min(means) if len(means) > 1 else float("nan"),
        excess=metrics.paired_difference(floor_kld, kld),
        excess_stderr=metrics.clustered_stderr(kld - floor_kld, windows),
        ratio=metrics.ratio_to_floor(float(np.mean(kld)), mean.value),
        clusters=len(np.unique(windows)),
        margin=margin,
        beyond=metrics.mean_with_stderr(beyond),
        beyond_stderr=metrics.clustered_stderr(beyond, windows),
    )
