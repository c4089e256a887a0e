"""Goodbyes: a rank whose program ends tells the other ranks of each of its MPI
communicators, so that a rank left waiting in a collective for it raises within
seconds instead of waiting out the timeout.

Horovod does the same through its coordinator ("Horovod has been shut down ...
an attempt to allreduce ... after one of the ranks finished execution"). On the MPI
backend each communicator sends, at interpreter exit (before ``MPI_Finalize``), one
small message to every other rank on its internal duplicate (which carries no user
message), with a tag no ring uses. A waiting rank reads them while it waits
(:class:`Departures`); it raises only when its collective has not completed
:data:`GRACE_S` seconds after it learned of the departure (and nothing moved since),
as a peer may well have taken part in that collective before it left.
"""

from __future__ import annotations

import atexit
import time
import weakref
from typing import Any

import numpy as np
from mpi4py import MPI

__all__ = ["GRACE_S", "Departures", "say_goodbye_at_exit"]

#: Seconds a collective may still complete after a rank of its group left.
GRACE_S = 5.0
#: Seconds the goodbyes may take to leave at exit (they are tiny: at once, normally).
_SEND_S = 1.0


def say_goodbye_at_exit(owner: Any, comm: Any, tag: int) -> None:
    """At interpreter exit, while ``owner`` (a communicator object) is alive and MPI is
    not finalized, send a goodbye on ``comm`` to every other rank.

    Args:
        owner: held weakly: a communicator collected before exit says nothing.
        comm: the mpi4py communicator the goodbyes travel on.
        tag: their tag.
    """
    if comm.Get_size() < 2:
        return
    ref = weakref.ref(owner)

    def send() -> None:
        if ref() is None or MPI.Is_finalized() or comm == MPI.COMM_NULL:
            return
        note = np.ones(1, dtype=np.int64)
        me = comm.Get_rank()
        reqs = [comm.Isend(note, dest=peer, tag=tag) for peer in range(comm.Get_size()) if peer != me]
        deadline = time.monotonic() + _SEND_S
        while not MPI.Request.Testall(reqs) and time.monotonic() < deadline:
            time.sleep(1e-3)
        for req in reqs:  # a peer that cannot take it (gone): do not hold up finalize
            if req != MPI.REQUEST_NULL:
                try:
                    req.Cancel()
                    req.Free()
                except MPI.Exception:
                    pass

    atexit.register(send)


class Departures:
    """The ranks of one communicator that said goodbye, read while waiting.

    Args:
        comm: the mpi4py communicator the goodbyes travel on.
        tag: their tag.
    """

    def __init__(self, comm: Any, tag: int) -> None:
        self.comm, self.tag = comm, tag
        self.gone: dict[int, float] = {}  # rank -> when this rank learned it left

    def read(self) -> None:
        """Receive the goodbyes that arrived (never blocks)."""
        status = MPI.Status()
        note = np.empty(1, dtype=np.int64)
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=self.tag, status=status):
            source = status.Get_source()
            self.comm.Recv(note, source=source, tag=self.tag)
            self.gone.setdefault(source, time.monotonic())

    def overdue(self, since: float, now: float) -> list[int]:
        """The departed ranks a wait that began (or last saw progress) at ``since``
        has waited for over :data:`GRACE_S` seconds, at ``now``."""
        return sorted(r for r, t in self.gone.items() if now - max(t, since) > GRACE_S)
