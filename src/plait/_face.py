"""What ``plait.torch`` and ``plait.tensorflow`` share: Horovod's names for the
world communicator and its collectives, translated to plait's Communicator.

Framework-free: each face passes its framework name to :func:`init`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from . import runtime
from .errors import ConfigError, invalid
from .protocols import Communicator, Handle

__all__ = [
    "Adasum", "Average", "Face", "Max", "Min", "Product", "Sum", "check_groups", "elastic_attribute",
    "gradient_compression", "reduce_tensor", "resolve_op",
]

Average, Sum, Adasum, Min, Max, Product = "average", "sum", "adasum", "min", "max", "product"


def reduce_tensor(comm: Communicator, tensor: Any, op: str, name: str | None, compression: Any,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """Horovod's ``allreduce`` semantics: prescale, reduce (compressed when a compressor
    is given and the op is a sum or average), postscale.

    Args:
        comm: the communicator.
        tensor: the tensor.
        op: reduction name.
        name: collective name (also keys the compressor's state).
        compression: a compressor, or ``Compression.none``.
        prescale_factor: multiply before the reduction.
        postscale_factor: multiply after the reduction.

    Returns:
        The reduced tensor.
    """
    from .compression import Compression, compressed_allreduce

    if prescale_factor != 1.0:
        tensor = tensor * prescale_factor
    if compression is Compression.none or compression is None or op not in (Average, Sum):
        out = comm.allreduce(tensor, op, name)
    else:
        out = compressed_allreduce(comm, tensor, name or "allreduce", compression,
                                   average=op == Average)
    return out * postscale_factor if postscale_factor != 1.0 else out


def gradient_compression(compression: Any, memory: Any) -> tuple[Any, Any]:
    """A face's ``compression=`` / ``memory=`` pair, checked as ``DataParallel`` checks it.

    Args:
        compression: ``Compression.none`` (or None) or any plait compressor.
        memory: an error-feedback memory (e.g. ``plait.compression.Residual()``) or None.

    Returns:
        ``(compressor or None, memory or None)``; None for no compression.

    Raises:
        ConfigError: for a memory without a lossy compressor, or an unknown name.
        PlaitTypeError: for a value of another type.
    """
    from .compression import NoneCompressor, check_settings

    compressor, memory = check_settings(compression, memory)
    return (None if isinstance(compressor, NoneCompressor) else compressor), memory


def check_groups(groups: Any, num_groups: int) -> None:
    """Validate Horovod's explicit allreduce grouping (``groups`` / deprecated ``num_groups``).

    plait accepts them for compatibility: grouping only changes how allreduces are
    batched, never the result, and plait fuses gradients by ``bucket_mb`` instead.

    Args:
        groups: None, a positive number of groups, or a list of lists of variables.
        num_groups: Horovod's deprecated spelling of an integer ``groups`` (0: none).

    Raises:
        ConfigError: for a negative ``num_groups`` or a ``groups`` of another kind.
    """
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise invalid("num_groups", num_groups, "an integer >= 0 (deprecated; use groups=)")
    if groups is None:
        return
    if isinstance(groups, list) and all(isinstance(g, (list, tuple)) for g in groups):
        return
    if isinstance(groups, int) and not isinstance(groups, bool) and groups > 0:
        return
    raise invalid("groups", groups, "None, an integer > 0 or a list of lists of variables")


def elastic_attribute(face: str, module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` giving a face Horovod's ``hvd.elastic``, imported on first use
    (it needs horovod; ``import plait.torch`` must not import it).

    Args:
        face: the face module's name (for the error).
        module: the module that ``elastic`` stands for.

    Returns:
        The ``__getattr__`` function.
    """

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook
        if name == "elastic":
            return importlib.import_module(module)
        raise AttributeError(f"module {face!r} has no attribute {name!r}")

    return __getattr__


def resolve_op(average: bool | None, op: str | None, default: str = Average) -> str:
    """Horovod's ``average=`` (deprecated) and ``op=`` arguments, as one op name."""
    if average is not None and op is not None:
        raise ConfigError("specify either average= or op=, not both (average is deprecated)")
    if average is not None:
        return Average if average else Sum
    return default if op is None else op


class _Scaled:
    """A handle whose result is multiplied by a factor (Horovod's postscale)."""

    def __init__(self, handle: Handle, factor: float) -> None:
        self._handle, self._factor = handle, factor

    def wait(self) -> Any:
        return self._handle.wait() * self._factor

    def done(self) -> bool:
        return self._handle.done()


class Face:
    """Horovod's module-level functions, bound to one framework.

    Args:
        framework: "torch" or "tensorflow" (which Horovod library to use on that backend).
    """

    def __init__(self, framework: str) -> None:
        self.framework = framework

    def init(self, comm: Any = None, backend: str | None = None, **kwargs: Any) -> None:
        """Start plait (``hvd.init()``); ``backend`` is "mpi", "horovod" or "auto".

        Raises:
            ConfigError: when ``comm`` (Horovod's list of ranks / MPI communicator) is given;
                use :meth:`Communicator.split` for sub-groups instead.
        """
        if comm is not None:
            raise invalid("comm", comm, "None: plait.torch.init() always starts on all ranks; "
                          "make sub-groups with plait.world().split(color, key)")
        runtime.init(backend, framework=self.framework, **kwargs)

    @staticmethod
    def comm(process_set: Communicator | None = None) -> Communicator:
        return runtime.world() if process_set is None else process_set

    def shutdown(self) -> None:
        runtime.shutdown()

    def is_initialized(self) -> bool:
        return runtime.is_initialized()

    def rank(self) -> int:
        return runtime.world().rank

    def size(self) -> int:
        return runtime.world().size

    def local_rank(self) -> int:
        return runtime.world().local_rank

    def local_size(self) -> int:
        return runtime.world().local_size

    def cross_rank(self) -> int:
        return runtime.world().cross_rank

    def cross_size(self) -> int:
        return runtime.world().cross_size

    def backend(self) -> str:
        """"mpi" or "horovod": what carries the bytes."""
        return runtime.world().backend

    def mpi_threads_supported(self) -> bool:
        from plait.collectives.mpi import thread_level

        return thread_level() == "multiple"

    def allreduce_async(self, tensor: Any, average: bool | None = None, name: str | None = None,
                        op: str | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0,
                        process_set: Communicator | None = None) -> Handle:
        if prescale_factor != 1.0:
            tensor = tensor * prescale_factor
        handle = self.comm(process_set).allreduce_async(tensor, resolve_op(average, op), name)
        return handle if postscale_factor == 1.0 else _Scaled(handle, postscale_factor)

    def allreduce(self, tensor: Any, average: bool | None = None, name: str | None = None,
                  op: str | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, process_set: Communicator | None = None) -> Any:
        return self.allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                    process_set).wait()

    def grouped_allreduce(self, tensors: Sequence[Any], average: bool | None = None,
                          name: str | None = None, op: str | None = None,
                          process_set: Communicator | None = None) -> list[Any]:
        return self.comm(process_set).grouped_allreduce(list(tensors), resolve_op(average, op), name)

    def allgather(self, tensor: Any, name: str | None = None,
                  process_set: Communicator | None = None) -> Any:
        return self.comm(process_set).allgather(tensor, name)

    def allgather_async(self, tensor: Any, name: str | None = None,
                        process_set: Communicator | None = None) -> Handle:
        return self.comm(process_set).allgather_async(tensor, name)

    def broadcast(self, tensor: Any, root_rank: int, name: str | None = None,
                  process_set: Communicator | None = None) -> Any:
        return self.comm(process_set).broadcast(tensor, root_rank, name)

    def broadcast_async(self, tensor: Any, root_rank: int, name: str | None = None,
                        process_set: Communicator | None = None) -> Handle:
        return self.comm(process_set).broadcast_async(tensor, root_rank, name)

    def alltoall(self, tensor: Any, splits: Any = None, name: str | None = None,
                 process_set: Communicator | None = None) -> tuple[Any, Any]:
        if splits is not None and not isinstance(splits, (list, tuple)):
            splits = [int(s) for s in splits]
        return self.comm(process_set).alltoall(tensor, splits, name)  # type: ignore[attr-defined,no-any-return]

    def reducescatter(self, tensor: Any, name: str | None = None, op: str = Average,
                      process_set: Communicator | None = None) -> Any:
        return self.comm(process_set).reducescatter(tensor, op, name)  # type: ignore[attr-defined]

    def barrier(self, process_set: Communicator | None = None) -> None:
        self.comm(process_set).barrier()

    @staticmethod
    def poll(handle: Handle) -> bool:
        return handle.done()

    @staticmethod
    def synchronize(handle: Handle) -> Any:
        return handle.wait()

    def broadcast_object(self, obj: Any, root_rank: int = 0, name: str | None = None,
                         process_set: Communicator | None = None) -> Any:
        return self.comm(process_set).broadcast_object(obj, root_rank)

    def allgather_object(self, obj: Any, name: str | None = None,
                         process_set: Communicator | None = None) -> list[Any]:
        return self.comm(process_set).allgather_object(obj)
