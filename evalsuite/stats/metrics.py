"""Statistics of the diff report, as pure functions on arrays.

Every statistic is defined once here, with its uncertainty, in the conventions of llama.cpp's perplexity tool
(`tools/perplexity/perplexity.cpp`): standard errors of means use the sample variance with n − 1, and a rate
p over n trials has the binomial standard error sqrt(p (1 − p) / (n − 1)). Accumulation is in float64 so that
identical inputs give exactly 0 and exactly 1 where they should. No model, no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from numpy.typing import ArrayLike, NDArray

from evalsuite.stats import token_ranks


@dataclass(frozen=True)
class Estimate:
    """A mean with its standard error and the sample size it came from."""

    value: float
    stderr: float
    n: int


def _as_f64(x: ArrayLike) -> NDArray[np.float64]:
    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError("a statistic of no samples is undefined")
    return arr


def mean_with_stderr(x: ArrayLike) -> Estimate:
    """Mean of `x` and its standard error sqrt(var / (n − 1)), with var the population variance.

    A single sample has no error estimate: its stderr is NaN rather than a misleading 0.
    """
    arr = _as_f64(x)
    n = arr.size
    mean = float(arr.mean())
    if n < 2:
        return Estimate(mean, float("nan"), n)
    var = float(np.mean((arr - mean) ** 2))
    return Estimate(mean, float(np.sqrt(var / (n - 1))), n)


def clustered_stderr(x: ArrayLike, clusters: ArrayLike) -> float:
    """Standard error of the mean of `x` when samples are correlated within clusters (the tokens of one
    window), from the clusters' sums: sqrt(G / (G − 1) · Σ_g (Σ_{i∈g} (x_i − x̄))²) / N, with G clusters and
    N samples. For clusters of equal size this is the standard error of the G cluster means, s / sqrt(G).

    With fewer than two clusters there is no error estimate: NaN. With G clusters the estimate itself is
    uncertain by about 1 / sqrt(2 (G − 1)) (±27% for 8 windows), so it is reported beside, not instead of,
    the per-sample error.
    """
    arr = _as_f64(x)
    labels = np.asarray(clusters).reshape(-1)
    if labels.shape != arr.shape:
        raise ValueError(f"{labels.size} cluster labels for {arr.size} samples")
    _, index = np.unique(labels, return_inverse=True)
    groups = int(index.max()) + 1
    if groups < 2:
        return float("nan")
    sums = np.bincount(index, weights=arr - arr.mean(), minlength=groups)
    return float(np.sqrt(groups / (groups - 1) * np.sum(sums * sums)) / arr.size)


def rms_clustered_stderr(x: ArrayLike, clusters: ArrayLike) -> float:
    """Window-clustered standard error of the root mean square sqrt(mean(x²)), by the delta method from that
    of mean(x²): se(x²) / (2 rms). NaN for fewer than two clusters or an rms of 0."""
    arr = _as_f64(x)
    rms = float(np.sqrt(np.mean(arr * arr)))
    if rms == 0:
        return float("nan")
    return clustered_stderr(arr * arr, clusters) / (2 * rms)


def window_labels(n_windows: int, per_window: int) -> NDArray[np.int64]:
    """Cluster labels of samples laid out window after window, `per_window` each."""
    return np.repeat(np.arange(n_windows, dtype=np.int64), per_window)


def perplexity(nll: ArrayLike) -> float:
    """exp of the mean negative log-likelihood (natural log) of the scored tokens."""
    return float(np.exp(_as_f64(nll).mean()))


def ln_perplexity(nll: ArrayLike) -> Estimate:
    """ln(PPL) = mean NLL, with its standard error; PPL ± PPL·stderr is llama.cpp's printed interval."""
    return mean_with_stderr(nll)


def paired_log_ratio(nll_ref: ArrayLike, nll_ckpt: ArrayLike) -> Estimate:
    """ln(PPL_ckpt / PPL_ref) as the mean of per-token NLL differences, with the paired standard error.

    Pairing by token cancels the variance the two sides share (the text's own difficulty), which makes the
    error bar of the ratio far tighter than that of either PPL.
    """
    ref, ckpt = _as_f64(nll_ref), _as_f64(nll_ckpt)
    if ref.shape != ckpt.shape:
        raise ValueError(f"paired samples differ in length: {ref.size} vs {ckpt.size}")
    return mean_with_stderr(ckpt - ref)


