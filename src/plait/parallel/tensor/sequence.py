"""Ulysses-style sequence parallelism: all-to-all between sequence-sharded and head-sharded layouts.

Outside attention each rank holds a slice of the sequence with every head
(``[B, S/P, H, D]``); attention needs the whole sequence, so one all-to-all
trades the sequence split for a head split (``[B, S, H/P, D]``), each rank runs
ordinary attention on its heads, and the inverse all-to-all returns to the
sequence split. Each exchange is differentiable: its backward is the inverse
exchange. Written once over the communicator's ``alltoall`` and TensorOps
(eager tensors: the communicators' alltoall does not run inside ``tf.function``).
"""

from __future__ import annotations

from plait.adapters import ops_for
from plait.errors import ConfigError
from plait.protocols import Communicator, Tensor

from .mappings import _apply, _axis

__all__ = ["all_to_all", "heads_to_seq", "seq_to_heads"]


def all_to_all(x: Tensor, comm: Communicator, scatter_dim: int, gather_dim: int) -> Tensor:
    """Split ``x`` along ``scatter_dim`` across the group and concatenate what arrives along ``gather_dim``.

    Slice ``i`` of ``scatter_dim`` goes to rank ``i``; rank ``j``'s contribution
    lands at position ``j`` of ``gather_dim``. Not differentiable by itself
    (see :func:`seq_to_heads`).

    Args:
        x: a tensor of the same shape on every rank.
        comm: the sequence-parallel group.
        scatter_dim: the axis to split (divisible by the group size).
        gather_dim: the axis to concatenate along.

    Returns:
        The exchanged tensor.

    Raises:
        ConfigError: when ``scatter_dim`` is not divisible by the group size.
    """
    if comm.size == 1:
        return x
    ops = ops_for(x)
    shape = ops.shape(x)
    s, g, p = _axis(len(shape), scatter_dim), _axis(len(shape), gather_dim), comm.size
    if shape[s] % p:
        raise ConfigError(
            f"invalid tensor dim {scatter_dim} of length {shape[s]}: expected a multiple of the "
            f"sequence-parallel group size {p}")
    send = ops.concat(ops.split(x, [shape[s] // p] * p, axis=s), axis=0)
    received, _ = comm.alltoall(send, [shape[0]] * p)
    return ops.concat(ops.split(received, [shape[0]] * p, axis=0), axis=g)


def seq_to_heads(x: Tensor, comm: Communicator, seq_dim: int = 1, head_dim: int = 2) -> Tensor:
    """``[B, S/P, H, D]`` (sequence split) to ``[B, S, H/P, D]`` (head split), differentiably.

    Args:
        x: this rank's slice of the sequence, all heads.
        comm: the sequence-parallel group.
        seq_dim: the sequence axis.
        head_dim: the head axis (heads divisible by the group size).

    Returns:
        The whole sequence for this rank's heads.
    """
    if comm.size == 1:
        return x
    return _apply(x, lambda t: all_to_all(t, comm, head_dim, seq_dim),
                  lambda g: all_to_all(g, comm, seq_dim, head_dim))


def heads_to_seq(x: Tensor, comm: Communicator, seq_dim: int = 1, head_dim: int = 2) -> Tensor:
    """``[B, S, H/P, D]`` (head split) back to ``[B, S/P, H, D]`` (sequence split), differentiably.

    Args:
        x: the whole sequence for this rank's heads.
        comm: the sequence-parallel group.
        seq_dim: the sequence axis (divisible by the group size).
        head_dim: the head axis.

    Returns:
        This rank's slice of the sequence, all heads.
    """
    if comm.size == 1:
        return x
    return _apply(x, lambda t: all_to_all(t, comm, seq_dim, head_dim),
                  lambda g: all_to_all(g, comm, head_dim, seq_dim))
