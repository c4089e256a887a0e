"""``plait run --elastic`` on the MPI backend: a killed worker, a host added, bad input.

The job (tests/parallel/job_elastic_mpi.py) is Horovod's elastic torch loop with
``import plait.torch as hvd``; its weights after every relaunch must equal a
one-process run of the same steps (every committed step applied exactly once).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jobs import ROOT, mpi_env

from plait.errors import ConfigError
from plait.launch.elastic import ElasticPolicy, discover, plan_hosts
from plait.launch.hostfile import HostSlots
from plait.launch.run import build_parser, elastic_policy
from plait.testing.netns import EmulatedHosts, unavailable_reason
from plait.testing.pytest_fixtures import emulated_hosts  # noqa: F401  (fixture)

torch = pytest.importorskip("torch")  # the commits hold torch tensors: loaded at once
Factory = Callable[..., EmulatedHosts]
JOB = ROOT / "tests" / "parallel" / "job_elastic_mpi.py"
STEPS = 40


def _commits(directory: Path) -> int:
    """The most commits any host's file holds."""
    best = 0
    for path in directory.glob("commit-*.pkl"):
        try:
            with open(path, "rb") as f:
                best = max(best, int(pickle.load(f)["commits"]))
        except (OSError, EOFError, pickle.UnpicklingError):
            continue  # being replaced
    return best


