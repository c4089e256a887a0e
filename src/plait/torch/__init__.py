"""Horovod's PyTorch API on plait: ``import plait.torch as hvd`` runs a Horovod
script on the MPI or the Horovod backend (``PLAIT_BACKEND`` or ``hvd.init(backend=)``).

Also :func:`DistributedSampler`-style sharding and the data-parallel optimizer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from plait.adapters import torch_adasum, torch_optim
from plait.adapters.torch import OPS, collective_function, grouped_collective_function
from plait.adapters.torch_sparse import sparse_allreduce_async
from plait.adapters.torch_syncbn import SyncBatchNorm

from .._face import (
    Adasum,
    Average,
    Done,
    Face,
    MappedHandle,
    Max,
    Min,
    Product,
    Sum,
    check_groups,
    check_predivide,
    elastic_attribute,
    gradient_compression,
    reduce_tensor,
    resolve_op,
)
from .._face import _claim as claim_name
from .._face_compression import Compression, Compressor
from .._face_compression import _Horovodish as HorovodStyle
from .._process_sets import ProcessSet, add_process_set, global_process_set, outside, remove_process_set
from ..errors import HorovodInternalError, invalid

__all__ = [
    "Adasum", "Average", "Compression", "Compressor", "DistributedOptimizer",
    "HorovodInternalError", "Max", "Min", "Product", "ProcessSet", "Sum", "add_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "backend", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "grouped_allgather_async", "grouped_allreduce_async", "grouped_allreduce_async_",
    "grouped_reducescatter_async", "broadcast_optimizer_state",
    "broadcast_parameters", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allreduce",
    "grouped_allreduce_", "grouped_reducescatter", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async", "remove_process_set",
    "rocm_built", "sycl_built", "shutdown", "size", "start_timeline", "stop_timeline", "synchronize",
]

__all__ += ["SyncBatchNorm", "sparse_allreduce_async"]

_F = Face("torch")
init, shutdown, is_initialized = _F.init, _F.shutdown, _F.is_initialized
rank, size, local_rank, local_size = _F.rank, _F.size, _F.local_rank, _F.local_size
backend = _F.backend
cross_rank, cross_size, mpi_threads_supported = _F.cross_rank, _F.cross_size, _F.mpi_threads_supported
mpi_built, gloo_built, nccl_built, ccl_built = _F.mpi_built, _F.gloo_built, _F.nccl_built, _F.ccl_built
cuda_built, rocm_built, ddl_built, is_homogeneous = (_F.cuda_built, _F.rocm_built, _F.ddl_built,
                                                     _F.is_homogeneous)
mpi_enabled, gloo_enabled, sycl_built = _F.mpi_enabled, _F.gloo_enabled, _F.sycl_built
join, start_timeline, stop_timeline = _F.join, _F.start_timeline, _F.stop_timeline
allreduce_async = _F.allreduce_async
allgather_async, broadcast_async = _F.allgather_async, _F.broadcast_async
alltoall_async, barrier = _F.alltoall_async, _F.barrier
reducescatter_async = _F.reducescatter_async
poll, synchronize = _F.poll, _F.synchronize
broadcast_object, allgather_object = _F.broadcast_object, _F.allgather_object


def allreduce(tensor: Any, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None) -> Any:
    """Reduce ``tensor`` over ranks (differentiable: the gradient is allreduced too).

    Args:
        tensor: a torch tensor.
        average: deprecated; True means op=Average, False op=Sum.
        name: name of the collective (appears in mismatch errors).
        compression: ``Compression.none`` / ``.fp16`` / ``.bf16`` (wire format).
        op: Average (default), Sum, Min, Max, Product, or Adasum (Horovod backend).
        prescale_factor: multiply before the reduction.
        postscale_factor: multiply after the reduction.
        process_set: a ``ProcessSet`` (or a plait sub-communicator) instead of all ranks.

    Returns:
        The reduced tensor (0-d stays 0-d).

    Raises:
        ConfigError: when an operation of the same ``name`` is still in flight.
    """
    claim_name(name, "allreduce")
    reduce_op = resolve_op(average, op)
    comm = _F.comm(process_set)

    def forward(t: Any) -> Any:
        return reduce_tensor(comm, t, reduce_op, name, compression, prescale_factor, postscale_factor)

    def backward(g: Any) -> Any:  # Horovod's: the same allreduce of the upstream gradient
        return reduce_tensor(comm, g, reduce_op, None, None, prescale_factor, postscale_factor)

    if tensor.requires_grad:
        return collective_function(forward, backward)(tensor)
    return forward(tensor)


def allgather(tensor: Any, name: str | None = None, process_set: Any = None) -> Any:
    """Concatenate every rank's ``tensor`` along the first dimension (sizes may differ).

    Differentiable as in Horovod: the gradient is the average of the upstream gradients
    over the ranks, sliced to this rank's rows.
    """
    if not tensor.requires_grad:
        return _F.allgather(tensor, name, process_set)
    comm = _F.comm(process_set)
    rows = int(tensor.shape[0]) if tensor.dim() else 0

    def backward(g: Any) -> Any:
        counts = comm.allgather_object(rows)
        start = sum(counts[: comm.rank])
        return comm.allreduce(g, Average)[start : start + rows]

    return collective_function(lambda t: _F.allgather(t, name, process_set), backward)(tensor)


def broadcast(tensor: Any, root_rank: int, name: str | None = None, process_set: Any = None) -> Any:
    """Return ``root_rank``'s tensor on every rank (a global rank, also with a ``ProcessSet``).

    Differentiable as in Horovod: the root gets the average of the upstream gradients,
    the other ranks zero.
    """
    if not tensor.requires_grad:
        return _F.broadcast(tensor, root_rank, name, process_set)
    comm, root = _F.target(process_set, root_rank)

    def backward(g: Any) -> Any:
        avg = comm.allreduce(g, Average)
        return avg if comm.rank == root else avg * 0

    return collective_function(lambda t: _F.broadcast(t, root_rank, name, process_set),
                               backward)(tensor)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             process_set: Any = None) -> Any:
    """Horovod's ``alltoall``: the received tensor, plus the received splits (an int32
    tensor) when ``splits`` is given; without ``splits`` the first dimension is split
    evenly. Differentiable: the gradient goes back by the reverse alltoall.

    Raises:
        ValueError: for ``splits`` given as a tensor of another dtype than int32 (Horovod's
            error, raised before any communication); a list is taken as it is.
    """
    if type(splits).__module__.split(".")[0] == "torch" and OPS.dtype_name(splits) != "int32":
        raise ValueError(f"alltoall expects splits to contain 32-bit integer elements: got a "
                         f"tensor of {splits.dtype}; pass torch.int32 splits or a list of ints")
    if not tensor.requires_grad:
        return _F.alltoall(tensor, splits, name, process_set)
    comm = _F.comm(process_set)
    received: list[Any] = []

    def forward(t: Any) -> Any:
        if splits is not None:
            out, got = _F.alltoall(t, splits, name, process_set)
        else:  # even splits; other ranks may send this one more or fewer rows
            claim_name(name, "alltoall")
            out, got = comm.alltoall(t, None, name)  # type: ignore[attr-defined]
        received.append(got)
        return out

    def backward(g: Any) -> Any:  # the rows go back where they came from
        return comm.alltoall(g, [int(v) for v in received[0]])[0]  # type: ignore[attr-defined]

    out = collective_function(forward, backward)(tensor)
    return out if splits is None else (out, received[0])


def reducescatter(tensor: Any, name: str | None = None, op: str = Average,
                  process_set: Any = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce over the ranks and keep this rank's rows (the first ``rows % size`` ranks
    get one extra). Differentiable as in Horovod: the upstream gradients, scaled by the
    factors (and by the group size for ``Sum``), are allgathered."""
    def forward(t: Any) -> Any:
        return _F.reducescatter(t, name, op, process_set, prescale_factor, postscale_factor)

    if not tensor.requires_grad:
        return forward(tensor)
    comm = _F.comm(process_set)

    def backward(g: Any) -> Any:
        factor = (comm.size if op == Sum else 1) * prescale_factor * postscale_factor
        return comm.allgather(g * factor if factor != 1 else g)

    return collective_function(forward, backward)(tensor)


