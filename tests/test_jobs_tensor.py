"""Tensor parallelism and the dp x pp x tp mesh under mpirun (see tests/parallel/job_tensor.py).

np=2: every test, MPI and Horovod backends. np=3: the layer equivalences (no plans) on the
MPI backend (dimensions are divisible by 3). np=8 (oversubscribed): only the
framework-free mesh test, dp=2 x pp=2 x tp=2, to keep 8 ranks on 2 cores cheap.
"""

from __future__ import annotations

import pytest
from jobs import pytest_argv, run_job

MPI_ONLY = {"PLAIT_TEST_BACKENDS": "mpi"}
JOBS = [
    (2, (), {}),
    (3, ("-k", "not mesh and not plan and not one"), MPI_ONLY),
    (8, ("-k", "mesh"), MPI_ONLY),
]


@pytest.mark.parametrize(("np", "args", "env"), JOBS, ids=[f"np{j[0]}" for j in JOBS])
def test_tensor_parallel_job(np, args, env):
    result = run_job("mpirun", np, pytest_argv("job_tensor.py", *args), timeout=600, env=env)
    assert result.returncode == 0, result.tail(120)