def exp64(x: NDArray[np.float64], out: NDArray[np.float64] | None = None) -> NDArray[np.float64]:
    """e^x elementwise in float64 (into `out` when given), by torch's vectorised exp on the same memory.

    Why not numpy's: on a CPU without AVX-512, numpy evaluates float64 exp one element at a time through
    libm, several times slower than torch's SIMD kernel, and the KL divergences take two exps per vocabulary
    entry per scored token (the bulk of `compare`'s work beyond forwarding; bench/compare.py). Every exp of a
    full-vocabulary statistic goes through here, so the fused passes stay bit for bit the definitions.
    """
    x = np.ascontiguousarray(x, dtype=np.float64)
    if not x.flags.writeable:  # torch shares memory only with writeable arrays; it never writes to `x`
        x = x.copy()
    if out is None:
        out = np.empty_like(x)
    torch.exp(torch.from_numpy(x), out=torch.from_numpy(out))
    return out


def kl_divergence(logp_ref: ArrayLike, logp_ckpt: ArrayLike) -> NDArray[np.float64]:
    """Per-row KL(P_ref ‖ P_ckpt) = Σ_v p_ref(v) (log p_ref(v) − log p_ckpt(v)), from log-probabilities.

    Rows are positions, columns the vocabulary. Terms where p_ref is exactly 0 contribute 0.
    """
    ref = np.asarray(logp_ref, dtype=np.float64)
    ckpt = np.asarray(logp_ckpt, dtype=np.float64)
    if ref.shape != ckpt.shape:
        raise ValueError(f"log-prob arrays differ in shape: {ref.shape} vs {ckpt.shape}")
    p_ref = exp64(ref)
    # In place: the same IEEE operations as np.where(p_ref > 0, p_ref * (ref - ckpt), 0) with two fewer
    # vocabulary-sized temporaries, on the pass `compare` makes once per candidate.
    terms = np.subtract(ref, ckpt)
    terms *= p_ref
    terms[~(p_ref > 0)] = 0.0
    return terms.sum(axis=-1)


