"""The Horovod library of a process, as plait's Horovod backend uses it: importing and
starting it (:class:`World`, shared by the world communicator and its groups), its
errors, and tensors handed to it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import BackendUnavailableError, HorovodInternalError, PlaitError, invalid
from plait.protocols import TensorOps

from .abort import reaper_argv
from .horovod_keep import TorchKeeper
from .horovod_rendezvous import clear, scopes, static_store
from .horovod_wait import BlockingWaits
from .outside_watchdog import OutsideWatchdog

if TYPE_CHECKING:
    from .base import CommunicatorBase

__all__ = ["World", "build_info", "finished", "from_numpy", "homogeneous", "horovod_errors",
           "import_library", "mpi_launched", "tf_bitcast", "tf_eager", "tf_value", "torch_dtype"]


def mpi_launched() -> bool:
    """True when an MPI launcher (mpirun, or horovodrun in MPI mode) started this process."""
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


@contextlib.contextmanager
def tf_eager() -> Iterator[None]:
    """Execute TensorFlow eagerly inside: out of a ``tf.function`` being traced
    (``tf.init_scope``), and out of a TF1 graph (eager mode, which ``init_scope`` keeps
    off there)."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    with tf.init_scope():
        if tf.executing_eagerly():
            yield
            return
    with context.eager_mode():
        yield


def build_info(framework: str = "torch") -> dict[str, bool]:
    """What the installed Horovod was built with, like ``horovodrun --check-build``."""
    hvd = import_library(framework)
    return {
        "mpi": bool(hvd.mpi_built()), "gloo": bool(hvd.gloo_built()),
        "nccl": bool(hvd.nccl_built()), "cuda": bool(hvd.cuda_built()),
        "torch": _importable("horovod.torch"), "tensorflow": _importable("horovod.tensorflow"),
    }


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except Exception:
        return False
    return True


def import_library(framework: str) -> Any:
    try:
        if framework == "torch":
            import horovod.torch as hvd
        elif framework == "tensorflow":
            import horovod.tensorflow as hvd
        else:
            raise invalid("framework", framework, '"torch" or "tensorflow"')
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend 'horovod' needs horovod.{framework}, which failed to import ({exc}); "
            "run `make setup` or choose backend='mpi'"
        ) from exc
    return hvd


class World:
    """What the world communicator and its sub-groups share: the library and process sets."""

    def __init__(self, framework: str) -> None:
        if mpi_launched():
            # MPI first, at THREAD_MULTIPLE, by plait also where the script told mpi4py not to
            # start it (Horovod's own tests do): Horovod would start it itself, and finalize
            # it when it shuts down, so the restart that process sets need aborted the job
            from .mpi import start_mpi

            start_mpi()
        self.framework = framework
        self.hvd = import_library(framework)
        # plait names every op anew (a sequence number), so Horovod's response cache
        # would never hit: it filled up and warned of each eviction (after ~1000 ops).
        # Off unless the user sets it.
        os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "0")
        # Horovod with dynamic process sets runs an extra allgather every background cycle,
        # holding the lock that starting an op waits for with the GIL held: a 4.8M-parameter
        # MLP step (2 ranks, mpirun) took 34.6-37.1 ms against 30.1-31.0 ms without, and a
        # rank whose peer died sat in it (30 s, Gloo's timeout) with its Python frozen. So
        # Horovod starts without them (unless the user's HOROVOD_DYNAMIC_PROCESS_SETS=1 asks
        # for them); the first split that needs a process set restarts it with them.
        self.dynamic = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1"
        # a worker of horovodrun's elastic mode: graph ops are named per graph (_graph_name)
        self.elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        self.graph_ops: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self.hvd.init()
        from plait.adapters import adapter

        self.ops: TensorOps = adapter(framework)
        self.sets: dict[tuple[int, ...], Any] = {}
        self.communicators = 0
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        # horovod.torch's handles (horovod.tensorflow has none)
        self.waits = (BlockingWaits(self.hvd.synchronize, "plait-hvd-wait")
                      if framework == "torch" else None)
        self.keeper = (TorchKeeper(self.hvd.mpi_ops._handle_map)
                       if framework == "torch" else None)
        # starting a horovod.torch op keeps the GIL and can block (see _enqueue), and an op
        # inside a TensorFlow graph cannot be interrupted (see _graph_op); after it killed
        # this rank, the guard ends a raw mpirun that cannot end the job
        self.guard = OutsideWatchdog(then=reaper_argv(str(self.hvd.rank())))
        # lets the host call arming a graph op be stateless (see bracketed): made now,
        # eagerly, not while a graph is traced
        self.anchor: Any = None
        if framework == "tensorflow":
            from plait.adapters.tensorflow import graph_anchor

            self.anchor = graph_anchor()

    def worker(self) -> concurrent.futures.ThreadPoolExecutor:
        """One daemon-like thread for blocking library calls that need a timeout."""
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plait-hvd")
        return self._worker

    def restart(self) -> None:
        """Shut the library down and initialise it again (Horovod elastic's reset):
        membership, ranks and sizes may have changed; every process set is gone."""
        self._start_again()
        self.sets.clear()
        self.communicators = 1  # only the world communicator (id 1) survives a restart

    def allow_process_sets(self, comm: CommunicatorBase) -> None:
        """Restart Horovod with dynamic process sets, unless it has them (see
        ``__init__``). Collective over ``comm``, which spans every rank (a
        communicator of fewer ranks is a process set: Horovod has them already).

        Raises:
            PlaitError: on every rank while an op that a rank started is still pending
                (the restart would fail it), or when horovodrun's rendezvous store
                could not be emptied (see :mod:`plait.collectives.horovod_rendezvous`).
        """
        if self.dynamic:
            return
        pending = 0
        if self.keeper is not None:
            pending = sum(not finished(self.hvd, h) for h in self.keeper.handles())
        everyone = comm.allgather_object((os.environ.get("HOROVOD_HOSTNAME", "localhost"),
                                          int(os.environ.get("HOROVOD_LOCAL_RANK", "0")), pending))
        busy = {r: n for r, (_, _, n) in enumerate(everyone) if n}
        if busy:
            raise PlaitError(
                f"split() needs a Horovod process set, which restarts Horovod with dynamic "
                f"process sets, but ops are still pending (rank: count) {busy}: wait for them "
                "first, or start with hvd.init(process_sets='dynamic') "
                "(or HOROVOD_DYNAMIC_PROCESS_SETS=1)")
        store = static_store(os.environ)
        if store is not None:
            failed = None
            if comm.rank == 0:
                try:
                    clear(*store, scopes([(h, lr) for h, lr, _ in everyone]))
                except PlaitError as exc:
                    failed = str(exc)
            # also keeps every rank from starting again before the store is empty
            failed = comm.broadcast_object(failed, root=0)
            if failed is not None:
                raise PlaitError(failed)
        self.dynamic = True
        self._start_again()

    def _start_again(self) -> None:
        """Shut Horovod down, forget what its ops left behind, and initialise it again."""
        self.hvd.shutdown()
        self.guard.clear()  # the ops it bounds ended with the library
        if self.keeper is not None:
            self.keeper.clear()
        self.hvd.init(process_sets="dynamic" if self.dynamic else None)

    def next_id(self) -> int:
        """Id of a new communicator: the same on all its ranks (:meth:`HorovodCommunicator.split`
        first agrees on the count over the parent group), and never reused in this process."""
        self.communicators += 1
        return self.communicators


