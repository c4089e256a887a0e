"""Horovod's ``horovod.tensorflow.mpi_ops`` names: the :mod:`plait.tensorflow` face's own objects."""

from __future__ import annotations

from types import SimpleNamespace

from plait._process_sets import comm_process_set_id, ids_and_ranks
from plait.tensorflow import (
    ProcessSet,
    add_process_set,
    allgather,
    alltoall,
    broadcast,
    broadcast_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_rank_op,
    local_size,
    local_size_op,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    process_set_included_op,
    rank,
    rank_op,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    size_op,
    start_timeline,
    stop_timeline,
)

__all__ = [
    "add_process_set", "allgather", "alltoall", "broadcast", "broadcast_", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_rank_op", "local_size", "local_size_op", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "process_set_included_op", "ProcessSet", "rank",
    "rank_op", "remove_process_set", "rocm_built", "shutdown", "size", "size_op",
    "start_timeline", "stop_timeline",
]

#: The internals that Horovod's own tests call: ``hvd.mpi_ops._basics._get_process_set_ids_and_ranks()``, ...
_basics = SimpleNamespace(_get_process_set_ids_and_ranks=ids_and_ranks,
                          _comm_process_set_id=comm_process_set_id)