def kl_divergence_both(
    logp_a: ArrayLike,
    logp_b: ArrayLike,
    scratch: tuple[NDArray[np.float64], NDArray[np.float64]] | None = None,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Per-row KL(P_a ‖ P_b) and KL(P_b ‖ P_a), from log-probabilities: bit for bit `kl_divergence(a, b)` and
    `kl_divergence(b, a)`, from one difference a − b and two vocabulary-sized buffers instead of six.

    Rounding to nearest is symmetric, so b − a is exactly −(a − b) and each reverse term p_b (b − a) exactly
    −(p_b (a − b)); a sum of negated terms is the negated sum. Only the sign of a zero can differ (a − a is
    +0, not −0), and a NaN's sign bit.

    The terms are summed unmasked. Where p is +0 (an underflow) and a − b finite, the term is ±0 where
    `kl_divergence` writes +0, which changes no sum but a zero one; where p is 0 or NaN and the term NaN, the
    sum is NaN. So only rows whose sum is 0 or NaN can differ from the definition, and those are summed again
    as `kl_divergence` sums them: a mask pass over every row costs more than the rare row summed twice.

    `scratch`, two float64 arrays of the inputs' shape, is where the vocabulary-sized intermediates go (their
    contents are overwritten): a caller looping over rows allocates them once, not twice a call.
    """
    a = np.asarray(logp_a, dtype=np.float64)
    b = np.asarray(logp_b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"log-prob arrays differ in shape: {a.shape} vs {b.shape}")
    if a.ndim < 2:  # a single distribution: nothing worth sharing
        return kl_divergence(a, b), kl_divergence(b, a)
    diff, terms = scratch if scratch is not None else (np.empty_like(a), np.empty_like(a))
    np.subtract(a, b, out=diff)
    exp64(a, out=terms)
    terms *= diff
    forward = terms.sum(axis=-1)
    exp64(b, out=terms)
    terms *= diff
    reverse = np.negative(terms.sum(axis=-1))
    for sums, p, q in ((forward, a, b), (reverse, b, a)):
        redo = (sums == 0) | np.isnan(sums)
        if redo.any():
            sums[redo] = kl_divergence(p[redo], q[redo])
    return forward, reverse


def kl_divergence_top_k_tail(
    top_logp_ref: ArrayLike,
    top_logp_ckpt: ArrayLike,
    tail_mass_ref: ArrayLike,
    tail_logp_ref: ArrayLike,
    tail_logp_ckpt: ArrayLike,
) -> NDArray[np.float64]:
    """Per-row KL(P_ref ‖ P_ckpt) from a recording of the reference: exact over its top-k T, sampled beyond.

    KL = Σ_T p_ref·δ + Σ_tail p_ref·δ with δ = log p_ref − log p_ckpt. With r = p_ckpt / p_ref, the tail part
    equals Σ_tail p_ref (r − 1 − log r) − Σ_tail (p_ckpt − p_ref), and the last sum is P_ref(T) − P_ckpt(T),
    known exactly from the top-k. So the tail contributes tail_mass × E_q[r − 1 − log r] − (P_ref(T) −
    P_ckpt(T)), with q = P_ref restricted to the tail; the mean over the ids drawn from q (`tail_logp_*`,
    shape (rows, m)) estimates E_q without bias. Each r − 1 − log r is ≥ 0 and of second order in log r, so
    the estimate is far less noisy than the mean of δ itself, whose first-order terms only cancel on
    average. With no tail samples the top-k part alone is returned (a lower bound, like one tail bucket).
    """
    top_ref = np.asarray(top_logp_ref, dtype=np.float64)
    top_ckpt = np.asarray(top_logp_ckpt, dtype=np.float64)
    tail_ref = np.asarray(tail_logp_ref, dtype=np.float64)
    tail_ckpt = np.asarray(tail_logp_ckpt, dtype=np.float64)
    mass = np.asarray(tail_mass_ref, dtype=np.float64).reshape(-1)
    if top_ref.shape != top_ckpt.shape or tail_ref.shape != tail_ckpt.shape:
        raise ValueError("reference and candidate log-probs must be gathered at the same ids")
    p_top_ref = np.exp(top_ref)
    top = (p_top_ref * (top_ref - top_ckpt)).sum(axis=-1)
    if tail_ref.shape[-1] == 0:
        return top
    log_r = tail_ckpt - tail_ref
    tail = mass * (np.expm1(log_r) - log_r).mean(axis=-1)
    return top + tail - (p_top_ref.sum(axis=-1) - np.exp(top_ckpt).sum(axis=-1))


def rate_with_stderr(hits: ArrayLike) -> Estimate:
    """Fraction of true values in `hits`, with the binomial standard error sqrt(p (1 − p) / (n − 1))."""
    arr = np.asarray(hits, dtype=bool).reshape(-1)
    n = arr.size
    if n == 0:
        raise ValueError("a rate over no trials is undefined")
    p = float(arr.mean())
    if n < 2:
        return Estimate(p, float("nan"), n)
    return Estimate(p, float(np.sqrt(p * (1.0 - p) / (n - 1))), n)


def same_top_rate(top_ref: ArrayLike, top_ckpt: ArrayLike) -> Estimate:
    """How often the two sides put the same token first."""
    a, b = np.asarray(top_ref).reshape(-1), np.asarray(top_ckpt).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"top-token arrays differ in length: {a.size} vs {b.size}")
    return rate_with_stderr(a == b)


@dataclass(frozen=True)
class DeltaP:
    """Change of the probability given to the true token, candidate minus reference."""

    mean: Estimate
    rms: Estimate


def delta_p(logp_true_ref: ArrayLike, logp_true_ckpt: ArrayLike) -> DeltaP:
    """Δp = p_ckpt(true) − p_ref(true) per token: its mean and its RMS, each with a standard error.

    The RMS error follows by error propagation from the stderr of the mean of Δp², as in llama.cpp.
    """
    ref, ckpt = _as_f64(logp_true_ref), _as_f64(logp_true_ckpt)
    if ref.shape != ckpt.shape:
        raise ValueError(f"paired samples differ in length: {ref.size} vs {ckpt.size}")
    dp = np.exp(ckpt) - np.exp(ref)
    mean = mean_with_stderr(dp)
    sq = mean_with_stderr(dp * dp)
    rms = float(np.sqrt(sq.value))
    rms_err = 0.5 * sq.stderr / rms if rms > 0 else 0.0 if sq.n > 1 else float("nan")
    return DeltaP(mean=mean, rms=Estimate(rms, rms_err, sq.n))


def quantiles(x: ArrayLike, qs: tuple[float, ...]) -> tuple[float, ...]:
    """Quantiles of `x` at the fractions `qs`, linear interpolation between order statistics."""
    arr = _as_f64(x)
    return tuple(float(v) for v in np.quantile(arr, qs, method="linear"))


def first_divergence(a: ArrayLike, b: ArrayLike) -> int | None:
    """Index of the first position where two token sequences differ; None when they are identical.

    A sequence that is a strict prefix of the other diverges at its own length.
    """
    x, y = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    n = min(x.size, y.size)
    diff = np.flatnonzero(x[:n] != y[:n])
    if diff.size:
        return int(diff[0])
    return None if x.size == y.size else n


def paired_difference(ref: ArrayLike, ckpt: ArrayLike) -> Estimate:
    """Mean per-document change ckpt − ref, with the paired standard error sqrt(var(d) / (n − 1)).

    Both sides scored the same documents, so the error bar is that of the per-document differences d: the
    documents' own difficulty, which both sides share, cancels. Identical sides give exactly 0 ± 0.
    """
    a, b = _as_f64(ref), _as_f64(ckpt)
    if a.shape != b.shape:
        raise ValueError(f"paired samples differ in length: {a.size} vs {b.size}")
    return mean_with_stderr(b - a)


def recovery(ref: float, ckpt: float) -> float:
    """ckpt / ref, llm-compressor's accuracy recovery; NaN when the reference scores 0 (undefined)."""
    return float(ckpt) / float(ref) if ref else float("nan")


