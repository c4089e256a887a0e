"""Asynchronous data parallelism as real jobs (tests/parallel/job_async_*.py).

torch on 2 and 3 ranks (3: parameter server with 1 server + 2 workers), Keras 3
on 2 ranks, and a rank that crashes mid-training: the job must end with an
error, not hang.
"""

from __future__ import annotations

import pytest
from jobs import pytest_argv, run_job

JOBS = [
    ("mpirun", 2, "job_async_torch.py"),
    ("mpirun", 3, "job_async_torch.py"),
    ("mpirun", 2, "job_async_tf.py"),
]


@pytest.mark.parametrize(("launcher", "np", "job"), JOBS,
                         ids=[f"{j[2][4:-3]}-np{j[1]}" for j in JOBS])
def test_async_job_passes_on_every_rank(launcher, np, job):
    result = run_job(launcher, np, pytest_argv(job), timeout=600)
    assert result.returncode == 0, result.tail(120)


def test_a_crashed_worker_ends_the_job_with_an_error():
    result = run_job("mpirun", 2, pytest_argv("job_async_crash.py"), timeout=300)
    assert result.returncode != 0, result.tail()
    # the launcher may end the job before it forwarded every line of the crashed rank
    assert ("worker crashes on purpose" in result.output
            or "aborting so that the other ranks do not hang" in result.output), result.tail()


def test_point_to_point_modes_need_mpi_under_horovodrun_gloo():
    result = run_job("horovodrun-gloo", 2, pytest_argv("job_async_gloo.py"), timeout=300)
    assert result.returncode == 0, result.tail(120)
