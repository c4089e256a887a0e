"""TensorFlow/Keras 3 glue of asynchronous data parallelism (``plait.parallel.asyncdp``).

:func:`async_optimizer` returns a copy of a Keras 3 optimizer (an instance of a
subclass of its class) whose ``apply`` runs one step of the algorithm. It works
eagerly: custom loops calling ``apply_gradients`` outside ``tf.function``, or
``model.fit`` after ``model.compile(..., run_eagerly=True)``. The extra methods
are ``serve(variables, checkpoint=None, model=None)`` (parameter-server ranks),
``synchronize(variables=None)``, ``gather_metrics()`` and the properties
``metrics_async``, ``async_algorithm`` and ``is_server``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from plait.errors import PlaitTypeError, invalid
from plait.parallel.asyncdp.base import AsyncAlgorithm

__all__ = ["KerasReplica", "async_optimizer"]


def _value(v: Any) -> Any:
    return v.value if hasattr(v, "value") and not isinstance(v, tf.Variable) else v


class KerasReplica:
    """Keras variables and the gradients of the current ``apply`` as flat float32 vectors.

    Args:
        optimizer: the asynchronous Keras optimizer.
        base: its original class (whose ``apply`` steps locally).
        variables: the trainable variables.
    """

    def __init__(self, optimizer: Any, base: type, variables: Sequence[Any]) -> None:
        self.optimizer: Any = optimizer
        self.base: Any = base
        self.variables = list(variables)
        self.shapes = [tuple(int(d) for d in v.shape) for v in self.variables]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.numel = int(sum(self.sizes))
        self.grads: list[Any] = [None] * len(self.variables)

    def get_params(self) -> np.ndarray:
        return np.concatenate([np.asarray(_value(v)).astype(np.float32).reshape(-1)
                               for v in self.variables])

    def set_params(self, flat: np.ndarray) -> None:
        for v, piece, shape in zip(self.variables, self._pieces(flat), self.shapes, strict=True):
            v.assign(piece.reshape(shape).astype(v.dtype if isinstance(v.dtype, str) else "float32"))

    def _pieces(self, flat: np.ndarray) -> list[np.ndarray]:
        return np.split(np.asarray(flat, dtype=np.float32), np.cumsum(self.sizes)[:-1])

    def get_grads(self) -> np.ndarray:
        out = []
        for g, n in zip(self.grads, self.sizes, strict=True):
            if g is None:
                out.append(np.zeros(n, np.float32))
            else:
                out.append(np.asarray(tf.convert_to_tensor(g)).astype(np.float32).reshape(-1))
        return np.concatenate(out)

    def set_grads(self, flat: np.ndarray) -> None:
        self.grads = [tf.constant(p.reshape(s)) for p, s in
                      zip(self._pieces(flat), self.shapes, strict=True)]

    def apply(self) -> None:
        grads = [tf.cast(g, _value(v).dtype) for g, v in zip(self.grads, self.variables, strict=True)]
        self.base.apply(self.optimizer, grads, self.variables)


class _State:
    """Holder kept off Keras' attribute tracking."""

    def __init__(self, algorithm: AsyncAlgorithm) -> None:
        self.algorithm = algorithm
        self.replica: KerasReplica | None = None


def async_optimizer(optimizer: Any, algorithm: AsyncAlgorithm) -> Any:
    """A copy of a Keras 3 optimizer whose ``apply`` is a step of ``algorithm``.

    The algorithm is set up (a collective) on the first ``apply`` (workers) or
    ``serve`` (parameter servers).

    Raises:
        ConfigError: when ``optimizer`` is not a Keras 3 optimizer.
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise invalid("optimizer", type(optimizer).__name__, "a keras.optimizers.Optimizer (Keras 3)")
    base = type(optimizer)

    def _replica(self: Any, variables: Sequence[Any] | None) -> KerasReplica:
        state: _State = self._plait_async
        if state.replica is None:
            if variables is None:
                raise invalid("variables", None, "the model's trainable variables (no step ran yet)")
            state.replica = KerasReplica(self, base, variables)
            state.algorithm.setup(state.replica)
        return state.replica

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        variables = list(trainable_variables if trainable_variables is not None
                         else self._trainable_variables)
        grads = list(grads)
        if any(g is not None and not tf.executing_eagerly() for g in grads):
            raise PlaitTypeError(
                "asynchronous data parallelism runs eagerly: call apply_gradients outside "
                "tf.function, or model.compile(..., run_eagerly=True) for model.fit")
        replica = _replica(self, variables)
        replica.grads = grads
        self._plait_async.algorithm.step(replica)
        return None

    def serve(self: Any, variables: Sequence[Any] | None = None, checkpoint: Any = None,
              model: Any = None) -> None:
        """Parameter-server ranks: serve until every worker finished.

        Args:
            variables: the trainable variables (default: ``model.trainable_variables``).
            checkpoint: a ``plait.Checkpoint``: the servers write a consistent snapshot
                whenever the workers reach a multiple of its ``every``.
            model: the Keras model (needed with ``checkpoint``).
        """
        if variables is None and model is not None:
            variables = model.trainable_variables
        if variables is None:
            raise invalid("variables", None, "the model's trainable variables (or model=)")
        if checkpoint is not None and model is None:
            raise invalid("model", None, "the Keras model being trained (with checkpoint=)")
        replica = _replica(self, list(variables))
        snapshot = None if checkpoint is None else checkpoint.snapshot(model, self)
        self._plait_async.algorithm.serve(replica, snapshot)

    def synchronize(self: Any, variables: Sequence[Any] | None = None) -> None:
        """Collective: finish and leave one identical model on every rank."""
        self._plait_async.algorithm.synchronize(
            _replica(self, None if variables is None else list(variables)))

    def gather_metrics(self: Any) -> list[dict[str, Any]]:
        """Collective: every rank's metrics summary."""
        return self._plait_async.algorithm.gather_metrics()

    props = {
        "apply": apply, "serve": serve, "synchronize": synchronize, "gather_metrics": gather_metrics,
        "is_server": property(lambda self: self._plait_async.algorithm.is_server),
        "async_algorithm": property(lambda self: self._plait_async.algorithm),
        "metrics_async": property(lambda self: self._plait_async.algorithm.metrics),
        "_plait_distributed": True,
    }
    cls: Any = type(base.__name__, (base,), props)
    out = cls.from_config(optimizer.get_config())
    object.__setattr__(out, "_plait_async", _State(algorithm))
    return out
