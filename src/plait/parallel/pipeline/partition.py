"""Splitting a model into pipeline stages and a batch into micro-batches.

All checks here run before any communication, so an impossible split fails
with the same clear error on every rank instead of a hang.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from .._checks import check_int
from .errors import PartitionError, PipelineTypeError

__all__ = [
    "balance_by_cost",
    "check_balance",
    "check_microbatches",
    "partition_sizes_to_bounds",
    "stage_costs",
]


def _check_costs(costs: object) -> list[float]:
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):
        raise PipelineTypeError(
            f"costs must be a sequence of non-negative numbers, one per layer, "
            f"got {type(costs).__name__}"
        )
    if len(costs) == 0:
        raise PartitionError("costs must have one entry per layer, got an empty sequence")
    out = []
    for i, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, (int, float)):
            raise PipelineTypeError(
                f"costs[{i}] must be a non-negative finite number, got {c!r} "
                f"of type {type(c).__name__}"
            )
        if not math.isfinite(c) or c < 0:
            raise PartitionError(f"costs[{i}] must be a non-negative finite number, got {c!r}")
        out.append(float(c))
    return out


def _check_stages(stages: object, layers: int) -> int:
    k = check_int(
        "stages", stages, minimum=1, value_error=PartitionError, type_error=PipelineTypeError
    )
    if k > layers:
        raise PartitionError(
            f"stages must be at most the number of layers ({layers}) so that every stage "
            f"gets a layer, got stages={k}"
        )
    return k


def _fits(prefix: list[float], start: int, parts: int, bound: float) -> bool:
    """Whether layers ``start:`` split greedily into ``<= parts`` parts each ``<= bound``."""
    n = len(prefix) - 1
    i = start
    for _ in range(parts):
        # Furthest end j with prefix[j] - prefix[i] <= bound.
        j = bisect.bisect_right(prefix, prefix[i] + bound, lo=i) - 1
        # bisect compares prefix[j] with prefix[i] + bound; fix any rounding so
        # that the test is exactly prefix[j] - prefix[i] <= bound, as elsewhere.
        while j > i and prefix[j] - prefix[i] > bound:
            j -= 1
        while j < n and prefix[j + 1] - prefix[i] <= bound:
            j += 1
        if j == i:
            return False
        i = j
        if i == n:
            return True
    return False


def _bottleneck(prefix: list[float], start: int, parts: int) -> float:
    """Smallest possible largest part of layers ``start:`` split into ``parts`` parts.

    Nicol's exact probe-based recursion: find the shortest first part whose
    sum is itself a feasible bound; the optimum is that sum or is reached with
    the first part one layer shorter.
    """
    n = len(prefix) - 1
    best = math.inf
    lo_bound = -math.inf
    while True:
        if parts == 1:
            return min(best, max(lo_bound, prefix[n] - prefix[start]))
        # Smallest end j in (start, n] with _fits(sum(start:j)).
        lo, hi = start + 1, n
        while lo < hi:
            mid = (lo + hi) // 2
            if _fits(prefix, start, parts, prefix[mid] - prefix[start]):
                hi = mid
            else:
                lo = mid + 1
        best = min(best, max(lo_bound, prefix[lo] - prefix[start]))
        if lo - 1 == start:
            return best
        # Otherwise the first part ends at lo - 1 and the rest decides.
        lo_bound = max(lo_bound, prefix[lo - 1] - prefix[start])
        start, parts = lo - 1, parts - 1


def balance_by_cost(costs: Sequence[float], stages: int) -> list[int]:
    """Split layers into contiguous stages minimising the largest stage cost.

    The result is exact: no contiguous split into ``stages`` non-empty parts
    has a smaller maximum part sum (sums are taken as differences of prefix
    sums). Among the optimal splits, the one whose list of sizes is
    lexicographically smallest is returned, i.e. each stage in turn takes as
    few layers as it can; this leaves slack to the later stages, which hold
    fewer in-flight micro-batches under 1F1B.

    Args:
        costs: Non-negative cost per layer (parameter count, measured time).
        stages: Number of stages, ``1 <= stages <= len(costs)``.

    Returns:
        Number of layers in each stage; positive, summing to ``len(costs)``.

    Raises:
        PipelineTypeError: ``costs`` is not a sequence of numbers or
            ``stages`` is not an integer.
        PartitionError: ``costs`` is empty or has a negative or non-finite
            entry, or ``stages`` is outside ``1..len(costs)``.
    """
    values = _check_costs(costs)
    n = len(values)
    k = _check_stages(stages, n)
    prefix = [0.0]
    for c in values:
        prefix.append(prefix[-1] + c)
    bound = _bottleneck(prefix, 0, k)

    # min_parts[p]: fewest parts (each <= bound) covering layers p:, found by
    # greedy from the right; it is non-increasing in p.
    min_parts = [0] * (n + 1)
    end, count = n, 0
    for p in range(n - 1, -1, -1):
        if prefix[end] - prefix[p] > bound:
            end, count = p + 1, count + 1
        min_parts[p] = count + 1

    sizes = []
    start = 0
    for remaining in range(k - 1, 0, -1):
        # Fewest layers for this stage that leave a feasible rest.
        size = 1
        while min_parts[start + size] > remaining:
            size += 1
        sizes.append(size)
        start += size
    sizes.append(n - start)
    return sizes


def check_balance(balance: Sequence[int], layers: int, stages: int | None = None) -> list[int]:
    """Validate an explicit ``balance`` (layers per stage) before it is used.

    Args:
        balance: Number of layers of each stage.
        layers: Number of layers of the model.
        stages: Expected number of stages, or ``None`` for ``len(balance)``.

    Returns:
        ``balance`` as a list of ints.

    Raises:
        PipelineTypeError: ``balance`` is not a sequence of integers.
        PartitionError: An entry is below 1, the entries do not sum to
            ``layers``, or ``len(balance) != stages``.
    """
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise PipelineTypeError(
            f"balance must be a sequence of positive integers (layers per stage), "
            f"got {type(balance).__name__}"
        )
    n = check_int(
        "layers", layers, minimum=1, value_error=PartitionError, type_error=PipelineTypeError
    )
    out = [
        check_int(
            f"balance[{i}]", b, minimum=1,
            value_error=PartitionError, type_error=PipelineTypeError,
        )
        for i, b in enumerate(balance)
    ]
    if stages is not None:
        k = check_int(
            "stages", stages, minimum=1, value_error=PartitionError, type_error=PipelineTypeError
        )
        if len(out) != k:
            raise PartitionError(
                f"balance must have one entry per stage ({k}), got {len(out)} entries: {out}"
            )
    if not out:
        raise PartitionError("balance must have at least one stage, got []")
    if sum(out) != n:
        raise PartitionError(
            f"balance must sum to the number of layers ({n}), got {out} which sums to {sum(out)}"
        )
    return out


def partition_sizes_to_bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Turn stage sizes into half-open layer ranges.

    Args:
        sizes: Number of layers of each stage, e.g. ``[2, 3]``.

    Returns:
        ``(start, stop)`` per stage, e.g. ``[(0, 2), (2, 5)]``.

    Raises:
        PipelineTypeError: ``sizes`` is not a sequence of integers.
        PartitionError: ``sizes`` is empty or has an entry below 1.
    """
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise PipelineTypeError(
            f"sizes must be a sequence of positive integers, got {type(sizes).__name__}"
        )
    if len(sizes) == 0:
        raise PartitionError("sizes must have at least one stage, got []")
    bounds = []
    start = 0
    for i, s in enumerate(sizes):
        size = check_int(
            f"sizes[{i}]", s, minimum=1, value_error=PartitionError, type_error=PipelineTypeError
        )
        bounds.append((start, start + size))
        start += size
    return bounds


