"""Fault tolerance end to end: SIGKILLed ranks, automatic restarts, elastic restart, dead peers.

The training job is tests/parallel/job_ckpt_train.py (2-rank digits MLP, checkpoint every
2 steps) started by ``plait run --restarts``. Every job runs under ``--timeout`` and a
harness timeout.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from jobs import ROOT, mpi_env

from plait.checkpoint import Checkpoint
from plait.testing.netns import EmulatedHosts, unavailable_reason
from plait.testing.pytest_fixtures import emulated_hosts  # noqa: F401  (fixture)

torch = pytest.importorskip("torch")
JOB = str(ROOT / "tests" / "parallel" / "job_ckpt_train.py")
STEPS = 14
KILLS_PER_RUN = 5
RUNS = 2  # 2 runs x 5 kills = 10 killed attempts (each attempt pays a torch import per rank)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> str:
    import numpy as np
    from sklearn.datasets import load_digits

    d = load_digits()
    path = tmp_path_factory.mktemp("data") / "digits.npz"
    np.savez(path, x=d.data, y=d.target)
    return str(path)


def plait_run(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "plait.launch.run", *args]
    return subprocess.run(argv, cwd=ROOT, env=mpi_env(env), capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


def train(tmp: Path, name: str, data: str, kill: str, restarts: int) -> subprocess.CompletedProcess[str]:
    env = {"FT_DATA": data, "FT_DIR": str(tmp / name), "FT_OUT": str(tmp / f"{name}.pt"),
           "FT_STEPS": str(STEPS), "FT_EVERY": "2", "FT_KILL": kill}
    args = ["-np", "2", "--oversubscribe", "--timeout", "90", "--restarts", str(restarts),
            "--restart-backoff", "0.1", "--", sys.executable, JOB]
    return plait_run(args, env, timeout=90 * (restarts + 1) + 60)


def weights(path: Path) -> dict[str, object]:
    return torch.load(path, weights_only=True)


def model_and_optimizer() -> tuple[object, object]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def schedule(rng: random.Random) -> str:
    """Kill points for attempts 0..K-1: increasing steps, random rank, some during a save."""
    while True:
        steps = sorted(rng.sample(range(1, STEPS), KILLS_PER_RUN))
        if all(b - a >= 2 for a, b in zip(steps, steps[1:], strict=False)):
            break
    return ";".join(f"{a}:{rng.randrange(2)}:{s}" + (":w" if rng.random() < 0.4 else "")
                    for a, s in enumerate(steps))


@pytest.mark.timeout(900)
def test_random_sigkills_resume_to_bitwise_equal_weights(tmp_path: Path, digits: str) -> None:
    ref = train(tmp_path, "ref", digits, "", 0)
    assert ref.returncode == 0, ref.stderr[-3000:]
    expected = weights(tmp_path / "ref.pt")
    seed = int(os.environ.get("PLAIT_FT_SEED", str(random.SystemRandom().randrange(10**6))))
    rng = random.Random(seed)
    killed = 0
    for run in range(RUNS):
        kill = schedule(rng)
        name = f"run{run}"
        proc = train(tmp_path, name, digits, kill, KILLS_PER_RUN + 1)
        context = f"seed={seed} kill={kill}\n{proc.stderr[-3000:]}"
        assert proc.returncode == 0, context
        restarts = re.findall(r"restart (\d+)/\d+ in", proc.stderr)
        assert len(restarts) == KILLS_PER_RUN, context
        assert "exited on signal 9" in proc.stderr, context
        killed += len(restarts)
        resumed = [int(m) for m in re.findall(r"FT rank=0 attempt=\d+ resumed=(\d+)", proc.stdout)]
        assert len(resumed) == KILLS_PER_RUN + 1 and all(r % 2 == 0 for r in resumed), context
        got = weights(tmp_path / f"{name}.pt")
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(got[key], value), f"{key} differs; {context}"
        # the latest checkpoint of the directory loads, and holds the final step
        model, opt = model_and_optimizer()
        assert Checkpoint(tmp_path / name).restore(model, opt) == STEPS
    assert killed >= 10


DEAD = """
import os, signal, sys, time
import numpy as np
import plait
comm = plait.init("mpi", timeout=3)
for i in range(10**6):
    if comm.rank == 1 and i == 20:
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # alive but stuck: the others must time out and abort the job
    comm.allreduce(np.ones(4), name="x")
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["kill", "stuck"])
def test_dead_peer_ends_the_job(how: str) -> None:
    proc = plait_run(["-np", "2", "--oversubscribe", "--timeout", "100", "--",
                      sys.executable, "-c", DEAD, how], {}, timeout=160)
    assert proc.returncode not in (0, 124), proc.stderr[-3000:]
    if how == "kill":
        assert "exited on signal 9" in proc.stderr, proc.stderr[-3000:]
    else:
        assert "waited 3s for the other ranks to reach" in proc.stderr, proc.stderr[-3000:]
        assert "aborts the job (MPI_Abort)" in proc.stderr, proc.stderr[-3000:]


