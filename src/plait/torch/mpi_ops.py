"""Horovod's ``horovod.torch.mpi_ops`` names (``from plait.torch.mpi_ops import synchronize,
Sum``): the :mod:`plait.torch` face's own objects."""

from __future__ import annotations

from types import SimpleNamespace

from plait._face import Face, num_rank_is_power_2
from plait._process_sets import comm_process_set_id, ids_and_ranks
from plait.torch import (
    Adasum,
    Average,
    Compression,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)

__all__ = [
    "gpu_available", "num_rank_is_power_2",
    "Adasum", "add_process_set", "allgather", "allgather_async", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "Average", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "ccl_built",
    "Compression", "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set",
    "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allgather_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "HorovodInternalError", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_size", "Max", "Min", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "ProcessSet", "Product", "rank", "reducescatter",
    "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
    "sparse_allreduce_async", "start_timeline", "stop_timeline", "Sum", "synchronize",
]

#: Horovod's ``gpu_available(ext_base_name)``: whether the backend has GPU kernels.
gpu_available = Face("torch").gpu_available

#: The internals that Horovod's own tests call: ``hvd.mpi_ops._basics._get_process_set_ids_and_ranks()``, ...
_basics = SimpleNamespace(_get_process_set_ids_and_ranks=ids_and_ranks,
                          _comm_process_set_id=comm_process_set_id)
