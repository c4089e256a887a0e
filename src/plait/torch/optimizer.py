"""Horovod's ``horovod.torch.optimizer`` names: the :mod:`plait.torch` face's own objects."""

from __future__ import annotations

from plait.torch import (
    DistributedOptimizer,
)

__all__ = [
    "DistributedOptimizer",
]
