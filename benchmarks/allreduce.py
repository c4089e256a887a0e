"""Allreduce latency and bus bandwidth, 4 B to 64 MiB, on 2 ranks, side by side.

Implementations, all in the same job and interleaved repeat by repeat (so load
changes on the machine hit all of them alike):

* ``plait-mpi`` / ``plait-mpi-nocheck``: plait's MPI communicator with the
  cross-rank agreement check on (the default) and off;
* ``mpi4py``: raw ``comm.Allreduce`` on the same buffers;
* ``plait-horovod`` / ``plait-horovod-nocheck``: plait's Horovod communicator;
* ``horovod``: raw ``horovod.torch.allreduce``;
* ``gloo``: ``torch.distributed.all_reduce`` on the gloo backend.

Two jobs, each interleaving its implementations: the MPI one (plait-mpi, with and
without the check, and mpi4py) imports neither Horovod nor gloo, whose background
threads poll all the time and, on 2 cores, slowed raw ``MPI_Allreduce`` in the same
process up to 25x; the other runs the Horovod and gloo rows.

Float32 torch tensors, op sum. Latency of a sample = the mean over back-to-back
calls (as many as fill about 20 ms, 50 ms in the full run), the slowest rank's;
bus bandwidth = bytes * 2(n-1)/n / latency (the nccl-tests convention). Reported: min/median/max over repeats.

Run: ``python benchmarks/allreduce.py [--quick] [--out BASE]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    fmt_bytes,
    free_port,
    launch,
    load_note,
    md_table,
    meta,
    parse_args,
    stats,
    versions,
    write_results,
)

IMPLS = ["plait-mpi", "plait-mpi-nocheck", "mpi4py", "plait-horovod", "plait-horovod-nocheck",
         "horovod", "gloo"]
#: The two jobs: ``--worker NAME`` runs these implementations.
JOBS = {"mpi": IMPLS[:3], "horovod": IMPLS[3:]}
#: plait implementation -> the raw backend it wraps
WRAPS = {"plait-mpi": "mpi4py", "plait-mpi-nocheck": "mpi4py", "plait-horovod": "horovod",
         "plait-horovod-nocheck": "horovod"}
FULL_SIZES = [4, 64, 1024, 16 * 1024, 256 * 1024, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20]
QUICK_SIZES = [4, 1024, 64 * 1024, 2**20, 4 * 2**20]
SMOKE_SIZES = [4, 64 * 1024]


def iterations(seconds_per_call: float, quick: bool, smoke: bool) -> int:
    """Back-to-back calls per sample: enough for a sample of about 20 ms (50 ms in the
    full run), so that a 10 µs call is timed over thousands of calls, not ten."""
    if smoke:
        return 2
    target = 0.02 if quick else 0.05
    return int(min(5000, max(2, target / max(seconds_per_call, 1e-7))))


def _setup(world: Any, job: str) -> dict[str, Any]:
    """The implementations of ``job`` (see :data:`JOBS`) as callables ``fn(tensor) -> None``."""
    from mpi4py import MPI

    def plait_with(comm: Any, check: bool) -> Any:
        def fn(t: Any) -> None:
            comm.check = check
            comm.allreduce(t, op="sum", name="bench")
        return fn

    if job == "horovod":
        import horovod.torch as hvd
        import torch.distributed as dist
        from plait.collectives.horovod import HorovodCommunicator

        ph = HorovodCommunicator("torch")
        port = world.bcast(free_port() if world.rank == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                                world_size=world.size)
        return {"plait-horovod": plait_with(ph, True), "plait-horovod-nocheck": plait_with(ph, False),
                "horovod": lambda t: hvd.allreduce(t, op=hvd.Sum, name="bench.raw"),
                "gloo": lambda t: dist.all_reduce(t)}
    from plait.collectives.mpi import MPICommunicator

    pm = MPICommunicator(world.Dup())
    raw = world.Dup()
    out_cache: dict[int, Any] = {}

    def mpi_raw(t: Any) -> None:
        a = t.numpy()
        out = out_cache.get(a.size)
        if out is None:
            out = out_cache[a.size] = a.copy()
        raw.Allreduce(a, out, MPI.SUM)

    return {"plait-mpi": plait_with(pm, True), "plait-mpi-nocheck": plait_with(pm, False),
            "mpi4py": mpi_raw}


def worker(args: Any) -> int:
    """Runs on every rank: measure the implementations of job ``args.worker`` at every size;
    rank 0 writes their samples to ``OUT.JOB.samples.json``."""
    import numpy as np
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    names = JOBS[args.worker]
    impls = _setup(world, args.worker)
    sizes = SMOKE_SIZES if args.smoke else QUICK_SIZES if args.quick else FULL_SIZES
    repeats = 2 if args.smoke else 3 if args.quick else 7
    sync = world.Barrier
    samples = np.zeros((len(names), len(sizes), repeats))
    for si, nbytes in enumerate(sizes):
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        per_call = np.zeros(len(names))
        for ii, name in enumerate(names):  # warm up (connections, caches), then time a few calls
            impls[name](t)
            sync()
            t0 = MPI.Wtime()
            for _ in range(3):
                impls[name](t)
            per_call[ii] = (MPI.Wtime() - t0) / 3
        world.Allreduce(MPI.IN_PLACE, per_call, MPI.MAX)  # every rank runs the same counts
        iters = [iterations(p, args.quick, args.smoke) for p in per_call]
        for r in range(repeats):
            for ii, name in enumerate(names):
                sync()
                t0 = MPI.Wtime()
                for _ in range(iters[ii]):
                    impls[name](t)
                samples[ii, si, r] = (MPI.Wtime() - t0) / iters[ii]
        if world.rank == 0:
            print(f"  {fmt_bytes(nbytes)} done", flush=True)
    slowest = np.empty_like(samples)
    world.Allreduce(samples, slowest, MPI.MAX)
    if world.rank == 0:
        Path(f"{args.out}.{args.worker}.samples.json").write_text(json.dumps(
            {"names": names, "sizes": sizes, "seconds": slowest.tolist(), "np": world.size,
             "repeats": repeats, "load_note": load_note(), "versions": versions()}))
    if args.worker == "horovod":
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def _rows(samples: Any, sizes: list[int], n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows = []
    factor = 2 * (n - 1) / n
    med: dict[tuple[str, int], float] = {}
    for ii, name in enumerate(IMPLS):
        for si, nbytes in enumerate(sizes):
            lat = [float(x) for x in samples[ii, si]]
            st = stats([x * 1e6 for x in lat])
            bw = stats([nbytes * factor / x / 1e9 for x in lat])
            med[(name, nbytes)] = st["median"]
            rows.append({"impl": name, "bytes": nbytes, "latency_us": st, "busbw_GBps": bw})
    ratios = []
    for nbytes in sizes:
        for name, raw in WRAPS.items():
            p, r = med[(name, nbytes)], med[(raw, nbytes)]
            ratios.append({"impl": name, "raw": raw, "bytes": nbytes, "time_ratio": p / r,
                           "overhead_us": p - r})
        for backend in ("mpi", "horovod"):
            on, off = med[(f"plait-{backend}", nbytes)], med[(f"plait-{backend}-nocheck", nbytes)]
            ratios.append({"impl": f"plait-{backend}", "raw": f"plait-{backend}-nocheck",
                           "bytes": nbytes, "time_ratio": on / off, "overhead_us": on - off,
                           "what": "cost of the agreement check"})
    return rows, ratios


def _markdown(rows: list[dict[str, Any]], ratios: list[dict[str, Any]], sizes: list[int],
              m: dict[str, Any]) -> str:
    by = {(r["impl"], r["bytes"]): r for r in rows}

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        s = r[key]
        return f"{s['median']:{fmt}} ({s['min']:{fmt}}–{s['max']:{fmt}})"

    out = [f"## Allreduce, {m['np']} ranks (float32, sum)\n",
           f"{m['machine'].get('cores')} cores, {m['load_note']}; median (min–max) over "
           f"{m['repeats']} repeats, each the slowest rank's mean over back-to-back calls.\n",
           "\n### Latency (µs)\n"]
    out.append(md_table(["size", *IMPLS],
                        [[fmt_bytes(s), *(cell(by[(i, s)], "latency_us", ".1f") for i in IMPLS)]
                         for s in sizes]))
    out.append("\n### Bus bandwidth (GB/s)\n")
    out.append(md_table(["size", *IMPLS],
                        [[fmt_bytes(s), *(cell(by[(i, s)], "busbw_GBps", ".3f") for i in IMPLS)]
                         for s in sizes]))
    out.append("\n### plait vs the raw backend it wraps (median latency)\n")
    out.append("time ratio > 1 means plait is slower; the last two columns are the cost of the "
               "cross-rank agreement check (check on vs off).\n\n")
    rat = {(r["impl"], r["raw"], r["bytes"]): r for r in ratios}
    header = ["size", "plait-mpi / mpi4py", "plait-mpi-nocheck / mpi4py",
              "plait-horovod / horovod", "plait-horovod-nocheck / horovod",
              "check cost mpi", "check cost horovod"]
    table = []
    for s in sizes:
        def rr(i: str, r: str, s: int = s) -> str:
            x = rat[(i, r, s)]
            return f"{x['time_ratio']:.2f}x ({x['overhead_us']:+.0f} µs)"
        table.append([fmt_bytes(s), rr("plait-mpi", "mpi4py"), rr("plait-mpi-nocheck", "mpi4py"),
                      rr("plait-horovod", "horovod"), rr("plait-horovod-nocheck", "horovod"),
                      f"{rat[('plait-mpi', 'plait-mpi-nocheck', s)]['overhead_us']:+.0f} µs",
                      f"{rat[('plait-horovod', 'plait-horovod-nocheck', s)]['overhead_us']:+.0f} µs"])
    out.append(md_table(header, table))
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    args = parse_args(__doc__.splitlines()[0], argv)
    if args.worker:
        return worker(args)
    print(f"allreduce benchmark on {args.np} ranks{' (quick)' if args.quick else ''}", flush=True)
    parts = {}
    for job in JOBS:
        rc = launch(__file__, args, worker=job)
        if rc != 0:
            return rc
        path = Path(f"{args.out}.{job}.samples.json")
        parts[job] = json.loads(path.read_text())
        path.unlink()
    first = parts["mpi"]
    sizes = first["sizes"]
    samples = np.concatenate([np.array(parts[job]["seconds"]) for job in JOBS])
    rows, ratios = _rows(samples, sizes, first["np"])
    notes = "; ".join(f"{job} job: {parts[job]['load_note']}" for job in JOBS)
    m = meta(quick=args.quick, smoke=args.smoke, np=first["np"], repeats=first["repeats"],
             dtype="float32", op="sum", versions={**first["versions"], **parts["horovod"]["versions"]},
             load_note=notes)
    write_results(args.out, "allreduce", rows, _markdown(rows, ratios, sizes, m), m, ratios=ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
