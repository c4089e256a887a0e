"""Decentralised gossip: each rank averages its parameters with one neighbour per step."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from plait.errors import invalid
from plait.protocols import Communicator

from .base import AsyncAlgorithm
from .replica import Replica

__all__ = ["TOPOLOGIES", "Gossip", "gossip_peers", "sends_first"]

#: "ring": always the next rank; "shift": the distance grows by one each step (1 .. size-1).
TOPOLOGIES = ("ring", "shift")

_TAG = 7301


def gossip_peers(rank: int, size: int, step: int, topology: str) -> tuple[int, int, int]:
    """``(send_to, recv_from, distance)`` of ``rank`` at ``step``.

    Each rank sends to ``rank + k`` and receives from ``rank - k`` (mod size), so the
    mixing is doubly stochastic and the mean of the replicas is preserved.
    """
    k = 1 if topology == "ring" else 1 + step % (size - 1)
    return (rank + k) % size, (rank - k) % size, k


def sends_first(rank: int, size: int, k: int) -> bool:
    """Whether ``rank`` sends before receiving in the exchange at distance ``k``.

    Ranks alternate by their position along their cycle ``c, c+k, c+2k, ...`` (the
    parity of rank order along the cycle), so no cycle is all senders and blocking
    sends cannot deadlock even when a message is too large to be sent eagerly.
    """
    g = math.gcd(k, size)
    pos, x = 0, rank % g
    while x != rank:
        x = (x + k) % size
        pos += 1
    return pos % 2 == 0


class Gossip(AsyncAlgorithm):
    """After each local step, average parameters with one neighbour (no global collective).

    Args:
        comm: the data-parallel communicator (point-to-point needed).
        topology: "ring" or "shift" (shifting peer).

    Raises:
        ConfigError: for an unknown topology.
    """

    name = "gossip"
    point_to_point = True

    def __init__(self, comm: Communicator, topology: str = "ring") -> None:
        if topology not in TOPOLOGIES:
            raise invalid("topology", topology, f"one of {list(TOPOLOGIES)}")
        super().__init__(comm)
        self.topology = topology

    def step(self, replica: Replica) -> None:
        """Local step, then a pairwise exchange and average with this step's neighbour."""
        replica.apply()
        t = self.metrics.steps
        self.metrics.steps += 1
        if self.comm.size == 1:
            return
        dest, source, k = gossip_peers(self.comm.rank, self.comm.size, t, self.topology)
        mine = replica.get_params()
        with self.metrics.waiting():
            if sends_first(self.comm.rank, self.comm.size, k):
                self.comm.send(mine, dest, _TAG)
                theirs = self.comm.recv(mine, source, _TAG)
            else:
                theirs = self.comm.recv(mine, source, _TAG)
                self.comm.send(mine, dest, _TAG)
        replica.set_params((mine + np.asarray(theirs, dtype=np.float32)) * np.float32(0.5))
        self.metrics.staleness.append(0)
        self.metrics.messages += 1

    def describe(self) -> dict[str, Any]:
        return {"algorithm": self.name, "topology": self.topology}
