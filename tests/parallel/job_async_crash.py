"""A parameter-server job whose last worker crashes mid-training (tests/test_jobs_async.py).

The crashing rank's test fails; since asynchronous messages are in flight, the
process aborts at exit and mpirun ends the job: no rank may hang. With
``PLAIT_TEST_CRASH_STAMP`` set, the crashing rank writes the time of the crash there.
"""

from __future__ import annotations

import os
import time

import torch
from conftest import make_comm

import plait


def test_worker_crash():
    comm = make_comm("mpi")
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 2)
    opt = plait.DataParallel(comm=comm, mode="async", algorithm="ps").optimizer(
        torch.optim.SGD(m.parameters(), lr=0.1))
    if opt.is_server:
        opt.serve()
    else:
        for step in range(50):
            m(torch.ones(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            if comm.rank == comm.size - 1 and step == 5:
                stamp = os.environ.get("PLAIT_TEST_CRASH_STAMP")
                if stamp:  # when it crashed, for the test's bound on the shutdown time
                    with open(stamp, "w") as f:
                        f.write(repr(time.time()))
                raise RuntimeError("the last worker crashes on purpose")
    opt.synchronize()
