"""Fault tolerance: SIGKILLed ranks, automatic restarts, dead peers, Horovod elastic on
emulated hosts, and the restart logic itself (unit tests at the end). A restart that leaves
out a host whose link went down is in test_link_down.py.

The training job is tests/parallel/job_ckpt_train.py (2-rank digits MLP, torch or Keras 3,
checkpoint every 2 steps) started by ``plait run --restarts``; a parameter-server job
(tests/parallel/job_ckpt_ps.py) is killed and resumed from the servers' snapshot. Every
job runs under ``--timeout`` and a harness timeout.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jobs import ROOT, mpi_env

import plait
from plait.checkpoint import Checkpoint
from plait.errors import ConfigError
from plait.launch.command import LaunchSpec
from plait.launch.hostfile import HostSlots, total_slots
from plait.launch.restart import RestartPolicy, RestartState, blamed_hosts, rank_hosts, run_with_restarts
from plait.testing.netns import EmulatedHosts
from plait.testing.pytest_fixtures import emulated_hosts  # noqa: F401  (fixture)

torch = pytest.importorskip("torch")
JOB = str(ROOT / "tests" / "parallel" / "job_ckpt_train.py")
STEPS = 10
RUNS = 4  # each run: its own seeded kill schedule; 1 kill (2 in every third run)
RESTART_LINE = re.compile(r"restart (\d+)/\d+ in")


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


def launch(tmp: Path, name: str, job: str, np: int, env: dict[str, str], restarts: int,
           on_restart: Callable[[int], None] | None = None) -> tuple[int, str, str]:
    """Run ``job`` on ``np`` ranks under ``plait run --restarts``; return (status, stdout, stderr).

    ``on_restart(k)`` is called as soon as ``plait run`` announces restart ``k``: the killed
    attempt has ended and the next one has not started (back-off), so the checkpoint
    directory is as the killed attempt left it.
    """
    argv = [sys.executable, "-m", "plait.launch.run", "-np", str(np), "--oversubscribe",
            "--timeout", "90", "--restarts", str(restarts), "--restart-backoff", "0.1", "--",
            sys.executable, job]
    with open(tmp / f"{name}.out", "w+") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=mpi_env(env), stdout=out,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        guard = threading.Timer(90 * (restarts + 1) + 60, os.killpg, (proc.pid, signal.SIGKILL))
        guard.start()
        lines = []
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append(line)
                found = RESTART_LINE.search(line)
                if found and on_restart is not None:
                    on_restart(int(found.group(1)))
            status = proc.wait()
        finally:
            guard.cancel()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0)
        return status, out.read(), "".join(lines)


def train(tmp: Path, name: str, data: str, kill: str, restarts: int,
          on_restart: Callable[[int], None] | None = None,
          more: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The 2-rank digits job (``more``: extra environment, e.g. FT_FRAMEWORK=keras)."""
    env = {"FT_DATA": data, "FT_DIR": str(tmp / name), "FT_OUT": str(tmp / f"{name}.out.npz"),
           "FT_STEPS": str(STEPS), "FT_EVERY": "2", "FT_KILL": kill, **(more or {})}
    return launch(tmp, name, JOB, 2, env, restarts, on_restart)


def weights(path: Path) -> list[np.ndarray]:
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def model_and_optimizer(framework: str = "torch") -> tuple[object, object]:
    """What the job trains, for loading its checkpoints here (tests/parallel/job_ckpt_train.py)."""
    if framework == "keras":
        import keras

        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dropout(0.1, seed=7), keras.layers.Dense(10)])
        return model, keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def schedule(rng: random.Random, kills: int) -> list[tuple[int, int, bool]]:
    """Kill points (rank, step, during a save) for attempts 0..kills-1, at increasing steps
    at least 2 apart (so each attempt gets past the checkpoint it resumed from)."""
    while True:
        steps = sorted(rng.sample(range(1, STEPS), kills))
        if all(b - a >= 2 for a, b in zip(steps, steps[1:], strict=False)):
            break
    return [(rng.randrange(2), s, rng.random() < 0.4) for s in steps]


def kill_spec(points: list[tuple[int, int, bool]]) -> str:
    """The ``FT_KILL`` value of tests/parallel/job_ckpt_train.py."""
    return ";".join(f"{a}:{r}:{s}" + (":w" if w else "") for a, (r, s, w) in enumerate(points))


