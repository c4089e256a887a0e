"""Parameter server: server ranks hold (shards of) the parameters and apply updates as they arrive."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from plait.errors import invalid
from plait.protocols import Communicator

from .base import AsyncAlgorithm
from .mailbox import DONE, UPDATE, Mailbox, Message
from .replica import Replica

__all__ = ["ParameterServer", "Snapshot", "shard_bounds"]

_PUSH_TAG, _REPLY_TAG, _SNAP_TAG = 7501, 7511, 7521


class Snapshot(Protocol):
    """Where servers write checkpoints (``plait.Checkpoint.snapshot`` makes one)."""

    #: take a snapshot whenever the workers reach a multiple of this step.
    every: int

    def pack(self) -> np.ndarray:
        """This server's checkpoint files (model, optimizer, RNG, algorithm state) as uint8."""
        ...

    def write(self, step: int, others: Mapping[int, np.ndarray]) -> Any:
        """Server 0: write its files and the other servers' packed files as one checkpoint."""
        ...


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

    Checkpoints (``serve(replica, snapshot)``) are consistent snapshots: at each
    multiple ``t`` of ``snapshot.every`` the servers hold back pushes of step ``t``
    and later until every worker still training has had exactly ``t`` updates
    applied; then each server sends its shard and files to server 0, which writes
    one checkpoint whose model is the whole current model. Workers restored from it
    all resume at step ``t``: no update is lost or applied twice.

    Args:
        comm: the data-parallel communicator (point-to-point needed).
        servers: number of server ranks (1 .. size-1).
        staleness: optional bound on how far the fastest worker may run ahead.

    Raises:
        ConfigError: for a bad number of servers or bound.
    """

    name = "parameter_server"
    point_to_point = True
    checkpoint_kind = "server"

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
        self._version = 0  # server: updates applied to its shard
        self._resume = 0  # the step every worker restarts from (restored snapshot)
        self._snap: dict[str, Any] = {}  # server: what the snapshot being written records

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
    def serve(self, replica: Replica, snapshot: Snapshot | None = None) -> None:
        """Apply pushes as they arrive until every worker finished (server ranks).

        Args:
            replica: this server's replica.
            snapshot: where to write checkpoints (every ``snapshot.every`` worker steps).

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
        done_steps = {w: self._resume for w in self.workers}
        pending: list[Message] = []
        held: set[int] = set()
        next_snap = None if snapshot is None else (self._resume // snapshot.every + 1) * snapshot.every
        while active or pending:
            with self.metrics.waiting():
                arrived = box.take(True, "worker pushes")
            for msg in arrived:
                if int(msg[1][0]) == DONE:
                    active.discard(msg[0])
                else:
                    pending.append(msg)
            while True:
                while self._apply_one(replica, pending, done_steps, active, held, next_snap, lo, hi):
                    pass
                if snapshot is None or next_snap is None:
                    break
                if not _snapshot_due(next_snap, done_steps, active):
                    break
                self._snapshot(replica, snapshot, next_snap)
                next_snap += snapshot.every
        box.close()
        self._served = True

    def _apply_one(self, replica: Replica, pending: list[Message], done_steps: dict[int, int],
                   active: set[int], held: set[int], next_snap: int | None, lo: int, hi: int) -> bool:
        """Apply the first pending push allowed now (staleness bound, snapshot step); reply."""
        slowest = min((done_steps[w] for w in active), default=None)
        for msg in list(pending):
            worker, head, payload = msg
            step = int(head[1])
            waits_snapshot = next_snap is not None and step >= next_snap
            too_far = self.bound is not None and slowest is not None and step - slowest > self.bound
            if waits_snapshot or too_far:
                held.add(worker)
                continue
            pending.remove(msg)
            full = np.zeros(replica.numel, np.float32)
            full[lo:hi] = payload if payload is not None else 0.0
            replica.set_grads(full)
            replica.apply()
            stale = self._version - int(head[2])
            self._version += 1
            self.metrics.staleness.append(stale)
            self.metrics.steps += 1
            was_held = 1 if worker in held else 0
            held.discard(worker)
            self.metrics.blocked_steps += was_held
            self.comm.send(np.array([0, self._version, stale, was_held], np.int64), worker, _REPLY_TAG)
            self.comm.send(np.ascontiguousarray(replica.get_params()[lo:hi]), worker, _REPLY_TAG + 1)
            self.metrics.messages += 1
            done_steps[worker] = step + 1
            return True
        return False

    def _snapshot(self, replica: Replica, snapshot: Snapshot, step: int) -> None:
        """Every worker is at ``step``: servers send shard and files to server 0, which writes."""
        rank = self.comm.rank
        self._snap = {"steps": step, "version": self._version, "versions": []}
        if rank != 0:
            lo, hi = self._bounds[rank]
            blob = snapshot.pack()
            self.comm.send(np.array([step, self._version, blob.size], np.int64), 0, _SNAP_TAG)
            self.comm.send(np.ascontiguousarray(replica.get_params()[lo:hi]), 0, _SNAP_TAG + 1)
            self.comm.send(blob, 0, _SNAP_TAG + 2)
            return
        full, versions, others = replica.get_params(), [self._version], {}
        with self.metrics.waiting():
            for j in range(1, self.servers):
                lo, hi = self._bounds[j]
                head = np.asarray(self.comm.recv(np.zeros(3, np.int64), j, _SNAP_TAG))
                if int(head[0]) != step:
                    raise RuntimeError(f"parameter server {j} snapshot of step {int(head[0])} arrived "
                                       f"while server 0 takes step {step}'s")
                full[lo:hi] = np.asarray(self.comm.recv(np.zeros(hi - lo, np.float32), j, _SNAP_TAG + 1))
                others[j] = np.asarray(self.comm.recv(np.zeros(int(head[2]), np.uint8), j, _SNAP_TAG + 2))
                versions.append(int(head[1]))
        # server 0 never serves the other shards: its copy of them may be overwritten
        replica.set_params(full)
        self._snap["versions"] = versions
        snapshot.write(step, others)

    # -- checkpoints --------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        """The snapshot being written (servers only): the workers' step, this server's
        version and (server 0) every server's."""
        if not self._snap:
            raise RuntimeError("parameter-server state is saved by the servers' snapshots "
                               "(serve(checkpoint=...)), not by workers")
        return {"servers": self.servers, **self._snap}

    def _load(self, state: Mapping[str, Any], own: bool) -> None:
        super()._load(state, own)
        self._resume = int(state["steps"])
        versions = [int(v) for v in state.get("versions", [])]
        same = int(state["servers"]) == self.servers and len(versions) == self.servers
        if self.is_server:
            self.metrics.steps = 0
            self._version = int(state["version"]) if own else (versions[self.comm.rank] if same else 0)
        else:
            self._versions = versions if same else [0] * self.servers

    def restores_own_state(self, saved: Mapping[str, Any], saved_size: int) -> bool:
        """Servers take their own snapshot back when the number of servers is unchanged
        (the number of workers may differ); workers have none."""
        return self.is_server and saved.get("servers") == self.servers

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


def _snapshot_due(step: int, done_steps: Mapping[int, int], active: set[int]) -> bool:
    """Every worker still training has had exactly ``step`` updates applied (and one has)."""
    return (all(done_steps[w] == step for w in active)
            and any(n == step for n in done_steps.values()))
