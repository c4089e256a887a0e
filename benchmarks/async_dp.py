"""Asynchronous vs synchronous data parallelism with a straggler (torch, MPI backend).

Two worker ranks train the digits MLP for a fixed wall time; one of them is
slowed by ``--slow-factor`` (default 2x). Each step's compute is the real
forward/backward plus a simulated ``--step-ms`` of model compute (so the
straggler matters as it would for a real model; the slow rank sleeps
``factor x step-ms``). For sync and each async mode it reports the whole job's
throughput (samples/s over both workers), the accuracy on held-out digits after
``synchronize()`` and the per-rank async metrics.

The job has 3 ranks: rank 0 is the parameter server for ``parameter_server`` and
idle otherwise; ranks 1 and 2 are the workers (rank 2 is the slow one) and use a
sub-communicator for the other modes. Collective modes (sync, local SGD,
delayed, gossip) need equal step counts, so their workers agree on stopping with
a one-integer allreduce every ``period`` steps; SSP and the parameter server stop
on each worker's own clock.

    python benchmarks/async_dp.py [--quick|--smoke] [--out BASE] [--seconds S]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import launch, load_note, md_table, meta, parse_args, versions, write_results  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "sync": {},
    "parameter_server": {"algorithm": "parameter_server"},
    "ssp(s=2)": {"algorithm": "ssp", "staleness": 2},
    "local_sgd(H=4)": {"algorithm": "local_sgd", "period": 4},
    "delayed": {"algorithm": "delayed"},
    "gossip": {"algorithm": "gossip"},
}
TRAIN, BATCH = 1500, 64
SELF_PACED = ("parameter_server", "ssp")


def _extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=0, help="training wall time per mode")
    p.add_argument("--slow-factor", type=float, default=2.0, help="how much slower rank 2 is")
    p.add_argument("--step-ms", type=float, default=10.0, help="simulated compute per step (ms)")


def run_mode(world: Any, sub: Any, name: str, options: dict[str, Any], args: argparse.Namespace,
             data: tuple[Any, Any]) -> dict[str, Any] | None:
    import torch

    import plait

    x, y = data
    ps = options.get("algorithm") == "parameter_server"
    comm = world if ps else sub
    world.barrier()
    if comm is None:  # rank 0 outside the parameter server: idle
        return None
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
    base = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
    dp = plait.DataParallel(comm=comm, mode="async" if options else "sync", **options)
    opt = dp.optimizer(base)
    if not options:
        dp.broadcast(m)
    worker = world.rank - 1
    slow = args.slow_factor if world.rank == 2 else 1.0
    steps = 0
    start = time.perf_counter()
    if getattr(opt, "is_server", False):
        opt.serve()
    else:
        loss_fn = torch.nn.CrossEntropyLoss()
        check = options.get("period", 4)
        while True:
            if name.split("(")[0] in SELF_PACED:
                if time.perf_counter() - start >= args.seconds:
                    break
            elif steps % check == 0:
                late = np.array([int(time.perf_counter() - start >= args.seconds)], np.int64)
                if int(np.asarray(comm.allreduce(late, "max", name="bench.stop"))[0]):
                    break
            s = ((steps * 2 + worker) * BATCH) % (TRAIN - BATCH)
            loss_fn(m(x[s : s + BATCH]), y[s : s + BATCH]).backward()
            time.sleep(args.step_ms * slow / 1000)
            opt.step()
            opt.zero_grad()
            steps += 1
    if options:
        opt.synchronize()
    wall = time.perf_counter() - start
    with torch.no_grad():
        acc = float((m(x[TRAIN:]).argmax(1) == y[TRAIN:]).float().mean()) * 100
    summary = opt.gather_metrics() if options else None
    return {"rank": world.rank, "steps": steps, "samples": steps * BATCH, "wall": wall, "accuracy": acc,
            "metrics": summary}


def worker(args: argparse.Namespace) -> None:
    import torch
    from sklearn.datasets import load_digits

    import plait

    torch.set_num_threads(1)
    world = plait.init("mpi", check=False, timeout=120)
    if world.size != 3:
        raise SystemExit("async_dp.py runs on 3 ranks (1 parameter server + 2 workers)")
    sub = world.split(0 if world.rank > 0 else 1, world.rank)
    sub = sub if world.rank > 0 else None
    xs, ys = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(xs))
    data = (torch.tensor(xs[order] / 16.0, dtype=torch.float32), torch.tensor(ys[order]))
    warm = argparse.Namespace(**{**vars(args), "seconds": 0.3})
    run_mode(world, sub, "sync", {}, warm, data)  # warm-up (first torch and MPI calls), not reported
    world.allgather_object(None)
    rows = []
    for name, options in MODES.items():
        mine = run_mode(world, sub, name, options, args, data)
        everyone = world.allgather_object(mine)
        if world.rank == 0:
            workers = [r for r in everyone if r is not None and r["rank"] > 0]
            samples = sum(r["samples"] for r in workers)
            wall = max(r["wall"] for r in workers)
            metrics = next((r["metrics"] for r in everyone if r is not None and r["metrics"]), None)
            rows.append({"mode": name, "throughput": samples / wall, "wall_s": wall,
                         "steps_per_worker": [r["steps"] for r in workers],
                         "accuracy": workers[0]["accuracy"], "metrics": metrics})
            print(f"{name:>18}: {samples / wall:8.0f} samples/s, steps {rows[-1]['steps_per_worker']}, "
                  f"accuracy {workers[0]['accuracy']:.1f}%", flush=True)
    if world.rank == 0:
        sync = rows[0]
        for r in rows:
            r["speedup_vs_sync"] = r["throughput"] / sync["throughput"]
            r["accuracy_delta"] = r["accuracy"] - sync["accuracy"]
        table = md_table(
            ["mode", "samples/s", "x sync", "steps (fast, slow)", "accuracy %", "Δ acc", "max staleness"],
            [[r["mode"], f"{r['throughput']:.0f}", f"{r['speedup_vs_sync']:.2f}",
              ", ".join(map(str, r["steps_per_worker"])), f"{r['accuracy']:.1f}",
              f"{r['accuracy_delta']:+.1f}",
              max((m["max_staleness"] for m in r["metrics"]), default=0) if r["metrics"] else "-"]
             for r in rows])
        md = (f"# Asynchronous data parallelism with a {args.slow_factor:g}x straggler\n\n"
              f"2 workers (rank 2 slowed {args.slow_factor:g}x), {args.seconds:g} s of training per mode, "
              f"batch {BATCH} per step, {args.step_ms:g} ms simulated compute per step; digits MLP "
              f"64-64-10, SGD lr 0.1 momentum 0.5; {load_note()}.\n\n{table}\n\n"
              "Target (from the issue, reported not asserted): each async mode >= 1.5x sync throughput "
              "at <= 2 points accuracy loss. Only the parameter server lets the fast worker run ahead "
              "without limit. SSP lets it run at most s steps ahead, which absorbs transient jitter "
              "but not a constant straggler (in the long run it moves at the slow rank's pace). "
              "Collective modes (local SGD, delayed, gossip) wait for the straggler at every "
              "averaging point; what they gain is hidden or less frequent communication, not "
              "straggler tolerance. Numbers from a shared 2-core machine are noisy (see the load).\n")
        write_results(args.out, "async_dp", rows, md,
                      meta=meta(quick=args.quick, seconds=args.seconds, slow_factor=args.slow_factor,
                                step_ms=args.step_ms, versions=versions()))
        print(md)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], extra=_extra)
    if not args.seconds:
        args.seconds = 0.5 if args.smoke else 2.0 if args.quick else 8.0
    if not args.worker:
        args.np = 3
        raise SystemExit(launch(__file__, args, forward=["--seconds", str(args.seconds),
                                                         "--slow-factor", str(args.slow_factor),
                                                         "--step-ms", str(args.step_ms)]))
    worker(args)


if __name__ == "__main__":
    main()
