"""Topology and cross-host traffic on every rank of a multi-host job (run by tests/test_multihost.py).

The outer test says where the ranks should be: ``PLAIT_TEST_HOSTS`` (host names in
host order) and ``PLAIT_TEST_SLOTS`` (ranks per host; ranks fill hosts in order).
Each rank checks the communicator's rank, local and cross coordinates against
its real host name, moves a known number of bytes between hosts, and writes one
report file into ``PLAIT_TEST_REPORT_DIR`` for the outer test to read.
"""

from __future__ import annotations

import json
import os
import socket

import numpy as np

from plait.launch.context import context

#: Bytes every rank contributes to the allgather that crosses hosts.
GATHER_BYTES = 1 << 20


def test_ranks_sit_on_their_hosts(comm):
    hosts = os.environ["PLAIT_TEST_HOSTS"].split(",")
    slots = int(os.environ["PLAIT_TEST_SLOTS"])
    name = socket.gethostname()
    assert comm.size == len(hosts) * slots
    assert name == hosts[comm.rank // slots], (comm.rank, name)
    assert (comm.local_rank, comm.local_size) == (comm.rank % slots, slots)
    assert (comm.cross_rank, comm.cross_size) == (comm.rank // slots, len(hosts))
    ctx = context()  # what the launcher told this process agrees with the communicator
    assert (ctx.rank, ctx.size, ctx.local_rank, ctx.local_size) == (
        comm.rank, comm.size, comm.local_rank, comm.local_size)
    assert (ctx.cross_rank, ctx.cross_size) == (comm.cross_rank, comm.cross_size)
    everyone = comm.allgather_object([name, comm.local_rank])
    assert everyone == [[hosts[r // slots], r % slots] for r in range(comm.size)]
    assert comm.broadcast_object({"from": name}, root=comm.size - 1) == {"from": hosts[-1]}


def test_allgather_crosses_the_network(comm):
    """Every host receives GATHER_BYTES from each rank on the other hosts (at least)."""
    mine = np.full(GATHER_BYTES // 4, comm.rank, dtype=np.float32)
    out = np.asarray(comm.allgather(mine))
    assert out.shape == (comm.size * mine.size,)
    np.testing.assert_array_equal(out[:: mine.size], np.arange(comm.size, dtype=np.float32))
    report = {
        "host": socket.gethostname(), "rank": comm.rank, "size": comm.size,
        "local_rank": comm.local_rank, "local_size": comm.local_size,
        "cross_rank": comm.cross_rank, "cross_size": comm.cross_size,
        "backend": comm.backend, "gathered_bytes_from_other_hosts":
            GATHER_BYTES * (comm.size - comm.local_size),
    }
    path = os.path.join(os.environ["PLAIT_TEST_REPORT_DIR"], f"{comm.backend}-{comm.rank}.json")
    with open(path, "w") as f:
        json.dump(report, f)
