"""Horovod's ``horovod.torch.sync_batch_norm`` names: the :mod:`plait.torch` face's own objects."""

from __future__ import annotations

from plait.torch import (
    SyncBatchNorm,
)

__all__ = [
    "SyncBatchNorm",
]
