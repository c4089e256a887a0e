"""MPI backend: plait's Communicator over mpi4py.

Tensors are viewed as numpy buffers (no copy for host tensors). Every collective
starts with one small allgather, the *header* (:mod:`plait.collectives.mpi_header`):
the agreement check, sizes, and the whole tensor of a small collective, which is then
finished locally. The data then moves by Open MPI's collectives (blocking calls under
a watchdog for synchronous ones on one host, except broadcast; nonblocking otherwise)
or by plait's pipelined ring (:mod:`plait.collectives.ring`), chosen per message by
:class:`~plait.collectives.tuning.Tuning` from the size, dtype and host layout.
float16 and bfloat16 cross the wire at 2 bytes per element and are reduced by numpy in
the ring. Collectives in flight progress, and every wait is bounded, as
:mod:`plait.collectives.mpi_wait` says.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from mpi4py import MPI
from plait.adapters.numpy import bf16_to_f32, f32_to_bf16

from plait.errors import MismatchError, invalid
from plait.protocols import Handle, Tensor

from .adasum import ADASUM_DTYPES, adasum, power_of_two
from .base import Done, check_splits, floating, reducescatter_counts
from .check import Call
from .join import ALLREDUCE, JOINED, SMALL, STEP, Reduction, describe, read, zeros
from .mpi_header import HEAD, MAX_PLANS, SLOT, Gathered, MPIHeader, Sig, flat_bytes
from .mpi_wait import PROGRESS_S, SPIN_S, TAG_UB, start_mpi, thread_level
from .point import Point
from .pool import BufferPool
from .ring import Chain, Exchange, Relay, Ring, combiner, segments
from .tuning import Tuning

__all__ = ["PROGRESS_S", "SLOT", "SPIN_S", "MPICommunicator", "start_mpi", "thread_level"]

_BUILTIN = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD,
            "average": MPI.SUM}
_BOOL = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "product": MPI.LAND}
_MPI_TYPES = {
    "float32": MPI.FLOAT, "float64": MPI.DOUBLE, "int8": MPI.INT8_T, "uint8": MPI.UINT8_T,
    "int16": MPI.INT16_T, "uint16": MPI.UINT16_T, "int32": MPI.INT32_T, "int64": MPI.INT64_T,
    "bool": MPI.C_BOOL,
}
_MAX_CHUNKS = 4096  # tags per ring collective


def _offsets(counts: Sequence[int]) -> list[int]:
    """``[0, c0, c0+c1, ...]``: where consecutive parts of the given sizes start."""
    return [0, *itertools.accumulate(counts)]


@dataclass(frozen=True)
class _Plan:
    """An allreduce call signature's work, made once (see ``_allreduce_plan``)."""

    call: Call
    row: np.ndarray  # the header row (a small allreduce copies it and adds its data)
    combine: Any
    reduction: Reduction | None  # None: small, reduced from the header's rows
    what: str  # the call, for messages


@dataclass(frozen=True)
class _Scatter:
    """A reducescatter's call signature, its parts and algorithm (see ``_scatter_plan``)."""

    sig: Sig
    rows: list[int]  # slices of the first dimension each rank keeps
    row: int  # elements per slice
    shape: tuple[int, ...]  # this rank's part
    start: int  # the element where this rank's part starts
    mpi: bool  # Open MPI's reduce-scatter (else plait's ring; unused for small tensors)
    want: bool  # a synchronous call that would block where every rank asks for it
    counts: list[int]  # elements each rank keeps


@dataclass
class _Alltoall:
    """An alltoall's call signature, validated and with its header made once (see
    ``_alltoall_plan``)."""

    sig: Sig
    send: np.ndarray  # the splits as bytes (they travel in the header)
    row: int  # bytes per slice of the first dimension
    want: bool  # a synchronous call that would block where every rank asks for it
    counts: list[int]  # bytes to each rank
    offsets: list[int]  # where each rank's part starts (and the end)
    layout: _Layout | None = None  # the last call's (its ranks' splits are often the same)


@dataclass(frozen=True)
class _Layout:
    """Where an alltoall's parts arrive, for the ranks' splits ``theirs``."""

    theirs: list[list[int]]  # every rank's splits
    recv: list[int]  # rows from each rank
    rows: int  # rows received
    counts: list[int]  # bytes from each rank
    offsets: list[int]  # where each rank's part starts (and the end)
    copies: list[tuple[int, int, int, int]]  # (rank, at, n, to): from the header rows, when
    # every rank's data travelled in them; else empty
    even: bool = False  # every rank sends every rank as many rows (MPI_Alltoall will do)


