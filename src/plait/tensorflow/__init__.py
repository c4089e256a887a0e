"""Horovod's TensorFlow 2 API on plait: ``import plait.tensorflow as hvd`` runs a
Horovod script on the MPI or the Horovod backend, with Keras 3 variables.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import tensorflow as tf

from plait.adapters import tf_optim
from plait.adapters.keras_syncbn import SyncBatchNormalization

from .._face import (
    Adasum,
    Average,
    Face,
    Max,
    Min,
    Product,
    Sum,
    check_groups,
    check_predivide,
    elastic_attribute,
    gradient_compression,
    keep_shape,
    num_rank_is_power_2,
    reduce_tensor,
    resolve_op,
    scale,
    split_list,
)
from .._face import _claim as claim_name
from .._face_compression import Compression, Compressor
from .._process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    included,
    outside,
    remove_process_set,
    set_size,
)
from ..errors import HorovodInternalError, invalid
from ..parallel.data import DEFAULT_BUCKET_MB

__all__ = [
    "check_num_rank_power_of_2", "gpu_available", "split_list",
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "Compression", "Compressor",
    "DistributedGradientTape",
    "DistributedOptimizer", "HorovodInternalError", "Max", "Min", "PartialDistributedGradientTape",
    "ProcessSet", "Product", "Sum", "SyncBatchNormalization",
    "add_process_set", "allgather", "allgather_object", "allreduce", "alltoall", "backend",
    "barrier", "broadcast", "broadcast_", "broadcast_global_variables", "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "global_process_set", "gloo_built",
    "gloo_enabled", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "init",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_rank_op", "local_size",
    "local_size_op", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
    "process_set_included_op", "rank", "rank_op", "reducescatter", "remove_process_set",
    "rocm_built", "sycl_built", "shutdown", "size", "size_op", "start_timeline", "stop_timeline",
]

_F = Face("tensorflow")
init, shutdown, is_initialized = _F.init, _F.shutdown, _F.is_initialized
rank, size, local_rank, local_size = _F.rank, _F.size, _F.local_rank, _F.local_size
backend = _F.backend
cross_rank, cross_size, mpi_threads_supported = _F.cross_rank, _F.cross_size, _F.mpi_threads_supported
mpi_built, gloo_built, nccl_built, ccl_built = _F.mpi_built, _F.gloo_built, _F.nccl_built, _F.ccl_built
cuda_built, rocm_built, ddl_built, is_homogeneous = (_F.cuda_built, _F.rocm_built, _F.ddl_built,
                                                     _F.is_homogeneous)
mpi_enabled, gloo_enabled, sycl_built = _F.mpi_enabled, _F.gloo_enabled, _F.sycl_built
join, start_timeline, stop_timeline = _F.join, _F.start_timeline, _F.stop_timeline
gpu_available, check_num_rank_power_of_2 = _F.gpu_available, num_rank_is_power_2
barrier = _F.barrier


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: Any = None) -> Any:
    """``root_rank``'s picklable ``obj`` on every rank (Horovod's TensorFlow signature).

    Args:
        obj: the object (used on ``root_rank`` only).
        root_rank: the global rank that has it.
        session: Horovod's TF1 session; no effect (the object travels eagerly).
        name: no effect.
        process_set: the process set (default: all ranks).

    Returns:
        The root's object.
    """
    return _F.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: Any = None) -> Any:
    """Horovod's ``broadcast_object_fn``: a function ``fn(obj)`` doing
    :func:`broadcast_object` with these arguments."""
    return functools.partial(broadcast_object, root_rank=root_rank, session=session, name=name,
                             process_set=process_set)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (Horovod's TensorFlow signature;
    ``session`` and ``name`` have no effect)."""
    return _F.allgather_object(obj, name, process_set)


def _executing_eagerly() -> bool:
    """Whether TensorFlow executes eagerly here (Horovod exports this helper too)."""
    from plait.adapters import tensorflow as tf_adapter

    return tf_adapter.executing_eagerly()


def _int32(value: int) -> Any:
    from plait.adapters import adapter

    return adapter("tensorflow").zeros([], "int32", None) + value


