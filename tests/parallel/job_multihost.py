"""Topology and cross-host traffic on every rank of a multi-host job (run by tests/test_multihost.py).

The outer test says where the ranks should be: ``PLAIT_TEST_HOSTS`` (host names in
host order) and ``PLAIT_TEST_SLOTS`` (ranks per host; ranks fill hosts in order).
Each rank checks the communicator's rank, local and cross coordinates against
its real host name, moves a known number of bytes between hosts, and writes one
report file into ``PLAIT_TEST_REPORT_DIR`` for the outer test to read. A torch
pipeline with one stage per rank, whose activations (64 KiB per micro-batch, past
Open MPI's TCP eager limit) cross the hosts, must equal the serial model.
"""

from __future__ import annotations

import copy
import json
import os
import socket

import numpy as np
import pytest

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


def test_pipeline_crosses_the_network_and_equals_the_serial_model(comm):
    """One stage per rank, stages on different hosts: the stages let the messages move
    between their layers (``Wire.progress``), and the loss and weights equal one process's."""
    import torch

    from plait.parallel.pipeline import Pipeline

    width, batch, steps = 256, 256, 2
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(comm.size):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    serial = torch.nn.Sequential(*layers, torch.nn.Linear(width, 4))
    model = copy.deepcopy(serial)
    loss_fn = torch.nn.CrossEntropyLoss()
    kwargs = {"microbatches": 4, "schedule": "gpipe", "comm": comm, "loss_fn": loss_fn,
              "optimizer": lambda ps: torch.optim.SGD(ps, lr=0.1)}
    if comm.backend == "horovod":
        # no MPI under horovodrun --gloo; beside Horovod's background thread Open MPI's TCP
        # transport stalls messages (README; tools/mpi_threads.py)
        match = "point-to-point" if comm._mpi is None else "several hosts"
        with pytest.raises(NotImplementedError, match=match):
            Pipeline(model, **kwargs).train_step(torch.zeros(batch, width), torch.zeros(batch))
        return
    pipe = Pipeline(model, **kwargs)
    crosses = comm.cross_size > 1
    assert pipe.runtime.wire.crosses_hosts == crosses
    assert all((ex.progress is not None) == crosses for ex in pipe.executors.values())
    opt = torch.optim.SGD(serial.parameters(), lr=0.1)
    rng = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(batch, width, generator=rng), torch.randint(0, 4, (batch,), generator=rng)
        loss = pipe.train_step(x, y)
        opt.zero_grad()
        want = loss_fn(serial(x), y)
        want.backward()
        opt.step()
        assert abs(loss - want.item()) < 1e-5, (loss, want.item())
    pipe.close()
    held = {id(p) for p in pipe.parameters()}
    mine = [(a, b) for a, b in zip(model.parameters(), serial.parameters(), strict=True) if id(a) in held]
    assert mine
    for a, b in mine:
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
