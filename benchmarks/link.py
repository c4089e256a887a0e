"""Collectives across emulated hosts on a throttled link, as a fraction of the link rate.

Two hosts (network namespaces on a bridge, ``tc tbf`` on every host's link: see
:mod:`plait.testing.netns`), 1 or 2 ranks per host, one ``mpirun`` job started
from the first host. For allreduce, allgather, broadcast, reducescatter and alltoall
of a float32 tensor of each size on every rank, in the same job, interleaved repeat
by repeat:

* ``plait-mpi``: plait's MPI communicator (agreement check on, algorithms "auto");
* ``plait-mpi-fp16`` (allreduce): the same tensor cast to float16 (half the bytes);
* ``mpi4py``: the raw mpi4py collective (Open MPI's own algorithm);
* ``gloo``: ``torch.distributed`` on gloo (no reducescatter: gloo has none);
* ``horovod``: ``horovod.torch`` (Horovod's MPI controller);
* ``plait-horovod``: plait's Horovod communicator.

Fraction of the link rate = the time an ideal collective needs to move the bytes that
must cross each host's link (allreduce ``2 (H-1)/H S``, allgather ``(H-1) L S``,
broadcast ``S``, reducescatter ``(H-1)/H S``, alltoall ``(H-1)/H L S`` for H hosts of
L ranks and S bytes per rank) / the measured time; the fp16 row uses the float32
ideal, so it can exceed 1. Median (min-max) over repeats, each the slowest rank's
mean over back-to-back calls.

Needs root (network namespaces). Run:
``python benchmarks/link.py [--quick] [--rates 1gbit,10gbit] [--slots 1,2] [--kinds allreduce,...]``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_bytes, load_note, md_table, meta, parse_args, stats, versions, write_results

IMPLS = ["plait-mpi", "plait-mpi-fp16", "mpi4py", "gloo", "horovod", "plait-horovod"]
KINDS = ["allreduce", "allgather", "broadcast", "reducescatter", "alltoall"]
FULL_SIZES = [2**20, 16 * 2**20, 64 * 2**20, 256 * 2**20]
QUICK_SIZES = [4 * 2**20, 41 * 2**20]
SMOKE_SIZES = [2**20]
SMOKE_KINDS = ["allreduce", "allgather"]
#: size limit per collective (an allgather's output is ranks x the size)
_MAX = {"allgather": 64 * 2**20, "alltoall": 64 * 2**20}


def ideal_bytes(kind: str, nbytes: int, hosts: int, per_host: int) -> float:
    """Bytes that must cross each host's link (one way) for ``kind`` (module doc)."""
    h, n = hosts, nbytes
    return {"allreduce": 2 * (h - 1) / h * n, "allgather": (h - 1) * per_host * n,
            "broadcast": n, "reducescatter": (h - 1) / h * n,
            "alltoall": (h - 1) / h * per_host * n}[kind]
_RATE_BITS = {"gbit": 1e9, "mbit": 1e6}


def rate_bits(rate: str) -> float:
    """``"1gbit"`` -> 1e9 bits per second."""
    for unit, scale in _RATE_BITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: expected NUMBER followed by gbit or mbit")


