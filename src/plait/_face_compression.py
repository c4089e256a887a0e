"""Horovod's compressor interface for the faces: ``hvd.Compression.fp16.compress(t)``
returns ``(tensor, ctx)`` and ``decompress(tensor, ctx)`` undoes it, and a user's
subclass of ``hvd.Compressor`` works wherever a face takes ``compression=``.

Horovod's compressors are classes with static methods (``Compression.fp16`` is the
class ``FP16Compressor``); an allreduce sums their outputs. :func:`to_plait` turns
one into a plait :class:`~plait.compression.Compressor` (one payload tensor,
summable), and leaves plait compressors as they are. Framework-free: casts go
through the tensor's adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .compression import Compressor as PlaitCompressor
from .compression import NoneCompressor as PlaitNone

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor",
           "to_plait"]

_FLOATS = ("float16", "bfloat16", "float32", "float64")


def _dtype_name(dtype: Any) -> str:
    """``"float32"`` for ``torch.float32``, ``tf.float32``, a numpy dtype or a Keras string."""
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]


class Compressor:
    """Horovod's compressor interface: override both static methods.

    ``compress`` runs on every rank before the allreduce and ``decompress`` after it;
    the allreduce sums what ``compress`` returned, so the result must stay summable.
    """

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Encode ``tensor``.

        Args:
            tensor: the tensor to send.

        Returns:
            ``(tensor to send, ctx)``; ``ctx`` stays on this rank.
        """
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Decode a (reduced) tensor.

        Args:
            tensor: what the allreduce returned.
            ctx: the context ``compress`` returned on this rank.

        Returns:
            The decoded tensor.
        """
        return tensor


class NoneCompressor(Compressor):
    """Send tensors as they are (Horovod's ``Compression.none``)."""


class _CastCompressor(Compressor):
    """Floating tensors cross the wire as ``wire``; other dtypes pass unchanged (as in Horovod)."""

    wire = "float16"

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:  # type: ignore[override]
        """Cast a floating ``tensor`` to the wire dtype.

        Args:
            tensor: a torch or TensorFlow tensor.

        Returns:
            ``(cast tensor, original dtype)``; integer tensors come back unchanged.
        """
        from plait.adapters import ops_for

        ops = ops_for(tensor)
        if ops.dtype_name(tensor) in _FLOATS:
            return ops.cast(tensor, cls.wire), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Cast back to the dtype ``compress`` saw.

        Args:
            tensor: the reduced tensor.
            ctx: the original dtype.

        Returns:
            The tensor in its original dtype.
        """
        from plait.adapters import ops_for

        name = _dtype_name(ctx)
        return ops_for(tensor).cast(tensor, name) if name in _FLOATS else tensor


class FP16Compressor(_CastCompressor):
    """float16 on the wire (Horovod's ``Compression.fp16``)."""

    wire = "float16"


class BF16Compressor(_CastCompressor):
    """bfloat16 on the wire (plait's addition; Horovod 0.28 has no bf16 compressor)."""

    wire = "bfloat16"


class Compression:
    """Horovod's ``hvd.Compression``: ``none`` and ``fp16`` (plait adds ``bf16``).

    Plait's own compressors (``plait.compression.TopK(0.01)``, ...) are accepted
    wherever these are.
    """

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


class _Horovodish(PlaitCompressor):
    """A plait compressor that runs a Horovod-style one: one payload tensor, summed."""

    summable = True
    graph_safe = True

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        inner = self.inner if isinstance(self.inner, type) else type(self.inner)
        return f"<Horovod compressor {inner.__name__}>"

    def compress(self, tensor: Any, name: str) -> tuple[list[Any], Any]:
        out, ctx = self.inner.compress(tensor)
        return [out], ctx

    def decompress(self, payload: Sequence[Any], ctx: Any) -> Any:
        return self.inner.decompress(payload[0], ctx)


def _horovod_style(obj: Any) -> bool:
    kind = obj if isinstance(obj, type) else type(obj)
    return issubclass(kind, Compressor)


def to_plait(compression: Any) -> Any:
    """A face's ``compression=`` as plait understands it.

    Args:
        compression: a Horovod-style compressor (class or instance, e.g.
            ``hvd.Compression.fp16`` or a user's ``hvd.Compressor`` subclass), a plait
            compressor, a name, or None.

    Returns:
        A plait compressor (``plait.compression.NoneCompressor`` for Horovod's none),
        or ``compression`` unchanged when it is not Horovod-style.
    """
    if compression is None or not _horovod_style(compression):
        return compression
    kind = compression if isinstance(compression, type) else type(compression)
    if kind is NoneCompressor:
        return PlaitNone()
    return _Horovodish(compression)
