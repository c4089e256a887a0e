"""Real multi-host jobs over emulated hosts: every launcher, both backends, failures.

Hosts are network namespaces on one bridge (:class:`plait.testing.netns.EmulatedHosts`);
they need root, which this machine and CI have, so nothing here skips: without root
the tests fail with the reason. Two host layouts, 2 hosts x 1 slot and 4 hosts x 2
slots, are each brought up once per module.

Launches (each one job under ``--timeout``/``mpirun --timeout`` and a harness kill):

* the collectives job: ``tests/parallel/job_collectives.py`` (with ``job_ring.py``, the
  MPI backend's ring and hierarchical algorithms, under MPI launchers) restricted with ``-k``
  (:data:`COLLECTIVES_K`: float32 allreduce with every op, allgather, broadcast,
  alltoall, reducescatter, send/recv, split, a shape mismatch and the missing-rank
  timeout, for numpy and torch tensors; not the TensorFlow flavours, whose cost is the
  import, nor ``test_objects_and_topology``, which asserts a single host) plus
  ``tests/parallel/job_multihost.py``, which checks each rank's host name, local and
  cross rank/size from the communicator and moves a known number of bytes between hosts;
* the digits example ``examples/torch_digits.py`` on each backend, wrapped so that each
  rank then reports its host and the world communicator's coordinates;
* native ``torch.distributed`` (gloo) and ``tf.distribute.MultiWorkerMirroredStrategy``
  initialised from :func:`plait.launch.context.export_framework_env`;
* a rank killed with SIGKILL mid-job.

Lost links and stopped ranks during training (every workload and launcher) are in
``tests/test_link_down.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from jobs import ROOT, pytest_argv

from plait.testing.netns import EmulatedHosts

pytestmark = pytest.mark.timeout(600)

JOB_S = 300  # plait run / mpirun --timeout of a normal job (generous: 2 shared cores)
KILLED_RANK_S = 30  # a killed rank ends the job within this (its PLAIT_TIMEOUT is 60)
HARD_S = 360  # harness kill of a normal job (kills its whole process group)
VENV_BIN = str(Path(sys.executable).parent)
MULTIHOST_JOB = str(ROOT / "tests" / "parallel" / "job_multihost.py")
RING_JOB = str(ROOT / "tests" / "parallel" / "job_ring.py")
COLLECTIVES_JOB = str(ROOT / "tests" / "parallel" / "job_collectives.py")
DIGITS = str(ROOT / "examples" / "torch_digits.py")
DIGITS_EPOCHS = "8"
#: The job_collectives.py tests that run across hosts (see the module docstring).
COLLECTIVES_K = (
    "not tensorflow and not function and (float32 or send_recv or split_into or missing_rank "
    "or (mismatch and shape) or reducescatter) or ranks_sit or crosses_the_network"
)
#: Parameters of the digits model (64-128-10 MLP): bytes every rank receives at least once.
DIGITS_PARAM_BYTES = 4 * (64 * 128 + 128 + 128 * 10 + 10)

# Runs a program (argv after -c) as __main__, then reports where this rank ran.
REPORTING_WRAPPER = """\
import json, os, runpy, socket, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as exc:
    if exc.code not in (0, None):
        raise
import plait
w = plait.world()
report = {"host": socket.gethostname(), "rank": w.rank, "size": w.size, "backend": w.backend,
          "local_rank": w.local_rank, "local_size": w.local_size,
          "cross_rank": w.cross_rank, "cross_size": w.cross_size}
with open(os.path.join(os.environ["PLAIT_TEST_REPORT_DIR"], f"{w.backend}-{w.rank}.json"), "w") as f:
    json.dump(report, f)
