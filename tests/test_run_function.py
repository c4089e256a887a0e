"""plait.run(func, np=N), Horovod's horovod.run: real mpirun / horovodrun --gloo jobs of 2 ranks.

The functions are defined inside the tests, so they travel by value (cloudpickle), as a
notebook's or a script's would.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import plait
from plait.errors import ConfigError
from plait.runner import run as runner_run

pytestmark = pytest.mark.timeout(300)


def test_every_rank_calls_the_function_and_the_results_come_back_by_rank():
    def work(base, scale=1):
        import numpy as np

        import plait

        comm = plait.init(backend="mpi")
        total = comm.allreduce(np.array([float(comm.rank)]), op="sum")
        return comm.rank, comm.size, base + scale * float(total[0])

    assert plait.run(work, args=(10,), kwargs={"scale": 2}, np=2, timeout=120) == [
        (0, 2, 12.0), (1, 2, 12.0)]


def test_a_rank_that_raises_fails_the_call_with_that_ranks_traceback():
    def work():
        if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
            raise ValueError("rank one fails on purpose")
        return 0

    with pytest.raises(RuntimeError, match=r"(?s)rank 1 raised:.*ValueError: rank one fails on purpose"):
        plait.run(work, np=2, timeout=120)


def test_use_gloo_runs_the_function_under_horovodrun_on_the_horovod_backend(monkeypatch):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")

    def work():
        import torch

        import plait
        import plait.torch as hvd

        hvd.init()
        total = hvd.allreduce(torch.tensor([1.0 + hvd.rank()]), op=hvd.Sum).item()
        return hvd.rank(), total, plait.world().backend

    assert runner_run(work, np=2, use_gloo=True, timeout=200) == [(0, 3.0, "horovod"),
                                                                   (1, 3.0, "horovod")]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"np": 0}, "np=0"),
    ({"np": "2"}, "np='2'"),
    ({"np": 2, "use_gloo": True, "use_mpi": True}, "choose one"),
    ({"np": 2, "min_np": 1}, "min_np=1: plait.run does not take"),
    ({"np": 2, "timeout": 0}, "timeout=0"),
])
def test_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        plait.run(len, **kwargs)
    with pytest.raises(ConfigError, match="func=3"):
        plait.run(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="nonsense"):
        plait.run(len, nonsense=1)
