"""Runs on every rank: the timeline and the stall inspector (collectives/timeline.py, stall.py).

``::test_timeline_records_collectives`` (with ``PLAIT_TIMELINE`` set) makes a known sequence of
collectives on both backends; the outer test checks the merged file.
``::test_horovod_timeline_layout`` (same launch): ``HOROVOD_TIMELINE`` on the MPI backend
writes Horovod's layout on rank 0, flushed after each collective, its dynamic form, and
a complete file after ``plait.shutdown()``.
``::test_stall_inspector_names_the_missing_rank`` (with ``PLAIT_STALL_WARNING`` and
``PLAIT_STALL_SHUTDOWN`` set): rank 1 never submits a tensor; rank 0's inspector must
name it and end the job.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
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


def test_horovod_timeline_layout():
    from plait.collectives.mpi import MPI, MPICommunicator
    from plait.collectives.timeline import horovod_recorder, maybe_wrap

    path = os.environ["PLAIT_TIMELINE"] + ".horovod"
    env = {"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
    comm = maybe_wrap(MPICommunicator(MPI.COMM_WORLD.Dup(), timeout=60), env=env)
    x = np.arange(3, dtype=np.float32)
    comm.allreduce(x, op="sum", name="test_allreduce")
    comm.allreduce(np.ones(100_000, np.float32), op="sum")
    assert comm.allgather(x, name="g").shape == (6,)
    if comm.rank == 0:  # readable while the job runs, as Horovod's is
        text = open(path).read()
        for word in ("allreduce.test_allreduce", "allreduce.noname.1", "allgather.g",
                     "NEGOTIATE_ALLREDUCE", '"ALLREDUCE"', "NEGOTIATE_ALLGATHER", "CYCLE_START"):
            assert word in text, (word, text)
    assert horovod_recorder(comm).active == (comm.rank == 0)  # rank 0 writes it alone
    horovod_recorder(comm).stop()
    if comm.rank == 0:
        events = json.loads(open(path).read())
        names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"
                 and "name" in e["args"]}
        assert sorted(names.values()) == ["allgather.g", "allreduce.noname.1",
                                          "allreduce.test_allreduce"]
        for pid in names:  # per tensor: negotiation, then the op with one nested activity
            mine = [e for e in events if e.get("pid") == pid and e["ph"] in "BE"]
            assert [e.get("name", "E") for e in mine][:2] == [
                f"NEGOTIATE_{names[pid].split('.')[0].upper()}", "E"]
            assert [e["ph"] for e in mine] == ["B", "E", "B", "B", "E", "E"]
            assert [e["ts"] for e in mine] == sorted(e["ts"] for e in mine)
    # dynamic: nothing recorded until start_timeline, nothing after stop_timeline
    dyn = maybe_wrap(MPICommunicator(MPI.COMM_WORLD.Dup(), timeout=60),
                     env={"HOROVOD_TIMELINE": "DYNAMIC"})
    dyn.allreduce(x, op="sum", name="before")
    horovod_recorder(dyn).start(path + ".dyn")
    dyn.allreduce(x, op="sum", name="during")
    horovod_recorder(dyn).stop()
    dyn.allreduce(x, op="sum", name="after")
    if dyn.rank == 0:
        text = open(path + ".dyn").read()
        assert "allreduce.during" in text and "before" not in text and "after" not in text
    # without HOROVOD_TIMELINE at start there is no dynamic timeline, as in Horovod
    with pytest.raises(ValueError, match="HOROVOD_TIMELINE=DYNAMIC"):
        horovod_recorder(make_comm("mpi"))
    # hvd.shutdown() leaves the file complete (valid JSON), as Horovod's does
    import plait

    ours = os.environ.pop("PLAIT_TIMELINE")  # it would win over Horovod's
    os.environ["HOROVOD_TIMELINE"] = path + ".shutdown"
    try:
        world = plait.init("mpi")
        world.allreduce(x, op="sum", name="last")
        plait.shutdown()
    finally:
        del os.environ["HOROVOD_TIMELINE"]
        os.environ["PLAIT_TIMELINE"] = ours
    if comm.rank == 0:
        events = json.loads(open(path + ".shutdown").read())
        assert any(e.get("args", {}).get("name") == "allreduce.last" for e in events), events


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