def size_op(process_set_id: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """The number of ranks of a process set as an int32 tensor (Horovod's ``size_op``).

    Args:
        process_set_id: Horovod's: 0 (every rank) or a registered set's id; its size is
            known on every rank, members or not.
        name: unused (Horovod's op name).
        process_set: plait's: a ``ProcessSet`` or communicator instead of the id.

    Returns:
        A 0-d int32 tensor; in a graph traced by a worker of a Horovod elastic job, an op
        that reads the size each time the graph runs (as Horovod's).

    Raises:
        ConfigError: for an id that is not registered.
    """
    from plait.adapters.tf_collectives import group_size

    if process_set is None and process_set_id == 0:
        process_set = global_process_set
    if process_set is not None:
        size = group_size(_F.comm(process_set))
        return _int32(size) if isinstance(size, int) else size
    return _int32(set_size(process_set_id))


def rank_op(name: str | None = None) -> Any:
    """This process's rank as an int32 tensor (Horovod's ``rank_op``)."""
    return _int32(rank())


def local_rank_op(name: str | None = None) -> Any:
    """This process's rank on its host as an int32 tensor (Horovod's ``local_rank_op``)."""
    return _int32(local_rank())


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """1 (int32 tensor) when this process is in process set ``process_set_id``, else 0."""
    return _int32(int(included(process_set_id)))


def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: Any = None) -> list[Any]:
    """Assign ``root_rank``'s values to ``variables`` in place (Horovod's ``broadcast_``).

    Eagerly the assignment is done when this returns; inside a graph (TF1 graph mode,
    also with ``RefVariable``) the returned tensors are the assignments: running one
    assigns its variable, as Horovod's in-place op does.

    Args:
        variables: ``tf.Variable`` (resource or TF1 ref) or Keras 3 variables.
        root_rank: the rank whose values are kept.
        name: base name of the broadcasts inside a graph (``{name}.{i}``), or None.
        process_set: the process set (default: all ranks).

    Returns:
        The new values, one per variable.
    """
    from plait.adapters.tensorflow import unwrap

    variables = list(variables)
    if not _executing_eagerly():
        return [v.assign(broadcast(unwrap(v), root_rank,
                                   None if name is None else f"{name}.{i}",
                                   process_set=process_set))
                for i, v in enumerate(variables)]
    broadcast_variables(variables, root_rank, process_set)
    return [v.value() if callable(getattr(v, "value", None)) else v.value for v in variables]


def local_size_op(name: str | None = None) -> Any:
    """The number of ranks on this host as an int32 tensor (Horovod's ``local_size_op``)."""
    return _int32(local_size())


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none, op: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None,
              process_set: Any = None) -> Any:
    """Reduce ``tensor`` over ranks (Horovod's signature; device arguments are ignored).

    A ``tf.IndexedSlices`` (a sparse gradient) is reduced as Horovod reduces it: its
    values and indices are allgathered (divided by the ranks for an average).

    Raises:
        ConfigError: when an operation of the same ``name`` is still in flight.
        NotImplementedError: for ``tf.IndexedSlices`` with an op other than Sum or
            Average, or with pre/postscaling (as Horovod).
    """
    from plait.adapters import tf_collectives as tc

    claim_name(name, "allreduce")
    comm, how = _F.comm(process_set), resolve_op(average, op)
    if tc.is_sparse(tensor):
        tc.check_sparse(how, prescale_factor, postscale_factor)
        return tc.sparse_allreduce(comm, tensor, how, name)

    def run(t: Any, label: str | None) -> Any:
        return reduce_tensor(comm, t, how, label, compression, prescale_factor, postscale_factor)

    return tc.differentiable(lambda t: run(t, name),
                             lambda dy: run(dy, None if name is None else f"{name}/grad"), tensor)


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = None) -> Any:
    """Concatenate every rank's ``tensor`` along the first dimension (sizes may differ),
    with Horovod's gradient (the averaged upstream gradient's rows of this rank).

    Raises:
        ConfigError: when an operation of the same ``name`` is still in flight.
    """
    from plait.adapters import tf_collectives as tc

    claim_name(name, "allgather")
    comm = _F.comm(process_set)
    return tc.differentiable(lambda t: comm.allgather(t, name),
                             tc.allgather_backward(comm, tensor, name), tensor)


