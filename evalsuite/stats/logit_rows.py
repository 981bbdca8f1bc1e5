"""Per-row statistics of two sides' next-token logits in float32, in one pass over each row: what `ppl` and
`compare` report per scored token (both KL divergences, the reference's top-1 probability, both sides'
ranked top tokens, whether their most probable tokens agree, the candidate's log-normaliser that gives its
NLL), and one side's NLL and top token (`row_scores`) in the same arithmetic.

numpy on purpose, the ranking of top tokens included (`token_ranks.ranked_top`). numpy runs a ufunc on the
calling thread only, so the caller may split rows between threads without touching torch's thread count, a
process-wide setting (changed in one thread, it is changed for threads started later), and float32 exp runs in
SIMD on CPUs without AVX-512 as on those with it.

Precision. Logits arrive as bf16, float16 or float32 values, all exact in float32, so every shifted logit
x − max(x) and every difference of two sides' shifted logits is exact or nearly so; the rounding that remains
is float32 exp's (about one unit in the last place) and the products, each relative to the term it rounds.
The sums (the normalisers Σ e^(x − max) and the KL sums) accumulate in float64. So the error of a KLD is
relative to Σ p |log p − log q|, not to the logits' size: the float64 definition is kept to about 1e-5 of
that scale, which the test on every fixture pair holds to 1e-4 relative of `kld_mean`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from evalsuite.stats import metrics, token_ranks


def as_float32(raw: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Rows of stored logits as float32 in `out` (same shape): `raw` is bf16's 16 bits as uint16 (numpy has
    no bfloat16; its bits are a float32's upper half), or float16 or float32. Each side is read by its own
    dtype: a backend that hands float32 logits (`llamacpp`) meets a bf16 reference."""
    if raw.dtype == np.uint16:
        bits = out.view(np.uint32)
        np.copyto(bits, raw, casting="safe")
        bits <<= 16
    else:
        np.copyto(out, raw, casting="safe")
    return out


@dataclass
class RowScratch:
    """Float32 buffers for `pair_statistics` on up to `rows` rows of a vocabulary, allocated once per
    thread rather than per block."""

    rows: int
    vocab: int

    def __post_init__(self) -> None:
        self.x, self.y, self.ex, self.ey = (np.empty((self.rows, self.vocab), np.float32) for _ in range(4))


@dataclass
class PairRows:
    """`pair_statistics` of a block of rows."""

    kld: np.ndarray  # KL(ref ‖ ckpt), float64
    reverse_kld: np.ndarray  # KL(ckpt ‖ ref), float64
    ref_top_p: np.ndarray  # the reference's top-1 probability, float64
    top_ref: np.ndarray  # (rows, k) ids, most probable first, ties by lower id
    top_ckpt: np.ndarray
    same_top: np.ndarray  # some token is most probable on both sides (ties included)
    top_hits: np.ndarray  # (rows, k): the first 1 .. k tokens agree in order, ties included
    ckpt_log_norm: np.ndarray  # log Σ e^y of the candidate's row, float64 (`log_normalisers`)


# Entries ranked per row beyond the k compared: BF16 logits tie often, and a tie at the k-th value that runs
# past these is looked for in the whole row.
RANKED_BEYOND_K = 5


