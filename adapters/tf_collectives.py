"""TensorFlow forms of plait's collectives that Horovod's TensorFlow API has: grouped
allreduce as one fused collective per dtype, eagerly and inside graphs.

A graph-mode collective on the MPI backend is one host call (a ``tf.numpy_function``),
so a group of N tensors fused into one buffer per dtype is one host call instead of
N, and eagerly one agreement round instead of N.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from plait.protocols import Communicator

from .tensorflow import OPS, unwrap

__all__ = ["fused_allreduce"]


def fused_allreduce(comm: Communicator, tensors: Sequence[Any], op: str,
                    name: str | None = None) -> list[Any]:
    """Allreduce ``tensors`` as one flat buffer per dtype (in order of first appearance).

    Shapes may be unknown inside a graph (sizes are read at run time); 0-d tensors
    stay 0-d.

    Args:
        comm: the communicator.
        tensors: TensorFlow tensors or variables, the same list on every rank.
        op: the reduction ("sum", "average", "min", "max", "product").
        name: base name of the collectives (``{name}.{dtype}``), or None.

    Returns:
        The reduced tensors, in the order of ``tensors``.
    """
    values = [tf.convert_to_tensor(unwrap(t)) for t in tensors]
    groups: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault(OPS.dtype_name(v), []).append(i)
    out: list[Any] = [None] * len(values)
    for dtype, members in groups.items():
        label = None if name is None else f"{name}.{dtype}"
        if len(members) == 1:
            out[members[0]] = comm.allreduce(values[members[0]], op, label)
            continue
        parts = [values[i] for i in members]
        flat = tf.concat([tf.reshape(p, [-1]) for p in parts], axis=0)
        reduced = comm.allreduce(flat, op, label)
        sizes = [int(p.shape.num_elements()) if p.shape.is_fully_defined() else tf.size(p)
                 for p in parts]
        if any(isinstance(s, tf.Tensor) for s in sizes):
            sizes = tf.stack([tf.cast(s, tf.int32) for s in sizes])
        for i, p, piece in zip(members, parts, tf.split(reduced, sizes)):
            shape = p.shape if p.shape.is_fully_defined() else tf.shape(p)
            out[i] = tf.reshape(piece, shape)
    return out
