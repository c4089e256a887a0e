"""Pipeline parallelism jobs: every rank runs tests/parallel/job_pipeline.py under mpirun.

np=2: every schedule x framework against the serial model, balance modes,
activation recomputation, predict, the Horovod backend and the errors;
np=3: every schedule on three stages, stages that let messages move, a bad batch
given only to the end stages (the middle stage must raise too, not hang) and the
timeline of one step;
np=4: a dp=2 x pp=2 mesh, and a pp=2 x tp=2 mesh with TensorParallel stages (torch, Keras).
"""

from __future__ import annotations

import json

import pytest
from jobs import pytest_argv, run_job

from plait.parallel.pipeline import one_f_one_b

JOBS = [
    (2, "not mesh and not timeline"),
    (4, "mesh"),
]


@pytest.mark.parametrize(("np", "select"), JOBS, ids=[f"np{n}-{k.replace(' ', '_')}" for n, k in JOBS])
def test_pipeline_job_passes_on_every_rank(np, select):
    result = run_job("mpirun", np, pytest_argv("job_pipeline.py", "-k", select), timeout=600)
    assert result.returncode == 0, result.tail(120)


def test_three_stage_job_and_its_timeline(tmp_path):
    path = tmp_path / "pipeline.json"
    select = "every_schedule or end_stages or timeline or messages_move"
    result = run_job("mpirun", 3, pytest_argv("job_pipeline.py", "-k", select), timeout=600,
                     env={"PLAIT_TIMELINE": str(path)})
    assert result.returncode == 0, result.tail(120)
    trace = json.loads(path.read_text())
    assert trace["otherData"]["missing_ranks"] == []
    events = trace["traceEvents"]
    for rank, actions in enumerate(one_f_one_b(3, 3)):  # the timeline test's schedule
        got = [e for e in events if e.get("pid") == rank and e.get("cat") == "pipeline"]
        assert [e["name"] for e in got] == [str(a) for a in actions], rank
        for e, a in zip(got, actions):
            assert e["args"]["stage"] == a.stage and e["args"]["microbatch"] == a.microbatch
            assert e["args"]["kind"] == a.kind.value and e["dur"] >= 0
