"""Keras 3 callbacks with Horovod's names, over a plait communicator."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from plait.errors import invalid
from plait.progress import average_metrics
from plait.protocols import Communicator

from .tf_optim import broadcast_variables

__all__ = [
    "BroadcastGlobalVariablesCallback", "CommitStateCallback", "LearningRateWarmupCallback",
    "MetricAverageCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, copy ``root_rank``'s model and optimizer variables to all ranks.

    The optimizer is built first if needed, so its slots are broadcast before the
    first step rather than after it.
    """

    def __init__(self, root_rank: int, comm: Communicator) -> None:
        super().__init__()
        self.root_rank, self._comm = root_rank, comm

    def on_train_begin(self, logs: Any = None) -> None:
        model: Any = self.model
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        variables = list(model.variables)
        if optimizer is not None:
            variables += list(optimizer.variables)
        broadcast_variables(variables, self._comm, self.root_rank)


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


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over the
    first ``warmup_epochs`` (Goyal et al.; Horovod's callback of the same name).

    Args:
        initial_lr: the target (already size-scaled) learning rate.
        comm: the data-parallel communicator.
        warmup_epochs: epochs of warm-up.
        steps_per_epoch: batches per epoch (default: from ``fit``'s params).
        verbose: print the rate at the end of warm-up on rank 0.
    """

    def __init__(self, initial_lr: float, comm: Communicator, warmup_epochs: float = 5,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        super().__init__()
        self.initial_lr, self.warmup_epochs = float(initial_lr), float(warmup_epochs)
        self.steps_per_epoch, self.verbose, self._comm = steps_per_epoch, verbose, comm
        self._epoch = 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        steps = self.steps_per_epoch or self.params.get("steps") or 1
        progress = self._epoch + batch / steps
        if progress > self.warmup_epochs:
            return
        size = self._comm.size
        lr = self.initial_lr / size * (progress * (size - 1) / self.warmup_epochs + 1)
        model: Any = self.model
        model.optimizer.learning_rate.assign(lr)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch + 1 == int(self.warmup_epochs) and self.verbose and self._comm.rank == 0:
            print(f"\nEpoch {epoch + 1}: finished learning-rate warm-up to {self.initial_lr:g}.")


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
