"""Timeline and stall inspector: single-process checks and two real 2-rank jobs."""

from __future__ import annotations

import json
import re
import time
from collections import Counter

import pytest
from jobs import pytest_argv, run_job
from plait.collectives.stall import Tracker
from plait.collectives.timeline import maybe_wrap, merge, prepare_env

from plait.errors import ConfigError

# -- single process -------------------------------------------------------------------------------


def test_off_means_no_wrapping():
    comm = object()
    assert maybe_wrap(comm, env={}) is comm  # type: ignore[arg-type]
    assert maybe_wrap(comm, env={"PLAIT_TIMELINE": "", "PLAIT_STALL_WARNING": "0"}) is comm  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["soon", "-1"])
def test_bad_stall_setting_names_the_variable(value):
    with pytest.raises(ConfigError, match="PLAIT_STALL_WARNING"):
        maybe_wrap(object(), env={"PLAIT_STALL_WARNING": value})  # type: ignore[arg-type]


def test_horovod_stall_settings_on_the_mpi_backend():
    """On the MPI backend Horovod's stall warning starts plait's inspector; PLAIT_STALL_*
    win; Horovod's shutdown (which fails the stalled ops, not the job) is not taken; the
    Horovod backend leaves them to Horovod."""
    from plait.collectives.timeline import _stall_settings

    hv = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "30", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90"}
    assert _stall_settings(hv, "mpi") == (30.0, 0.0)
    assert _stall_settings({**hv, "HOROVOD_STALL_CHECK_DISABLE": "1"}, "mpi") == (0.0, 0.0)
    assert _stall_settings({**hv, "PLAIT_STALL_WARNING": "5"}, "mpi") == (5.0, 0.0)
    assert _stall_settings({**hv, "PLAIT_STALL_SHUTDOWN": "50"}, "mpi") == (30.0, 50.0)
    assert _stall_settings(hv, "horovod") == (0.0, 0.0)
    assert _stall_settings({}, "mpi") == (0.0, 0.0)


def test_stall_settings_pass_to_horovod():
    env = {"PLAIT_STALL_WARNING": "2.5", "PLAIT_STALL_SHUTDOWN": "30"}
    prepare_env("horovod", env)
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "2"
    assert env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "30"
    env = {"PLAIT_STALL_WARNING": "5", "HOROVOD_STALL_CHECK_TIME_SECONDS": "9"}
    prepare_env("horovod", env)
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "9"  # the user's own setting wins
    env = {"PLAIT_STALL_WARNING": "5"}
    prepare_env("mpi", env)
    assert "HOROVOD_STALL_CHECK_TIME_SECONDS" not in env


def test_tracker_reports_missing_ranks_then_aborts():
    t = Tracker(warning=2.0, shutdown=5.0)
    t.enter(0, "w", (0, 1, 2), 1, "allreduce a", now=0.0)
    t.enter(1, "w", (0, 1, 2), 1, "allreduce a", now=0.1)
    t.enter(2, "w", (0, 1, 2), 1, "allreduce a", now=0.2)
    assert t.calls == {}  # everyone entered: nothing pending
    t.enter(0, "w", (0, 1, 2), 2, "allreduce grad.0", now=1.0)
    t.enter(2, "w", (0, 1, 2), 2, "allreduce grad.0", now=1.0)
    assert t.check(now=2.0) == ([], None)
    warnings, abort = t.check(now=3.5)
    assert len(warnings) == 1 and abort is None
    assert "ranks [1] have not submitted allreduce grad.0" in warnings[0]
    assert "ranks [0, 2] submitted it" in warnings[0]
    assert t.check(now=4.0) == ([], None)  # not repeated within the warning period
    warnings, abort = t.check(now=6.5)
    assert abort is not None and "ranks [1]" in abort


def test_tracker_keeps_groups_apart():
    t = Tracker(warning=1.0)
    t.enter(0, "w/1:0", (0, 2), 1, "allreduce x", now=0.0)
    t.enter(1, "w/1:1", (1, 3), 1, "allreduce x", now=0.0)
    t.enter(3, "w/1:1", (1, 3), 1, "allreduce x", now=0.0)
    warnings, _ = t.check(now=5.0)
    assert len(warnings) == 1 and "ranks [2]" in warnings[0] and "w/1:0" in warnings[0]


