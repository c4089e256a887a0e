"""Gradient buckets inside a TensorFlow graph, reduced while backward goes on.

A collective inside a graph on the MPI backend is a host op (``tf.numpy_function``)
that blocks its executor thread until the collective is done. Here each bucket is
two host ops: *start* (the agreement round, then the bucket's allreduce is left in
flight, driven by the communicator's progress thread; it returns a token) and
*finish* (waits for it and returns the reduced bucket). The starts run as soon as
their bucket's gradients exist, in build order (``tf.function`` runs stateful ops
in program order; a TF1 graph chains them), so the bytes of early buckets move while
TensorFlow computes the rest of backward, as Horovod's asynchronous ops do.

On the MPI backend each traced bucket layout is checked once, as the PyTorch reducer
checks its plans (:class:`~plait.parallel.data.GradientReducer`'s ``check_once``): the
graph's first run starts every bucket with the agreement check; once a run has finished
every bucket, the next run splits a private copy of the communicator without the check
and later runs reduce there, so a bucket's start no longer waits on an executor thread
for the other ranks' agreement round (with one inter-op thread that wait made the ranks
take turns). ``PLAIT_BUCKET_CHECK=always`` checks every run. A rank that called
``join()`` hears of each such run from a notice on the communicator and takes part with
zeros.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from plait.collectives.graph_order import ordered

from plait.errors import MismatchError
from plait.parallel.data import GradSpec, checks_once, plan_buckets, unchecked_copy
from plait.protocols import Communicator, Handle

from .tensorflow import OPS

__all__ = ["finish_allreduce", "overlapped_reduce", "start_allreduce"]

_HANDLES: dict[int, Handle] = {}
_TOKENS = itertools.count(1)
_LOCK = threading.Lock()


class _Layout:
    """The buckets of one traced reduction: where each run starts them (see the module).

    A run whose start ops negotiate their turn (a TF1 ``tf.cond`` branch,
    ``PLAIT_GRAPH_ORDER=negotiate``: graphs that several threads may run at once) always
    starts them on the checked communicator.

    Args:
        comm: the data-parallel communicator.
        names: the buckets' collective names, in start order.
        op: the reduction.
    """

    def __init__(self, comm: Communicator, names: Sequence[str], op: str) -> None:
        self.comm, self.names, self.op = comm, list(names), op
        self.once = getattr(comm, "backend", None) == "mpi" and checks_once(comm)
        self.calls: list[Any] = []  # the start ops' host calls (negotiated ones rule it out)
        self.like: list[tuple[tuple[int, ...], Any]] = []  # each bucket's shape and dtype
        self.fast: Any = None
        self.current: Any = comm
        self.generation = getattr(comm, "generation", 0)
        self.finished, self.complete = 0, False
        self.notice: Handle | None = None
        self.lock = threading.Lock()
        serve = getattr(comm, "serve_joined", None)
        self.join_key = serve(self._joined_step) if self.once and serve is not None else None

    def start(self, index: int, a: np.ndarray) -> Any:
        """Where bucket ``index`` (the array ``a``) starts in this run."""
        if index == 0:
            self._begin()
        if index == len(self.like):
            self.like.append((a.shape, a.dtype))
        return self.current

    def _begin(self) -> None:
        comm = self.comm
        generation = getattr(comm, "generation", 0)
        if generation != self.generation:  # an elastic reset: groups split before it are gone
            self.generation, self.fast, self.complete = generation, None, False
        if (self.fast is None and self.complete and self.once
                and not any(getattr(c, "negotiate", False) for c in self.calls)):
            self.fast = unchecked_copy(comm)  # at the same point of every rank's chain
        self.finished, self.complete = 0, False
        self.current = comm if self.fast is None else self.fast
        if self.fast is not None:
            self.fast.timeout = comm.timeout  # type: ignore[attr-defined]  # the caller's, now
            if self.join_key is not None:
                self.notice = comm.step_notice(self.join_key)  # type: ignore[attr-defined]

    def finished_one(self) -> None:
        """A bucket of this run is reduced; after the last, the run is complete."""
        with self.lock:
            self.finished += 1
            last = self.finished == len(self.names)
            notice, self.notice = (self.notice, None) if last else (None, self.notice)
        if notice is not None:
            notice.wait()
        if last:
            self.complete = True

    def _joined_step(self) -> None:
        """This rank called ``join()``: take part in another rank's run with zeros."""
        if self.fast is None or len(self.like) < len(self.names):
            raise MismatchError(f"{self.comm!r}: another rank ran a traced gradient reduction "
                                "that this rank has not run twice (it joined before)")
        handles = [self.fast.allreduce_async(np.zeros(shape, dtype), self.op, name)
                   for (shape, dtype), name in zip(self.like, self.names)]
        for handle in handles:
            handle.wait()


def start_allreduce(comm: Communicator, tensor: Any, op: str, name: str | None,
                    layout: _Layout | None = None, index: int = 0) -> tf.Tensor:
    """A host op starting the allreduce of ``tensor``; returns its token (int64 scalar).

    Args:
        comm: the communicator (its ``allreduce_async`` runs on numpy arrays).
        tensor: a symbolic tensor.
        op: the reduction.
        name: the collective's name.
        layout: the traced reduction it belongs to (decides where it starts), or None.
        index: its bucket's position in ``layout``.

    Returns:
        The token, for :func:`finish_allreduce`.
    """
    def start(a: np.ndarray) -> np.ndarray:
        target = comm if layout is None else layout.start(index, a)
        handle = target.allreduce_async(a, op, name)  # keeps ``a`` (and its buffer) alive
        with _LOCK:
            token = next(_TOKENS)
            _HANDLES[token] = handle
        return np.array(token, dtype=np.int64)

    call = ordered(comm, start)
    if layout is not None:
        layout.calls.append(call)
    return OPS.host_call(call, [tensor], tf.zeros([], tf.int64))


def finish_allreduce(token: tf.Tensor, like: Any, layout: _Layout | None = None) -> tf.Tensor:
    """A host op waiting for the allreduce of ``token``; returns the reduced tensor.

    Args:
        token: from :func:`start_allreduce`.
        like: the tensor that was reduced (gives the output its dtype and shape).
        layout: the traced reduction it belongs to, or None.

    Returns:
        The reduced tensor.
    """
    def finish(t: np.ndarray) -> np.ndarray:
        with _LOCK:
            handle = _HANDLES.pop(int(t))
        out = np.asarray(handle.wait())
        if layout is not None:
            layout.finished_one()
        return out

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
    buckets = plan_buckets(specs, bucket_mb * 2**20)
    layout = _Layout(comm, [f"{prefix}.{i}" for i in range(len(buckets))], op)
    started = []
    for i, bucket in enumerate(buckets):
        parts = [by_name[s.name] for s in bucket]
        fused = parts[0] if len(parts) == 1 else tf.concat([tf.reshape(p, [-1]) for p in parts], 0)
        started.append((bucket, fused, start_allreduce(comm, fused, op, layout.names[i], layout, i)))
    out: dict[str, Any] = {}
    for bucket, fused, token in started:
        reduced = finish_allreduce(token, fused, layout)
        pieces = [reduced] if len(bucket) == 1 else tf.split(reduced, [s.numel for s in bucket])
        for spec, piece in zip(bucket, pieces):
            out[spec.name] = tf.reshape(piece, spec.shape)
    return [out[s.name] for s in specs]