"""


def job_env(hosts: EmulatedHosts, slots: int, report_dir: Path) -> dict[str, str]:
    env = hosts.env()
    env["PATH"] = f"{hosts.bin_dir}:{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_mpi_yield_when_idle": "1", "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
        "PLAIT_TEST_HOSTS": ",".join(hosts.hosts), "PLAIT_TEST_SLOTS": str(slots),
        "PLAIT_TEST_REPORT_DIR": str(report_dir),
    })
    return env


#: Variables raw ``mpirun`` must forward (plait run forwards PLAIT_* itself).
MPIRUN_X = ["-x", "PYTHONUNBUFFERED", "-x", "TF_CPP_MIN_LOG_LEVEL", "-x", "PLAIT_TEST_HOSTS",
            "-x", "PLAIT_TEST_SLOTS", "-x", "PLAIT_TEST_REPORT_DIR"]


def launcher_argv(hosts: EmulatedHosts, launcher: str, backend: str | None) -> list[str]:
    """The launcher part of the command line, up to the program."""
    np = str(len(hosts.hosts) * hosts.slots)
    plait = [sys.executable, "-m", "plait.launch.run", "--timeout", str(JOB_S)]
    horovodrun = [os.path.join(VENV_BIN, "horovodrun"), "-np", np, "--network-interface", "eth0",
                  "--start-timeout", "60"]
    if launcher == "plait":
        return [*plait, "--hostfile", hosts.hostfile, *hosts.mpirun_args(),
                "--backend", backend or "auto", "--"]
    if launcher == "mpirun":
        return ["mpirun", "--allow-run-as-root", "-np", np, "--hostfile", hosts.hostfile,
                *hosts.mpirun_args(), "--timeout", str(JOB_S), *MPIRUN_X]
    if launcher == "horovodrun-gloo-hostfile":
        return [*horovodrun, "--gloo", "--hostfile", hosts.plain_hostfile]
    if launcher == "horovodrun-gloo-H":
        return [*horovodrun, "--gloo", "-H", hosts.hosts_arg]
    raise ValueError(launcher)


def launch(hosts: EmulatedHosts, argv: Sequence[str], report_dir: Path,
           label: str) -> subprocess.CompletedProcess[str]:
    """Run a job from the first host; print how long it took (``pytest -s`` shows it)."""
    start = time.monotonic()
    proc = hosts.exec(hosts.hosts[0], argv, timeout=HARD_S, cwd=str(ROOT),
                      env=job_env(hosts, hosts.slots, report_dir))
    print(f"\n[multihost] {label}: {time.monotonic() - start:.1f}s, exit status {proc.returncode}")
    return proc


def read_reports(report_dir: Path) -> dict[str, list[dict[str, object]]]:
    by_backend: dict[str, list[dict[str, object]]] = {}
    for path in sorted(report_dir.glob("*.json")):
        row = json.loads(path.read_text())
        by_backend.setdefault(str(row["backend"]), []).append(row)
    return {b: sorted(rows, key=lambda r: int(str(r["rank"]))) for b, rows in by_backend.items()}


def check_placement(hosts: EmulatedHosts, rows: list[dict[str, object]]) -> None:
    """One report per rank; rank r on host r // slots with the right local/cross coordinates."""
    slots, n = hosts.slots, len(hosts.hosts)
    assert [r["rank"] for r in rows] == list(range(n * slots)), rows
    for r, row in enumerate(rows):
        want = {"host": hosts.hosts[r // slots], "size": n * slots, "local_rank": r % slots,
                "local_size": slots, "cross_rank": r // slots, "cross_size": n}
        assert {k: row[k] for k in want} == want, row
    assert len({row["host"] for row in rows}) == n  # distinct host names, one per host


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[EmulatedHosts]:
    with EmulatedHosts(2, slots=1) as hosts:
        yield hosts


@pytest.fixture(scope="module")
def four_hosts() -> Iterator[EmulatedHosts]:
    with EmulatedHosts(4, slots=2) as hosts:
        yield hosts


# (layout, launcher, job, backend): every launcher runs both jobs on some layout, and both
# layouts; both backends run under plait run and mpirun (the collectives job covers both in one
# launch); Horovod's Gloo controller has no MPI, so horovodrun covers the horovod backend.
# horovodrun launches cost 15-20 s more than mpirun ones (task servers on every host), so
# there are two of them.
CASES = [
    ("2x1", "plait", "collectives", None),
    ("4x2", "plait", "digits", "mpi"),
    ("2x1", "plait", "digits", "horovod"),
    ("4x2", "mpirun", "collectives", None),
    ("4x2", "horovodrun-gloo-H", "collectives", None),
    ("2x1", "horovodrun-gloo-hostfile", "digits", "horovod"),
]


@pytest.mark.parametrize(("layout", "launcher", "job", "backend"), CASES,
                         ids=["-".join(filter(None, c)) for c in CASES])
def test_job_across_hosts(request: pytest.FixtureRequest, tmp_path: Path, layout: str,
                          launcher: str, job: str, backend: str | None) -> None:
    hosts: EmulatedHosts = request.getfixturevalue("two_hosts" if layout == "2x1" else "four_hosts")
    report_dir = tmp_path / "reports"
    report_dir.mkdir()
    if job == "collectives":
        # job_ring.py: plait's ring and hierarchical allreduce across the hosts (MPI only)
        ring = [] if "gloo" in launcher else [RING_JOB]
        # across hosts tests/parallel/conftest.py runs every MPI-backend test before the
        # first Horovod one: beside Horovod's background thread Open MPI's TCP transport
        # stalls messages (README, "What does not work"; tools/mpi_threads.py)
        program = pytest_argv("job_multihost.py", COLLECTIVES_JOB, *ring, "-k", COLLECTIVES_K)
    else:
        program = [sys.executable, "-c", REPORTING_WRAPPER, DIGITS, "--backend", str(backend),
                   "--epochs", DIGITS_EPOCHS]
    before = [hosts.rx_bytes(h) for h in hosts.hosts]
    proc = launch(hosts, [*launcher_argv(hosts, launcher, backend), *program], report_dir,
                  f"{layout} {launcher} {job} {backend or ''}")
    output = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, output
    received = [a - b for a, b in zip([hosts.rx_bytes(h) for h in hosts.hosts], before,
                                      strict=True)]
    reports = read_reports(report_dir)
    if job == "collectives":
        want = ["horovod"] if "gloo" in launcher else ["horovod", "mpi"]
        assert sorted(reports) == want, (reports, output)
        assert " passed" in proc.stdout and " failed" not in proc.stdout, output
        # every host received at least what the allgathers moved between hosts
        moved = sum(int(str(rows[0]["gathered_bytes_from_other_hosts"])) for rows in reports.values())
        assert all(r >= moved for r in received), (received, moved)
    else:
        assert list(reports) == [backend], (reports, output)
        found = [line for line in proc.stdout.splitlines() if "test accuracy:" in line]
        assert len(found) == 1, output
        assert f"{len(hosts.hosts) * hosts.slots} ranks, backend {backend}" in found[0]
        assert float(found[0].split("test accuracy:")[1].split()[0]) >= 0.9, found
        assert all(r >= DIGITS_PARAM_BYTES for r in received), received
    for rows in reports.values():
        check_placement(hosts, rows)


# Every rank allreduces once, records its pid, then allreduces in a loop until the job ends.
ALLREDUCE_LOOP = """\
import os, pathlib, time
import numpy as np
import plait
comm = plait.init("mpi")
x = np.ones(1 << 16, dtype=np.float32)
comm.allreduce(x, op="sum")  # connected to every peer: the job is under way
pathlib.Path(os.environ["PLAIT_TEST_REPORT_DIR"], f"pid-{comm.rank}").write_text(str(os.getpid()))
while True:
    comm.allreduce(x, op="sum")
    time.sleep(0.02)
"""


def fail_mid_job(hosts: EmulatedHosts, tmp_path: Path, job_timeout: int | None, action: str,
                 extra_env: dict[str, str], program: str = ALLREDUCE_LOOP, backend: str = "mpi",
                 wait_s: float | None = None, options: Sequence[str] = ()
                 ) -> tuple[int | None, str, float]:
    """Start ``program`` on every host, then break it; return (status, stderr, seconds).

    ``action`` is ``"kill"`` (SIGKILL rank 1's process, on the second host) or ``"link"``
    (unplug the second host). ``job_timeout`` is plait run's ``--timeout`` (``None``: none).
    The harness waits ``wait_s`` s after the failure (default ``job_timeout`` + 30); the
    status is ``None`` if the job had to be killed by the harness (a hang). ``options`` are
    more plait run options.
    """
    report_dir = tmp_path / "reports"
    report_dir.mkdir()
    argv = [*launcher_argv(hosts, "plait", backend), sys.executable, "-c", program]
    argv[argv.index("--"):argv.index("--")] = options
    at = argv.index("--timeout")
    if job_timeout is None:
        del argv[at:at + 2]
    else:
        argv[at + 1] = str(job_timeout)
    if wait_s is None:
        wait_s = float(job_timeout or JOB_S) + 30
    env = {**job_env(hosts, hosts.slots, report_dir), **extra_env}
    pids = [report_dir / f"pid-{r}" for r in range(len(hosts.hosts) * hosts.slots)]
    status: int | None = None
    with open(tmp_path / "stderr", "w+") as err:  # a file: orphans cannot block a pipe
        proc = hosts.popen(hosts.hosts[0], argv, env=env, cwd=str(ROOT),
                           stdout=subprocess.DEVNULL, stderr=err)
        try:
            start = time.monotonic()
            while not all(p.exists() and p.read_text() for p in pids):
                assert proc.poll() is None, "the job ended before every rank started"
                assert time.monotonic() - start < HARD_S, "the ranks did not start"
                time.sleep(0.1)
            broken = time.monotonic()
            if action == "kill":
                os.kill(int(pids[1].read_text()), signal.SIGKILL)
            else:
                hosts.link_down(hosts.hosts[1])
            try:
                status = proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                status = None
            elapsed = time.monotonic() - broken
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if action == "link":
                hosts.link_up(hosts.hosts[1])
        err.seek(0)
        stderr = err.read()
    print(f"\n[multihost] {action}: job ended {elapsed:.1f}s after the failure, status {status}")
    return status, stderr, elapsed


def test_killed_rank_ends_the_job_naming_it(two_hosts: EmulatedHosts, tmp_path: Path) -> None:
    status, stderr, elapsed = fail_mid_job(two_hosts, tmp_path, job_timeout=60, action="kill",
                                           extra_env={"PLAIT_TIMEOUT": "60"})
    assert status is not None, "the job hung: the harness had to kill it"
    assert status not in (0, 124), (status, stderr)  # failed by itself, before --timeout
    # seconds, not the collective timeout: Open MPI sees the death and ends the job
    assert elapsed < KILLED_RANK_S, (elapsed, stderr)
    assert "rank 1" in stderr and two_hosts.hosts[1] in stderr and "signal 9" in stderr, stderr


# torch.distributed (gloo) and MultiWorkerMirroredStrategy from the variables plait exports.
NATIVE_FRAMEWORKS = """\
import datetime, json, os, socket
import plait
from plait.launch.context import export_framework_env
comm = plait.init("mpi")
torch_vars = export_framework_env("torch", comm)
import torch
import torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
x = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(x)
torch_rank, torch_size, torch_sum = dist.get_rank(), dist.get_world_size(), x.item()
dist.destroy_process_group()
tf_vars = export_framework_env("tensorflow", comm)
import tensorflow as tf
strategy = tf.distribute.MultiWorkerMirroredStrategy()
out = strategy.run(lambda: tf.distribute.get_replica_context().all_reduce(
    "sum", tf.constant([float(comm.rank + 1)])))
report = {"host": socket.gethostname(), "rank": comm.rank, "torch": torch_vars,
          "torch_rank": torch_rank, "torch_size": torch_size, "torch_sum": torch_sum,
          "tf_config": json.loads(tf_vars["TF_CONFIG"]), "tf_replicas": strategy.num_replicas_in_sync,
          "tf_sum": float(strategy.experimental_local_results(out)[0].numpy()[0])}
with open(os.path.join(os.environ["PLAIT_TEST_REPORT_DIR"], f"native-{comm.rank}.json"), "w") as f:
    json.dump(report, f)
"""


def test_native_torch_and_tf_strategies_from_exported_env(two_hosts: EmulatedHosts,
                                                          tmp_path: Path) -> None:
    hosts = two_hosts
    report_dir = tmp_path / "reports"
    report_dir.mkdir()
    argv = [*launcher_argv(hosts, "plait", "mpi"), sys.executable, "-c", NATIVE_FRAMEWORKS]
    proc = launch(hosts, argv, report_dir, "2x1 plait torch.distributed + MultiWorkerMirrored")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [json.loads((report_dir / f"native-{r}.json").read_text()) for r in range(2)]
    addresses = [hosts.address(h) for h in hosts.hosts]
    for rank, row in enumerate(rows):
        assert row["host"] == hosts.hosts[rank]
        assert row["torch"]["MASTER_ADDR"] == addresses[0]  # rank 0's host, on the job network
        assert row["torch"]["RANK"] == str(rank) and row["torch"]["WORLD_SIZE"] == "2"
        assert (row["torch_rank"], row["torch_size"], row["torch_sum"]) == (rank, 2, 3.0)
        workers = row["tf_config"]["cluster"]["worker"]
        assert [w.rsplit(":", 1)[0] for w in workers] == addresses
        assert row["tf_config"]["task"] == {"type": "worker", "index": rank}
        assert (row["tf_replicas"], row["tf_sum"]) == (2, 3.0)
    assert rows[0]["torch"] == rows[1]["torch"] | {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}