def broadcast(tensor: Any, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = None) -> Any:
    """``root_rank``'s ``tensor`` on every rank, with Horovod's gradient (the averaged
    upstream gradient on the root, zeros elsewhere).

    Raises:
        ConfigError: for a root outside the process set, or a ``name`` still in flight.
    """
    from plait.adapters import tf_collectives as tc

    claim_name(name, "broadcast")
    comm, root = _F.target(process_set, root_rank)

    def backward(dy: Any) -> Any:
        g = comm.allreduce(dy, Average, None if name is None else f"{name}/grad")
        return g if comm.rank == root else g * 0

    return tc.differentiable(lambda t: keep_shape(t, comm.broadcast(t, root, name)), backward,
                             tensor)


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False, process_set: Any = None) -> Any:
    """Send slice ``i`` of the first dimension to rank ``i`` (Horovod's ``alltoall``): the
    received tensor, and with ``splits`` given also the received splits (int32); without
    ``splits`` the first dimension is split evenly. Gradient: the alltoall of the
    upstream gradient back along the received splits.

    Raises:
        ConfigError: for splits that do not fit, or a ``name`` still in flight.
    """
    from plait.adapters import tf_collectives as tc

    claim_name(name, "alltoall")
    comm = _F.comm(process_set)
    kept: list[Any] = []

    def forward(t: Any) -> Any:
        out, received = tc.alltoall(comm, t, splits, name)
        kept[:] = [received]
        return out

    def backward(dy: Any) -> Any:  # back along the received splits
        return tc.alltoall(comm, dy, kept[0], None if name is None else f"{name}/grad")[0]

    out = tc.differentiable(forward, backward, tensor)
    return out if splits is None else (out, kept[0])


