"""Horovod's Keras API on plait (``import plait.keras as hvd``), for Keras 3.

Horovod 0.28's own Keras optimizer silently stops averaging gradients under
Keras 3 ``model.fit``; this one averages them on both backends.
"""

from __future__ import annotations

from typing import Any

from plait.adapters import keras_callbacks as _cb
from plait.adapters import tf_optim

from ._face import Adasum, Average, Face, Max, Min, Product, Sum, elastic_attribute
from .compression import Compression
from .parallel.data import DEFAULT_BUCKET_MB
from .protocols import Communicator
from .tensorflow import allgather, allreduce, broadcast, broadcast_variables

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Max", "Min", "Product", "Sum",
    "allgather", "backend", "allreduce", "broadcast", "broadcast_variables", "callbacks", "init",
    "is_initialized", "local_rank", "local_size", "rank", "shutdown", "size",
]

_F = Face("tensorflow")
init, shutdown, is_initialized = _F.init, _F.shutdown, _F.is_initialized
rank, size, local_rank, local_size = _F.rank, _F.size, _F.local_rank, _F.local_size
backend = _F.backend


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any, name: str | None = None, compression: Any = Compression.none,
    op: str = Average, process_set: Communicator | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB, **horovod_options: Any,
) -> Any:
    """A Keras 3 optimizer whose ``apply`` (used by ``model.fit``) averages gradients.

    Horovod's device and sparse options are accepted and ignored.
    """
    return tf_optim.distributed_keras_optimizer(
        optimizer, _F.comm(process_set), op=op, bucket_mb=bucket_mb,
        compression=None if compression is Compression.none else compression)


class callbacks:  # noqa: N801 - Horovod's module name, hvd.callbacks.X
    """Horovod's Keras callbacks, bound to the world communicator."""

    @staticmethod
    def BroadcastGlobalVariablesCallback(root_rank: int = 0,  # noqa: N802
                                         process_set: Communicator | None = None) -> Any:
        return _cb.BroadcastGlobalVariablesCallback(root_rank, _F.comm(process_set))

    @staticmethod
    def MetricAverageCallback(process_set: Communicator | None = None) -> Any:  # noqa: N802
        return _cb.MetricAverageCallback(_F.comm(process_set))

    @staticmethod
    def LearningRateWarmupCallback(initial_lr: float, warmup_epochs: float = 5,  # noqa: N802
                                   steps_per_epoch: int | None = None, verbose: int = 0,
                                   process_set: Communicator | None = None) -> Any:
        return _cb.LearningRateWarmupCallback(initial_lr, _F.comm(process_set), warmup_epochs,
                                              steps_per_epoch, verbose)


#: ``hvd.elastic``: Horovod's elastic mode (``run``, the state objects), on first use.
__getattr__ = elastic_attribute(__name__, "plait.collectives.horovod_elastic_tf")
