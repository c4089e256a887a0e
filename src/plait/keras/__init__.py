"""Horovod's Keras API on plait (``import plait.keras as hvd``), for Keras 3.

Horovod 0.28's own Keras optimizer silently stops averaging gradients under
Keras 3 ``model.fit``; this one averages them on both backends.
"""

from __future__ import annotations

from typing import Any

from plait.adapters import keras_load, tf_optim
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
    elastic_attribute,
    gradient_compression,
)
from .._face_compression import Compression, Compressor
from .._process_sets import ProcessSet, add_process_set, global_process_set, outside, remove_process_set
from ..errors import HorovodInternalError, invalid
from ..parallel.data import DEFAULT_BUCKET_MB
from ..tensorflow import (
    _executing_eagerly,
    allgather,
    allreduce,
    broadcast,
    broadcast_variables,
    reducescatter,
)
from ..tensorflow import broadcast_global_variables as _global_variables_op
from . import callbacks

__all__ = [
    "Adasum", "Average", "Compression", "Compressor", "DistributedOptimizer",
    "HorovodInternalError", "Max", "Min", "PartialDistributedOptimizer", "Product", "ProcessSet",
    "Sum", "SyncBatchNormalization",
    "add_process_set", "allgather", "allreduce", "backend", "broadcast",
    "broadcast_global_variables", "broadcast_variables", "callbacks", "load_model",
    "cross_rank", "cross_size", "reducescatter",
    "ccl_built", "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled",
    "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "remove_process_set",
    "rocm_built", "sycl_built", "shutdown", "size", "start_timeline", "stop_timeline",
]

_F = Face("tensorflow")
init, shutdown, is_initialized = _F.init, _F.shutdown, _F.is_initialized
rank, size, local_rank, local_size = _F.rank, _F.size, _F.local_rank, _F.local_size
backend, mpi_threads_supported = _F.backend, _F.mpi_threads_supported
cross_rank, cross_size = _F.cross_rank, _F.cross_size
mpi_built, gloo_built, nccl_built, ccl_built = _F.mpi_built, _F.gloo_built, _F.nccl_built, _F.ccl_built
cuda_built, rocm_built, ddl_built, is_homogeneous = (_F.cuda_built, _F.rocm_built, _F.ddl_built,
                                                     _F.is_homogeneous)
mpi_enabled, gloo_enabled, sycl_built = _F.mpi_enabled, _F.gloo_enabled, _F.sycl_built
join, start_timeline, stop_timeline = _F.join, _F.start_timeline, _F.stop_timeline


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
    compression: Any = Compression.none, sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0, op: str = Average, backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
    process_set: Any = None, scale_local_gradients: bool = True, *,
    bucket_mb: float = DEFAULT_BUCKET_MB, memory: Any = None,
) -> Any:
    """Horovod's ``horovod.tensorflow.keras.DistributedOptimizer``, for Keras 3: a copy of
    ``optimizer`` whose ``apply`` (used by ``model.fit`` and ``apply_gradients``) averages
    the gradients across ranks first.

    The signature is Horovod 0.28's, plus plait's keyword-only ``bucket_mb`` and
    ``memory``; an unknown keyword is a ``TypeError``. A ``tf.IndexedSlices`` gradient
    (an embedding's) is allgathered, as Horovod's is, or reduced dense with
    ``sparse_as_dense=True``; ``name`` and the device arguments are
    accepted and have no effect, and ``groups`` / ``num_groups`` are validated but fusion
    follows ``bucket_mb``. Variables given to its ``register_local_var`` keep this rank's
    gradient (see :func:`PartialDistributedOptimizer`).

    Args:
        optimizer: a Keras 3 optimizer.
        name: Horovod's op-name prefix (no effect).
        device_dense: no effect.
        device_sparse: no effect.
        compression: ``Compression.none``/``fp16``/``bf16`` or any plait compressor.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients dense (default: allgathered).
        gradient_predivide_factor: divide before the sum, multiply after.
        op: Average (default) or Sum.
        backward_passes_per_step: local passes accumulated per reduction and update.
        average_aggregated_gradients: apply the mean of the accumulated passes, not their sum.
        num_groups: deprecated form of ``groups``.
        groups: Horovod's explicit allreduce groups (validated; fusion follows ``bucket_mb``).
        process_set: data-parallel sub-communicator (default: all ranks); on a rank
            outside a Horovod ``ProcessSet`` the gradients stay its own, as in Horovod.
        scale_local_gradients: divide the gradients of local variables by the number
            of ranks (Horovod's default).
        bucket_mb: fusion bucket size in MiB (0: one gradient per allreduce).
        memory: error-feedback memory for ``compression`` (e.g. ``Residual()``).

    Returns:
        The distributed optimizer (an instance of a subclass of the optimizer's class).

    Raises:
        ConfigError: for an op other than Average or Sum, bad groups, passes or factor,
            a memory without a compressor, or an optimizer that is not a Keras 3 one.
    """
    if op not in (Average, Sum):
        raise invalid("op", op, "Average or Sum (as in Horovod's Keras optimizer)")
    check_groups(groups, num_groups)
    compressor, memory = gradient_compression(compression, memory)
    return tf_optim.distributed_keras_optimizer(
        optimizer, None if outside(process_set) else _F.comm(process_set), op=op,
        bucket_mb=bucket_mb, compression=compressor,
        memory=memory, backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        gradient_predivide_factor=gradient_predivide_factor,
        scale_local_gradients=scale_local_gradients, sparse_as_dense=sparse_as_dense)


def PartialDistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: Any, name: str | None = None, device_dense: str = "", device_sparse: str = "",
    compression: Any = Compression.none, sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0, op: str = Average, backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False, groups: Any = None, process_set: Any = None,
    local_layers: Any = None, scale_local_gradients: bool = True, *,
    bucket_mb: float = DEFAULT_BUCKET_MB, memory: Any = None,
) -> Any:
    """Horovod's ``PartialDistributedOptimizer``: a :func:`DistributedOptimizer` that
    does not reduce the gradients of the trainable variables of ``local_layers``; each
    rank applies its own (divided by the number of ranks with ``scale_local_gradients``,
    Horovod's default, so that a learning rate scaled by the number of ranks fits them too).

    Args:
        optimizer: a Keras 3 optimizer.
        name: no effect.
        device_dense: no effect.
        device_sparse: no effect.
        compression: as :func:`DistributedOptimizer`.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients dense (default: allgathered).
        gradient_predivide_factor: divide before the sum, multiply after.
        op: Average (default) or Sum.
        backward_passes_per_step: local passes accumulated per reduction and update.
        average_aggregated_gradients: apply the mean of the accumulated passes.
        groups: Horovod's explicit allreduce groups (validated only).
        process_set: data-parallel sub-communicator (default: all ranks).
        local_layers: a Keras layer or a list of them whose gradients stay local; None:
            a plain :func:`DistributedOptimizer`.
        scale_local_gradients: divide the local gradients by the number of ranks.
        bucket_mb: fusion bucket size in MiB.
        memory: error-feedback memory for ``compression``.

    Returns:
        The distributed optimizer, with the local layers' variables registered.

    Raises:
        ConfigError: for ``local_layers`` that are not Keras layers, or as
            :func:`DistributedOptimizer`.
    """
    local = tf_optim.local_layer_variables(local_layers)
    opt = DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients,
        bucket_mb=bucket_mb, memory=memory)
    for variable in local:
        opt.register_local_var(variable)
    return opt


def load_model(filepath: Any, custom_optimizers: Any = None, custom_objects: Any = None,
               compression: Any = Compression.none, legacy_opts: bool = False) -> Any:
    """Horovod's ``load_model``: a saved Keras 3 model (``.keras`` file) whose optimizer
    is replaced by a :func:`DistributedOptimizer` of the same config and state, so
    training resumes data-parallel. Models with :class:`SyncBatchNormalization` load
    without ``custom_objects``.

    Args:
        filepath: the saved model (anything ``keras.models.load_model`` takes).
        custom_optimizers: optimizer classes of the file that are not Keras' own.
        custom_objects: other classes or functions of the file, by name.
        compression: the distributed optimizer's compression.
        legacy_opts: Horovod's switch to Keras 2 legacy optimizers: only False.

    Returns:
        The model (as loaded when it was saved without an optimizer).

    Raises:
        ConfigError: for ``legacy_opts=True`` (Keras 3 has no legacy optimizers), bad
            ``custom_optimizers``/``custom_objects``, or a saved optimizer state that
            does not fit.
    """
    if legacy_opts:
        raise invalid("legacy_opts", legacy_opts, "False (Keras 3 has no legacy optimizers)")
    return keras_load.load_model(
        filepath, lambda opt: DistributedOptimizer(opt, compression=compression),
        custom_optimizers, custom_objects)


def broadcast_global_variables(root_rank: int) -> Any:
    """Horovod's Keras ``broadcast_global_variables``: in a TF1 graph, assign
    ``root_rank``'s values to every global variable, run in the default session.

    Returns:
        The session's result of the broadcast op (None).

    Raises:
        RuntimeError: when executing eagerly (as Horovod) or without a default session
            (Keras 3 has no ``backend.get_session()``: open one with ``with sess.as_default()``
            or use the op of :func:`plait.tensorflow.broadcast_global_variables`).
    """
    session = keras_load.default_session()
    if session is None:  # checked before the op is built: no collective is left unrun
        if _executing_eagerly():
            _global_variables_op(root_rank)  # raises Horovod's error
        raise RuntimeError("hvd.broadcast_global_variables() needs a default tf.compat.v1.Session "
                           "(Keras 3 has no backend session): run it inside `with sess.as_default():`"
                           " or run plait.tensorflow.broadcast_global_variables(root_rank) yourself")
    return session.run(_global_variables_op(root_rank))


#: ``hvd.elastic``: Horovod's elastic mode (``run``, the state objects), on first use.
__getattr__ = elastic_attribute(__name__, "plait.collectives.horovod_elastic_tf")