def saved_range(step: int, during_save: bool) -> tuple[int, int]:
    """Lowest and highest step the latest checkpoint (every 2 steps) can hold after a kill.

    Killed before ``step``: steps 0..step-1 are done on every rank, and rank 0 wrote the
    checkpoints due before the last allreduce; the one after step-1 may be cut short by the
    job's end. Killed during the save after ``step``: the same with one more step done.
    """
    done = step + 1 if during_save else step
    return 2 * ((done - 1) // 2), done


def sigkill_runs(tmp_path: Path, digits: str, framework: str, runs: int) -> int:
    """``runs`` runs of the digits job, each SIGKILLing a random rank at random steps (some
    during a checkpoint write, two kills in every third run); the latest checkpoint loads
    after every killed attempt; the final weights equal the uninterrupted run's bit for bit.
    Reproduce a failure with PLAIT_FT_SEED. Returns the number of kills."""
    more = {"FT_FRAMEWORK": framework}
    status, _, err = train(tmp_path, "ref", digits, "", 0, more=more)
    assert status == 0, err[-3000:]
    expected = weights(tmp_path / "ref.out.npz")
    seed = int(os.environ.get("PLAIT_FT_SEED", str(random.SystemRandom().randrange(10**6))))
    print(f"\n[fault tolerance] {framework} PLAIT_FT_SEED={seed}")
    killed = 0
    for run in range(runs):
        points = schedule(random.Random(f"{seed}-{run}"), 2 if run % 3 == 2 else 1)
        if run == 1 and not any(w for _, _, w in points):  # at least one kill during a save
            points = [(r, s, True) for r, s, _ in points]
        kill = kill_spec(points)
        name = f"run{run}"
        print(f"[fault tolerance] {name}: FT_KILL={kill}")
        loaded: list[int] = []

        def latest_loads(restart: int, name: str = name, points: list[tuple[int, int, bool]] = points,
                         loaded: list[int] = loaded, kill: str = kill) -> None:
            # restart k follows the kill of attempt k-1
            _, step, during_save = points[restart - 1]
            ckpt = Checkpoint(tmp_path / name)
            model, opt = model_and_optimizer(framework)
            got = ckpt.restore(model, opt)  # raises CheckpointError if the latest is broken
            entry = ckpt.latest()
            assert got == (entry.step if entry is not None else 0), (seed, kill, restart)
            low, high = saved_range(step, during_save)
            assert got % 2 == 0 and low <= got <= high, (seed, kill, restart, got, (low, high))
            loaded.append(got)

        began = time.monotonic()
        status, out, err = train(tmp_path, name, digits, kill, len(points), latest_loads, more)
        print(f"[fault tolerance] {name}: {len(points) + 1} attempts in {time.monotonic() - began:.0f}s")
        context = f"PLAIT_FT_SEED={seed} FT_KILL={kill}\n{err[-3000:]}\n{out[-1500:]}"
        assert status == 0, context
        assert len(RESTART_LINE.findall(err)) == len(points) == len(loaded), context
        assert "exited on signal 9" in err, context
        killed += len(points)
        resumed = [int(m) for m in re.findall(r"FT rank=0 attempt=\d+ resumed=(\d+)", out)]
        # every relaunch resumed from exactly the checkpoint the test loaded after the kill
        assert resumed == [0, *loaded], context
        got = weights(tmp_path / f"{name}.out.npz")
        assert len(got) == len(expected), context
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert np.array_equal(a, b), f"weight {i} differs; {context}"
        model, opt = model_and_optimizer(framework)
        assert Checkpoint(tmp_path / name).restore(model, opt) == STEPS, context
    return killed


@pytest.mark.timeout(1200)
def test_random_sigkills_resume_to_bitwise_equal_weights(tmp_path: Path, digits: str) -> None:
    """torch: 4 runs, 5 kills (two in the third run), a new seed each time (PLAIT_FT_SEED)."""
    assert sigkill_runs(tmp_path, digits, "torch", RUNS) >= 5


@pytest.mark.timeout(900)
def test_random_sigkills_keras_resume_to_bitwise_equal_weights(tmp_path: Path, digits: str) -> None:
    """Keras 3 (op determinism on, dropout drawn from Keras seed generators): 2 runs."""
    assert sigkill_runs(tmp_path, digits, "keras", 2) >= 2


PS_JOB = str(ROOT / "tests" / "parallel" / "job_ckpt_ps.py")


@pytest.mark.timeout(400)
def test_killed_parameter_server_job_resumes_from_the_servers_snapshot(tmp_path: Path) -> None:
    """1 server + 2 workers, snapshots every 5 steps; worker rank 2 is slower (worker 1 is
    held at each snapshot step) and is SIGKILLed before its step 13. The latest snapshot
    is step 10 and holds exactly 10 exact updates of each worker; the relaunch resumes
    there and ends with exactly 40 of each: nothing lost, nothing applied twice."""
    sys.path.insert(0, str(ROOT / "tests" / "parallel"))
    try:
        from job_ckpt_ps import expected
    finally:
        sys.path.pop(0)
    directory = tmp_path / "ps"
    seen: list[int] = []

    def snapshot_is_exact(restart: int) -> None:
        model = torch.nn.Linear(8, 1, bias=False)
        seen.append(Checkpoint(directory).restore(model))
        assert np.array_equal(model.weight.detach().numpy().reshape(-1), expected(seen[-1])), seen

    env = {"FT_DIR": str(directory), "FT_STEPS": "40", "FT_EVERY": "5", "FT_KILL": "0:2:13",
           "FT_SLEEP": "0.05", "PLAIT_TIMEOUT": "60"}
    status, out, err = launch(tmp_path, "ps", PS_JOB, 3, env, 1, snapshot_is_exact)
    context = f"{err[-3000:]}\n{out[-2000:]}"
    assert status == 0, context
    assert "exited on signal 9" in err and seen == [10], context
    assert sorted(re.findall(r"PS rank=(\d) attempt=1 resumed=(\d+)", out)) == [
        ("0", "10"), ("1", "10"), ("2", "10")], context
    assert "PS done steps=40 exact=True" in out, context


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


PENDING = """
import sys
import torch
import plait.torch as hvd
hvd.init()
kept = hvd.allreduce_async(torch.ones(17, 17, 17))  # Horovod's test_torch.py leaves one so
if sys.argv[1] == "drop":
    del kept
print(f"rank {hvd.rank()} leaves", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("handle", ["keep", "drop"])
def test_collectives_never_waited_for_do_not_crash_the_exit(handle: str) -> None:
    """Ranks that end with an asynchronous collective still in flight (its handle kept or
    dropped, never waited for) exit cleanly on the MPI backend: it completes before
    MPI_Finalize (Open MPI crashed under it: SIGSEGV in 4 of 4 runs, or a corrupted heap)."""
    proc = plait_run(["-np", "2", "--oversubscribe", "--timeout", "90", "--",
                      sys.executable, "-c", PENDING, handle], {"PLAIT_BACKEND": "mpi"}, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("leaves") == 2 and "signal" not in proc.stderr, proc.stderr[-3000:]


EARLY = """
import sys
import numpy as np
import plait
comm = plait.init("mpi", timeout=200)
for i in range(10**6):
    if comm.rank == 1 and i == 20:
        sys.exit(0)  # ends normally, having called fewer collectives than the others
    if sys.argv[1] == "recv" and i == 20:
        comm.recv(np.zeros(4), 1)  # rank 0: a message rank 1 never sends
    comm.allreduce(np.ones(4), name="x")
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("wait", "what"), [("collective", "allreduce"),
                                            ("recv", "a message from rank 1")])
