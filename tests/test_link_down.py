"""Every wait bounded across emulated hosts: a lost link or a stopped rank ends the job by itself.

Each case is a 2-rank job (one rank on each of two emulated hosts, see
:class:`plait.testing.netns.EmulatedHosts`) that trains until it is broken: the second
host's link goes down, or its rank gets SIGSTOP. The job runs with no job-level time
limit (no ``plait run --timeout``, no ``mpirun --timeout``); it must end by itself within
the collective timeout + 30 s, with a non-zero status and the survivor's
``CollectiveTimeoutError`` naming what it waited for (and, where plait knows it, the host
that did not answer).

Workloads: a synchronous allreduce loop; torch data parallelism through
``plait.torch.DistributedOptimizer`` (fused asynchronous buckets); Keras ``model.fit``
with ``plait.keras.DistributedOptimizer`` (collectives inside the ``tf.function``); a
2-stage torch pipeline (send/recv); a parameter-server step (a server and a worker).
Launchers: ``plait run``, raw ``mpirun`` with the keepalive flags the README tells users
to pass, and ``horovodrun --gloo``.

Cost: the cases of one launcher run at once, each on its own pair of fresh hosts (one set
of namespaces per launcher), so one launcher group costs about one startup plus one
timeout-and-teardown. Every job starts with a generous ``PLAIT_TIMEOUT`` (imports and
tracing on 2 busy cores may be far apart) and lowers its communicator's timeout to
``PLAIT_TEST_TIMEOUT`` after a barrier, once every rank is set up (``ready`` below).

``plait run --restarts``: a 3-host resumable job loses a host's link, is restarted by
``plait run`` on the two hosts that still answer, resumes from its last checkpoint and
ends with exactly the weights of an uninterrupted 2-host run from that checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest
from jobs import ROOT

from plait.checkpoint.atomic import read_manifest
from plait.launch.run import KEEPALIVE_MCA
from plait.testing.netns import EmulatedHosts

pytestmark = pytest.mark.timeout(600)

#: The communicator timeout once training is under way (the job's PLAIT_TIMEOUT is START_TIMEOUT_S).
TIMEOUT_S = 3
START_TIMEOUT_S = 120
#: A broken job must end by itself within this many seconds (the issue's bound).
LIMIT_S = TIMEOUT_S + 30
START_S = 300  # the harness gives up on jobs that are not training after this
GLOO_TIMEOUT_S = 20
VENV_BIN = str(Path(sys.executable).parent)
#: What the README tells raw mpirun users to pass (the same as plait run's defaults).
KEEPALIVE_FLAGS = [a for k, v in KEEPALIVE_MCA for a in ("--mca", k, v)]
FORWARD = ["PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL", "PLAIT_TIMEOUT", "PLAIT_BACKEND",
           "PLAIT_TEST_TIMEOUT", "PLAIT_TEST_REPORT_DIR"]

# Every program sets up (imports, model, first collectives) under PLAIT_TIMEOUT=START_TIMEOUT_S,
# then calls ready(comm) and trains until it is broken, pausing 20 ms after each step
# (the jobs of a group share 2 cores and must leave them to the ones still starting).
PRELUDE = """\
import faulthandler, os, pathlib, signal, time
import plait
faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: where is it stuck?
_REPORTS = pathlib.Path(os.environ["PLAIT_TEST_REPORT_DIR"])

def ready(comm, record=True):
    # wait for every rank, lower comm's timeout (communicators split later inherit it),
    # then (or later) record this rank's pid for the harness
    comm.barrier()
    comm.timeout = float(os.environ["PLAIT_TEST_TIMEOUT"])
    if record:
        started(comm)

def started(comm):
    tmp = _REPORTS / f".pid-{comm.rank}"
    tmp.write_text(str(os.getpid()))
    tmp.rename(_REPORTS / f"pid-{comm.rank}")

def pace():
    time.sleep(0.02)
"""

PROGRAMS = {
    "allreduce": """\
import numpy as np
comm = plait.init()
x = np.ones(1 << 16, dtype=np.float32)
comm.allreduce(x, op="sum")
ready(comm)
while True:
    comm.allreduce(x, op="sum")
    pace()
""",
    "dp": """\
import torch
import plait.torch as hvd
hvd.init()
comm = plait.world()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(), bucket_mb=0.05)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

def step():
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()

# Horovod negotiates each new op name in full once: slow on busy cores. (Not on the MPI
# backend: its optimizer splits a communicator after the first step, with the timeout then.)
for _ in range(3 if comm.backend == "horovod" else 0):
    step()
ready(comm)
while True:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    pace()
""",
    "keras": """\
import keras
import numpy as np
import plait.keras as hvd
hvd.init()
comm = plait.world()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                          keras.layers.Dense(10)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.01)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

