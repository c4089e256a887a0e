"""Horovod backend: plait's Communicator over Horovod (the only module importing horovod).

One Horovod library serves the process: ``horovod.torch`` for a PyTorch job,
``horovod.tensorflow`` for a TensorFlow job. Tensors of another framework (and
numpy arrays) cross through host memory. Horovod 0.28's CPU ops have no
bfloat16, no bool and no 8/16-bit integer reductions, so plait reduces those
in float32 / int32 and moves bfloat16 as its 16-bit pattern and bool as uint8.
Horovod has no point-to-point messages: ``send``/``recv`` use MPI when the job
was started by an MPI launcher and raise ``NotImplementedError`` otherwise.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import re
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from plait.errors import (
    BackendUnavailableError,
    CollectiveTimeoutError,
    HorovodInternalError,
    MismatchError,
    PlaitError,
    invalid,
)
from plait.protocols import Handle, Tensor, TensorOps

from .abort import reaper_argv
from .base import CommunicatorBase, Done, Pending, check_splits
from .check import Call, agreed, encode, mismatch
from .horovod_keep import TorchKeeper
from .horovod_rendezvous import clear, scopes, static_store
from .horovod_wait import HOROVOD_WAIT, BlockingWaits, spin, wait_ticking
from .outside_watchdog import OutsideWatchdog

__all__ = ["HorovodCommunicator", "build_info", "mpi_launched"]

# Horovod 0.28's CPU reductions take float16/32/64 and int32/64 only; its
# data-moving ops also take int8, uint8 and int16.
_CARRY_REDUCE = {"bfloat16": "float32", "bool": "int32", "int8": "int32", "uint8": "int32",
                 "int16": "int32", "uint16": "int32"}
_CARRY_MOVE = {"bfloat16": "int16", "uint16": "int16", "bool": "uint8"}  # (horovod.torch: no uint16)
_BOOL_OPS = {"sum": "max", "max": "max", "min": "min", "product": "min"}


def mpi_launched() -> bool:
    """True when an MPI launcher (mpirun, or horovodrun in MPI mode) started this process."""
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


@contextlib.contextmanager
def _tf_eager() -> Iterator[None]:
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
    hvd = _import(framework)
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


def _import(framework: str) -> Any:
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


class _World:
    """What the world communicator and its sub-groups share: the library and process sets."""

    def __init__(self, framework: str) -> None:
        if mpi_launched():
            # MPI first, at THREAD_MULTIPLE, by plait also where the script told mpi4py not to
            # start it (Horovod's own tests do): Horovod would start it itself, and finalize
            # it when it shuts down, so the restart that process sets need aborted the job
            from .mpi import start_mpi

            start_mpi()
        self.framework = framework
        self.hvd = _import(framework)
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

    def allow_process_sets(self, comm: HorovodCommunicator) -> None:
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
            pending = sum(not _finished(self.hvd, h) for h in self.keeper.handles())
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


class _TorchCheck:
    """An agreement check started in horovod.torch: a MIN allreduce of a call's digest.

    Args:
        comm: the communicator that started it.
        call: what this rank called.
        name: the check's Horovod op name.
        handle: Horovod's handle of the check.
        digest: the check's input tensor (kept alive while Horovod reads it).
    """

    def __init__(self, comm: HorovodCommunicator, call: Call, name: str, handle: Any,
                 digest: Any) -> None:
        self.comm, self.call, self.name, self.handle, self.digest = comm, call, name, handle, digest

    def agrees(self, lo: Any) -> bool:
        """Whether the reduced digest ``lo`` says every rank made this call."""
        return agreed(np.asarray(self.comm._w.ops.to_numpy(lo)))

    def verify(self, lo: Any) -> None:
        """Raise :class:`~plait.errors.MismatchError` (on every rank: all of them see the
        same ``lo``) unless ``lo`` agrees; None: known to differ."""
        if lo is None or not self.agrees(lo):  # several checks may be in flight: report this one
            comm = self.comm
            raise mismatch(self.call, lambda row: comm._raw_allgather_rows(row, self.name),
                           f"the {comm.backend} communicator of size {comm.size}")


class HorovodCommunicator(CommunicatorBase):
    """:class:`~plait.protocols.Communicator` over Horovod.

    Args:
        framework: "torch" or "tensorflow": which Horovod library to initialise.
        check: verify before each collective that all ranks make the same call.
        timeout: seconds to wait for the other ranks at the agreement check.
    """

    backend = "horovod"

    def __init__(self, framework: str = "torch", *, check: bool = True, timeout: float = 300.0,
                 _world: _World | None = None, _set: Any = None, _mpi: Any = None) -> None:
        super().__init__(check=check, timeout=timeout)
        self._w = _world if _world is not None else _World(framework)
        self.framework = self._w.framework
        hvd = self._w.hvd
        self._hvd = hvd
        self._set = hvd.global_process_set if _set is None else _set
        self.rank = int(self._set.rank())
        self.size = int(self._set.size())
        self._cid = self._w.next_id()
        self._seq = 0
        self._checks = 0  # agreement checks so far: one per call, whatever the call
        self._joins = 0  # join() calls so far (names the counters' resync after each)
        self.adasum = True
        if _world is None and mpi_launched():
            from .mpi import MPICommunicator

            _mpi = MPICommunicator(check=check, timeout=timeout)
        self._mpi = _mpi
        if _world is None and _mpi is None:
            from .abort import install

            # no MPI_Abort without MPI: a rank dying of an uncaught timeout or mismatch
            # exits at once instead of hanging in Horovod's shutdown
            install(mpi=False)
        if _set is None:
            self.local_rank, self.local_size = int(hvd.local_rank()), int(hvd.local_size())
            self.cross_rank, self.cross_size = int(hvd.cross_rank()), int(hvd.cross_size())
            self.homogeneous = _homogeneous(hvd)
        else:
            self._topology()
        self._ops_map = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min,
                         "max": hvd.Max, "product": hvd.Product, "adasum": hvd.Adasum}

    def reset(self) -> None:
        """Restart Horovod and rebind this world communicator to the new membership.

        Used by Horovod's elastic mode (:mod:`plait.collectives.horovod_elastic`) after
        workers were added or removed: every surviving and new worker calls it at the
        same point, so op names (counted from zero again) agree on all ranks. Objects
        holding this communicator (optimizers, callbacks) keep working; groups made
        by :meth:`split` before the reset are invalid, and so are handles started
        before it (``generation`` counts the resets: holders of handles drop those of
        an older generation).

        Raises:
            NotImplementedError: on a group made by :meth:`split`, or under mpirun
                (Horovod elastic runs on Gloo, started by horovodrun).
        """
        if self._cid != 1 or self._mpi is not None:
            raise NotImplementedError(
                "reset() restarts Horovod for the world communicator of a horovodrun (Gloo) "
                f"job; this is communicator {self._cid}"
                + (" of an mpirun job" if self._mpi is not None else ""))
        self._w.restart()
        self._set = self._hvd.global_process_set
        self.rank, self.size = int(self._hvd.rank()), int(self._hvd.size())
        self.local_rank, self.local_size = int(self._hvd.local_rank()), int(self._hvd.local_size())
        self.cross_rank, self.cross_size = int(self._hvd.cross_rank()), int(self._hvd.cross_size())
        self.homogeneous = _homogeneous(self._hvd)
        self._seq = self._checks = self._joins = 0
        self.generation += 1

    def live_size(self) -> Any:
        """This group's size as a TensorFlow op that reads it each time the graph runs
        (Horovod's ``size_op``): a graph of a Horovod elastic job keeps running after
        workers joined or left.

        Returns:
            A 0-d int32 tensor.

        Raises:
            NotImplementedError: on a torch communicator.
        """
        if self.framework != "tensorflow":
            raise NotImplementedError("live_size() is a TensorFlow op; this communicator "
                                      f"runs horovod.{self.framework}")
        from horovod.tensorflow.mpi_ops import size_op

        return size_op(process_set_id=self._set.process_set_id)

    def _name(self, kind: str, name: str | None = None) -> str:
        """A name for the next Horovod op, equal on every rank of this communicator.

        Horovod matches ops across ranks by name; its own default names count every
        op of the process, which drifts apart once ranks use different process sets.
        """
        self._seq += 1
        return f"plait.{self._cid}.{self._seq}.{kind}" + ("" if name is None else f".{name}")

    def _graph_name(self, name: str) -> str:
        """The name of an op built into a TensorFlow graph in a Horovod elastic job, in place
        of ``name`` (made by :meth:`_name`): numbered within the traced function, not in this
        communicator's sequence, which it leaves as it was.

        A worker that joined traces the user's ``tf.function`` alone, while the others run
        the graph they traced before; its ops must get the names theirs got, and the ops
        it runs eagerly afterwards too. So graph ops are numbered per traced function, in
        the order the trace builds them, and named after the functions that enclose them
        (a loop's or a branch's body, which TensorFlow names with a process-wide counter,
        counts in its function). A function traced again starts its count again: a worker
        that joined traces a nested function once more where its first trace creates
        variables (Keras' ``one_step_on_data`` when the optimizer's were not built yet),
        the others did not. As the other workers do not trace with it, the ops are not
        checked when built: a mismatch meets in Horovod's coordinator (its error), or
        times out in the graph's watchdog.
        """
        import tensorflow as tf
        from tensorflow.python.ops.control_flow_v2_func_graphs import ControlFlowFuncGraph

        self._seq -= 1
        graph = tf.compat.v1.get_default_graph()
        functions = []  # the graphs of the enclosing functions, innermost first
        while True:
            if not isinstance(graph, ControlFlowFuncGraph):
                functions.append(graph)
            outer = getattr(graph, "outer_graph", None)
            if outer is None or not hasattr(outer, "outer_graph"):  # graph is the outermost
                break
            graph = outer
        if not functions:  # a branch built into a TF1 graph
            functions.append(graph.outer_graph)
        count = self._w.graph_ops.get(functions[0], 0) + 1
        self._w.graph_ops[functions[0]] = count
        base = ".".join(re.sub(r"[^A-Za-z0-9_]", "_", str(getattr(g, "name", "graph")))
                        for g in reversed(functions))
        return f"plait.{self._cid}.{base}.{count}.{name.split('.', 3)[3]}"

    def _check_name(self) -> str:
        """The name of the next agreement check: numbered apart from the data ops, so
        the checks of ranks that make different calls still meet (and report it)."""
        self._checks += 1
        return f"plait.{self._cid}.check{self._checks}"

    # -- conversion to and from the library's framework ----------------------------------
    def _native(self, ops: TensorOps, tensor: Tensor, carry: str | None) -> Any:
        lib = self._w.ops
        if ops.framework == lib.framework:
            # Horovod's torch ops need contiguous memory (autograd hands in expanded views)
            t = tensor.contiguous() if ops.framework == "torch" else _tf_value(tensor)
            if carry is None:
                return t
            if carry == "int16" and lib.framework == "torch":
                return t.view(_torch_dtype("int16"))
            return lib.cast(t, carry) if carry != "int16" else _tf_bitcast(t, "int16")
        arr = ops.to_numpy(tensor)
        if carry == "float32" and ops.dtype_name(tensor) == "bfloat16":
            from plait.adapters.numpy import bf16_to_f32

            arr = bf16_to_f32(arr)
        elif carry == "int16":
            arr = arr.view(np.int16)
        elif carry is not None:
            arr = arr.astype(carry)
        return _from_numpy(lib, arr)

    def _back(self, ops: TensorOps, result: Any, like: Tensor, dtype: str, carry: str | None) -> Any:
        lib = self._w.ops
        if ops.framework == lib.framework:
            if carry is None:
                return result
            if carry == "int16" and lib.framework == "torch":
                return result.view(_torch_dtype(dtype))
            return lib.cast(result, dtype) if carry != "int16" else _tf_bitcast(result, dtype)
        arr = lib.to_numpy(result)
        if dtype == "bfloat16" and carry == "float32":
            from plait.adapters.numpy import f32_to_bf16

            arr = f32_to_bf16(arr)
        elif carry == "int16":
            arr = arr.view(np.uint16 if dtype in ("bfloat16", "uint16") else np.float16)
        elif carry is not None:
            arr = arr.astype(bool if dtype == "bool" else dtype)
        return ops.from_numpy(np.ascontiguousarray(arr), like)

    def _start(self, fn: str, call: Call, finish: Callable[[Any], Any], *args: Any,
               inplace: bool = False, **kwargs: Any) -> Handle:
        """Start the library's ``fn`` (allreduce, allgather, broadcast, alltoall,
        reducescatter) and return a handle whose ``wait()`` is bounded by ``self.timeout``.

        With the check on, the agreement check's tiny allreduce is started first and
        the data op right behind it, so Horovod negotiates both in one coordinator
        cycle (a check waited for before the op would cost a whole extra cycle);
        ``wait()`` verifies the check before it returns the data, so a mismatch still
        raises :class:`~plait.errors.MismatchError` on every rank, also when the
        mismatched data ops never meet in Horovod (an op left pending then).

        torch: Horovod's ``{fn}_async`` handle, polled. TensorFlow: eager ops run on the
        one worker thread (in order); graph ops (inside ``tf.function``) are built here,
        checked once when the graph is built.

        Args:
            fn: the library function's name.
            call: what this rank calls (named if the wait times out).
            finish: turns the library's result into the caller's.
            *args: the library function's positional arguments.
            inplace: torch: start ``{fn}_async_`` (the result overwrites the input).
            **kwargs: its keyword arguments (``name`` names the op in the timeout message).

        Returns:
            The handle.
        """
        hvd = self._hvd
        if self.framework != "torch" and any(self._w.ops.is_symbolic(a) for a in args[:1]):
            if self._w.elastic:
                kwargs["name"] = self._graph_name(str(kwargs["name"]))
            else:
                self._verify(call)  # once, when the graph is built
            what = f"{call.describe()} (Horovod op {kwargs.get('name')!r})"
            return Done(finish(self._graph_op(fn, what, *args, **kwargs)))
        what = f"{call.describe()} (Horovod op {kwargs.get('name')!r})"
        if self.framework == "torch":
            check = self._check_torch(call)
            started = self._enqueue(f"{fn}_async_" if inplace else f"{fn}_async", what, *args,
                                    **kwargs)
            result: list[Any] = []

            def done() -> bool:
                return bool(hvd.poll(started)) and (check is None or bool(hvd.poll(check.handle)))

            return Pending(done, lambda: result.append(self._wait_torch(started, what, check)),
                           lambda: finish(result[0]), (started, check))
        checked = self._check_async(call)
        future = self._w.worker().submit(getattr(hvd, fn), *args, **kwargs)

        def wait_tf() -> None:
            checked.wait()
            self._wait_future(future, what)

        return Pending(lambda: future.done() and checked.done(), wait_tf,
                       lambda: finish(future.result()), None)

    def _check_async(self, call: Call) -> Handle:
        """Start the agreement check of ``call``; the handle's ``wait()`` raises
        :class:`~plait.errors.MismatchError` on every rank when the calls differ, and
        :class:`~plait.errors.CollectiveTimeoutError` when the others do not arrive.

        torch: a MIN allreduce of the call's digest (see
        :func:`~plait.collectives.check.verify`) started now, so it shares a Horovod
        cycle with the data op started next. TensorFlow: checked at once, through MPI
        where the job has it (no TensorFlow op, so nothing touches the caller's graph),
        else through Horovod (horovodrun --gloo); horovod.tensorflow's eager ops on two
        threads at once mix up their names, so a check cannot run beside a data op.
        """
        if not (self.check and self.size > 1):
            return Done(None)
        if self.framework != "torch":
            if self._mpi is not None:
                self._call = call
                self._mpi.timeout = self.timeout  # the caller may have changed it
                try:
                    self._mpi._verify(call)
                except MismatchError:  # a data op names itself first, an object call not
                    counts = self._mpi.allgather_object((self._seq, self._checks))
                    self._seq, self._checks = (max(c) for c in zip(*counts))
                    raise
            else:
                super()._verify(call)
            return Done(None)
        check = self._check_torch(call)
        if check is None:
            return Done(None)
        return Pending(lambda: bool(self._hvd.poll(check.handle)),
                       lambda: check.verify(self._wait_torch(check.handle)), lambda: None, check)

    def _check_torch(self, call: Call) -> _TorchCheck | None:
        """Start the agreement check of ``call`` in horovod.torch (None with the check off)."""
        if not (self.check and self.size > 1):
            return None
        self._call = call
        digest = _from_numpy(self._w.ops, encode(call))
        name = self._check_name()
        h = self._enqueue("allreduce_async_", f"the agreement check {name!r}", digest, op=self._hvd.Min,
                          name=name, process_set=self._set)
        return _TorchCheck(self, call, name, h, digest)

    def _verify(self, call: Call) -> None:
        self._check_async(call).wait()

    def _enqueue(self, fn: str, what: str, *args: Any, **kwargs: Any) -> Any:
        """Start horovod.torch's ``fn``, bounded by ``self.timeout`` from outside.

        The call keeps the GIL and waits for a lock that Horovod's background loop
        holds while it negotiates with the other ranks: with a rank stopped or stuck
        it never returns, and no Python thread can run to time it out. So it runs
        armed in the process's :class:`OutsideWatchdog`, which prints the timeout
        message and kills this rank when the call outlives ``self.timeout`` (the
        launcher then ends the job). The tensors handed over stay referenced from C++
        until the op is over (:class:`~plait.collectives.horovod_keep.TorchKeeper`), and
        Horovod's ``HorovodInternalError`` comes out as one that plait's class catches too.

        Args:
            fn: the library function's name (``allreduce_async``...).
            what: names the op in the message.
            *args: the function's positional arguments.
            **kwargs: its keyword arguments.

        Returns:
            Horovod's handle.
        """
        guard, keeper = self._w.guard, self._w.keeper
        key = guard.arm(self.timeout, self._kill_message(
            f"Horovod to start {what}: the call holds the GIL while Horovod's background loop "
            "waits for a rank that is stopped, stuck or unreachable"))
        views = keeper.before(args) if keeper is not None else []
        try:
            with _horovod_errors():
                handle = getattr(self._hvd, fn)(*args, **kwargs)
        finally:
            guard.disarm(key)
        if keeper is not None:
            keeper.started(handle, views)
        return handle

    def _graph_op(self, fn: str, what: str, *args: Any, **kwargs: Any) -> Any:
        """Build horovod.tensorflow's ``fn`` into the graph being built, bounded by
        ``self.timeout`` from outside.

        The op waits in a TensorFlow kernel for the other ranks, and nothing in Python
        can end that wait: each time the graph runs, the op is armed in the process's
        :class:`OutsideWatchdog` just before it starts and disarmed once its outputs
        are computed (host calls in the graph, see
        :func:`plait.adapters.tensorflow.bracketed`). The bound is the communicator's
        timeout when the graph runs, not when it was built.

        Args:
            fn: the library function's name (``allreduce``, ``grouped_allreduce``...).
            what: names the op in the message.
            *args: the function's positional arguments.
            **kwargs: its keyword arguments.

        Returns:
            The op's outputs.
        """
        from plait.adapters.tensorflow import bracketed

        guard, key = self._w.guard, object()  # one key per op built: a failed run left it armed

        def arm() -> None:
            guard.arm(self.timeout, self._kill_message(
                f"the other ranks to reach {what} inside a TensorFlow graph, where the wait "
                "cannot be interrupted; some rank is dead, stuck (or its host unreachable) or "
                "calling something else"), key)

        return bracketed(lambda first: getattr(self._hvd, fn)(first, *args[1:], **kwargs),
                         args[0], arm, lambda: guard.disarm(key), self._w.anchor)

    def _kill_message(self, waited_for: str) -> str:
        """What the outside watchdog prints when it ends this rank after waiting for
        ``waited_for`` (read at arming time: the timeout then)."""
        return (f"plait: rank {self.rank}: plait.errors.CollectiveTimeoutError: waited "
                f"{self.timeout:g}s for {waited_for}; ending this rank (SIGKILL)")

    def _wait_torch(self, started: Any, what: str | None = None,
                    check: _TorchCheck | None = None) -> Any:
        """``hvd.synchronize(started)``, raising :class:`CollectiveTimeoutError` after
        ``self.timeout`` seconds (Horovod's own wait has no timeout).

        With ``check``, its agreement check is waited for first, in the same hand-off
        to the waiting thread (each hand-off costs a thread wake-up and the GIL); when
        the calls differ, ``started`` is not waited for (it may never complete) and
        :class:`~plait.errors.MismatchError` is raised.
        """
        hvd = self._hvd

        def finish(ready: Callable[[Any], None]) -> Any:
            """The check's verdict, then the op's result; ``ready(handle)`` waits before
            each ``synchronize`` (which blocks by itself)."""
            if check is not None:
                ready(check.handle)
                if not check.agrees(hvd.synchronize(check.handle)):
                    return check  # the calls differ: ``started`` may never complete
            ready(started)
            return hvd.synchronize(started)

        def block(handle: Any) -> Any:
            return finish(lambda h: None)

        try:
            with _horovod_errors():
                if hvd.poll(started) and (check is None or hvd.poll(check.handle)):
                    out = block(started)
                elif self._mpi is None:  # horovodrun --gloo: poll here (see ``spin``)
                    deadline = time.monotonic() + self.timeout
                    out = finish(lambda h: spin(lambda: bool(hvd.poll(h)), deadline))
                else:  # blocked in Horovod's own wait, on another thread, ticking: in an MPI
                    # job polling here took CPU from Horovod's background thread (3.5 ms of an
                    # 11 ms allreduce)
                    out = self._w.waits.wait(started, self.timeout,  # type: ignore[union-attr]
                                             self._tick(), block=block)
        except TimeoutError:
            raise self._timed_out(what) from None
        if check is not None and out is check:
            check.verify(None)
        keeper = self._w.keeper
        if keeper is not None:
            keeper.done((started,) if check is None else (started, check.handle))
        return out

    def _tick(self) -> Callable[[], None] | None:
        """What a wait calls now and then: in an MPI job, answer ranks that timed out
        and ask where this rank waits (see :meth:`_timed_out`)."""
        mpi = self._mpi
        return None if mpi is None else (lambda: mpi.answer(HOROVOD_WAIT))

    def _wait_future(self, future: concurrent.futures.Future[Any], what: str | None) -> Any:
        """The result of an op running on the worker thread, waited for at most
        ``self.timeout`` seconds."""
        if not wait_ticking(lambda t: not concurrent.futures.wait([future], t).not_done,
                            self.timeout, self._tick()):
            raise self._timed_out(what)
        return future.result()

    # -- raw primitives ------------------------------------------------------------------
    def _eager(self) -> contextlib.AbstractContextManager[Any]:
        """Run raw primitives eagerly, also while a ``tf.function`` is traced (so the
        agreement check of a graph op happens once, when the graph is built) and while
        a TF1 ``tf.Graph`` is the default (its tensors cannot reach Horovod's eager ops)."""
        if self.framework != "tensorflow":
            return contextlib.nullcontext()
        return _tf_eager()

    def _timed_out(self, what: str | None = None) -> CollectiveTimeoutError:
        """The timeout error, naming ``what`` was waited for (default: the agreement
        check of the last call checked)."""
        if what is None:
            what = ("the agreement check of " + self._call.describe() if self._call is not None
                    else "a collective")
        head = f"{self!r}: waited {self.timeout:g}s for the other ranks to reach {what}; "
        if self._mpi is not None and self.size > 1:  # an MPI job: ask where the others wait
            # (ranks waiting in plait answer, see _tick; the MPI group has this group's ranks)
            return CollectiveTimeoutError(head + self._mpi.arrivals(HOROVOD_WAIT,
                                                                    "waited in a Horovod op"))
        return CollectiveTimeoutError(
            head + "some rank is dead, stuck (or its host unreachable) or calling something else")

    def _raw_min(self, values: np.ndarray) -> np.ndarray:
        with self._eager():
            return self._raw_min_eager(values)

    def _bounded(self, fn: str, *args: Any, **kwargs: Any) -> np.ndarray:
        """Run the library's ``fn`` (allreduce, allgather, broadcast) on eager host
        tensors, raising :class:`CollectiveTimeoutError` after ``self.timeout``."""
        lib, hvd = self._w.ops, self._hvd
        if self.framework == "torch":
            h = self._enqueue(f"{fn}_async", f"{fn} {kwargs.get('name')!r}", *args, **kwargs)
            return np.asarray(lib.to_numpy(self._wait_torch(h)))
        # horovod.tensorflow has no handles: wait on a worker thread (one, so the
        # order of ops is kept even behind an op abandoned after a timeout)
        future = self._w.worker().submit(getattr(hvd, fn), *args, **kwargs)
        return np.asarray(lib.to_numpy(self._wait_future(future, None)))

    def _raw_min_eager(self, values: np.ndarray) -> np.ndarray:
        t = _from_numpy(self._w.ops, values)
        return self._bounded("allreduce", t, op=self._hvd.Min, name=self._check_name(),
                             process_set=self._set)

    def _raw_allgather_bytes(self, data: np.ndarray) -> np.ndarray:
        with self._eager():
            return self._raw_allgather_eager(data)

    def _raw_allgather_eager(self, data: np.ndarray, name: str | None = None) -> np.ndarray:
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        out = self._bounded("allgather", _from_numpy(self._w.ops, flat),
                            name=name or self._name("bytes"), process_set=self._set)
        return out.view(np.uint8)

    def _raw_allgather_rows(self, row: np.ndarray, check: str | None = None) -> np.ndarray:
        """The mismatch report's allgather. Ranks that made different calls may have
        named different numbers of data ops (a data op starts with its check), so the
        report is named after the check that failed (``check``; default: the last one),
        carries each rank's op and check counts, and every rank goes on from the largest:
        the next ops' and checks' names meet again."""
        ext = np.zeros(row.size + 16, dtype=np.uint8)
        ext[: row.size] = row
        ext[row.size :].view(np.int64)[:] = (self._seq, self._checks)
        check = check or f"plait.{self._cid}.check{self._checks}"
        with self._eager():
            out = self._raw_allgather_eager(ext, f"{check}.rows")
        rows = out.reshape(-1, row.size + 16)
        counts = np.ascontiguousarray(rows[:, row.size :]).view(np.int64).max(axis=0)
        self._seq, self._checks = int(counts[0]), int(counts[1])  # checks started apart too
        return np.ascontiguousarray(rows[:, : row.size])

    def _raw_bcast_bytes(self, data: np.ndarray | None, root: int) -> np.ndarray:
        with self._eager():
            return self._raw_bcast_eager(data, root)

    def _raw_bcast_eager(self, data: np.ndarray | None, root: int) -> np.ndarray:
        lib = self._w.ops
        n = np.array([0 if data is None else data.size], dtype=np.int64)
        n = self._bounded("broadcast", _from_numpy(lib, n), self._root(root),
                          name=self._name("bytes.n"), process_set=self._set)
        buf = np.ascontiguousarray(data).view(np.uint8) if data is not None else np.zeros(
            int(n[0]), np.uint8)
        out = self._bounded("broadcast", _from_numpy(lib, buf), self._root(root),
                            name=self._name("bytes"), process_set=self._set)
        return out.view(np.uint8)

    def _root(self, root: int) -> int:
        """Horovod names broadcast roots by their global rank."""
        ranks = self._set.ranks
        return int(ranks[root]) if ranks else int(root)

    # -- collectives ---------------------------------------------------------------------
    def allreduce_async(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Handle:
        ops = self._ops(tensor, "allreduce")
        dtype = ops.dtype_name(tensor)
        self._validate_op(op, dtype)
        if self._host_graph(ops, tensor):
            return self._graph(ops, tensor, lambda a: self.allreduce(a, op, name)) or Done(None)
        call = Call("allreduce", ops.shape(tensor), dtype, op=op, name=name)
        carry = _CARRY_REDUCE.get(dtype)
        if dtype == "float16" and op in ("min", "max", "product"):
            carry = "float32"
        hop = self._ops_map[_BOOL_OPS[op] if dtype == "bool" else op]
        t = self._native(ops, tensor, carry)
        return self._start("allreduce", call, lambda r: self._back(ops, r, tensor, dtype, carry),
                           t, name=self._name("allreduce", name), op=hop, process_set=self._set)

    def grouped_allreduce(self, tensors: Sequence[Tensor], op: str = "average",
                          name: str | None = None) -> list[Tensor]:
        """Allreduce several tensors in one Horovod grouped call where types allow."""
        return super().grouped_allreduce(tensors, op, name)

    def group_allreduce_async(self, tensors: Sequence[Tensor], op: str = "average",
                              name: str | None = None) -> Handle | None:
        """One Horovod grouped allreduce of torch tensors that Horovod reduces as they
        are, in place: Horovod copies them into its fusion buffer on its own background
        thread, so the caller need not fuse them (a data-parallel bucket), and back
        (as Horovod's own DistributedOptimizer does to ``.grad``). In place, because
        outputs allocated anew each step cost page faults when Horovod first writes
        them: measured (2 ranks, shm, a 5.8M-parameter transformer), Horovod's copies
        out of its fusion buffer took 4.5 ms a step into new outputs and 0.7 ms in place.

        Args:
            tensors: torch tensors of one dtype (float16, float32 or float64).
            op: "average" or "sum".
            name: names the group.

        Returns:
            A handle whose ``wait()`` gives the reduced tensors (``tensors`` themselves
            where they were contiguous, else contiguous copies), or None
            where Horovod cannot take them as they are (another framework, dtype or
            op, mixed dtypes): the caller then fuses them itself.
        """
        if self.framework != "torch" or op not in ("average", "sum") or not tensors:
            return None
        ops = self._w.ops
        if not all(ops.owns(t) for t in tensors):
            return None
        dtypes = {ops.dtype_name(t) for t in tensors}
        if len(dtypes) != 1 or not dtypes <= {"float16", "float32", "float64"}:
            return None
        total = sum(int(t.numel()) for t in tensors)
        call = Call("allreduce", (len(tensors), total), dtypes.pop(), op=op, name=name)
        native = [t.contiguous() for t in tensors]
        return self._start("grouped_allreduce", call, list, native, inplace=True,
                           name=self._name("grouped", name), op=self._ops_map[op],
                           process_set=self._set)

    def allgather_async(self, tensor: Tensor, name: str | None = None) -> Handle:
        ops = self._ops(tensor, "allgather")
        dtype = ops.dtype_name(tensor)
        if self._host_graph(ops, tensor):
            return self._graph(ops, tensor, lambda a: self.allgather(a, name), False) or Done(None)
        shape = ops.shape(tensor)
        if not shape:
            raise invalid("tensor", "a 0-d tensor", "a tensor with at least one dimension")
        call = Call("allgather", shape, dtype, name=name, ragged=True)
        carry = _CARRY_MOVE.get(dtype)
        t = self._native(ops, tensor, carry)
        return self._start("allgather", call, lambda r: self._back(ops, r, tensor, dtype, carry),
                           t, name=self._name("allgather", name), process_set=self._set)

    def broadcast_async(self, tensor: Tensor, root: int = 0, name: str | None = None) -> Handle:
        ops = self._ops(tensor, "broadcast")
        self._validate_rank("root", root)
        dtype = ops.dtype_name(tensor)
        if self._host_graph(ops, tensor):
            return self._graph(ops, tensor, lambda a: self.broadcast(a, root, name)) or Done(None)
        call = Call("broadcast", ops.shape(tensor), dtype, root=root, name=name)
        carry = _CARRY_MOVE.get(dtype)
        t = self._native(ops, tensor, carry)
        return self._start("broadcast", call, lambda r: self._back(ops, r, tensor, dtype, carry),
                           t, self._root(root), name=self._name("broadcast", name),
                           process_set=self._set)

    def alltoall(self, tensor: Tensor, splits: Sequence[int] | None = None,
                 name: str | None = None) -> tuple[Tensor, list[int]]:
        """Send slice ``i`` of the first dimension to rank ``i``; return what arrived and its
        splits (inside ``tf.function`` the received splits are an int32 tensor)."""
        ops = self._ops(tensor, "alltoall")
        if self._host_graph(ops, tensor):
            return self._graph_alltoall(ops, tensor, splits, name)
        dtype = ops.dtype_name(tensor)
        shape = ops.shape(tensor)
        if not shape:
            raise invalid("tensor", "a 0-d tensor", "a tensor with at least one dimension")
        call = Call("alltoall", shape, dtype, name=name, ragged=True)
        carry = _CARRY_MOVE.get(dtype)
        t = self._native(ops, tensor, carry)
        if splits is not None and ops.owns(splits) and ops.is_symbolic(splits):
            lib_splits = ops.cast(splits, "int32")  # a graph's splits (a gradient's): Horovod checks
        else:
            send = check_splits(splits, shape[0], self.size)
            lib_splits = _from_numpy(self._w.ops, np.array(send, dtype=np.int32))
        out, received = self._start("alltoall", call, lambda r: r, t, splits=lib_splits,
                                    name=self._name("alltoall", name),
                                    process_set=self._set).wait()
        if ops.is_symbolic(tensor):  # inside tf.function, with horovod.tensorflow
            return self._back(ops, out, tensor, dtype, carry), received
        recv = [int(r) for r in np.asarray(self._w.ops.to_numpy(received)).reshape(-1)]
        return self._back(ops, out, tensor, dtype, carry), recv

    def reducescatter(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Tensor:
        """Reduce over ranks and keep this rank's part of the first dimension."""
        ops = self._ops(tensor, "reducescatter")
        dtype = ops.dtype_name(tensor)
        self._validate_op(op, dtype)
        if op not in ("sum", "average"):
            raise invalid("op", op, "'sum' or 'average' for reducescatter on the horovod backend")
        if self._host_graph(ops, tensor):
            return (self._graph(ops, tensor, lambda a: self.reducescatter(a, op, name), False)
                    or Done(None)).wait()
        shape = ops.shape(tensor)
        if not shape:
            raise invalid("tensor", "a 0-d tensor", "a tensor with at least one dimension")
        call = Call("reducescatter", shape, dtype, op=op, name=name)
        carry = _CARRY_REDUCE.get(dtype)
        t = self._native(ops, tensor, carry)
        out = self._start("reducescatter", call, lambda r: r, t,
                          name=self._name("reducescatter", name), op=self._ops_map[op],
                          process_set=self._set).wait()
        return self._back(ops, out, tensor, dtype, carry)

    def barrier(self) -> None:
        """Wait until every rank of the group arrived.

        With the agreement check on, the check itself is the barrier, so a rank
        calling another collective meanwhile raises on every rank.

        Raises:
            MismatchError: when another rank makes a different call.
            CollectiveTimeoutError: when the others do not arrive within the timeout.
        """
        if self.check and self.size > 1:
            self._verify(Call("barrier", (), "none"))
        else:
            self._raw_min(np.zeros(1, dtype=np.int64))

    def join(self, device: int = -1) -> int:
        """Horovod's ``join()``: with torch, Horovod's own (joined ranks contribute zeros
        to the others' allreduces); with TensorFlow, whose agreement check runs through
        MPI, only the case where every rank joins (see ``CommunicatorBase.join``).

        Returns:
            The rank that joined last.
        """
        if self.framework == "torch" and self.size > 1:
            with _horovod_errors():
                last = int(self._hvd.join(device))
            # ranks whose calls failed while others were joined numbered checks and ops
            # the joined ranks did not: every rank goes on from the largest counts
            self._joins += 1
            counts = np.array([self._seq, self._checks], dtype=np.int64)
            with self._eager():
                rows = self._raw_allgather_eager(counts.view(np.uint8),
                                                 f"plait.{self._cid}.join{self._joins}")
            self._seq, self._checks = (int(c) for c in rows.view(np.int64).reshape(-1, 2).max(0))
            return last
        return super().join(device)

    # -- point to point (through MPI) ------------------------------------------------------
    def _p2p(self) -> Any:
        if self._mpi is None:
            raise NotImplementedError(
                "Horovod has no point-to-point messages; plait sends them through MPI, which "
                "needs the job to be started by mpirun (or horovodrun --mpi). This job was "
                "started without MPI (e.g. horovodrun --gloo): use backend='mpi' under mpirun"
            )
        return self._mpi

    def send(self, tensor: Tensor, dest: int, tag: int = 0) -> None:
        """Send ``tensor`` to group rank ``dest`` (through MPI)."""
        self._p2p().send(tensor, dest, tag)

    def recv(self, like: Tensor, source: int, tag: int = 0) -> Tensor:
        """Receive a tensor shaped like ``like`` from group rank ``source`` (through MPI)."""
        return self._p2p().recv(like, source, tag)

    def send_async(self, tensor: Tensor, dest: int, tag: int = 0) -> Handle:
        """Start a send to group rank ``dest`` (through MPI); see ``MPICommunicator.send_async``."""
        p2p = self._p2p()
        p2p.timeout = self.timeout
        return p2p.send_async(tensor, dest, tag)

    def recv_async(self, like: Tensor, source: int, tag: int = 0) -> Handle:
        """Start a receive from group rank ``source`` (through MPI); ``wait()`` gives the tensor."""
        p2p = self._p2p()
        p2p.timeout = self.timeout
        return p2p.recv_async(like, source, tag)

    # -- groups -------------------------------------------------------------------------------
    def split(self, color: int, key: int = 0) -> HorovodCommunicator:
        """Collective over this group: ranks with equal ``color`` form a Horovod process set.

        Raises:
            NotImplementedError: when ``key`` would order a group's ranks other than
                by global rank, which Horovod process sets cannot do.
        """
        me = (int(color), int(key), int(self._set.ranks[self.rank]) if self._set.ranks
              else self.rank, self._w.communicators)
        everyone = self.allgather_object(me)
        groups: dict[int, list[tuple[int, int]]] = {}
        for c, k, g, _ in everyone:
            groups.setdefault(c, []).append((k, g))
        # the new group's id (it names the group's ops) must be equal on its ranks, but
        # ranks that split other groups have counted further: continue from the largest
        self._w.communicators = max(n for *_, n in everyone)
        mine = None
        for c in sorted(groups):
            ranks = tuple(g for _, g in sorted(groups[c]))
            if list(ranks) != sorted(ranks):
                raise NotImplementedError(
                    f"split(color={c}, key=...) would order ranks {list(ranks)}, but a Horovod "
                    "process set always orders its ranks by global rank; use keys that keep "
                    "that order (e.g. key=rank), or backend='mpi'"
                )
            if ranks not in self._w.sets:
                if len(ranks) == self._hvd.size() and ranks == tuple(range(len(ranks))):
                    self._w.sets[ranks] = self._hvd.global_process_set
                else:
                    self._w.allow_process_sets(self)
                    self._w.sets[ranks] = self._hvd.add_process_set(list(ranks))
            if c == int(color):
                mine = self._w.sets[ranks]
        sub_mpi = self._mpi.split(color, key) if self._mpi is not None else None
        return HorovodCommunicator(self.framework, check=self.check, timeout=self.timeout,
                                   _world=self._w, _set=mine, _mpi=sub_mpi)

    def _host_graph(self, ops: TensorOps, tensor: Tensor) -> bool:
        """A symbolic tensor that the library cannot take natively."""
        return ops.is_symbolic(tensor) and ops.framework != self.framework


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
def _horovod_errors() -> Iterator[None]:
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


def _finished(hvd: Any, handle: Any) -> bool:
    """Whether horovod.torch's op ``handle`` is over (a handle already waited for and
    cleared counts as over)."""
    try:
        return bool(hvd.poll(handle))
    except ValueError:
        return True


def _homogeneous(hvd: Any) -> bool:
    """Horovod's own answer: every host runs the same number of ranks (no collective)."""
    fn = getattr(hvd, "is_homogeneous", None) or hvd.mpi_ops.is_homogeneous
    return bool(fn())


def _from_numpy(lib: TensorOps, arr: np.ndarray) -> Any:
    if lib.framework == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(arr).copy())
    import tensorflow as tf

    return tf.convert_to_tensor(arr)


def _torch_dtype(name: str) -> Any:
    from plait.adapters.torch import torch_dtype

    return torch_dtype(name)


def _tf_value(x: Any) -> Any:
    from plait.adapters.tensorflow import unwrap

    return unwrap(x)


def _tf_bitcast(x: Any, dtype: str) -> Any:
    import tensorflow as tf
    from plait.adapters.tensorflow import tf_dtype

    return tf.bitcast(x, tf_dtype(dtype))