def test_peer_that_ends_its_program_ends_the_others_wait(wait: str, what: str) -> None:
    """A rank that exits normally says goodbye: the other rank's collective, or its receive
    from that rank, raises MismatchError naming it within seconds (Horovod: "after one of
    the ranks finished execution"), not after the 200 s timeout; the job ends non-zero."""
    proc = plait_run(["-np", "2", "--oversubscribe", "--timeout", "150", "--",
                      sys.executable, "-c", EARLY, wait], {}, timeout=200)
    assert proc.returncode not in (0, 124), proc.stderr[-3000:]
    assert "MismatchError" in proc.stderr, proc.stderr[-3000:]
    assert f"rank 1 (host {socket.gethostname()}) ended its program while this rank waits in " \
           f"{what}" in proc.stderr, proc.stderr[-3000:]


Factory = Callable[..., EmulatedHosts]


def horovod_elastic(tmp_path: Path, job: str, hosts_text: str, env: dict[str, str],
                    timeout: float, hosts: EmulatedHosts | None = None, min_np: int = 2,
                    np: int = 2) -> str:
    """Run ``job`` under ``horovodrun`` in elastic mode (``np`` workers at the start, ``min_np``
    to 3) with a discovery script printing HVD_HOSTS, which the job rewrites; return stdout
    and stderr. Asserts exit 0."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts_text)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    argv = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(np), "--min-np", str(min_np),
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
    return f"{proc.stdout}\n{proc.stderr}"


HOROVODRUN = pytest.mark.skipif(not (Path(sys.executable).parent / "horovodrun").exists(),
                                reason="horovodrun is not installed in this environment")


@HOROVODRUN
@pytest.mark.timeout(400)
def test_horovod_elastic_torch_adds_a_host_and_survives_a_killed_worker(
        tmp_path: Path, digits: str, emulated_hosts: Factory) -> None:  # noqa: F811
    """``import plait.torch as hvd`` elastic on 3 emulated hosts: the discovery script
    lists 1 host, then all three (1 -> 3 workers); at step 8 the worker on the first host
    (horovodrun's) is SIGKILLed while the others are in that step's gradient allreduces, and the two
    others restore the last commit and finish (3 -> 2; Horovod leaves the dead worker's
    host out). Removing a host from discovery: the Keras test below.

    SGD with momentum: the first worker's optimizer has state when the others join and
    theirs has none, so only theirs take Horovod's state-initialising step in the sync
    (local: it hung in plait's synchronize); and the first worker's optimizer was made
    alone, where the others' were made in a group (it must decide to check its buckets
    once as they do: it did not, and they hung in the split of their unchecked copy).

    A survivor may wait out Gloo's timeout in a send to the other survivor, which already
    left that exchange (Gloo's `unbound_buffer` "Timed out waiting ... for send operation");
    real Horovod with the same script did too (1 run of 4; plait 3 of 4, each 30 s longer).
    ``HOROVOD_GLOO_TIMEOUT_SECONDS=10`` keeps the test short."""
    hosts = emulated_hosts(3, slots=1)
    names = hosts.hosts
    # the first worker is not on horovodrun's host (alone there, Horovod looks for 127.0.0.1)
    out = horovod_elastic(tmp_path, "job_ckpt_hvd_elastic.py", f"{names[1]}:1\n",
                          {"FT_DATA": digits, "HVD_ADD": "3", "HVD_REMOVE": "99", "HVD_STEPS": "14",
                           "HVD_GROWN": "".join(f"{names[i]}:1\n" for i in (1, 0, 2)),
                           "HVD_KILL": f"8:{names[0]}", "HVD_MOMENTUM": "0.9",
                           "HOROVOD_GLOO_TIMEOUT_SECONDS": "10"},
                          timeout=360, hosts=hosts, min_np=1, np=1)
    check_grown_then_killed(out, 14, [names[0], names[2]], [1, 3, 2])


def check_grown_then_killed(out: str, steps: int, added: list[str], sizes: list[int]) -> None:
    """The job's sizes were ``sizes`` (it grew to 3, then a worker was killed), equal
    replicas; the plait state object (a residual memory counting steps) was committed and
    synced: every rank, the one that joined late included, counted all ``steps``; the worker
    that joined as rank 2 ran on one of the ``added`` hosts."""
    done = re.search(r"HVD done sizes=\[(.*?)\] replicas_equal=(\w+) residual_steps=\[(.*?)\]", out)
    assert done is not None, out[-3000:]
    assert [int(s) for s in done.group(1).split(",")] == sizes, out[-3000:]
    assert done.group(2) == "True", out[-3000:]
    assert [float(s) for s in done.group(3).split(",")] == [float(steps)] * 2, out[-3000:]
    joined = re.search(r"HVD joined rank=2 step=(\d+) seen=([\d.]+) host=(\S+)", out)
    assert joined is not None and int(joined.group(1)) == float(joined.group(2)) > 1, out[-3000:]
    assert joined.group(3) in added, out[-3000:]
    # a step() after the reset is not taken for a second synchronize (the failed one did not count)
    assert "without optimizer.skip_synchronize()" not in out, out[-3000:]


@HOROVODRUN
@pytest.mark.timeout(400)
def test_horovod_elastic_tf_loop_traced_before_a_host_joins_survives_a_killed_worker(
        tmp_path: Path, digits: str, emulated_hosts: Factory) -> None:  # noqa: F811
    """``import plait.tensorflow as hvd``, Horovod's ``tensorflow2_mnist_elastic.py`` pattern:
    a ``tf.function`` step with ``DistributedGradientTape`` traced by the first worker alone;
    two hosts' workers join after step 3 and trace it (their graph ops must meet the first
    worker's without a check at trace time: its graph, traced at size 1, must reduce too, as
    Horovod's does; it did not, and the others waited for it until the timeout), and at step
    8 the worker on the first host is SIGKILLed (1 -> 3 -> 2 workers)."""
    hosts = emulated_hosts(3, slots=1)
    names = hosts.hosts
    out = horovod_elastic(tmp_path, "job_ckpt_hvd_elastic_tf.py", f"{names[1]}:1\n",
                          {"FT_DATA": digits, "HVD_ADD": "3", "HVD_REMOVE": "99", "HVD_STEPS": "12",
                           "HVD_GROWN": "".join(f"{names[i]}:1\n" for i in (1, 0, 2)),
                           "HVD_KILL": f"8:{names[0]}", "HOROVOD_GLOO_TIMEOUT_SECONDS": "10"},
                          timeout=360, hosts=hosts, min_np=1, np=1)
    check_grown_then_killed(out, 12, [names[0], names[2]], [1, 3, 2])


@HOROVODRUN
@pytest.mark.timeout(400)
def test_horovod_elastic_worker_with_other_versions_leaves_and_the_others_go_on(
        tmp_path: Path, digits: str, emulated_hosts: Factory) -> None:  # noqa: F811
    """A third host joins whose plait reports another version: its worker leaves with an
    error naming both versions, the two others reset without it and finish, in step."""
    hosts = emulated_hosts(3, slots=1)
    names = hosts.hosts
    two = f"{names[0]}:1\n{names[1]}:1\n"
    out = horovod_elastic(tmp_path, "job_ckpt_hvd_elastic.py", two,
                          {"FT_DATA": digits, "HVD_ADD": "3", "HVD_REMOVE": "99", "HVD_STEPS": "8",
                           "HVD_GROWN": f"{two}{names[2]}:1\n", "HVD_ODD_HOST": names[2]},
                          timeout=360, hosts=hosts)
    done = re.search(r"HVD done sizes=\[(.*?)\] replicas_equal=(\w+) residual_steps=\[(.*?)\]", out)
    assert done is not None, out[-3000:]
    assert done.group(1) == "2" and done.group(2) == "True", out[-3000:]
    assert [float(s) for s in done.group(3).split(",")] == [8.0, 8.0], out[-3000:]
    assert re.search(rf"ConfigError: this worker \(rank \d, host {names[2]}\) runs plait 0\.0\.0\+other"
                     rf".* the elastic job runs plait {re.escape(plait.__version__)}", out), out[-3000:]


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
    script lists 2 hosts, then the third, then 2 again. The model is compiled with a metric,
    as Horovod's elastic Keras test's is: the worker that joins traces the train step twice
    (its first trace builds the metric's variables), the others once; its graph ops must
    still get their names (they did not, and every worker waited until the timeout)."""
    hosts = emulated_hosts(3, slots=1)
    names = hosts.hosts
    two = f"{names[0]}:1\n{names[1]}:1\n"
    out = horovod_elastic(tmp_path, "job_ckpt_hvd_elastic_keras.py", two,
                          {"FT_DATA": digits, "HVD_ADD": "5", "HVD_REMOVE": "12", "HVD_EPOCHS": "5",
                           "HVD_GROWN": f"{two}{names[2]}:1\n"},
                          timeout=360, hosts=hosts)
    check_keras_elastic(out)


# -- the restart logic of ``plait run --restarts`` (no processes) ------------------------------
def test_restart_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(restarts=5, backoff=0.5, backoff_max=3.0)
    assert [policy.delay(a) for a in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert RestartPolicy(restarts=1, backoff=0.0).delay(4) == 0.0


@pytest.mark.parametrize(("field", "value"), [
    ("restarts", -1), ("restarts", True), ("restarts", 1.5), ("backoff", -1.0), ("backoff", 31.0),
    ("exclude_after", 0), ("probe_timeout", 0.0)])
def test_restart_policy_rejects_bad_settings(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"invalid {field}="):
        RestartPolicy(**{field: value})  # type: ignore[arg-type]


def test_rank_hosts_fills_slots_host_by_host_and_wraps() -> None:
    hosts = [HostSlots("a", 2), HostSlots("b", 1)]
    assert rank_hosts(hosts, 3) == ["a", "a", "b"]
    assert rank_hosts(hosts, 5) == ["a", "a", "b", "a", "a"]  # oversubscribed
    assert rank_hosts([], 2) == []


def test_blamed_hosts_reads_open_mpi_and_plait_reports() -> None:
    ranks = ["h0", "h0", "h1", "h2"]
    signal_line = ("mpirun noticed that process rank 2 with PID 4242 on node h1 exited on "
                   "signal 9 (Killed).\n")
    assert blamed_hosts(signal_line, ranks) == ["h1"]
    daemon = "ORTE has lost communication with a remote daemon.\n  Remote daemon: [[5,0],2] on node h2\n"
    assert blamed_hosts(daemon, ranks) == ["h2"]
    assert blamed_hosts("MPI_ABORT was invoked on rank 3 in communicator MPI_COMM_WORLD\n", ranks) == ["h2"]
    assert blamed_hosts("  Process name: [[1234,1],1]\n  Exit code: 1\n", ranks) == ["h0"]
    assert blamed_hosts("plait: rank 0 on host h0 failed: CollectiveTimeoutError\n", ranks) == ["h0"]
    # each host once; ranks outside the job and unrelated text blame nobody
    both = signal_line + signal_line + "MPI_ABORT was invoked on rank 0 in communicator x\n"
    assert blamed_hosts(both, ranks) == ["h1", "h0"]
    assert blamed_hosts("MPI_ABORT was invoked on rank 9 in communicator x\n", ranks) == []
    assert blamed_hosts("Traceback (most recent call last):\nValueError: boom\n", ranks) == []


def test_a_host_blamed_repeatedly_is_excluded_and_an_unreachable_one_at_once() -> None:
    state = RestartState([HostSlots("a", 2), HostSlots("b", 2), HostSlots("c", 2)])
    assert state.blame(["b"], exclude_after=2) == []  # once: kept
    assert [h.host for h in state.hosts] == ["a", "b", "c"]
    assert state.blame(["b", "a"], exclude_after=2) == ["b"]  # twice: out; a once: kept
    assert [h.host for h in state.hosts] == ["a", "c"]
    assert state.failures == {"a": 1, "b": 2}
    assert state.excluded == {"b": "its ranks failed 2 times"}
    assert state.blame(["b"], exclude_after=2) == []  # already out: not excluded again
    assert state.unreachable({"c": "no answer within 8s"}) == ["c"]
    assert state.unreachable({"c": "no answer within 8s"}) == []
    assert [h.host for h in state.hosts] == ["a"]
    assert "did not answer a probe job (no answer within 8s)" in state.excluded["c"]
    assert total_slots(state.hosts) == 2


def test_run_with_restarts_relaunches_until_success_or_the_restarts_run_out(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A local job (no hosts: no probes): each attempt gets PLAIT_RESTART = its number."""
    spec = LaunchSpec(command=("python", "train.py"), np=2, oversubscribe=True)
    attempts: list[str] = []

    def failing_twice(cmd: Any, timeout: float | None, capture: list[str], signals: list[int]) -> int:
        attempts.append(cmd.env["PLAIT_RESTART"])
        return 1 if len(attempts) <= 2 else 0

    policy = RestartPolicy(restarts=3, backoff=0.0)
    assert run_with_restarts(spec, policy, {}, True, (), failing_twice) == 0
    assert attempts == ["0", "1", "2"]
    err = capsys.readouterr().err
    assert "restart 1/3 in 0s with 2 ranks" in err and "restart 2/3 in 0s" in err
    assert "job finished after 2 restart(s) with 2 ranks on hosts localhost" in err

    attempts.clear()

    def always_failing(cmd: Any, timeout: float | None, capture: list[str], signals: list[int]) -> int:
        attempts.append(cmd.env["PLAIT_RESTART"])
        return 7

    assert run_with_restarts(spec, RestartPolicy(restarts=1, backoff=0.0), {}, True, (),
                             always_failing) == 7
    assert attempts == ["0", "1"]
    assert "no restarts left (1 used)" in capsys.readouterr().err

    def interrupted(cmd: Any, timeout: float | None, capture: list[str], signals: list[int]) -> int:
        signals.append(2)  # the user's Ctrl-C was forwarded to the job: never restart
        return 130

    assert run_with_restarts(spec, policy, {}, True, (), interrupted) == 130