def test_merge_tolerates_an_unfinished_part(tmp_path):
    path = tmp_path / "tl.json"
    (tmp_path / "tl.json.rank0").write_text(
        '[\n{"name":"allreduce x","ph":"X","pid":0,"tid":1,"ts":1000.0,"dur":5},\n'
        '{"name":"end","ph":"i","pid":0,"tid":0,"ts":1010.0}\n]\n')
    (tmp_path / "tl.json.rank1").write_text(  # a rank that died mid-write
        '[\n{"name":"allreduce x","ph":"X","pid":1,"tid":1,"ts":1002.0,"dur":3},\n{"name":"al')
    merged = json.loads(merge(str(path), 2).read_text())
    assert merged["otherData"]["missing_ranks"] == [1]
    names = [(e["pid"], e["name"], e["ts"]) for e in merged["traceEvents"]]
    assert (0, "allreduce x", 0.0) in names and (1, "allreduce x", 2.0) in names


# -- jobs -----------------------------------------------------------------------------------------

def _collectives(events, pid):
    return sorted((e for e in events if e.get("pid") == pid and e.get("cat") == "collective"
                   and e["name"] not in ("submit", "wait")),
                  key=lambda e: (e["args"]["backend"], e["args"]["seq"]))


def test_timeline_of_a_two_rank_job(tmp_path):
    path = tmp_path / "timeline.json"
    job = pytest_argv("job_timeline.py", "-k", "records_collectives or horovod_timeline_layout")
    result = run_job("mpirun", 2, job, timeout=400, env={"PLAIT_TIMELINE": str(path)})
    assert result.returncode == 0, result.tail(80)
    trace = json.loads(path.read_text())
    assert not list(tmp_path.glob("timeline.json.rank*"))  # parts merged and removed
    assert "2 passed" in result.output, result.tail(40)  # with Horovod's layout on the MPI backend
    events = trace["traceEvents"]
    assert trace["otherData"]["missing_ranks"] == []
    per_rank = [_collectives(events, r) for r in (0, 1)]
    expected_once = ["allreduce t.0", "allreduce t.1", "allreduce t.2", "allreduce async.1",
                     "allreduce async.2", "allgather gathered", "broadcast bcast",
                     "allreduce grad.0", "allreduce grad.1", "allreduce grad.2", "allreduce grad.3"]
    for r, evs in enumerate(per_rank):
        counts = Counter((e["args"]["backend"], e["name"]) for e in evs)
        for backend in ("mpi", "horovod"):
            for name in expected_once:
                assert counts[(backend, name)] == 1, (r, backend, name, counts)
            assert counts[(backend, "barrier")] == 2
        for e in evs:
            a = e["args"]
            assert a["enqueue_us"] <= a["start_us"] <= a["end_us"]
    # the same calls in the same order on both ranks
    assert [e["name"] for e in per_rank[0]] == [e["name"] for e in per_rank[1]]
    sizes = {e["name"]: e["args"].get("bytes") for e in per_rank[0]}
    assert sizes["allreduce t.0"] == 32
    # nesting: each submit/wait lies inside one collective event on the same row, and
    # collective events on one row never overlap
    rows: dict[tuple[int, int], list[dict]] = {}
    for e in events:
        if e.get("ph") == "X":
            rows.setdefault((e["pid"], e["tid"]), []).append(e)
    eps = 0.002
    for row in rows.values():
        tops = sorted((e for e in row if e["name"] not in ("submit", "wait")), key=lambda e: e["ts"])
        for a, b in zip(tops, tops[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + eps, (a, b)
        for child in (e for e in row if e["name"] in ("submit", "wait")):
            parents = [p for p in tops if p["ts"] - eps <= child["ts"]
                       and child["ts"] + child["dur"] <= p["ts"] + p["dur"] + eps]
            assert len(parents) == 1, child


#: Seconds allowed between the configured stall limit and the job's end (rank 0's inspector
#: notices within a poll, then MPI_Abort tears down both ranks on a loaded machine).
ABORT_MARGIN_S = 25.0


def test_stall_warning_names_rank_and_tensor_then_ends_the_job():
    job = pytest_argv("job_timeline.py::test_stall_inspector_names_the_missing_rank", "-s")  # -s: the
    # job is aborted, so what pytest captured would never be shown
    shutdown = 5.0
    result = run_job("mpirun", 2, job, timeout=200,
                     env={"PLAIT_STALL_WARNING": "1", "PLAIT_STALL_SHUTDOWN": f"{shutdown:g}"})
    ended = time.time()
    out = result.output
    stalled = re.search(r"stalled at ([0-9.]+)", out)
    assert stalled is not None, result.tail(60)
    # ended within the configured limit (plus a margin), long before rank 1's 120 s sleep
    assert ended - float(stalled.group(1)) < shutdown + ABORT_MARGIN_S, result.tail(60)
    assert result.returncode not in (0, 124), result.tail(60)  # ended, and not by our timeout
    assert "the stall inspector did not end the job" not in out
    assert "ranks [1] have not submitted allreduce never.submitted" in out, result.tail(60)
    assert "shutting down the job after PLAIT_STALL_SHUTDOWN=5s" in out, result.tail(60)
