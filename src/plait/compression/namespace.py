"""Horovod's spelling (``Compression.fp16``) and resolving user settings to objects."""

from __future__ import annotations

from plait.errors import invalid

from .base import Compressor
from .cast import BF16, FP16, NoneCompressor
from .memory import Memory, NoMemory, Residual

__all__ = ["Compression", "resolve_compressor", "resolve_memory"]


class Compression:
    """Ready-made compressors under Horovod's names: ``compression=Compression.fp16``.

    Attributes:
        none: send tensors as they are.
        fp16: float16 on the wire.
        bf16: bfloat16 on the wire.
    """

    none: Compressor = NoneCompressor()
    fp16: Compressor = FP16()
    bf16: Compressor = BF16()


_BY_NAME = {"none": Compression.none, "fp16": Compression.fp16, "bf16": Compression.bf16}


def resolve_compressor(spec: Compressor | str | None) -> Compressor:
    """Turn a ``compression=`` setting into a compressor.

    Args:
        spec: a :class:`Compressor`, None, or one of "none", "fp16", "bf16".

    Returns:
        The compressor (``Compression.none`` for None).

    Raises:
        ConfigError: for anything else.
    """
    if spec is None:
        return Compression.none
    if isinstance(spec, str) and spec.lower() in _BY_NAME:
        return _BY_NAME[spec.lower()]
    if isinstance(spec, Compressor):
        return spec
    raise invalid("compression", spec, f"a Compressor object, None or one of {sorted(_BY_NAME)}")


def resolve_memory(spec: Memory | str | None) -> Memory:
    """Turn a ``memory=`` setting into an error-feedback memory.

    Args:
        spec: a :class:`Memory`, None/"none" (no feedback) or "residual".

    Returns:
        A memory object (a new one for a name).

    Raises:
        ConfigError: for anything else.
    """
    if spec is None or spec == "none":
        return NoMemory()
    if spec == "residual":
        return Residual()
    if isinstance(spec, Memory):
        return spec
    raise invalid("memory", spec, "a Memory object, None, 'none' or 'residual'")
