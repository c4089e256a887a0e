"""Gradient buckets inside a TensorFlow graph, reduced while backward goes on.

A collective inside a graph on the MPI backend is a host op (``tf.numpy_function``)
that blocks its executor thread until the collective is done. Here each bucket is
two host ops: *start* (the agreement round, then the bucket's allreduce is left in
flight, driven by the communicator's progress thread; it returns a token) and
*finish* (waits for it and returns the reduced bucket). The starts run as soon as
their bucket's gradients exist, in build order (``tf.function`` runs stateful ops
in program order; a TF1 graph chains them), so the bytes of early buckets move while
TensorFlow computes the rest of backward, as Horovod's asynchronous ops do.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from plait.collectives.graph_order import ordered

from plait.parallel.data import GradSpec, plan_buckets
from plait.protocols import Communicator, Handle

from .tensorflow import OPS

__all__ = ["finish_allreduce", "overlapped_reduce", "start_allreduce"]

_HANDLES: dict[int, Handle] = {}
_TOKENS = itertools.count(1)
_LOCK = threading.Lock()


def start_allreduce(comm: Communicator, tensor: Any, op: str, name: str | None) -> tf.Tensor:
    """A host op starting the allreduce of ``tensor``; returns its token (int64 scalar).

    Args:
        comm: the communicator (its ``allreduce_async`` runs on numpy arrays).
        tensor: a symbolic tensor.
        op: the reduction.
        name: the collective's name.

    Returns:
        The token, for :func:`finish_allreduce`.
    """
    def start(a: np.ndarray) -> np.ndarray:
        handle = comm.allreduce_async(a, op, name)  # keeps ``a`` (and its buffer) alive
        with _LOCK:
            token = next(_TOKENS)
            _HANDLES[token] = handle
        return np.array(token, dtype=np.int64)

    return OPS.host_call(ordered(comm, start), [tensor], tf.zeros([], tf.int64))


def finish_allreduce(token: tf.Tensor, like: Any) -> tf.Tensor:
    """A host op waiting for the allreduce of ``token``; returns the reduced tensor.

    Args:
        token: from :func:`start_allreduce`.
        like: the tensor that was reduced (gives the output its dtype and shape).

    Returns:
        The reduced tensor.
    """
    def finish(t: np.ndarray) -> np.ndarray:
        with _LOCK:
            handle = _HANDLES.pop(int(t))
        return np.asarray(handle.wait())

    return OPS.host_call(finish, [token], like)


def overlapped_reduce(comm: Communicator, specs: Sequence[GradSpec], grads: Sequence[Any], op: str,
                      bucket_mb: float, prefix: str = "tfgrad") -> list[Any]:
    """Reduce dense symbolic gradients in fusion buckets (those of
    :func:`~plait.parallel.data.plan_buckets`, named ``{prefix}.{bucket}``), every bucket
    started before any is waited for.

    Args:
        comm: the data-parallel communicator.
        specs: one spec per gradient (names unique).
        grads: the dense gradients, shaped like their specs.
        op: "average" or "sum".
        bucket_mb: fusion bucket size in MiB (0: one gradient per bucket).
        prefix: prefix of the collectives' names.

    Returns:
        The reduced gradients, in the order of ``specs``.
    """
    by_name = {s.name: g for s, g in zip(specs, grads)}
    started = []
    for i, bucket in enumerate(plan_buckets(specs, bucket_mb * 2**20)):
        parts = [by_name[s.name] for s in bucket]
        fused = parts[0] if len(parts) == 1 else tf.concat([tf.reshape(p, [-1]) for p in parts], 0)
        started.append((bucket, fused, start_allreduce(comm, fused, op, f"{prefix}.{i}")))
    out: dict[str, Any] = {}
    for bucket, fused, token in started:
        reduced = finish_allreduce(token, fused)
        pieces = [reduced] if len(bucket) == 1 else tf.split(reduced, [s.numel for s in bucket])
        for spec, piece in zip(bucket, pieces):
            out[spec.name] = tf.reshape(piece, spec.shape)
    return [out[s.name] for s in specs]