def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: str = Average, name: str | None = None, process_set: Any = None,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce over ranks and keep this rank's rows (the first ``rows % size`` ranks get one
    extra), with Horovod's gradient (the allgather of the upstream gradient, times the
    ranks for a sum, times the scale factors). ``compression`` has no effect.

    Raises:
        ConfigError: for a bad op, a 0-d ``tensor`` (nothing to scatter; Horovod refuses
            it too), or a ``name`` still in flight.
    """
    from plait.adapters import tf_collectives as tc

    _check_scatterable(tensor)

    def forward(t: Any) -> Any:
        return _F.reducescatter(t, name, op, process_set, prescale_factor, postscale_factor)

    def backward(dy: Any) -> Any:
        factor = (_F.comm(process_set).size if op == Sum else 1) * prescale_factor * postscale_factor
        g = dy if factor == 1 else dy * factor
        return _F.comm(process_set).allgather(g, None if name is None else f"{name}/grad")

    return tc.differentiable(forward, backward, tensor)


def _check_scatterable(tensor: Any) -> None:
    """Refuse a 0-d tensor for reducescatter (its first dimension is what is scattered)."""
    from plait.adapters.tensorflow import unwrap

    ndims = getattr(getattr(unwrap(tensor), "shape", None), "ndims", None)
    if ndims == 0:
        raise invalid("tensor", f"a 0-d tensor {tensor!r}",
                      "a tensor of rank >= 1 (reducescatter splits its first dimension)")


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False, process_set: Any = None) -> list[Any]:
    """:func:`allgather` of several tensors (Horovod's ``grouped_allgather``), each with
    :func:`allgather`'s gradient, eagerly and inside graphs.

    Raises:
        ConfigError: when an operation of the same ``name`` is still in flight.
    """
    from plait.adapters import tf_collectives as tc

    claim_name(name, "grouped_allgather")
    tensors, comm = list(tensors), _F.comm(process_set)
    labels = [None if name is None else f"{name}.{i}" for i in range(len(tensors))]

    def forward(ts: list[Any]) -> list[Any]:
        return [comm.allgather(t, label) for t, label in zip(ts, labels)]

    def backward(dys: list[Any]) -> list[Any]:
        return [tc.allgather_backward(comm, t, label)(dy)
                for t, label, dy in zip(tensors, labels, dys)]

    return tc.differentiable_group(forward, backward, tensors)


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Any = Compression.none, op: str = Average,
                          process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, name: str | None = None) -> list[Any]:
    """:func:`reducescatter` of several tensors (Horovod's ``grouped_reducescatter``
    signature, plus ``name``), each with :func:`reducescatter`'s gradient.

    Raises:
        ConfigError: for a bad op, a 0-d tensor, or a ``name`` still in flight.
    """
    from plait.adapters import tf_collectives as tc

    tensors = list(tensors)
    for t in tensors:
        _check_scatterable(t)
    claim_name(name, "grouped_reducescatter")
    comm = _F.comm(process_set)
    labels = [None if name is None else f"{name}.{i}" for i in range(len(tensors))]
    factor = (comm.size if op == Sum else 1) * prescale_factor * postscale_factor

    def forward(ts: list[Any]) -> list[Any]:
        return [_F.reducescatter(t, label, op, process_set, prescale_factor, postscale_factor)
                for t, label in zip(ts, labels)]

    def backward(dys: list[Any]) -> list[Any]:
        return [comm.allgather(dy if factor == 1 else dy * factor,
                               None if label is None else f"{label}/grad")
                for dy, label in zip(dys, labels)]

    return tc.differentiable_group(forward, backward, tensors)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None, device_dense: str = "",
                      device_sparse: str = "", compression: Any = Compression.none,
                      op: str | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None,
                      name: str | None = None) -> list[Any]:
    """Reduce several tensors over ranks (Horovod's signature; device arguments are
    ignored): one fused collective per dtype, eagerly and inside graphs (one host op).

    With a compressor other than ``Compression.none`` each tensor is reduced (and
    compressed) on its own, as :func:`allreduce` does. ``tf.IndexedSlices`` in the list
    are reduced as :func:`allreduce` reduces them (allgathered values and indices) and
    come back as ``tf.IndexedSlices``, in their places.

    Raises:
        ConfigError: when an operation of the same ``name`` is still in flight.
        NotImplementedError: with ``tf.IndexedSlices`` in the list and an op other than
            Sum or Average, or pre/postscaling (as Horovod).
    """
    from plait.adapters import tf_collectives as tc
    from plait.adapters.tf_collectives import fused_allreduce

    from .._face_compression import to_plait

    claim_name(name, "grouped_allreduce")
    tensors, how = list(tensors), resolve_op(average, op)
    comm = _F.comm(process_set)
    sparse = [i for i, t in enumerate(tensors) if tc.is_sparse(t)]
    if sparse:
        tc.check_sparse(how, prescale_factor, postscale_factor)
    dense = [i for i in range(len(tensors)) if i not in sparse]
    out: list[Any] = [None] * len(tensors)
    for i in sparse:
        out[i] = tc.sparse_allreduce(comm, tensors[i], how, None if name is None else f"{name}.{i}")
    if not dense:
        return out
    compressor = to_plait(compression)
    if compressor is not None and type(compressor).__name__ != "NoneCompressor":
        for i in dense:
            out[i] = reduce_tensor(comm, tensors[i], how, None if name is None else f"{name}.{i}",
                                   compression, prescale_factor, postscale_factor)
        return out

    def run(ts: list[Any], label: str | None) -> list[Any]:
        outs = fused_allreduce(comm, [scale(t, prescale_factor) for t in ts], how, label)
        return [keep_shape(t, scale(o, postscale_factor)) for t, o in zip(ts, outs)]

    reduced = tc.differentiable_group(lambda ts: run(ts, name),
                                      lambda dys: run(dys, None if name is None else f"{name}/grad"),
                                      [tensors[i] for i in dense])
    for i, r in zip(dense, reduced):
        out[i] = r
    return out


def broadcast_variables(variables: Sequence[Any], root_rank: int, process_set: Any = None,
                        inplace: bool = False) -> Any:
    """Assign ``root_rank``'s values to ``variables`` (tf.Variable or Keras 3) everywhere.

    As Horovod's: eagerly the assignment is done when this returns; inside a graph (a TF1
    ``tf.Graph`` or ``tf.function``) the returned op does it.

    Args:
        variables: ``tf.Variable`` (resource or TF1 ref) or Keras 3 variables.
        root_rank: the global rank whose values are kept.
        process_set: the process set (default: all ranks).
        inplace: Horovod's in-place broadcast; no effect (the result is the same).

    Returns:
        None eagerly; inside a graph the op (``tf.group`` of the assignments) to run.
    """
    if not _executing_eagerly():
        import tensorflow as tf

        return tf.group(*broadcast_(list(variables), root_rank, process_set=process_set))
    comm, root = _F.target(process_set, root_rank)
    tf_optim.broadcast_variables(list(variables), comm, root)
    return None


def broadcast_global_variables(root_rank: int) -> Any:
    """Horovod's TF1 ``broadcast_global_variables``: inside a graph, an op assigning
    ``root_rank``'s values to every global variable.

    Returns:
        The op (``tf.group`` of the assignments), to run in the session.

    Raises:
        RuntimeError: when executing eagerly (as Horovod: there are no global variables;
            use :func:`broadcast_variables`).
    """
    import tensorflow as tf

    if _executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; "
                           "use hvd.broadcast_variables(<model/optimizer variables>, root_rank)")
    return tf.group(*[v.assign(broadcast(v, root_rank, name="global." + v.name.replace(":", ".")))
                      for v in tf.compat.v1.global_variables()])  # ":" is no op name


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """Horovod's TF1 ``BroadcastGlobalVariablesHook``: a ``SessionRunHook`` (for
    ``MonitoredTrainingSession``) that assigns ``root_rank``'s values to every global
    variable once the session is created, after a checkpoint restore. (Horovod 0.28 only
    defines it where TensorFlow still has ``tf.estimator``, gone since TensorFlow 2.16.)

    Args:
        root_rank: the rank whose values every rank takes.
        device: accepted, as Horovod's; the broadcast runs where plait's backend runs it.
        process_set: a ``ProcessSet`` (default: every rank).
    """

    def __init__(self, root_rank: int, device: str = "", process_set: Any = None) -> None:
        super().__init__()
        self.root_rank, self.device, self.process_set = root_rank, device, process_set
        self.bcast_op: Any = None

    def begin(self) -> None:
        """Build the broadcast into the session's graph (again if the graph changed)."""
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            self.bcast_op = (broadcast_global_variables(self.root_rank)
                             if self.process_set is None
                             else broadcast_variables(tf.compat.v1.global_variables(),
                                                      self.root_rank, self.process_set))

    def after_create_session(self, session: Any, coord: Any) -> None:
        """Run the broadcast (every rank creates its session at this point)."""
        session.run(self.bcast_op)


