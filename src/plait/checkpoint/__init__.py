"""Fault tolerance: atomic checkpoints written by one rank and restored on every rank.

The core (this package) is framework-free: it moves named byte strings and JSON.
``plait.adapters.torch_ckpt`` and ``plait.adapters.tf_ckpt`` turn a model,
optimizer, RNG states and plait state objects into those bytes and back,
without pickle. State that differs per rank (error-feedback memories,
asynchronous replicas and parameter servers) is saved for every rank.
"""

from __future__ import annotations

from .atomic import CheckpointError, Entry, atomic_write, list_complete, read_checkpoint, read_manifest
from .checkpoint import (
    ASYNC_STATE,
    READ_MODES,
    AlgorithmState,
    Checkpoint,
    ServerSnapshot,
    async_algorithm,
    codec_for,
)
from .state import ResidualState, Stateful, as_stateful, is_per_rank

__all__ = [
    "ASYNC_STATE",
    "READ_MODES",
    "AlgorithmState",
    "Checkpoint",
    "CheckpointError",
    "Entry",
    "ResidualState",
    "ServerSnapshot",
    "Stateful",
    "as_stateful",
    "async_algorithm",
    "is_per_rank",
    "atomic_write",
    "codec_for",
    "list_complete",
    "read_checkpoint",
    "read_manifest",
]