@functools.cache
def _horovods_error() -> type[Exception]:
    """Horovod's own ``HorovodInternalError`` class."""
    from horovod.common.exceptions import HorovodInternalError as HorovodsError

    return HorovodsError  # type: ignore[no-any-return]


@functools.cache
def _both_internal_errors() -> type[HorovodInternalError]:
    """An error class that ``except`` clauses for plait's and for Horovod's own
    ``HorovodInternalError`` both catch."""
    return type("HorovodInternalError", (HorovodInternalError, _horovods_error()), {
        "__module__": __name__,
        "__doc__": "Horovod's HorovodInternalError, raised by plait's Horovod backend (also "
                   "plait's: ``except hvd.HorovodInternalError`` catches it with either import).",
    })


@contextlib.contextmanager
def horovod_errors() -> Iterator[None]:
    """Raise Horovod's own ``HorovodInternalError`` (a failed op: e.g. Horovod shut down
    after a peer died) as :func:`_both_internal_errors`; other errors pass unchanged.

    ``hvd.elastic.run`` (Horovod's) catches Horovod's class to reset; a script that
    imported plait's face catches plait's.
    """
    try:
        yield
    except _horovods_error() as exc:
        if isinstance(exc, HorovodInternalError):
            raise
        raise _both_internal_errors()(*exc.args) from exc


def finished(hvd: Any, handle: Any) -> bool:
    """Whether horovod.torch's op ``handle`` is over (a handle already waited for and
    cleared counts as over)."""
    try:
        return bool(hvd.poll(handle))
    except ValueError:
        return True


def homogeneous(hvd: Any) -> bool:
    """Horovod's own answer: every host runs the same number of ranks (no collective)."""
    fn = getattr(hvd, "is_homogeneous", None) or hvd.mpi_ops.is_homogeneous
    return bool(fn())


def from_numpy(lib: TensorOps, arr: np.ndarray) -> Any:
    if lib.framework == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(arr).copy())
    import tensorflow as tf

    return tf.convert_to_tensor(arr)


def torch_dtype(name: str) -> Any:
    from plait.adapters.torch import torch_dtype

    return torch_dtype(name)


def tf_value(x: Any) -> Any:
    from plait.adapters.tensorflow import unwrap

    return unwrap(x)


def tf_bitcast(x: Any, dtype: str) -> Any:
    import tensorflow as tf
    from plait.adapters.tensorflow import tf_dtype

    return tf.bitcast(x, tf_dtype(dtype))
