"""Exact stage partitioning and batch/balance validation (pure, fast)."""

from __future__ import annotations

import itertools
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.parallel.pipeline import (
    PartitionError,
    PipelineError,
    PipelineTypeError,
    balance_by_cost,
    check_balance,
    check_microbatches,
    partition_sizes_to_bounds,
    stage_costs,
)


def prefix_sums(costs: list[float]) -> list[float]:
    out = [0.0]
    for c in costs:
        out.append(out[-1] + c)
    return out


def largest(costs: list[float], sizes: list[int]) -> float:
    pre = prefix_sums(costs)
    return max(pre[b] - pre[a] for a, b in partition_sizes_to_bounds(sizes))


def brute_force(costs: list[float], stages: int) -> tuple[float, list[int]]:
    """Optimal largest stage sum, and the lexicographically smallest optimal sizes."""
    n = len(costs)
    best: tuple[float, list[int]] | None = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = (0, *cuts, n)
        sizes = [edges[i + 1] - edges[i] for i in range(stages)]
        cand = (largest(costs, sizes), sizes)
        if best is None or cand < best:
            best = cand
    assert best is not None
    return best


@st.composite
def cases(draw: st.DrawFn, floats: bool) -> tuple[list[float], int]:
    n = draw(st.integers(1, 9))
    if floats:
        elem = st.floats(0, 100, allow_nan=False, allow_infinity=False)
    else:
        elem = st.integers(0, 12).map(float)
    costs = draw(st.lists(elem, min_size=n, max_size=n))
    return costs, draw(st.integers(1, n))


@settings(max_examples=300, deadline=None)
@given(cases(floats=False))
def test_optimal_and_tie_break_match_brute_force(case: tuple[list[float], int]) -> None:
    costs, stages = case
    sizes = balance_by_cost(costs, stages)
    assert (largest(costs, sizes), sizes) == brute_force(costs, stages)


@settings(max_examples=200, deadline=None)
@given(cases(floats=True))
def test_optimal_for_float_costs(case: tuple[list[float], int]) -> None:
    costs, stages = case
    sizes = balance_by_cost(costs, stages)
    assert len(sizes) == stages and all(s >= 1 for s in sizes) and sum(sizes) == len(costs)
    assert largest(costs, sizes) == brute_force(costs, stages)[0]


def test_examples() -> None:
    assert balance_by_cost([1, 1, 1, 1], 2) == [2, 2]
    assert balance_by_cost([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balance_by_cost([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == [5, 2, 2]  # 15 | 13 | 17
    assert balance_by_cost([0, 0, 7], 2) == [1, 2]
    assert balance_by_cost([3], 1) == [1]
    assert balance_by_cost([2, 2, 2], 3) == [1, 1, 1]
    assert balance_by_cost([0.5, 0.25, 0.25], 2) == [1, 2]


def test_large_is_fast() -> None:
    rng = random.Random(0)
    costs = [rng.random() for _ in range(3000)]
    start = time.perf_counter()
    sizes = balance_by_cost(costs, 64)
    assert time.perf_counter() - start < 2.0
    assert len(sizes) == 64 and sum(sizes) == 3000
    per_stage = stage_costs(costs, sizes)
    # no worse than the trivial lower bound by more than one layer's cost
    assert max(per_stage) <= sum(costs) / 64 + max(costs)


def test_bounds_and_stage_costs() -> None:
    assert partition_sizes_to_bounds([2, 3, 1]) == [(0, 2), (2, 5), (5, 6)]
    assert stage_costs([1, 2, 3, 4], [1, 3]) == [1.0, 9.0]


def test_balance_errors() -> None:
    with pytest.raises(PartitionError, match="stages must be an integer >= 1, got 0"):
        balance_by_cost([1, 2], 0)
    with pytest.raises(PartitionError, match=r"at most the number of layers \(2\).*stages=3"):
        balance_by_cost([1, 2], 3)
    with pytest.raises(PartitionError, match="empty"):
        balance_by_cost([], 1)
    with pytest.raises(PartitionError, match=r"costs\[1\] must be a non-negative finite number"):
        balance_by_cost([1, -2], 1)
    with pytest.raises(PartitionError, match=r"costs\[0\]"):
        balance_by_cost([float("nan")], 1)
    with pytest.raises(PipelineTypeError, match=r"costs\[0\]"):
        balance_by_cost(["1"], 1)  # type: ignore[list-item]
    with pytest.raises(PipelineTypeError, match="stages"):
        balance_by_cost([1, 2], 1.5)  # type: ignore[arg-type]


def test_check_balance() -> None:
    assert check_balance([2, 3], 5) == [2, 3]
    assert check_balance((1, 1, 1), 3, stages=3) == [1, 1, 1]
    with pytest.raises(PartitionError, match=r"sum to the number of layers \(6\).*sums to 5"):
        check_balance([2, 3], 6)
    with pytest.raises(PartitionError, match=r"balance\[1\] must be an integer >= 1, got 0"):
        check_balance([5, 0], 5)
    with pytest.raises(PartitionError, match=r"one entry per stage \(3\), got 2"):
        check_balance([2, 3], 5, stages=3)
    with pytest.raises(PartitionError, match="at least one stage"):
        check_balance([], 5)
    with pytest.raises(PipelineTypeError):
        check_balance("23", 5)  # type: ignore[arg-type]
    with pytest.raises(PartitionError, match=r"sizes\[0\]"):
        partition_sizes_to_bounds([0, 2])


def test_check_microbatches() -> None:
    assert check_microbatches(32, 4) == 8
    assert check_microbatches(7, 7) == 1
    with pytest.raises(PartitionError, match="divide batch_size=12, got microbatches=5; "
                       "valid values: 1, 2, 3, 4, 6, 12"):
        check_microbatches(12, 5)
    with pytest.raises(PartitionError, match="valid values: 1, 3"):
        check_microbatches(3, 4)
    with pytest.raises(PartitionError, match="microbatches must be an integer >= 1, got 0"):
        check_microbatches(8, 0)
    with pytest.raises(PipelineTypeError, match="batch_size"):
        check_microbatches(8.0, 2)  # type: ignore[arg-type]
    assert issubclass(PartitionError, PipelineError) and issubclass(PartitionError, ValueError)