class Pace(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        pace()

rng = np.random.default_rng(0)
x, y = rng.random((256, 64), dtype=np.float32), rng.integers(0, 10, 256)
broadcast = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[broadcast])  # traces the step
ready(comm)
model.fit(x, y, batch_size=32, epochs=10**6, verbose=0, callbacks=[Pace()])
""",
    "pipeline": """\
import torch
comm = plait.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32),
                            torch.nn.Tanh(), torch.nn.Linear(32, 10))
x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
ready(comm, record=False)  # first: the pipeline's communicator (split when built) inherits it
pipe = plait.Pipeline(model, microbatches=4, schedule="1f1b", comm=comm,
                      loss_fn=torch.nn.CrossEntropyLoss(),
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.05))
pipe.train_step(x, y)
started(comm)
while True:
    pipe.train_step(x, y)
    pace()
""",
    "ps": """\
import torch
dp = plait.DataParallel("mpi", mode="async", algorithm="parameter_server")
comm = dp.comm
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
opt = dp.optimizer(torch.optim.SGD(model.parameters(), lr=0.05))
ready(comm)
if opt.is_server:
    opt.serve()
else:
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    while True:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        pace()
""",
}


@dataclass
class Case:
    """One 2-rank job and how it is broken."""

    launcher: str  # "plait", "mpirun" or "horovodrun"
    program: str  # a key of PROGRAMS
    backend: str
    action: str  # "link" (the second host's link goes down) or "stop" (SIGSTOP its rank)
    #: the survivor's message names the rank's host (the MPI backend's who-is-waiting report)
    names_host: bool = False

    @property
    def id(self) -> str:
        return f"{self.launcher}-{self.program}-{self.backend}-{self.action}"


@dataclass
class Outcome:
    """What happened to one job."""

    case: Case
    hosts: list[str]
    status: int | None = None  # None: still running when the harness gave up (a hang)
    elapsed: float = float("nan")  # seconds from the failure to the job's end
    stderr: str = ""
    started: bool = False
    proc: subprocess.Popen[str] | None = None
    report_dir: Path = Path()
    err: IO[str] | None = field(default=None, repr=False)


GROUPS = {
    "plait": [
        Case("plait", "dp", "mpi", "link", names_host=True),
        Case("plait", "dp", "horovod", "link"),
        Case("plait", "keras", "mpi", "link", names_host=True),
        Case("plait", "pipeline", "mpi", "link"),
        Case("plait", "ps", "mpi", "link"),
        Case("plait", "dp", "mpi", "stop", names_host=True),
    ],
    "mpirun": [
        Case("mpirun", "allreduce", "mpi", "link", names_host=True),
        # (the other programs' lost links: under plait run above; a survivor's timeout does
        # not depend on the launcher, and mpirun ends the job as for the allreduce loop)
        Case("mpirun", "pipeline", "mpi", "stop", names_host=True),
        # With a rank stopped, the survivor's Horovod background loop waits for it and the
        # survivor's next horovod.torch ``*_async`` call blocks inside Horovod holding the
        # GIL (in about 1 of 3 runs): the process's OutsideWatchdog prints the timeout and
        # kills the rank, and mpirun ends the job.
        Case("mpirun", "dp", "horovod", "stop"),
        # Keras's step waits for the stopped rank in a Horovod kernel inside the tf.function,
        # which Python cannot interrupt: the same watchdog bounds each Horovod graph op
        Case("mpirun", "keras", "horovod", "stop"),
    ],
    "horovodrun": [
        Case("horovodrun", "dp", "horovod", "link"),
    ],
}
CASES = [(group, i) for group, cases in GROUPS.items() for i in range(len(cases))]


def job_env(hosts: EmulatedHosts, case: Case, report_dir: Path) -> dict[str, str]:
    env = hosts.env()
    env["PATH"] = f"{hosts.bin_dir}:{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_mpi_yield_when_idle": "1", "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
        "PLAIT_TIMEOUT": str(START_TIMEOUT_S), "PLAIT_BACKEND": case.backend,
        "PLAIT_TEST_TIMEOUT": str(TIMEOUT_S), "PLAIT_TEST_REPORT_DIR": str(report_dir),
    })
    if case.launcher == "horovodrun":
        # Starting a Horovod op can block inside Horovod while its background loop is stuck
        # in a Gloo exchange with the lost host, until Gloo's own timeout (default 30 s; the
        # README tells Gloo users to lower it this way)
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(GLOO_TIMEOUT_S)
    return env


def job_argv(hosts: EmulatedHosts, case: Case, pair: list[str], hostfile: Path) -> list[str]:
    program = [sys.executable, "-c", PRELUDE + PROGRAMS[case.program]]
    if case.launcher == "plait":
        return [sys.executable, "-m", "plait.launch.run", "--hostfile", str(hostfile),
                *hosts.mpirun_args(), "--backend", case.backend, "--", *program]
    if case.launcher == "mpirun":
        forward = [a for name in FORWARD for a in ("-x", name)]
        return ["mpirun", "--allow-run-as-root", "-np", "2", "--hostfile", str(hostfile),
                *hosts.mpirun_args(), *KEEPALIVE_FLAGS, *forward, *program]
    return [os.path.join(VENV_BIN, "horovodrun"), "-np", "2", "--network-interface", "eth0",
            "--start-timeout", "120", "--gloo", "-H", ",".join(f"{h}:1" for h in pair), *program]


def _ready(o: Outcome) -> bool:
    return all((o.report_dir / f"pid-{r}").exists() for r in range(2))


def break_jobs(cases: list[Case], tmp_path: Path) -> dict[str, Outcome]:
    """Start every case on its own pair of fresh hosts, break them all once all train,
    and wait (at most LIMIT_S + 30 s) for each to end."""
    out: dict[str, Outcome] = {}
    with EmulatedHosts(2 * len(cases), slots=1) as hosts:
        try:
            for i, case in enumerate(cases):
                pair = hosts.hosts[2 * i:2 * i + 2]
                o = out[case.id] = Outcome(case, pair, report_dir=tmp_path / case.id / "reports")
                o.report_dir.mkdir(parents=True)
                hostfile = tmp_path / case.id / "hostfile"
                hostfile.write_text("".join(f"{h} slots=1\n" for h in pair))
                o.err = open(tmp_path / case.id / "stderr", "w+")  # a file: orphans cannot block
                o.proc = hosts.popen(pair[0], job_argv(hosts, case, pair, hostfile),
                                     env=job_env(hosts, case, o.report_dir), cwd=str(ROOT),
                                     stdout=o.err, stderr=subprocess.STDOUT)
            start = time.monotonic()
            while time.monotonic() - start < START_S:
                waiting = [o for o in out.values() if not _ready(o) and o.proc.poll() is None]
                if not waiting:
                    break
                time.sleep(0.1)
            time.sleep(1.0)  # every job is past its first paced steps
            broken = time.monotonic()
            for o in out.values():
                o.started = _ready(o) and o.proc.poll() is None
                if not o.started:
                    o.status = o.proc.poll()
                    continue
                if o.case.action == "stop":
                    os.kill(int((o.report_dir / "pid-1").read_text()), signal.SIGSTOP)
                else:
                    hosts.link_down(o.hosts[1])
            while time.monotonic() - broken < LIMIT_S + 30:
                for o in out.values():
                    if o.started and o.status is None and o.proc.poll() is not None:
                        o.status, o.elapsed = o.proc.returncode, time.monotonic() - broken
                if all(o.status is not None for o in out.values() if o.started):
                    break
                time.sleep(0.1)
        finally:
            for o in out.values():
                if o.proc is not None and o.proc.poll() is None:
                    os.killpg(o.proc.pid, signal.SIGKILL)
                    o.proc.wait()
                if o.err is not None:
                    o.err.seek(0)
                    o.stderr = o.err.read()
                    o.err.close()
                print(f"\n[link-down] {o.case.id}: "
                      + (f"ended {o.elapsed:.1f}s after the failure, status {o.status}" if o.started
                         else f"did not start (status {o.status})"))
            # the namespaces (and every process left in them, stopped ones too) go with hosts
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Outcome]]]:
    """Each launcher group runs once, when its first case is tested."""
    done: dict[str, dict[str, Outcome]] = {}

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, group: str) -> dict[str, Outcome]:
            done[group] = break_jobs(GROUPS[group], tmp_path_factory.mktemp(group))
            self[group] = done[group]
            return done[group]

    yield Lazy()


@pytest.mark.parametrize(("group", "index"), CASES,
                         ids=[GROUPS[g][i].id for g, i in CASES])
def test_broken_job_ends_by_itself_with_the_timeout_message(
        outcomes: dict[str, dict[str, Outcome]], group: str, index: int) -> None:
    case = GROUPS[group][index]
    o = outcomes[group][case.id]
    tail = o.stderr[-6000:]
    assert o.started, f"{case.id} did not start training:\n{tail}"
    assert o.status is not None, f"{case.id} hung: the harness killed it\n{tail}"
    assert o.status != 0, tail
    assert o.elapsed < LIMIT_S, (o.elapsed, tail)
    # the survivor's message names what it waited for and how long
    found = re.search(rf"CollectiveTimeoutError: .*(waited {TIMEOUT_S}s|within {TIMEOUT_S}s)", o.stderr)
    assert found is not None, tail
    if case.names_host:
        assert re.search(rf"rank 1 did not arrive \(host {re.escape(o.hosts[1])};", o.stderr), tail


# --- plait run --restarts: resume on the hosts that still answer ----------------------------------
RESUMABLE = str(ROOT / "examples" / "resumable_digits.py")
STEPS, EVERY, BATCH = "600", "10", "96"  # a batch both 3 and 2 ranks divide
_DIGEST = re.compile(r"weights sha256 ([0-9a-f]{16})")
_RESUMED = re.compile(r"restart 1: (\d+) ranks, resuming at step (\d+)")


def test_restart_resumes_on_the_hosts_that_answer(tmp_path: Path) -> None:
    """A 3-host job loses its third host's link after its first checkpoint: plait run ends the
    failed attempt, excludes the host that does not answer its probe, relaunches on the other
    two, which resume from the last checkpoint and end with the weights of an uninterrupted
    2-host run from a copy of that checkpoint."""
    ckpt, saved = tmp_path / "ckpt", tmp_path / "ckpt-at-failure"
    with EmulatedHosts(3, slots=1) as hosts:
        case = Case("plait", "resumable", "mpi", "link")
        env = job_env(hosts, case, tmp_path)
        env["PLAIT_TIMEOUT"] = "10"  # from the start here: one job, sequential
        program = [sys.executable, RESUMABLE, "--ckpt", str(ckpt), "--steps", STEPS, "--every", EVERY,
                   "--batch", BATCH]
        argv = [sys.executable, "-m", "plait.launch.run", "--hostfile", hosts.hostfile,
                *hosts.mpirun_args(), "--backend", "mpi", "--restarts", "2",
                "--restart-backoff", "3", "--probe-timeout", "3", "--timeout", "240", "--", *program]
        with open(tmp_path / "stderr", "w+") as err:
            proc = hosts.popen(hosts.hosts[0], argv, env=env, cwd=str(ROOT), stdout=err,
                               stderr=subprocess.STDOUT)
            try:
                start = time.monotonic()
                while not _has_checkpoint(ckpt):
                    assert proc.poll() is None, _tail(err)
                    assert time.monotonic() - start < START_S, _tail(err)
                    time.sleep(0.05)
                hosts.link_down(hosts.hosts[2])
                broken = time.monotonic()
                while "restart 1/2 in" not in _tail(err):
                    assert proc.poll() is None, _tail(err)
                    assert time.monotonic() - broken < 120, _tail(err)
                    time.sleep(0.05)
                shutil.copytree(ckpt, saved)  # before the relaunch (3 s back-off) writes more
                failed_after = time.monotonic() - broken
                status = proc.wait(timeout=240)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            output = _tail(err, 100000)
        print(f"\n[link-down] restart: attempt 0 ended {failed_after:.1f}s after the link went down")
        assert status == 0, output[-6000:]
        assert f"excluding host {hosts.hosts[2]}" in output, output[-6000:]
        resumed = _RESUMED.search(output)
        assert resumed is not None and resumed.group(1) == "2", output[-6000:]
        entry = read_manifest(str(saved))
        assert entry is not None and int(resumed.group(2)) == entry.step > 0, output[-6000:]
        got = _DIGEST.findall(output)
        assert len(got) == 1, output[-6000:]
        # the uninterrupted reference: 2 ranks on the same two hosts from the same checkpoint
        hostfile = tmp_path / "hostfile2"
        hostfile.write_text("".join(f"{h} slots=1\n" for h in hosts.hosts[:2]))
        reference = [sys.executable, "-m", "plait.launch.run", "--hostfile", str(hostfile),
                     *hosts.mpirun_args(), "--backend", "mpi", "--timeout", "240", "--",
                     sys.executable, RESUMABLE, "--ckpt", str(saved), "--steps", STEPS,
                     "--every", EVERY, "--batch", BATCH]
        ref = hosts.exec(hosts.hosts[0], reference, timeout=300, env=env, cwd=str(ROOT))
        ref_out = ref.stdout + ref.stderr
        assert ref.returncode == 0, ref_out[-6000:]
        assert f"resuming at step {resumed.group(2)}" in ref_out, ref_out[-6000:]
        assert _DIGEST.findall(ref_out) == got, (got, ref_out[-3000:])


def _has_checkpoint(directory: Path) -> bool:
    try:
        entry = read_manifest(str(directory))
    except Exception:  # noqa: BLE001 - being written
        return False
    return entry is not None and entry.step > 0


def _tail(err: IO[str], n: int = 6000) -> str:
    err.flush()
    with open(err.name) as f:
        return f.read()[-n:]
