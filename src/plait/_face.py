"""What ``plait.torch`` and ``plait.tensorflow`` share: Horovod's names for the
world communicator and its collectives, translated to plait's Communicator.

Framework-free: each face passes its framework name to :func:`init`.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from plait.collectives.base import MappedHandle

from . import runtime
from ._face_compression import to_plait
from ._process_sets import _is_mpi_comm, communicator, init_process_sets, note_dynamic_env
from .errors import ConfigError, invalid
from .protocols import Communicator, Handle

__all__ = [
    "Adasum", "Average", "Face", "Max", "Min", "Product", "Sum", "check_groups", "check_predivide",
    "elastic_attribute", "elastic_module",
    "Done", "MappedHandle", "gradient_compression", "keep_shape", "num_rank_is_power_2",
    "reduce_tensor", "resolve_op", "scale", "split_list",
]

Average, Sum, Adasum, Min, Max, Product = "average", "sum", "adasum", "min", "max", "product"


def reduce_tensor(comm: Communicator, tensor: Any, op: str, name: str | None, compression: Any,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """Horovod's ``allreduce`` semantics: prescale, reduce (compressed when a compressor
    is given and the op is a sum or average), postscale; a 0-d tensor stays 0-d.

    Args:
        comm: the communicator.
        tensor: the tensor.
        op: reduction name.
        name: collective name (also keys the compressor's state).
        compression: a compressor (Horovod-style or plait's), or ``Compression.none``.
        prescale_factor: multiply before the reduction (integers: truncated, as Horovod).
        postscale_factor: multiply after the reduction.

    Returns:
        The reduced tensor.
    """
    from .compression import NoneCompressor, compressed_allreduce

    compressor = to_plait(compression)
    t = scale(tensor, prescale_factor)
    if compressor is None or isinstance(compressor, NoneCompressor) or op not in (Average, Sum):
        out = comm.allreduce(t, op, name)
    else:
        out = compressed_allreduce(comm, t, name or "allreduce", compressor, average=op == Average)
    return keep_shape(tensor, scale(out, postscale_factor))


def scale(tensor: Any, factor: float) -> Any:
    """``tensor * factor`` in the tensor's dtype, computed as Horovod scales on the CPU:
    16-bit floats in float32, integers in float64 (truncated toward zero).

    Args:
        tensor: a torch, TensorFlow or numpy tensor.
        factor: the factor (1.0: ``tensor`` itself).

    Returns:
        The scaled tensor.
    """
    if factor == 1.0:
        return tensor
    from plait.adapters import ops_for

    ops = ops_for(tensor)
    dtype = ops.dtype_name(tensor)
    if dtype in ("float32", "float64"):
        return tensor * factor
    wide = "float32" if dtype in ("float16", "bfloat16") else "float64"  # Horovod's CPU math
    return ops.cast(ops.cast(tensor, wide) * factor, dtype)


def keep_shape(tensor: Any, out: Any) -> Any:
    """``out`` reshaped to ``()`` when ``tensor`` is 0-d (Horovod keeps 0-d tensors 0-d).

    Args:
        tensor: the input of a collective.
        out: its result.

    Returns:
        ``out``, 0-d when ``tensor`` was.
    """
    from plait.adapters import ops_for

    try:
        ops = ops_for(tensor)
        # a graph's static shape may claim () while the host op returns (1,): reshape anyway
        if ops.shape(tensor) == () and (ops.shape(out) != () or ops.is_symbolic(out)):
            return ops.reshape(out, [])
    except (TypeError, ValueError):  # a symbolic shape of unknown rank
        pass
    return out


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

    compressor, memory = check_settings(to_plait(compression), memory)
    return (None if isinstance(compressor, NoneCompressor) else compressor), memory


def check_predivide(factor: float, op: str) -> None:
    """Refuse Horovod's ``gradient_predivide_factor`` with an op it does not split.

    As in Horovod's optimizers and tapes: the factor divides the gradients before the
    sum and multiplies them after it, which only an Average takes apart.

    Args:
        factor: the ``gradient_predivide_factor``.
        op: the reduction op.

    Raises:
        ConfigError: (a ``ValueError``, as Horovod's) for a factor other than 1 with an op
            other than Average.
    """
    if factor != 1.0 and op != Average:
        raise invalid("gradient_predivide_factor", factor,
                      f"1.0 with op={op!r} (it splits an Average only)")


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


#: ``hvd.elastic`` on the MPI backend: relaunched by ``plait run --elastic``.
_RELAUNCH_ELASTIC = {"plait.collectives.horovod_elastic_torch": "plait.adapters.torch_elastic",
                     "plait.collectives.horovod_elastic_tf": "plait.adapters.keras_elastic"}


def elastic_module(module: str) -> ModuleType:
    """The module that a face's ``hvd.elastic`` stands for now: ``module`` (Horovod's
    elastic mode), or on the MPI backend (or before ``init`` in a job started by
    ``plait run --elastic``) :mod:`plait.adapters.torch_elastic` /
    :mod:`plait.adapters.keras_elastic`. Imported on first use: it needs horovod, and
    ``import plait.torch`` must not import it.

    Args:
        module: the Horovod backend's elastic module for the face.

    Returns:
        The module.
    """
    relaunch = _RELAUNCH_ELASTIC.get(module)
    mpi = (runtime.world().backend == "mpi" if runtime.is_initialized()
           else "PLAIT_ELASTIC_DIR" in os.environ)
    return importlib.import_module(relaunch if relaunch is not None and mpi else module)


def elastic_attribute(face: str, module: str, submodules: Sequence[str] = ()) -> Callable[[str], Any]:
    """A module ``__getattr__`` giving a face Horovod's ``hvd.elastic`` (see
    :func:`elastic_module`) and its other submodules on first use (``hvd.mpi_ops.Sum``, as
    Horovod's package has them), or the names of ``hvd.elastic`` to the face's ``elastic``
    submodule (``from plait.torch.elastic import run``, chosen when each name is read).

    Args:
        face: the face's (or its ``elastic`` submodule's) name.
        module: the Horovod backend's elastic module for the face.
        submodules: the face's submodules other than ``elastic``.

    Returns:
        The ``__getattr__`` function.
    """
    submodule = face.endswith(".elastic")

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook
        if submodule and not name.startswith("__"):
            return getattr(elastic_module(module), name)
        if name == "elastic":
            return elastic_module(module)
        if name in submodules:
            return importlib.import_module(f"{face}.{name}")
        raise AttributeError(f"module {face!r} has no attribute {name!r}")

    return __getattr__


def _every_process(comm: Any) -> bool:
    """Whether Horovod's ``init(comm=...)`` names every process of the job: an mpi4py
    communicator as large as ``COMM_WORLD``, or the list of all ranks (the job's size from
    the launcher's environment)."""
    if _is_mpi_comm(comm):
        from mpi4py import MPI

        return bool(comm.Get_size() == MPI.COMM_WORLD.Get_size())
    size = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("HOROVOD_SIZE")
    try:
        return size is not None and sorted(int(r) for r in comm) == list(range(int(size)))
    except (TypeError, ValueError):
        return False


def split_list(items: Sequence[Any], n: int) -> list[Sequence[Any]]:
    """Horovod's ``split_list``: ``items`` in ``n`` consecutive chunks whose lengths differ
    by at most one (the longer ones first)."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def num_rank_is_power_2(num_rank: int) -> bool:
    """Horovod's ``num_rank_is_power_2`` (``check_num_rank_power_of_2`` in TensorFlow):
    whether ``num_rank`` is a power of two (what Horovod's Adasum needs)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def resolve_op(average: bool | None, op: str | None, default: str = Average) -> str:
    """Horovod's ``average=`` (deprecated) and ``op=`` arguments, as one op name."""
    if average is not None and op is not None:
        raise ConfigError("specify either average= or op=, not both (average is deprecated)")
    if average is not None:
        return Average if average else Sum
    return default if op is None else op


class Done:
    """A handle whose result is already known."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def wait(self) -> Any:
        return self._value

    def done(self) -> bool:
        return True


#: Names of the operations in flight in this process (Horovod's tensor queue is per process),
#: each after its kind, as Horovod names them ("allreduce.NAME"): an allgather may share an
#: allreduce's name.
_IN_FLIGHT: dict[str, _Named] = {}
#: Operations started through the faces so far (the number of the last one).
_STARTED = [0]


class _Named:
    """A handle whose name counts as in flight until it is waited on or polled done."""

    def __init__(self, handle: Handle, name: str) -> None:
        self._handle, self._name = handle, name
        self._finished = False
        self.number = _STARTED[0]  # its own start (see _claim)

    def _release(self) -> None:
        if not self._finished:
            self._finished = True
            if _IN_FLIGHT.get(self._name) is self:
                del _IN_FLIGHT[self._name]

    def wait(self) -> Any:
        try:
            return self._handle.wait()
        finally:
            self._release()

    def done(self) -> bool:
        finished = self._finished or self._handle.done()
        if finished:
            self._release()
        return finished


def _claim(name: str | None, kind: str) -> None:
    """Raise Horovod's ``ValueError`` when an operation of this ``kind`` ("allreduce",
    "allgather"...) and ``name`` is still in flight.

    An operation that completed without being waited on frees its name once an
    operation of another name, or a ``join``, started after it (Horovod frees a name when
    its operation completes; its background cycle makes that at least a cycle after the
    start, so an immediate reuse of the same name always raises, and does here too)."""
    name = None if name is None else f"{kind}.{name}"
    held = _IN_FLIGHT.get(name) if name is not None else None
    if held is not None and held.number < _STARTED[0]:
        try:
            held.done()  # releases the name once complete
        except Exception:  # noqa: BLE001 - it failed: its name is free (its wait raises)
            held._release()
    if name is not None and name in _IN_FLIGHT:
        raise ConfigError(
            f"an operation named {name.split('.', 1)[1]!r} ({kind}) is still in flight (not yet "
            "synchronized); Horovod refuses two concurrent operations with the same name: use "
            "a different name")
    _STARTED[0] += 1


def _named(handle: Handle, name: str | None, kind: str) -> Handle:
    """``handle``, holding ``kind.name`` in flight until it is waited on or polled done."""
    if name is None:
        return handle
    named = _Named(handle, f"{kind}.{name}")
    _IN_FLIGHT[named._name] = named
    return named


class Face:
    """Horovod's module-level functions, bound to one framework.

    Args:
        framework: "torch" or "tensorflow" (which Horovod library to use on that backend).
    """

    def __init__(self, framework: str) -> None:
        self.framework = framework

    def init(self, comm: Any = None, process_sets: Any = None, backend: str | None = None,
             **kwargs: Any) -> None:
        """Start plait (``hvd.init()``); every rank must call it.

        Args:
            comm: None, or what Horovod takes that means every rank: an mpi4py
                communicator of every process, or the list of all ranks (plait always
                starts on all ranks).
            process_sets: Horovod's: None, ``"dynamic"`` or a list of ``ProcessSet``.
            backend: "mpi", "horovod" or "auto" (default: ``PLAIT_BACKEND``).
            **kwargs: ``check`` / ``timeout`` of :func:`plait.init`.

        Raises:
            ConfigError: when ``comm`` (Horovod's list of ranks / MPI communicator) leaves
                out some process (use ``process_sets`` or :meth:`Communicator.split` for
                sub-groups), or for bad process sets.
        """
        if comm is not None and not _every_process(comm):
            raise invalid("comm", comm, f"None, or every process (plait.{self.framework}.init() "
                          "always starts on all ranks); make sub-groups with process_sets= or "
                          "plait.world().split(color, key)")
        note_dynamic_env()
        runtime.init(backend, framework=self.framework, **kwargs)
        init_process_sets(process_sets, comm)

    @staticmethod
    def comm(process_set: Any = None) -> Communicator:
        """The communicator of ``process_set`` (None: every rank)."""
        return communicator(process_set)[0]

    @staticmethod
    def target(process_set: Any, root_rank: int) -> tuple[Communicator, int]:
        """The communicator of ``process_set`` and ``root_rank`` as its group rank.

        As in Horovod, the root of a ``ProcessSet`` operation is a global rank; with a
        plait communicator (from ``split``) it is a rank of that group.

        Raises:
            ConfigError: for a root that is not a member of the set.
        """
        comm, ranks = communicator(process_set)
        if ranks is None:
            return comm, root_rank
        if root_rank not in ranks:
            raise invalid("root_rank", root_rank, f"a global rank of the process set {ranks}")
        return comm, ranks.index(root_rank)

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

    # -- build and capability queries ---------------------------------------------------
    def _backend_name(self) -> str:
        if runtime.is_initialized():
            return runtime.world().backend
        from .config import Config

        return runtime.choose_backend(Config.from_env().backend)

    def _horovod(self) -> Any:
        """The Horovod library the Horovod backend loaded (read from ``sys.modules``:
        only ``plait.collectives`` imports horovod)."""
        framework = getattr(runtime.world(), "framework", self.framework) if (
            runtime.is_initialized()) else self.framework
        lib = sys.modules.get(f"horovod.{framework}")
        if lib is None:  # before init: let the backend module import it
            importlib.import_module("plait.collectives.horovod").build_info(framework)
            lib = sys.modules[f"horovod.{framework}"]
        return lib

    def _query(self, name: str, mpi_answer: Any) -> Any:
        if self._backend_name() == "mpi":
            return mpi_answer
        return getattr(self._horovod(), name)()

    def mpi_built(self) -> bool:
        """Whether the backend can use MPI (MPI backend: True)."""
        return bool(self._query("mpi_built", True))

    def gloo_built(self) -> bool:
        """Whether the backend was built with Gloo (MPI backend: False)."""
        return bool(self._query("gloo_built", False))

    def nccl_built(self) -> int:
        """NCCL version code the backend was built with, 0 without (MPI backend: 0)."""
        return int(self._query("nccl_built", 0))

    def ddl_built(self) -> bool:
        """Whether the backend was built with IBM DDL (MPI backend: False)."""
        return bool(self._query("ddl_built", False))

    def ccl_built(self) -> bool:
        """Whether the backend was built with oneCCL (MPI backend: False)."""
        return bool(self._query("ccl_built", False))

    def sycl_built(self) -> bool:
        """Whether the backend was built with SYCL (Horovod after 0.28, and Intel's fork; a
        Horovod without the query, and the MPI backend: False)."""
        if self._backend_name() == "mpi":
            return False
        query = getattr(self._horovod(), "sycl_built", None)
        return bool(query()) if query is not None else False

    def cuda_built(self) -> bool:
        """Whether the backend has CUDA kernels (MPI backend: False; CUDA tensors are
        staged through host memory)."""
        return bool(self._query("cuda_built", False))

    def rocm_built(self) -> bool:
        """Whether the backend has ROCm kernels (MPI backend: False)."""
        return bool(self._query("rocm_built", False))

    def gpu_available(self, ext_base_name: str = "", verbose: bool = False) -> bool:
        """Horovod's ``gpu_available(ext_base_name)``: whether the backend's library for
        ``ext_base_name`` ("torch", "tensorflow") has GPU kernels, CUDA or ROCm (MPI
        backend: False; ``verbose`` has no effect)."""
        return self.cuda_built() or self.rocm_built()

    def mpi_enabled(self) -> bool:
        """Whether MPI carries this job's collectives now (MPI backend: True)."""
        return bool(self._query("mpi_enabled", True))

    def gloo_enabled(self) -> bool:
        """Whether Gloo carries this job's collectives now (MPI backend: False)."""
        return bool(self._query("gloo_enabled", False))

    def mpi_threads_supported(self) -> bool:
        """Whether MPI runs at ``MPI_THREAD_MULTIPLE`` (mpi4py may be used alongside).

        Raises:
            ConfigError: when MPI is not enabled (a Gloo job), as Horovod raises ``ValueError``.
        """
        if self._backend_name() != "mpi":
            if not self._horovod().mpi_enabled():
                raise ConfigError("Horovod MPI is not enabled (this job runs on Gloo): "
                                  "mpi_threads_supported() has no answer")
        from plait.collectives.mpi import thread_level

        return thread_level() == "multiple"

    def is_homogeneous(self) -> bool:
        """Whether every host runs the same number of ranks (the world communicator
        knows it from its construction: no collective here, nor in ``init``, so a worker
        joining an elastic job runs no call the others do not).

        Raises:
            PlaitError: before ``init``.
        """
        return bool(getattr(runtime.world(), "homogeneous", True))

    def start_timeline(self, file_path: str, mark_cycles: bool = False) -> None:
        """Horovod's dynamic timeline: start writing ``file_path`` (rank 0), as Horovod
        does; it needs ``HOROVOD_TIMELINE=DYNAMIC`` set before ``init``, as in Horovod. On
        the Horovod backend Horovod writes it, on the MPI backend plait in Horovod's
        layout (:mod:`plait.collectives.horovod_timeline`).

        Raises:
            ValueError: when ``HOROVOD_TIMELINE`` was not set before ``init``.
        """
        if self._backend_name() == "mpi":
            from plait.collectives.timeline import horovod_recorder

            horovod_recorder(runtime.world()).start(file_path, mark_cycles)
            return
        self._horovod().start_timeline(file_path, mark_cycles)

    def stop_timeline(self) -> None:
        """End the timeline started by :meth:`start_timeline` (the file stays).

        Raises:
            ValueError: as :meth:`start_timeline`.
        """
        if self._backend_name() == "mpi":
            from plait.collectives.timeline import horovod_recorder

            horovod_recorder(runtime.world()).stop()
            return
        self._horovod().stop_timeline()

    def join(self, device: int = -1) -> int:
        """Horovod's ``join()``: a rank out of data joins; until every rank has joined,
        it contributes zeros to the other ranks' allreduces (an average still divides
        by the whole group's size), and their other collectives raise
        :class:`~plait.errors.MismatchError` meanwhile (torch on both backends,
        TensorFlow on the MPI backend; TensorFlow on the Horovod backend only when
        every rank joins). ``device`` has no effect.

        Returns:
            The global rank that called ``join`` last.
        """
        last = runtime.world().join(device)
        _STARTED[0] += 1  # the operations started before are over: their names may be free
        return last

    # -- collectives -------------------------------------------------------------------------
    def allreduce_async(self, tensor: Any, average: bool | None = None, name: str | None = None,
                        op: str | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, process_set: Any = None) -> Handle:
        _claim(name, "allreduce")
        handle = self.comm(process_set).allreduce_async(scale(tensor, prescale_factor),
                                                        resolve_op(average, op), name)
        handle = MappedHandle(handle, lambda out: keep_shape(tensor, scale(out, postscale_factor)))
        return _named(handle, name, "allreduce")

    def allreduce(self, tensor: Any, average: bool | None = None, name: str | None = None,
                  op: str | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, process_set: Any = None) -> Any:
        return self.allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor,
                                    process_set).wait()

    def grouped_allreduce(self, tensors: Sequence[Any], average: bool | None = None,
                          name: str | None = None, op: str | None = None,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          process_set: Any = None) -> list[Any]:
        _claim(name, "grouped_allreduce")
        tensors = list(tensors)
        outs = self.comm(process_set).grouped_allreduce(
            [scale(t, prescale_factor) for t in tensors], resolve_op(average, op), name)
        return [keep_shape(t, scale(o, postscale_factor)) for t, o in zip(tensors, outs)]

    def allgather_async(self, tensor: Any, name: str | None = None,
                        process_set: Any = None) -> Handle:
        _claim(name, "allgather")
        return _named(self.comm(process_set).allgather_async(tensor, name), name, "allgather")

    def allgather(self, tensor: Any, name: str | None = None, process_set: Any = None) -> Any:
        return self.allgather_async(tensor, name, process_set).wait()

    def grouped_allgather(self, tensors: Sequence[Any], name: str | None = None,
                          process_set: Any = None) -> list[Any]:
        """Allgather several tensors (started together, waited together)."""
        _claim(name, "grouped_allgather")
        comm = self.comm(process_set)
        handles = [comm.allgather_async(t, None if name is None else f"{name}.{i}")
                   for i, t in enumerate(tensors)]
        return [h.wait() for h in handles]

    def broadcast_async(self, tensor: Any, root_rank: int, name: str | None = None,
                        process_set: Any = None) -> Handle:
        _claim(name, "broadcast")
        comm, root = self.target(process_set, root_rank)
        handle = MappedHandle(comm.broadcast_async(tensor, root, name),
                         lambda out: keep_shape(tensor, out))
        return _named(handle, name, "broadcast")

    def broadcast(self, tensor: Any, root_rank: int, name: str | None = None,
                  process_set: Any = None) -> Any:
        return self.broadcast_async(tensor, root_rank, name, process_set).wait()

    def alltoall(self, tensor: Any, splits: Any = None, name: str | None = None,
                 process_set: Any = None) -> Any:
        """Horovod's ``alltoall``: the received tensor, and with ``splits`` given also the
        received splits (an int32 tensor of the tensor's framework); without ``splits``
        the first dimension is split evenly."""
        _claim(name, "alltoall")
        given = splits
        if splits is not None and not isinstance(splits, (list, tuple)):
            splits = [int(s) for s in splits]
        out, received = self.comm(process_set).alltoall(tensor, splits, name)  # type: ignore[attr-defined]
        if given is None:
            return out
        from plait.adapters import ops_for

        ops = ops_for(tensor)
        if isinstance(received, list):
            import numpy as np

            received = ops.from_numpy(np.asarray(received, dtype=np.int32),
                                      ops.zeros([len(received)], "int32", tensor))
        return out, received

    def alltoall_async(self, tensor: Any, splits: Any = None, name: str | None = None,
                       process_set: Any = None) -> Handle:
        """:meth:`alltoall` as a handle (plait runs it at call time)."""
        return Done(self.alltoall(tensor, splits, name, process_set))

    def reducescatter_async(self, tensor: Any, name: str | None = None, op: str = Average,
                            process_set: Any = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0) -> Handle:
        """Reduce over the ranks and keep this rank's rows; Horovod's rule gives the first
        ``rows % size`` ranks one extra row.

        Raises:
            NotImplementedError: for ``Adasum`` (a ``RuntimeError``, as Horovod's error).
        """
        if op == Adasum:
            raise NotImplementedError("reducescatter supports Average and Sum (and, on the MPI "
                                      "backend, Min, Max and Product), not Adasum, as in Horovod")
        _claim(name, "reducescatter")
        comm = self.comm(process_set)
        start = getattr(comm, "reducescatter_async", None)
        t = scale(tensor, prescale_factor)
        handle = (start(t, op, name) if start is not None
                  else Done(comm.reducescatter(t, op, name)))  # type: ignore[attr-defined]
        if postscale_factor != 1.0:
            handle = MappedHandle(handle, lambda out: scale(out, postscale_factor))
        return _named(handle, name, "reducescatter")

    def reducescatter(self, tensor: Any, name: str | None = None, op: str = Average,
                      process_set: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0) -> Any:
        return self.reducescatter_async(tensor, name, op, process_set, prescale_factor,
                                        postscale_factor).wait()

    def grouped_reducescatter(self, tensors: Sequence[Any], name: str | None = None,
                              op: str = Average, process_set: Any = None,
                              prescale_factor: float = 1.0,
                              postscale_factor: float = 1.0) -> list[Any]:
        """:meth:`reducescatter` of several tensors."""
        _claim(name, "grouped_reducescatter")
        return [self.reducescatter(t, None if name is None else f"{name}.{i}", op, process_set,
                                   prescale_factor, postscale_factor)
                for i, t in enumerate(tensors)]

    def barrier(self, process_set: Any = None) -> None:
        self.comm(process_set).barrier()

    @staticmethod
    def poll(handle: Handle) -> bool:
        return handle.done()

    @staticmethod
    def synchronize(handle: Handle) -> Any:
        return handle.wait()

    def broadcast_object(self, obj: Any, root_rank: int = 0, name: str | None = None,
                         process_set: Any = None) -> Any:
        comm, root = self.target(process_set, root_rank)
        return comm.broadcast_object(obj, root)

    def allgather_object(self, obj: Any, name: str | None = None,
                         process_set: Any = None) -> list[Any]:
        return self.comm(process_set).allgather_object(obj)
