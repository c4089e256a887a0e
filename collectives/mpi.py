"""MPI backend: plait's Communicator over mpi4py (the only module importing mpi4py).

Tensors are viewed as numpy buffers (no copy for host tensors). Every collective
starts with one small allgather, the *header*: each rank's call digest (the
agreement check), a number (the rows of an allgather) and up to :data:`SLOT`
bytes (alltoall splits; the whole tensor of a small allreduce, reducescatter,
broadcast, allgather or alltoall, which is then finished locally: one message
round instead of two). The data then moves by Open MPI's collectives (blocking
calls under a watchdog for synchronous ones on one host, except broadcast;
nonblocking otherwise)
or by plait's pipelined ring (:mod:`plait.collectives.ring`), chosen per message
by :class:`~plait.collectives.tuning.Tuning` from the size, dtype and host layout.
float16 and bfloat16 cross the wire at 2 bytes per element and are reduced by
numpy in the ring.

Open MPI moves the bytes of a nonblocking collective only inside MPI calls, and
plait's rings advance only when polled. So every collective in flight is driven by
a progress thread of the communicator (every :data:`PROGRESS_S` seconds, while the
caller computes: backward overlaps the gradients' allreduce), and by whoever waits:
a waiter polls, yielding the CPU while bytes move, and naps only after
:data:`SPIN_S` seconds without progress; every wait is bounded by the timeout. While
someone waits, the progress thread sleeps on an event (it does not poll).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import math
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from mpi4py import MPI
from plait.adapters.numpy import bf16_to_f32, f32_to_bf16

from plait.errors import CollectiveTimeoutError, MismatchError, invalid
from plait.protocols import Handle, Tensor

from .abort import end_job
from .base import (
    CommunicatorBase,
    Done,
    Pending,
    check_splits,
    floating,
    rank_list,
    reducescatter_counts,
)
from .check import Call, mismatch
from .goodbye import Departures, say_goodbye_at_exit
from .horovod_wait import HOROVOD_WAIT
from .join import ALLREDUCE, JOINED, OTHER, SMALL, STEP, Reduction, describe, read, zeros
from .point import Point
from .pool import BufferPool
from .ring import Chain, Exchange, Relay, Ring, combiner, segments
from .tuning import Tuning
from .watchdog import Watchdog

__all__ = ["PROGRESS_S", "SLOT", "SPIN_S", "MPICommunicator", "start_mpi", "thread_level"]

_BUILTIN = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD,
            "average": MPI.SUM}
_BOOL = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "product": MPI.LAND}
_MPI_TYPES = {
    "float32": MPI.FLOAT, "float64": MPI.DOUBLE, "int8": MPI.INT8_T, "uint8": MPI.UINT8_T,
    "int16": MPI.INT16_T, "uint16": MPI.UINT16_T, "int32": MPI.INT32_T, "int64": MPI.INT64_T,
    "bool": MPI.C_BOOL,
}
#: Payload bytes the header carries (a small allreduce travels whole in it); with the
#: header's fields a multiple of 8 bytes, so that rows read in place as int64s.
SLOT = 1024
_HEAD = 24  # digest, one number and the role (see plait.collectives.join), int64 each
_HEAD_FORMAT = struct.Struct("=3q")  # native int64s, as the rows are read back
_NUMBER = struct.Struct("=q")  # the header's number, at byte 8
#: In a header's first number, beside the 62-bit digest: this rank asks for the blocking
#: call (a blocking collective matches only blocking ones, see ``_blocks``).
_BLOCK = 1 << 62
_DIGEST = _BLOCK - 1
#: Seconds a waiter keeps polling (yielding the CPU) after the last sign of progress.
SPIN_S = 0.05
_NAP_S = 2e-4
#: Polls a waiter makes before it registers as waiting (see ``_wait_until``): on one host
#: a header round's other rank arrives within them (~0.3 us a poll).
_QUICK_POLLS = 64
#: Seconds between the progress thread's polls while collectives are in flight.
PROGRESS_S = 5e-4
#: Seconds a communicator lets its unfinished collectives complete at exit (and how
#: long nothing may move meanwhile).
DRAIN_S, DRAIN_QUIET_S = 5.0, 1.0
_MAX_CHUNKS = 4096  # tags per ring collective


def start_mpi() -> None:
    """Start MPI if it is not running: a script that set ``mpi4py.rc.initialize = False``
    (as Horovod's own tests do, Horovod starting MPI itself) gets it started here, with
    every thread allowed to call MPI, and finalized at exit (after the communicators'
    goodbyes, which are registered later and so run first)."""
    if MPI.Is_initialized():
        return
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
    atexit.register(lambda: None if MPI.Is_finalized() else MPI.Finalize())


def _drain_at_exit(owner: MPICommunicator) -> None:
    """At interpreter exit (before the goodbyes and ``MPI_Finalize``), let the
    collectives of ``owner`` still in flight complete: a handle never waited for (Horovod's
    users drop some) left an ``MPI_Iallreduce`` running into ``MPI_Finalize``, which then
    crashed Open MPI (SIGSEGV or a corrupted heap). Bounded by :data:`DRAIN_S` and
    :data:`DRAIN_QUIET_S`; nothing to do after a wait of this communicator failed (its
    collectives in flight cannot complete), and ends once another rank said goodbye."""
    ref = weakref.ref(owner)

    def drain() -> None:
        comm = ref()
        if comm is None or comm._given_up or MPI.Is_finalized():
            return
        now = time.monotonic()
        deadline, quiet = now + DRAIN_S, now
        while comm._rings and now < deadline and now - quiet < DRAIN_QUIET_S:
            if comm._drive():
                quiet = now
            comm._departures.read()
            if comm._departures.gone:
                return
            time.sleep(PROGRESS_S)
            now = time.monotonic()

    atexit.register(drain)


def thread_level() -> str:
    """Name of the MPI thread support level provided to this process."""
    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    return names.get(MPI.Query_thread(), "unknown")


def _offsets(counts: Sequence[int]) -> list[int]:
    """``[0, c0, c0+c1, ...]``: where consecutive parts of the given sizes start."""
    return [0, *itertools.accumulate(counts)]


def _flat_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


#: The largest tag. MPI defines the attribute on MPI_COMM_WORLD only (a split
#: communicator has none) and the bound holds on every communicator.
start_mpi()  # as importing mpi4py.MPI does, unless the script said mpi4py.rc.initialize = False
_TAG_UB = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767)
#: Tags of the "who is waiting?" exchange after a timeout (the top of the tag range,
#: which user point-to-point messages are unlikely to use).
_ASK_TAG = _TAG_UB
_ANSWER_TAG = _ASK_TAG - 1
#: The tag of the goodbyes (:mod:`plait.collectives.goodbye`) on the ring communicator,
#: above every ring's tags.
_BYE_TAG = _TAG_UB
#: How long a timed-out rank listens for the others' answers at most (and at least
#: :data:`_ASK_MIN_S`; a tenth of the timeout in between: the question adds at most 10 %
#: to long timeouts). Ranks answer between polls; 8 ranks on 2 cores under load took
#: over 0.5 s to answer, and the report then named waiting ranks as missing.
_ASK_GRACE_S = 2.0
_ASK_MIN_S = 1.5
#: Allreduce plans kept (a loop has a few dozen call signatures; forgotten all at once beyond).
_MAX_PLANS = 1024


class _Request:
    """An MPI request driven like a ring (``progress``, ``complete``, ``moved``)."""

    def __init__(self, req: Any) -> None:
        self._req = req
        self.complete = False
        self.moved = 0

    def progress(self) -> bool:
        if not self.complete:
            self.complete = bool(self._req.Test())
            self.moved += self.complete
        return self.complete


class _Flight:
    """A handle over a collective in flight on an :class:`MPICommunicator` (see its
    ``_start``): one object with slots where closures made ~30 objects the garbage
    collector tracks per collective (a step of 32 buckets crossed its threshold, and a
    collection took ~0.2 ms, every few steps).

    Args:
        comm: the communicator that drives ``engine``.
        engine: the collective's engine (a ring, a chain, an MPI request...).
        finish: turns the completed collective into the result (called once).
        keep: objects that must stay alive while it is in flight.
        what: the collective in words, for the timeout's report.
    """

    __slots__ = ("_comm", "_engine", "_finish", "_keep", "what", "_result", "_finished")

    def __init__(self, comm: MPICommunicator, engine: Any, finish: Callable[[], Any], keep: Any,
                 what: str) -> None:
        self._comm, self._engine, self._finish, self._keep = comm, engine, finish, keep
        self.what = what
        self._result: Any = None
        self._finished = False

    def done(self) -> bool:
        if self._finished:
            return True
        self._comm._drive()
        return bool(self._engine.complete)

    def wait(self) -> Any:
        if not self._finished:
            self._comm._wait_engine(self._engine, self.what)
            self._result = self._finish()
            self._finished = True
            self._keep = self._engine = None
        return self._result


@dataclass(frozen=True)
class _Plan:
    """An allreduce call signature's work, made once (see ``_allreduce_plan``)."""

    call: Call
    row: np.ndarray  # the header row (a small allreduce copies it and adds its data)
    combine: Any
    reduction: Reduction | None  # None: small, reduced from the header's rows
    what: str  # the call, for messages


@dataclass(eq=False)
class _Sig:
    """A collective's call signature, with its header row made once (see ``_sig``)."""

    call: Call
    row: np.ndarray  # the header row: digest (and the block bit), role; number 0, no payload
    role: int
    what: str  # the call, for messages
    gathered: _Gathered | None = None  # an allgather's last layout (the ranks' rows)


@dataclass(frozen=True)
class _Gathered:
    """Where an allgather's parts go, for the ranks' numbers of rows ``numbers``."""

    numbers: list[int]
    counts: list[int]  # bytes from each rank
    fits: bool  # every rank's part came in the header
    even: bool  # every part is as long
    ring: bool  # plait's ring (else Open MPI's allgather)


@dataclass(frozen=True)
class _Scatter:
    """A reducescatter's call signature, its parts and algorithm (see ``_scatter_plan``)."""

    sig: _Sig
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

    sig: _Sig
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


class MPICommunicator(CommunicatorBase):
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
        super().__init__(check=check, timeout=timeout)
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.tuning = Tuning.from_env() if tuning is None else tuning
        self._ring_comm = self.comm.Dup()  # ring messages never meet user send/recv
        self._departures = Departures(self._ring_comm, _BYE_TAG)
        say_goodbye_at_exit(self, self._ring_comm, _BYE_TAG)
        _drain_at_exit(self)  # registered after the goodbyes: runs before them
        # the tag ranges of successive rings; a split communicator used to fall back to
        # 7 ranges (32767 // 4096), so a DP step with more buckets in flight reused tags
        # of rings still running: messages crossed between buckets (MPI_ERR_TRUNCATE or
        # corrupted memory, measured across hosts)
        self._tag_slots = max(1, _TAG_UB // _MAX_CHUNKS)
        # collectives in flight, in start order, driven under the lock by the progress
        # thread and by waiters
        self._rings: list[Ring | Chain | Exchange | Relay | _Request] = []
        # per engine in flight (by id): its handle's buffers, which MPI may still write to
        # (a caller may drop the handle, Horovod's users do, without waiting for it)
        self._held: dict[int, tuple[Any, Any]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # one token per wait in progress (they drive; the progress thread rests); a set, as
        # add/discard are atomic where a shared counter's += is not
        self._waiting: set[object] = set()
        self._unwatched = threading.Event()  # set while nobody waits
        self._unwatched.set()
        self._pool = BufferPool()  # outputs, reused once nobody holds them
        self._plans: dict[tuple[Any, ...], _Plan] = {}  # see _allreduce_plan
        self._sigs: dict[tuple[Any, ...], _Sig] = {}  # see _sig
        # the last header rows checked and their leading numbers, read once (see _heads)
        self._checked: tuple[np.ndarray | None, list[list[int]]] = (None, [])
        self._alltoalls: dict[tuple[Any, ...], _Alltoall] = {}  # see _alltoall_plan
        self._scatters: dict[tuple[Any, ...], _Scatter] = {}  # see _scatter_plan
        self._watchdog = Watchdog(self._stuck, name=f"plait-watchdog-{self.rank}")
        self._ring_seq = 0
        self._joiners: list[weakref.WeakMethod[Any]] = []  # see serve_joined
        self._abandoned: list[Any] = []  # requests given up on (timeouts), with their buffers
        self._given_up = False  # a wait raised (see _drain_at_exit)
        self._calls = 0  # bounded collective waits so far (the "#k" of the timeout report)
        self._asked = 0  # timeouts reported so far (the id of each "who is waiting?")
        self._answers: list[Any] = []  # answers in flight
        self._topology()
        cpus = os.cpu_count() or 1
        bound = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
        # whether the progress thread drives Open MPI's own nonblocking collectives too
        self._drive_requests = self.tuning.drives_requests(
            self.cross_size, min(bound, cpus / max(1, self.local_size)))
        # the two levels of the hierarchical allreduce: this host's ranks, and the ranks
        # with this local rank on every host (every rank decides alike: same host list)
        self._local: Any = None
        self._cross: Any = None
        if self.cross_size > 1 and self.local_size > 1 and self.homogeneous:
            self._local = self.comm.Split(self.cross_rank, self.rank)
            self._cross = self.comm.Split(self.local_rank, self.rank)

    # -- waiting --------------------------------------------------------------------
    def _drive(self, block: bool = True) -> bool:
        """Advance every collective in flight; True when something moved.

        Args:
            block: wait for the lock (a waiter), or give up at once when another
                thread holds it (the progress thread).
        """
        if not self._lock.acquire(blocking=block):
            return False
        try:
            moved = False
            for ring in self._rings:
                before = ring.moved
                ring.progress()
                moved = moved or ring.moved != before
            if any(r.complete for r in self._rings):
                for r in self._rings:
                    if r.complete:
                        self._held.pop(id(r), None)
                self._rings = [r for r in self._rings if not r.complete]
            return moved
        finally:
            self._lock.release()

    def _progress_loop(self) -> None:
        """The progress thread: drive what is in flight while nobody waits for it (a
        waiter drives everything itself; two threads polling one transport only
        trade the GIL and the lock), sleep when nothing is in flight."""
        while True:
            self._wake.wait()
            while self._rings:
                # a waiter drives: rest until it is done (polling here only to see that
                # someone waits cost 8 ranks on 2 cores half their time, measured)
                self._unwatched.wait()
                self._drive(block=False)
                time.sleep(PROGRESS_S)
            self._wake.clear()
            if self._rings:  # started between the check and the clear
                self._wake.set()

    def _wait_until(self, ready: Callable[[], bool], timed_out: Callable[[], str],
                    seq: int = -1, point: tuple[int, str] | None = None) -> None:
        """Poll ``ready`` (which drives MPI progress), and the rings in flight, until it
        is true; raise after ``self.timeout`` seconds.

        Polls yield the CPU and never sleep while anything moved in the last
        :data:`SPIN_S` seconds (a sleeping rank would stall its own transfers). Then
        it naps between polls and answers other ranks that timed out and ask who is
        waiting (saying "collective #seq", or -1 outside a collective). A wait of a
        collective raises when a rank of the group ended its program, and one for a
        message to or from a single rank (``point``: that rank and what the message is),
        when that rank did (see :mod:`plait.collectives.goodbye`)."""
        if ready():
            return
        if not self._rings:  # a short collective completes within a few polls: spare it
            for _ in range(_QUICK_POLLS):  # the bookkeeping below (~2 us a header round)
                if ready():
                    return
        token = object()
        self._waiting.add(token)
        self._unwatched.clear()
        try:
            self._wait_loop(ready, timed_out, seq, point)
        except BaseException:
            self._given_up = True
            raise
        finally:
            self._waiting.discard(token)
            if not self._waiting:
                self._unwatched.set()

    def _wait_loop(self, ready: Callable[[], bool], timed_out: Callable[[], str], seq: int,
                   point: tuple[int, str] | None) -> None:
        now = time.monotonic()
        deadline, quiet, answer_at = now + self.timeout, now, 0.0
        while True:
            if self._rings and self._drive():
                quiet = time.monotonic()
            if ready():
                return
            now = time.monotonic()
            if now > deadline:
                raise CollectiveTimeoutError(f"{self!r}: {timed_out()}")
            if now - quiet < SPIN_S:
                os.sched_yield()
                continue
            if now > answer_at:
                self._answer(seq)
                answer_at = now + 0.05
                if seq > 0 or point is not None:  # did a rank this wait needs leave?
                    self._departures.read()
                    gone = self._departures.overdue(quiet, now)
                    if point is not None:
                        gone = [r for r in gone if r == point[0]]
                    if gone:
                        raise self._departed(gone, seq, None if point is None else point[1])
            time.sleep(_NAP_S)

    def _departed(self, gone: list[int], seq: int, what: str | None) -> MismatchError:
        """The error of a wait for ranks that ended their program (``what``: a message's
        description; None: the last collective started)."""
        if what is None:
            what = self._call.describe() if self._call is not None else "a collective"
        hosts = self.on_hosts(gone).rstrip("; ")
        return MismatchError(
            f"{self!r}: {rank_list(gone)}{self._world_ranks(gone)}{f' ({hosts})' if hosts else ''} "
            f"ended its program while this rank waits in {what} (collective #{seq}): "
            "the ranks called different collectives or different numbers of them (as Horovod: "
            "a collective after one of the ranks finished execution)")

    def _poll(self, req: Any, what: str, peer: int | None = None) -> None:
        """Wait for ``req``, raising if the group (or the one ``peer`` of a message) does
        not complete it in time (the request is then kept: mpi4py holds its buffers, which
        MPI may still write into once a late rank arrives; freed, they were reused and a
        later test crashed)."""
        self._calls += 1
        seq = self._calls
        point = None if peer is None else (peer, what)
        try:
            self._wait_until(req.Test, lambda: self._timeout_report(what, seq), seq, point)
        except BaseException:
            self._abandoned.append(req)
            raise

    def _stuck(self, what: str) -> None:
        """A blocking call outlived the timeout (the watchdog's thread): end the job."""
        end_job(CollectiveTimeoutError(
            f"{self!r}: waited {self.timeout:g}s in the blocking data phase of {what}, which every "
            "rank had reached (a rank stopped, died or was cut off in the middle of it); a "
            "blocking call cannot raise, so this rank ends the job"))

    # -- timeout report ----------------------------------------------------------------
    def _answer(self, seq: int) -> dict[int, int]:
        """Answer every pending "who is waiting?" with ``seq``; return the askers'
        own positions (they are waiting too)."""
        askers: dict[int, int] = {}
        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_ASK_TAG, status=status):
            source = status.Get_source()
            ask = np.empty(2, dtype=np.int64)
            self.comm.Recv(ask, source=source, tag=_ASK_TAG)
            askers[source] = int(ask[1])
            reply = np.array([ask[0], seq], dtype=np.int64)
            self._answers.append((self.comm.Isend(reply, dest=source, tag=_ANSWER_TAG), reply))
        self._answers = [(r, b) for r, b in self._answers if not r.Test()]
        return askers

    def _who_waits(self, seq: int) -> dict[int, int]:
        """Ask every other rank where it waits; return ``{rank: its collective number
        (-1: outside a collective)}`` for those that answered within the grace time."""
        self._asked += 1
        ask = np.array([self._asked, seq], dtype=np.int64)
        for peer in range(self.size):
            if peer != self.rank:
                self._answers.append((self.comm.Isend(ask, dest=peer, tag=_ASK_TAG), ask))
        heard: dict[int, int] = {}
        status = MPI.Status()
        reply = np.empty(2, dtype=np.int64)
        deadline = time.monotonic() + min(_ASK_GRACE_S, max(_ASK_MIN_S, 0.1 * self.timeout))
        while len(heard) < self.size - 1 and time.monotonic() < deadline:
            heard.update(self._answer(seq))
            while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_ANSWER_TAG, status=status):
                source = status.Get_source()
                self.comm.Recv(reply, source=source, tag=_ANSWER_TAG)
                if int(reply[0]) == self._asked:  # not an answer to an older question
                    heard[source] = int(reply[1])
            time.sleep(1e-3)
        return heard

    def _timeout_report(self, what: str, seq: int) -> str:
        """The timeout message, naming the ranks that did not arrive when it can."""
        if self._call is not None and what == "a collective":
            what = self._call.describe()
        head = f"waited {self.timeout:g}s for the other ranks to reach {what} (collective #{seq})"
        return head if self.size < 2 else f"{head}; {self.arrivals(seq)}"

    def arrivals(self, seq: int, here: str = "waited in it") -> str:
        """Ask the other ranks where they wait (they answer while they wait in plait):
        which ranks of this group wait in collective ``seq`` like this one, which wait
        elsewhere, and which did not answer, with their hosts.

        Args:
            seq: the collective this rank waits in (see :meth:`_wait_until`; the Horovod
                backend's waits answer :data:`HOROVOD_WAIT`).
            here: what the ranks waiting in ``seq`` are said to do.

        Returns:
            Clauses for a timeout message, joined by "; ".
        """
        try:
            heard = self._who_waits(seq)
        except MPI.Exception as exc:  # e.g. a peer's link is gone: report what is known
            return f"could not ask the other ranks where they wait ({exc})"
        missing = [r for r in range(self.size) if r != self.rank and r not in heard]
        same = [self.rank] + sorted(r for r, s in heard.items() if s == seq)
        parts = [f"{rank_list(sorted(same))} of this group {here}"]
        if missing:
            parts.append(f"{rank_list(missing)}{self._world_ranks(missing)} did not arrive "
                         f"({self.on_hosts(missing)}dead, stuck, unreachable, or busy outside plait)")
        for r, s in sorted(heard.items()):
            if s != seq:
                where = {-1: "a recv", HOROVOD_WAIT: "a Horovod op"}.get(s, f"collective #{s}")
                parts.append(f"rank {r}{self._world_ranks([r])} is waiting in {where} "
                             "(calling something else)")
        return "; ".join(parts)

    def answer(self, seq: int) -> None:
        """Answer the other ranks' pending "where do you wait?" with ``seq`` (a wait
        outside this communicator calls it now and then, see :meth:`arrivals`)."""
        self._answer(seq)

    def _world_ranks(self, ranks: list[int]) -> str:
        """`` (world ranks [...])`` when this group is not the whole world."""
        if self.size == MPI.COMM_WORLD.Get_size():
            return ""
        world = MPI.Group.Translate_ranks(self.comm.Get_group(), ranks, MPI.COMM_WORLD.Get_group())
        return f" (world {rank_list(list(world))})"

    def _raw_allgather_bytes(self, data: np.ndarray) -> np.ndarray:
        data = _flat_bytes(data)
        counts = np.empty(self.size, dtype=np.int64)
        self._poll(self.comm.Iallgather(np.array([data.size], dtype=np.int64), counts),
                   "an object allgather")
        out = np.empty(int(counts.sum()), dtype=np.uint8)
        self._poll(self.comm.Iallgatherv([data, MPI.BYTE], [out, counts, MPI.BYTE]),
                   "an object allgather")
        return out

    def _raw_bcast_bytes(self, data: np.ndarray | None, root: int) -> np.ndarray:
        n = np.array([0 if data is None else data.size], dtype=np.int64)
        self._poll(self.comm.Ibcast(n, root=root), "an object broadcast")
        out = _flat_bytes(data).copy() if data is not None else np.empty(int(n[0]), np.uint8)
        self._poll(self.comm.Ibcast(out, root=root), "an object broadcast")
        return out

    # -- the header: agreement check, sizes and small payloads in one allgather ---------
    def _verify(self, call: Call, payload: np.ndarray | None = None, role: int = OTHER) -> None:
        if self.check and self.size > 1:
            self._header(call, 0, payload, role)

    def _header(self, call: Call, number: int = 0, payload: np.ndarray | None = None,
                role: int = OTHER, block: bool = False) -> np.ndarray:
        """Allgather every rank's call digest, ``number``, ``role`` (what a rank that
        called :meth:`join` does with this call), whether it asks for the blocking call
        (``block``, see :meth:`_blocks`) and ``payload`` (at most :data:`SLOT` bytes);
        raise on every rank when the digests differ.

        Returns:
            One row per rank: ``[digest, number, role]`` as int64, then the payload bytes.

        Raises:
            MismatchError: when the ranks' calls differ (with the check on), or when
                some ranks joined and this call is not an allreduce.
            CollectiveTimeoutError: when the others do not arrive in time.
        """
        return self._header_row(call, self._row(call, number, role, payload, block), role)

    def _header_row(self, call: Call, row: np.ndarray, role: int) -> np.ndarray:
        """:meth:`_header` of a row made by :meth:`_row`."""
        req, rows = self._header_start(call, row)
        self._poll(req, "a collective")
        return self._header_check(call, rows, role)

    def _row(self, call: Call, number: int, role: int, payload: np.ndarray | None,
             block: bool = False) -> np.ndarray:
        """This rank's header row: the call's digest (and ``block``), ``number``, ``role``,
        ``payload``."""
        row = np.zeros(_HEAD + SLOT, dtype=np.uint8)
        digest = call.digest() if self.check else 0
        _HEAD_FORMAT.pack_into(row.data, 0, digest | _BLOCK if block else digest, number, role)
        if payload is not None:
            row[_HEAD : _HEAD + payload.size] = payload
        return row

    def _sig(self, kind: str, shape: tuple[int, ...], dtype: str, op: str | None = None,
             root: int | None = None, name: str | None = None, block: bool = False,
             role: int = OTHER) -> _Sig:
        """The :class:`Call` of a collective and its header row, kept per signature (a
        training loop repeats its calls; making them anew cost ~3 us of a small one).
        Allgather and alltoall are ragged (their first dimension may differ)."""
        key = (kind, shape, dtype, op, root, name, block, role, self.check)
        sig = self._sigs.get(key)
        if sig is None:
            call = Call(kind, shape, dtype, op=op, root=root, name=name,
                        ragged=kind in ("allgather", "alltoall"))
            if len(self._sigs) >= _MAX_PLANS:
                self._sigs.clear()
            sig = self._sigs[key] = _Sig(call, self._row(call, 0, role, None, block), role,
                                         call.describe())
        return sig

    def _head(self, sig: _Sig, number: int = 0, *payload: np.ndarray | None) -> np.ndarray:
        """:meth:`_header` of the call of ``sig``, with ``number`` and the bytes of
        ``payload`` one after another (None: none)."""
        row = sig.row.copy()
        if number:
            _NUMBER.pack_into(row.data, 8, number)
        at = _HEAD
        for part in payload:
            if part is not None:
                row[at : at + part.size] = part
                at += part.size
        return self._header_row(sig.call, row, sig.role)

    def _header_start(self, call: Call, row: np.ndarray) -> tuple[Any, np.ndarray]:
        """Start allgathering every rank's header ``row``; return the request and the rows."""
        self._call = call
        rows = np.empty((self.size, _HEAD + SLOT), dtype=np.uint8)
        return self.comm.Iallgather(row, rows), rows

    def _header_check(self, call: Call, rows: np.ndarray, role: int) -> np.ndarray:
        # a few rows of three numbers: plain Python is faster than numpy here (every
        # collective passes through; measured ~5 us less per call)
        heads = rows.view(np.int64)[:, :3].tolist()
        self._checked = (rows, heads)
        first = heads[0][0] & _DIGEST
        if all(head[0] & _DIGEST == first and head[2] != JOINED for head in heads):
            return rows  # the usual case: one digest, nobody joined
        joined = [r for r, head in enumerate(heads) if head[2] == JOINED]
        digests = {head[0] & _DIGEST for head in heads if head[2] != JOINED}
        if self.check and len(digests) > 1:
            raise mismatch(call, self._raw_allgather_bytes,
                           f"the {self.backend} communicator of size {self.size}")
        if role == OTHER and joined:
            raise MismatchError(
                f"{self!r}: {call.describe()} while rank(s) {joined} have called join(); "
                "joined ranks only take part in allreduce (contributing zeros), as in Horovod")
        return rows

    def _blocks(self, rows: np.ndarray) -> bool:
        """Whether every rank that has not joined asked for the blocking call in its header
        row (``block``). MPI matches a blocking collective only with blocking ones: where
        one rank waits for an asynchronous collective (Horovod lets ranks mix
        ``allreduce`` and ``allreduce_async``), all take the nonblocking call. A joined
        rank's row always asks (it follows the others)."""
        return all(head[0] & _BLOCK for head in self._heads(rows))

    def _heads(self, rows: np.ndarray) -> list[list[int]]:
        """``[digest, number, role]`` of every rank's header row in ``rows``, as
        :meth:`_header_check` read them when it checked these rows (each read of a few
        numbers from numpy costs ~1 us)."""
        checked, heads = self._checked
        if checked is rows:
            return heads
        return rows.view(np.int64)[:, :3].tolist()  # type: ignore[no-any-return]

    def serve_joined(self, step: Callable[[], Any]) -> int:
        """Register a gradient reducer's step for ranks that joined (see :meth:`join`):
        a reducer that moves its buckets on a private unchecked communicator announces
        each step with :meth:`step_notice`, and a joined rank then runs ``step``
        (its own reducer's step with zero gradients). Ranks register in the same order.

        Args:
            step: a bound method (held weakly: a dropped reducer is forgotten).

        Returns:
            The key to pass to :meth:`step_notice`.
        """
        self._joiners.append(weakref.WeakMethod(step))  # type: ignore[arg-type]
        return len(self._joiners) - 1

    def step_notice(self, key: int) -> Handle:
        """Announce a step of the reducer registered as ``key`` to joined ranks (a
        header, not waited for here); wait for the handle before the step ends.

        Raises (from ``wait()``):
            MismatchError: when another rank made a different call meanwhile.
        """
        if self.size == 1 or not self.check:
            return Done(None)
        sig = self._sig("reducer step", (), "none", role=STEP)
        call, row = sig.call, sig.row.copy()
        _NUMBER.pack_into(row.data, 8, key)
        req, rows = self._header_start(call, row)
        # not driven by this communicator's progress thread (waking it during backward
        # cost ~0.5 ms a step, measured): MPI moves it inside the buckets' calls
        return Pending(req.Test, lambda: self._poll(req, "the announcement of a gradient "
                                                    "reducer's step"),
                       lambda: self._header_check(call, rows, STEP), rows)

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
                r = read(rows[live[0], _HEAD:])
                if r.blocking and not self._blocks(rows):
                    r = replace(r, blocking=False)
                mine = zeros(r)
                self._allreduce_data(mine, r, None, lambda out: None, mine,
                                     f"allreduce of {r.size} {r.dtype} while joined").wait()

    # -- data movement ---------------------------------------------------------------------
    def _request(self, req: Any, finish: Callable[[], Any], keep: Any, what: str,
                 sync: bool = False) -> Handle:
        """A handle over an MPI request, driven like a ring; ``wait()`` is bounded
        (``sync``: waited for here, by polling the request alone: the ring machinery of
        :meth:`_start` cost ~5 us of a 4 KiB broadcast on one host)."""
        if sync:
            self._poll(req, what)
            return Done(finish())
        return self._start(_Request(req), finish, keep, what, sync)

    def _blocking(self, run: Callable[[], Any], what: str) -> None:
        """Make the blocking MPI call ``run()`` that every rank of the group has reached
        (their header round completed), bounded by the watchdog (see :meth:`_stuck`)."""
        key = self._watchdog.arm(self.timeout, lambda: what)
        try:
            run()
        finally:
            self._watchdog.disarm(key)

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

    def _start(self, engine: Ring | Chain | Exchange | Relay | _Request, finish: Callable[[], Any],
               keep: Any, what: str, sync: bool = False) -> Handle:
        """A handle over a collective in flight, driven by the progress thread and by
        every wait and test (``sync``: waited for at once by the caller, which drives it;
        the progress thread is not woken for it: on 2 ranks of 2 cores its wake-up added
        11-21 us to an 8 KiB alltoall or allgather, measured with ``PLAIT_BLOCKING=never``)."""
        with self._lock:
            self._rings.append(engine)
            self._held[id(engine)] = (finish, keep)
        # Open MPI's own request also moves inside this rank's next MPI call; where no
        # core is spare, a thread polling it slowed the steps it overlaps (see Tuning)
        if not sync and (self._drive_requests or not isinstance(engine, _Request)):
            if self._thread is None:
                self._thread = threading.Thread(target=self._progress_loop, daemon=True,
                                                name=f"plait-progress-{self.rank}")
                self._thread.start()
            self._wake.set()

        return _Flight(self, engine, finish, keep, what)

    def _wait_engine(self, engine: Ring | Chain | Exchange | Relay | _Request, what: str) -> None:
        """Wait (bounded, see :meth:`_wait_until`) until ``engine`` completed."""
        self._calls += 1
        seq = self._calls
        self._wait_until(lambda: engine.complete, lambda: self._timeout_report(what, seq), seq)

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
        plan = self._allreduce_plan(ops, buf, dtype, op, name, sync)
        call = plan.call
        if self.size == 1:
            return Done(ops.from_numpy(self._reduced(buf.copy(), op, dtype, ops), tensor))
        if plan.reduction is None:  # one round: every rank's tensor travels in the header
            row = plan.row.copy()
            row[_HEAD : _HEAD + buf.nbytes] = _flat_bytes(buf)
            out = self._reduce_rows(self._header_row(call, row, SMALL), buf, plan.combine)
            return Done(ops.from_numpy(self._reduced(out.reshape(buf.shape), op, dtype, ops), tensor))
        r = plan.reduction
        if r.blocking or self.check:  # a blocking call: every rank arrived, and blocks
            rows = self._header_row(call, plan.row, ALLREDUCE)
            if r.blocking and not self._blocks(rows):
                r = replace(r, blocking=False)

        finish = functools.partial(self._finish_reduce, ops, op, dtype, buf.shape, tensor)
        return self._allreduce_data(buf, r, ops, finish, (buf, tensor), plan.what, sync)

    def _finish_reduce(self, ops: Any, op: str, dtype: str, shape: tuple[int, ...], like: Tensor,
                       out: np.ndarray) -> Tensor:
        """An allreduce's result: ``out`` (flat) reduced by ``op`` in ``shape``, a tensor
        like ``like``."""
        return ops.from_numpy(self._reduced(out.reshape(shape), op, dtype, ops), like)

    def _reduce_rows(self, rows: np.ndarray, buf: np.ndarray, combine: Any) -> np.ndarray:
        """Every rank's tensor like ``buf``, sent as the payload of its header row in
        ``rows``, reduced here by ``combine`` (flat)."""
        parts = np.ascontiguousarray(rows[:, _HEAD : _HEAD + buf.nbytes]).view(buf.dtype)
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
        if len(self._plans) >= _MAX_PLANS:
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
        mine = _flat_bytes(buf)
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
            g = sig.gathered = _Gathered(numbers, counts, max(counts) <= SLOT,
                                         len(set(counts)) == 1, self.tuning.gather_algorithm(
                                             sum(counts), self.cross_size) == "ring")
        counts = g.counts
        out = self._pool.empty((sum(numbers),) + buf.shape[1:], buf.dtype)
        flat = _flat_bytes(out)
        if g.fits:
            at = 0
            for r, n in enumerate(counts):
                flat[at : at + n] = rows[r, _HEAD : _HEAD + n]
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
            rows = self._head(sig, 0, _flat_bytes(buf) if self.rank == root else None)
            data = np.ascontiguousarray(rows[root, _HEAD : _HEAD + buf.nbytes])
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
            req = self.comm.Ibcast([_flat_bytes(src), MPI.BYTE], root=root)
            if self.rank == root:
                out[...] = src
            return self._request(req, lambda: ops.from_numpy(out, tensor), (src, buf, tensor),
                                 what, sync)
        if self.rank == root:
            out[...] = buf
        if ring:
            comm = self._ring_comm
            relay = Relay(_flat_bytes(out), self.rank, self.size, root,
                          lambda b, dest, tag: comm.Isend([b, MPI.BYTE], dest, tag),
                          lambda b, source, tag: comm.Irecv([b, MPI.BYTE], source, tag),
                          MPI.Request.Testsome, self._tags(), self.tuning.chunk_bytes,
                          _MAX_CHUNKS, self.tuning.window)
            return self._start(relay, lambda: ops.from_numpy(out, tensor), (buf, tensor), what,
                               sync)
        return self._request(self.comm.Ibcast([_flat_bytes(out), MPI.BYTE], root=root),
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
        src = _flat_bytes(buf)
        block = False
        if send.size <= SLOT:  # the splits travel in the header, and the data if it fits
            rows = self._head(sig, 0, send, src if send.size + src.size <= SLOT else None)
            # the splits as int64s in place (a row's header and slot are whole int64s)
            theirs = rows.view(np.int64)[:, _HEAD // 8 : _HEAD // 8 + self.size].tolist()
            layout = plan.layout
            if layout is None or theirs != layout.theirs:
                layout = plan.layout = self._alltoall_layout(plan, theirs)
            if layout.copies:  # every rank's part for this rank came in the header
                out = self._pool.empty((layout.rows,) + buf.shape[1:], buf.dtype)
                dst = _flat_bytes(out)
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
        dst = _flat_bytes(out)
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
            if len(self._alltoalls) >= _MAX_PLANS:
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
                copies.append((p, _HEAD + plan.send.size + sum(t[:me]) * row, counts[p],
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
            heads = self._head(plan.sig, 0, _flat_bytes(buf))
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
        if len(self._scatters) >= _MAX_PLANS:
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
        data = _flat_bytes(ops.to_numpy(tensor))
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
        self._poll(self.comm.Irecv(_flat_bytes(out), source=source, tag=tag),
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
