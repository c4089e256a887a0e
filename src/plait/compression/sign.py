"""One-bit compressors: a sign bit per element, packed 8 to a byte (allgather path).

* :class:`SignSGD` -- signs only; ranks combine by majority vote.
* :class:`EFSignSGD` -- signs scaled by the mean magnitude, for error feedback
  (Karimireddy et al. 2019); ranks combine by a vote weighted by their scales.
* :class:`OneBit` -- 1-bit SGD (Seide et al. 2014): each bit decodes to the mean
  of the positive or of the negative elements.

A zero counts as positive. All three drop most of the tensor's information on
each step: use :class:`~plait.compression.memory.Residual` with EFSignSGD and OneBit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.adapters import ops_for
from plait.protocols import Tensor, TensorOps

from .base import Compressor, Context, compute_dtype, prepare, restore

__all__ = ["EFSignSGD", "OneBit", "SignSGD"]


def _decode(ops: TensorOps, payload: Tensor, ctx: Context, one: Any, zero: Any) -> Tensor:
    """A payload's sign bits as ``one`` (set) / ``zero`` (clear), in the tensor's shape and dtype."""
    return restore(ops, ops.decode_bits(payload, ctx.numel, one, zero, compute_dtype(ctx.dtype)), ctx)


def _vote(decoded: Sequence[Tensor]) -> Tensor:
    """``sign`` of the sum of the decoded tensors (ties give 0)."""
    total = decoded[0]
    for d in decoded[1:]:
        total = total + d
    return ops_for(total).sign(total)


class SignSGD(Compressor):
    """signSGD with majority vote (Bernstein et al. 2018, 2019).

    Payload: ``[packed sign bits]``. Each rank's part decodes to +-1; ranks
    combine by majority vote, ``sign(sum of signs)`` (0 where the vote ties),
    whether or not averaging was asked for.
    """

    def compress(self, tensor: Tensor, name: str) -> tuple[list[Tensor], Any]:
        """Pack the signs of ``tensor``.

        Args:
            tensor: a floating tensor.
            name: its name.

        Returns:
            ``([bits], ctx)``.

        Raises:
            PlaitTypeError: for a non-floating tensor.
        """
        ops, flat, ctx = prepare(tensor, name, self)
        return [ops.packbits(flat >= 0)], ctx

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """+1 for a set bit, -1 otherwise."""
        ops = ops_for(payload[0])
        return _decode(ops, payload[0], ctx, 1.0, -1.0)

    def combine(self, decoded: Sequence[Tensor], average: bool) -> Tensor:
        """Majority vote: ``sign(sum_r decoded_r)``."""
        return _vote(decoded)


class EFSignSGD(Compressor):
    """Scaled sign, ``mean|x| * sign(x)``, meant for error feedback (EF-signSGD).

    Payload: ``[scale (1 element), packed sign bits]``. Ranks combine by a vote
    weighted by their scales, ``sign(sum_r scale_r * sign_r)``, rescaled by the
    ranks' mean scale (their summed scale when not averaging).
    """

    def compress(self, tensor: Tensor, name: str) -> tuple[list[Tensor], Any]:
        """Pack the signs of ``tensor`` with its mean magnitude.

        Args:
            tensor: a floating tensor.
            name: its name.

        Returns:
            ``([scale, bits], ctx)``.

        Raises:
            PlaitTypeError: for a non-floating tensor.
        """
        ops, flat, ctx = prepare(tensor, name, self)
        scale = ops.sum(ops.abs(flat)) / max(ctx.numel, 1)
        return [ops.reshape(scale, [1]), ops.packbits(flat >= 0)], ctx

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """``scale`` for a set bit, ``-scale`` otherwise."""
        ops = ops_for(payload[1])
        return _decode(ops, payload[1], ctx, payload[0], -payload[0])

    def combine(self, decoded: Sequence[Tensor], average: bool) -> Tensor:
        """Scale-weighted vote, times the mean (or summed) scale of the ranks."""
        ops = ops_for(decoded[0])
        n = 1
        for d in ops.shape(decoded[0]):
            n *= d
        if n == 0:
            return decoded[0]
        # every element of a rank's decoded tensor is +-scale: its first one says it
        scales = [ops.reshape(ops.abs(ops.split(ops.reshape(d, [-1]), [1, n - 1])[0]), []) for d in decoded]
        scale = scales[0]
        for s in scales[1:]:
            scale = scale + s
        return _vote(decoded) * (scale / len(decoded) if average else scale)


class OneBit(Compressor):
    """1-bit SGD: a bit per element, decoded to the mean of its sign class.

    Payload: ``[[mean of x >= 0, mean of x < 0], packed sign bits]``.
    """

    def compress(self, tensor: Tensor, name: str) -> tuple[list[Tensor], Any]:
        """Pack the signs of ``tensor`` with the means of its two sign classes.

        Args:
            tensor: a floating tensor.
            name: its name.

        Returns:
            ``([means, bits], ctx)``.

        Raises:
            PlaitTypeError: for a non-floating tensor.
        """
        ops, flat, ctx = prepare(tensor, name, self)
        bits = flat >= 0
        pos = ops.cast(bits, compute_dtype(ctx.dtype))
        count = ops.sum(pos)
        pos_sum = ops.sum(flat * pos)
        pos_mean = pos_sum / ops.clamp_min(count, 1.0)
        neg_mean = (ops.sum(flat) - pos_sum) / ops.clamp_min(ctx.numel - count, 1.0)
        means = ops.concat([ops.reshape(pos_mean, [1]), ops.reshape(neg_mean, [1])])
        return [means, ops.packbits(bits)], ctx

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """The positive mean for a set bit, the negative mean otherwise."""
        ops = ops_for(payload[1])
        pos_mean, neg_mean = ops.split(payload[0], [1, 1])
        return _decode(ops, payload[1], ctx, pos_mean, neg_mean)
