"""TensorFlow forms of plait's collectives that Horovod's TensorFlow API has: grouped
allreduce as one fused collective per dtype, eagerly and inside graphs.

A graph-mode collective on the MPI backend is one host call (a ``tf.numpy_function``),
so a group of N tensors fused into one buffer per dtype is one host call instead of
N, and eagerly one agreement round instead of N.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from plait.protocols import Communicator

from .tensorflow import OPS, unwrap

__all__ = ["allgather_backward", "alltoall", "check_sparse", "differentiable",
           "differentiable_group", "fused_allreduce", "group_size", "is_sparse", "sparse_allreduce",
           "to_dense"]


def group_size(comm: Communicator, dtype: Any = tf.int32) -> Any:
    """``comm.size`` as a divisor: an int, or, in a graph being traced by a worker of a
    Horovod elastic job, an op that reads the size each time the graph runs.

    Such a graph keeps running after workers joined or left (Horovod's elastic loop does
    not trace it again), so a size read at trace time would be stale; Horovod reads it
    with its ``size_op`` there too (``HOROVOD_ELASTIC``).

    Args:
        comm: the communicator.
        dtype: the op's dtype (it divides tensors of this dtype).

    Returns:
        An int, or a 0-d tensor of ``dtype``.
    """
    live = getattr(comm, "live_size", None)
    if live is None or os.environ.get("HOROVOD_ELASTIC") != "1" or tf.executing_eagerly():
        return comm.size
    return tf.cast(live(), dtype)


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


def differentiable(forward: Callable[[Any], Any], backward: Callable[..., Any], tensor: Any) -> Any:
    """``forward(tensor)`` with ``backward`` as its registered gradient (Horovod registers
    one for each of its TensorFlow collectives), eagerly and inside graphs.

    Args:
        forward: the collective, of one tensor; may return a tensor or a tuple of them.
        backward: the gradient: takes the upstream gradient of each output, returns
            the gradient of ``tensor``.
        tensor: a TensorFlow tensor or (Keras) variable.

    Returns:
        What ``forward`` returns (integer inputs: no gradient, ``forward`` alone).
    """
    value = tf.convert_to_tensor(unwrap(tensor))
    if not (value.dtype.is_floating or value.dtype.is_complex):
        return forward(value)

    @tf.custom_gradient
    def apply(x: tf.Tensor) -> Any:
        return forward(x), backward

    return apply(value)


def differentiable_group(forward: Callable[[list[Any]], list[Any]],
                         backward: Callable[[list[Any]], list[Any]],
                         tensors: Sequence[Any]) -> list[Any]:
    """:func:`differentiable` for a group: ``forward`` maps a list of tensors to a list
    of outputs, ``backward`` the outputs' upstream gradients (zeros where an output is
    not used) to the inputs' gradients (integer inputs get none).

    Args:
        forward: the grouped collective.
        backward: its gradient.
        tensors: TensorFlow tensors or (Keras) variables.

    Returns:
        What ``forward`` returns.
    """
    values = [tf.convert_to_tensor(unwrap(t)) for t in tensors]
    if not any(v.dtype.is_floating or v.dtype.is_complex for v in values):
        return forward(values)

    @tf.custom_gradient
    def apply(*xs: tf.Tensor) -> Any:
        outs = forward(list(xs))

        def grad(*dys: Any) -> list[Any]:
            ups = [tf.zeros_like(o) if d is None else d for d, o in zip(dys, outs)]
            grads = backward(ups)
            return [g if (x.dtype.is_floating or x.dtype.is_complex) else None
                    for g, x in zip(grads, xs)]

        return outs, grad

    return list(apply(*values))


def allgather_backward(comm: Communicator, tensor: Any, name: str | None = None
                       ) -> Callable[[Any], Any]:
    """Horovod's allgather gradient: average the upstream gradient over ranks and keep
    this rank's rows (every rank's row count is allgathered).

    Args:
        comm: the communicator of the allgather.
        tensor: its input.
        name: its name (the gradient's collectives get ``{name}/grad...``).

    Returns:
        The gradient function.
    """
    def backward(dy: Any) -> Any:
        label = None if name is None else f"{name}/grad"
        rows = tf.reshape(tf.shape(unwrap(tensor), out_type=tf.int32)[0], [1])
        g = comm.allreduce(dy, "average", label)
        sizes = tf.reshape(comm.allgather(rows, None if label is None else f"{label}.rows"),
                           [comm.size])
        return tf.split(g, sizes, num=comm.size, axis=0)[comm.rank]

    return backward


def to_dense(tensor: Any) -> Any:
    """``tf.IndexedSlices`` as a dense tensor; anything else unchanged."""
    return tf.convert_to_tensor(tensor) if isinstance(tensor, tf.IndexedSlices) else tensor


def is_sparse(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``tf.IndexedSlices`` (a sparse gradient)."""
    return isinstance(tensor, tf.IndexedSlices)


def check_sparse(op: str, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> None:
    """Refuse what Horovod refuses for ``tf.IndexedSlices``: an op other than sum or
    average, and pre/postscaling.

    Args:
        op: the reduction.
        prescale_factor: the factor applied before the reduction.
        postscale_factor: the factor applied after it.

    Raises:
        NotImplementedError: for any of those (Horovod's error), before any communication.
    """
    if op not in ("sum", "average"):
        raise NotImplementedError(f"allreduce of tf.IndexedSlices supports op 'sum' or 'average' "
                                  f"only, not op={op!r} (as Horovod)")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError(
            "allreduce of tf.IndexedSlices does not support prescale_factor/postscale_factor "
            f"(got {prescale_factor!r}, {postscale_factor!r}; as Horovod)")


def sparse_allreduce(comm: Communicator, tensor: tf.IndexedSlices, op: str,
                     name: str | None = None) -> tf.IndexedSlices:
    """Horovod's allreduce of ``tf.IndexedSlices``: allgather the values and the indices
    (the sum of the slices; divided by the ranks for an average).

    Raises:
        NotImplementedError: for an op other than "sum" or "average" (as Horovod).
    """
    check_sparse(op)
    values, indices = _gather_rows(comm, tensor.values, tensor.indices, name)
    if op == "average":
        values = values / tf.cast(group_size(comm, values.dtype), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)


def _gather_rows(comm: Communicator, values: Any, indices: Any, name: str | None
                 ) -> tuple[Any, Any]:
    """Every rank's ``values`` (rows) and ``indices`` (one per row), in rank order: one
    allgather of rows of bytes, each a row of ``values`` and its index side by side (one
    collective instead of two: in a graph each costs a host call or two, in a TF1 session
    ~0.1 ms each on the Horovod backend). Two allgathers where a row's size is not known
    when the graph is built.

    Returns:
        The gathered values and indices.
    """
    width = values.shape[1:].num_elements()
    numeric = values.dtype.is_floating or values.dtype.is_integer or values.dtype.is_complex
    if width is None or indices.shape.rank != 1 or not numeric:
        return (comm.allgather(values, None if name is None else f"{name}.values"),
                comm.allgather(indices, None if name is None else f"{name}.indices"))
    nv = width * values.dtype.size
    rows = tf.concat([tf.reshape(tf.bitcast(values, tf.uint8), [-1, nv]),
                      tf.reshape(tf.bitcast(indices, tf.uint8), [-1, indices.dtype.size])], 1)
    out = comm.allgather(rows, None if name is None else f"{name}.rows")
    gathered = tf.bitcast(tf.reshape(out[:, :nv], [-1, width, values.dtype.size]), values.dtype)
    return (tf.reshape(gathered, tf.concat([[-1], tf.shape(values)[1:]], 0)),
            tf.bitcast(out[:, nv:], indices.dtype))


def alltoall(comm: Communicator, tensor: Any, splits: Any, name: str | None = None
             ) -> tuple[Any, Any]:
    """Alltoall of a TensorFlow tensor: ``(received tensor, received splits as int32)``.

    Args:
        comm: the communicator.
        tensor: the tensor; slice ``i`` of its first dimension goes to rank ``i``.
        splits: rows per rank (a list, an int32/int64 tensor, also symbolic), or None
            (even parts).
        name: the collective's name.

    Returns:
        The received tensor and splits.
    """
    if splits is not None and not isinstance(splits, (list, tuple)) and tf.executing_eagerly():
        splits = [int(v) for v in np.asarray(splits).reshape(-1)]
    elif splits is not None and not isinstance(splits, (list, tuple)):
        splits = tf.cast(splits, tf.int32)
    out, received = comm.alltoall(unwrap(tensor), splits, name)  # type: ignore[attr-defined]
    if not isinstance(received, tf.Tensor):
        received = tf.constant(np.asarray(received, dtype=np.int32))
    return out, received
