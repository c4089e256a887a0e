"""Stale-synchronous parallel (SSP): no rank runs more than ``staleness`` steps ahead of the slowest."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from plait.errors import invalid
from plait.protocols import Communicator

from .base import AsyncAlgorithm
from .mailbox import DONE, UPDATE, Mailbox, Message
from .replica import Replica

__all__ = ["StaleSynchronous"]

_TAG = 7401


class StaleSynchronous(AsyncAlgorithm):
    """Bounded-staleness data parallelism without a server.

    Every rank sends its gradients of each step to every other rank and keeps
    going. Before applying step t it must hold every peer's gradients up to step
    ``t - staleness`` (it waits otherwise); it then applies the average (sum over
    ranks / size) of its own step-t gradients and every peer gradient of a step
    <= t not applied yet. So each update applied is at most ``staleness`` steps
    old, and every gradient of the job is applied exactly once on every rank.
    ``staleness=0`` is synchronous training. Ranks may stop after different
    numbers of steps: a finished rank stops constraining the others, and
    :meth:`synchronize` applies what is left and averages the replicas.

    Args:
        comm: the data-parallel communicator (point-to-point needed).
        staleness: the bound s >= 0.

    Raises:
        ConfigError: for a bad bound.
    """

    name = "ssp"
    point_to_point = True

    def __init__(self, comm: Communicator, staleness: int = 1) -> None:
        if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
            raise invalid("staleness", staleness, "an int >= 0 (0 is synchronous training)")
        super().__init__(comm)
        self.staleness = staleness
        self._mailbox: Mailbox | None = None
        self._inbox: list[tuple[int, int, np.ndarray]] = []  # (step, rank, grads)
        self._received: dict[int, int] = {}
        self._done: set[int] = set()

    def _start(self, replica: Replica) -> None:
        peers = [r for r in range(self.comm.size) if r != self.comm.rank]
        self._received = {p: 0 for p in peers}
        if peers:
            numel = replica.numel
            self._mailbox = Mailbox(self.comm, peers, lambda _p: numel, _TAG)

    def _absorb(self, messages: list[Message]) -> None:
        for peer, header, payload in messages:
            if int(header[0]) == DONE:
                self._done.add(peer)
            elif payload is not None:
                self._inbox.append((int(header[1]), peer, payload))
                self._received[peer] += 1

    def _ready(self, step: int) -> bool:
        need = step - self.staleness + 1
        return all(p in self._done or n >= need for p, n in self._received.items())

    def _combine(self, own: tuple[int, int, np.ndarray] | None, upto: int | None,
                 now: int) -> np.ndarray | None:
        """Average of ``own`` and the inbox entries with step <= ``upto`` (all when None);
        records each peer update's staleness relative to step ``now``."""
        take = [u for u in self._inbox if upto is None or u[0] <= upto]
        self._inbox = [u for u in self._inbox if not (upto is None or u[0] <= upto)]
        if own is not None:
            take.append(own)
        if not take:
            return None
        take.sort(key=lambda u: (u[0], u[1]))
        total = np.zeros(take[0][2].shape, np.float64)
        for _, _, g in take:
            total += g
        self.metrics.staleness.extend(max(0, now - s) for s, r, _ in take if r != self.comm.rank)
        return (total / self.comm.size).astype(np.float32)

    def step(self, replica: Replica) -> None:
        """Send this step's gradients, wait for peers within the bound, apply the average."""
        t = self.metrics.steps
        grads = replica.get_grads()
        box = self._mailbox
        if box is not None:
            for p in box.peers:
                box.post(p, UPDATE, t, payload=grads)
            self.metrics.messages += len(box.peers)
            self._absorb(box.take(False, "peer gradients"))
            if not self._ready(t):
                self.metrics.blocked_steps += 1
                with self.metrics.waiting():
                    while not self._ready(t):
                        self._absorb(box.take(True, f"peer gradients of step {t - self.staleness}"))
        avg = self._combine((t, self.comm.rank, grads), t, t)
        replica.set_grads(avg)
        replica.apply()
        self.metrics.steps += 1

    def _finish(self, replica: Replica) -> None:
        box = self._mailbox
        if box is None:
            return
        for p in box.peers:
            box.post(p, DONE, self.metrics.steps)
        with self.metrics.waiting():
            while len(self._done) < len(box.peers):
                self._absorb(box.take(True, "the other ranks to finish"))
            box.close()
        rest = self._combine(None, None, self.metrics.steps - 1)
        if rest is not None:
            replica.set_grads(rest)
            replica.apply()

    def _state(self) -> dict[str, Any]:
        """Every peer gradient of the steps before this one, received (waited for now) and
        not applied yet. Every rank saves at the same step, so none of a later step exists."""
        t, box = self.metrics.steps, self._mailbox
        if box is not None:
            with self.metrics.waiting():
                while not all(p in self._done or n >= t for p, n in self._received.items()):
                    self._absorb(box.take(True, f"peer gradients before step {t} (checkpoint)"))
        inbox = sorted(self._inbox, key=lambda u: (u[0], u[1]))
        return {"inbox": [{"step": s, "rank": r, "grads": g} for s, r, g in inbox]}

    def _load(self, state: Mapping[str, Any], own: bool) -> None:
        super()._load(state, own)
        t = self.metrics.steps
        self._received = {p: t for p in self._received}  # peers resume sending at step t
        self._done = set()
        # another rank's unapplied gradients are not this rank's to apply: start empty
        self._inbox = [(int(u["step"]), int(u["rank"]), np.asarray(u["grads"], dtype=np.float32))
                       for u in state["inbox"]] if own else []

    def describe(self) -> dict[str, Any]:
        return {"algorithm": self.name, "staleness": self.staleness}
