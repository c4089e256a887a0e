"""Horovod's ``horovod.tensorflow.functions`` names: the :mod:`plait.tensorflow` face's own objects."""

from __future__ import annotations

from plait.tensorflow import (
    allgather_object,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)

__all__ = [
    "allgather_object", "broadcast_object", "broadcast_object_fn", "broadcast_variables",
]
