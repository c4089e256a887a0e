"""Every wait is bounded: the Horovod backend under horovodrun --gloo (no MPI) and under
mpirun, and a rank whose MPI_Abort never returns.

One real 2-rank job (``tests/parallel/job_wait_bounded.py``) per launcher: a torch Horovod
handle whose peer is late raises ``CollectiveTimeoutError`` naming the collective (and,
under mpirun, which rank is not waiting and its host), and an uncaught timeout ends the
job by itself, non-zero, well before the launcher's own limit.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest
from jobs import ROOT, run_job
from plait.collectives.abort import ABORT_CODE
from plait.collectives.watchdog import Watchdog

from plait.launch.command import build_command
from plait.launch.run import KEEPALIVE_MCA, build_parser, spec_from_args

JOB = str(ROOT / "tests" / "parallel" / "job_wait_bounded.py")
LIMIT_S = 120  # the harness kills the job after this (rank 1 sleeps 600 s)


@pytest.mark.timeout(LIMIT_S + 60)
@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "mpirun"])
def test_horovod_handle_wait_and_uncaught_timeout_are_bounded(launcher: str) -> None:
    pytest.importorskip("horovod.torch")
    start = time.monotonic()
    result = run_job(launcher, 2, [sys.executable, JOB], timeout=LIMIT_S)
    elapsed = time.monotonic() - start
    out = result.output
    phase1 = re.search(r"phase 1: rank 0 timed out after ([\d.]+)s: (.*)", out)
    assert phase1 is not None, result.tail()
    # 1 s timeout (+ up to 2 s asking the others under mpirun), rank 1 came at 4 s
    assert float(phase1.group(1)) < (3.9 if launcher == "mpirun" else 3.5), phase1.group(0)
    # the message names the collective: kind, shape, dtype, op and name
    assert "allreduce(shape=(1000,), dtype=float32, op=sum, name='late')" in phase1.group(2), out
    assert "waited 1s" in phase1.group(2), out
    if launcher == "mpirun":  # and, in an MPI job, the rank that is not waiting, with its host
        assert re.search(r"rank 0 of this group waited in a Horovod op; rank 1 did not arrive "
                         rf"\(host {re.escape(socket.gethostname())};", phase1.group(2)), out
    assert "phase 2: rank 0 starts" in out and "phase 2: rank 1 starts" in out, result.tail()
    # the uncaught timeout ends the job by itself, not the harness
    assert result.returncode not in (0, 124), result.tail()
    ended = ("aborts the job (MPI_Abort)" if launcher == "mpirun" else "exits with status 3")
    assert f"{ended} after an uncaught CollectiveTimeoutError" in out, result.tail()
    assert "name='never'" in out, result.tail()
    assert elapsed < LIMIT_S - 30, (elapsed, result.tail())


def test_aborting_rank_exits_by_itself_when_the_abort_blocks() -> None:
    """The watchdog armed before MPI_Abort ends the rank (status 3) if the abort never
    returns, as when mpirun cannot reach a host (here: the rank just sleeps)."""
    code = ("import time\nfrom plait.collectives import abort\n"
            "abort._exit_later(0.5)\ntime.sleep(60)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == ABORT_CODE, proc.stderr
    assert time.monotonic() - start < 20, proc.stderr
    assert "did not end this rank within 0.5s" in proc.stderr, proc.stderr


def test_plait_run_gives_mpirun_a_short_keepalive_unless_told_otherwise() -> None:
    """A lost host is noticed in seconds (measured: 10 to 15 s after a link went down)."""

    def mca(argv: list[str]) -> dict[str, str]:
        return {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "--mca"}

    spec = spec_from_args(build_parser().parse_args(["-np", "2", "--", "x"]))
    assert {k: v for k, v in mca(build_command(spec).argv).items()
            if "keepalive" in k} == dict(KEEPALIVE_MCA)
    spec = spec_from_args(build_parser().parse_args(
        ["--mca", "oob_tcp_keepalive_time", "60", "--", "x"]))
    got = mca(build_command(spec).argv)
    assert got["oob_tcp_keepalive_time"] == "60" and got["oob_tcp_keepalive_probes"] == "5"
    assert build_command(spec).argv.count("oob_tcp_keepalive_time") == 1
    spec = spec_from_args(build_parser().parse_args(["--launcher", "horovodrun", "--", "x"]))
    assert "--mca" not in build_command(spec).argv  # horovodrun takes no --mca


_STOPS_IN_DATA_PHASE = """
import os, signal
import numpy as np
from plait.collectives.check import Call
from plait.collectives.mpi import MPICommunicator
comm = MPICommunicator(timeout=2.0)
x = np.ones(100_000, np.float32)  # above the header's slot: a blocking Allreduce on one host
assert comm.tuning.blocks(comm.cross_size)
print(f"first {comm.allreduce(x, 'sum')[0]}", flush=True)
if comm.rank == 1:  # arrive at the next collective (its header, asking to block), then stop
    comm._header(Call("allreduce", x.shape, "float32", op="sum", name=None), block=True)
    os.kill(os.getpid(), signal.SIGSTOP)
comm.allreduce(x, "sum")
print("the stuck allreduce returned", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_rank_stopped_inside_a_blocking_collective_ends_the_job() -> None:
    """On one host a synchronous allreduce is a blocking MPI call once every rank arrived;
    the watchdog ends the job with the collective's name when a rank stops inside it."""
    start = time.monotonic()
    result = run_job("mpirun", 2, [sys.executable, "-c", _STOPS_IN_DATA_PHASE], timeout=90)
    elapsed = time.monotonic() - start
    out = result.output
    assert out.count("first 2.0") == 2, result.tail()
    assert result.returncode not in (0, 124), result.tail()
    assert "the stuck allreduce returned" not in out, result.tail()
    assert re.search(r"CollectiveTimeoutError: .*waited 2s in the blocking data phase of "
                     r"allreduce\(shape=\(100000,\), dtype=float32, op=sum", out), result.tail()
    assert elapsed < 45, (elapsed, result.tail())


def test_watchdog_calls_expire_only_for_a_call_that_outlives_its_time() -> None:
    expired: list[str] = []
    dog = Watchdog(expired.append)
    key = dog.arm(0.05, lambda: "quick")
    dog.disarm(key)
    dog.arm(0.1, lambda: "slow")
    deadline = time.monotonic() + 5
    while not expired and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert expired == ["slow"]
