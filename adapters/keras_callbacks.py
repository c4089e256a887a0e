"""Keras 3 callbacks with Horovod's names, over a plait communicator."""

from __future__ import annotations

import warnings
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from plait.errors import invalid
from plait.progress import average_metrics
from plait.protocols import Communicator

from .tf_optim import _key, broadcast_variables

__all__ = [
    "BroadcastGlobalVariablesCallback", "CommitStateCallback", "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, copy ``root_rank``'s model and optimizer variables to all ranks.

    The optimizer is built first if needed, so its slots are broadcast before the
    first step rather than after it. A model not built yet (a ``Sequential`` without an
    input shape: its first batch creates its variables) is broadcast at the end of the
    first batch instead, as Horovod's callback does.

    Args:
        root_rank: the rank whose values every rank gets.
        comm: the communicator.
        local_variables: variables (tf or Keras 3) that keep each rank's own value
            (Horovod's worker-local variables); None: none.

    Raises:
        ConfigError: when ``local_variables`` is not a list of variables.
    """

    def __init__(self, root_rank: int, comm: Communicator, local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank, self._comm = root_rank, comm
        valid = "a list of tf.Variable or keras.Variable (or None)"
        if isinstance(local_variables, (tf.Variable, keras.Variable, str)):
            raise invalid("local_variables", type(local_variables).__name__, valid)
        try:
            local = [] if local_variables is None else list(local_variables)
        except TypeError:
            raise invalid("local_variables", type(local_variables).__name__, valid) from None
        for v in local:
            if not isinstance(v, (tf.Variable, keras.Variable)):
                raise invalid("local_variables", f"a list holding a {type(v).__name__}", valid)
        self._local = {_key(v) for v in local}
        self._pending = False  # the model was not built at train begin: broadcast after batch 1

    def on_train_begin(self, logs: Any = None) -> None:
        model: Any = self.model
        self._pending = not getattr(model, "built", True) or not model.variables
        if not self._pending:  # else the first batch builds the model (a Sequential without
            self._broadcast()  # an input shape): broadcast after it, as Horovod always does

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._pending:
            self._pending = False
            self._broadcast()

    def _broadcast(self) -> None:
        """Broadcast the model's and its optimizer's variables (building the optimizer first)."""
        model: Any = self.model
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables = list(model.variables)
        if optimizer is not None:
            variables += list(optimizer.variables)
        broadcast_variables([v for v in variables if _key(v) not in self._local], self._comm,
                            self.root_rank)


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics over ranks, so logs (and checkpoints) agree.

    Put it before callbacks that read the metrics.
    """

    def __init__(self, comm: Communicator) -> None:
        super().__init__()
        self._comm = comm

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if not logs:
            return
        numeric = {k: float(v) for k, v in logs.items() if np.ndim(v) == 0}
        logs.update(average_metrics(numeric, self._comm))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` between ``start_epoch``
    and ``end_epoch`` (Horovod's callback of the same name).

    With ``staircase`` the rate changes at the first batch of each epoch (``multiplier``
    gets the integer epoch); otherwise at every batch, with the fractional epoch
    ``epoch + batch / steps_per_epoch``. A constant ``multiplier`` means exponential
    decay: ``multiplier ** (epoch - start_epoch)``.

    Momentum correction (Goyal et al.) scales the optimizer's momentum by
    ``new_lr / old_lr`` for the batch where the rate changes. It needs a momentum the
    compiled train step reads at run time (a variable); Keras 3's built-in optimizers
    keep it as a Python number fixed when the step is traced, so for them a warning
    says it is not applied.

    Args:
        initial_lr: the base learning rate.
        multiplier: a function of the (fractional) epoch, or a constant.
        comm: the data-parallel communicator.
        start_epoch: first epoch adjusted.
        end_epoch: first epoch no longer adjusted (None: never stop).
        staircase: adjust once per epoch instead of every batch.
        momentum_correction: scale momentum with the rate change.
        steps_per_epoch: batches per epoch (default: from ``fit``'s parameters).

    Raises:
        ConfigError: for a missing ``initial_lr``.
    """

    def __init__(self, initial_lr: float, multiplier: Any, comm: Communicator,
                 start_epoch: int = 0, end_epoch: float | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise invalid("initial_lr", initial_lr, "the base learning rate (a number)")
        self.initial_lr, self.start_epoch, self.end_epoch = float(initial_lr), start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch, self._comm = steps_per_epoch, comm
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: float(multiplier) ** (epoch - start_epoch)
        self.current_epoch = 0
        self._restore_momentum: Any = None
        self._warned = False

    def _optimizer(self) -> Any:
        model: Any = self.model
        return model.optimizer

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            steps = self.params.get("steps")
            if not steps:
                raise invalid("steps_per_epoch", self.steps_per_epoch,
                              "the number of batches per epoch (fit could not tell it)")
            self.steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch

    def _adjust(self, epoch: float) -> None:
        optimizer = self._optimizer()
        old_lr = float(np.asarray(optimizer.learning_rate))
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        momentum = getattr(optimizer, "momentum", None)
        if not self.momentum_correction or momentum is None or old_lr == 0:
            return
        if isinstance(momentum, (int, float)) and momentum == 0:
            return  # no momentum to correct
        if hasattr(momentum, "assign"):
            self._restore_momentum = float(np.asarray(momentum))
            momentum.assign(self._restore_momentum * new_lr / old_lr)
        elif not self._warned:
            self._warned = True
            warnings.warn(f"{type(self).__name__}: momentum correction not applied: "
                          f"{type(optimizer).__name__}.momentum is a constant of the compiled "
                          "train step (pass momentum_correction=False to silence this)",
                          stacklevel=2)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust(epoch)
        elif not self.staircase:
            self._adjust(epoch + float(batch) / float(self.steps_per_epoch or 1))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._restore_momentum is not None:
            self._optimizer().momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = float(np.asarray(self._optimizer().learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over the
    first ``warmup_epochs`` (Goyal et al.; Horovod's callback of the same name).

    Per batch, ``lr = initial_lr / size * (e * (size - 1) / warmup_epochs + 1)`` with
    ``e = epoch + (batch + 1) / steps_per_epoch``, so the last warm-up batch runs at
    exactly ``initial_lr``; afterwards the rate is left alone.

    Args:
        initial_lr: the target (already size-scaled) learning rate.
        comm: the data-parallel communicator.
        warmup_epochs: epochs of warm-up.
        momentum_correction: scale momentum with the rate change (see the base class).
        steps_per_epoch: batches per epoch (default: from ``fit``'s params).
        verbose: print the rate at the end of warm-up on rank 0.
    """

    def __init__(self, initial_lr: float, comm: Communicator, warmup_epochs: float = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        if not warmup_epochs > 0:
            raise invalid("warmup_epochs", warmup_epochs, "a number of epochs > 0")

        def multiplier(epoch: float) -> float:
            epoch += 1.0 / float(self.steps_per_epoch or 1)
            size = comm.size
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, comm, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs, self.verbose = warmup_epochs, verbose

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose > 0 and self._comm.rank == 0:
            lr = float(np.asarray(self._optimizer().learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


# -- Horovod elastic (state objects from plait.collectives.horovod_elastic_tf) -------------
class CommitStateCallback(keras.callbacks.Callback):
    """Commit an elastic state every ``batches_per_commit`` batches and at each epoch's end.

    A commit is where a membership change is noticed: it raises Horovod's
    ``HostsUpdatedInterrupt``, which ends ``fit`` so ``run`` can reset and retry.

    Args:
        state: the elastic state (``KerasState``).
        batches_per_commit: batches between commits (>= 1).

    Raises:
        ConfigError: for ``batches_per_commit`` < 1.
    """

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        if int(batches_per_commit) < 1:
            raise invalid("batches_per_commit", batches_per_commit, "an integer >= 1")
        self.state, self.batches_per_commit = state, int(batches_per_commit)
        self._left = self.batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self._left = self.batches_per_commit  # equal on all ranks after every reset

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._left -= 1
        if self._left == 0:
            self.state.commit()
            self._left = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the batch reached, so a retried epoch runs only the rest."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self._steps: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self._steps = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        steps = self.params.get("steps")
        if steps:
            if self._steps is None:
                self._steps = int(steps)
            self.params["steps"] = self._steps - int(self.state.batch)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of epochs finished, across resets.

    As in Horovod, each retry calls ``fit(..., epochs=total - state.epoch)``: Keras
    counts that retry's epochs from 0 and this callback adds the epochs done before.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self._initial = int(state.epoch)

    def on_train_begin(self, logs: Any = None) -> None:
        self._initial = int(self.state.epoch)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self._initial + epoch + 1
