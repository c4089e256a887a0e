"""Horovod backend: plait's Communicator over Horovod.

One Horovod library serves the process: ``horovod.torch`` for a PyTorch job,
``horovod.tensorflow`` for a TensorFlow job. Tensors of another framework (and
numpy arrays) cross through host memory. Horovod 0.28's CPU ops have no
bfloat16, no bool and no 8/16-bit integer reductions, so plait reduces those
in float32 / int32 and moves bfloat16 as its 16-bit pattern and bool as uint8.
Horovod has no point-to-point messages: ``send``/``recv`` use MPI when the job
was started by an MPI launcher and raise ``NotImplementedError`` otherwise. The library
itself is :mod:`plait.collectives.horovod_library`; starting its ops and waiting for them,
:mod:`plait.collectives.horovod_ops`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from plait.errors import invalid
from plait.protocols import Handle, Tensor, TensorOps

from .base import Done, check_splits
from .check import Call
from .horovod_library import (
    World,
    build_info,
    finished,
    from_numpy,
    homogeneous,
    horovod_errors,
    mpi_launched,
    tf_bitcast,
    tf_value,
    torch_dtype,
)
from .horovod_ops import HorovodOps

__all__ = ["HorovodCommunicator", "build_info", "mpi_launched"]

# Horovod 0.28's CPU reductions take float16/32/64 and int32/64 only; its
# data-moving ops also take int8, uint8 and int16.
_CARRY_REDUCE = {"bfloat16": "float32", "bool": "int32", "int8": "int32", "uint8": "int32",
                 "int16": "int32", "uint16": "int32"}
_CARRY_MOVE = {"bfloat16": "int16", "uint16": "int16", "bool": "uint8"}  # (horovod.torch: no uint16)
_BOOL_OPS = {"sum": "max", "max": "max", "min": "min", "product": "min"}
_SETTLE_NAP_S = 5e-4  # between polls of the ops in flight before a join (see _settle)


class HorovodCommunicator(HorovodOps):
    """:class:`~plait.protocols.Communicator` over Horovod.

    Args:
        framework: "torch" or "tensorflow": which Horovod library to initialise.
        check: verify before each collective that all ranks make the same call.
        timeout: seconds to wait for the other ranks at the agreement check.
    """

    backend = "horovod"

    def __init__(self, framework: str = "torch", *, check: bool = True, timeout: float = 300.0,
                 _world: World | None = None, _set: Any = None, _mpi: Any = None) -> None:
        super().__init__(check=check, timeout=timeout)
        self._w = _world if _world is not None else World(framework)
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
            self.homogeneous = homogeneous(hvd)
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
        self.homogeneous = homogeneous(self._hvd)
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

    # -- conversion to and from the library's framework ----------------------------------
    def _native(self, ops: TensorOps, tensor: Tensor, carry: str | None) -> Any:
        lib = self._w.ops
        if ops.framework == lib.framework:
            # Horovod's torch ops need contiguous memory (autograd hands in expanded views)
            t = tensor.contiguous() if ops.framework == "torch" else tf_value(tensor)
            if carry is None:
                return t
            if carry == "int16" and lib.framework == "torch":
                return t.view(torch_dtype("int16"))
            return lib.cast(t, carry) if carry != "int16" else tf_bitcast(t, "int16")
        arr = ops.to_numpy(tensor)
        if carry == "float32" and ops.dtype_name(tensor) == "bfloat16":
            from plait.adapters.numpy import bf16_to_f32

            arr = bf16_to_f32(arr)
        elif carry == "int16":
            arr = arr.view(np.int16)
        elif carry is not None:
            arr = arr.astype(carry)
        return from_numpy(lib, arr)

    def _back(self, ops: TensorOps, result: Any, like: Tensor, dtype: str, carry: str | None) -> Any:
        lib = self._w.ops
        if ops.framework == lib.framework:
            if carry is None:
                return result
            if carry == "int16" and lib.framework == "torch":
                return result.view(torch_dtype(dtype))
            return lib.cast(result, dtype) if carry != "int16" else tf_bitcast(result, dtype)
        arr = lib.to_numpy(result)
        if dtype == "bfloat16" and carry == "float32":
            from plait.adapters.numpy import f32_to_bf16

            arr = f32_to_bf16(arr)
        elif carry == "int16":
            arr = arr.view(np.uint16 if dtype in ("bfloat16", "uint16") else np.float16)
        elif carry is not None:
            arr = arr.astype(bool if dtype == "bool" else dtype)
        return ops.from_numpy(np.ascontiguousarray(arr), like)

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
        elif splits is None and shape[0] < 0:  # a graph's unknown rows: Horovod splits evenly
            lib_splits = from_numpy(self._w.ops, np.zeros(0, dtype=np.int32))  # and checks
        else:
            send = check_splits(splits, shape[0], self.size)
            lib_splits = from_numpy(self._w.ops, np.array(send, dtype=np.int32))
        out, received = self._start("alltoall", call, lambda r: r, t, splits=lib_splits,
                                    name=self._name("alltoall", name),
                                    process_set=self._set).wait()
        if ops.is_symbolic(tensor):  # inside tf.function, with horovod.tensorflow
            return self._back(ops, out, tensor, dtype, carry), received
        recv = [int(r) for r in np.asarray(self._w.ops.to_numpy(received)).reshape(-1)]
        return self._back(ops, out, tensor, dtype, carry), recv

    def reducescatter(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Tensor:
        """Reduce over ranks and keep this rank's part of the first dimension."""
        return self.reducescatter_async(tensor, op, name).wait()

    def reducescatter_async(self, tensor: Tensor, op: str = "average",
                            name: str | None = None) -> Handle:
        """:meth:`reducescatter`, started; the handle's ``wait()`` gives this rank's part.

        Raises:
            NotImplementedError: for op "adasum", as Horovod (a ``RuntimeError``).
            ConfigError: for min, max or product (Horovod 0.28 has sum and average only).
        """
        ops = self._ops(tensor, "reducescatter")
        dtype = ops.dtype_name(tensor)
        self._validate_op(op, dtype)
        if op == "adasum":
            raise NotImplementedError("reducescatter with op='adasum': Horovod has none")
        if op not in ("sum", "average"):
            raise invalid("op", op, "'sum' or 'average' for reducescatter on the horovod backend")
        if self._host_graph(ops, tensor):
            return (self._graph(ops, tensor, lambda a: self.reducescatter(a, op, name), False)
                    or Done(None))
        shape = ops.shape(tensor)
        if not shape:
            raise invalid("tensor", "a 0-d tensor", "a tensor with at least one dimension")
        call = Call("reducescatter", shape, dtype, op=op, name=name)
        carry = _CARRY_REDUCE.get(dtype)
        t = self._native(ops, tensor, carry)
        return self._start("reducescatter", call, lambda r: self._back(ops, r, tensor, dtype, carry),
                           t, name=self._name("reducescatter", name), op=self._ops_map[op],
                           process_set=self._set)

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
            self._settle()
            with horovod_errors():
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

    def _settle(self) -> None:
        """Wait until this rank's ops in flight have completed (at most the timeout; then
        join anyway). Horovod 0.28 never completes an op still waiting in its queue when
        ``join`` reaches it: an ``allreduce_async`` right before ``hvd.join()`` (Horovod's
        own duplicate-name tests do that) stayed pending for ever, with real Horovod too,
        and its shutdown later crashed the process."""
        keeper, hvd = self._w.keeper, self._hvd
        if keeper is None:
            return
        deadline = time.monotonic() + self.timeout
        for handle in keeper.handles():
            while not finished(hvd, handle) and time.monotonic() < deadline:
                time.sleep(_SETTLE_NAP_S)

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

