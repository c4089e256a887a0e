"""Allreduce across emulated hosts on a throttled link, as a fraction of the link rate.

Two hosts (network namespaces on a bridge, ``tc tbf`` on every host's link: see
:mod:`plait.testing.netns`), 1 or 2 ranks per host, one ``mpirun`` job started
from the first host. In the same job, interleaved repeat by repeat:

* ``plait-mpi``: plait's MPI communicator (agreement check on, algorithm "auto");
* ``plait-mpi-fp16``: the same tensor cast to float16 (half the bytes on the wire);
* ``mpi4py``: raw ``comm.Allreduce`` (Open MPI's own algorithm);
* ``gloo``: ``torch.distributed.all_reduce`` (gloo);
* ``horovod``: ``horovod.torch.allreduce`` (Horovod's MPI controller);
* ``plait-horovod``: plait's Horovod communicator.

Fraction of the link rate = the time an ideal allreduce needs (every host sends and
receives ``2 (hosts-1)/hosts`` of the float32 tensor over its link) / the measured
time; the fp16 row uses the same float32 ideal, so it can exceed 1. Median (min-max)
over repeats, each the slowest rank's mean over back-to-back calls.

Needs root (network namespaces). Run:
``python benchmarks/link.py [--quick] [--rates 1gbit,10gbit] [--slots 1,2]``.
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
FULL_SIZES = [2**20, 16 * 2**20, 64 * 2**20, 256 * 2**20]
QUICK_SIZES = [4 * 2**20, 41 * 2**20]
SMOKE_SIZES = [2**20]
_RATE_BITS = {"gbit": 1e9, "mbit": 1e6}


def rate_bits(rate: str) -> float:
    """``"1gbit"`` -> 1e9 bits per second."""
    for unit, scale in _RATE_BITS.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: expected NUMBER followed by gbit or mbit")


def _setup(world: Any) -> dict[str, Any]:
    import horovod.torch as hvd
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from plait.collectives.horovod import HorovodCommunicator
    from plait.collectives.mpi import MPICommunicator

    pm = MPICommunicator(world.Dup())
    ph = HorovodCommunicator("torch")
    raw = world.Dup()
    addr = world.bcast(socket.gethostbyname(socket.gethostname()) if world.rank == 0 else None)
    port = world.bcast(_free_port(addr) if world.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=world.rank,
                            world_size=world.size)
    outs: dict[int, Any] = {}
    halves: dict[int, Any] = {}

    def mpi_raw(t: Any) -> None:
        a = t.numpy()
        out = outs.setdefault(a.size, a.copy())
        raw.Allreduce(a, out, MPI.SUM)

    def fp16(t: Any) -> None:
        h = halves.setdefault(t.numel(), t.to(torch.float16))
        pm.allreduce(h, op="sum", name="bench.fp16")

    return {
        "plait-mpi": lambda t: pm.allreduce(t, op="sum", name="bench"),
        "plait-mpi-fp16": fp16,
        "mpi4py": mpi_raw,
        "gloo": lambda t: dist.all_reduce(t),
        "horovod": lambda t: hvd.allreduce(t, op=hvd.Sum, name="bench.raw"),
        "plait-horovod": lambda t: ph.allreduce(t, op="sum", name="bench"),
    }


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def worker(args: Any) -> int:
    """Runs on every rank: every implementation at every size, interleaved."""
    import numpy as np
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    impls = _setup(world)
    sizes = SMOKE_SIZES if args.smoke else QUICK_SIZES if args.quick else FULL_SIZES
    repeats = 2 if args.smoke else 3 if args.quick else 5
    samples = np.zeros((len(IMPLS), len(sizes), repeats))
    for si, nbytes in enumerate(sizes):
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        iters = 1 if nbytes >= 64 * 2**20 or args.smoke else 2
        for fn in impls.values():
            fn(t)  # warm up: connections, first-call costs
        for r in range(repeats):
            for ii, name in enumerate(IMPLS):
                world.Barrier()
                t0 = MPI.Wtime()
                for _ in range(iters):
                    impls[name](t)
                samples[ii, si, r] = (MPI.Wtime() - t0) / iters
    slowest = np.empty_like(samples)
    world.Allreduce(samples, slowest, MPI.MAX)
    if world.rank == 0:
        Path(args.out + ".samples.json").write_text(json.dumps(
            {"sizes": sizes, "impls": IMPLS, "seconds": slowest.tolist(),
             "np": world.size, "load_note": load_note(), "versions": versions()}))
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def _rows(data: dict[str, Any], rate: str, hosts: int) -> list[dict[str, Any]]:
    bits = rate_bits(rate)
    rows = []
    for ii, name in enumerate(data["impls"]):
        for si, nbytes in enumerate(data["sizes"]):
            secs = data["seconds"][ii][si]
            ideal = nbytes * 2 * (hosts - 1) / hosts * 8 / bits
            rows.append({"impl": name, "bytes": nbytes, "rate": rate, "np": data["np"],
                         "ms": stats([s * 1e3 for s in secs]),
                         "link_fraction": stats([ideal / s for s in secs])})
    return rows


def _markdown(rows: list[dict[str, Any]], m: dict[str, Any]) -> str:
    out = ["## Allreduce across 2 emulated hosts (float32, sum)\n\n",
           f"{m['machine'].get('cores')} cores; load per run below; fraction of the link rate, "
           "median (min–max) over repeats; ms = median time.\n"]
    for (rate, np_), note in m["runs"].items() if isinstance(m["runs"], dict) else []:
        sub = [r for r in rows if r["rate"] == rate and r["np"] == np_]
        sizes = sorted({r["bytes"] for r in sub})
        by = {(r["impl"], r["bytes"]): r for r in sub}

        def cell(r: dict[str, Any]) -> str:
            f = r["link_fraction"]
            return f"{f['median']:.2f} ({f['min']:.2f}–{f['max']:.2f}) {r['ms']['median']:.0f} ms"

        out.append(f"\n### {rate}, {np_} ranks ({note})\n\n")
        out.append(md_table(["size", *IMPLS], [[fmt_bytes(s), *(cell(by[(i, s)]) for i in IMPLS)]
                                               for s in sizes]))
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    def extra(p: Any) -> None:
        p.add_argument("--rates", default="1gbit", help="comma-separated tc rates (default 1gbit)")
        p.add_argument("--slots", default="1", help="ranks per host, comma-separated (default 1)")

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
                       sys.executable, str(Path(__file__).resolve()), "--worker", "1",
                       "--out", out, *(["--quick"] if args.quick else []),
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
