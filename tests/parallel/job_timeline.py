"""Runs on every rank: the timeline and the stall inspector (collectives/timeline.py, stall.py).

``::test_timeline_records_collectives`` (with ``PLAIT_TIMELINE`` set) makes a known sequence of
collectives on both backends; the outer test checks the merged file.
``::test_stall_inspector_names_the_missing_rank`` (with ``PLAIT_STALL_WARNING`` and
``PLAIT_STALL_SHUTDOWN`` set): rank 1 never submits a tensor; rank 0's inspector must
name it and end the job.
"""

from __future__ import annotations

import os
import time

import numpy as np
from conftest import backends, make_comm


def test_timeline_records_collectives():
    from plait.collectives.timeline import ObservedCommunicator, Recorder, maybe_wrap

    for backend in backends():
        comm = maybe_wrap(make_comm(backend))
        assert isinstance(comm, ObservedCommunicator)
        x = np.arange(8, dtype=np.float32) + comm.rank
        for i in range(3):
            np.testing.assert_allclose(comm.allreduce(x, op="sum", name=f"t.{i}"),
                                       2 * np.arange(8) + 1)
        handles = [comm.allreduce_async(x * k, op="sum", name=f"async.{k}") for k in (1, 2)]
        for k, h in zip((1, 2), handles):
            np.testing.assert_allclose(h.wait(), k * (2 * np.arange(8) + 1))
        assert comm.allgather(x[: comm.rank + 1], name="gathered").shape == (3,)
        assert comm.broadcast(x, root=1, name="bcast")[0] == 1
        comm.barrier()
        # fused gradient buckets, as the data-parallel optimizer names them
        import torch
        from plait.adapters.torch_optim import distributed_optimizer

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        opt = distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm,
                                    model.named_parameters(), bucket_mb=0)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        comm.barrier()
    rec = Recorder._open[os.environ["PLAIT_TIMELINE"]]
    rec.close()


def test_stall_inspector_names_the_missing_rank():
    from plait.collectives.mpi import MPI, MPICommunicator
    from plait.collectives.timeline import maybe_wrap

    comm = maybe_wrap(MPICommunicator(MPI.COMM_WORLD.Dup(), timeout=120))
    comm.allreduce(np.ones(2), op="sum", name="submitted.by.all")
    if comm.rank == 1:
        time.sleep(120)  # never submits "never.submitted"; the inspector must abort the job
    else:
        print(f"stalled at {time.time():.3f}", flush=True)  # the outer test times the abort
        comm.allreduce(np.ones(2), op="sum", name="never.submitted")
    raise AssertionError("the stall inspector did not end the job")
