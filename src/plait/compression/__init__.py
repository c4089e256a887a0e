"""Gradient compression with error feedback, written once for every framework and backend.

* :mod:`.base` -- the :class:`Compressor` contract, :class:`Exchanger` for compressors
  that run their own collectives.
* :mod:`.memory` -- error feedback: :class:`NoMemory`, :class:`Residual`.
* compressors -- :class:`NoneCompressor`, :class:`FP16`, :class:`BF16` (summable);
  :class:`TopK`, :class:`RandomK`, :class:`Threshold`; :class:`QSGD`, :class:`TernGrad`;
  :class:`SignSGD`, :class:`EFSignSGD`, :class:`OneBit`; :class:`PowerSGD`.
* :func:`compressed_allreduce` -- compensate, compress, update, send, decode.
* :class:`WireStats` -- bytes sent vs. uncompressed bytes.
* :class:`Compression` -- Horovod's names (``Compression.fp16``); :func:`check_settings`
  validates a ``compression=``/``memory=`` pair.

Importing this package imports no framework and no communication library.
"""

from .allreduce import compressed_allreduce, exchange_payload
from .base import Compressor, Context, Exchanger
from .cast import BF16, FP16, NoneCompressor
from .memory import Memory, NoMemory, Residual
from .namespace import (
    COMPRESSOR_NAMES,
    MEMORY_NAMES,
    Compression,
    check_settings,
    resolve_compressor,
    resolve_memory,
)
from .powersgd import PowerSGD
from .quantize import QSGD, TernGrad
from .sign import EFSignSGD, OneBit, SignSGD
from .sparse import RandomK, Threshold, TopK
from .stats import Traffic, WireStats

__all__ = [
    "BF16",
    "COMPRESSOR_NAMES",
    "FP16",
    "MEMORY_NAMES",
    "QSGD",
    "Compression",
    "Compressor",
    "Context",
    "EFSignSGD",
    "Exchanger",
    "Memory",
    "NoMemory",
    "NoneCompressor",
    "OneBit",
    "PowerSGD",
    "RandomK",
    "Residual",
    "SignSGD",
    "TernGrad",
    "Threshold",
    "TopK",
    "Traffic",
    "WireStats",
    "check_settings",
    "compressed_allreduce",
    "exchange_payload",
    "resolve_compressor",
    "resolve_memory",
]
