"""Horovod's ``horovod.tensorflow.compression`` names (``Compression``, ``Compressor`` and
its subclasses), as on the :mod:`plait.tensorflow` face."""

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
