"""Every collective on one host: plait's MPI backend next to raw mpi4py, 64 B to 4 MiB.

For each of allreduce, allgather, broadcast, alltoall and reducescatter, in one
job, interleaved repeat by repeat (so load changes on the machine hit both alike):

* ``plait-mpi``: the synchronous collective of plait's MPI communicator, with the
  cross-rank agreement check on (the default);
* ``mpi4py``: the blocking mpi4py call on buffers allocated once (``Allreduce``,
  ``Allgather``, ``Bcast``, ``Alltoall``, ``Reduce_scatter_block``).

Float32 torch tensors; ``size`` is the bytes each rank contributes (an alltoall
and a reducescatter take ``size`` per rank, ``size x ranks`` in all). Latency of a
sample = the mean over back-to-back calls (as many as fill about 20 ms), the
slowest rank's. Reported: min/median/max over repeats, and plait's added
microseconds and time ratio (issue goal: at most 20 us added for small messages).

Run: ``python benchmarks/collectives.py [--quick] [--out BASE] [--np N]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_bytes, launch, load_note, md_table, meta, parse_args, stats, versions, write_results

KINDS = ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter"]
IMPLS = ["plait-mpi", "mpi4py"]
FULL_SIZES = [64, 1024, 4096, 64 * 1024, 2**20, 4 * 2**20]
QUICK_SIZES = [64, 4096, 64 * 1024, 2**20]
SMOKE_SIZES = [64, 64 * 1024]


def _calls(world: Any, nbytes: int) -> dict[str, dict[str, Any]]:
    """``{kind: {impl: fn()}}`` on float32 tensors of ``nbytes`` per rank."""
    import torch
    from mpi4py import MPI
    from plait.collectives.mpi import MPICommunicator

    pm, raw, size = MPICommunicator(world.Dup()), world.Dup(), world.Get_size()
    n = max(1, nbytes // 4)
    t, wide = torch.ones(n), torch.ones(n * size)
    a, aw = t.numpy(), wide.numpy()
    out, out_wide = a.copy(), aw.copy()
    return {
        "allreduce": {"plait-mpi": lambda: pm.allreduce(t, op="sum", name="b.ar"),
                      "mpi4py": lambda: raw.Allreduce(a, out, MPI.SUM)},
        "allgather": {"plait-mpi": lambda: pm.allgather(t, name="b.ag"),
                      "mpi4py": lambda: raw.Allgather(a, out_wide)},
        "broadcast": {"plait-mpi": lambda: pm.broadcast(t, root=0, name="b.bc"),
                      "mpi4py": lambda: raw.Bcast(a, root=0)},
        "alltoall": {"plait-mpi": lambda: pm.alltoall(wide, name="b.a2a"),
                     "mpi4py": lambda: raw.Alltoall(aw, out_wide)},
        "reducescatter": {"plait-mpi": lambda: pm.reducescatter(wide, op="sum", name="b.rs"),
                          "mpi4py": lambda: raw.Reduce_scatter_block(aw, out, MPI.SUM)},
    }


def worker(args: Any) -> int:
    """Runs on every rank: time every kind x implementation x size; rank 0 writes
    ``OUT.samples.json``."""
    import numpy as np
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    sizes = SMOKE_SIZES if args.smoke else QUICK_SIZES if args.quick else FULL_SIZES
    repeats = 2 if args.smoke else 5 if args.quick else 9
    target = 0.002 if args.smoke else 0.02
    samples = np.zeros((len(KINDS), len(IMPLS), len(sizes), repeats))
    for si, nbytes in enumerate(sizes):
        calls = _calls(world, nbytes)
        for ki, kind in enumerate(KINDS):
            per_call = np.zeros(len(IMPLS))
            for ii, impl in enumerate(IMPLS):  # warm up, then time a few calls
                fn = calls[kind][impl]
                for _ in range(3):
                    fn()
                world.Barrier()
                t0 = MPI.Wtime()
                for _ in range(3):
                    fn()
                per_call[ii] = (MPI.Wtime() - t0) / 3
            world.Allreduce(MPI.IN_PLACE, per_call, MPI.MAX)  # every rank runs the same counts
            iters = [int(min(3000, max(2, target / max(p, 1e-7)))) for p in per_call]
            for r in range(repeats):
                for ii, impl in enumerate(IMPLS):
                    fn = calls[kind][impl]
                    world.Barrier()
                    t0 = MPI.Wtime()
                    for _ in range(iters[ii]):
                        fn()
                    samples[ki, ii, si, r] = (MPI.Wtime() - t0) / iters[ii]
        if world.rank == 0:
            print(f"  {fmt_bytes(nbytes)} done", flush=True)
    slowest = np.empty_like(samples)
    world.Allreduce(samples, slowest, MPI.MAX)
    if world.rank == 0:
        Path(f"{args.out}.samples.json").write_text(json.dumps(
            {"sizes": sizes, "seconds": slowest.tolist(), "np": world.size, "repeats": repeats,
             "load_note": load_note(), "versions": versions()}))
    return 0


def _rows(seconds: Any, sizes: list[int]) -> list[dict[str, Any]]:
    rows = []
    for ki, kind in enumerate(KINDS):
        for si, nbytes in enumerate(sizes):
            lat = {impl: stats([x * 1e6 for x in seconds[ki][ii][si]]) for ii, impl in enumerate(IMPLS)}
            p, r = lat["plait-mpi"]["median"], lat["mpi4py"]["median"]
            rows.append({"kind": kind, "bytes": nbytes, "latency_us": lat, "added_us": p - r,
                         "time_ratio": p / r})
    return rows


def _markdown(rows: list[dict[str, Any]], m: dict[str, Any]) -> str:
    def cell(s: dict[str, float]) -> str:
        return f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})"

    out = [f"## Every collective on one host, {m['np']} ranks (float32)\n\n",
           f"{m['machine'].get('cores')} cores, {m['load_note']}; latency in µs, median (min–max) "
           f"over {m['repeats']} repeats, each the slowest rank's mean over back-to-back calls; "
           "size = bytes per rank. plait-mpi has the agreement check on.\n\n"]
    out.append(md_table(["collective", "size", "plait-mpi", "mpi4py", "added µs", "time ratio"],
                        [[r["kind"], fmt_bytes(r["bytes"]), cell(r["latency_us"]["plait-mpi"]),
                          cell(r["latency_us"]["mpi4py"]), f"{r['added_us']:+.1f}",
                          f"{r['time_ratio']:.2f}x"] for r in rows]))
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    if args.worker:
        return worker(args)
    print(f"collectives benchmark on {args.np} ranks{' (quick)' if args.quick else ''}", flush=True)
    rc = launch(__file__, args)
    if rc != 0:
        return rc
    path = Path(f"{args.out}.samples.json")
    part = json.loads(path.read_text())
    path.unlink()
    rows = _rows(part["seconds"], part["sizes"])
    m = meta(quick=args.quick, smoke=args.smoke, np=part["np"], repeats=part["repeats"],
             dtype="float32", versions=part["versions"], load_note=part["load_note"])
    write_results(args.out, "collectives", rows, _markdown(rows, m), m)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