def _setup(world: Any) -> dict[tuple[str, str], Any]:
    """``(kind, impl) -> fn(tensor)`` for every pair that exists."""
    import horovod.torch as hvd
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from plait.collectives.horovod import HorovodCommunicator
    from plait.collectives.mpi import MPICommunicator

    pm = MPICommunicator(world.Dup())
    ph = HorovodCommunicator("torch")
    raw = world.Dup()
    n = world.size
    addr = world.bcast(socket.gethostbyname(socket.gethostname()) if world.rank == 0 else None)
    port = world.bcast(_free_port(addr) if world.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=world.rank,
                            world_size=n)
    cache: dict[tuple[str, int], Any] = {}

    def buf(key: str, t: Any, factor: float = 1.0) -> Any:
        return cache.setdefault((key, t.numel()),
                                np.empty(int(t.numel() * factor), dtype=np.float32))

    def half(t: Any) -> Any:
        return cache.setdefault(("half", t.numel()), t.to(torch.float16))

    def gloo_gather(t: Any) -> None:
        dist.all_gather_into_tensor(cache.setdefault(("gg", t.numel()), torch.empty(t.numel() * n)), t)

    def gloo_a2a(t: Any) -> None:
        dist.all_to_all_single(cache.setdefault(("ga", t.numel()), torch.empty_like(t)), t)

    return {
        ("allreduce", "plait-mpi"): lambda t: pm.allreduce(t, op="sum", name="b"),
        ("allreduce", "plait-mpi-fp16"): lambda t: pm.allreduce(half(t), op="sum", name="b16"),
        ("allreduce", "mpi4py"): lambda t: raw.Allreduce(t.numpy(), buf("ar", t), MPI.SUM),
        ("allreduce", "gloo"): lambda t: dist.all_reduce(t),
        ("allreduce", "horovod"): lambda t: hvd.allreduce(t, op=hvd.Sum, name="ar"),
        ("allreduce", "plait-horovod"): lambda t: ph.allreduce(t, op="sum", name="b"),
        ("allgather", "plait-mpi"): lambda t: pm.allgather(t, name="g"),
        ("allgather", "mpi4py"): lambda t: raw.Allgather(t.numpy(), buf("ag", t, n)),
        ("allgather", "gloo"): gloo_gather,
        ("allgather", "horovod"): lambda t: hvd.allgather(t, name="ag"),
        ("allgather", "plait-horovod"): lambda t: ph.allgather(t, name="g"),
        ("broadcast", "plait-mpi"): lambda t: pm.broadcast(t, root=0, name="c"),
        ("broadcast", "mpi4py"): lambda t: raw.Bcast(t.numpy(), root=0),
        ("broadcast", "gloo"): lambda t: dist.broadcast(t, src=0),
        ("broadcast", "horovod"): lambda t: hvd.broadcast(t, 0, name="bc"),
        ("broadcast", "plait-horovod"): lambda t: ph.broadcast(t, root=0, name="c"),
        ("reducescatter", "plait-mpi"): lambda t: pm.reducescatter(t, op="sum", name="r"),
        ("reducescatter", "mpi4py"): lambda t: raw.Reduce_scatter_block(
            t.numpy(), buf("rs", t, 1 / n), MPI.SUM),
        ("reducescatter", "horovod"): lambda t: hvd.reducescatter(t, op=hvd.Sum, name="rs"),
        ("reducescatter", "plait-horovod"): lambda t: ph.reducescatter(t, op="sum", name="r"),
        ("alltoall", "plait-mpi"): lambda t: pm.alltoall(t, name="a"),
        ("alltoall", "mpi4py"): lambda t: raw.Alltoall(t.numpy(), buf("aa", t)),
        ("alltoall", "gloo"): gloo_a2a,
        ("alltoall", "horovod"): lambda t: hvd.alltoall(t, name="aa"),
        ("alltoall", "plait-horovod"): lambda t: ph.alltoall(t, name="a"),
    }


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def worker(args: Any) -> int:
    """Runs on every rank: every implementation of every collective at every size."""
    import numpy as np
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    impls = _setup(world)
    sizes = SMOKE_SIZES if args.smoke else QUICK_SIZES if args.quick else FULL_SIZES
    kinds = SMOKE_KINDS if args.smoke else args.kinds.split(",")
    repeats = 2 if args.smoke else 3 if args.quick else 5
    cells = [(k, s) for k in kinds for s in sizes if s <= _MAX.get(k, s)]
    samples = np.zeros((len(IMPLS), len(cells), repeats))
    for ci, (kind, nbytes) in enumerate(cells):
        # rows divisible by the ranks (reducescatter, alltoall)
        t = torch.ones(nbytes // 4 // world.size * world.size, dtype=torch.float32)
        iters = 1 if nbytes >= 64 * 2**20 or args.smoke else 2
        mine = [(ii, impls[(kind, name)]) for ii, name in enumerate(IMPLS) if (kind, name) in impls]
        for _, fn in mine:
            fn(t)  # warm up: connections, first-call costs
        for r in range(repeats):
            for ii, fn in mine:
                world.Barrier()
                t0 = MPI.Wtime()
                for _ in range(iters):
                    fn(t)
                samples[ii, ci, r] = (MPI.Wtime() - t0) / iters
    slowest = np.empty_like(samples)
    world.Allreduce(samples, slowest, MPI.MAX)
    if world.rank == 0:
        Path(args.out + ".samples.json").write_text(json.dumps(
            {"cells": cells, "impls": IMPLS, "seconds": slowest.tolist(),
             "present": sorted(f"{k}|{i}" for k, i in impls), "np": world.size,
             "load_note": load_note(), "versions": versions()}))
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def _rows(data: dict[str, Any], rate: str, hosts: int) -> list[dict[str, Any]]:
    bits = rate_bits(rate)
    rows = []
    per_host = data["np"] // hosts
    for ii, name in enumerate(data["impls"]):
        for ci, (kind, nbytes) in enumerate(data["cells"]):
            if f"{kind}|{name}" not in data["present"]:
                continue
            secs = data["seconds"][ii][ci]
            ideal = ideal_bytes(kind, nbytes, hosts, per_host) * 8 / bits
            rows.append({"kind": kind, "impl": name, "bytes": nbytes, "rate": rate,
                         "np": data["np"], "ms": stats([s * 1e3 for s in secs]),
                         "link_fraction": stats([ideal / s for s in secs])})
    return rows


def _markdown(rows: list[dict[str, Any]], m: dict[str, Any]) -> str:
    out = ["## Collectives across 2 emulated hosts (float32)\n\n",
           f"{m['machine'].get('cores')} cores; load per run below; each cell: fraction of the "
           "link rate, median (min–max) over repeats, and the median time.\n"]

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "–"
        f = r["link_fraction"]
        return f"{f['median']:.2f} ({f['min']:.2f}–{f['max']:.2f}) {r['ms']['median']:.0f} ms"

    for (rate, np_), note in m["runs"].items():
        sub = [r for r in rows if r["rate"] == rate and r["np"] == np_]
        by = {(r["kind"], r["impl"], r["bytes"]): r for r in sub}
        out.append(f"\n### {rate}, {np_} ranks ({note})\n\n")
        table = [[kind, fmt_bytes(b), *(cell(by.get((kind, i, b))) for i in IMPLS)]
                 for kind, b in dict.fromkeys((r["kind"], r["bytes"]) for r in sub)]
        out.append(md_table(["collective", "size", *IMPLS], table))
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    def extra(p: Any) -> None:
        p.add_argument("--rates", default="1gbit", help="comma-separated tc rates (default 1gbit)")
        p.add_argument("--slots", default="1", help="ranks per host, comma-separated (default 1)")
        p.add_argument("--kinds", default=",".join(KINDS), help="collectives, comma-separated")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    if args.worker:
        return worker(args)
    from plait.testing.netns import EmulatedHosts

    rows: list[dict[str, Any]] = []
    runs: dict[str, str] = {}
    for rate in args.rates.split(","):
        for slots in (int(s) for s in args.slots.split(",")):
            print(f"link benchmark: 2 hosts x {slots} ranks at {rate}", flush=True)
            with EmulatedHosts(2, rate=rate, slots=slots, clean_env=False) as hosts:
                out = f"{args.out}.{rate}.np{2 * slots}"
                cmd = ["mpirun", "--allow-run-as-root", "-np", str(2 * slots), "--hostfile",
                       hosts.hostfile, *hosts.mpirun_args(), "--bind-to", "none",
                       "--timeout", str(int(args.timeout)), "-x", "PATH", "-x", "PYTHONPATH",
                       "-x", "OMPI_MCA_mpi_yield_when_idle",
                       # plait's settings (PLAIT_RING_CHUNK_KB, ...), the same on every rank
                       *[a for k in sorted(os.environ) if k.startswith("PLAIT_") for a in ("-x", k)],
                       sys.executable, str(Path(__file__).resolve()), "--worker", "1",
                       "--out", out, "--kinds", args.kinds, *(["--quick"] if args.quick else []),
                       *(["--smoke"] if args.smoke else [])]
                env = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1", PYTHONUNBUFFERED="1",
                           PYTHONPATH=str(Path(__file__).resolve().parent.parent))
                proc = hosts.exec(hosts.hosts[0], cmd, timeout=args.timeout + 30, env=env)
                if proc.returncode != 0:
                    print(proc.stdout[-4000:], proc.stderr[-4000:], file=sys.stderr)
                    return proc.returncode
            data = json.loads(Path(out + ".samples.json").read_text())
            Path(out + ".samples.json").unlink()
            rows += _rows(data, rate, 2)
            runs[f"{rate}|{2 * slots}"] = data["load_note"]
    m = meta(quick=args.quick, smoke=args.smoke, runs=runs)
    m_md = dict(m, runs={(k.split("|")[0], int(k.split("|")[1])): v for k, v in runs.items()})
    write_results(args.out, "link", rows, _markdown(rows, m_md), m)
    print(Path(args.out + ".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