def DistributedGradientTape(  # noqa: N802 - Horovod's name
    gradtape: Any, device_dense: str = "", device_sparse: str = "",
    compression: Any = Compression.none, sparse_as_dense: bool = False, op: str = Average,
    gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
    process_set: Any = None, scale_local_gradients: bool = True, *,
    bucket_mb: float = DEFAULT_BUCKET_MB, memory: Any = None,
) -> tf_optim.DistributedGradientTape:
    """Horovod's ``DistributedGradientTape``: ``gradient()`` returns averaged gradients,
    for ``tf.Variable`` and Keras 3 variables, eagerly and inside ``tf.function``.

    The signature is Horovod 0.28's (no gradient accumulation, as there), plus plait's
    keyword-only ``bucket_mb`` and ``memory``. As in Horovod, a ``tf.IndexedSlices``
    gradient (an embedding's) is allgathered and stays ``tf.IndexedSlices`` unless
    ``sparse_as_dense`` (then, and with an error-feedback ``memory`` or a predivide
    factor, it is reduced dense; Horovod does not compress it either); the
    device arguments have no effect; ``groups`` is validated but fusion follows
    ``bucket_mb``. As Horovod's, the tape has ``register_local_source(variable)`` (that
    gradient stays local) and ``get_local_and_global_gradients``.

    Args:
        gradtape: the ``tf.GradientTape`` that recorded the forward pass.
        device_dense: no effect.
        device_sparse: no effect.
        compression: ``Compression.none``/``fp16``/``bf16`` or any plait compressor.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
        op: Average (default), Sum or Adasum (Horovod backend).
        gradient_predivide_factor: divide before the sum, multiply after.
        num_groups: deprecated form of ``groups``.
        groups: Horovod's explicit allreduce groups (validated only).
        process_set: data-parallel sub-communicator (default: all ranks).
        scale_local_gradients: divide the gradients of local sources by the number of
            ranks (Horovod's default).
        bucket_mb: fusion bucket size in MiB (0: one gradient per allreduce).
        memory: error-feedback memory for ``compression`` (e.g. ``Residual()``).

    Returns:
        The distributed tape.

    Raises:
        ConfigError: for bad groups or factor (a factor other than 1 with an op other
            than Average, as in Horovod), a memory without a compressor, or a
            ``gradtape`` that is not a ``tf.GradientTape``.
    """
    check_predivide(gradient_predivide_factor, op)
    check_groups(groups, num_groups)
    compressor, memory = gradient_compression(compression, memory)
    if outside(process_set):
        return _OutsideSetTape(gradtape, process_set.size(), scale_local_gradients)
    return tf_optim.DistributedGradientTape(
        gradtape, _F.comm(process_set), op=op, compression=compressor, memory=memory,
        bucket_mb=bucket_mb, gradient_predivide_factor=gradient_predivide_factor,
        scale_local_gradients=scale_local_gradients, sparse_as_dense=sparse_as_dense)


