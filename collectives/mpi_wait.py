"""Progress and bounded waits of the MPI backend (the base of
:class:`~plait.collectives.mpi.MPICommunicator`).

Open MPI moves the bytes of a nonblocking collective only inside MPI calls, and
plait's rings advance only when polled. So every collective in flight is driven by
a progress thread of the communicator (every :data:`PROGRESS_S` seconds, while the
caller computes: backward overlaps the gradients' allreduce), and by whoever waits:
a waiter polls, yielding the CPU while bytes move, and naps only after
:data:`SPIN_S` seconds without progress; every wait is bounded by the timeout. While
someone waits, the progress thread sleeps on an event (it does not poll).

A wait that times out asks the other ranks where they wait (they answer between
polls) and names the ranks that did not arrive; one that outlives a rank that ended
its program raises at once (see :mod:`plait.collectives.goodbye`).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from plait.errors import CollectiveTimeoutError, MismatchError
from plait.protocols import Handle

from .abort import end_job
from .base import CommunicatorBase, Done, rank_list
from .goodbye import Departures, say_goodbye_at_exit
from .horovod_wait import HOROVOD_WAIT
from .ring import Chain, Exchange, Relay, Ring
from .watchdog import Watchdog

__all__ = ["DRAIN_QUIET_S", "DRAIN_S", "PROGRESS_S", "SPIN_S", "TAG_UB", "Engine", "MPIWaits",
           "start_mpi", "thread_level"]

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


def start_mpi() -> None:
    """Start MPI if it is not running: a script that set ``mpi4py.rc.initialize = False``
    (as Horovod's own tests do, Horovod starting MPI itself) gets it started here, with
    every thread allowed to call MPI, and finalized at exit (after the communicators'
    goodbyes, which are registered later and so run first)."""
    if MPI.Is_initialized():
        return
    MPI.Init_thread(MPI.THREAD_MULTIPLE)
    atexit.register(lambda: None if MPI.Is_finalized() else MPI.Finalize())


def thread_level() -> str:
    """Name of the MPI thread support level provided to this process."""
    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    return names.get(MPI.Query_thread(), "unknown")


#: The largest tag. MPI defines the attribute on MPI_COMM_WORLD only (a split
#: communicator has none) and the bound holds on every communicator.
start_mpi()  # as importing mpi4py.MPI does, unless the script said mpi4py.rc.initialize = False
TAG_UB = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767)
#: Tags of the "who is waiting?" exchange after a timeout (the top of the tag range,
#: which user point-to-point messages are unlikely to use).
_ASK_TAG = TAG_UB
_ANSWER_TAG = _ASK_TAG - 1
#: The tag of the goodbyes (:mod:`plait.collectives.goodbye`) on the ring communicator,
#: above every ring's tags.
_BYE_TAG = TAG_UB
#: How long a timed-out rank listens for the others' answers at most (and at least
#: :data:`_ASK_MIN_S`; a tenth of the timeout in between: the question adds at most 10 %
#: to long timeouts). Ranks answer between polls; 8 ranks on 2 cores under load took
#: over 0.5 s to answer, and the report then named waiting ranks as missing.
_ASK_GRACE_S = 2.0
_ASK_MIN_S = 1.5


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

    def __init__(self, comm: MPIWaits, engine: Any, finish: Callable[[], Any], keep: Any,
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


#: What a communicator drives while a collective is in flight.
Engine = Ring | Chain | Exchange | Relay | _Request


def _drain_at_exit(owner: MPIWaits) -> None:
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


class MPIWaits(CommunicatorBase):
    """The waiting half of an MPI communicator: collectives in flight, their progress,
    bounded waits and the timeout's report of where the other ranks wait.

    Args:
        comm: the mpi4py communicator (default ``MPI.COMM_WORLD``).
        check: verify before each collective that all ranks make the same call.
        timeout: seconds a wait lasts at most.
    """

    def __init__(self, comm: Any = None, *, check: bool = True, timeout: float = 300.0) -> None:
        super().__init__(check=check, timeout=timeout)
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._ring_comm = self.comm.Dup()  # ring messages never meet user send/recv
        self._departures = Departures(self._ring_comm, _BYE_TAG)
        say_goodbye_at_exit(self, self._ring_comm, _BYE_TAG)
        _drain_at_exit(self)  # registered after the goodbyes: runs before them
        # collectives in flight, in start order, driven under the lock by the progress
        # thread and by waiters
        self._rings: list[Engine] = []
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
        # whether the progress thread drives Open MPI's own nonblocking collectives too
        # (the communicator decides from its tuning and host layout)
        self._drive_requests = True
        self._watchdog = Watchdog(self._stuck, name=f"plait-watchdog-{self.rank}")
        self._abandoned: list[Any] = []  # requests given up on (timeouts), with their buffers
        self._given_up = False  # a wait raised (see _drain_at_exit)
        self._calls = 0  # bounded collective waits so far (the "#k" of the timeout report)
        self._asked = 0  # timeouts reported so far (the id of each "who is waiting?")
        self._answers: list[Any] = []  # answers in flight

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

    def _start(self, engine: Engine, finish: Callable[[], Any],
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

    def _wait_engine(self, engine: Engine, what: str) -> None:
        """Wait (bounded, see :meth:`_wait_until`) until ``engine`` completed."""
        self._calls += 1
        seq = self._calls
        self._wait_until(lambda: engine.complete, lambda: self._timeout_report(what, seq), seq)

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