def edit_distance(a: Sequence[object], b: Sequence[object]) -> int:
    """Levenshtein distance: the fewest substitutions, deletions and insertions that turn `a` into `b`."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def character_error_rate(hypothesis: str, reference: str) -> float:
    """CER as OCR reports it (jiwer's `cer`): the edit distance of the hypothesis to the reference, in
    characters, over the reference's length. 0 is an exact reading; an empty hypothesis scores 1; a
    hypothesis longer than the reference can score above 1 (every extra character is an insertion)."""
    if not reference:
        raise ValueError("the character error rate needs a non-empty reference text")
    return edit_distance(hypothesis, reference) / len(reference)


@dataclass(frozen=True)
class Flips:
    """Documents whose correctness changed between the sides: correct → wrong and wrong → correct, of n."""

    c2w: int
    w2c: int
    n: int

    @property
    def rate(self) -> float:
        """(c2w + w2c) / n: the share of documents answered differently right or wrong."""
        return (self.c2w + self.w2c) / self.n if self.n else float("nan")


def flip_counts(ref_correct: ArrayLike, ckpt_correct: ArrayLike) -> Flips:
    """The flips of per-document correctness (truthy = correct) from the reference to the candidate.

    Equal accuracy can hide many flips (Dutta et al., "Accuracy is Not All You Need", 2024): the accuracy
    delta is (w2c − c2w) / n, the flips are what it cancels.
    """
    a = np.asarray(ref_correct).reshape(-1).astype(bool)
    b = np.asarray(ckpt_correct).reshape(-1).astype(bool)
    if a.shape != b.shape:
        raise ValueError(f"paired samples differ in length: {a.size} vs {b.size}")
    return Flips(c2w=int(np.sum(a & ~b)), w2c=int(np.sum(~a & b)), n=int(a.size))


def mcnemar_exact_p(c2w: int, w2c: int) -> float:
    """McNemar's exact test, two-sided: is one direction of flips more frequent than the other?

    Under the null each of the n = c2w + w2c discordant documents flips either way with probability 1/2,
    so p = min(1, 2 · Σ_{i ≤ min(c2w, w2c)} C(n, i) / 2^n). The sum is of integers, exact at any n; with no
    discordant document there is no evidence of a change: p = 1.
    """
    if c2w < 0 or w2c < 0:
        raise ValueError("flip counts cannot be negative")
    n, k = c2w + w2c, min(c2w, w2c)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1))
    return min(1.0, float(Fraction(2 * tail, 2**n)))


def mcnemar_min_discordant(alpha: float = 0.05) -> int:
    """The fewest discordant documents with which McNemar's exact two-sided test can reach p < `alpha` at all
    (every flip one way): with fewer, no count of flips is evidence of a change at that level, and a verdict
    resting on the test is undetermined rather than a pass."""
    n = 1
    while mcnemar_exact_p(n, 0) >= alpha:
        n += 1
    return n


def choice_kl_divergence(lls_ref: ArrayLike, lls_ckpt: ArrayLike) -> float:
    """KL(P_ref ‖ P_ckpt) between two distributions over a question's answer choices, each the softmax of
    that side's per-choice log-likelihoods. 0 for identical log-likelihoods."""
    a, b = _as_f64(lls_ref), _as_f64(lls_ckpt)
    if a.shape != b.shape:
        raise ValueError(f"choice log-likelihoods differ in length: {a.size} vs {b.size}")
    logp_a = a - np.logaddexp.reduce(a)
    logp_b = b - np.logaddexp.reduce(b)
    return float(kl_divergence(logp_a[None, :], logp_b[None, :])[0])


def _position_label(position: int) -> str:
    return f"{position // 1024}k" if position and position % 1024 == 0 else str(position)


def position_buckets(positions: ArrayLike, edges: Sequence[int]) -> list[tuple[str, NDArray[np.bool_]]]:
    """The samples of each position bucket [edges[i], edges[i+1]) and [edges[-1], ∞), as (name, mask);
    names say the range in tokens (`pos_1k_4k`, `pos_16k_inf`, 1k = 1,024). Empty buckets are left out."""
    pos = np.asarray(positions).reshape(-1)
    bounds = [*edges, None]
    out = []
    for lo, hi in itertools.pairwise(bounds):
        mask = (pos >= lo) if hi is None else (pos >= lo) & (pos < hi)
        if mask.any():
            name = f"pos_{_position_label(lo)}_{'inf' if hi is None else _position_label(hi)}"
            out.append((name, mask))
    return out


# --------------------------------------------------------------------------------------------------------
# KLD detail: how the divergence is spread over tokens (llama.cpp's `tools/perplexity/perplexity.cpp` KL
# divergence printout, exllamav3's `eval/qbench/measure.py` confidence buckets)
# --------------------------------------------------------------------------------------------------------

# The Δp percentiles llama.cpp prints ("Maximum Δp", "99.9% Δp", …, "Minimum Δp"), as fractions.
DELTA_P_PERCENTILES = (1.0, 0.999, 0.99, 0.95, 0.90, 0.75, 0.5, 0.25, 0.10, 0.05, 0.01, 0.001, 0.0)
# The reference's top-1 probability buckets of exllamav3's qbench; the last one holds p = 1 too.
CONFIDENCE_BUCKETS = ((0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 0.95), (0.95, 1.0))


def percentile_name(q: float) -> str:
    """`max`, `min`, `median`, or `p99.9` / `p5`: the suffix a percentile's metric is named by."""
    if q == 1.0:
        return "max"
    if q == 0.0:
        return "min"
    if q == 0.5:
        return "median"
    return f"p{round(q * 100, 3):g}"


def delta_p_percentiles(dp: ArrayLike) -> dict[str, float]:
    """The percentiles of per-token Δp at `DELTA_P_PERCENTILES`, keyed `max`, `p99.9`, …, `min`.

    Order statistics carry no simple standard error; the sample size is that of `dp`.
    """
    values = quantiles(dp, DELTA_P_PERCENTILES)
    return {percentile_name(q): v for q, v in zip(DELTA_P_PERCENTILES, values, strict=True)}


def top_k_agreement(top_ref: ArrayLike, top_ckpt: ArrayLike, k: int) -> Estimate:
    """Share of positions whose k most probable tokens agree in order (`top_k_hits`; k = 1 is the
    same-top-token rate with ties broken by the ranking given), with the binomial standard error."""
    return rate_with_stderr(token_ranks.top_k_hits(top_ref, top_ckpt, k))


@dataclass(frozen=True)
class ConfidenceBucket:
    """KLD of the tokens where the reference's top-1 probability lies in [lo, hi): their share of all
    tokens, their mean KLD with its standard error and their median (None when the bucket is empty)."""

    lo: float
    hi: float
    n: int
    share: float
    mean: Estimate | None
    median: float | None
    inside: NDArray[np.bool_] | None = None  # which tokens lie in the bucket


def confidence_buckets(
    kld: ArrayLike, ref_top_p: ArrayLike, edges: tuple[tuple[float, float], ...] = CONFIDENCE_BUCKETS
) -> list[ConfidenceBucket]:
    """Per-token KLD bucketed by the reference's top-1 probability; the last bucket includes its upper edge
    (a reference certain of a token, p = 1, counts in it)."""
    x, conf = _as_f64(kld), _as_f64(ref_top_p)
    if x.shape != conf.shape:
        raise ValueError(f"paired samples differ in length: {x.size} vs {conf.size}")
    out = []
    for i, (lo, hi) in enumerate(edges):
        upper = conf <= hi if i == len(edges) - 1 else conf < hi
        inside = (conf >= lo) & upper
        n = int(inside.sum())
        mean = mean_with_stderr(x[inside]) if n else None
        median = float(np.median(x[inside])) if n else None
        out.append(ConfidenceBucket(lo, hi, n, n / x.size, mean, median, inside))
    return out


def ratio_to_floor(value: float, floor: float) -> float:
    """value / floor, a candidate's KLD in units of the measurement's own noise floor: inf for a positive
    value over a zero floor, NaN for 0 / 0."""
    if floor > 0:
        return float(value) / float(floor)
    return float("nan") if value == 0 else float("inf")


def distinguishable(estimate: Estimate, stderr: float | None = None, z: float = 1.96) -> bool:
    """Whether a mean difference lies further than z standard errors from 0 (two-sided 95% by default);
    `stderr` replaces the estimate's own (a window-clustered one, say). No error estimate: never."""
    se = estimate.stderr if stderr is None else stderr
    if not np.isfinite(se):
        return False
    return abs(estimate.value) > z * se


def pareto_front(costs: ArrayLike, losses: ArrayLike) -> list[bool]:
    """Which points lie on the Pareto front of (cost, loss), both to be minimised: no other point is at
    least as good on both and better on one. Ties on both count as on the front together."""
    c, loss = _as_f64(costs), _as_f64(losses)
    if c.shape != loss.shape:
        raise ValueError(f"paired samples differ in length: {c.size} vs {loss.size}")
    front = []
    for i in range(c.size):
        dominated = np.any((c <= c[i]) & (loss <= loss[i]) & ((c < c[i]) | (loss < loss[i])))
        front.append(not bool(dominated))
    return front


def topk_overlap(ref_index: ArrayLike, ckpt_index: ArrayLike) -> NDArray[np.float64]:
    """Per row (a token), |A ∩ B| / k of two sets of k chosen ids (a router's top-k experts): 1 when the
    candidate chose the reference's experts, in any order."""
    a, b = np.asarray(ref_index), np.asarray(ckpt_index)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"top-k indices differ in shape or are not (rows, k): {a.shape} vs {b.shape}")
    hits = (a[:, :, None] == b[:, None, :]).any(axis=2).sum(axis=1)
    return hits / a.shape[1]


