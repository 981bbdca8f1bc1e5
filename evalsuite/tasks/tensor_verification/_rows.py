"""What the tensors task records of each tensor: a typed row per source tensor (`TensorRow`) or unexpected
candidate tensor (`UnexpectedRow`), each written as one row of tensors.json, the problems found, and the error
statistics of a decoded tensor against its source."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np

from evalsuite import metrics
from evalsuite.formats import ModuleKind, Part
from evalsuite.formats.compressed_tensors import StoredQuantization

TensorClass = Literal["quantized", "protected", "missing"]


@dataclass(frozen=True)
class Problem:
    """One thing the files disagree on, named: `check` is protected, missing, unexpected, config or decode."""

    check: str
    tensor: str
    detail: str

    def to_json(self) -> dict[str, str]:
        """The problem as listed in tensors.json and in the task's details."""
        return {"check": self.check, "tensor": self.tensor, "detail": self.detail}


# Fields of a TensorRow that are not columns of their own: `to_json` writes what they hold.
_FORMAT_DETAILS = frozenset({"stored", "codebook", "worst_tile", "worst_tile_ratio", "tile_outliers"})


@dataclass
class TensorRow:
    """One source tensor: how it pairs (`tensor_class`), what its module is, how the candidate stores it and,
    for a decoded or cast tensor, its error against the source.

    The fields up to `problems` are the columns every row of tensors.json has, in their order there; the
    format's details follow them only in rows of that format: a compressed-tensors module's `group_size` and
    `symmetric` (from `stored`, its scheme as read from its tensors), an EXL3 module's `codebook`.
    """

    name: str
    tensor_class: TensorClass
    module: str
    kind: ModuleKind
    part: Part
    layer: int | None
    projection: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    candidate_tensors: list[str]
    payload_bytes: int = 0
    format: str | None = None
    group: str | None = None
    strategy: str | None = None
    bits: int | float | None = None
    bits_per_weight: int | float | None = None
    identical: bool | None = None
    sha256: str | None = None
    candidate_sha256: str | None = None
    first_difference: str | None = None
    decode_exact: bool | None = None
    library_checked_rows: int | None = None
    rel_err: float | None = None
    sqnr_db: float | None = None
    cosine: float | None = None
    max_abs_err: float | None = None
    worst_channel: int | None = None
    worst_channel_rel_err: float | None = None
    worst_channel_err: float | None = None
    worst_channel_err_channel: int | None = None
    note: str | None = None
    problems: list[str] = field(default_factory=list)
    stored: StoredQuantization | None = None
    codebook: str | None = None  # EXL3: mcg, mul1, 3inst (no marker) or mixed; None for an unreadable trellis
    # EXL3: the tile with the largest error in the rotated basis, its error over the median tile's, and how
    # many tiles exceed the outlier ratio (`_exl3.TILE_OUTLIER_RATIO`).
    worst_tile: str | None = None
    worst_tile_ratio: float | None = None
    tile_outliers: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The row of tensors.json."""
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _FORMAT_DETAILS}
        row["shape"] = list(self.shape)
        if self.stored is not None:
            row.update(group_size=self.stored.group_size, symmetric=self.stored.symmetric)
        if self.format == "exl3":
            row["codebook"] = self.codebook
            row.update(
                worst_tile=self.worst_tile,
                worst_tile_ratio=self.worst_tile_ratio,
                tile_outliers=self.tile_outliers,
            )
        return row


@dataclass
class UnexpectedRow:
    """A candidate tensor that pairs with no source tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The row of tensors.json."""
        return {
            "name": self.name,
            "tensor_class": "unexpected",
            "dtype": self.dtype,
            "shape": list(self.shape),
            "problems": self.problems,
        }


class ErrorAccumulator:
    """Error statistics of a decoded tensor against its source, added up block by block of rows.

    It adds up the sums of `metrics.error_sums` (computed here per row, in reused buffers), and keeps two
    worst output channels (rows): the largest ‖x_r − w_r‖ / ‖w_r‖ (relative to the channel itself: above 1 a
    channel decodes further from its source than zeros would) and the largest ‖x_r − w_r‖ / max(‖w_r‖, RMS)
    with RMS the tensor's RMS channel norm √(Σ‖w_r‖² / rows). The second holds for error-compensating
    quantizers (GPTQ moves the weights of a near-zero channel far, relative to that channel, on purpose: the
    RMS is the yardstick there) and for real weights' outlier channels (their own norm is), while one wrong
    scale still shows.
    """

    def __init__(self) -> None:
        self.sums = metrics.ErrorSums(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        self.rows = 0
        self.worst_channel = -1
        self.worst_channel_rel_err = 0.0
        self.row_err: list[np.ndarray] = []
        self.row_norm: list[np.ndarray] = []

    def add(self, r0: int, ref: np.ndarray, cand: np.ndarray, work: np.ndarray | None = None) -> None:
        """Add rows r0.. of the source (`ref`) and of the decoded tensor (`cand`), float32 (rows, cols);
        `work` is a float32 buffer of the same shape for the difference."""
        import torch

        r, c = torch.from_numpy(ref), torch.from_numpy(cand)
        d = torch.sub(c, r, out=None if work is None else torch.from_numpy(work))
        # Per row in float32 (torch's vectorised norm, one pass each, in a fixed order on one thread: the
        # task runs torch on one thread per worker), across rows in float64: the rounding stays near 1e-6
        # relative. Σ r·x follows from the other three, (Σ r² + Σ x² − Σ (x − r)²) / 2, with the same
        # relative accuracy (it is about Σ r² itself), which saves a fourth pass.
        err, norm, cand_sq = (
            torch.linalg.vector_norm(t, dim=1).double().square_().numpy() for t in (d, r, c)
        )
        low, high = torch.aminmax(d) if d.numel() else (torch.zeros(()), torch.zeros(()))
        ref_sq, err_sq, cand_total = float(norm.sum()), float(err.sum()), float(cand_sq.sum())
        block = metrics.ErrorSums(
            n=d.numel(),
            ref_sq=ref_sq,
            err_sq=err_sq,
            cand_sq=cand_total,
            dot=(ref_sq + cand_total - err_sq) / 2,
            max_abs=float(max(high, -low)),
        )
        self.sums = self.sums + block
        self.rows += err.size
        if not err.size:
            return
        self.row_err.append(err)
        self.row_norm.append(norm)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(err == 0, 0.0, np.sqrt(err / norm))
        i = int(np.argmax(rel))
        if np.isnan(rel[i]) or rel[i] > self.worst_channel_rel_err:
            self.worst_channel, self.worst_channel_rel_err = r0 + i, float(rel[i])

    def fill(self, row: TensorRow) -> None:
        """Write the statistics into a row."""
        s = self.sums
        row.rel_err = s.relative_frobenius_error
        row.sqnr_db = s.sqnr_db
        row.cosine = s.cosine
        row.max_abs_err = s.max_abs
        row.worst_channel = self.worst_channel if self.worst_channel >= 0 else None
        row.worst_channel_rel_err = self.worst_channel_rel_err
        if self.row_err:
            err, norm = np.concatenate(self.row_err), np.concatenate(self.row_norm)
            yardstick = np.maximum(norm, s.ref_sq / self.rows)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(err == 0, 0.0, np.sqrt(err / yardstick))
            j = int(np.argmax(ratio))  # argmax takes a NaN first: a NaN channel is the worst there is
            row.worst_channel_err, row.worst_channel_err_channel = float(ratio[j]), j
