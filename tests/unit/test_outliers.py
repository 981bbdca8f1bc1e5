"""The rule that judges a channel against its tensor's channels and a tensor against its siblings, on
constructed errors worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evalsuite.tasks.tensors._verification._outliers import (
    CHANNEL_RATIO,
    CHANNEL_Z,
    MIN_CHANNELS,
    MIN_SIBLINGS,
    MIN_SPREAD,
    TENSOR_Z,
    channel_detail,
    channel_outliers,
    robust_z,
    sibling_outliers,
)


def test_robust_z_is_the_distance_from_the_median_in_scaled_mads():
    # Median 0, absolute deviations 2, 1, 0, 1, 2 → MAD 1, spread 1.4826.
    z, spread = robust_z(np.array([-2.0, -1.0, 0.0, 1.0, 2.0]))
    assert spread == pytest.approx(1.4826)
    assert z == pytest.approx([-2 / 1.4826, -1 / 1.4826, 0, 1 / 1.4826, 2 / 1.4826])


def test_robust_z_never_divides_by_less_than_the_least_spread():
    z, spread = robust_z(np.array([0.0, 0.0, 0.0, 0.5]))
    assert spread == MIN_SPREAD and z[-1] == pytest.approx(0.5 / MIN_SPREAD)


def noisy_channels(rows: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Squared errors, squared norms and largest weights of channels quantized alike: errors 5% of the norm,
    give or take 3%."""
    rng = np.random.default_rng(seed)
    norm_sq = rng.uniform(0.5, 2.0, rows)
    amax = np.sqrt(norm_sq) * rng.uniform(0.25, 0.3, rows)
    err_sq = norm_sq * (0.05 * rng.uniform(0.97, 1.03, rows)) ** 2
    return err_sq, norm_sq, amax


def test_channels_quantized_alike_have_no_outlier():
    found = channel_outliers(*noisy_channels(), 4096)
    assert found is not None and found.channels == () and found.judged == 64
    assert found.worst_z < CHANNEL_Z


def test_a_channel_twice_as_far_off_is_named():
    err_sq, norm_sq, amax = noisy_channels()
    err_sq[5] *= 2.0**2
    found = channel_outliers(err_sq, norm_sq, amax, 4096)
    assert found.channels == (5,) and found.worst == 5
    assert found.ratio[0] == pytest.approx(2.0, rel=0.05)
    detail = channel_detail(found, 64)
    assert detail.startswith("output channel 5 (1 of 64) stands out") and "2.0" in detail


def test_a_channel_whose_error_its_largest_weight_explains_is_no_outlier():
    # A channel with one very large weight: a uniform grid's step follows it, so its error is large against
    # its norm (5×) but ordinary against its largest weight. Real down_proj weights have such channels.
    err_sq, norm_sq, amax = noisy_channels()
    err_sq[7] *= 5.0**2
    amax[7] *= 5.0
    found = channel_outliers(err_sq, norm_sq, amax, 4096)
    assert found.channels == ()


def test_a_nan_channel_and_an_error_in_a_zero_channel_are_outliers():
    err_sq, norm_sq, amax = noisy_channels()
    err_sq[3] = math.nan
    norm_sq[9], amax[9] = 0.0, 0.0
    found = channel_outliers(err_sq, norm_sq, amax, 4096)
    assert set(found.channels) == {3, 9} and math.isinf(found.worst_z)
    assert "NaN, or from a zero source channel" in channel_detail(found, 64)


def test_too_few_channels_with_an_error_are_not_judged():
    err_sq, norm_sq, amax = noisy_channels(rows=MIN_CHANNELS)
    err_sq[:2] = 0.0  # decoded exactly: no error to compare
    assert channel_outliers(err_sq, norm_sq, amax, 4096) is None


def test_a_slightly_worse_channel_below_the_ratio_is_no_outlier():
    # Errors alike within 0.1%: a channel 1.2× off is many MADs away, but under CHANNEL_RATIO.
    rows = 64
    norm_sq, amax = np.ones(rows), np.full(rows, 0.3)
    err_sq = (0.05 * (1 + 0.001 * np.linspace(-1, 1, rows))) ** 2
    err_sq[0] = (0.05 * 1.2) ** 2
    assert CHANNEL_RATIO > 1.2
    assert channel_outliers(err_sq, norm_sq, amax, 4096).channels == ()


def test_a_tensor_twice_as_far_off_as_its_siblings_stands_out():
    # 29 siblings spread evenly over 0.092..0.105 (median about 0.0985, MAD about a quarter of the log range).
    errors = [*np.linspace(0.092, 0.105, 29), 0.2]
    judged = sibling_outliers(errors)
    assert list(judged.outlier) == [False] * 29 + [True]
    assert judged.median == pytest.approx(0.0985, rel=0.01)
    assert judged.ratio[-1] == pytest.approx(0.2 / judged.median)
    assert judged.z[-1] == pytest.approx(
        math.log(0.2 / 0.0985) / (1.4826 * math.log(0.105 / 0.092) / 4), rel=0.1
    )


def test_a_tensor_a_little_worse_than_tight_siblings_does_not():
    # The first layer's o_proj of a real model quantizes about 1.3× worse than the others, far in MADs.
    errors = [0.092, 0.0921, 0.0922, 0.0919, 0.0918, 0.092, 0.12]
    judged = sibling_outliers(errors)
    assert judged.z[-1] > TENSOR_Z and not judged.outlier.any()


def test_too_few_siblings_are_not_judged_and_nan_or_exact_tensors_never_are():
    assert sibling_outliers([0.1] * (MIN_SIBLINGS - 2) + [0.5]) is None
    judged = sibling_outliers([0.1, 0.1, 0.11, 0.09, 0.1, 0.1, math.nan, 0.0])
    assert math.isnan(judged.z[-2]) and math.isnan(judged.z[-1]) and not judged.outlier.any()


def test_short_channels_are_judged_no_more_finely_than_their_own_sampling_noise():
    # 32 channels alike within 0.1% and one 1.35× off: an outlier among channels of 65,536 weights, but a
    # channel of 64 weights varies by about 1 / √128 ≈ 9% by chance alone, so 1.35× is no outlier there.
    rows = 32
    norm_sq, amax = np.ones(rows), np.full(rows, 0.3)
    err_sq = (0.05 * (1 + 0.001 * np.linspace(-1, 1, rows))) ** 2
    err_sq[0] = (0.05 * 1.35) ** 2
    assert channel_outliers(err_sq, norm_sq, amax, 65536).channels == (0,)
    assert channel_outliers(err_sq, norm_sq, amax, 64).channels == ()
