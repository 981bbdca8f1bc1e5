"""Errors of a decoded or quantized tensor against its reference: relative Frobenius error, cosine
similarity, max abs error, SQNR, and their sums accumulated over blocks (`ErrorSums`) or groups of rows.
Pure functions on arrays, in float64 (the `tensors` task, the vision tower and the layer diagnostics)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """Σ a·b of two 1-D arrays in one fixed order (einsum's loop, not a BLAS dot, whose split over threads
    varies between runs): the same inputs give the same bits, run after run."""
    return float(np.einsum("i,i->", a, b))


def relative_frobenius_error(reference: ArrayLike, candidate: ArrayLike) -> float:
    """‖candidate − reference‖_F / ‖reference‖_F, in float64; exactly 0 for identical arrays."""
    ref, cand = np.asarray(reference, dtype=np.float64), np.asarray(candidate, dtype=np.float64)
    if ref.shape != cand.shape:
        raise ValueError(f"arrays differ in shape: {ref.shape} vs {cand.shape}")
    norm = float(np.linalg.norm(ref))
    err = float(np.linalg.norm(cand - ref))
    return err / norm if norm else (0.0 if err == 0 else float("inf"))


def cosine_similarity(reference: ArrayLike, candidate: ArrayLike) -> float:
    """Cosine of the angle between two arrays taken as vectors, in float64; exactly 1 for identical arrays.

    Written as a·b / sqrt(‖a‖²·‖b‖²): for a = b that is x / sqrt(x·x), which IEEE arithmetic makes exactly 1.
    """
    a = np.asarray(reference, dtype=np.float64).reshape(-1)
    b = np.asarray(candidate, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"arrays differ in size: {a.size} vs {b.size}")
    denominator = float(np.sqrt(_dot(a, a) * _dot(b, b)))
    return _dot(a, b) / denominator if denominator else float("nan")


def max_abs_error(reference: ArrayLike, candidate: ArrayLike) -> float:
    """Largest absolute elementwise difference."""
    ref, cand = np.asarray(reference, dtype=np.float64), np.asarray(candidate, dtype=np.float64)
    if ref.shape != cand.shape:
        raise ValueError(f"arrays differ in shape: {ref.shape} vs {cand.shape}")
    return float(np.abs(cand - ref).max()) if ref.size else 0.0


@dataclass(frozen=True)
class ErrorSums:
    """Sufficient statistics of a reconstruction `x` of a reference `r` (a decoded weight and its source).

    Sums add, so a tensor streamed in chunks has the statistics of its chunks' sums added in float64: `n`
    elements, Σ r², Σ (x − r)², Σ x², Σ r·x and max |x − r|. The statistics follow the conventions of
    `relative_frobenius_error`, `cosine_similarity` and `max_abs_error` above.
    """

    n: int
    ref_sq: float
    err_sq: float
    cand_sq: float
    dot: float
    max_abs: float

    def __add__(self, other: ErrorSums) -> ErrorSums:
        return ErrorSums(
            self.n + other.n,
            self.ref_sq + other.ref_sq,
            self.err_sq + other.err_sq,
            self.cand_sq + other.cand_sq,
            self.dot + other.dot,
            max(self.max_abs, other.max_abs),
        )

    @property
    def relative_frobenius_error(self) -> float:
        """‖x − r‖_F / ‖r‖_F: 0 for an exact copy, inf when r is all zeros and x is not."""
        if self.err_sq == 0:
            return 0.0
        return float(np.sqrt(self.err_sq / self.ref_sq)) if self.ref_sq > 0 else float("inf")

    @property
    def sqnr_db(self) -> float:
        """Signal to quantization-noise ratio 10·log10(Σ r² / Σ (x − r)²) in dB: inf for an exact copy."""
        if self.err_sq == 0:
            return float("inf")
        return float(10 * np.log10(self.ref_sq / self.err_sq)) if self.ref_sq > 0 else float("-inf")

    @property
    def cosine(self) -> float:
        """Σ r·x / sqrt(Σ r² · Σ x²); NaN when either side is all zeros (no direction to compare)."""
        denominator = float(np.sqrt(self.ref_sq * self.cand_sq))
        return self.dot / denominator if denominator else float("nan")


def error_sums(ref: ArrayLike, cand: ArrayLike) -> ErrorSums:
    """The `ErrorSums` of `cand` against `ref` (same shape).

    Two float32 arrays are summed by float32 BLAS dot products, which is what makes streaming a large tensor
    affordable: callers keep chunks near a million elements and add the chunks' sums in float64, which keeps
    the relative rounding error near 1e-6. Anything else is summed in float64.
    """
    r, x = np.asarray(ref), np.asarray(cand)
    if r.shape != x.shape:
        raise ValueError(f"arrays differ in shape: {r.shape} vs {x.shape}")
    dtype = np.float32 if r.dtype == np.float32 and x.dtype == np.float32 else np.float64
    r, x = r.astype(dtype, copy=False).reshape(-1), x.astype(dtype, copy=False).reshape(-1)
    if r.size == 0:
        return ErrorSums(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    d = x - r
    err_sq = _dot(d, d)
    np.abs(d, out=d)
    return ErrorSums(
        n=int(r.size),
        ref_sq=_dot(r, r),
        err_sq=err_sq,
        cand_sq=_dot(x, x),
        dot=_dot(r, x),
        max_abs=float(d.max()),
    )


def sqnr_db(reference: ArrayLike, candidate: ArrayLike) -> float:
    """Signal to quantization-noise ratio of `candidate` against `reference` in dB (`ErrorSums.sqnr_db`)."""
    return error_sums(reference, candidate).sqnr_db


# --------------------------------------------------------------------------------------------------------
# Paired per-document comparisons (downstream accuracy on the same documents, one score per side)
# --------------------------------------------------------------------------------------------------------


def grouped_error_sums(
    ref: ArrayLike, cand: ArrayLike, weights: ArrayLike, groups: ArrayLike, n_groups: int
) -> NDArray[np.float64]:
    """Weighted error sums of rows grouped by an id (an expert's outputs, weighted by their routing weights):
    for each group g, (rows, Σ w, Σ w‖r‖², Σ w‖x − r‖², Σ w‖x‖², Σ w r·x) over the rows of group g, shape
    (n_groups, 6). A group's weighted relative error is sqrt(col 3 / col 2), its cosine col 5 /
    sqrt(col 2 · col 4)."""
    r, x = np.asarray(ref, dtype=np.float64), np.asarray(cand, dtype=np.float64)
    w, g = np.asarray(weights, dtype=np.float64), np.asarray(groups, dtype=np.int64)
    if r.shape != x.shape or r.ndim != 2 or w.shape != (len(r),) or g.shape != (len(r),):
        raise ValueError(f"rows {r.shape} / {x.shape}, weights {w.shape} and groups {g.shape} differ")
    d = x - r
    columns = (
        np.ones(len(r)),
        w,
        w * np.einsum("ij,ij->i", r, r),
        w * np.einsum("ij,ij->i", d, d),
        w * np.einsum("ij,ij->i", x, x),
        w * np.einsum("ij,ij->i", r, x),
    )
    out = np.zeros((n_groups, 6))
    for c, column in enumerate(columns):
        np.add.at(out[:, c], g, column)
    return out
