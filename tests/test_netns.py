"""Multi-host launching over emulated hosts (network namespaces on a bridge).

Needs root and iproute2: we are root here and in CI, so these run rather than skip.
Every job has two hard limits: mpirun/plait ``--timeout`` and the harness's own
subprocess timeout (which kills the whole process group).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from plait.testing.netns import EmulatedHosts, cleanup, unavailable_reason
from plait.testing.pytest_fixtures import emulated_hosts  # noqa: F401  (fixture)

pytestmark = [
    pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason())),
    pytest.mark.timeout(180),
]

JOB_S = 30  # mpirun / plait run --timeout for every job
HARD_S = 90  # harness kill for every job
VENV_BIN = str(Path(sys.executable).parent)
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_mpi_yield_when_idle": "1",
}
# Each rank writes one line: hostname, rank, local rank, local size and plait's view.
REPORT = """\
import os, socket, sys
from plait.launch.context import context
ctx = context()
e = os.environ
sys.stdout.write(" ".join(map(str, [
    "REPORT", socket.gethostname(), e["OMPI_COMM_WORLD_RANK"], e["OMPI_COMM_WORLD_LOCAL_RANK"],
    e["OMPI_COMM_WORLD_LOCAL_SIZE"], ctx.rank, ctx.cross_rank, ctx.cross_size,
    e.get("PLAIT_BACKEND", "-")])) + "\\n")
