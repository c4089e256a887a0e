"""Repeated elastic membership changes on both backends: ``make stress`` (not part of ``make test``).

Each Horovod-backend case is one elastic ``horovodrun`` job
(``tests/parallel/job_ckpt_hvd_elastic*.py``) on 3 emulated hosts, 2 workers at the start
(``--min-np 1 --max-np 3``); the discovery script lists 2 hosts, and the case changes the
membership once or twice within a few seconds. Every case runs ``PLAIT_STRESS_REPEATS``
times (default 20), the repeats seeded apart by the pause between steps (0.1-0.6 s), which
moves the changes against Horovod's discovery and resets. Each run must end with exit 0,
equal replicas and every committed step counted once on every worker (the plait state
object carried by the elastic state agrees).

Cases (``h2``: the second host, ``h3``: the third, listed from step/batch 3 or 5):

* ``torch-kill``: the worker on h2 is SIGKILLed at step 5 (2 -> 1 worker, then h3 is never listed);
* ``torch-add-kill``: h3 listed after step 3, the worker on h2 killed at step 4;
* ``torch-add-kill-same-step``: both after step 3;
* ``torch-kill-in-reset``: h3 listed after step 3, and the worker on h2 dies inside the
  reset that follows (after the new rendezvous, before the state's sync);
* ``torch-kill-at-commit``: h3 listed after step 3, the worker on h2 killed after step 5,
  while the others commit it;
* ``torch-kill-in-checkpoint``: every worker saves a ``plait.Checkpoint`` after each commit
  (rank 0 gathers and writes); rank 0's worker (on h1) is SIGKILLed in the middle of writing
  step 5's, after its first file. The survivor's latest checkpoint must hold the last step and
  the trained weights;
* ``torch-kill-in-checkpoint-gather``: the same, the worker on h2 killed as it starts saving
  step 5's checkpoint, while rank 0 gathers;
* ``torch-add-remove``: h3 listed after step 3 and taken out of discovery after step 7
  (2 -> 3 -> 2, no worker dies);
* ``torch-add-leave-in-reset``: h3 listed after step 3; its worker, as it starts, takes h3
  out of discovery again and waits 2.5 s, so that Horovod's driver announces the removal
  while the others wait for that worker in their reset (2 -> 3 -> 2; Horovod itself loses
  that announcement, and the removed host's worker trains to the end);
* ``torch-add``: h3 listed after step 3 (2 -> 3), nothing else (28 steps, so that the new
  worker has time to start; the run must end on 3 workers);
* ``torch-remove``: h2 taken out of discovery after step 3, no worker killed (must end on 1);
* ``tf-loop-*``: the same cases (kill, add-kill, kill-in-reset, kill-at-commit,
  add-remove, add, remove) for a Keras custom loop: a ``tf.function`` step with
  ``DistributedGradientTape``, traced before any change, and ``TensorFlowKerasState``;
* ``keras-kill``, ``keras-add-kill``: ``model.fit`` with Horovod's elastic callbacks, the
  worker on h2 killed after 7 batches; in the second, h3 listed after 5 batches;
  ``keras-add``, ``keras-remove``: h3 listed (10 epochs, must end on 3 workers), or h2
  taken out of discovery (must end on 1), after 5 batches;
* on the MPI backend (``plait run --elastic``), after 2-5 commits: ``mpi-kill-swap``, the
  worker on h2 killed and h3 listed in its place at the same instant (ends on 2 ranks);
  ``mpi-kill``, the worker on h2 killed (its host is blamed: 1 rank); ``mpi-kill-in-write``,
  the same while it writes its host's commit file (the state carries 32 MiB, so that the
  write takes a while); ``mpi-remove``, h2
  taken out of discovery (1 rank); ``mpi-add``, a job started on h1 alone gets h2 (2
  ranks); ``mpi-remove-add``, h2 taken out and h3 listed 1 s later (2 ranks).

Run: ``make stress`` or ``python -m pytest tests/stress_elastic.py -q [-k CASE]`` (as root:
emulated hosts are network namespaces).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jobs import ROOT
from test_fault_tolerance import HOROVODRUN, digits, horovod_elastic  # noqa: F401

from plait.testing.pytest_fixtures import emulated_hosts  # noqa: F401  (fixture)

REPEATS = int(os.environ.get("PLAIT_STRESS_REPEATS", "20"))
STEPS = 14  # torch steps
KERAS_EPOCHS = 5  # of 4 batches
REMOVE_AT = 7  # step

#: case -> (job, discovery change, HVD_ADD, HVD_KILL as (step, host index, where: start,
#: commit, checkpoint, gather; the last two save checkpoints) or None,
#: kill in the reset, workers at the end or None where a kill makes it vary). The change at
#: step HVD_ADD: ``grow`` lists h3 too, ``shrink`` lists h1 alone; ``grow-shrink`` also takes
#: h3 out again after step REMOVE_AT; ``grow-leave``: h3's worker takes h3 out as it starts.
#: A case that ends on 3 workers, and ``grow-leave``, run twice the steps, so that the new worker
#: has time to start.
CASES: dict[str, tuple[str, str, int, tuple[int, int, str] | None, bool, int | None]] = {
    "torch-kill": ("torch", "grow", 99, (5, 1, "start"), False, None),
    "torch-add-kill": ("torch", "grow", 3, (4, 1, "start"), False, None),
    "torch-add-kill-same-step": ("torch", "grow", 3, (3, 1, "start"), False, None),
    "torch-kill-in-reset": ("torch", "grow", 3, None, True, None),
    "torch-kill-at-commit": ("torch", "grow", 3, (5, 1, "commit"), False, None),
    "torch-kill-in-checkpoint": ("torch", "grow", 99, (5, 0, "checkpoint"), False, None),
    "torch-kill-in-checkpoint-gather": ("torch", "grow", 99, (5, 1, "gather"), False, None),
    "torch-add-remove": ("torch", "grow-shrink", 3, None, False, 2),
    "torch-add-leave-in-reset": ("torch", "grow-leave", 3, None, False, 2),
    "torch-add": ("torch", "grow", 3, None, False, 3),
    "torch-remove": ("torch", "shrink", 3, None, False, 1),
    "tf-loop-kill": ("tf", "grow", 99, (5, 1, "start"), False, None),
    "tf-loop-add-kill": ("tf", "grow", 3, (4, 1, "start"), False, None),
    "tf-loop-kill-in-reset": ("tf", "grow", 3, None, True, None),
    "tf-loop-kill-at-commit": ("tf", "grow", 3, (5, 1, "commit"), False, None),
    "tf-loop-add-remove": ("tf", "grow-shrink", 3, None, False, 2),
    "tf-loop-add": ("tf", "grow", 3, None, False, 3),
    "tf-loop-remove": ("tf", "shrink", 3, None, False, 1),
    "keras-kill": ("keras", "grow", 99, (7, 1, "start"), False, None),
    "keras-add-kill": ("keras", "grow", 5, (6, 1, "start"), False, None),
    "keras-add": ("keras", "grow", 5, None, False, 3),
    "keras-remove": ("keras", "shrink", 5, None, False, 1),
}


@HOROVODRUN
@pytest.mark.timeout(400)
@pytest.mark.parametrize("seed", range(REPEATS))
@pytest.mark.parametrize("case", list(CASES))
def test_elastic_job_survives_the_change(tmp_path: Path, digits: str, emulated_hosts, case: str,  # noqa: F811
                                         seed: int) -> None:
    job, change, add, kill, in_reset, end = CASES[case]
    hosts = emulated_hosts(3, slots=1)
    names = hosts.hosts
    two = f"{names[0]}:1\n{names[1]}:1\n"
    remove = REMOVE_AT if change == "grow-shrink" else 99
    grow = 2 if end == 3 or change == "grow-leave" else 1  # a worker must have time to join
    steps, epochs = grow * STEPS, grow * KERAS_EPOCHS
    changed = f"{names[0]}:1\n" if change == "shrink" else f"{two}{names[2]}:1\n"
    env = {"FT_DATA": digits, "HVD_ADD": str(add), "HVD_REMOVE": str(remove), "HVD_GROWN": changed,
           "HOROVOD_GLOO_TIMEOUT_SECONDS": "10",
           "HVD_SLEEP": f"{0.1 + 0.1 * (seed % 6):.1f}", "HVD_STEPS": str(steps),
           "HVD_EPOCHS": str(epochs)}
    if kill is not None:
        env["HVD_KILL"] = f"{kill[0]}:{names[kill[1]]}:{kill[2]}"
        if kill[2] in ("checkpoint", "gather"):
            env["HVD_CKPT"] = str(tmp_path / "ckpt")
    if in_reset:
        env["HVD_KILL_RESET"] = names[1]
    if change == "grow-leave":
        env.update(HVD_LEAVE=names[2], HVD_LEFT=two)
    script = {"torch": "job_ckpt_hvd_elastic.py", "tf": "job_ckpt_hvd_elastic_tf.py",
              "keras": "job_ckpt_hvd_elastic_keras.py"}[job]
    out = horovod_elastic(tmp_path, script, two, env, timeout=360, hosts=hosts, min_np=1)
    (tmp_path / "output.txt").write_text(out)  # pytest keeps the last runs' tmp_path
    told = "\n".join(line for line in out.splitlines() if "HVD" in line or "rror:" in line)[-3000:]
    if job != "keras":
        done = re.search(r"HVD done sizes=\[(.*?)\] replicas_equal=(\w+) residual_steps=\[(.*?)\]", out)
        assert done is not None, told
        assert done.group(2) == "True", told
        counted = [float(s) for s in done.group(3).split(",")]
        assert counted == [float(steps)] * len(counted), told
        if "HVD_CKPT" in env:
            assert f"checkpoint_step={steps} checkpoint_equal=True" in out, told
    else:
        done = re.search(r"HVD done sizes=\[(.*?)\] replicas_equal=(\w+) accuracy=\S+ batches=(\d+) "
                         r"residual_batches=\[(.*?)\]", out)
        assert done is not None, told
        assert done.group(2) == "True", told
        batches = int(done.group(3))  # a reset restarts the epoch from its start: >= all batches
        counted = [float(s) for s in done.group(4).split(",")]
        assert batches >= 4 * epochs and counted == [float(batches)] * len(counted), told
    assert end is None or int(done.group(1).split(",")[-1]) == end, told


#: MPI case -> (hosts listed at the start, hosts listed after the change (indices), kill the
#: worker on h2: "now", "in-write" (while it writes its host's commit file) or "" (no),
#: hosts listed 1 s later or None, ranks at the end)
MPI_CASES: dict[str, tuple[tuple[int, ...], tuple[int, ...], str, tuple[int, ...] | None, int]] = {
    "mpi-kill-swap": ((0, 1), (0, 2), "now", None, 2),
    "mpi-kill": ((0, 1), (0, 1), "now", None, 1),
    "mpi-kill-in-write": ((0, 1), (0, 1), "in-write", None, 1),
    "mpi-remove": ((0, 1), (0,), "", None, 1),
    "mpi-add": ((0,), (0, 1), "", None, 2),
    "mpi-remove-add": ((0, 1), (0,), "", (0, 2), 2),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", range(REPEATS))
@pytest.mark.parametrize("case", list(MPI_CASES))
def test_mpi_elastic_job_survives_the_change(tmp_path: Path, emulated_hosts, case: str,  # noqa: F811
                                             seed: int) -> None:
    """``plait run --elastic`` (MPI backend) on 3 emulated hosts: after 2-5 commits (by seed)
    discovery changes and, in some cases, the worker on h2 is SIGKILLed in the same instant
    (or as it next writes its commit file); the job ends on the ranks it should with a
    one-process run's weights."""
    from test_elastic_mpi import JOB, STEPS, _commits, _until, drive, elastic_job

    first, changed, kill, later, end = MPI_CASES[case]
    hosts = emulated_hosts(3, slots=1)

    def listing(indices: tuple[int, ...]) -> str:
        return "".join(f"{hosts.hosts[i]}:1\n" for i in indices)

    argv, env = elastic_job(tmp_path, "job_elastic_mpi.py", listing(first),
                            {"EL_STEPS": str(STEPS), "EL_OUT": str(tmp_path / "w.npy"),
                             "EL_BLOB": "32" if kill == "in-write" else "0",
                             "PLAIT_TIMEOUT": "20"}, *hosts.mpirun_args())
    env["PATH"] = f"{hosts.bin_dir}:{env['PATH']}"

    def steer(proc: subprocess.Popen[Any]) -> None:
        _until(lambda: _commits(tmp_path / "commits") >= 2 + seed % 4, proc, "the first commits")
        (tmp_path / "hosts").write_text(listing(changed))
        pid = int((tmp_path / "pids" / "pid-1-0").read_text())
        if kill == "in-write":
            writing = f"commit-*.pkl.{pid}.tmp"  # elastic_relaunch's temporary
            deadline = time.monotonic() + 60
            while not any((tmp_path / "commits").glob(writing)):
                assert time.monotonic() < deadline and proc.poll() is None, "no commit written"
                time.sleep(0.0005)
        if kill:
            os.kill(pid, signal.SIGKILL)
        if later is not None:
            time.sleep(1)
            (tmp_path / "hosts").write_text(listing(later))

    status, stdout, stderr = drive(tmp_path, lambda **kw: hosts.popen(hosts.hosts[0], argv, env=env,
                                                                      cwd=str(ROOT), **kw), steer)
    context = f"{stderr[-4000:]}\n{stdout[-3000:]}"
    assert status == 0, context
    done = re.findall(r"EL done rank=\d size=(\d) batch=(\d+) replicas_equal=(True|False)", stdout)
    assert done == [(str(end), str(STEPS), "True")] * end, context
    sys.path.insert(0, str(JOB.parent))
    try:
        from job_elastic_mpi import serial
    finally:
        sys.path.pop(0)
    np.testing.assert_allclose(np.load(tmp_path / "w.npy"), serial(STEPS), rtol=1e-5, atol=1e-6)
