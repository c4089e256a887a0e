"""Pipeline-parallel benchmark: measured bubble, throughput and live activations per schedule.

``python benchmarks/pipeline.py [--quick] [--stages 2] [--out PATH]`` launches
``mpirun -np STAGES`` of itself (``--worker``). Each worker builds the same
torch MLP, splits it into ``STAGES`` stages and, for every schedule and number
of micro-batches ``M``, times a few ``train_step`` calls on a fixed batch:

* measured bubble fraction: ``1 - sum(busy) / (P * makespan)``, busy being each
  rank's forward + backward seconds (the runtime's per-stage timers) and the
  makespan the slowest rank's step time (steps start after a barrier);
* theoretical bubble: ``(P - 1) / (M + P - 1)`` for GPipe and 1F1B,
  ``(P - 1) / (v * M + P - 1)`` for interleaved 1F1B with ``v`` chunks, and
  the pure simulator's value (forward 1, backward 2) next to it;
* throughput (samples/s) and its ratio to the naive model-parallel split
  (GPipe with ``M = 1``, the same batch);
* peak live micro-batch activations on any rank, measured by the runtime,
  next to the simulator's.

Results go to ``--out`` (default ``benchmarks/results/pipeline.json``) and a
markdown table next to it (``.md``). Numbers are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "pipeline.json"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small grid, finishes in under a minute")
    ap.add_argument("--stages", type=int, default=2, help="pipeline ranks (mpirun -np)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON path; .md written next to it")
    ap.add_argument("--timeout", type=int, default=900, help="seconds for the whole mpirun job")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args()


def launch(args: argparse.Namespace) -> int:
    """Run the workers under mpirun and print the markdown table."""
    env = dict(os.environ)
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "OMPI_MCA_mpi_yield_when_idle": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))})
    cmd = [shutil.which("mpirun") or "mpirun", "-np", str(args.stages), "--oversubscribe",
           "--bind-to", "none", "--timeout", str(max(10, args.timeout - 10)),
           sys.executable, str(Path(__file__).resolve()), "--worker", "--stages", str(args.stages),
           "--out", str(args.out.resolve())] + (["--quick"] if args.quick else [])
    try:
        proc = subprocess.run(cmd, env=env, timeout=args.timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        print(f"benchmark killed after {args.timeout}s", file=sys.stderr)
        return 124
    if proc.returncode == 0:
        print(args.out.with_suffix(".md").read_text())
    return proc.returncode


def theory(schedule: str, p: int, m: int, v: int) -> float:
    """Closed-form bubble fraction of a schedule."""
    return (p - 1) / ((v if schedule == "interleaved" else 1) * m + p - 1)


def worker(args: argparse.Namespace) -> None:
    import torch

    import plait
    from plait.parallel.pipeline import Pipeline, get_schedule, simulate

    torch.set_num_threads(1)
    world = plait.init("mpi")
    p = world.size
    width, layers, batch, steps = (512, 8, 512, 3) if args.quick else (1024, 8, 512, 5)
    grid = [1, 4, 8] if args.quick else [1, 2, 4, 8, 16]
    rng = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=rng)
    y = torch.randint(0, 10, (batch,), generator=rng)
    rows = []
    for schedule in ("gpipe", "1f1b", "interleaved"):
        v = 2 if schedule == "interleaved" else 1
        for m in grid:
            if schedule == "interleaved" and m % p:
                continue
            torch.manual_seed(0)
            mods: list[torch.nn.Module] = []
            for _ in range(layers):
                mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
            mods.append(torch.nn.Linear(width, 10))
            pipe = Pipeline(torch.nn.Sequential(*mods), microbatches=m, schedule=schedule, comm=world,
                            balance="params", loss_fn=torch.nn.CrossEntropyLoss(),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
            pipe.train_step(x, y)  # warm-up
            walls, bubbles, peaks = [], [], []
            for _ in range(steps):
                world.barrier()
                start = time.perf_counter()
                pipe.train_step(x, y)
                wall = time.perf_counter() - start
                st = pipe.last_stats
                everyone = world.allgather_object((st.wall, st.busy, st.peak_live))
                makespan = max(w for w, _, _ in everyone)
                bubbles.append(1 - sum(b for _, b, _ in everyone) / (p * makespan))
                peaks.append(max(k for _, _, k in everyone))
                walls.append(max(world.allgather_object(wall)))
            pipe.close()
            sim = simulate(get_schedule(schedule, p, m, v))
            rows.append({
                "schedule": schedule, "stages": p, "chunks": v, "microbatches": m,
                "batch": batch, "step_s": statistics.median(walls),
                "samples_per_s": batch / statistics.median(walls),
                "bubble_measured": statistics.median(bubbles),
                "bubble_theory": theory(schedule, p, m, v),
                "bubble_simulated": sim.bubble_fraction,
                "peak_live_measured": max(peaks),
                "peak_live_simulated": max(sim.peak_activations),
            })
    naive = next(r for r in rows if r["schedule"] == "gpipe" and r["microbatches"] == 1)
    for r in rows:
        r["speedup_vs_naive"] = r["samples_per_s"] / naive["samples_per_s"]
    if world.rank == 0:
        write(rows, args, width, layers)


def write(rows: list[dict[str, float]], args: argparse.Namespace, width: int, layers: int) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"quick": args.quick, "width": width, "blocks": layers, "model": "torch MLP",
            "host_cpus": os.cpu_count(), "rows": rows}
    args.out.write_text(json.dumps(meta, indent=2) + "\n")
    lines = [
        f"Pipeline benchmark: torch MLP ({layers} x Linear({width}) + Tanh), P={rows[0]['stages']} "
        f"ranks on {os.cpu_count()} CPUs, batch {rows[0]['batch']}{' (quick)' if args.quick else ''}",
        "",
        "| schedule | M | step ms | samples/s | vs naive M=1 | bubble measured | bubble theory "
        "| bubble sim | peak live | peak live sim |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['microbatches']} | {1e3 * r['step_s']:.1f} | "
            f"{r['samples_per_s']:.0f} | {r['speedup_vs_naive']:.2f}x | {r['bubble_measured']:.3f} | "
            f"{r['bubble_theory']:.3f} | {r['bubble_simulated']:.3f} | {r['peak_live_measured']} | "
            f"{r['peak_live_simulated']} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    ns = parse()
    if ns.worker:
        worker(ns)
    else:
        sys.exit(launch(ns))
