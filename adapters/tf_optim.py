"""TensorFlow / Keras 3 data parallelism: gradient tape, Keras optimizer, broadcasts.

Keras 3 variables are not ``tf.Variable`` (Horovod 0.28 fails on them, and its
Keras optimizer silently skips averaging under ``model.fit``); everything here
goes through :func:`~plait.adapters.tensorflow.unwrap` and the communicator,
and works eagerly and inside ``tf.function`` on both backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from plait.errors import invalid
from plait.parallel.data import DEFAULT_BUCKET_MB, GradientReducer, GradSpec
from plait.protocols import Communicator

from .tensorflow import OPS, unwrap

__all__ = [
    "DistributedGradientTape", "broadcast_variables", "distributed_keras_optimizer",
    "reduce_gradients",
]


def _name(v: Any, i: int) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", None) or f"var.{i}") + f"#{i}"


def reduce_gradients(grads: Sequence[Any], variables: Sequence[Any], comm: Communicator, *,
                     op: str = "average", compression: Any = None, memory: Any = None,
                     bucket_mb: float = DEFAULT_BUCKET_MB) -> list[Any]:
    """Average (or sum) gradients across ``comm``, fused into buckets.

    A ``None`` gradient is reduced as zeros (another rank may have one), and
    ``tf.IndexedSlices`` are made dense.

    Returns:
        The reduced gradients, in the order of ``variables``.
    """
    if comm.size == 1:
        return list(grads)
    specs, dense = [], []
    for i, (g, v) in enumerate(zip(grads, variables)):
        value = unwrap(v)
        if g is None:
            g = tf.zeros_like(value)
        elif isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        specs.append(GradSpec(_name(v, i), tuple(value.shape), OPS.dtype_name(value)))
        dense.append(g)
    reducer = GradientReducer(comm, specs, op=op, bucket_mb=bucket_mb, compression=compression,
                              memory=memory, prefix="tfgrad")
    for spec, g in zip(specs, dense):
        reducer.ready(spec.name, g)
    out = reducer.finish(lambda spec: None)
    return [out[s.name] for s in specs]


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape`` so that ``gradient()`` returns averaged gradients.

    Args:
        tape: the tape that recorded the forward pass.
        comm: the data-parallel communicator.
        op: "average" (default) or "sum".
        compression: a compressor, or None.
        memory: its error-feedback memory, or None.
        bucket_mb: fusion bucket size in MiB.
    """

    def __init__(self, tape: tf.GradientTape, comm: Communicator, *, op: str = "average",
                 compression: Any = None, memory: Any = None,
                 bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
        if not isinstance(tape, tf.GradientTape):
            raise invalid("gradtape", type(tape).__name__, "a tf.GradientTape")
        self._tape, self._comm = tape, comm
        self._kw = {"op": op, "compression": compression, "memory": memory, "bucket_mb": bucket_mb}

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, **kw: Any) -> Any:
        """Gradients of ``target`` w.r.t. ``sources``, averaged over ranks."""
        flat = tf.nest.flatten(sources)
        grads = self._tape.gradient(target, [unwrap(s) for s in flat], output_gradients, **kw)
        reduced = reduce_gradients(grads, flat, self._comm, **self._kw)
        return tf.nest.pack_sequence_as(sources, reduced)


def broadcast_variables(variables: Sequence[Any], comm: Communicator, root: int = 0) -> None:
    """Assign ``root``'s values to ``variables`` (tf or Keras 3) on every rank, one
    fused broadcast per dtype."""
    by_dtype: dict[str, list[Any]] = {}
    for v in variables:
        by_dtype.setdefault(OPS.dtype_name(v), []).append(v)
    for dtype in sorted(by_dtype):
        group = by_dtype[dtype]
        flat = tf.concat([tf.reshape(unwrap(v), [-1]) for v in group], axis=0)
        out = comm.broadcast(flat, root=root, name=f"broadcast.vars.{dtype}")
        sizes = [int(tf.size(unwrap(v))) for v in group]
        for v, part in zip(group, tf.split(out, sizes)):
            v.assign(tf.reshape(part, unwrap(v).shape))


def distributed_keras_optimizer(optimizer: Any, comm: Communicator, *, op: str = "average",
                                compression: Any = None, memory: Any = None,
                                bucket_mb: float = DEFAULT_BUCKET_MB) -> Any:
    """A copy of a Keras 3 optimizer whose ``apply`` averages gradients first.

    Works with ``model.fit`` (which calls ``optimizer.apply``) and with custom
    loops calling ``apply_gradients``; the result is an instance of a subclass of
    the optimizer's class, built from its config.

    Raises:
        ConfigError: when ``optimizer`` is not a Keras 3 optimizer.
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise invalid("optimizer", type(optimizer).__name__, "a keras.optimizers.Optimizer (Keras 3)")
    base = type(optimizer)
    kw = {"op": op, "compression": compression, "memory": memory, "bucket_mb": bucket_mb}

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        variables = trainable_variables
        if variables is None:
            variables = self._trainable_variables
        reduced = reduce_gradients(list(grads), list(variables), comm, **kw)
        return base.apply(self, reduced, trainable_variables)

    cls: Any = type(base.__name__, (base,), {"apply": apply, "_plait_distributed": True})
    return cls.from_config(optimizer.get_config())
