"""The exact ``k`` largest elements of a large host array, without a full selection.

``torch.topk`` of 10.8M float32 takes 175 ms here and ``tf.math.top_k`` 153 ms; a
random sample's threshold, then a partition of the few elements above it, takes
about 13 ms. The torch, TensorFlow and numpy adapters share it on host memory.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SAMPLED_MIN", "sample_size", "sampled_topk", "seeded_topk"]

#: The smallest sample :func:`sampled_topk` uses; it samples only arrays of at least 4x
#: as many elements (a plain selection is fast enough below).
SAMPLED_MIN = 1 << 16


def sample_size(n: int, k: int) -> int | None:
    """How many elements to sample for the ``k`` largest of ``n``.

    Args:
        n: elements in the array.
        k: elements wanted.

    Returns:
        The sample size, or None where sampling does not pay (``k`` over an eighth of
        ``n``, or a sample over a quarter of it).
    """
    if not 0 < 8 * k < n:
        return None
    m = max(SAMPLED_MIN, 200 * n // k)
    return m if 4 * m <= n else None


def sampled_topk(a: np.ndarray, k: int, sample: np.ndarray, magnitude: bool = False
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """The exact ``k`` largest of 1-d ``a`` (by ``|a|`` with ``magnitude``).

    The sample gives a threshold that about 1.25 k elements exceed (its ``j``-th
    largest, ``j`` a few standard deviations above the ``m k / n`` expected); if at
    least ``k`` do, every one of the ``k`` largest is among them, and a partition of
    those few gives the answer. Ties at the cut keep the first ones. ``|a|`` is taken
    chunk by chunk (a full-size ``|a|`` of 10.8M float32 costs ~20 ms of page faults).

    Args:
        a: a 1-d float array.
        k: elements wanted, 0 < k < a.size.
        sample: ``m`` random positions into ``a`` (m from :func:`sample_size`).
        magnitude: rank by absolute value.

    Returns:
        ``(values, positions)``, positions int64 in increasing order; None when the
        sample misled (fewer than ``k`` passed its threshold): select otherwise.
    """
    m = sample.size
    expect = m * k / a.size
    j = min(m, int(expect + 6 * expect**0.5 + 8))
    picked = a[sample]
    key = np.abs(picked) if magnitude else picked
    threshold = float(np.partition(key, m - j)[m - j])
    candidates = _at_least(a, threshold, magnitude)
    if candidates.size < k:
        return None
    picked = a[candidates]
    key = np.abs(picked) if magnitude else picked
    cut = np.partition(key, key.size - k)[key.size - k]  # the k-th largest
    chosen = np.flatnonzero(key >= cut)  # in order, as the candidates are
    if chosen.size > k:  # ties at the cut: the first of them
        above = np.flatnonzero(key > cut)
        chosen = np.sort(np.concatenate([above, np.flatnonzero(key == cut)[:k - above.size]]))
    return picked[chosen], candidates[chosen]


def seeded_topk(a: np.ndarray, k: int, magnitude: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`sampled_topk` of a float32/float64 array, sampled by a generator seeded with
    ``(a.size, k)`` (the numpy and TensorFlow adapters; torch samples with its own).

    Args:
        a: a 1-d array.
        k: elements wanted.
        magnitude: rank by absolute value.

    Returns:
        ``(values, positions)``; None for other dtypes, where sampling does not pay, or
        when the sample misled: select otherwise.
    """
    m = sample_size(a.size, k) if a.dtype in (np.float32, np.float64) else None
    if m is None:
        return None
    return sampled_topk(a, k, np.random.default_rng([a.size, k]).integers(0, a.size, m), magnitude)


def _at_least(a: np.ndarray, threshold: float, magnitude: bool, chunk: int = 1 << 18) -> np.ndarray:
    """Positions (int64) of the elements of 1-d ``a`` (or of ``|a|``) >= ``threshold``, in
    order, found chunk by chunk so that the temporaries stay small and reused."""
    parts = [np.flatnonzero((np.abs(c) if magnitude else c) >= threshold) + start
             for start in range(0, a.size, chunk) for c in (a[start:start + chunk],)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)