class _OutsideSetTape(tf_optim.DistributedGradientTape):
    """The distributed tape of a rank outside its ``process_set``: as Horovod's (its
    ``_allreduce_cond``), the gradients are this rank's own, not reduced; registered
    local sources are still divided by the set's size with ``scale_local_gradients``.

    Args:
        tape: the ``tf.GradientTape`` that recorded the forward pass.
        set_size: the number of ranks of the process set.
        scale_local_gradients: divide the local sources' gradients by ``set_size``.
    """

    def __init__(self, tape: Any, set_size: int, scale_local_gradients: bool) -> None:
        super().__init__(tape, cast(Any, None), scale_local_gradients=scale_local_gradients)
        self._set_size = set_size

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, **kw: Any) -> Any:
        """This rank's gradients of ``target`` w.r.t. ``sources`` (local sources scaled).

        Args:
            target: the value to differentiate.
            sources: the variables (any nest).
            output_gradients: upstream gradients of ``target``, or None.
            **kw: ``tf.GradientTape.gradient``'s other arguments; Horovod's
                ``use_generic_names`` has no effect.

        Returns:
            The gradients, in the structure of ``sources``.
        """
        import tensorflow as tf

        from plait.adapters.tensorflow import unwrap

        kw.pop("use_generic_names", None)
        flat = tf.nest.flatten(sources)
        grads = self._tape.gradient(target, [unwrap(s) for s in flat], output_gradients, **kw)
        size = self._set_size if self._scale_local else 1
        out = [tf_optim._scaled_local(g, size) if tf_optim._key(s) in self._local else g
               for s, g in zip(flat, grads)]
        return tf.nest.pack_sequence_as(sources, out)


