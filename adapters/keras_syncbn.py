"""Horovod's ``SyncBatchNormalization`` for Keras 3 (``plait.tensorflow`` and
``plait.keras``): batch normalization whose training-mode statistics are those of
the global batch (every rank's rows together).

Training forward: each rank sums its per-channel row count, values and squared
values (in float64, with Keras' mask as weights); one sum-allreduce of the three
gives the global count, mean and biased variance (``E[x^2] - E[x]^2``: float64
keeps the cancellation far below float32's resolution), which normalize the local
rows and update the moving statistics, as Keras' own layer does with its batch's.
The allreduce is differentiable (its gradient is the sum-allreduce of the upstream
gradient), so TensorFlow's gradient of the layer is that of batch normalization over
the global batch: one allreduce of ``2 x channels`` values per layer and backward
pass. ``gamma``/``beta`` gradients stay local (the data-parallel optimizer averages
them). Inference mode (and ``trainable=False``) is Keras' own layer, unchanged.

Unlike Horovod 0.28 (whose layer is built on Keras 2 internals and averages the
ranks' means, wrong for uneven batches) this one runs on Keras 3, eagerly and inside
``tf.function`` / ``model.fit``, and weighs each rank by its rows.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from plait._process_sets import communicator
from plait.errors import invalid
from plait.protocols import Communicator

from .tf_collectives import differentiable

__all__ = ["SyncBatchNormalization", "global_moments"]


def global_moments(inputs: Any, axes: list[int], mask: Any, comm: Communicator,
                   name: str = "sync_batch_norm.stats") -> tuple[Any, Any]:
    """Per-channel mean and biased variance of ``inputs`` over every rank's rows.

    Args:
        inputs: this rank's batch (any float dtype); the row count may differ by rank.
        axes: the reduction axes (every axis but the channel axis).
        mask: Keras' mask (one dimension less than ``inputs``, channels last), or None.
        comm: the communicator whose ranks share the statistics.
        name: the collective's name.

    Returns:
        ``(mean, variance)``, each of shape ``(channels,)`` in ``inputs``' dtype; both
        zero for a global batch without rows.
    """
    x = tf.cast(inputs, tf.float64)
    if mask is None:
        weights = tf.ones_like(x)
    else:
        weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), tf.float64), tf.shape(x))
    local = tf.stack([tf.reduce_sum(weights, axes), tf.reduce_sum(weights * x, axes),
                      tf.reduce_sum(weights * tf.square(x), axes)])
    total = differentiable(lambda t: comm.allreduce(t, "sum", name),
                           lambda dy: comm.allreduce(dy, "sum", f"{name}/grad"), local)
    count = tf.maximum(tf.stop_gradient(total[0]), 1.0)
    mean = total[1] / count
    variance = tf.maximum(total[2] / count - tf.square(mean), 0.0)
    return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)


@keras.saving.register_keras_serializable(package="plait")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Horovod's ``hvd.SyncBatchNormalization``: a ``keras.layers.BatchNormalization``
    whose training-mode batch statistics are computed over all ranks' batches.

    Same arguments, weights and config as Keras' layer (so a saved model loads with
    either class); every rank of the group must call it in the same mode and order.
    A saved model names it ``plait>SyncBatchNormalization``; importing
    ``plait.tensorflow`` or ``plait.keras`` registers it for loading.

    Args:
        fused: Horovod's argument: only False (the default) is accepted.
        process_set: plait extension: a ``ProcessSet`` (or plait sub-communicator)
            whose ranks share the statistics (default: all ranks); not saved in the
            config.
        **kwargs: ``keras.layers.BatchNormalization``'s arguments (``axis``,
            ``momentum``, ``epsilon``, ``center``, ``scale``, initializers, ``name``...).

    Raises:
        ConfigError: for ``fused`` True or None (as Horovod: fused batch norm cannot
            be synchronized), or ``renorm=True`` (not supported).
        NotImplementedError: on a Keras whose batch norm has no ``_moments`` hook.
    """

    def __init__(self, fused: bool | None = False, *, process_set: Any = None,
                 **kwargs: Any) -> None:
        if not callable(getattr(keras.layers.BatchNormalization, "_moments", None)):
            raise NotImplementedError(  # the hook moved: never train on local statistics
                f"SyncBatchNormalization needs Keras 3's BatchNormalization._moments, which Keras "
                f"{keras.__version__} does not have")
        if fused is not False:
            raise invalid("fused", fused, "False (SyncBatchNormalization is never fused)")
        if kwargs.get("renorm"):
            raise invalid("renorm", kwargs["renorm"], "False (batch renormalization is not "
                          "synchronized)")
        super().__init__(**kwargs)
        self.process_set = process_set

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        """The global batch's mean and variance (Keras' hook; training mode only)."""
        comm = communicator(self.process_set)[0]
        if comm.size == 1:
            mean, variance = super()._moments(inputs, mask)
            return mean, variance
        return global_moments(inputs, list(self._reduction_axes), mask, comm)