class MPICommunicator(MPIHeader):
    """:class:`~plait.protocols.Communicator` over an mpi4py communicator.

    Args:
        comm: the mpi4py communicator (default ``MPI.COMM_WORLD``).
        check: verify before each collective that all ranks make the same call.
        timeout: seconds a rank waits for the others to arrive at a collective
            before raising :class:`~plait.errors.CollectiveTimeoutError`.
        tuning: algorithm settings (default: from ``PLAIT_ALLREDUCE`` and friends).
    """

    backend = "mpi"

    def __init__(self, comm: Any = None, *, check: bool = True, timeout: float = 300.0,
                 tuning: Tuning | None = None) -> None:
        super().__init__(comm, check=check, timeout=timeout)
        self.adasum = True  # op="adasum": gathered and combined in numpy (see _adasum)
        self.tuning = Tuning.from_env() if tuning is None else tuning
        # the tag ranges of successive rings; a split communicator used to fall back to
        # 7 ranges (32767 // 4096), so a DP step with more buckets in flight reused tags
        # of rings still running: messages crossed between buckets (MPI_ERR_TRUNCATE or
        # corrupted memory, measured across hosts)
        self._tag_slots = max(1, TAG_UB // _MAX_CHUNKS)
        self._ring_seq = 0
        self._pool = BufferPool()  # outputs, reused once nobody holds them
        self._plans: dict[tuple[Any, ...], _Plan] = {}  # see _allreduce_plan
        self._alltoalls: dict[tuple[Any, ...], _Alltoall] = {}  # see _alltoall_plan
        self._scatters: dict[tuple[Any, ...], _Scatter] = {}  # see _scatter_plan
        self._topology()
        cpus = os.cpu_count() or 1
        bound = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
        self._drive_requests = self.tuning.drives_requests(
            self.cross_size, min(bound, cpus / max(1, self.local_size)))
        # the two levels of the hierarchical allreduce: this host's ranks, and the ranks
        # with this local rank on every host (every rank decides alike: same host list)
        self._local: Any = None
        self._cross: Any = None
        if self.cross_size > 1 and self.local_size > 1 and self.homogeneous:
            self._local = self.comm.Split(self.cross_rank, self.rank)
            self._cross = self.comm.Split(self.local_rank, self.rank)

    def join(self, device: int = -1) -> int:
        """Horovod's ``join()`` (``device`` unused): until every rank has joined, take
        part in the other ranks' allreduces with zeros (an average still divides by the
        group's size); their other collectives raise on them meanwhile.

        Returns:
            The rank that joined last (the highest of those that joined together).

        Raises:
            ConfigError: with the agreement check off (``PLAIT_CHECK=0``): a joined
                rank learns the others' calls from the check's header.
            MismatchError: when the ranks that did not join disagree.
            CollectiveTimeoutError: when no other rank calls a collective or ``join``
                within the timeout.
        """
        if self.size == 1:
            return self.rank
        if not self.check:
            raise invalid("PLAIT_CHECK", "0", "1 for join(): a joined rank learns the other "
                          "ranks' calls from the agreement check")
        first = 1
        while True:
            rows = self._header(Call("join", (), "none"), first, role=JOINED, block=True)
            first = 0
            head = rows.view(np.int64)
            live = np.flatnonzero(head[:, 2] != JOINED)
            if live.size == 0:
                last = np.flatnonzero(head[:, 1] == 1)
                return int(last.max()) if last.size else self.rank
            if head[live[0], 2] == STEP:
                step = self._joiners[int(head[live[0], 1])]()
                if step is None:
                    raise MismatchError(f"{self!r}: another rank stepped a gradient reducer "
                                        "that this rank no longer has (it joined without it)")
                step()
            elif head[live[0], 2] == ALLREDUCE:
                r = read(rows[live[0], HEAD:])
                if r.blocking and not self._blocks(rows):
                    r = replace(r, blocking=False)
                mine = zeros(r)
                self._allreduce_data(mine, r, None, lambda out: None, mine,
                                     f"allreduce of {r.size} {r.dtype} while joined").wait()

    # -- data movement ---------------------------------------------------------------------
    def _tags(self) -> int:
        """The first tag of the next ring (the same on every rank: rings start in order)."""
        self._ring_seq += 1
        return (self._ring_seq % self._tag_slots) * _MAX_CHUNKS

    def _new_ring(self, comm: Any, rank: int, size: int, buf: np.ndarray, counts: Sequence[int],
                  phases: str, combine: Any, src: np.ndarray | None, tags: int) -> Ring:
        chunk = max(1, self.tuning.chunk_bytes // max(1, buf.itemsize))
        return Ring(buf, segments(counts), rank, size,
                    lambda b, dest, tag: comm.Isend([b, MPI.BYTE], dest, tag),
                    lambda b, source, tag: comm.Irecv([b, MPI.BYTE], source, tag),
                    MPI.Request.Testsome, tags, chunk, combine, phases, _MAX_CHUNKS,
                    self.tuning.window, src)

    def _ring(self, buf: np.ndarray, counts: Sequence[int], phases: str, combine: Any,
              src: np.ndarray | None = None) -> Ring:
        """A ring collective over the whole group into the flat ``buf`` (from the flat
        ``src``) cut into segments of ``counts``."""
        return self._new_ring(self._ring_comm, self.rank, self.size, buf, counts, phases,
                              combine, src, self._tags())

    def _hierarchical(self, out: np.ndarray, src: np.ndarray, combine: Any) -> Chain:
        """Allreduce ``src`` into ``out`` (flat): reduce-scatter inside the host, a ring
        between hosts on this rank's shard, allgather inside the host."""
        local, cross = self.local_size, self.cross_size
        counts = reducescatter_counts(out.size, local)
        start = sum(counts[: self.local_rank])
        shard = out[start : start + counts[self.local_rank]]
        tags = [self._tags() for _ in range(3)]
        return Chain([
            lambda: self._new_ring(self._local, self.local_rank, local, out, counts,
                                   "reducescatter", combine, src, tags[0]),
            lambda: self._new_ring(self._cross, self.cross_rank, cross, shard,
                                   reducescatter_counts(shard.size, cross), "allreduce", combine,
                                   None, tags[1]),
            lambda: self._new_ring(self._local, self.local_rank, local, out, counts, "allgather",
                                   None, None, tags[2]),
        ])

    def _average(self, out: np.ndarray, dtype: str, kernels: Any = None) -> np.ndarray:
        fast = getattr(kernels, "host_divide", None)
        divide = fast(dtype) if fast is not None else None
        if divide is not None:  # 16-bit floats with the framework's kernel (see combiner)
            divide(out, self.size)
            return out
        if dtype == "bfloat16":
            return f32_to_bf16(bf16_to_f32(out) / self.size)
        if floating(dtype):
            out /= self.size
            return out
        return np.trunc(out / self.size).astype(out.dtype)

    def _reduced(self, out: np.ndarray, op: str, dtype: str, kernels: Any = None) -> np.ndarray:
        return self._average(out, dtype, kernels) if op == "average" else out

    def algorithm(self, kind: str, nbytes: int, dtype: str) -> str:
        """How this communicator moves a collective of ``kind`` on ``nbytes`` of ``dtype``:
        "header" (one round, inside the agreement check), "ring", "hierarchical" or "mpi"
        (Open MPI's own); recorded in the timeline. An allgather or alltoall of at most
        :data:`SLOT` bytes here is "header" when every rank's part fits (for the ranks'
        equal parts)."""
        if kind == "allreduce" and (nbytes <= SLOT or self.size == 1):
            return "header"
        if self.size > 1 and (kind in ("reducescatter", "allgather") and nbytes <= SLOT
                              or kind == "broadcast" and 0 < nbytes <= SLOT
                              or kind == "alltoall" and nbytes + 8 * self.size <= SLOT):
            return "header"
        if kind == "allreduce":
            return self.tuning.reduce_algorithm(nbytes, dtype, self.cross_size,
                                                self.local_size if self._local else 1)
        if kind == "reducescatter" and self.size > 1:
            return "mpi" if self.tuning.reduce_algorithm(
                nbytes, dtype, self.cross_size) == "mpi" else "ring"
        if kind == "allgather":
            return self.tuning.gather_algorithm(nbytes * self.size, self.cross_size)
        if kind == "broadcast" and nbytes > SLOT and self.size > 1:
            return self.tuning.gather_algorithm(nbytes, self.cross_size)
        return "mpi"

    # -- collectives -----------------------------------------------------------------------------
    def allreduce_async(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Handle:
        return self._allreduce(tensor, op, name, sync=False)

    def allreduce(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Tensor:
        """Reduce ``tensor`` over all ranks; every rank gets the result (on one host a
        blocking MPI call once every rank arrived, see :meth:`Tuning.blocks`)."""
        return self._allreduce(tensor, op, name, sync=True).wait()

    def _allreduce(self, tensor: Tensor, op: str, name: str | None, sync: bool) -> Handle:
        ops = self._ops(tensor, "allreduce")
        graph = self._graph(ops, tensor, lambda a: self.allreduce(a, op, name))
        if graph is not None:
            return graph
        dtype = ops.dtype_name(tensor)
        buf = ops.to_numpy(tensor)
        if op == "adasum":
            return Done(ops.from_numpy(self._adasum(buf, dtype, name), tensor))
        plan = self._allreduce_plan(ops, buf, dtype, op, name, sync)
        call = plan.call
        if self.size == 1:
            return Done(ops.from_numpy(self._reduced(buf.copy(), op, dtype, ops), tensor))
        if plan.reduction is None:  # one round: every rank's tensor travels in the header
            row = plan.row.copy()
            row[HEAD : HEAD + buf.nbytes] = flat_bytes(buf)
            out = self._reduce_rows(self._header_row(call, row, SMALL), buf, plan.combine)
            return Done(ops.from_numpy(self._reduced(out.reshape(buf.shape), op, dtype, ops), tensor))
        r = plan.reduction
        if r.blocking or self.check:  # a blocking call: every rank arrived, and blocks
            rows = self._header_row(call, plan.row, ALLREDUCE)
            if r.blocking and not self._blocks(rows):
                r = replace(r, blocking=False)

        finish = functools.partial(self._finish_reduce, ops, op, dtype, buf.shape, tensor)
        return self._allreduce_data(buf, r, ops, finish, (buf, tensor), plan.what, sync)

    def _adasum(self, buf: np.ndarray, dtype: str, name: str | None) -> np.ndarray:
        """Horovod's Adasum of ``buf`` over the group: every rank's tensor gathered (memory:
        the group's size times the tensor, where Horovod exchanges halves) and combined
        by :func:`~plait.collectives.adasum.adasum`, the same on every rank.

        Raises:
            ConfigError: for a dtype other than float16, float32 or float64.
            NotImplementedError: for a group whose size is not a power of two (Horovod's
                condition).
        """
        if dtype not in ADASUM_DTYPES:
            raise invalid("op", "adasum", f"another op for a {dtype} tensor (Adasum takes "
                          f"{', '.join(ADASUM_DTYPES)})")
        if not power_of_two(self.size):
            raise NotImplementedError(f"Adasum needs a power-of-two number of ranks, as in "
                                      f"Horovod; this group has {self.size}")
        if self.size == 1:
            return buf.copy()
        flat = np.ascontiguousarray(buf).reshape(1, -1)
        parts = self.allgather(flat, f"{'' if name is None else name}#adasum")
        return adasum(np.asarray(parts)).reshape(buf.shape)

    def _finish_reduce(self, ops: Any, op: str, dtype: str, shape: tuple[int, ...], like: Tensor,
                       out: np.ndarray) -> Tensor:
        """An allreduce's result: ``out`` (flat) reduced by ``op`` in ``shape``, a tensor
        like ``like``."""
        return ops.from_numpy(self._reduced(out.reshape(shape), op, dtype, ops), like)

    def _reduce_rows(self, rows: np.ndarray, buf: np.ndarray, combine: Any) -> np.ndarray:
        """Every rank's tensor like ``buf``, sent as the payload of its header row in
        ``rows``, reduced here by ``combine`` (flat)."""
        parts = np.ascontiguousarray(rows[:, HEAD : HEAD + buf.nbytes]).view(buf.dtype)
        out = parts[0].copy()
        for r in range(1, self.size):
            combine(out, out, parts[r])
        return out

    def _allreduce_plan(self, ops: Any, buf: np.ndarray, dtype: str, op: str, name: str | None,
                        sync: bool) -> _Plan:
        """What an allreduce of ``buf`` does (validated, header row made), kept per call
        signature: a training loop repeats the same calls, and building them anew was a
        third of plait's own time in a small allreduce."""
        key = (buf.shape, dtype, op, name, sync, self.check, ops)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        self._validate_op(op, dtype)
        call = Call("allreduce", buf.shape, dtype, op=op, name=name)
        reduction = None
        if buf.nbytes > SLOT:
            algorithm = self.tuning.reduce_algorithm(buf.nbytes, dtype, self.cross_size,
                                                     self.local_size if self._local else 1)
            blocking = sync and algorithm == "mpi" and self.tuning.blocks(self.cross_size)
            reduction = Reduction(dtype, buf.size, op, algorithm, blocking)
        row = (self._row(call, 0, SMALL, None) if reduction is None
               else self._row(call, 0, ALLREDUCE, describe(reduction), reduction.blocking))
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        plan = self._plans[key] = _Plan(call, row, combiner(dtype, op, ops), reduction,
                                        call.describe())
        return plan

    def _allreduce_data(self, buf: np.ndarray, r: Reduction, kernels: Any,
                        finish: Callable[[np.ndarray], Any], keep: Any, what: str,
                        sync: bool = False) -> Handle:
        """The data phase of an allreduce of ``buf`` (after its header), as ``r`` says;
        the handle's result is ``finish(out)`` (``sync``: see :meth:`_start`)."""
        if r.algorithm != "mpi":
            out = self._pool.empty((buf.size,), buf.dtype)
            combine = combiner(r.dtype, r.op, kernels)
            engine: Ring | Chain
            if r.algorithm == "hierarchical":
                engine = self._hierarchical(out, buf.reshape(-1), combine)
            else:
                engine = self._ring(out, reducescatter_counts(out.size, self.size), "allreduce",
                                    combine, buf.reshape(-1))
            return self._start(engine, functools.partial(finish, out), keep, what, sync)
        out = self._pool.empty(buf.shape, buf.dtype)
        mpi_op = _BOOL[r.op] if r.dtype == "bool" else _BUILTIN[r.op]
        send, recv = [buf, _MPI_TYPES[r.dtype]], [out, _MPI_TYPES[r.dtype]]
        if r.blocking:
            self._blocking(lambda: self.comm.Allreduce(send, recv, mpi_op), what)
            return Done(finish(out))
        return self._request(self.comm.Iallreduce(send, recv, mpi_op), functools.partial(finish, out),
                             keep, what, sync)

    def allgather_async(self, tensor: Tensor, name: str | None = None) -> Handle:
        return self._allgather(tensor, name, sync=False)

    def allgather(self, tensor: Tensor, name: str | None = None) -> Tensor:
        """Concatenate every rank's ``tensor`` along the first dimension (sizes may differ)."""
        return self._allgather(tensor, name, sync=True).wait()

    def _allgather(self, tensor: Tensor, name: str | None, sync: bool) -> Handle:
        ops = self._ops(tensor, "allgather")
        graph = self._graph(ops, tensor, lambda a: self.allgather(a, name), same_shape=False)
        if graph is not None:
            return graph
        dtype = ops.dtype_name(tensor)
        buf = ops.to_numpy(tensor)
        if buf.ndim == 0:
            raise invalid("tensor", "a 0-d tensor", "a tensor with at least one dimension")
        mine = flat_bytes(buf)
        # a rank whose rows fit in the slot sends them in the header; when every rank's
        # did (all know all sizes from it), that was the whole allgather
        want = sync and self.tuning.blocks(self.cross_size)
        sig = self._sig("allgather", buf.shape, dtype, name=name, block=want)
        rows = self._head(sig, buf.shape[0], mine if mine.size <= SLOT else None)
        # plain Python on a few numbers (numpy's reductions cost ~3 us each here)
        numbers = [head[1] for head in self._heads(rows)]
        g = sig.gathered
        if g is None or numbers != g.numbers:  # a loop gathers alike: kept from the last call
            row_bytes = math.prod(buf.shape[1:]) * buf.itemsize
            counts = [n * row_bytes for n in numbers]
            g = sig.gathered = Gathered(numbers, counts, max(counts) <= SLOT,
                                         len(set(counts)) == 1, self.tuning.gather_algorithm(
                                             sum(counts), self.cross_size) == "ring")
        counts = g.counts
        out = self._pool.empty((sum(numbers),) + buf.shape[1:], buf.dtype)
        flat = flat_bytes(out)
        if g.fits:
            at = 0
            for r, n in enumerate(counts):
                flat[at : at + n] = rows[r, HEAD : HEAD + n]
                at += n
            return Done(ops.from_numpy(out, tensor))
        what = sig.what
        if g.ring:
            at = sum(counts[: self.rank])
            flat[at : at + counts[self.rank]] = mine
            return self._start(self._ring(flat, counts, "allgather", None),
                               lambda: ops.from_numpy(out, tensor), (buf, tensor), what, sync)
        # equal parts: MPI_Allgather, faster than MPI_Allgatherv here (1 MiB: 117 against 147
        # us); bytes as MPI.BYTE on both sides (a bare uint8 array goes as MPI_UNSIGNED_CHAR,
        # and against a receive of MPI.BYTE a 1 MiB allgather took 134 instead of 115 us)
        even = g.even
        recv = [flat, MPI.BYTE] if even else [flat, counts, MPI.BYTE]
        if want and self._blocks(rows):
            run = self.comm.Allgather if even else self.comm.Allgatherv
            self._blocking(lambda: run([mine, MPI.BYTE], recv), what)
            return Done(ops.from_numpy(out, tensor))
        start = self.comm.Iallgather if even else self.comm.Iallgatherv
        return self._request(start([mine, MPI.BYTE], recv), lambda: ops.from_numpy(out, tensor),
                             (buf, tensor), what, sync)

    def broadcast_async(self, tensor: Tensor, root: int = 0, name: str | None = None) -> Handle:
        return self._broadcast(tensor, root, name, sync=False)

    def broadcast(self, tensor: Tensor, root: int = 0, name: str | None = None) -> Tensor:
        """Return ``root``'s ``tensor`` on every rank."""
        return self._broadcast(tensor, root, name, sync=True).wait()

    def _broadcast(self, tensor: Tensor, root: int, name: str | None, sync: bool) -> Handle:
        ops = self._ops(tensor, "broadcast")
        self._validate_rank("root", root)
        graph = self._graph(ops, tensor, lambda a: self.broadcast(a, root, name))
        if graph is not None:
            return graph
        dtype = ops.dtype_name(tensor)
        buf = ops.to_numpy(tensor)
        sig = self._sig("broadcast", buf.shape, dtype, root=root, name=name)
        if 0 < buf.nbytes <= SLOT and self.size > 1:  # one round: root's tensor in the header
            rows = self._head(sig, 0, flat_bytes(buf) if self.rank == root else None)
            data = np.ascontiguousarray(rows[root, HEAD : HEAD + buf.nbytes])
            return Done(ops.from_numpy(data.view(buf.dtype).reshape(buf.shape).copy(), tensor))
        if self.check and self.size > 1:
            self._head(sig)
        out = self._pool.empty(buf.shape, buf.dtype)
        what = sig.what
        ring = self.tuning.gather_algorithm(buf.nbytes, self.cross_size) == "ring"
        if sync and not ring:  # the root sends from its own tensor and copies it into the
            # output while the others receive (1 MiB on one host: 95 us; 119 us copied after
            # a blocking MPI_Bcast, 160 us copied before; raw MPI_Bcast 82 us)
            src = np.ascontiguousarray(buf) if self.rank == root else out
            req = self.comm.Ibcast([flat_bytes(src), MPI.BYTE], root=root)
            if self.rank == root:
                out[...] = src
            return self._request(req, lambda: ops.from_numpy(out, tensor), (src, buf, tensor),
                                 what, sync)
        if self.rank == root:
            out[...] = buf
        if ring:
            comm = self._ring_comm
            relay = Relay(flat_bytes(out), self.rank, self.size, root,
                          lambda b, dest, tag: comm.Isend([b, MPI.BYTE], dest, tag),
                          lambda b, source, tag: comm.Irecv([b, MPI.BYTE], source, tag),
                          MPI.Request.Testsome, self._tags(), self.tuning.chunk_bytes,
                          _MAX_CHUNKS, self.tuning.window)
            return self._start(relay, lambda: ops.from_numpy(out, tensor), (buf, tensor), what,
                               sync)
        return self._request(self.comm.Ibcast([flat_bytes(out), MPI.BYTE], root=root),
                             lambda: ops.from_numpy(out, tensor), (buf, tensor), what, sync)

    def alltoall_async(self, tensor: Tensor, splits: Sequence[int] | None = None,
                       name: str | None = None) -> Handle:
        """Start an alltoall; ``wait()`` gives ``(output, received_splits)`` (inside
        ``tf.function`` the received splits are an int32 tensor)."""
        return self._alltoall(tensor, splits, name, sync=False)

    def alltoall(self, tensor: Tensor, splits: Sequence[int] | None = None,
                 name: str | None = None) -> tuple[Tensor, list[int]]:
        """Send slice ``i`` of the first dimension to rank ``i``; return what arrived and its splits."""
        result: tuple[Tensor, list[int]] = self._alltoall(tensor, splits, name, sync=True).wait()
        return result

    def _alltoall(self, tensor: Tensor, splits: Sequence[int] | None, name: str | None,
                  sync: bool) -> Handle:
        ops = self._ops(tensor, "alltoall")
        if ops.is_symbolic(tensor):
            return Done(self._graph_alltoall(ops, tensor, splits, name))
        buf = ops.to_numpy(tensor)
        plan = self._alltoall_plan(ops, tensor, buf, splits, name, sync)
        sig, send = plan.sig, plan.send
        src = flat_bytes(buf)
        block = False
        if send.size <= SLOT:  # the splits travel in the header, and the data if it fits
            rows = self._head(sig, 0, send, src if send.size + src.size <= SLOT else None)
            # the splits as int64s in place (a row's header and slot are whole int64s)
            theirs = rows.view(np.int64)[:, HEAD // 8 : HEAD // 8 + self.size].tolist()
            layout = plan.layout
            if layout is None or theirs != layout.theirs:
                layout = plan.layout = self._alltoall_layout(plan, theirs)
            if layout.copies:  # every rank's part for this rank came in the header
                out = self._pool.empty((layout.rows,) + buf.shape[1:], buf.dtype)
                dst = flat_bytes(out)
                for p, at, n, to in layout.copies:
                    dst[to : to + n] = rows[p, at : at + n]
                return Done((ops.from_numpy(out, tensor), list(layout.recv)))
            block = plan.want and self._blocks(rows)
        else:
            if self.check:
                self._head(sig)
            got = np.empty(self.size, dtype=np.int64)
            self._poll(self.comm.Ialltoall(send.view(np.int64), got), sig.what)
            layout = self._alltoall_layout(plan, [[n] * self.size for n in got.tolist()])
        recv, so, ro = layout.recv, plan.offsets, layout.offsets
        out = self._pool.empty((layout.rows,) + buf.shape[1:], buf.dtype)
        dst = flat_bytes(out)
        what = sig.what
        if block:  # every rank sent its splits and waits for this call
            if layout.even:  # the call without counts: 0.4-0.6 us less at 4-64 KiB, 2 ranks
                self._blocking(lambda: self.comm.Alltoall([src, MPI.BYTE], [dst, MPI.BYTE]), what)
            else:
                sc, rc = plan.counts, layout.counts
                self._blocking(lambda: self.comm.Alltoallv([src, sc, so[:-1], MPI.BYTE],
                                                           [dst, rc, ro[:-1], MPI.BYTE]), what)
            return Done((ops.from_numpy(out, tensor), list(recv)))
        # pairwise: every send and receive posted at once (this rank's own part copied)
        dst[ro[self.rank] : ro[self.rank + 1]] = src[so[self.rank] : so[self.rank + 1]]
        peers = [p for p in range(self.size) if p != self.rank]
        comm = self._ring_comm
        engine = Exchange([(src[so[p] : so[p + 1]], p) for p in peers],
                          [(dst[ro[p] : ro[p + 1]], p) for p in peers],
                          lambda b, dest, tag: comm.Isend([b, MPI.BYTE], dest, tag),
                          lambda b, source, tag: comm.Irecv([b, MPI.BYTE], source, tag),
                          MPI.Request.Testsome, self._tags())
        return self._start(engine, lambda: (ops.from_numpy(out, tensor), list(recv)),
                           (buf, tensor), what, sync)

    def _alltoall_plan(self, ops: Any, tensor: Tensor, buf: np.ndarray,
                       splits: Sequence[int] | None, name: str | None, sync: bool) -> _Alltoall:
        """An alltoall's validated splits and header, kept per call signature (for the
        default splits and lists of them; making them anew cost ~4 us of a small one).

        Raises:
            ConfigError: for a 0-d tensor, or splits that do not fit it and the group.
        """
        key = None
        dtype = ops.dtype_name(tensor)
        if splits is None or isinstance(splits, (list, tuple)):
            key = (buf.shape, dtype, name, None if splits is None else tuple(splits),
                   sync, self.check, ops)
            plan = self._alltoalls.get(key)
            if plan is not None:
                return plan
        if buf.ndim == 0:
            raise invalid("tensor", "a 0-d tensor", "a tensor with at least one dimension")
        mine = check_splits(splits, buf.shape[0], self.size)
        send = np.array(mine, dtype=np.int64).view(np.uint8)
        want = sync and send.size <= SLOT and self.tuning.blocks(self.cross_size)
        row = math.prod(buf.shape[1:]) * buf.itemsize
        counts = [n * row for n in mine]
        plan = _Alltoall(self._sig("alltoall", buf.shape, dtype, name=name, block=want),
                         send, row, want, counts, _offsets(counts))
        if key is not None:
            if len(self._alltoalls) >= MAX_PLANS:
                self._alltoalls.clear()
            self._alltoalls[key] = plan
        return plan

    def _alltoall_layout(self, plan: _Alltoall, theirs: list[list[int]]) -> _Layout:
        """Where this rank's parts of an alltoall arrive, given every rank's splits
        ``theirs`` (rank ``p``'s ``theirs[p][self.rank]`` rows are for this rank)."""
        me, row = self.rank, plan.row
        recv = [t[me] for t in theirs]
        counts = [n * row for n in recv]
        offsets = _offsets(counts)
        copies = []
        if max(map(sum, theirs)) * row + plan.send.size <= SLOT:  # every rank's data fit
            for p, t in enumerate(theirs):  # rank p's part for this rank, in its header row
                copies.append((p, HEAD + plan.send.size + sum(t[:me]) * row, counts[p],
                               offsets[p]))
        # from every rank's splits, so that all ranks make the same call
        even = len({n for t in theirs for n in t}) == 1
        return _Layout(theirs, recv, sum(recv), counts, offsets, copies, even)

    def reducescatter_async(self, tensor: Tensor, op: str = "average",
                            name: str | None = None) -> Handle:
        return self._reducescatter(tensor, op, name, sync=False)

    def reducescatter(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Tensor:
        """Reduce over ranks and keep this rank's part of the first dimension."""
        return self._reducescatter(tensor, op, name, sync=True).wait()

    def _reducescatter(self, tensor: Tensor, op: str, name: str | None, sync: bool) -> Handle:
        ops = self._ops(tensor, "reducescatter")
        dtype = ops.dtype_name(tensor)
        self._validate_op(op, dtype)
        if op == "adasum":
            raise NotImplementedError("reducescatter with op='adasum': Horovod has none either "
                                      "(sum, average, min, max and product reduce-scatter here)")
        graph = self._graph(ops, tensor, lambda a: self.reducescatter(a, op, name),
                            same_shape=False)
        if graph is not None:
            return graph
        buf = ops.to_numpy(tensor)
        plan = self._scatter_plan(buf, dtype, op, name, sync)
        rows, row, shape, start = plan.rows, plan.row, plan.shape, plan.start
        if self.size == 1:  # a group of one (e.g. a process set): its own tensor, reduced
            return Done(ops.from_numpy(self._reduced(buf.copy(), op, dtype, ops), tensor))
        if buf.nbytes <= SLOT:  # one round: every rank's tensor in the header, reduced here
            heads = self._head(plan.sig, 0, flat_bytes(buf))
            part = self._reduce_rows(heads, buf, combiner(dtype, op, ops))
            part = part[start : start + rows[self.rank] * row].reshape(shape)
            return Done(ops.from_numpy(self._reduced(part, op, dtype, ops), tensor))
        block = False
        if plan.want or self.check:  # a blocking call: every rank arrived, and blocks
            block = self._blocks(self._head(plan.sig)) and plan.want
        what = plan.sig.what
        if not plan.mpi:
            flat = self._pool.empty((buf.size,), buf.dtype)

            def mine() -> Tensor:
                part = flat[start : start + rows[self.rank] * row].reshape(shape)
                return ops.from_numpy(self._reduced(part, op, dtype, ops), tensor)

            ring = self._ring(flat, [r * row for r in rows], "reducescatter", combiner(dtype, op, ops),
                              buf.reshape(-1))
            return self._start(ring, mine, (buf, tensor), what, sync)
        out = self._pool.empty(shape, buf.dtype)
        mpi_op = _BOOL[op] if dtype == "bool" else _BUILTIN[op]
        send, recv = [buf, _MPI_TYPES[dtype]], [out, _MPI_TYPES[dtype]]
        counts = plan.counts
        if block:
            self._blocking(lambda: self.comm.Reduce_scatter(send, recv, counts, mpi_op), what)
            return Done(ops.from_numpy(self._reduced(out, op, dtype, ops), tensor))
        return self._request(self.comm.Ireduce_scatter(send, recv, counts, mpi_op),
                             lambda: ops.from_numpy(self._reduced(out, op, dtype, ops), tensor),
                             (buf, tensor), what, sync)

    def _scatter_plan(self, buf: np.ndarray, dtype: str, op: str, name: str | None,
                      sync: bool) -> _Scatter:
        """A reducescatter's parts, algorithm and header, kept per call signature (making
        them anew cost ~3 us of a small one).

        Raises:
            ConfigError: for a 0-d tensor.
        """
        key = (buf.shape, dtype, op, name, sync, self.check)
        plan = self._scatters.get(key)
        if plan is not None:
            return plan
        if buf.ndim == 0:
            raise invalid("tensor", "a 0-d tensor", "a tensor with at least one dimension")
        rows = reducescatter_counts(buf.shape[0], self.size)
        row = math.prod(buf.shape[1:])
        mpi = buf.nbytes > SLOT and self.tuning.reduce_algorithm(
            buf.nbytes, dtype, self.cross_size) == "mpi"
        want = sync and mpi and self.tuning.blocks(self.cross_size)
        plan = _Scatter(self._sig("reducescatter", buf.shape, dtype, op, name=name, block=want),
                        rows, row, (rows[self.rank],) + buf.shape[1:],
                        sum(rows[: self.rank]) * row, mpi, want, [r * row for r in rows])
        if len(self._scatters) >= MAX_PLANS:
            self._scatters.clear()
        self._scatters[key] = plan
        return plan

    def barrier(self) -> None:
        """Wait until every rank of the group arrived.

        With the agreement check on, the check itself is the barrier (its allgather
        completes only once every rank contributed), so a rank calling another
        collective meanwhile raises :class:`~plait.errors.MismatchError` on every rank.

        Raises:
            MismatchError: when another rank makes a different call.
            CollectiveTimeoutError: when the others do not arrive within the timeout.
        """
        if self.check and self.size > 1:
            self._verify(Call("barrier", (), "none"))
        else:
            self._poll(self.comm.Ibarrier(), "barrier")

    # -- point to point -------------------------------------------------------------------------
    def send(self, tensor: Tensor, dest: int, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dest`` (until the buffer is reusable, within the timeout)."""
        self._validate_rank("dest", dest)
        ops = self._ops(tensor, "send")
        data = flat_bytes(ops.to_numpy(tensor))
        self._poll(self.comm.Isend(data, dest=dest, tag=tag),
                   f"a send to rank {dest} (tag {tag}) of {data.size} bytes", dest)

    def recv(self, like: Tensor, source: int, tag: int = 0) -> Tensor:
        """Receive a tensor shaped and typed like ``like`` from rank ``source``.

        Raises:
            MismatchError: when the message's size differs from ``like``'s.
            CollectiveTimeoutError: when no message arrives within the timeout.
        """
        self._validate_rank("source", source)
        ops = self._ops(like, "recv")
        template = ops.to_numpy(like)
        status = MPI.Status()
        self._poll_probe(source, tag, status)
        got = status.Get_count(MPI.BYTE)
        if got != template.nbytes:
            junk = np.empty(got, dtype=np.uint8)
            self._poll(self.comm.Irecv(junk, source=source, tag=tag), "a recv", source)
            raise MismatchError(
                f"{self!r}: recv from rank {source} (tag {tag}) expected {template.nbytes} bytes "
                f"(shape {template.shape}, {ops.dtype_name(like)}) but the message has {got}"
            )
        out = self._pool.empty(template.shape, template.dtype)
        self._poll(self.comm.Irecv(flat_bytes(out), source=source, tag=tag),
                   f"a recv from rank {source} (tag {tag}) of {template.nbytes} bytes", source)
        return ops.from_numpy(out, like)

    def send_async(self, tensor: Tensor, dest: int, tag: int = 0) -> Handle:
        """Post a send of ``tensor`` to rank ``dest`` and return at once (no thread, no
        polling until ``done()`` or ``wait()``); ``tensor`` must not change until the
        handle's ``wait()`` returned.

        Raises:
            CollectiveTimeoutError: from ``wait()``, when the message is not taken within
                the timeout.
        """
        self._validate_rank("dest", dest)
        data, ops = self._point_numpy(tensor, "send")
        if not data.flags.c_contiguous:  # MPI reads its bytes as they lie
            data = np.ascontiguousarray(data)
        return Point(self, self.comm.Isend([data, MPI.BYTE], dest=dest, tag=tag), dest, tag, data,
                     tensor, ops)

    def recv_async(self, like: Tensor, source: int, tag: int = 0) -> Handle:
        """Post a receive of a tensor shaped and typed like ``like`` from rank ``source``;
        ``wait()`` returns it.

        Raises:
            MismatchError: from ``wait()``, when the message's size differs from ``like``'s.
            CollectiveTimeoutError: from ``wait()``, when no message arrives within the timeout.
        """
        self._validate_rank("source", source)
        template, ops = self._point_numpy(like, "recv")
        out = self._pool.empty(template.shape, template.dtype)
        return Point(self, self.comm.Irecv([out, MPI.BYTE], source=source, tag=tag), source, tag,
                     out, like, ops, receive=True)

    def _point_numpy(self, tensor: Tensor, what: str) -> tuple[np.ndarray, Any]:
        """``tensor`` as numpy and its adapter, None for a numpy array (what the pipeline
        sends and receives: the adapter's look-up cost ~6 us of a message after compute)."""
        if type(tensor) is np.ndarray:
            return tensor, None
        ops = self._ops(tensor, what)
        return ops.to_numpy(tensor), ops

    def _poll_probe(self, source: int, tag: int, status: Any) -> None:
        self._wait_until(lambda: bool(self.comm.Iprobe(source=source, tag=tag, status=status)),
                         lambda: f"no message from rank {source} (tag {tag}) within {self.timeout:g}s",
                         point=(source, f"a message from rank {source} (tag {tag})"))

    # -- groups ------------------------------------------------------------------------------------
    def split(self, color: int, key: int = 0) -> MPICommunicator:
        """Collective over this group: ranks with equal ``color`` form a new group,
        ordered by ``key`` (then by rank).

        Raises:
            MismatchError: when another rank makes a different call.
            CollectiveTimeoutError: when the others do not arrive within the timeout
                (MPI's own split blocks: it starts only once every rank arrived).
        """
        if self.check and self.size > 1:
            self._verify(Call("split", (), "none"))
        else:
            self._poll(self.comm.Ibarrier(), "split")
        sub = self.comm.Split(int(color), int(key))
        return MPICommunicator(sub, check=self.check, timeout=self.timeout, tuning=self.tuning)
