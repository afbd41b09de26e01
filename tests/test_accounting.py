"""Row accounting helpers over whole columns (hf_pipeline.accounting)."""

from __future__ import annotations

import numpy as np
import pytest

from hf_pipeline.accounting import later_duplicates, sorted_unique


@pytest.mark.parametrize(
    "values",
    [
        np.array([], dtype=np.int64),
        np.array([7], dtype=np.int64),
        np.array([3, -1, 3, 3, 0, -1, 2**62, -(2**62)], dtype=np.int64),
        np.random.default_rng(0).integers(-50, 50, size=10_000),
        np.random.default_rng(1).permutation(100_000),
    ],
    ids=["empty", "one", "extremes", "many-duplicates", "all-distinct"],
)
def test_sorted_unique_is_numpys_unique(values):
    got = sorted_unique(values)
    np.testing.assert_array_equal(got, np.unique(values))
    assert got.dtype == values.dtype


def test_later_duplicates_first_eligible_occurrence_wins():
    keys = np.array([5, 1, 5, 2, 1, 5, 9, 9])
    eligible = np.array([False, True, True, True, True, True, True, True])
    # Row 0 (key 5) cannot win: row 2 is the first copy that counts, row 5 a duplicate.
    assert later_duplicates(keys, eligible).tolist() == [
        False, False, False, False, True, True, False, True,
    ]  # fmt: skip
    assert later_duplicates(keys).tolist() == [
        False, False, True, False, True, True, False, True,
    ]  # fmt: skip
