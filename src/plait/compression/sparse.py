"""Sparsifying compressors: send some elements and their positions.

* :class:`TopK` -- the ``ratio`` largest magnitudes (allgather path).
* :class:`RandomK` -- ``ratio`` of the elements at positions drawn from a seed
  shared by all ranks, so positions agree, only values travel, and the payload
  is summable.
* :class:`Threshold` -- every element whose magnitude exceeds ``tau`` (ragged:
  the count differs between ranks).

Positions travel as int32 (int64 for tensors of 2**31 elements or more).
Sparsifiers lose most of the tensor on each step: use them with
:class:`~plait.compression.memory.Residual` error feedback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.adapters import ops_for
from plait.collectives.pool import BufferPool
from plait.errors import invalid
from plait.protocols import Tensor, TensorOps

from .base import Compressor, Context, Pooled, SeedStream, check_ratio, prepare, restore

__all__ = ["RandomK", "Threshold", "TopK"]


def _count(n: int, ratio: float) -> int:
    """Elements kept out of ``n`` (at least one of a non-empty tensor)."""
    return min(n, max(1, round(n * ratio))) if n else 0


def _index_dtype(n: int) -> str:
    return "int32" if n < 2**31 else "int64"


def _dense(ops: TensorOps, values: Tensor, indices: Tensor, ctx: Context,
           pool: BufferPool | None = None) -> Tensor:
    """``values`` scattered at ``indices`` into zeros of ``ctx``'s shape (into a buffer of
    ``pool`` where the framework offers it)."""
    pooled = getattr(ops, "scatter_pooled", None) if pool is not None else None
    positions = ops.cast(indices, "int64")
    dense = (ops.scatter(positions, values, ctx.numel) if pooled is None
             else pooled(positions, values, ctx.numel, pool))
    return restore(ops, dense, ctx)


class _Positional(Pooled, Compressor):
    """A payload of ``[values, positions]``: every rank's, concatenated, is scattered
    into one dense tensor (duplicate positions add up, in rank order; a pooled one for
    torch CPU tensors, see :class:`~plait.compression.base.Pooled`)."""

    def residual(self, tensor: Tensor, payload: Sequence[Tensor], ctx: Any,
                 inplace: bool = False) -> Tensor:
        """``tensor - decompress(payload, ctx)`` for this rank's own payload, whose values
        are ``tensor``'s own at distinct positions: ``tensor`` with those positions
        zeroed (one pass instead of a dense decode and a subtraction), written into
        ``tensor`` with ``inplace`` where its framework allows. A subclass with its own
        ``compress`` gets the plain difference."""
        if type(self).compress not in (TopK.compress, Threshold.compress):
            return tensor - self.decompress(payload, ctx)
        ops = ops_for(tensor)
        return ops.reshape(ops.zero_at(tensor, ops.cast(payload[1], "int64"), inplace), ctx.shape)

    def decode_gathered(self, gathered: Sequence[Tensor], counts: Any, ctx: Any,
                        average: bool) -> Tensor:
        ops = ops_for(gathered[0])
        values = gathered[0] / len(counts) if average else gathered[0]  # the few sent, not the dense sum
        return _dense(ops, values, gathered[1], ctx, self._buffers())


class TopK(_Positional):
    """Send the ``ratio`` fraction of elements with the largest magnitudes.

    Payload: ``[values, positions]``; decoded into a dense tensor with zeros elsewhere.

    Args:
        ratio: fraction of elements kept, in (0, 1] (at least one element).

    Raises:
        ConfigError: for a ratio outside (0, 1].
    """

    def __init__(self, ratio: float) -> None:
        self.ratio = check_ratio(ratio)

    def compress(self, tensor: Tensor, name: str) -> tuple[list[Tensor], Any]:
        """Select the largest magnitudes.

        Args:
            tensor: a floating tensor.
            name: its name.

        Returns:
            ``([values, positions], ctx)``.

        Raises:
            PlaitTypeError: for a non-floating tensor.
        """
        ops, flat, ctx = prepare(tensor, name, self)
        values, idx = ops.topk(flat, _count(ctx.numel, self.ratio), magnitude=True)
        return [values, ops.cast(idx, _index_dtype(ctx.numel))], ctx

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Scatter the values to their positions in a zero tensor."""
        return _dense(ops_for(payload[0]), payload[0], payload[1], ctx, self._buffers())


