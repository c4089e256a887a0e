"""Horovod's ``horovod.torch.functions`` names: the :mod:`plait.torch` face's own objects."""

from __future__ import annotations

from plait.torch import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

__all__ = [
    "allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
]
