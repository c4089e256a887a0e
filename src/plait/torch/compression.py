"""Horovod's ``horovod.torch.compression`` names (``Compression``, ``Compressor`` and its
subclasses), as on the :mod:`plait.torch` face."""

from __future__ import annotations

from plait._face_compression import (
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
)

__all__ = [
    "Compression", "Compressor", "FP16Compressor", "NoneCompressor",
]
