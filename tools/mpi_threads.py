"""Open MPI's TCP transport beside a thread that blocks in MPI: do messages stall?

No plait and no Horovod, only mpi4py. Every rank's main thread runs rounds of
nonblocking messages shaped like a pipeline step (a 64 KiB message to each
neighbour and a 512-byte notice to every other rank), waiting for them by
testing (``Testall`` and short naps), as plait's waits do. Meanwhile a second
thread calls a small allreduce every millisecond on another communicator,
which is what Horovod's background thread does under mpirun:

* ``blocking``: ``Allreduce`` (Horovod's controller uses blocking calls);
* ``polling``: ``Iallreduce`` tested until done;
* ``none``: no second thread.

A round that does not complete within ``--stall-s`` counts as a stall. Measured
with Open MPI 4.1.4 on 4 emulated hosts x 2 ranks: ``blocking`` stalled in 8 of
11 jobs, ``polling`` in 0 of 11 and ``none`` in 0 of 3. That is why a pipeline on the
Horovod backend may not span hosts (README, "What does not work, and why").

Run (root: the hosts are network namespaces)::

    python tools/mpi_threads.py --hosts 4 --slots 2 --jobs 3
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(mode: str, rounds: int, stall_s: float) -> None:
    """One rank: ``rounds`` rounds of messages; prints ``STALL`` and exits 3 on a stall."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    side, main = world.Dup(), world.Dup()
    stop = np.zeros(1, np.int32)

    def background() -> None:
        while True:  # every rank leaves after the same allreduce: the one that saw a stop
            flag = stop.copy()
            if mode == "blocking":
                side.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
            else:
                req = side.Iallreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
                while not req.Test():
                    time.sleep(5e-5)
            if flag[0]:
                return
            time.sleep(1e-3)

    thread = threading.Thread(target=background, daemon=True) if mode != "none" else None
    if thread is not None:
        thread.start()
    peers = [p for p in range(size) if p != rank]
    big = np.ones(16384, np.float32)
    for step in range(rounds):
        inbox = [np.zeros(512, np.uint8) for _ in peers]
        reqs = [main.Irecv(buf, source=p, tag=1) for buf, p in zip(inbox, peers)]
        near = [p for p in (rank - 1, rank + 1) if 0 <= p < size]
        got = [np.empty_like(big) for _ in near]
        reqs += [main.Irecv(buf, source=p, tag=2) for buf, p in zip(got, near)]
        reqs += [main.Isend(big, dest=p, tag=2) for p in near]
        note = np.full(512, step % 256, np.uint8)
        reqs += [main.Isend(note, dest=p, tag=1) for p in peers]
        start = time.monotonic()
        while not MPI.Request.Testall(reqs):
            if time.monotonic() - start > stall_s:
                print(f"STALL rank {rank} round {step}: nothing moved for {stall_s:g}s", flush=True)
                os._exit(3)  # the job ends; mpirun reports it
            time.sleep(5e-5)
    stop[0] = 1
    if thread is not None:
        thread.join()
    main.Barrier()
    if rank == 0:
        print(f"OK {rounds} rounds", flush=True)


def drive(ns: argparse.Namespace) -> int:
    """Run ``ns.jobs`` jobs per mode on emulated hosts; print a table of stalls."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from plait.testing.netns import EmulatedHosts

    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_mpi_yield_when_idle": "1"}
    rows = []
    with EmulatedHosts(ns.hosts, slots=ns.slots) as hosts:
        env["PATH"] = f"{hosts.bin_dir}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
        for mode in ns.modes.split(","):
            stalls = 0
            for _ in range(ns.jobs):
                argv = ["mpirun", "--allow-run-as-root", "-np", str(ns.hosts * ns.slots),
                        "--hostfile", hosts.hostfile, *hosts.mpirun_args(), "--bind-to", "none",
                        sys.executable, os.path.abspath(__file__), "--worker", mode,
                        "--rounds", str(ns.rounds), "--stall-s", str(ns.stall_s)]
                proc = hosts.exec(hosts.hosts[0], argv, timeout=ns.stall_s * 4 + 120, env=env)
                stalled = "STALL" in proc.stdout
                if not stalled and proc.returncode != 0:
                    sys.stderr.write(proc.stderr[-2000:])
                    return 1
                stalls += stalled
            rows.append((mode, ns.jobs, stalls))
    print(f"| second thread | jobs ({ns.hosts} hosts x {ns.slots}, {ns.rounds} rounds) | jobs with a stall |")
    print("|---|---|---|")
    for mode, jobs, stalls in rows:
        print(f"| {mode} | {jobs} | {stalls} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", choices=["blocking", "polling", "none"], help=argparse.SUPPRESS)
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=3, help="jobs per mode")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--stall-s", type=float, default=20.0)
    parser.add_argument("--modes", default="blocking,polling,none")
    ns = parser.parse_args()
    if ns.worker:
        worker(ns.worker, ns.rounds, ns.stall_s)
        return 0
    return drive(ns)


if __name__ == "__main__":
    sys.exit(main())