def grouped_allgather(tensors: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """:func:`allgather` of several tensors, started together. Differentiable as Horovod's
    (``HorovodGroupedAllgather``): each gradient is this rank's rows of the averaged
    upstream gradient.

    Returns:
        One gathered tensor per input.
    """
    tensors = list(tensors)
    if not any(getattr(t, "requires_grad", False) for t in tensors):
        return _F.grouped_allgather(tensors, name, process_set)
    comm = _F.comm(process_set)
    rows = [int(t.shape[0]) if t.dim() else 0 for t in tensors]

    def backward(gs: list[Any]) -> list[Any]:
        earlier = comm.allgather_object(rows)[: comm.rank]  # the ranks before this one
        before = [sum(r[i] for r in earlier) for i in range(len(rows))]
        averaged = comm.grouped_allreduce(gs, Average)
        return [g[at : at + n] for g, at, n in zip(averaged, before, rows)]

    return list(grouped_collective_function(
        lambda ts: _F.grouped_allgather(ts, name, process_set), backward)(*tensors))


def grouped_reducescatter(tensors: Any, name: str | None = None, op: str = Average,
                          process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Any]:
    """:func:`reducescatter` of several tensors. Differentiable as Horovod's
    (``HorovodGroupedReducescatter``): the scaled upstream gradients are allgathered.

    Returns:
        One reduced part per input.
    """
    tensors = list(tensors)

    def forward(ts: list[Any]) -> list[Any]:
        return _F.grouped_reducescatter(ts, name, op, process_set, prescale_factor,
                                        postscale_factor)

    if not any(getattr(t, "requires_grad", False) for t in tensors):
        return forward(tensors)
    comm = _F.comm(process_set)
    factor = (comm.size if op == Sum else 1) * prescale_factor * postscale_factor

    def backward(gs: list[Any]) -> list[Any]:
        handles = [comm.allgather_async(g * factor if factor != 1 else g) for g in gs]
        return [h.wait() for h in handles]

    return list(grouped_collective_function(forward, backward)(*tensors))


def allreduce_(tensor: Any, average: bool | None = None, name: str | None = None,
               op: str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None) -> Any:
    """In-place :func:`allreduce`; returns ``tensor``."""
    tensor.data.copy_(_F.allreduce(tensor, average, name, op, prescale_factor, postscale_factor,
                                   process_set))
    return tensor


def grouped_allreduce(tensors: Any, average: bool | None = None, name: str | None = None,
                      op: str | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None) -> list[Any]:
    """Reduce several tensors in one fused collective (Horovod's ``grouped_allreduce``).

    Differentiable as in Horovod: the upstream gradients get the same grouped allreduce.

    Returns:
        One reduced tensor per input.
    """
    tensors = list(tensors)
    if not any(getattr(t, "requires_grad", False) for t in tensors):
        return _F.grouped_allreduce(tensors, average, name, op, prescale_factor,  # type: ignore[no-any-return]
                                    postscale_factor, process_set)
    reduce_op = resolve_op(average, op)

    def forward(ts: list[Any]) -> list[Any]:
        return _F.grouped_allreduce(ts, None, name, reduce_op, prescale_factor,  # type: ignore[no-any-return]
                                    postscale_factor, process_set)

    def backward(gs: list[Any]) -> list[Any]:
        return _F.grouped_allreduce(gs, None, None, reduce_op, prescale_factor,  # type: ignore[no-any-return]
                                    postscale_factor, process_set)

    return list(grouped_collective_function(forward, backward)(*tensors))


def grouped_allreduce_(tensors: Any, average: bool | None = None, name: str | None = None,
                       op: str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: Any = None) -> list[Any]:
    """In-place :func:`grouped_allreduce`; returns ``tensors``."""
    tensors = list(tensors)
    outs = _F.grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor,
                                process_set)
    for t, o in zip(tensors, outs):
        t.data.copy_(o)
    return tensors