def pair_statistics(raw_x: np.ndarray, raw_y: np.ndarray, k: int, scratch: RowScratch) -> PairRows:
    """Per row of stored logits `raw_x` (the reference) and `raw_y` (the candidate), as `as_float32` reads
    them: the forward and reverse KLD, the reference's top-1 probability, both sides' `k` most probable ids
    and whether their most probable tokens agree. Rows whose sums are not finite (logits of ±inf or NaN)
    are computed again in float64 from the definition."""
    n = len(raw_x)
    x = as_float32(raw_x, scratch.x[:n])
    y = as_float32(raw_y, scratch.y[:n])
    # More than k ranked: the (k+1)-th value tells whether a tie reaches the k-th, the rest hold the tokens
    # tied with the k-th (`top_k_hits_tied`), and the first is the row's maximum, so no pass over the rows
    # looks for any of them.
    ranked = min(k + RANKED_BEYOND_K, x.shape[1])
    top_ref, values_x = token_ranks.ranked_top(x, ranked)
    top_ckpt, values_y = token_ranks.ranked_top(y, ranked)
    mx, my = values_x[:, :1], values_y[:, :1]
    hits = token_ranks.top_k_hits_tied(
        x, y, top_ref[:, :k], top_ckpt[:, :k], ranked=((top_ref, values_x), (top_ckpt, values_y))
    )
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        ex, ey = scratch.ex[:n], scratch.ey[:n]
        sx, sy = shifted_exps(x, mx, ex), shifted_exps(y, my, ey)
        # log p − log q = (x − mx − log sx) − (y − my − log sy) = t − c with t the shifted x less the shifted
        # y, in float32; c in float32 too, and what its rounding lost, c − c32, added back once (Σ p = 1).
        c = np.log(sx) - np.log(sy)
        c32 = c.astype(np.float32)
        t = np.subtract(x, y, out=x)
        t -= c32[:, None]
        terms = np.multiply(ex, t, out=y)
        forward = row_sums(terms) / sx - (c - c32)
        np.multiply(ey, t, out=terms)
        reverse = (c - c32) - row_sums(terms) / sy
        log_norm = log_normalisers(my, sy)
    bad = ~(np.isfinite(forward) & np.isfinite(reverse))
    if bad.any():
        rows = np.flatnonzero(bad)
        again = [
            as_float32(raw[rows], np.empty((len(rows), raw.shape[1]), np.float32)) for raw in (raw_x, raw_y)
        ]
        forward[rows], reverse[rows] = _kld_rows64(*again)
    # The first of the top-k hits is the same-top event (`top_k_hits_tied`'s column 0).
    return PairRows(forward, reverse, 1.0 / sx, top_ref[:, :k], top_ckpt[:, :k], hits[:, 0], hits, log_norm)


def shifted_exps(x: np.ndarray, m: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Rows `x` less their maxima `m` (in place), e to those in `out`, and each row's sum of them in
    float64."""
    x -= m
    np.exp(x, out=out)
    return row_sums(out)


def row_sums(rows: np.ndarray) -> np.ndarray:
    """Each row's sum, accumulated in float64. einsum, not `sum(dtype=float64)`: the same float64
    accumulation without the buffered cast, a quarter faster, and a row's bits do not depend on the rows
    beside it."""
    return np.einsum("ij->i", rows, dtype=np.float64)


def log_normalisers(m: np.ndarray, sums: np.ndarray) -> np.ndarray:
    """log Σ e^x of rows whose maxima are `m` (rows, 1) and whose `shifted_exps` sums are `sums`, in
    float64: a token's NLL is this less its logit."""
    return m[:, 0].astype(np.float64) + np.log(sums)


def row_scores(raw: np.ndarray, targets: np.ndarray, scratch: RowScratch) -> tuple[np.ndarray, np.ndarray]:
    """One side's rows of stored logits (as `as_float32` reads them): the NLL of each row's `targets` token
    (float64) and its most probable token (ties by lower id, a NaN never), in `scratch` (two of its buffers).
    The arithmetic `pair_statistics` gives the candidate's rows, so a token's NLL has the same bits whether
    its side was observed alone or compared as it was made."""
    n = len(raw)
    rows, e = as_float32(raw, scratch.x[:n]), scratch.ex[:n]
    top, values = token_ranks.ranked_top(rows, 1)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        sums = shifted_exps(rows, values[:, :1], e)
        return target_nll(log_normalisers(values[:, :1], sums), raw, targets), top[:, 0]


def target_nll(log_norm: np.ndarray, raw: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Each row's NLL of its `targets` token, in float64: its log-normaliser (`log_normalisers`) less that
    token's logit in the stored rows `raw` (as `as_float32` reads them)."""
    picked = raw[np.arange(len(raw)), targets]
    return log_norm - as_float32(picked, np.empty(len(picked), np.float32)).astype(np.float64)


def _kld_rows64(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Forward and reverse KLD of rows of logits by the float64 definition (`metrics.kl_divergence`)."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        lp, lq = _log_softmax64(x), _log_softmax64(y)
        return metrics.kl_divergence(lp, lq), metrics.kl_divergence(lq, lp)


def _log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = np.max(x, axis=1, keepdims=True)
    m[~np.isfinite(m)] = 0.0
    shifted = x - m
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