def mass_on_chosen(
    ckpt_weights: ArrayLike, ckpt_index: ArrayLike, ref_index: ArrayLike
) -> NDArray[np.float64]:
    """Per row, the share of the candidate's routing weight on the experts the reference chose:
    Σ_j w_j [i_j ∈ A] / Σ_j w_j, the part of its routed output that comes from the reference's experts (1 for
    the same set, whatever the rounding of the weights)."""
    w, b, a = np.asarray(ckpt_weights, dtype=np.float64), np.asarray(ckpt_index), np.asarray(ref_index)
    if w.shape != b.shape or a.shape[0] != b.shape[0]:
        raise ValueError(f"weights {w.shape}, indices {b.shape} and reference indices {a.shape} differ")
    chosen = (b[:, :, None] == a[:, None, :]).any(axis=2)
    total = w.sum(axis=1)
    return np.divide((w * chosen).sum(axis=1), total, out=np.zeros_like(total), where=total != 0)


def proportion_interval(successes: int, n: int, level: float = 0.95) -> tuple[float, float, float]:
    """A share `successes / n` of independent outcomes (one per prompt, say) with its two-sided Wilson score
    interval at `level` (Wilson 1927): unlike the share ± z·stderr, it stays inside [0, 1] and keeps its
    coverage near a share of 0 or 1, where a good candidate's survival lies. NaN for no outcomes."""
    if n <= 0:
        return float("nan"), float("nan"), float("nan")
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.5 + level / 2)
    share = successes / n
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # At a share of 0 (or 1) the bound is 0 (or 1) exactly; the arithmetic above leaves rounding dust there.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    return share, low, 1.0 if successes == n else min(1.0, centre + half)