def broadcast_(tensor: Any, root_rank: int, name: str | None = None,
               process_set: Any = None) -> Any:
    """In-place :func:`broadcast`; returns ``tensor``."""
    tensor.data.copy_(_F.broadcast(tensor, root_rank, name, process_set))
    return tensor


def allreduce_async_(tensor: Any, average: bool | None = None, name: str | None = None,
                     op: str | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: Any = None) -> Any:
    """In-place :func:`allreduce_async`: ``synchronize`` writes the result into ``tensor``
    and returns it."""
    handle = _F.allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                process_set)
    return MappedHandle(handle, lambda out: _write(tensor, out))


def _write(tensor: Any, value: Any) -> Any:
    tensor.data.copy_(value)
    return tensor


def broadcast_async_(tensor: Any, root_rank: int, name: str | None = None,
                     process_set: Any = None) -> Any:
    """In-place :func:`broadcast_async`: ``synchronize`` writes the result into ``tensor``."""
    handle = _F.broadcast_async(tensor, root_rank, name, process_set)
    return MappedHandle(handle, lambda out: _write(tensor, out))


def grouped_allreduce_async(tensors: Any, average: bool | None = None, name: str | None = None,
                            op: str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: Any = None) -> Any:
    """:func:`grouped_allreduce` as a handle (plait runs it at the call)."""
    return Done(_F.grouped_allreduce(tensors, average, name, op, prescale_factor,
                                     postscale_factor, process_set))