class RandomK(Pooled, Compressor):
    """Send the ``ratio`` fraction of elements at random positions that all ranks share.

    Positions are drawn from ``(seed, name, step)``, so every rank picks the same
    ones (as in GRACE's RandomK) and only the values cross the wire, summed by an
    allreduce. All ranks must therefore use the same ``seed`` and compress each
    name the same number of times. With ``unbiased`` the values are scaled by
    ``n / k`` so that the decode equals the tensor in expectation; without, the
    decode is the plain selection (better with error feedback).

    Args:
        ratio: fraction of elements sent, in (0, 1].
        seed: non-negative int, equal on every rank.
        unbiased: scale by ``n / k``.

    Raises:
        ConfigError: for a ratio outside (0, 1] or a bad seed.
    """

    summable = True

    def __init__(self, ratio: float, seed: int = 0, unbiased: bool = True) -> None:
        self.ratio = check_ratio(ratio)
        if seed is None:
            raise invalid("seed", seed, "an int equal on every rank (RandomK's positions must agree)")
        self._seeds = SeedStream(seed)
        self.seed = seed
        self.unbiased = bool(unbiased)

    def compress(self, tensor: Tensor, name: str) -> tuple[list[Tensor], Any]:
        """Pick this step's positions for ``name`` and send the values there.

        Args:
            tensor: a floating tensor.
            name: its name (part of the positions' seed).

        Returns:
            ``([values], ctx)``; ctx holds the positions.

        Raises:
            PlaitTypeError: for a non-floating tensor.
        """
        ops, flat, ctx = prepare(tensor, name, self)
        n = ctx.numel
        k = _count(n, self.ratio)
        seed = self._seeds.next(name)
        choose = getattr(ops, "choose", None)  # numpy and torch: k positions drawn directly
        idx = (choose(n, k, seed, flat) if choose is not None
               else ops.topk(ops.uniform([n], seed, flat), k)[1])
        values = ops.gather(flat, idx)
        if self.unbiased and k < n:
            values = values * (n / k)
        return [values], Context(ctx.shape, ctx.dtype, idx)

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Scatter the (possibly summed) values to the shared positions."""
        return _dense(ops_for(payload[0]), payload[0], ctx.extra, ctx, self._buffers())


class Threshold(_Positional):
    """Send every element whose magnitude is above ``tau`` (a varying count).

    Args:
        tau: magnitude threshold, >= 0 (0 sends every non-zero element).

    Raises:
        ConfigError: for a negative or non-numeric tau.
    """

    ragged = True

    def __init__(self, tau: float) -> None:
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau >= 0:
            raise invalid("tau", tau, "a magnitude threshold >= 0")
        self.tau = float(tau)

    def compress(self, tensor: Tensor, name: str) -> tuple[list[Tensor], Any]:
        """Select the elements above the threshold.

        Args:
            tensor: a floating tensor.
            name: its name.

        Returns:
            ``([values, positions], ctx)`` (both possibly empty).

        Raises:
            PlaitTypeError: for a non-floating tensor.
        """
        ops, flat, ctx = prepare(tensor, name, self)
        idx = ops.nonzero(ops.abs(flat) > self.tau)
        return [ops.gather(flat, idx), ops.cast(idx, _index_dtype(ctx.numel))], ctx

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Scatter the values to their positions in a zero tensor."""
        return _dense(ops_for(payload[0]), payload[0], payload[1], ctx, self._buffers())
