"""Horovod's elastic mode for TensorFlow / Keras 3 with plait (``plait.keras.elastic``).

Horovod 0.28's ``TensorFlowKerasState`` cannot hold a Keras 3 model (it calls
``optimizer.variables()`` and broadcasts Keras variables it cannot take). This
state can, with Horovod's spelling: ``state = hvd.elastic.KerasState(model,
epoch=0, batch=0)`` (``TensorFlowState(variables, ...)`` for plain variables),
``@hvd.elastic.run``, and the callbacks
``CommitStateCallback``, ``UpdateBatchStateCallback``, ``UpdateEpochStateCallback``
for ``model.fit``. After a reset the model's compiled train/test/predict functions
are rebuilt, so graph collectives get the same names on old and new workers.
This module imports horovod (only ``collectives/`` may).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from horovod.common.elastic import ObjectState
from horovod.common.exceptions import HorovodInternalError
from plait.adapters.keras_callbacks import (
    CommitStateCallback,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
)
from plait.adapters.keras_elastic import check_state_arguments

from plait.errors import invalid

from .horovod_elastic import LateHostUpdates, PlaitObjects, check_versions, elastic_run

__all__ = [
    "CommitStateCallback", "KerasState", "TensorFlowKerasState", "TensorFlowState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback", "run",
]


def _plait_mpi() -> Any:
    """plait's world communicator, unless it is horovod.tensorflow's (whose elastic reset
    this module drives): on the MPI backend, or on horovod.torch, horovod.tensorflow is
    not initialised."""
    from plait import runtime

    world = runtime.world() if runtime.is_initialized() else None
    if world is None or (world.backend == "horovod"
                         and getattr(world, "framework", None) == "tensorflow"):
        return None
    return world


def _broadcast_object(obj: Any, name: str | None = None) -> Any:
    world = _plait_mpi()
    if world is not None:
        return world.broadcast_object(obj, 0)
    return hvd.broadcast_object(obj, root_rank=0, name=name or "plait.elastic.object")


def _allgather_object(obj: Any) -> Any:
    world = _plait_mpi()
    if world is not None:
        return world.allgather_object(obj)
    return hvd.allgather_object(obj, name="plait.elastic.versions")


@contextlib.contextmanager
def _horovod_errors() -> Iterator[None]:
    """Turn the TensorFlow error of a failed Horovod op (a peer died) into Horovod's
    ``HorovodInternalError``, which Horovod's elastic loop answers with a restore and a reset."""
    try:
        yield
    except tf.errors.UnknownError as exc:
        if "Horovod" in str(exc.message):
            raise HorovodInternalError(exc) from exc
        raise


def _rank() -> int:
    world = _plait_mpi()
    return int(world.rank) if world is not None else int(hvd.rank())


class TensorFlowState(LateHostUpdates, ObjectState):  # type: ignore[misc]
    """Horovod's ``hvd.elastic.TensorFlowState``: elastic state of TensorFlow variables.

    Args:
        variables: the ``tf.Variable`` objects (eager TensorFlow 2).
        session: Horovod's TF1 session argument; only None (eager) is supported.
        state: plait state objects by name, committed, restored and synchronised too.
        **kwargs: plain attributes (``epoch=0``, ``batch=0``), exposed as attributes.

    Raises:
        NotImplementedError: for a TF1 ``session``.
        ConfigError: without variables.
    """

    def __init__(self, variables: Any = None, session: Any = None,
                 state: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self.variables = check_state_arguments(variables, session)
        self._plait = PlaitObjects(state)
        self._saved_values: list[np.ndarray] = []
        self._save_variables()
        super().__init__(bcast_object=_broadcast_object, get_rank=_rank, **kwargs)

    def _variables(self) -> list[Any]:
        return self.variables

    def _save_variables(self) -> None:
        self._saved_values = [np.array(v.numpy()) for v in self._variables()]
        self._plait.save()

    def _load_variables(self, values: list[np.ndarray]) -> None:
        variables = self._variables()
        if len(values) != len(variables):
            raise RuntimeError(f"elastic state holds {len(values)} values for {len(variables)} "
                               "variables: the model changed")
        for v, value in zip(variables, values):
            v.assign(value)

    def save(self) -> None:
        """Commit: remember every variable and attribute in memory."""
        self._save_variables()
        super().save()

    def restore(self) -> None:
        """Roll back to the last commit (after a worker failed)."""
        self._load_variables(self._saved_values)
        self._plait.restore()
        super().restore()

    def sync(self) -> None:
        """Make every worker (new ones too) hold rank 0's variables, attributes and objects,
        once every worker was found to run the job's versions (see :func:`check_versions`).

        Raises:
            HorovodInternalError: when a worker failed meanwhile (Horovod's elastic loop
                then restores the last commit and resets).
        """
        with _horovod_errors():
            check_versions(_allgather_object, _rank())
            values = [np.array(v.numpy()) for v in self._variables()]
            self._load_variables(_broadcast_object(values, "plait.elastic.variables"))
            self._plait.sync(_broadcast_object)
            self._save_variables()
            super().sync()


class KerasState(TensorFlowState):
    """Horovod elastic state of a Keras 3 model, its optimizer and plait state objects.

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``); built here if needed,
            so new workers hold the same slot variables as old ones.
        state: plait state objects by name, committed, restored and synchronised too.
        **kwargs: plain attributes (``epoch=0``, ``batch=0``), exposed as attributes.

    Raises:
        ConfigError: when the model is not built yet.
    """

    def __init__(self, model: Any, optimizer: Any = None, state: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        if not getattr(model, "built", False):
            raise invalid("model", type(model).__name__,
                          "a built Keras model (call model.build(input_shape) or run it once)")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__([], state=state, **kwargs)

    def _variables(self) -> list[Any]:
        opt = self.optimizer
        if opt is not None and not opt.built:
            opt.build(self.model.trainable_variables)
        return list(self.model.variables) + (list(opt.variables) if opt is not None else [])

    def reset(self) -> None:
        """After Horovod restarted: drop the model's compiled functions so they are traced
        again with the new ranks (and with op names equal to the new workers')."""
        for attr in ("train_function", "test_function", "predict_function"):
            if hasattr(self.model, attr):
                setattr(self.model, attr, None)


#: Horovod's name for the same state in ``horovod.tensorflow.elastic``.
TensorFlowKerasState = KerasState


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``hvd.elastic.run``: retry ``func(state, ...)`` across membership changes.

    A TensorFlow error raised by a Horovod op (a peer died) counts as a worker
    failure: the state is restored to the last commit and training goes on.

    Args:
        func: the training function; its first argument is a :class:`KerasState`.

    Returns:
        The wrapped function.
    """

    def attempt(state: Any, *args: Any, **kwargs: Any) -> Any:
        with _horovod_errors():
            return func(state, *args, **kwargs)

    return elastic_run(attempt, hvd, "tensorflow")