Factory = Callable[..., EmulatedHosts]


@pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))
@pytest.mark.timeout(420)
def test_elastic_restart_excludes_a_host_whose_link_went_down(
        emulated_hosts: Factory, tmp_path: Path, digits: str) -> None:  # noqa: F811
    hosts = emulated_hosts(3)
    env = mpi_env({"FT_DATA": digits, "FT_DIR": str(tmp_path / "ck"), "FT_OUT": str(tmp_path / "w.pt"),
                   "FT_STEPS": "40", "FT_EVERY": "2", "FT_BATCH": "96", "FT_BASE_SIZE": "3",
                   "FT_SLEEP": "0.2", "PLAIT_TIMEOUT": "5"})
    env["PATH"] = f"{hosts.bin_dir}:{env['PATH']}"
    argv = [sys.executable, "-m", "plait.launch.run", "--timeout", "120", "--restarts", "2",
            "--restart-backoff", "0.5", "--probe-timeout", "8", "--hostfile", hosts.hostfile,
            *hosts.mpirun_args(), *[a for k in env if k.startswith("FT_") for a in ("-x", k)],
            "--", sys.executable, JOB]
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
        proc = hosts.popen(hosts.hosts[0], argv, env=env, stdout=out, stderr=err)
        try:
            deadline = time.monotonic() + 240
            ckpt = Checkpoint(tmp_path / "ck")
            while proc.poll() is None and time.monotonic() < deadline:
                entry = ckpt.latest() if (tmp_path / "ck").exists() else None
                if entry is not None and entry.step >= 4:
                    break
                time.sleep(0.2)
            assert proc.poll() is None, "the job ended before the link went down"
            hosts.link_down(hosts.hosts[2])
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    context = f"{stderr[-4000:]}\n{stdout[-2000:]}"
    assert proc.returncode == 0, context
    assert f"excluding host {hosts.hosts[2]}" in stderr, context
    used = ",".join(hosts.hosts[:2])
    assert f"with 2 ranks on hosts {used}" in stderr, context
    assert "FT done size=2" in stdout, context
    resumed = re.findall(r"FT rank=\d attempt=1 resumed=(\d+) size=2", stdout)
    assert len(resumed) == 2, context
    assert resumed and int(resumed[0]) >= 4, context