def stage_costs(costs: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """Sum the per-layer costs of each stage.

    Args:
        costs: Non-negative cost per layer.
        sizes: Number of layers of each stage; must sum to ``len(costs)``.

    Returns:
        The cost of each stage.

    Raises:
        PipelineTypeError: An argument has the wrong type.
        PartitionError: Bad costs, or sizes that do not cover the layers.
    """
    values = _check_costs(costs)
    check_balance(sizes, len(values))
    return [math.fsum(values[a:b]) for a, b in partition_sizes_to_bounds(sizes)]


def check_microbatches(batch_size: int, microbatches: int) -> int:
    """Check that a batch splits evenly into micro-batches.

    Args:
        batch_size: Samples per step on this pipeline, ``>= 1``.
        microbatches: Number of micro-batches, ``>= 1``.

    Returns:
        The micro-batch size ``batch_size // microbatches``.

    Raises:
        PipelineTypeError: An argument is not an integer.
        PartitionError: An argument is below 1, ``microbatches > batch_size``
            or ``batch_size`` is not divisible by ``microbatches``; the error
            lists the valid micro-batch counts.
    """
    b = check_int(
        "batch_size", batch_size, minimum=1,
        value_error=PartitionError, type_error=PipelineTypeError,
    )
    m = check_int(
        "microbatches", microbatches, minimum=1,
        value_error=PartitionError, type_error=PipelineTypeError,
    )
    if b % m != 0:
        divisors = [d for d in range(1, b + 1) if b % d == 0]
        shown = ", ".join(map(str, divisors[:16])) + (", ..." if len(divisors) > 16 else "")
        raise PartitionError(
            f"microbatches must divide batch_size={b}, got microbatches={m}; "
            f"valid values: {shown}"
        )
    return b // m
