"""Adasum's combination (pure numpy, any number of ranks)."""

from __future__ import annotations

import numpy as np
import pytest
from plait.collectives.adasum import adasum, power_of_two


def test_orthogonal_gradients_add_parallel_ones_average_zero_ones_drop_out():
    eye = np.eye(4, dtype=np.float32)
    np.testing.assert_allclose(adasum(eye), np.ones(4))
    v = np.array([1.0, -2.0, 0.5])
    np.testing.assert_allclose(adasum(np.stack([v * k for k in (1, 2, 3, 4)])), v * 2.5)
    np.testing.assert_array_equal(adasum(np.stack([np.zeros(3), v])), v)


def test_pairs_in_rank_order_and_scale_invariance():
    rows = np.random.default_rng(0).normal(size=(4, 5))
    left, right = adasum(rows[:2]), adasum(rows[2:])
    np.testing.assert_allclose(adasum(rows), adasum(np.stack([left, right])))
    np.testing.assert_allclose(adasum(rows * 1e-30) / 1e-30, adasum(rows), rtol=1e-12)
    assert adasum(rows.astype(np.float16)).dtype == np.float16


@pytest.mark.parametrize("n", [3, 5, 6])
def test_other_counts_raise(n):
    assert not power_of_two(n)
    with pytest.raises(ValueError, match="power-of-two"):
        adasum(np.ones((n, 2)))
