"""Horovod's spelling (``Compression.fp16``) and resolving user settings to objects."""

from __future__ import annotations

from typing import Any

from plait.errors import PlaitTypeError, invalid

from .base import Compressor
from .cast import BF16, FP16, NoneCompressor
from .memory import Memory, NoMemory, Residual

__all__ = ["COMPRESSOR_NAMES", "MEMORY_NAMES", "Compression", "check_settings", "resolve_compressor",
           "resolve_memory"]


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

#: Names accepted for ``compression=``.
COMPRESSOR_NAMES = tuple(sorted(_BY_NAME))
#: Names accepted for ``memory=``.
MEMORY_NAMES = ("none", "residual")


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


def _is_memory(obj: Any) -> bool:
    return not isinstance(obj, type) and isinstance(obj, Memory)


def check_settings(compression: Any, memory: Any) -> tuple[Compressor | None, Memory | None]:
    """Validate the ``compression=`` and ``memory=`` of a data-parallel entry point.

    A name gives a new object (never one shared with other users, so that its
    traffic counter is its own). Error feedback needs a lossy compressor: a memory
    with no compressor (or :class:`NoneCompressor`) is an error, not ignored.

    Args:
        compression: None, a :class:`Compressor` or one of :data:`COMPRESSOR_NAMES`.
        memory: None, a :class:`Memory` or one of :data:`MEMORY_NAMES`.

    Returns:
        ``(compressor or None, memory or None)``; None stands for "none".

    Raises:
        ConfigError: for an unknown name, or a memory without a compressor that can use it.
        PlaitTypeError: for a value of any other type (e.g. a class instead of an instance).
    """
    comp: Compressor | None
    if compression is None:
        comp = None
    elif isinstance(compression, str):
        if compression.lower() not in _BY_NAME:
            raise invalid("compression", compression,
                          f"a Compressor object, None or one of {list(COMPRESSOR_NAMES)}")
        comp = None if compression.lower() == "none" else type(_BY_NAME[compression.lower()])()
    elif isinstance(compression, Compressor):
        comp = compression
        if any(compression is c for c in _BY_NAME.values()):  # shared and stateless: a private copy
            comp = type(compression)()
            comp.stats = compression.stats
    else:
        hint = " (an instance, e.g. TopK(0.01), not the class)" if isinstance(compression, type) else ""
        raise PlaitTypeError(
            f"invalid compression={compression!r}: expected a plait.compression.Compressor object"
            f"{hint}, None or one of {list(COMPRESSOR_NAMES)}")
    mem: Memory | None
    if memory is None or (isinstance(memory, str) and memory.lower() == "none"):
        mem = None
    elif isinstance(memory, str):
        if memory.lower() != "residual":
            raise invalid("memory", memory, f"a Memory object, None or one of {list(MEMORY_NAMES)}")
        mem = Residual()
    elif _is_memory(memory):
        mem = memory
    else:
        hint = " (an instance, e.g. Residual(), not the class)" if isinstance(memory, type) else ""
        raise PlaitTypeError(
            f"invalid memory={memory!r}: expected a plait.compression.Memory object{hint}, None or "
            f"one of {list(MEMORY_NAMES)}")
    if mem is not None and not isinstance(mem, NoMemory) and (
            comp is None or isinstance(comp, NoneCompressor)):
        raise invalid("memory", memory,
                      f"None with compression={compression!r}: error feedback returns what a lossy "
                      "compressor dropped, and nothing is dropped; pass a compressor, e.g. "
                      "compression=TopK(0.01), or leave memory out")
    return comp, mem
