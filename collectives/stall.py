"""Stall inspector: rank 0 names the tensors some ranks wait on and the ranks missing.

Raw MPI hangs silently when one rank never reaches a collective; Horovod prints
which ranks have not submitted which tensors. plait does the same on any
backend of a job started by an MPI launcher:

* every rank announces each collective it enters (communicator, sequence
  number, name) to rank 0 with a nonblocking send on a duplicate of the MPI
  world (a few microseconds per call, no waiting);
* a background thread on rank 0 matches announcements per communicator and
  call; when some members entered a call and others did not for longer than
  ``PLAIT_STALL_WARNING`` seconds it prints (to stderr) which tensor and which
  ranks are missing, and after ``PLAIT_STALL_SHUTDOWN`` seconds (0: never) it
  aborts the whole job with ``MPI_Abort``.

The agreement check's timeout (``PLAIT_TIMEOUT``, :class:`~plait.errors.CollectiveTimeoutError`)
still bounds every wait. On the Horovod backend started by ``horovodrun --gloo``
(no MPI) plait passes the same settings to Horovod's own inspector
(``HOROVOD_STALL_CHECK_TIME_SECONDS``, ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``; see
:func:`plait.collectives.timeline.prepare_env`).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from plait.errors import invalid

__all__ = ["StallInspector", "Tracker"]

_TAG = 7710


@dataclass
class _Call:
    members: tuple[int, ...]
    first: float
    entered: dict[int, str] = field(default_factory=dict)
    warned: float = 0.0


class Tracker:
    """Which ranks entered which call (pure bookkeeping, no communication).

    Args:
        warning: seconds after which a call not entered by every member is reported.
        shutdown: seconds after which :meth:`check` asks to abort (0: never).
    """

    def __init__(self, warning: float, shutdown: float = 0.0) -> None:
        if not warning > 0:
            raise invalid("PLAIT_STALL_WARNING", warning, "a number of seconds > 0")
        if shutdown < 0:
            raise invalid("PLAIT_STALL_SHUTDOWN", shutdown, "a number of seconds >= 0 (0: never)")
        self.warning, self.shutdown = warning, shutdown
        self.calls: dict[tuple[str, int], _Call] = {}

    def enter(self, rank: int, cid: str, members: Sequence[int], seq: int, what: str,
              now: float) -> None:
        """Rank ``rank`` entered call ``seq`` (``what``) of communicator ``cid``."""
        key = (cid, seq)
        call = self.calls.get(key)
        if call is None:
            call = self.calls[key] = _Call(tuple(members), now)
        call.entered[rank] = what
        if len(call.entered) >= len(call.members):
            del self.calls[key]

    def check(self, now: float) -> tuple[list[str], str | None]:
        """Warnings due now, and the reason to abort (or None)."""
        warnings, abort = [], None
        for (cid, seq), call in sorted(self.calls.items(), key=lambda kv: kv[1].first):
            waited = now - call.first
            if waited < self.warning:
                continue
            missing = [r for r in call.members if r not in call.entered]
            what = sorted(set(call.entered.values()))
            group = "the world" if cid == "w" else f"group {cid}"
            text = (f"ranks {missing} have not submitted {' / '.join(what)} "
                    f"(call #{seq} on {group} of ranks {list(call.members)}); ranks "
                    f"{sorted(call.entered)} submitted it {waited:.1f} s ago and are waiting")
            if now - call.warned >= self.warning:
                call.warned = now
                warnings.append(text)
            if self.shutdown > 0 and waited >= self.shutdown and abort is None:
                abort = text
        return warnings, abort


class StallInspector:
    """Announces this rank's calls to rank 0; rank 0 watches them (see module doc).

    Args:
        mpi_comm: a private mpi4py communicator over the whole job (a ``Dup`` of the world).
        warning: seconds before a warning.
        shutdown: seconds before the job is aborted (0: never).
        out: where rank 0 prints (default stderr).
        abort: what rank 0 calls to end the job (default ``mpi_comm.Abort(1)``).
    """

    def __init__(self, mpi_comm: Any, warning: float, shutdown: float = 0.0, *,
                 out: TextIO | None = None, abort: Callable[[], None] | None = None) -> None:
        self.tracker = Tracker(warning, shutdown)
        self.comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.out = out
        self._abort = abort or (lambda: mpi_comm.Abort(1))
        self._lock = threading.Lock()
        self._pending: list[Any] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.rank == 0:
            self._thread = threading.Thread(target=self._watch, name="plait-stall", daemon=True)
            self._thread.start()
        atexit.register(self.close)

    @classmethod
    def create(cls, comm: Any, warning: float, shutdown: float) -> StallInspector | None:
        """An inspector for a job started by an MPI launcher, else None (Horovod's own
        inspector then applies; see :func:`plait.collectives.timeline.prepare_env`).

        Collective: every rank of the job must call it.
        """
        if not any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
            if getattr(comm, "backend", "") != "horovod":
                print("plait: PLAIT_STALL_WARNING needs a job started by mpirun; ignored",
                      file=sys.stderr)
            return None
        from mpi4py import MPI

        return cls(MPI.COMM_WORLD.Dup(), warning, shutdown)

    def enter(self, cid: str, members: Sequence[int], seq: int, what: str) -> None:
        """This rank enters call ``seq`` of communicator ``cid`` (never blocks)."""
        members = tuple(members)
        if self.rank == 0:
            with self._lock:
                self.tracker.enter(0, cid, members, seq, what, time.monotonic())
            return
        self._pending = [r for r in self._pending if not r.Test()]
        self._pending.append(self.comm.isend((cid, members, seq, what), dest=0, tag=_TAG))

    def _print(self, text: str) -> None:
        out = self.out or sys.stderr
        print(f"plait stall inspector (rank 0): {text}", file=out, flush=True)

    def _watch(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        while not self._stop.is_set():
            while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG, status=status):
                cid, members, seq, what = self.comm.recv(source=status.Get_source(), tag=_TAG)
                with self._lock:
                    self.tracker.enter(status.Get_source(), cid, members, seq, what,
                                       time.monotonic())
            with self._lock:
                warnings, abort = self.tracker.check(time.monotonic())
            for text in warnings:
                self._print(text)
            if abort is not None:
                self._print(f"shutting down the job after PLAIT_STALL_SHUTDOWN="
                            f"{self.tracker.shutdown:g}s: {abort}")
                self._abort()
                return
            self._stop.wait(0.05)

    def close(self) -> None:
        """Stop watching (rank 0) and let announcements in flight finish (others)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
            self._thread = None
        deadline = time.monotonic() + 1.0
        while self._pending and time.monotonic() < deadline:
            self._pending = [r for r in self._pending if not r.Test()]
            time.sleep(0.01)
