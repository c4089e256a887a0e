"""Horovod's TensorFlow 2 API on plait: ``import plait.tensorflow as hvd`` runs a
Horovod script on the MPI or the Horovod backend, with Keras 3 variables.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.adapters import tf_optim

from ._face import (
    Adasum,
    Average,
    Face,
    Max,
    Min,
    Product,
    Sum,
    elastic_attribute,
    reduce_tensor,
    resolve_op,
)
from .compression import Compression
from .parallel.data import DEFAULT_BUCKET_MB
from .protocols import Communicator

__all__ = [
    "Adasum", "Average", "Compression", "DistributedGradientTape", "Max", "Min", "Product", "Sum",
    "allgather", "backend", "allgather_object", "allreduce", "alltoall", "barrier", "broadcast",
    "broadcast_object", "broadcast_variables", "cross_rank", "cross_size", "grouped_allreduce",
    "init", "is_initialized", "local_rank", "local_size", "mpi_threads_supported", "rank",
    "reducescatter", "shutdown", "size",
]

_F = Face("tensorflow")
init, shutdown, is_initialized = _F.init, _F.shutdown, _F.is_initialized
rank, size, local_rank, local_size = _F.rank, _F.size, _F.local_rank, _F.local_size
backend = _F.backend
cross_rank, cross_size, mpi_threads_supported = _F.cross_rank, _F.cross_size, _F.mpi_threads_supported
grouped_allreduce, allgather, broadcast = _F.grouped_allreduce, _F.allgather, _F.broadcast
alltoall, reducescatter, barrier = _F.alltoall, _F.reducescatter, _F.barrier
broadcast_object, allgather_object = _F.broadcast_object, _F.allgather_object


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none, op: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None,
              process_set: Communicator | None = None) -> Any:
    """Reduce ``tensor`` over ranks (Horovod's signature; device arguments are ignored)."""
    return reduce_tensor(_F.comm(process_set), tensor, resolve_op(average, op), name, compression,
                         prescale_factor, postscale_factor)


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: Communicator | None = None) -> None:
    """Assign ``root_rank``'s values to ``variables`` (tf.Variable or Keras 3) everywhere."""
    tf_optim.broadcast_variables(list(variables), _F.comm(process_set), root_rank)


def DistributedGradientTape(  # noqa: N802 - Horovod's name
    gradtape: Any, device_dense: str = "", device_sparse: str = "",
    compression: Any = Compression.none, sparse_as_dense: bool = True, op: str = Average,
    process_set: Communicator | None = None, bucket_mb: float = DEFAULT_BUCKET_MB,
) -> tf_optim.DistributedGradientTape:
    """Horovod's ``DistributedGradientTape``: ``gradient()`` returns averaged gradients.

    Sparse gradients are always made dense; device arguments are ignored.
    """
    return tf_optim.DistributedGradientTape(
        gradtape, _F.comm(process_set), op=op,
        compression=None if compression is Compression.none else compression, bucket_mb=bucket_mb)


#: ``hvd.elastic``: Horovod's elastic mode (``run``, the state objects), on first use.
__getattr__ = elastic_attribute(__name__, "plait.collectives.horovod_elastic_tf")