"""

Factory = Callable[..., EmulatedHosts]


def job_env(hosts: EmulatedHosts) -> dict[str, str]:
    env = hosts.env()
    env["PATH"] = f"{hosts.bin_dir}:{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    return {**env, **MPI_ENV}


def plait_run(hosts: EmulatedHosts, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "plait.launch.run", "--timeout", str(JOB_S), *args]
    return hosts.exec(hosts.hosts[0], argv, timeout=HARD_S, env=job_env(hosts))


def reports(stdout: str) -> list[list[str]]:
    rows = [line.split()[1:] for line in stdout.splitlines() if line.startswith("REPORT ")]
    return sorted(rows, key=lambda r: int(r[1]))


def assert_gone(hosts: EmulatedHosts) -> None:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           check=True).stdout
    for ns in [*hosts.hosts, hosts.bridge]:
        assert re.search(rf"^{re.escape(ns)}\b", names, re.M) is None, f"{ns} left behind"
        assert not os.path.exists(f"/etc/netns/{ns}")
    assert not os.path.exists(hosts.workdir)


def test_two_hosts_raw_mpirun_distinct_hostnames_and_traffic() -> None:
    with EmulatedHosts(2) as hosts:
        route = subprocess.run(["ip", "route", "show", "exact", hosts.cidr],
                               capture_output=True, text=True, check=True).stdout
        assert route.startswith("blackhole"), route
        before = [hosts.tx_bytes(h) for h in hosts.hosts]
        argv = ["mpirun", "--allow-run-as-root", "-np", "2", "--hostfile", hosts.hostfile,
                *hosts.mpirun_args(), "--timeout", str(JOB_S), "-x", "PLAIT_BACKEND=mpi",
                sys.executable, "-c", REPORT]
        proc = hosts.exec(hosts.hosts[0], argv, timeout=HARD_S, env=job_env(hosts))
        assert proc.returncode == 0, proc.stderr
        rows = reports(proc.stdout)
        assert [r[0] for r in rows] == hosts.hosts  # one rank per host, each its own name
        assert [r[1:4] for r in rows] == [["0", "0", "1"], ["1", "0", "1"]]
        assert [r[5:] for r in rows] == [["0", "2", "mpi"], ["1", "2", "mpi"]]
        after = [hosts.tx_bytes(h) for h in hosts.hosts]
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    assert_gone(hosts)


def test_four_hosts_two_slots_through_plait_run(emulated_hosts: Factory) -> None:  # noqa: F811
    hosts = emulated_hosts(4, slots=2)
    before = [hosts.rx_bytes(h) for h in hosts.hosts]
    proc = plait_run(hosts, ["--hostfile", hosts.hostfile, *hosts.mpirun_args(),
                             "--backend", "mpi", "--", sys.executable, "-c", REPORT])
    assert proc.returncode == 0, proc.stderr
    rows = reports(proc.stdout)
    assert len(rows) == 8
    for rank, row in enumerate(rows):
        host, world_rank, local_rank, local_size, ctx_rank, cross_rank, cross_size, be = row
        assert host == hosts.hosts[rank // 2]
        assert (int(world_rank), int(local_rank), int(local_size)) == (rank, rank % 2, 2)
        assert (int(ctx_rank), int(cross_rank), int(cross_size)) == (rank, rank // 2, 4)
        assert be == "mpi"
    after = [hosts.rx_bytes(h) for h in hosts.hosts]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_failing_rank_status_crosses_hosts(emulated_hosts: Factory) -> None:  # noqa: F811
    hosts = emulated_hosts(2)
    code = "import os, sys; sys.exit(7 if os.environ['OMPI_COMM_WORLD_RANK'] == '1' else 0)"
    proc = plait_run(hosts, ["--hostfile", hosts.hostfile, *hosts.mpirun_args(), "--",
                             sys.executable, "-c", code])
    assert proc.returncode == 7, proc.stderr


def test_downed_link_fails_within_timeout(emulated_hosts: Factory,  # noqa: F811
                                          tmp_path: Path) -> None:
    hosts = emulated_hosts(2)
    marker = tmp_path / "rank"
    code = (
        "import os, pathlib, time; "
        f"pathlib.Path({str(marker)!r} + os.environ['OMPI_COMM_WORLD_RANK']).touch(); "
        "time.sleep(8)"
    )
    timeout_s = 15
    argv = [sys.executable, "-m", "plait.launch.run", "--timeout", str(timeout_s),
            "--hostfile", hosts.hostfile, *hosts.mpirun_args(), "--",
            sys.executable, "-c", code]
    start = time.monotonic()
    with open(tmp_path / "err", "w+") as err:  # a file, not a pipe: orphans cannot block us
        proc = hosts.popen(hosts.hosts[0], argv, env=job_env(hosts),
                           stdout=subprocess.DEVNULL, stderr=err)
        try:
            while not all(Path(f"{marker}{r}").exists() for r in (0, 1)):
                assert proc.poll() is None and time.monotonic() - start < JOB_S, "no start"
                time.sleep(0.1)
            hosts.link_down(hosts.hosts[1])
            proc.wait(timeout=timeout_s + 30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        err.seek(0)
        stderr = err.read()
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert proc.returncode == 124, stderr
    assert "longer than --timeout=15s" in stderr
    assert elapsed < timeout_s + 15, elapsed


def test_teardown_on_exception_and_agent_refuses_unknown_hosts() -> None:
    hosts = EmulatedHosts(2, rate="1gbit")
    with pytest.raises(RuntimeError, match="boom"), hosts:
        qdisc = hosts.exec(hosts.hosts[1], ["tc", "qdisc", "show", "dev", "eth0"], timeout=30)
        assert "tbf" in qdisc.stdout and "1Gbit" in qdisc.stdout
        name = hosts.exec(hosts.hosts[1], ["hostname"], timeout=30)
        assert name.stdout.strip() == hosts.hosts[1]
        bad = subprocess.run([hosts.agent, "evil;touch /tmp/x", "true"], capture_output=True,
                             text=True, timeout=30)
        assert bad.returncode == 255 and "unknown host" in bad.stderr
        # the agent runs the command it is given (a command line, as ssh would) on the host
        ok = subprocess.run([hosts.agent, hosts.hosts[1], "hostname"], capture_output=True,
                            text=True, timeout=30)
        assert ok.stdout.strip() == hosts.hosts[1]
        raise RuntimeError("boom")
    assert_gone(hosts)


def test_horovodrun_over_emulated_hosts(emulated_hosts: Factory) -> None:  # noqa: F811
    if not os.path.exists(os.path.join(VENV_BIN, "horovodrun")):
        pytest.skip("horovodrun is not installed in this environment")
    hosts = emulated_hosts(2)
    code = ("import os, socket, sys; sys.stdout.write('REPORT ' + socket.gethostname() + ' ' + "
            "os.environ['HOROVOD_RANK'] + ' ' + os.environ['PLAIT_BACKEND'] + '\\n')")
    proc = plait_run(hosts, ["--launcher", "horovodrun", "--gloo", "--backend", "horovod",
                             "--hostfile", hosts.hostfile, "--network-interface", "eth0",
                             "--start-timeout", "30", "--", sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    rows = sorted(line.split("REPORT ", 1)[1].split() for line in proc.stdout.splitlines()
                  if "REPORT " in line)
    assert rows == [[hosts.hosts[0], "0", "horovod"], [hosts.hosts[1], "1", "horovod"]]


def test_command_line_up_down() -> None:
    up = subprocess.run([sys.executable, "-m", "plait.testing.netns", "up", "2"],
                        capture_output=True, text=True, timeout=60)
    prefix = re.search(r"^prefix:\s+(\S+)", up.stdout, re.M)
    assert up.returncode == 0 and prefix is not None, up.stderr
    try:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"{prefix.group(1)}-h1" in names
    finally:
        down = subprocess.run([sys.executable, "-m", "plait.testing.netns", "down",
                               prefix.group(1)], capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    assert f"{prefix.group(1)}-h0" in down.stdout
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix.group(1) not in names
    assert cleanup(prefix.group(1) + "-") == []


def test_two_instances_side_by_side() -> None:
    """Instances use distinct names, so parallel tests do not collide; the route outlives both."""
    with EmulatedHosts(2) as first, EmulatedHosts(2) as second:
        assert not set(first.hosts) & set(second.hosts)
        for hosts in (first, second):
            argv = ["mpirun", "--allow-run-as-root", "-np", "2", "--hostfile", hosts.hostfile,
                    *hosts.mpirun_args(), "--timeout", str(JOB_S), sys.executable, "-c", REPORT]
            proc = hosts.exec(hosts.hosts[0], argv, timeout=HARD_S, env=job_env(hosts))
            assert proc.returncode == 0, proc.stderr
            assert [r[0] for r in reports(proc.stdout)] == hosts.hosts
        first.down()
        route = subprocess.run(["ip", "route", "show", "exact", second.cidr],
                               capture_output=True, text=True, check=True).stdout
        assert route.startswith("blackhole"), "the other instance still needs the route"
    assert_gone(first)
    assert_gone(second)
