"""Which tokens each side ranks first, ties included, as pure functions on rows of values over a vocabulary
(logits or log-probs; a row's log-probs are its logits less a constant, with the same ties): each row's
largest entries (`ranked_top`), whether the most probable token agrees (`same_top_tied`) and whether the
first k tokens agree in order (`top_k_hits_tied`), whatever order a tie among equal BF16 logits is broken in.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

# Entries per group when `ranked_top` looks for a row's largest values group by group.
RANK_GROUP = 64


def ranked_top(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's `k` largest entries, largest first and equal values by lower id (a NaN ranks below every
    number): their ids (int64) and their values, each (rows, k). Any float dtype; `k` at most the row length.

    Why not a top-k call: torch's works through every entry of every row, the slowest part of the KLD detail
    it was, and breaks ties in an order of its own. Here the row is cut into groups of `RANK_GROUP` entries,
    strided (entry i in group i mod groups), whose maxima one vectorised pass finds; the k-th largest of those
    maxima is a value at or below the row's k-th largest (k groups hold an entry at least that large), so the
    entries at or above it, all in the few groups whose maximum reaches it, are every candidate; they are
    ordered exactly."""
    n, width = rows.shape
    if not 1 <= k <= width:
        raise ValueError(f"the {k} largest of rows of {width} values")
    size = min(RANK_GROUP, width // (4 * k))
    groups = width // size if size else 0
    if groups < k:
        return _ranked_exactly(rows, k)
    cut = groups * size
    by_group = rows[:, :cut].reshape(n, size, groups)
    maxima = by_group.max(axis=1)
    if cut < width:
        maxima = np.concatenate([maxima, rows[:, cut:].max(axis=1, keepdims=True)], axis=1)
    nan = np.isnan(maxima).any(axis=1)
    threshold = np.partition(maxima, maxima.shape[1] - k, axis=1)[:, maxima.shape[1] - k]
    row, group = np.nonzero(maxima[:, :groups] >= threshold[:, None])
    values = by_group[row, :, group]
    ids = group[:, None] + groups * np.arange(size)
    keep = values >= threshold[row, None]
    row, values, ids = np.broadcast_to(row[:, None], keep.shape)[keep], values[keep], ids[keep]
    if cut < width:
        rest_row, rest_col = np.nonzero(rows[:, cut:] >= threshold[:, None])
        row = np.concatenate([row, rest_row])
        values = np.concatenate([values, rows[rest_row, cut + rest_col]])
        ids = np.concatenate([ids, cut + rest_col])
    order = np.lexsort((ids, -values, row))
    ids, values = ids[order], values[order]
    counts = np.bincount(row, minlength=n)
    first = (np.cumsum(counts) - counts)[:, None] + np.arange(k)
    if not nan.any():
        return ids[first].astype(np.int64), values[first]
    # A NaN group maximum hides the group's numbers from the threshold: such rows are ranked whole.
    top_ids, top_values = np.empty((n, k), np.int64), np.empty((n, k), rows.dtype)
    top_ids[~nan], top_values[~nan] = ids[first[~nan]], values[first[~nan]]
    top_ids[nan], top_values[nan] = _ranked_exactly(rows[nan], k)
    return top_ids, top_values


def _ranked_exactly(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`ranked_top` by sorting whole rows (lexsort puts NaN last)."""
    ids = np.empty((len(rows), k), np.int64)
    for i, row in enumerate(rows):
        ids[i] = np.lexsort((np.arange(len(row)), -row))[:k]
    return ids, np.take_along_axis(rows, ids, axis=1)


def same_top_tied(logp_ref: NDArray[np.float64], logp_ckpt: NDArray[np.float64]) -> NDArray[np.bool_]:
    """Per row, whether some token is most probable on both sides, ties included: the same-top-token event
    whatever order a tie among equal logits is broken in. Rows are positions, columns the vocabulary."""
    a, b = np.asarray(logp_ref), np.asarray(logp_ckpt)
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(f"log-prob rows must be (positions, vocabulary) alike: {a.shape} vs {b.shape}")
    same = a.argmax(axis=1) == b.argmax(axis=1)
    rows = np.flatnonzero(~same)
    if rows.size:  # only where the first maxima differ can a tie make them agree
        x, y = a[rows], b[rows]
        same[rows] = np.any((x == x.max(axis=1, keepdims=True)) & (y == y.max(axis=1, keepdims=True)), axis=1)
    return same


def top_k_hits(top_ref: ArrayLike, top_ckpt: ArrayLike, k: int) -> NDArray[np.bool_]:
    """Per position, whether the k most probable tokens are the same on both sides, in the same order. Rows
    are positions, columns the ranked token ids (at least k of them)."""
    a, b = np.asarray(top_ref), np.asarray(top_ckpt)
    if a.ndim != 2 or a.shape != b.shape:
        raise ValueError(f"ranked top-token arrays must be (positions, ranks) alike: {a.shape} vs {b.shape}")
    if not 1 <= k <= a.shape[1]:
        raise ValueError(f"top-{k} agreement needs {k} ranked tokens, the arrays hold {a.shape[1]}")
    return np.all(a[:, :k] == b[:, :k], axis=1)


def top_k_hits_tied(
    rows_ref: NDArray[np.floating],
    rows_ckpt: NDArray[np.floating],
    top_ref: ArrayLike,
    top_ckpt: ArrayLike,
    ranked: tuple[tuple[ArrayLike, ArrayLike], tuple[ArrayLike, ArrayLike]] | None = None,
) -> NDArray[np.bool_]:
    """Per position (rows of values over the vocabulary: logits or log-probs, any float dtype) and per
    k = 1..K (K the columns of the ranked ids `top_ref`/`top_ckpt`, each side's K largest in any order among
    equal values): whether some way of breaking ties on each side ranks the same k tokens first, in the same
    order. Column 0 is `same_top_tied`.

    Why this decides it: such a common ranking exists exactly when the two canonical rankings agree, each side
    ordered by (its own value, then the other side's value, both descending, then the lower id). A common
    ranking orders the tokens one side ties by the other side's values (it must be a ranking of both), so it
    is the canonical one up to tokens tied on both sides, where the lower id comes first on both. Only rows
    whose given rankings differ and that hold a tie at or above their K-th value need ranking again; there
    the candidates are the tokens at or above either side's K-th value.

    `ranked`, where the caller has them: each side's largest entries per row as (ids, values), largest first,
    more than K of them. They spare the comparisons of whole rows: a row holds such a tie exactly when two
    neighbours among its first K + 1 values are equal, and a side's tokens at or above its K-th value are
    among those ranked unless the last of them ties with it."""
    a, b = np.asarray(rows_ref), np.asarray(rows_ckpt)
    ia, ib = np.asarray(top_ref), np.asarray(top_ckpt)
    if a.ndim != 2 or a.shape != b.shape or ia.ndim != 2 or ia.shape != ib.shape or len(ia) != len(a):
        raise ValueError(f"value rows {a.shape}/{b.shape} and ranked ids {ia.shape}/{ib.shape} do not pair")
    k_max = ia.shape[1]
    hits = np.logical_and.accumulate(ia == ib, axis=1)
    differ = np.flatnonzero(~hits[:, -1])
    if not differ.size:
        return hits
    if ranked is not None:
        ranked = tuple((np.asarray(ids), np.asarray(values)) for ids, values in ranked)
        if any(values.shape[1] <= k_max or ids.shape != values.shape for ids, values in ranked):
            raise ValueError(f"more than the {k_max} largest entries per row are needed, with their ids")
        tied = np.zeros(len(differ), dtype=bool)
        for _, values in ranked:
            first = values[differ, : k_max + 1]
            tied |= (first[:, 1:] == first[:, :-1]).any(axis=1)
    else:
        # Fancy indexing copies whole rows of a vocabulary: one copy of each side's differing rows (none when
        # every row differs, as for most rows of a quantized candidate), not one per use.
        rows_a, rows_b = (a, b) if differ.size == len(a) else (a[differ], b[differ])
        va = np.take_along_axis(rows_a, ia[differ], axis=1)
        vb = np.take_along_axis(rows_b, ib[differ], axis=1)
        lowest_a, lowest_b = va.min(axis=1), vb.min(axis=1)
        tied = (
            (np.count_nonzero(rows_a >= lowest_a[:, None], axis=1) > k_max)
            | (np.count_nonzero(rows_b >= lowest_b[:, None], axis=1) > k_max)
            | (np.sort(va, axis=1)[:, 1:] == np.sort(va, axis=1)[:, :-1]).any(axis=1)
            | (np.sort(vb, axis=1)[:, 1:] == np.sort(vb, axis=1)[:, :-1]).any(axis=1)
        )
    rows = differ[tied]
    if ranked is not None and rows.size:
        lowest = [v[rows[:, None], given[rows]].min(axis=1) for v, given in ((a, ia), (b, ib))]
        # Rows whose every token at or above each side's lowest given value is among its ranked entries:
        # the last ranked value falls below that value on both sides (NaN never does).
        covered = np.logical_and.reduce(
            [values[rows, -1] < low for (_, values), low in zip(ranked, lowest, strict=True)]
        )
        if covered.any():
            within = [low[covered] for low in lowest]
            hits[rows[covered]] = _hits_among_ranked(a, b, rows[covered], within, ranked, k_max)
        rows = rows[~covered]
    for row in rows:
        ids = np.union1d(*(np.flatnonzero(v[row] >= v[row, top[row]].min()) for v, top in ((a, ia), (b, ib))))
        x, y = a[row, ids], b[row, ids]
        first_a = ids[np.lexsort((ids, -y, -x))[:k_max]]
        first_b = ids[np.lexsort((ids, -x, -y))[:k_max]]
        hits[row] = np.logical_and.accumulate(first_a == first_b)
    return hits


def _hits_among_ranked(
    a: np.ndarray,
    b: np.ndarray,
    rows: np.ndarray,
    lowest: list[np.ndarray],
    ranked: tuple[tuple[np.ndarray, np.ndarray], ...],
    k_max: int,
) -> np.ndarray:
    """`top_k_hits_tied` of `rows` whose candidates (each side's tokens at or above its `lowest` given
    value) are all among its ranked entries: both canonical rankings of the candidates, every row at once."""
    parts = [
        np.where(values[rows] >= low[:, None], ids[rows], -1)
        for (ids, values), low in zip(ranked, lowest, strict=True)
    ]
    # One place per candidate: each row's ids sorted, a repeat (a token both sides hold) emptied to -1.
    candidates = np.sort(np.concatenate(parts, axis=1), axis=1)
    candidates[:, 1:][candidates[:, 1:] == candidates[:, :-1]] = -1
    valid = candidates >= 0
    at = np.where(valid, candidates, 0)
    # Every candidate is at or above some side's K-th value, a number, so none is -inf on both sides: the
    # empty places, -inf on both, rank after every candidate in either order.
    x = np.where(valid, a[rows[:, None], at], -np.inf).ravel()
    y = np.where(valid, b[rows[:, None], at], -np.inf).ravel()
    ids = np.where(valid, candidates, np.iinfo(candidates.dtype).max).ravel()
    row = np.repeat(np.arange(len(rows)), candidates.shape[1])
    first = [
        ids[np.lexsort(keys).reshape(candidates.shape)[:, :k_max]]
        for keys in ((ids, -y, -x, row), (ids, -x, -y, row))
    ]
    return np.logical_and.accumulate(first[0] == first[1], axis=1)
