"""Stochastic quantisers, unbiased: QSGD and TernGrad (allgather path).

Each element is rounded up or down at random with the probabilities that make
the decode equal to the tensor in expectation. The random draws come from a
:class:`~plait.compression.base.SeedStream`: give a ``seed`` for reproducible
draws (use a different one per rank, e.g. ``seed=1000 + rank``, or the ranks'
rounding errors are correlated), or leave it None for fresh entropy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.adapters import ops_for
from plait.errors import invalid
from plait.protocols import Tensor

from .base import Compressor, Pooled, SeedStream, compute_dtype, prepare, restore

__all__ = ["QSGD", "TernGrad"]

#: Divisor floor: a zero tensor has zero norm and scale.
_TINY = 1e-30


#: QSGD and TernGrad scale by a norm (a maximum) this much too large: the random rounding
#: ``floor(x + u)`` (``u`` uniform in [0, 1), up with probability ``x - floor(x)``, see
#: ``TensorOps.random_round``) then never rounds past the top level, and the decode, by
#: the same norm, stays unbiased.
_WIDEN = 1 + 1e-6


class _ScaledCodes(Pooled, Compressor):
    """A payload of ``[factor (1 element), integer codes]`` that decodes to ``codes *
    factor``. Every rank's decode is summed (and averaged) in two buffers of a pool where
    the framework offers it (torch on the CPU: ``scaled_codes_sum``), with the same
    arithmetic in the same order as decoding each rank's part anew: QSGD's step in
    ``benchmarks/compression.py`` wrote six fresh 43 MB tensors, ~20 ms of page faults each."""

    def _factor(self, scale: Tensor) -> Tensor:
        """What the codes are multiplied by, from the payload's first entry."""
        return scale

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """``codes * factor``, in the original dtype and shape."""
        ops = ops_for(payload[1])
        return restore(ops, ops.cast(payload[1], compute_dtype(ctx.dtype)) * self._factor(payload[0]), ctx)

    def decode_gathered(self, gathered: Sequence[Tensor], counts: Any, ctx: Any,
                        average: bool) -> Tensor:
        ops = ops_for(gathered[1])
        fast = getattr(ops, "scaled_codes_sum", None)
        if fast is None:
            return super().decode_gathered(gathered, counts, ctx, average)
        ranks = len(counts)
        factors = [self._factor(f) for f in ops.split(gathered[0], [int(row[0]) for row in counts])]
        codes = ops.split(gathered[1], [int(row[1]) for row in counts])
        out = fast(codes, factors, compute_dtype(ctx.dtype), ranks if average else 1, self._buffers())
        return restore(ops, out, ctx)


class QSGD(_ScaledCodes):
    """QSGD (Alistarh et al. 2017): ``norm * sign(x) * q / levels``, ``q`` in ``0..levels``.

    Payload: ``[norm (1 element), signed levels]``, the levels as int8 for up to
    127 levels (int16 up to 32767, else int32).

    Args:
        levels: number of quantisation levels ``s`` >= 1.
        seed: base seed of the random rounding, or None.

    Raises:
        ConfigError: for levels < 1 or a bad seed.
    """

    def __init__(self, levels: int = 127, seed: int | None = None) -> None:
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels < 2**31:
            raise invalid("levels", levels, "an int number of quantisation levels >= 1")
        self.levels = levels
        self.seed = seed
        self._seeds = SeedStream(seed)
        self._code = "int8" if levels <= 127 else "int16" if levels <= 32767 else "int32"

    def compress(self, tensor: Tensor, name: str) -> tuple[list[Tensor], Any]:
        """Quantise ``tensor`` to signed levels of its norm.

        Args:
            tensor: a floating tensor.
            name: its name.

        Returns:
            ``([norm, codes], ctx)``.

        Raises:
            PlaitTypeError: for a non-floating tensor.
        """
        ops, flat, ctx = prepare(tensor, name, self)
        norm = ops.clamp_min(ops.norm(flat), _TINY) * _WIDEN
        codes = ops.random_round(flat, self.levels / norm, self._seeds.next(name), self._code)
        return [ops.reshape(norm, [1]), codes], ctx

    def _factor(self, scale: Tensor) -> Tensor:
        """``norm / levels``."""
        return scale / self.levels


class TernGrad(_ScaledCodes):
    """TernGrad (Wen et al. 2017): ``max|x| * sign(x) * b``, ``b ~ Bernoulli(|x| / max|x|)``.

    Payload: ``[scale (1 element), ternary codes as int8]``. (The paper's
    optional gradient clipping is left to the optimiser.)

    Args:
        seed: base seed of the random rounding, or None.

    Raises:
        ConfigError: for a bad seed.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._seeds = SeedStream(seed)

    def compress(self, tensor: Tensor, name: str) -> tuple[list[Tensor], Any]:
        """Quantise ``tensor`` to ``{-1, 0, 1}`` times its largest magnitude.

        Args:
            tensor: a floating tensor.
            name: its name.

        Returns:
            ``([scale, codes], ctx)``.

        Raises:
            PlaitTypeError: for a non-floating tensor.
        """
        ops, flat, ctx = prepare(tensor, name, self)
        dtype = compute_dtype(ctx.dtype)
        mag = ops.abs(flat)
        top = ops.amax(mag) if ctx.numel else ops.zeros([], dtype, flat)
        scale = ops.clamp_min(top, _TINY) * _WIDEN  # as in QSGD: every code stays in {-1, 0, 1}
        codes = ops.random_round(flat, 1 / scale, self._seeds.next(name), "int8")
        return [ops.reshape(scale, [1]), codes], ctx

