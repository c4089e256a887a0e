"""Launch tests/parallel/job_compression.py on 2 ranks under mpirun (MPI and Horovod backends)."""

from __future__ import annotations

from jobs import pytest_argv, run_job


def test_compressed_allreduce_on_two_ranks():
    r = run_job("mpirun", 2, pytest_argv("job_compression.py"), timeout=600)
    assert r.returncode == 0, r.tail()
