"""Real multi-process jobs: every rank runs a pytest file under mpirun or horovodrun.

Each job is one launch (the import cost of torch/TensorFlow is paid once per
rank), its own timeout, and fails if any rank fails.
"""

from __future__ import annotations

import pytest
from jobs import pytest_argv, run_job

JOBS = [
    ("mpirun", 2, "job_collectives.py"),
    ("mpirun", 3, "job_collectives.py"),
    ("horovodrun-gloo", 2, "job_collectives.py"),
    ("mpirun", 2, "job_dp_torch.py"),
    ("mpirun", 3, "job_dp_torch.py"),
    ("horovodrun-mpi", 2, "job_dp_torch.py"),
]


@pytest.mark.parametrize(("launcher", "np", "job"), JOBS, ids=[f"{j}-{l}-np{n}" for l, n, j in JOBS])
def test_job_passes_on_every_rank(launcher, np, job):
    result = run_job(launcher, np, pytest_argv(job), timeout=900)
    assert result.returncode == 0, result.tail(120)


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun-gloo"])
def test_one_failing_rank_fails_the_job(launcher):
    result = run_job(launcher, 2, pytest_argv("job_fails_on_last_rank.py"), timeout=300)
    assert result.returncode != 0, result.tail()
    assert "the last rank fails on purpose" in result.output
    assert "1 passed" in result.output  # rank 0 passed: the job still failed