def PartialDistributedGradientTape(  # noqa: N802 - Horovod's name
    gradtape: Any, device_dense: str = "", device_sparse: str = "",
    compression: Any = Compression.none, sparse_as_dense: bool = False, op: str = Average,
    gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
    process_set: Any = None, local_layers: Any = None, scale_local_gradients: bool = True, *,
    bucket_mb: float = DEFAULT_BUCKET_MB, memory: Any = None,
) -> tf_optim.DistributedGradientTape:
    """Horovod's ``PartialDistributedGradientTape``: a :func:`DistributedGradientTape`
    whose gradients of the trainable variables of ``local_layers`` are not reduced:
    each rank keeps its own (divided by the number of ranks with
    ``scale_local_gradients``, Horovod's default).

    Args:
        gradtape: the ``tf.GradientTape`` that recorded the forward pass.
        device_dense: no effect.
        device_sparse: no effect.
        compression: as :func:`DistributedGradientTape`.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
        op: Average (default), Sum or Adasum (Horovod backend).
        gradient_predivide_factor: divide before the sum, multiply after.
        num_groups: deprecated form of ``groups``.
        groups: Horovod's explicit allreduce groups (validated only).
        process_set: data-parallel sub-communicator (default: all ranks).
        local_layers: a Keras layer or a list of them whose gradients stay local; None
            (the default) makes this a plain :func:`DistributedGradientTape`.
        scale_local_gradients: divide the local gradients by the number of ranks.
        bucket_mb: fusion bucket size in MiB.
        memory: error-feedback memory for ``compression``.

    Returns:
        The distributed tape, with the local layers' variables registered as local
        sources.

    Raises:
        ConfigError: for ``local_layers`` that are not Keras layers, or as
            :func:`DistributedGradientTape`.
    """
    local = tf_optim.local_layer_variables(local_layers)
    tape = DistributedGradientTape(
        gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
        gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients,
        bucket_mb=bucket_mb, memory=memory)
    for variable in local:
        tape.register_local_source(variable)
    return tape


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any, name: str | None = None, use_locking: bool = False, device_dense: str = "",
    device_sparse: str = "", compression: Any = Compression.none, sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1, op: str = Average, gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
    process_set: Any = None, scale_local_gradients: bool = True, *,
    bucket_mb: float = DEFAULT_BUCKET_MB, memory: Any = None,
) -> Any:
    """Horovod's ``horovod.tensorflow.DistributedOptimizer``: for a Keras 3 optimizer the
    same as :func:`plait.keras.DistributedOptimizer` (``use_locking`` has no effect); a
    TF1 ``tf.compat.v1.train.Optimizer`` gets Horovod's TF1 wrapper, whose
    ``compute_gradients`` reduces the gradients (``backward_passes_per_step`` 1 only).

    Args:
        optimizer: a Keras 3 or TF1 optimizer.
        name: the TF1 wrapper's name; no effect for Keras.
        use_locking: the TF1 wrapper's; no effect for Keras.
        device_dense: no effect.
        device_sparse: no effect.
        compression: ``Compression.none``/``fp16``/``bf16`` or any plait compressor.
        sparse_as_dense: for Keras, reduce ``tf.IndexedSlices`` gradients dense (default:
            allgathered, as Horovod); no effect for TF1.
        backward_passes_per_step: local passes accumulated per reduction and update.
        op: Average (default) or Sum.
        gradient_predivide_factor: divide before the sum, multiply after.
        average_aggregated_gradients: apply the mean of the accumulated passes, not their sum.
        num_groups: deprecated form of ``groups``.
        groups: Horovod's explicit allreduce groups (validated only).
        process_set: data-parallel sub-communicator (default: all ranks).
        scale_local_gradients: no effect.
        bucket_mb: fusion bucket size in MiB.
        memory: error-feedback memory for ``compression``.

    Returns:
        The distributed Keras optimizer.

    Raises:
        ConfigError: a ``gradient_predivide_factor`` other than 1 with an op other than
            Average (as in Horovod), else as :func:`plait.keras.DistributedOptimizer`.
    """
    from plait.adapters.tensorflow import is_legacy_optimizer
    check_predivide(gradient_predivide_factor, op)

    if is_legacy_optimizer(optimizer):
        return _legacy_distributed_optimizer(
            optimizer, name, use_locking, compression, op, gradient_predivide_factor,
            backward_passes_per_step, process_set, scale_local_gradients)
    from .. import keras as keras_face

    return keras_face.DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
        num_groups, groups, process_set, scale_local_gradients, bucket_mb=bucket_mb,
        memory=memory)