def _until(cond: Callable[[], bool], proc: subprocess.Popen[Any], what: str, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert proc.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def elastic_job(tmp_path: Path, job: str, hosts_text: str, extra: dict[str, str],
                *args: str) -> tuple[list[str], dict[str, str]]:
    """argv and environment of ``plait run --elastic`` for tests/parallel/``job``; the
    discovery script prints ``tmp_path/hosts`` (starting as ``hosts_text``), commits go to
    ``tmp_path/commits`` and the ranks' pids to ``tmp_path/pids``."""
    (tmp_path / "hosts").write_text(hosts_text)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    script.chmod(0o755)
    (tmp_path / "pids").mkdir()
    env = mpi_env({"EL_SLEEP": "0.2", "EL_PIDS": str(tmp_path / "pids"),
                   "PLAIT_ELASTIC_DIR": str(tmp_path / "commits"), **extra})
    argv = [sys.executable, "-m", "plait.launch.run", "--elastic", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(script), "--discovery-interval", "0.5", "--timeout", "200",
            *args, *[a for k in env if k.startswith("EL_") for a in ("-x", k)], "--",
            sys.executable, str(JOB.parent / job)]
    return argv, env


def drive(tmp_path: Path, start: Callable[..., subprocess.Popen[Any]],
          steer: Callable[[subprocess.Popen[Any]], None]) -> tuple[int, str, str]:
    """Start the job (``start(stdout=, stderr=)``), ``steer`` it, wait for its end (killing
    it if it outlives the test); returns (status, stdout, stderr)."""
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
        proc = start(stdout=out, stderr=err)
        try:
            steer(proc)
            proc.wait(timeout=200)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        err.seek(0)
        return int(proc.returncode), out.read(), err.read()


def _starts(stdout: str) -> list[tuple[int, int]]:
    return [(int(s), int(b)) for s, b in re.findall(r"EL start rank=0 size=(\d) batch=(\d+)", stdout)]


@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
@pytest.mark.timeout(300)
def test_killed_worker_then_added_host_resume_from_the_last_commit(
        tmp_path: Path, emulated_hosts: Factory) -> None:  # noqa: F811
    """2 hosts; the second one's worker is SIGKILLed and its host leaves discovery (the
    job goes on with 1 rank from the last commit); a third host is added (2 ranks again)."""
    hosts = emulated_hosts(3, slots=1)
    h0, h1, h2 = hosts.hosts
    argv, env = elastic_job(tmp_path, "job_elastic_mpi.py", f"{h0}:1\n{h1}:1\n",
                            {"EL_STEPS": str(STEPS), "EL_OUT": str(tmp_path / "w.npy"),
                             "PLAIT_TIMEOUT": "20", "PLAIT_TIMELINE": str(tmp_path / "timeline.json")},
                            *hosts.mpirun_args())
    env["PATH"] = f"{hosts.bin_dir}:{env['PATH']}"
    commits, pids, listed = tmp_path / "commits", tmp_path / "pids", tmp_path / "hosts"
    seen: list[int] = []

    def steer(proc: subprocess.Popen[Any]) -> None:
        _until(lambda: _commits(commits) >= 4, proc, "4 commits")
        seen.append(_commits(commits))
        listed.write_text(f"{h0}:1\n")
        os.kill(int((pids / "pid-1-0").read_text()), signal.SIGKILL)
        _until(lambda: (pids / "pid-0-1").exists() and _commits(commits) >= seen[0] + 3, proc,
               "3 commits after the relaunch")
        listed.write_text(f"{h0}:1\n{h2}:1\n")

    status, stdout, stderr = drive(tmp_path, lambda **kw: hosts.popen(h0, argv, env=env, cwd=str(ROOT),
                                                                      **kw), steer)
    context = f"{stderr[-4000:]}\n{stdout[-3000:]}"
    assert status == 0, context
    starts = _starts(stdout)
    assert [s for s, _ in starts] == [2, 1, 2], context
    # each start resumed from a commit at least as new as the one seen before its change
    assert starts[0][1] == 0 and seen[0] <= starts[1][1] < STEPS, context
    assert starts[2][1] >= starts[1][1] + 3, context
    assert f"starting 2 ranks on {h0}:1,{h2}:1" in stderr, context
    done = re.findall(r"EL done rank=\d size=2 batch=(\d+) replicas_equal=(True|False)", stdout)
    assert done == [(str(STEPS), "True")] * 2, context
    sys.path.insert(0, str(JOB.parent))
    try:
        from job_elastic_mpi import serial
    finally:
        sys.path.pop(0)
    np.testing.assert_allclose(np.load(tmp_path / "w.npy"), serial(STEPS), rtol=1e-5, atol=1e-6)
    # the last start's timeline marks where it resumed (each start writes the file anew)
    events = json.loads((tmp_path / "timeline.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    marks = [e["args"] for e in events if e.get("name") == "elastic resume"]
    assert {(m["size"], m["restart"], m["commit"]) for m in marks} == {(2, 2, starts[2][1])}, marks


@pytest.mark.timeout(300)
def test_keras_loop_follows_a_host_that_shrinks(tmp_path: Path) -> None:
    """Keras 3 custom loop on one machine: discovery goes from 2 slots to 1; the job stops at
    a commit, starts again on 1 rank from it and ends with a one-process run's weights."""
    argv, env = elastic_job(tmp_path, "job_elastic_keras_mpi.py", "localhost:2\n",
                            {"EL_STEPS": "20", "PLAIT_TIMEOUT": "60"})

    def steer(proc: subprocess.Popen[Any]) -> None:
        _until(lambda: _commits(tmp_path / "commits") >= 3, proc, "3 commits", limit=200)
        (tmp_path / "hosts").write_text("localhost:1\n")

    status, stdout, stderr = drive(tmp_path, lambda **kw: subprocess.Popen(
        argv, env=env, cwd=str(ROOT), start_new_session=True, **kw), steer)
    context = f"{stderr[-4000:]}\n{stdout[-3000:]}"
    assert status == 0, context
    starts = _starts(stdout)
    assert [s for s, _ in starts] == [2, 1] and starts[1][1] >= 3, context
    done = re.search(r"EL done rank=0 size=1 batch=20 replicas_equal=True serial_diff=(\S+)", stdout)
    assert done is not None and float(done.group(1)) < 1e-5, context


def test_discovery_output_and_failures_are_checked(tmp_path: Path) -> None:
    assert discover("printf 'a:2\\nb\\n\\n'") == [HostSlots("a", 2), HostSlots("b", 1)]
    assert discover("true") == []
    with pytest.raises(ConfigError, match="failed with exit status 3: oops"):
        discover("echo oops >&2; exit 3")
    with pytest.raises(ConfigError, match="line 'a:x'"):
        discover("echo a:x")
    with pytest.raises(ConfigError, match="did not finish within 0.5s"):
        discover("sleep 5", timeout=0.5)


def test_plan_leaves_out_blamed_hosts_and_caps_at_max_np() -> None:
    found = [HostSlots("a", 2), HostSlots("b", 2), HostSlots("c", 1)]
    assert plan_hosts(found, [], 3) == [HostSlots("a", 2), HostSlots("b", 1)]
    assert plan_hosts(found, ["a"], 8) == [HostSlots("b", 2), HostSlots("c", 1)]


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args([*argv, "--", "true"])


@pytest.mark.parametrize(("argv", "match"), [
    (["--elastic", "--min-np", "1", "--max-np", "2"], "--elastic needs --host-discovery-script"),
    (["--min-np", "2"], "--min-np needs --elastic"),
    (["--elastic", "--host-discovery-script", "d", "--min-np", "3", "--max-np", "2"],
     r"--max-np=2: expected an integer >= --min-np \(3\)"),
    (["--elastic", "--host-discovery-script", "d", "--min-np", "1", "--max-np", "2", "--restarts", "1"],
     "drop --restarts"),
    (["--elastic", "--host-discovery-script", "d", "--min-np", "1", "--max-np", "2", "-H", "a:2"],
     "takes its hosts from --host-discovery-script: drop -H"),
])
def test_elastic_options_are_checked(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        elastic_policy(_args(*argv))


def test_elastic_policy_from_options() -> None:
    got = elastic_policy(_args("--elastic", "--host-discovery-script", "d", "--min-np", "1",
                               "--max-np", "4", "--reset-limit", "3"))
    assert got == ElasticPolicy("d", 1, 4, reset_limit=3)
    assert elastic_policy(_args()) is None


def test_ranks_with_other_versions_are_named() -> None:
    from plait.elastic_relaunch import mismatched, versions

    assert versions().startswith("plait ")
    assert mismatched(["a", "a", "b"]) == ("a", [2])
    assert mismatched(["b", "a", "a"]) == ("a", [0])
    assert mismatched(["a", "b"]) == ("a", [1])  # a tie: rank 0's versions are the job's
    assert mismatched(["a"]) == ("a", [])


def _supervise(tmp_path: Path, hosts: list[str], codes: list[int], **policy: Any) -> tuple[int, list[str]]:
    """``run_elastic`` with a runner that returns ``codes`` one start after another (the
    discovery script prints the lines of a file that ``hosts[k]`` replaces at start k)."""
    from plait.launch.command import LaunchSpec
    from plait.launch.elastic import run_elastic

    listed = tmp_path / "hosts"
    listed.write_text(hosts[0])
    started: list[str] = []

    def run(cmd: Any, timeout: Any, capture: list[str], signals: list[int]) -> int:
        started.append(cmd.argv[cmd.argv.index("-H") + 1])
        if len(started) < len(hosts):
            listed.write_text(hosts[len(started)])
        return codes[len(started) - 1]

    rc = run_elastic(LaunchSpec(command=("true",)),
                     ElasticPolicy(f"cat {listed}", 1, 4, interval=0.05, **policy), {}, False, run)
    return rc, started


def test_supervisor_relaunches_on_the_hosts_discovery_gives(tmp_path: Path) -> None:
    from plait.launch.elastic import EXIT_RELAUNCH

    rc, started = _supervise(tmp_path, ["a:2\nb:2\n", "a:2\n", "a:1\nc:9\n"], [EXIT_RELAUNCH, 1, 0])
    assert rc == 0 and started == ["a:2,b:2", "a:2", "a:1,c:3"]  # capped at --max-np 4


def test_supervisor_gives_up_after_failed_starts_without_a_commit(tmp_path: Path) -> None:
    rc, started = _supervise(tmp_path, ["a:1\n"] * 5, [7] * 5, max_failures=3)
    assert rc == 7 and len(started) == 3


def test_supervisor_fails_at_once_on_a_broken_script_and_waits_for_min_np(tmp_path: Path) -> None:
    from plait.launch.command import LaunchSpec
    from plait.launch.elastic import run_elastic

    rc = run_elastic(LaunchSpec(command=("true",)), ElasticPolicy("exit 3", 1, 2), {}, False,
                     lambda *a, **k: 0)
    assert rc == 1  # before any start: an error at once
    rc, started = _supervise(tmp_path, [""], [0], elastic_timeout=0.3)
    assert rc == 1 and started == []  # nothing discovered within --elastic-timeout


def test_supervisor_retries_a_script_that_fails_after_the_first_start(tmp_path: Path) -> None:
    from plait.launch.command import LaunchSpec
    from plait.launch.elastic import EXIT_RELAUNCH, run_elastic

    state = tmp_path / "state"
    state.write_text("a:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f'#!/bin/sh\nif [ "$(cat {state})" = fail ]; then echo b:1 > {state}; exit 3; fi\n'
                      f"cat {state}\n")
    script.chmod(0o755)
    started: list[str] = []

    def run(cmd: Any, timeout: Any, capture: list[str], signals: list[int]) -> int:
        started.append(cmd.argv[cmd.argv.index("-H") + 1])
        if len(started) == 1:
            state.write_text("fail")  # the next discovery fails once
            return EXIT_RELAUNCH
        return 0

    rc = run_elastic(LaunchSpec(command=("true",)), ElasticPolicy(str(script), 1, 2, interval=0.05),
                     {}, False, run)
    assert rc == 0 and started == ["a:1", "b:1"]