def grouped_allreduce_async_(tensors: Any, average: bool | None = None, name: str | None = None,
                             op: str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: Any = None) -> Any:
    """:func:`grouped_allreduce_` as a handle (plait runs it at the call)."""
    return Done(grouped_allreduce_(tensors, average, name, op, prescale_factor,
                                   postscale_factor, process_set))


def grouped_allgather_async(tensors: Any, name: str | None = None, process_set: Any = None) -> Any:
    """:func:`grouped_allgather` as a handle (plait runs it at the call)."""
    return Done(grouped_allgather(tensors, name, process_set))


def grouped_reducescatter_async(tensors: Any, name: str | None = None, op: str = Average,
                                process_set: Any = None, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Any:
    """:func:`grouped_reducescatter` as a handle (plait runs it at the call)."""
    return Done(grouped_reducescatter(tensors, name, op, process_set, prescale_factor,
                                      postscale_factor))


def broadcast_parameters(params: Any, root_rank: int = 0, process_set: Any = None) -> None:
    """Copy ``root_rank``'s parameters (``state_dict()`` or ``named_parameters()``) to all."""
    comm, root = _F.target(process_set, root_rank)
    torch_optim.broadcast_parameters(params, comm, root)


def broadcast_optimizer_state(optimizer: Any, root_rank: int = 0, process_set: Any = None) -> None:
    """Copy ``root_rank``'s optimizer state and hyper-parameters to all ranks.

    As Horovod does, an optimizer without state first takes one local step with zero
    gradients, so that its state exists (every parameter that requires a gradient is
    left with a zero ``.grad``; weight decay applies in that step, as in Horovod).
    """
    comm, root = _F.target(process_set, root_rank)
    torch_optim.initialize_optimizer_state(optimizer)
    torch_optim.broadcast_optimizer_state(optimizer, comm, root)


def _checked_names(optimizer: Any, named_parameters: Iterable[tuple[str, Any]] | None
                   ) -> list[tuple[str, Any]] | None:
    """Horovod's checks of ``named_parameters``, made before anything else (they need no
    ``hvd.init()``, as in Horovod).

    Args:
        optimizer: the local optimizer.
        named_parameters: ``model.named_parameters()`` or None.

    Returns:
        The pairs as a list (an iterator is read once), or None.

    Raises:
        ConfigError: (a ``ValueError``) for an item that is not a ``(name, parameter)``
            pair, a name given twice, or a parameter that needs a gradient and has no name.
    """
    if named_parameters is None:
        return None
    named = list(named_parameters)
    for item in named:
        if not isinstance(item, tuple) or len(item) != 2:
            raise invalid("named_parameters", item, "(name, parameter) pairs, as "
                          "model.named_parameters() gives")
    dups = sorted(n for n, count in Counter(n for n, _ in named).items() if count > 1)
    if dups:
        raise invalid("named_parameters", f"duplicate names {dups}", "unique names (two modules "
                      "chained? prefix their names, e.g. model.named_parameters() of a parent)")
    ids = {id(p) for _, p in named}
    unnamed = [p for g in optimizer.param_groups for p in g["params"]
               if p.requires_grad and id(p) not in ids]
    if unnamed:
        raise invalid("named_parameters", f"{len(unnamed)} optimizer parameters without a name",
                      "model.named_parameters() of the model whose parameters the optimizer has")
    return named


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any,
    named_parameters: Iterable[tuple[str, Any]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    *,
    bucket_mb: float | None = None,
    memory: Any = None,
) -> Any:
    """Horovod's ``DistributedOptimizer``: gradients are averaged across ranks in fused,
    overlapped allreduces before each ``step()``.

    The signature is Horovod 0.28's, plus plait's keyword-only ``bucket_mb`` and
    ``memory``; an unknown keyword is a ``TypeError``. ``groups`` / ``num_groups`` are
    validated, but fusion follows ``bucket_mb`` (grouping never changes the result).

    Args:
        optimizer: the local ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()``.
        compression: ``Compression.none``/``fp16``/``bf16`` or any plait compressor.
        backward_passes_per_step: local backward passes accumulated per step.
        op: Average (default), Sum or Adasum. With Adasum on more than one rank, as in
            Horovod, each rank steps the wrapped optimizer on its own gradients and the
            ranks combine the parameters' changes with Adasum
            (:mod:`plait.adapters.torch_adasum`).
        gradient_predivide_factor: split the averaging before/after the sum.
        num_groups: deprecated form of ``groups``.
        groups: Horovod's explicit allreduce groups (validated only).
        sparse_as_dense: reduce sparse gradients dense (handed back sparse); by default
            their rows are allgathered, as in Horovod.
        process_set: data-parallel sub-communicator (default: all ranks); on a rank
            outside a Horovod ``ProcessSet``, ``step()`` applies its own gradients, as in
            Horovod.
        bucket_mb: fusion bucket size in MiB (0: no fusion; None, the default: tuned in
            the first steps, see :mod:`plait.parallel.autotune`).
        memory: error-feedback memory for ``compression`` (e.g. ``Residual()``).

    Returns:
        The distributed optimizer (a subclass of ``type(optimizer)``).

    Raises:
        ConfigError: for bad passes, factor or groups, a memory without a compressor, or
            bad ``named_parameters`` (checked first: no ``hvd.init()`` needed, as in Horovod);
            a ``gradient_predivide_factor`` other than 1 with an op other than Average, or
            Adasum with a lossy compressor or a memory.
        NotImplementedError: Adasum with a process set other than every rank (Horovod's error).
    """
    named = _checked_names(optimizer, named_parameters)
    check_groups(groups, num_groups)
    check_predivide(gradient_predivide_factor, op)
    compressor, memory = gradient_compression(compression, memory)
    if op == Adasum and _F.comm(None).size > 1:
        if process_set is not None and process_set is not global_process_set:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        if memory is not None:
            raise invalid("memory", memory, "None with op=Adasum (no error feedback)")
        if compressor is not None and not (getattr(compressor, "elementwise", False)
                                           or isinstance(compressor, HorovodStyle)):
            raise invalid("compression", compressor, "none, fp16, bf16 or a Horovod-style "
                          "compressor with op=Adasum")
        if named is None:
            named = [(f"allreduce.noname.{i}", p) for g in optimizer.param_groups
                     for i, p in enumerate(g["params"])]
        return torch_adasum.adasum_optimizer(
            optimizer, _F.comm(None), [(n, p) for n, p in named if p.requires_grad],
            compression=compressor, backward_passes_per_step=backward_passes_per_step)
    return torch_optim.distributed_optimizer(
        optimizer, None if outside(process_set) else _F.comm(process_set), named,
        compression=compressor, memory=memory,
        backward_passes_per_step=backward_passes_per_step, op=op, bucket_mb=bucket_mb,
        gradient_predivide_factor=gradient_predivide_factor, sparse_as_dense=sparse_as_dense)


#: ``hvd.elastic``: Horovod's elastic mode (``run``, the state objects), and the other
#: submodules Horovod's package has, on first use.
__getattr__ = elastic_attribute(__name__, "plait.collectives.horovod_elastic_torch",
                                ("compression", "functions", "mpi_ops", "optimizer", "sync_batch_norm"))
