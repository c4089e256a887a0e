"""Lossless and cast compressors: none, float16, bfloat16 (all summable).

These only change the dtype, so their payloads are summed by an ordinary
allreduce, and they also work on symbolic TensorFlow tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.adapters import ops_for
from plait.errors import PlaitTypeError
from plait.protocols import Tensor

from .base import FLOATS, Compressor, Context, Pooled

__all__ = ["BF16", "FP16", "NoneCompressor"]


class NoneCompressor(Compressor):
    """Send the tensor as it is (any dtype)."""

    summable = True
    graph_safe = True
    elementwise = True

    def compress(self, tensor: Tensor, name: str) -> tuple[list[Tensor], Any]:
        """Return ``([tensor], None)``."""
        return [tensor], None

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Return the only payload entry."""
        return payload[0]


class _Cast(Pooled, Compressor):
    """Send a floating tensor cast to a 16-bit dtype; decode casts back (both casts of a
    torch CPU tensor into pooled buffers, see :class:`~plait.compression.base.Pooled`)."""

    summable = True
    graph_safe = True
    elementwise = True
    wire_dtype = "float16"

    def _cast(self, x: Tensor, dtype: str) -> Tensor:
        ops = ops_for(x)
        pooled = getattr(ops, "cast_pooled", None)
        return ops.cast(x, dtype) if pooled is None else pooled(x, dtype, self._buffers())

    def compress(self, tensor: Tensor, name: str) -> tuple[list[Tensor], Any]:
        """Cast ``tensor`` to the wire dtype.

        Args:
            tensor: a floating tensor.
            name: its name (for errors).

        Returns:
            ``([cast tensor], ctx)``.

        Raises:
            PlaitTypeError: for a non-floating tensor.
        """
        ops = ops_for(tensor)
        dtype = ops.dtype_name(tensor)
        if dtype not in FLOATS:
            raise PlaitTypeError(
                f"cannot compress tensor {name!r} of dtype {dtype} with {type(self).__name__}: "
                f"it compresses floating tensors ({', '.join(FLOATS)})"
            )
        return [self._cast(tensor, self.wire_dtype)], Context((), dtype)

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Cast the payload back to the original dtype."""
        return self._cast(payload[0], ctx.dtype)


class FP16(_Cast):
    """IEEE half precision on the wire (Horovod's ``Compression.fp16``).

    Values beyond +-65504 become infinite; gradients rarely are that large.
    """

    wire_dtype = "float16"


class BF16(_Cast):
    """bfloat16 on the wire: float32's range with 8 bits of mantissa."""

    wire_dtype = "bfloat16"
