"""Pipeline parallelism jobs: every rank runs tests/parallel/job_pipeline.py under mpirun.

np=2: every schedule x framework against the serial model, balance modes,
activation recomputation, predict, the Horovod backend and the errors;
np=3: every schedule on three stages; np=4: a dp=2 x pp=2 mesh.
"""

from __future__ import annotations

import pytest
from jobs import pytest_argv, run_job

JOBS = [
    (2, "not mesh"),
    (3, "every_schedule"),
    (4, "mesh"),
]


@pytest.mark.parametrize(("np", "select"), JOBS, ids=[f"np{n}-{k.replace(' ', '_')}" for n, k in JOBS])
def test_pipeline_job_passes_on_every_rank(np, select):
    result = run_job("mpirun", np, pytest_argv("job_pipeline.py", "-k", select), timeout=600)
    assert result.returncode == 0, result.tail(120)
