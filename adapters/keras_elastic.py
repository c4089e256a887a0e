"""Horovod's elastic TensorFlow / Keras 3 API on the MPI backend (``plait.keras.elastic`` /
``plait.tensorflow.elastic`` there).

``hvd.elastic.KerasState(model, epoch=0, batch=0)`` (``TensorFlowKerasState``),
``TensorFlowState(variables, ...)``, ``@hvd.elastic.run`` and the ``model.fit``
callbacks, as on the Horovod backend; membership changes are relaunches by
``plait run --elastic`` (see :mod:`plait.elastic_relaunch`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from plait.adapters.keras_callbacks import (
    CommitStateCallback,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
)

from plait.elastic_relaunch import HostsUpdatedInterrupt, ObjectState, State, run
from plait.errors import invalid

__all__ = [
    "CommitStateCallback", "HostsUpdatedInterrupt", "KerasState", "ObjectState", "State",
    "check_state_arguments",
    "TensorFlowKerasState", "TensorFlowState", "UpdateBatchStateCallback",
    "UpdateEpochStateCallback", "run",
]


def check_state_arguments(variables: Any, session: Any) -> list[Any]:
    """Horovod's ``TensorFlowState(variables, session)`` arguments, as plait takes them.

    Returns:
        The variables as a list.

    Raises:
        NotImplementedError: for a TF1 ``session``.
        ConfigError: without variables.
    """
    if session is not None:
        raise NotImplementedError("TensorFlowState(session=...): plait's elastic mode runs "
                                  "eager TensorFlow 2 (Horovod's TF1 session path is gone)")
    if variables is None:
        raise invalid("variables", None, "a list of tf.Variable (TF2 has no global "
                      "variable collection)")
    return list(variables)


class TensorFlowState(State):
    """TensorFlow variables and plain attributes, committed together.

    Args:
        variables: the ``tf.Variable`` objects (eager TensorFlow 2).
        session: Horovod's TF1 session argument; only None (eager) is supported.
        **kwargs: plain attributes (``epoch=0``, ``batch=0``), exposed as attributes, and
            ``state=``: plait state objects by name (see :class:`~plait.elastic_relaunch.State`).

    Raises:
        NotImplementedError: for a TF1 ``session``.
        ConfigError: without variables.
    """

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        self.variables = check_state_arguments(variables, session)
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        return self.variables

    def snapshot(self) -> dict[str, Any]:
        """The variables' values (numpy copies) and the attributes."""
        snap = super().snapshot()
        snap["values"] = [np.array(v.numpy()) for v in self._variables()]
        return snap

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        """Assign the variables and attributes of a snapshot.

        Raises:
            RuntimeError: when the snapshot holds another number of variables.
        """
        super().load_snapshot(snap)
        variables, values = self._variables(), snap["values"]
        if len(values) != len(variables):
            raise RuntimeError(f"elastic state holds {len(values)} values for {len(variables)} "
                               "variables: the model changed")
        for v, value in zip(variables, values, strict=True):
            v.assign(value)


class KerasState(TensorFlowState):
    """A built Keras 3 model, its optimizer (built here if needed) and plain attributes.

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: ``model.optimizer``).
        **kwargs: plain attributes (``epoch=0``, ``batch=0``), exposed as attributes, and
            ``state=``: plait state objects by name (see :class:`~plait.elastic_relaunch.State`).

    Raises:
        ConfigError: when the model is not built yet.
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if not getattr(model, "built", False):
            raise invalid("model", type(model).__name__,
                          "a built Keras model (call model.build(input_shape) or run it once)")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__([], **kwargs)

    def _variables(self) -> list[Any]:
        opt = self.optimizer
        if opt is not None and not opt.built:
            opt.build(self.model.trainable_variables)
        return list(self.model.variables) + (list(opt.variables) if opt is not None else [])


#: Horovod's name for the same state in ``horovod.tensorflow.elastic``.
TensorFlowKerasState = KerasState
