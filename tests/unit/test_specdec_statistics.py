"""`specdec`'s statistics on cases worked by hand: the mean accepted length of a drafted decoding, a mean over
prompts with its Student-t interval, and what a paired difference's interval lets a report say."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evalsuite.stats import claims, metrics


def test_tokens_per_round_is_new_tokens_over_rounds_the_bonus_token_included():
    # 24 tokens in 4 rounds: every round kept 5 drafted tokens and its bonus token (6 a round); 24 in 24: no
    # drafted token ever kept (1 a round, plain decoding's pace); 7 in 3.
    assert metrics.tokens_per_round([24, 24, 7], [4, 24, 3]).tolist() == [6.0, 1.0, 7 / 3]


@pytest.mark.parametrize(
    ("tokens", "rounds", "said"),
    [([4], [0], "at least one round"), ([4, 5], [2], "against 1 decodings' rounds")],
)
def test_tokens_per_round_refuses_a_decoding_without_rounds_or_unpaired_counts(tokens, rounds, said):
    with pytest.raises(ValueError, match=said):
        metrics.tokens_per_round(tokens, rounds)


def test_a_mean_over_prompts_has_its_student_t_interval():
    # [3, 1, 2]: mean 2, population variance 2/3, standard error sqrt((2/3) / 2) = 0.57735; t(0.975, 2) =
    # 4.302653, so the half-width is 2.484138.
    found = claims.mean_interval([3.0, 1.0, 2.0])
    assert (found.value, found.n) == (2.0, 3)
    assert found.lower == pytest.approx(2 - 2.484138, abs=1e-6)
    assert found.upper == pytest.approx(2 + 2.484138, abs=1e-6)


def test_too_few_prompts_give_no_interval():
    found = claims.mean_interval([1.0, 2.0])
    assert found.value == 1.5 and found.n == 2
    assert math.isnan(found.lower) and math.isnan(found.upper)
    assert claims.direction(found) == "undetermined"


@pytest.mark.parametrize(
    ("differences", "said"),
    [
        ([0.5, 0.6, 0.7, 0.5], "higher"),  # mean 0.575, half-width 0.152: [0.42, 0.73]
        ([-1.0, -1.2, -0.8], "lower"),
        ([0.0, 0.0, 0.0, 0.0, 0.0], "same"),  # every prompt's own difference is 0
        ([1.0, -1.0, 0.5, -0.5], "undetermined"),  # the interval holds 0: not "the same"
        ([0.0, 0.0, 1.0], "undetermined"),
    ],
)
def test_a_paired_difference_is_called_higher_or_lower_only_where_its_interval_excludes_zero(
    differences, said
):
    assert claims.direction(claims.mean_interval(np.asarray(differences))) == said


def test_a_workloads_direction_needs_the_bonferroni_interval_over_the_workloads():
    # Five paired differences 0.4, 0.6, 0.5, 0.7, 0.3: mean 0.5, sample sd sqrt(0.025), stderr sqrt(0.005).
    # At 95% (t_{0.975, 4} = 2.7764) the interval is 0.5 ± 0.1963: higher. Over eight workloads the level is
    # 1 − 0.05 / 8 = 0.99375 (t_{0.996875, 4} = 5.2611): 0.5 ± 0.3720, still higher; shifted down by 0.3 the
    # same spread gives 0.2 ± 0.3720, undetermined there, and 0.2 ± 0.1963 at 95%: higher.
    x = np.asarray([0.4, 0.6, 0.5, 0.7, 0.3])
    ninety_five = claims.mean_interval(x)
    assert ninety_five.lower == pytest.approx(0.5 - 2.7764 * math.sqrt(0.005), abs=1e-4)
    family = claims.mean_interval(x, 1 - 0.05 / 8)
    half = 5.2611 * math.sqrt(0.005)
    assert (family.lower, family.upper) == pytest.approx((0.5 - half, 0.5 + half), abs=1e-4)
    assert family.lower < ninety_five.lower and claims.direction(family) == "higher"
    shifted = x - 0.3
    assert claims.direction(claims.mean_interval(shifted)) == "higher"
    assert claims.direction(claims.mean_interval(shifted, 1 - 0.05 / 8)) == "undetermined"
