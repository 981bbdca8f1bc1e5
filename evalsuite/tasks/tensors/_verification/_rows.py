"""What the tensors task records of each tensor: a typed row per source tensor (`TensorRow`) or unexpected
candidate tensor (`UnexpectedRow`), each written as one row of tensors.json, the problems found, and the error
statistics of a decoded tensor against its source."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np

from evalsuite.formats import ModuleKind, Part
from evalsuite.formats.compressed_tensors import StoredQuantization
from evalsuite.stats import tensor_errors
from evalsuite.tasks.tensors._verification._outliers import ChannelOutliers, channel_outliers

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
_FORMAT_DETAILS = frozenset(
    {"stored", "codebook", "worst_tile", "worst_tile_ratio", "tile_outliers", "channel_judgement"}
)


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
    worst_channel_gain_err: float | None = None
    worst_channel_gain_err_channel: int | None = None
    # A quantized tensor's channels against each other and the tensor against its siblings (`_outliers`):
    # how many channels stand out, the channel with the largest robust z and that z; the tensor's relative
    # error over the median of its kind and its robust z among them (None where not judged).
    outlier_channels: int | None = None
    worst_channel_z: float | None = None
    worst_channel_z_channel: int | None = None
    sibling_ratio: float | None = None
    sibling_z: float | None = None
    note: str | None = None
    problems: list[str] = field(default_factory=list)
    stored: StoredQuantization | None = None
    codebook: str | None = None  # EXL3: mcg, mul1, 3inst (no marker) or mixed; None for an unreadable trellis
    # EXL3: the tile with the largest error in the rotated basis, its error over the median tile's, and how
    # many tiles exceed the outlier ratio (`_exl3.TILE_OUTLIER_RATIO`).
    worst_tile: str | None = None
    worst_tile_ratio: float | None = None
    tile_outliers: int | None = None
    channel_judgement: ChannelOutliers | None = None  # the outlier channels, named in a problem

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

    It adds up the sums of `tensor_errors.error_sums` (computed here per row, in reused buffers), and keeps
    two worst output channels (rows): the largest ‖x_r − w_r‖ / ‖w_r‖ (relative to the channel itself: above 1
    a channel decodes further from its source than zeros would) and the largest ‖x_r − w_r‖ / max(‖w_r‖, RMS)
    with RMS the tensor's RMS channel norm √(Σ‖w_r‖² / rows). The second holds for error-compensating
    quantizers (GPTQ moves the weights of a near-zero channel far, relative to that channel, on purpose: the
    RMS is the yardstick there) and for real weights' outlier channels (their own norm is), while one wrong
    scale still shows."""

    def __init__(self) -> None:
        # Per block: its first row, its rows' ‖x_r − w_r‖, ‖w_r‖, ‖x_r‖, max|w_r| (float32, 4 × rows), the
        # min and max of x − w, its elements; the rest is computed from these once, in `_settle`, not block by
        # block.
        self._blocks: list[tuple[int, Any, Any, int]] = []
        self._cand_sq = np.zeros(0)
        self._amax = np.zeros(0)
        self._settled: tuple[tensor_errors.ErrorSums, np.ndarray, np.ndarray, int, float] | None = None

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
        norms = torch.empty((4, d.shape[0]), dtype=torch.float32)
        for i, t in enumerate((d, r, c)):
            torch.linalg.vector_norm(t, dim=1, out=norms[i])
        # max|w_r|: the yardstick of a uniform grid's step, for judging channels against each other.
        torch.linalg.vector_norm(r, ord=float("inf"), dim=1, out=norms[3])
        extremes = torch.aminmax(d) if d.numel() else (torch.zeros(()), torch.zeros(()))
        self._blocks.append((r0, norms, extremes, d.numel()))
        self._settled = None

    def _settle(self) -> tuple[tensor_errors.ErrorSums, np.ndarray, np.ndarray, int, float]:
        """The sums, every row's squared error and source norms (float64), and the worst channel (-1 for
        none) with its relative error, from the blocks added so far."""
        if self._settled is not None:
            return self._settled
        import torch

        blocks = [b for b in self._blocks if b[1].shape[1]]
        if not blocks:
            self._settled = (
                tensor_errors.ErrorSums(0, 0.0, 0.0, 0.0, 0.0, 0.0),
                np.zeros(0),
                np.zeros(0),
                -1,
                0.0,
            )
            return self._settled
        stacked = torch.cat([b[1] for b in blocks], dim=1).double()
        self._amax = stacked[3].numpy()
        err, norm, cand_sq = stacked[:3].square_().numpy()
        self._cand_sq = cand_sq
        low = np.array([float(b[2][0]) for b in blocks])
        high = np.array([float(b[2][1]) for b in blocks])
        ref_sq, err_sq, cand_total = float(norm.sum()), float(err.sum()), float(cand_sq.sum())
        # A block's max |x − w| is NaN where x − w holds one, and a NaN never wins a max against a number
        # (as Python's max of floats, which added the blocks up before): fmax passes NaNs over.
        block_max = np.where(-low > high, -low, high)
        sums = tensor_errors.ErrorSums(
            n=sum(b[3] for b in blocks),
            ref_sq=ref_sq,
            err_sq=err_sq,
            cand_sq=cand_total,
            dot=(ref_sq + cand_total - err_sq) / 2,
            max_abs=float(np.fmax.reduce(np.append(block_max, 0.0))),
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(err == 0, 0.0, np.sqrt(err / norm))
        starts = np.cumsum([0] + [b[1].shape[1] for b in blocks])
        nan = np.flatnonzero(np.isnan(rel))
        if nan.size:
            # Blocks used to be compared one by one, each block's worst (its first NaN) replacing the worst so
            # far when NaN: the worst is the first NaN of the last block holding one.
            b = int(np.searchsorted(starts, nan[-1], side="right")) - 1
            i = int(nan[np.searchsorted(nan, starts[b])])
        else:
            i = int(np.argmax(rel))
            b = int(np.searchsorted(starts, i, side="right")) - 1
        worst, worst_rel = -1, 0.0
        if np.isnan(rel[i]) or rel[i] > 0:
            worst, worst_rel = blocks[b][0] + i - int(starts[b]), float(rel[i])
        self._settled = (sums, err, norm, worst, worst_rel)
        return self._settled

    @property
    def sums(self) -> tensor_errors.ErrorSums:
        """The `tensor_errors.ErrorSums` of the rows added so far."""
        return self._settle()[0]

    @property
    def rows(self) -> int:
        """Rows added so far."""
        return int(self._settle()[1].size)

    @property
    def worst_channel(self) -> int:
        """The row with the largest ‖x_r − w_r‖ / ‖w_r‖ (the first NaN of the last block holding one), -1
        while no row has an error."""
        return self._settle()[3]

    @property
    def worst_channel_rel_err(self) -> float:
        """That row's ‖x_r − w_r‖ / ‖w_r‖ (0.0 while no row has an error)."""
        return self._settle()[4]

    def fill(self, row: TensorRow) -> None:
        """Write the statistics into a row."""
        s, err, norm, worst, worst_rel = self._settle()
        row.rel_err = s.relative_frobenius_error
        row.sqnr_db = s.sqnr_db
        row.cosine = s.cosine
        row.max_abs_err = s.max_abs
        row.worst_channel = worst if worst >= 0 else None
        row.worst_channel_rel_err = worst_rel
        if err.size:
            yardstick = np.maximum(norm, s.ref_sq / err.size)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(err == 0, 0.0, np.sqrt(err / yardstick))
            j = int(np.argmax(ratio))  # argmax takes a NaN first: a NaN channel is the worst there is
            row.worst_channel_err, row.worst_channel_err_channel = float(ratio[j]), j
            # The error's component along the channel itself, ⟨w_r, x_r − w_r⟩ / (‖w_r‖ · max(‖w_r‖, RMS)),
            # from the three norms (x = w + d: ‖x‖² = ‖w‖² + 2⟨w, d⟩ + ‖d‖²). A wrong scale of the channel by
            # a factor f puts it at f − 1, of one group by about (f − 1) × the group's share of the channel's
            # energy, a channel zeroed or swapped at about 1; GPTQ's compensation leaves it small, but coarse
            # rounding that sends a channel's small weights to zero does not (README), so it is reported.
            along = (self._cand_sq - norm - err) / 2
            with np.errstate(divide="ignore", invalid="ignore"):
                # A channel zero in the source has no direction of its own: its error is worst_channel_err's.
                gain = np.where(norm == 0, 0.0, np.abs(along) / np.sqrt(norm * yardstick))
            g = int(np.argmax(gain))
            row.worst_channel_gain_err, row.worst_channel_gain_err_channel = float(gain[g]), g
        cols = s.n // err.size if err.size else 0
        judged = channel_outliers(err, norm, self._amax, cols) if row.tensor_class == "quantized" else None
        if judged is not None:
            row.channel_judgement = judged
            row.outlier_channels = len(judged.channels)
            row.worst_channel_z, row.worst_channel_z_channel = judged.worst_z, judged.worst