def _legacy_distributed_optimizer(optimizer: Any, name: str | None, use_locking: bool,
                                  compression: Any, op: str, gradient_predivide_factor: float,
                                  backward_passes_per_step: int, process_set: Any,
                                  scale_local_gradients: bool) -> Any:
    """Horovod's ``DistributedOptimizer`` for a TF1 ``tf.compat.v1.train.Optimizer``: its
    ``compute_gradients`` returns the gradients reduced over ``process_set`` (in one
    :func:`grouped_allreduce`); a rank outside the set keeps its own, as in Horovod.

    Raises:
        ConfigError: for ``backward_passes_per_step`` other than 1, an op other than
            Average or Sum, or a bad ``gradient_predivide_factor``.
    """
    import tensorflow as tf

    if backward_passes_per_step != 1:
        raise invalid("backward_passes_per_step", backward_passes_per_step,
                      "1 with a TF1 tf.compat.v1.train optimizer (plait accumulates passes for "
                      "Keras optimizers only)")
    if op not in (Average, Sum):
        raise invalid("op", op, "Average or Sum with a TF1 tf.compat.v1.train optimizer")
    if isinstance(gradient_predivide_factor, bool) or not isinstance(
            gradient_predivide_factor, (int, float)) or not gradient_predivide_factor > 0:
        raise invalid("gradient_predivide_factor", gradient_predivide_factor, "a number > 0")
    excluded = outside(process_set)
    base = tf.compat.v1.train.Optimizer

    class _DistributedOptimizer(base):  # type: ignore[misc, valid-type]
        """Horovod's TF1 distributed optimizer: wraps ``optimizer``."""

        def __init__(self) -> None:
            super().__init__(name=name or f"Distributed{type(optimizer).__name__}",
                             use_locking=use_locking)
            self._optimizer = optimizer
            self._local_vars: set[Any] = set()
            self.process_set = process_set

        def register_local_var(self, var: Any) -> None:
            """Keep ``var``'s gradient local (Horovod's ``register_local_var``)."""
            self._local_vars.add(tf_optim._key(var))

        def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
            """The wrapped optimizer's ``(gradient, variable)`` pairs, gradients reduced."""
            pairs = list(self._optimizer.compute_gradients(*args, **kwargs))
            grads = [g for g, _ in pairs]
            shared = [i for i, (g, v) in enumerate(pairs)
                      if g is not None and tf_optim._key(v) not in self._local_vars]
            if shared and not excluded:
                reduced = grouped_allreduce(
                    [grads[i] for i in shared], compression=compression, op=op,
                    prescale_factor=1.0 / gradient_predivide_factor,
                    postscale_factor=float(gradient_predivide_factor), process_set=process_set)
                for i, g in zip(shared, reduced):
                    grads[i] = g
            if scale_local_gradients and self._local_vars:
                n = (process_set.size() if isinstance(process_set, ProcessSet)
                     else _F.comm(process_set).size)
                for i, (g, v) in enumerate(pairs):
                    if g is not None and tf_optim._key(v) in self._local_vars:
                        grads[i] = tf_optim._scaled_local(g, n)
            return [(g, v) for g, (_, v) in zip(grads, pairs)]

        def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                            name: str | None = None) -> Any:
            """The wrapped optimizer's ``apply_gradients``."""
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                   name=name)

        def get_slot(self, *args: Any, **kwargs: Any) -> Any:
            return self._optimizer.get_slot(*args, **kwargs)

        def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
            return self._optimizer.get_slot_names(*args, **kwargs)

        def variables(self, *args: Any, **kwargs: Any) -> Any:
            return self._optimizer.variables(*args, **kwargs)

    return _DistributedOptimizer()


def _raising_tf_errors(fn: Any) -> Any:
    """``fn`` raising TensorFlow's ``FailedPreconditionError`` (as a ``MismatchError``
    subclass) when ranks disagree, as Horovod's TensorFlow ops do."""
    from plait.adapters.tensorflow import tf_errors

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with tf_errors():
            return fn(*args, **kwargs)

    return wrapper


for _name in ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
              "grouped_allreduce", "grouped_allgather", "grouped_reducescatter", "broadcast_",
              "broadcast_variables", "broadcast_global_variables", "barrier", "broadcast_object",
              "allgather_object"):
    globals()[_name] = _raising_tf_errors(globals()[_name])
del _name

#: ``hvd.elastic``: Horovod's elastic mode (``run``, the state objects), and the other
#: submodules Horovod's package has, on first use.
__getattr__ = elastic_attribute(__name__, "plait.collectives.horovod_elastic_tf",
                                ("compression", "functions", "keras", "mpi_ops", "sync_batch_norm", "util"))