def paired_proportion_difference(
    both: int, first_only: int, second_only: int, neither: int, level: float = 0.95
) -> tuple[float, float, float]:
    """The difference p₁ − p₂ of two shares measured on the same units (a case parsed by the reference and
    by the candidate), with Newcombe's square-and-add interval for paired data (Newcombe 1998, method 10;
    Fagerland, Lydersen and Laake, *Statistical Analysis of Contingency Tables*, 2017, ch. 8).

    The counts are the paired 2×2 table: units a success on both, on the first only, on the second only,
    on neither. Each share gets its Wilson interval (`proportion_interval`), and the two are combined with
    the estimated correlation φ between them, shrunk towards 0 by n/2 where positive (Newcombe's
    correction). Unlike estimate ± z·stderr it keeps its coverage where the difference is 0 with no
    discordant unit, as a faithful candidate's is. NaN for no units.
    """
    counts = (both, first_only, second_only, neither)
    if min(counts) < 0:
        raise ValueError(f"paired counts cannot be negative: {counts}")
    n = sum(counts)
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    p1, l1, u1 = proportion_interval(both + first_only, n, level)
    p2, l2, u2 = proportion_interval(both + second_only, n, level)
    margins = (both + first_only) * (second_only + neither) * (both + second_only) * (first_only + neither)
    phi = 0.0
    if margins:
        a = both * neither - first_only * second_only
        phi = (a - n / 2) / math.sqrt(margins) if a > n / 2 else min(a, 0) / math.sqrt(margins)
    low = math.sqrt(max(0.0, (p1 - l1) ** 2 + (u2 - p2) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2)))
    high = math.sqrt(max(0.0, (p2 - l2) ** 2 + (u1 - p1) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1)))
    return p1 - p2, p1 - p2 - low, p1 - p2 + high


def tokens_per_round(new_tokens: ArrayLike, rounds: ArrayLike) -> NDArray[np.float64]:
    """Per decoding with drafting (speculative decoding), its mean accepted length: the new tokens over the
    verification rounds (the target's forwards), each round's bonus token included, so 1 where no drafted
    token was ever kept and k + 1 where every round kept all of its k drafted tokens."""
    tokens, counted = _as_f64(new_tokens), _as_f64(rounds)
    if tokens.shape != counted.shape:
        raise ValueError(f"{tokens.size} decodings' tokens against {counted.size} decodings' rounds")
    if (counted < 1).any():
        raise ValueError("a decoding has at least one round (its prompt's prefill)")
    return tokens / counted
