"""Which samples each rank reads: disjoint shards, shuffled identically on all ranks."""

from __future__ import annotations

import numpy as np

from plait.errors import invalid

__all__ = ["shard_indices"]


def shard_indices(n: int, rank: int, size: int, *, epoch: int = 0, seed: int = 0,
                  shuffle: bool = True, drop_last: bool = False) -> np.ndarray:
    """Indices of the samples rank ``rank`` of ``size`` reads in ``epoch``.

    All ranks shuffle with the same generator (``seed`` + ``epoch``), then rank
    ``r`` takes every ``size``-th index starting at ``r``, so shards are disjoint
    and cover the data. Without ``drop_last`` the order is padded by wrapping
    around so every rank gets the same number of samples (as torch's
    ``DistributedSampler`` does); with it, the tail is dropped.

    Args:
        n: number of samples.
        rank: this rank.
        size: number of ranks.
        epoch: epoch number (changes the shuffle).
        seed: base seed, the same on all ranks.
        shuffle: shuffle before sharding.
        drop_last: drop the tail instead of padding.

    Returns:
        An int64 array of indices.

    Raises:
        ConfigError: for a negative ``n``, a bad ``size`` or a rank outside it.
    """
    if n < 0:
        raise invalid("n", n, "a number of samples >= 0")
    if size < 1:
        raise invalid("size", size, "a number of ranks >= 1")
    if not 0 <= rank < size:
        raise invalid("rank", rank, f"a rank in [0, {size})")
    order = (np.random.default_rng(seed + epoch).permutation(n) if shuffle
             else np.arange(n)).astype(np.int64)
    if drop_last:
        order = order[: (n // size) * size]
    elif n and n % size:
        per = -(-n // size)
        order = np.resize(order, per * size)
    return order[rank::size]
