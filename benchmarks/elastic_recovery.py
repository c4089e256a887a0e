"""Elastic recovery on the Horovod backend: a worker is SIGKILLed during training; how long
until the survivor completes its next step. plait next to real Horovod, in one run.

Each backend is one elastic ``horovodrun`` job of this same script (``--min-np 1
--max-np N``, a discovery script naming N host names of this machine, ``localhost``,
``127.0.0.1`` and with ``--np 3`` this machine's host name, one slot each, so that
Horovod blacklists the dead worker's host and goes on with the others). The workers
train an MLP (784-1024-1024-10, batch 32, SGD) under ``hvd.elastic.run`` with a
``TorchState`` committed every step: ``horovod`` imports ``horovod.torch``,
``plait-horovod`` imports ``plait.torch`` with ``PLAIT_BACKEND=horovod`` (the script is
otherwise the same). At step ``--kill-step``
the worker on ``127.0.0.1`` writes the time and kills itself; the survivor writes the
time of every completed step. Recovery = the (first) survivor's first completed step after
the kill minus the kill time (it includes Horovod noticing the death, the reset, the
new rendezvous, restoring the last commit and one step); "resumed" is the part until
the training function starts again (after the state's sync), "reset" the part until
Horovod is up again in the new membership (the state's reset callbacks), "noticed" the
part until the survivor's failed op raised (its state's restore). With ``--np 3`` two
workers survive; one of them may wait out Gloo's timeout (``HOROVOD_GLOO_TIMEOUT_SECONDS``,
30 s by default) in an exchange that the other survivor already left: the table counts
the recoveries that took longer than 5 s. Backends alternate round by round so that both
see the same load.

Run: ``python benchmarks/elastic_recovery.py [--quick] [--rounds N] [--np 3]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import load_note, md_table, meta, mpi_env, parse_args, write_results

BACKENDS = ("horovod", "plait-horovod")
DIMS = (784, 1024, 1024, 10)
BATCH = 32
VICTIM = "127.0.0.1"  #: the host name whose worker dies


def _extra(p: Any) -> None:
    p.add_argument("--rounds", type=int, default=3, help="jobs per backend, interleaved")
    p.add_argument("--steps", type=int, default=40, help="steps each job trains")
    p.add_argument("--kill-step", type=int, default=20, help="the step at which a worker dies")
    p.add_argument("--logdir", default="", help=argparse.SUPPRESS)


def worker(kind: str, logdir: Path, steps: int, kill_step: int) -> None:
    """One elastic worker: train, log each completed step, and die at ``kill_step`` on
    the victim host."""
    import torch

    if kind == "horovod":
        import horovod.torch as hvd
    else:
        import plait.torch as hvd  # type: ignore[no-redef]
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(DIMS[:-1], DIMS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x, y = torch.randn(BATCH, DIMS[0]), torch.randint(0, DIMS[-1], (BATCH,))
    host = os.environ.get("HOROVOD_HOSTNAME", "?")
    log = open(logdir / f"{host}.log", "a", buffering=1)  # noqa: SIM115 (open for the job)
    state = hvd.elastic.TorchState(model, opt, step=0)
    state.register_reset_callbacks([lambda: log.write(f"reset {time.time()}\n")])
    restore = state.restore

    def noticed() -> None:  # hvd.elastic.run restores first thing after an op failed
        log.write(f"noticed {time.time()}\n")
        restore()

    state.restore = noticed

    @hvd.elastic.run
    def train(state: Any) -> None:
        log.write(f"attempt {time.time()}\n")  # after the state's sync
        while state.step < steps:
            if state.step == kill_step and host == VICTIM:
                log.write(f"kill {time.time()}\n")
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            state.step += 1
            log.write(f"step {state.step} {time.time()} {hvd.size()}\n")
            state.commit()

    train(state)


def host_names(np_: int) -> list[str]:
    """``np_`` (2 or 3) names of this machine: the survivor first, then the victim.

    Raises:
        SystemExit: ``np_`` is not 2 or 3, or this machine's host name is not one of its
            own addresses (Horovod would start that worker over ssh).
    """
    if np_ not in (2, 3):
        raise SystemExit(f"--np={np_}: expected 2 or 3")
    names = ["localhost", VICTIM]
    if np_ == 3:
        name = socket.gethostname()
        if name in names or not socket.gethostbyname(name).startswith("127."):
            raise SystemExit(f"--np=3 needs a third name for this machine; its host name {name!r} "
                             f"is not one (it must resolve to 127.x and differ from {names})")
        names.append(name)
    return names


def _job(kind: str, args: Any) -> dict[str, Any]:
    """One elastic job of ``kind``; its recovery time and the step time before the kill."""
    logdir = Path(tempfile.mkdtemp(prefix="plait-recovery-"))
    disc = logdir / "discover.sh"
    disc.write_text("#!/bin/sh\n" + "".join(f"echo {h}:1\n" for h in host_names(args.np)))
    disc.chmod(0o755)
    cmd = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(args.np), "--min-np", "1",
           "--max-np", str(args.np), "--host-discovery-script", str(disc), "--start-timeout", "60",
           sys.executable, str(Path(__file__).resolve()), "--worker", kind,
           "--logdir", str(logdir), "--steps", str(args.steps), "--kill-step", str(args.kill_step)]
    env = mpi_env({"PLAIT_BACKEND": "horovod"} if kind.startswith("plait") else {})
    row: dict[str, Any] = {"backend": kind}
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=args.timeout, start_new_session=True)
        row["rc"] = proc.returncode
    except subprocess.TimeoutExpired:
        row["rc"] = 124
    try:
        kill = [float(ln.split()[1]) for ln in (logdir / f"{VICTIM}.log").read_text().splitlines()
                if ln.startswith("kill")]
        steps = [ln.split() for ln in (logdir / "localhost.log").read_text().splitlines()]
    except OSError:
        kill, steps = [], []
    shutil.rmtree(logdir, ignore_errors=True)
    if not kill:
        return {**row, "recovery_s": None, "step_ms": None, "note": "no kill recorded"}
    attempts = [float(parts[1]) for parts in steps if parts[0] == "attempt"]
    resets = [float(parts[1]) for parts in steps if parts[0] == "reset"]
    times = [(int(s), float(t), int(n)) for k, s, t, n in (p for p in steps if p[0] == "step")]
    before = [t for _, t, _ in times if t < kill[0]]
    after = [(s, t, n) for s, t, n in times if t > kill[0]]
    gaps = [b - a for a, b in zip(before[2:], before[3:])]  # past the first steps
    row["step_ms"] = round(1000 * statistics.median(gaps), 1) if gaps else None
    if not after:
        return {**row, "recovery_s": None, "note": "the survivor never stepped again"}
    row["recovery_s"] = round(after[0][1] - kill[0], 3)
    resumed = [t for t in attempts if t > kill[0]]
    row["resumed_s"] = round(resumed[0] - kill[0], 3) if resumed else None
    reset = [t for t in resets if t > kill[0]]
    row["reset_s"] = round(reset[0] - kill[0], 3) if reset else None
    seen = [float(p[1]) for p in steps if p[0] == "noticed" and float(p[1]) > kill[0]]
    row["noticed_s"] = round(seen[0] - kill[0], 3) if seen else None
    row["size_after"] = after[0][2]
    row["finished"] = times[-1][0] >= args.steps
    return row


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], extra=_extra)
    if args.worker:
        worker(args.worker, Path(args.logdir), args.steps, args.kill_step)
        return 0
    host_names(args.np)
    if args.quick:
        args.rounds, args.steps, args.kill_step = 1, 12, 6
    args.timeout = min(args.timeout, 240)
    rows = []
    for r in range(args.rounds):
        for kind in BACKENDS:
            row = {"round": r, **_job(kind, args)}
            print(row, flush=True)
            rows.append(row)
    table = []
    medians: dict[str, float | None] = {}
    for kind in BACKENDS:
        mine = [row for row in rows if row["backend"] == kind]

        def values(key: str) -> list[float]:
            return [row[key] for row in mine if row.get(key) is not None]  # noqa: B023

        def median(key: str, digits: int) -> str:
            v = values(key)
            return f"{statistics.median(v):.{digits}f}" if v else "-"

        rec = values("recovery_s")
        medians[kind] = statistics.median(rec) if rec else None
        table.append([kind, f"{len(rec)}/{len(mine)}", str(sum(r > 5 for r in rec)), median("recovery_s", 2),
                      f"{min(rec):.2f}-{max(rec):.2f}" if rec else "-", median("noticed_s", 3),
                      median("reset_s", 2), median("resumed_s", 2), median("step_ms", 1)])
    ours, theirs = medians["plait-horovod"], medians["horovod"]
    ratio = f"{ours / theirs:.2f}" if ours and theirs else "-"
    md = (f"# Elastic recovery after a SIGKILLed worker (Horovod backend, torch)\n\n"
          f"{load_note()} at the start; {args.np} workers, {args.rounds} round(s), {args.steps} "
          f"steps, kill at step {args.kill_step}.\n\n"
          + md_table(["backend", "recovered", "over 5 s", "recovery s (median)", "min-max",
                     "noticed s", "reset s", "resumed s", "step ms before"], table)
          + f"\nplait / Horovod median recovery: {ratio}\n")
    write_results(args.out, "elastic_recovery", rows, md,
                  meta(quick=args.quick, rounds=args.rounds, np=args.np, load=load_note()))
    print(md)
    return 0 if all(row["recovery_s"] is not None for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
