"""Horovod's Keras callbacks (``hvd.callbacks.X``, ``from plait.tensorflow.keras.callbacks
import X``; Horovod 0.28 signatures), bound to the world communicator or to
``process_set``; ``device`` arguments have no effect."""

from __future__ import annotations

from typing import Any

from plait.adapters import keras_callbacks as _cb

from .._face import Face

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback"]


def BroadcastGlobalVariablesCallback(root_rank: int = 0, device: str = "",  # noqa: N802
                                     local_variables: Any = None, process_set: Any = None) -> Any:
    """Copy ``root_rank``'s model and optimizer variables to all ranks when training
    starts, except ``local_variables`` (a list of variables that keep each rank's value)."""
    comm, root = Face.target(process_set, root_rank)
    return _cb.BroadcastGlobalVariablesCallback(root, comm, local_variables)


def MetricAverageCallback(device: str = "",  # noqa: N802
                          process_set: Any = None) -> Any:
    """Average each epoch's metrics over ranks."""
    return _cb.MetricAverageCallback(Face.comm(process_set))


def LearningRateScheduleCallback(  # noqa: N802
    initial_lr: float, multiplier: Any, start_epoch: int = 0, end_epoch: float | None = None,
    staircase: bool = True, momentum_correction: bool = True,
    steps_per_epoch: int | None = None, process_set: Any = None,
) -> Any:
    """``lr = initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``."""
    return _cb.LearningRateScheduleCallback(
        initial_lr, multiplier, Face.comm(process_set), start_epoch, end_epoch, staircase,
        momentum_correction, steps_per_epoch)


def LearningRateWarmupCallback(  # noqa: N802
    initial_lr: float, warmup_epochs: float = 5, momentum_correction: bool = True,
    steps_per_epoch: int | None = None, verbose: int = 0,
    process_set: Any = None,
) -> Any:
    """Ramp the rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``."""
    return _cb.LearningRateWarmupCallback(initial_lr, Face.comm(process_set), warmup_epochs,
                                          momentum_correction, steps_per_epoch, verbose)
