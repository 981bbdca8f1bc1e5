"""A tensor or an output channel that stands out from its siblings: judged against the others of its pack.

Absolute bounds (`worst_rel_err`, `worst_channel_gain_err`) have to be loose enough for every writer, GPTQ's
compensation included, so a few damaged bytes that leave one channel, or one tensor, twice as far off as its
siblings pass them. Quantization noise is alike across siblings, though: across the output channels of one
tensor, and across the tensors of one kind (same projection, same scheme) in one pack. So each is judged
against its siblings with robust statistics (the median and the median absolute deviation, MAD, of the
logarithm of the error: a few damaged channels move neither), as EXL3's `tile_outliers` judges a tile against
its tensor's tiles.

- **A channel** r of a decoded tensor: its error ‖x_r − w_r‖ is compared with what its own weights predict.
  That depends on the format: a floating-point grid (FP8) errs in proportion to the channel's norm ‖w_r‖, a
  uniform integer grid in proportion to its step, which its largest weight max|w_r| sets. So the error is
  divided by ‖w_r‖^(1−α) · max|w_r|^α, for the α of `ALPHAS` that makes the tensor's channels most alike
  (smallest MAD of the logarithm): the channel's robust z is its distance from their median in MADs. A
  channel is an outlier when its z is at least `CHANNEL_Z` and its error is at least `CHANNEL_RATIO` × the
  median channel's by both yardsticks (its norm and its largest weight): real weights have channels of
  unusual shape (a few very large weights) whose error stands out by one yardstick and not by the other; a
  damaged channel stands out by both, since damage adds error and leaves the source alone. The spread is
  never taken below a channel's own sampling noise (`CHANNEL_SAMPLING`).
- **A tensor**: its relative error against the tensors of its kind in the pack (same part, projection,
  format and scheme; at least `MIN_SIBLINGS` of them), the same way: z at least `TENSOR_Z` and its error at
  least `TENSOR_RATIO` × their median. Layers differ more than channels do (a real model's first layer
  quantizes worse than the others, under GPTQ most), hence a larger z and ratio.

A NaN error, or an error in a channel the source holds at zero, stands out by any measure: an outlier.
The thresholds are constants, as `TILE_OUTLIER_RATIO` is: `tasks/tensors.toml` bounds the counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# The exponents α of the yardstick ‖w_r‖^(1−α) · max|w_r|^α tried per tensor: 0 is the relative error (what a
# floating-point grid keeps alike), 1 the error over the channel's largest weight (a uniform grid's step).
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
# A channel: robust z and error over the median channel's (by both yardsticks). Clean packs of every writer
# stay below either where the other is reached (bench/outliers.py measures how far below).
CHANNEL_Z = 10.0
CHANNEL_RATIO = 1.3
# A tensor among the tensors of its kind, with at least MIN_SIBLINGS of them.
TENSOR_Z = 12.0
TENSOR_RATIO = 1.6
MIN_SIBLINGS = 6
# Fewer channels with an error than this: no judgement (no robust median of so few).
MIN_CHANNELS = 16
# The least spread the rule assumes (1.4826 × MAD of the natural logarithm): errors alike within 1% are as
# alike as rounding makes them, and a z of thousands would say more than the data do.
MIN_SPREAD = 0.01
# A channel's error is a norm over its n weights: even where every weight's error is drawn alike, its
# logarithm varies by about 1 / √(2n) (n Gaussian errors; uniform rounding errors a little less). The
# channels' spread is taken as at least that, so that a tensor of few, short channels (an MoE expert of 64
# inputs), whose MAD of a few dozen channels can come out small by chance, makes no outlier of its noisiest.
CHANNEL_SAMPLING = 1 / np.sqrt(2)
# Outlier channels named in a problem's detail (tensors.json's row gives the count).
NAMED_CHANNELS = 8


@dataclass(frozen=True)
class ChannelOutliers:
    """A decoded tensor's output channels judged against each other.

    `channels`: the outliers, worst first, with their robust z (`z`) and error over the median channel's
    (`ratio`: the smaller of the two yardsticks' ratios). `worst`, `worst_z`, `worst_ratio`: the channel with
    the largest z (outlier or not), its z and ratio. `judged`: the channels the median was taken over (those
    with an error). `nearest`: how close the closest channel came to being an outlier, the largest over the
    channels of min(z / CHANNEL_Z, ratio / CHANNEL_RATIO) (1 or more: an outlier)."""

    channels: tuple[int, ...]
    z: tuple[float, ...]
    ratio: tuple[float, ...]
    worst: int | None
    worst_z: float
    worst_ratio: float
    judged: int
    nearest: float


def robust_z(logs: np.ndarray, least: float = MIN_SPREAD) -> tuple[np.ndarray, float]:
    """Each value's distance from the median in robust standard deviations (1.4826 × MAD, at least `least`),
    and that spread. `logs` must be finite."""
    median = float(np.median(logs))
    spread = max(1.4826 * float(np.median(np.abs(logs - median))), least)
    return (logs - median) / spread, spread


def channel_outliers(
    err_sq: np.ndarray, norm_sq: np.ndarray, amax: np.ndarray, cols: int
) -> ChannelOutliers | None:
    """Judge every output channel of a decoded tensor from its squared error ‖x_r − w_r‖², its source's
    squared norm ‖w_r‖² and largest magnitude max|w_r| (see the module's docstring), each channel `cols`
    weights long. None when fewer than `MIN_CHANNELS` channels have an error to compare."""
    err_sq, norm_sq, amax = (np.asarray(a, dtype=np.float64) for a in (err_sq, norm_sq, amax))
    with np.errstate(invalid="ignore"):
        # A NaN error, or an error where the source channel is zero: no yardstick measures it, it stands out.
        broken = np.isnan(err_sq) | ((err_sq > 0) & ~(norm_sq > 0))
        judged = (err_sq > 0) & (norm_sq > 0) & (amax > 0) & np.isfinite(err_sq) & ~broken
    if int(judged.sum()) < MIN_CHANNELS:
        return None
    log_err = 0.5 * np.log(err_sq[judged])
    log_norm, log_max = 0.5 * np.log(norm_sq[judged]), np.log(amax[judged])
    least = max(MIN_SPREAD, CHANNEL_SAMPLING / np.sqrt(max(cols, 1)))
    fits = [robust_z(log_err - (1 - a) * log_norm - a * log_max, least) for a in ALPHAS]
    z = min(fits, key=lambda fit: fit[1])[0]
    # Over the median channel by each yardstick (α = 0 and α = 1), the smaller of the two.
    by_norm, by_max = log_err - log_norm, log_err - log_max
    ratio = np.exp(np.minimum(by_norm - np.median(by_norm), by_max - np.median(by_max)))
    full_z = np.full(err_sq.shape, -np.inf)
    full_ratio = np.zeros(err_sq.shape)
    full_z[judged], full_ratio[judged] = z, ratio
    full_z[broken], full_ratio[broken] = np.inf, np.inf
    outlier = (full_z >= CHANNEL_Z) & (full_ratio >= CHANNEL_RATIO)
    order = np.argsort(-full_z, kind="stable")
    worst, outliers = int(order[0]), [int(i) for i in order if outlier[i]]
    return ChannelOutliers(
        channels=tuple(outliers),
        z=tuple(float(full_z[i]) for i in outliers),
        ratio=tuple(float(full_ratio[i]) for i in outliers),
        worst=worst,
        worst_z=float(full_z[worst]),
        worst_ratio=float(full_ratio[worst]),
        judged=int(judged.sum()),
        nearest=float(np.max(np.minimum(full_z / CHANNEL_Z, full_ratio / CHANNEL_RATIO))),
    )


def channel_detail(found: ChannelOutliers, rows: int) -> str:
    """What a problem says of a tensor's outlier channels (`found.channels` is not empty)."""
    named = ", ".join(str(c) for c in found.channels[:NAMED_CHANNELS])
    count = len(found.channels)
    more = f" and {count - NAMED_CHANNELS} more" if count > NAMED_CHANNELS else ""
    first_z, first_ratio = found.z[0], found.ratio[0]
    z = "NaN, or from a zero source channel" if np.isinf(first_z) else f"robust z {first_z:.1f}"
    plural = ("s", "") if count > 1 else ("", "s")
    return (
        f"output channel{plural[0]} {named}{more} ({count} of {rows}) stand{plural[1]} out from the tensor's "
        f"channels: the first decodes with {first_ratio:.2f}× the median channel's error ({z}; an "
        f"outlier from z {CHANNEL_Z:g} and {CHANNEL_RATIO:g}×)"
    )


@dataclass(frozen=True)
class SiblingJudgement:
    """Tensors of one kind judged against each other: each one's robust z and relative error over the
    median's (NaN for a tensor with no error, or a NaN one: not judged), the median, and the outliers."""

    z: np.ndarray
    ratio: np.ndarray
    median: float

    @property
    def outlier(self) -> np.ndarray:
        """Which tensors stand out (`is_sibling_outlier`)."""
        with np.errstate(invalid="ignore"):
            return (self.z >= TENSOR_Z) & (self.ratio >= TENSOR_RATIO)


def sibling_outliers(rel_errs: Sequence[float]) -> SiblingJudgement | None:
    """Judge the relative errors of the tensors of one kind against each other (see the module's
    docstring); None when fewer than `MIN_SIBLINGS` have an error. A NaN error fails `worst_rel_err`
    already, and a tensor decoded exactly cannot stand out upwards: neither is judged."""
    errors = np.asarray(rel_errs, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        judged = errors > 0
    if int(judged.sum()) < MIN_SIBLINGS:
        return None
    logs = np.log(errors[judged])
    z_judged, _ = robust_z(logs)
    median = float(np.exp(np.median(logs)))
    z, ratio = np.full(errors.shape, np.nan), np.full(errors.shape, np.nan)
    z[judged], ratio[judged] = z_judged, errors[judged] / median
    return SiblingJudgement(z=z, ratio=ratio, median=median)


def is_sibling_outlier(z: float | None, ratio: float | None) -> bool:
    """Whether a tensor judged against its siblings (its robust z and error ratio) stands out."""
    return z is not None and ratio is not None and z >= TENSOR_Z and ratio >= TENSOR_RATIO


def sibling_detail(rel_err: float, z: float, ratio: float, median: float, kind: str, count: int) -> str:
    """What a problem says of a tensor that stands out from the `count` tensors of its kind."""
    return (
        f"relative error {rel_err:.4g} is {ratio:.2f}× the median ({median:.4g}) of the {count} {kind} "
        f"tensors of its scheme in the pack (robust z {z:.1f}; an outlier from z {TENSOR_Z:g} and "
        f"{TENSOR_RATIO:g}×)"
    )