def horovod_elastic(tmp_path: Path, job: str, hosts_text: str, env: dict[str, str],
                    timeout: float, hosts: EmulatedHosts | None = None) -> str:
    """Run ``job`` under ``horovodrun`` in elastic mode (2 to 3 workers) with a discovery
    script printing HVD_HOSTS, which the job rewrites; return stdout. Asserts exit 0."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts_text)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    argv = [str(Path(sys.executable).parent / "horovodrun"), "-np", "2", "--min-np", "2",
            "--max-np", "3", "--host-discovery-script", str(discover), "--gloo",
            "--network-interface", "lo" if hosts is None else "eth0", "--start-timeout", "120",
            sys.executable, str(ROOT / "tests" / "parallel" / job)]
    env = {"HVD_HOSTS": str(hosts_file), **env}
    if hosts is None:
        proc = subprocess.run(argv, cwd=ROOT, env=mpi_env(env), capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    else:
        proc = hosts.exec(hosts.hosts[0], argv, timeout=timeout, cwd=str(ROOT),
                          env=hosts.env(mpi_env(env)))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


HOROVODRUN = pytest.mark.skipif(not (Path(sys.executable).parent / "horovodrun").exists(),
                                reason="horovodrun is not installed in this environment")


@HOROVODRUN
@pytest.mark.timeout(400)
def test_horovod_elastic_torch_adds_and_removes_a_worker(tmp_path: Path, digits: str) -> None:
    """``import plait.torch as hvd`` elastic on localhost slots: 2 -> 3 -> 2 workers."""
    out = horovod_elastic(tmp_path, "job_ckpt_hvd_elastic.py", "localhost:2\n",
                          {"FT_DATA": digits, "HVD_ADD": "3", "HVD_REMOVE": "8", "HVD_STEPS": "14"},
                          timeout=360)
    done = re.search(r"HVD done sizes=\[(.*?)\] replicas_equal=(\w+) residual_steps=\[(.*?)\]", out)
    assert done is not None, out[-3000:]
    assert [int(s) for s in done.group(1).split(",")] == [2, 3, 2], out[-3000:]
    assert done.group(2) == "True", out[-3000:]
    # the plait state object (a residual memory counting steps) was committed and synced:
    # every rank, the one that joined late included, counted all 14 steps
    assert [float(s) for s in done.group(3).split(",")] == [14.0, 14.0], out[-3000:]
    joined = re.search(r"HVD joined rank=2 step=(\d+) seen=([\d.]+)", out)
    assert joined is not None and int(joined.group(1)) == float(joined.group(2)) > 1, out[-3000:]


def check_keras_elastic(out: str) -> None:
    """2 -> 3 -> 2 workers; replicas equal; state and plait object counted every batch."""
    done = re.search(r"HVD done sizes=\[(.*?)\] replicas_equal=(\w+) accuracy=([\d.]+) "
                     r"batches=(\d+) residual_batches=\[(.*?)\]", out)
    assert done is not None, out[-3000:]
    assert [int(s) for s in done.group(1).split(",")] == [2, 3, 2], out[-3000:]
    assert done.group(2) == "True", out[-3000:]
    assert float(done.group(3)) > 0.8, out[-3000:]
    batches = int(done.group(4))
    assert batches >= 20 and [float(s) for s in done.group(5).split(",")] == [batches] * 2, out[-3000:]
    joined = re.search(r"HVD joined rank=2 batches=(\d+)", out)
    assert joined is not None and int(joined.group(1)) >= 5, out[-3000:]


@HOROVODRUN
@pytest.mark.timeout(400)
def test_horovod_elastic_keras_fit_adds_and_removes_a_host(
        tmp_path: Path, digits: str, emulated_hosts: Callable[..., EmulatedHosts]) -> None:  # noqa: F811
    """``import plait.keras as hvd`` elastic ``model.fit`` on 3 emulated hosts: the discovery
    script lists 2 hosts, then the third, then 2 again."""
    hosts = emulated_hosts(3, slots=1)
    names = hosts.hosts
    two = f"{names[0]}:1\n{names[1]}:1\n"
    out = horovod_elastic(tmp_path, "job_ckpt_hvd_elastic_keras.py", two,
                          {"FT_DATA": digits, "HVD_ADD": "5", "HVD_REMOVE": "12", "HVD_EPOCHS": "5",
                           "HVD_GROWN": f"{two}{names[2]}:1\n"},
                          timeout=360, hosts=hosts)
    check_keras_elastic(out)
