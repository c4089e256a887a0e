"""Fault tolerance: atomic checkpoints written by one rank and restored on every rank.

The core (this package) is framework-free: it moves named byte strings and JSON.
``plait.adapters.torch_ckpt`` and ``plait.adapters.tf_ckpt`` turn a model,
optimizer, RNG states and plait state objects into those bytes and back,
without pickle.
"""

from __future__ import annotations

from .atomic import CheckpointError, Entry, atomic_write, list_complete, read_checkpoint, read_manifest
from .checkpoint import READ_MODES, Checkpoint, codec_for
from .state import ResidualState, Stateful, as_stateful

__all__ = [
    "READ_MODES",
    "Checkpoint",
    "CheckpointError",
    "Entry",
    "ResidualState",
    "Stateful",
    "as_stateful",
    "atomic_write",
    "codec_for",
    "list_complete",
    "read_checkpoint",
    "read_manifest",
]
