"""`token_ranks.ranked_top`: each row's k largest values and their ids, largest first and equal values by
lower id, found group by group; against a sort of the whole row."""

import numpy as np
import pytest

from evalsuite.stats import token_ranks


def _sorted_whole(rows: np.ndarray, k: int) -> np.ndarray:
    return np.stack([np.lexsort((np.arange(len(row)), -row))[:k] for row in rows])


@pytest.mark.parametrize("width", [6, 50, 1000, 4096, 49152 + 37])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ranked_top_is_a_sort_of_the_whole_row_ties_by_lower_id(width, dtype):
    rng = np.random.default_rng(width)
    # Coarse values, as BF16 logits have them: ties at every rank; some rows of few distinct values.
    rows = np.round(rng.normal(size=(40, width)) * 4) / 4
    rows[:5] = rng.integers(0, 3, size=(5, width))
    rows = rows.astype(dtype)
    for k in sorted({1, min(6, width), width if width <= 50 else 6}):
        ids, values = token_ranks.ranked_top(rows, k)
        expected = _sorted_whole(rows, k)
        assert ids.dtype == np.int64 and np.array_equal(ids, expected), k
        assert values.dtype == dtype and np.array_equal(values, np.take_along_axis(rows, expected, axis=1))


def test_ranked_top_ranks_infinities_as_numbers_and_nan_below_every_number():
    rows = np.random.default_rng(1).normal(size=(5, 3000)).astype(np.float32)
    rows[0, [10, 2500]] = np.inf
    rows[1, :] = -np.inf
    rows[1, [7, 2999]] = 1.0
    rows[2, [3, 1500, 2999]] = np.nan  # a NaN in a group hides that group's maximum
    rows[3, :] = np.nan
    rows[4, :2990] = -np.inf  # fewer than k groups with a number in them
    ids, values = token_ranks.ranked_top(rows, 6)
    assert np.array_equal(ids, _sorted_whole(rows, 6))
    assert ids[0, :2].tolist() == [10, 2500] and ids[1, :2].tolist() == [7, 2999]
    assert not np.isnan(values[2]).any() and np.isnan(values[3]).all()


def test_ranked_top_refuses_more_than_the_row_holds():
    with pytest.raises(ValueError, match="the 7 largest of rows of 6 values"):
        token_ranks.ranked_top(np.zeros((2, 6), np.float32), 7)
