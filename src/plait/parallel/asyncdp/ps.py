"""Parameter server: server ranks hold (shards of) the parameters and apply updates as they arrive."""

from __future__ import annotations

from typing import Any

import numpy as np

from plait.errors import invalid
from plait.protocols import Communicator

from .base import AsyncAlgorithm
from .mailbox import DONE, UPDATE, Mailbox, Message
from .replica import Replica

__all__ = ["ParameterServer", "shard_bounds"]

_PUSH_TAG, _REPLY_TAG = 7501, 7511


def shard_bounds(numel: int, servers: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` ranges of the flat parameters held by each server."""
    base, extra = divmod(numel, servers)
    out, lo = [], 0
    for j in range(servers):
        hi = lo + base + (1 if j < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


class ParameterServer(AsyncAlgorithm):
    """Ranks ``0 .. servers-1`` serve parameters; the other ranks are workers.

    A worker pushes each step's gradients (the shard of each server to that
    server) and pulls the fresh shards back; there is no global barrier. A
    server applies every push as it arrives with its copy of the user's
    optimizer (only its shard's gradients are non-zero and only its shard is
    served, so any element-wise optimizer -- SGD, momentum, Adam -- is exact per
    shard) and answers with its new shard. With ``staleness`` set, a server
    holds back the reply to a worker that is more than ``staleness`` steps ahead
    of the slowest unfinished worker.

    Server ranks call :meth:`serve` (it returns once every worker called
    ``synchronize()``); then every rank calls :meth:`synchronize`, after which all
    ranks hold the servers' final parameters.

    Args:
        comm: the data-parallel communicator (point-to-point needed).
        servers: number of server ranks (1 .. size-1).
        staleness: optional bound on how far the fastest worker may run ahead.

    Raises:
        ConfigError: for a bad number of servers or bound.
    """

    name = "parameter_server"
    point_to_point = True

    def __init__(self, comm: Communicator, servers: int = 1, staleness: int | None = None) -> None:
        if not isinstance(servers, int) or isinstance(servers, bool) or not 1 <= servers < comm.size:
            raise invalid("servers", servers,
                          f"an int in [1, {comm.size - 1}] (at least one rank must be a worker)")
        if staleness is not None and (not isinstance(staleness, int) or isinstance(staleness, bool)
                                      or staleness < 0):
            raise invalid("staleness", staleness, "None or an int >= 0")
        self.servers, self.bound = servers, staleness
        super().__init__(comm)
        self._bounds: list[tuple[int, int]] = []
        self._versions: list[int] = []
        self._served = False

    @property
    def role(self) -> str:
        return "server" if self.comm.rank < self.servers else "worker"

    @property
    def workers(self) -> list[int]:
        """The worker ranks."""
        return list(range(self.servers, self.comm.size))

    def _start(self, replica: Replica) -> None:
        self._bounds = shard_bounds(replica.numel, self.servers)
        self._versions = [0] * self.servers

    # -- worker --------------------------------------------------------------------------
    def step(self, replica: Replica) -> None:
        """Push this step's gradients to the servers and pull their fresh parameters.

        Raises:
            RuntimeError: on a server rank.
        """
        if self.is_server:
            raise RuntimeError(f"rank {self.comm.rank} is a parameter server: call serve(), not step()")
        t = self.metrics.steps
        grads = replica.get_grads()
        for j, (lo, hi) in enumerate(self._bounds):
            self.comm.send(np.array([UPDATE, t, self._versions[j], 0], np.int64), j, _PUSH_TAG)
            self.comm.send(np.ascontiguousarray(grads[lo:hi]), j, _PUSH_TAG + 1)
        params = replica.get_params()
        stale, held = 0, 0
        with self.metrics.waiting():
            for j, (lo, hi) in enumerate(self._bounds):
                head = np.asarray(self.comm.recv(np.zeros(4, np.int64), j, _REPLY_TAG))
                params[lo:hi] = np.asarray(self.comm.recv(np.zeros(hi - lo, np.float32), j,
                                                          _REPLY_TAG + 1))
                self._versions[j] = int(head[1])
                stale, held = max(stale, int(head[2])), max(held, int(head[3]))
        # the step's update is as stale as its stalest shard, and held if any server held it
        self.metrics.staleness.append(stale)
        self.metrics.blocked_steps += held
        replica.set_params(params)
        self.metrics.steps += 1
        self.metrics.messages += 2 * self.servers

    # -- server --------------------------------------------------------------------------
    def serve(self, replica: Replica) -> None:
        """Apply pushes as they arrive until every worker finished (server ranks).

        Raises:
            RuntimeError: on a worker rank.
            CollectiveTimeoutError: when no worker sends anything within the timeout.
        """
        if not self.is_server:
            super().serve(replica)
        if self._served:
            return
        lo, hi = self._bounds[self.comm.rank]
        box = Mailbox(self.comm, self.workers, lambda _w: hi - lo, _PUSH_TAG)
        active = set(self.workers)
        done_steps = {w: 0 for w in self.workers}
        pending: list[Message] = []
        held: set[int] = set()
        version = 0
        while active or pending:
            with self.metrics.waiting():
                arrived = box.take(True, "worker pushes")
            for msg in arrived:
                if int(msg[1][0]) == DONE:
                    active.discard(msg[0])
                else:
                    pending.append(msg)
            progress = True
            while progress:
                progress = False
                slowest = min((done_steps[w] for w in active), default=None)
                for msg in list(pending):
                    worker, head, payload = msg
                    step = int(head[1])
                    if self.bound is not None and slowest is not None and step - slowest > self.bound:
                        if worker not in held:
                            held.add(worker)
                        continue
                    pending.remove(msg)
                    full = np.zeros(replica.numel, np.float32)
                    full[lo:hi] = payload if payload is not None else 0.0
                    replica.set_grads(full)
                    replica.apply()
                    stale = version - int(head[2])
                    version += 1
                    self.metrics.staleness.append(stale)
                    self.metrics.steps += 1
                    was_held = 1 if worker in held else 0
                    held.discard(worker)
                    self.metrics.blocked_steps += was_held
                    self.comm.send(np.array([0, version, stale, was_held], np.int64), worker, _REPLY_TAG)
                    self.comm.send(np.ascontiguousarray(replica.get_params()[lo:hi]), worker,
                                   _REPLY_TAG + 1)
                    self.metrics.messages += 1
                    done_steps[worker] = step + 1
                    progress = True
                    break
        box.close()
        self._served = True

    # -- end ---------------------------------------------------------------------------------
    def _finish(self, replica: Replica) -> None:
        if self.is_server:
            self.serve(replica)
            return
        for j in range(self.servers):
            self.comm.send(np.array([DONE, self.metrics.steps, 0, 0], np.int64), j, _PUSH_TAG)

    def _average(self, replica: Replica) -> None:
        """Every rank gets each server's shard (a broadcast from each server)."""
        params = replica.get_params()
        for j, (lo, hi) in enumerate(self._bounds):
            shard = self.comm.broadcast(np.ascontiguousarray(params[lo:hi]), j,
                                        name=f"asyncdp.ps.shard{j}")
            params[lo:hi] = np.asarray(shard, dtype=np.float32)
        replica.set_params(params)

    def describe(self) -> dict[str, Any]:
        return {"algorithm": self.name, "servers": self.servers, "staleness": self.bound}
