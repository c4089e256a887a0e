"""Horovod's ``horovod.tensorflow.sync_batch_norm`` names: the :mod:`plait.tensorflow` face's own objects."""

from __future__ import annotations

from plait.tensorflow import (
    SyncBatchNormalization,
)

__all__ = [
    "SyncBatchNormalization",
]
