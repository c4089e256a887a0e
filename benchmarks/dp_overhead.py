"""The Python of plait's PyTorch data-parallel wrapper per training step, against the step.

``dp_step.py`` times whole steps; this one times what the wrapper itself does on the
step's critical path: the gradient hooks, the bucket bookkeeping and ``synchronize``
(writing ``.grad``), without the communicator's calls (starting and waiting for the
collectives, which the collectives benchmarks measure) and without the copy that fuses
a bucket (data, not bookkeeping). Each of those entry points is wrapped with a timer
that counts its own time only (its wrapped callees' excluded); the timers' own cost
(about ``TIMER_US`` per wrapped call, measured at the start) is left in, so the figure
is an upper bound.

Two models, batch 32 per rank, SGD, 2 ranks: ``mlp`` (784-2048-1536-10, 6 parameter
tensors, as in ``dp_step.py``) and ``deep`` (16 layers of 512, 34 tensors: more hooks
and buckets per step). Both plait backends run in the same job, interleaved repeat by
repeat, with real Horovod's ``hvd.DistributedOptimizer`` as the reference: its gradient
hooks and ``synchronize`` timed the same way, its ``allreduce_async_``,
``grouped_allreduce_async_`` and ``synchronize(handle)`` counted as the communicator's.

Run: ``python benchmarks/dp_overhead.py [--quick] [--out BASE]``.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import launch, load_note, md_table, meta, parse_args, stats, versions, write_results

BATCH = 32
MODELS = {"mlp": [784, 2048, 1536, 10], "deep": [784] + [512] * 16 + [10]}
IMPLS = ["plait-mpi", "plait-horovod", "horovod"]


class Timers:
    """Per-label seconds spent in wrapped functions, each excluding its wrapped callees."""

    def __init__(self) -> None:
        self.own: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self._stack: list[float] = []

    def wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        """``fn`` timed under ``label``."""
        stack, own, calls = self._stack, self.own, self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t0
                own[label] += spent - stack.pop()
                calls[label] += 1
                if stack:
                    stack[-1] += spent
        return timed

    def patch(self, cls: Any, name: str, label: str) -> None:
        """Time ``cls.name`` under ``label`` from now on."""
        setattr(cls, name, self.wrap(getattr(cls, name), label))


def _instrument(timers: Timers) -> None:
    """Wrap the wrapper's entry points and the communicator's (before any optimizer is made:
    the hooks and the reducer keep bound methods)."""
    from plait.adapters import torch_optim
    from plait.collectives import base, mpi_wait
    from plait.collectives.horovod import HorovodCommunicator
    from plait.collectives.mpi import MPICommunicator

    make_hook = torch_optim._Distributed._plait_hook

    def plait_hook(self: Any, name: str) -> Any:
        return timers.wrap(make_hook(self, name), "wrapper")

    torch_optim._Distributed._plait_hook = plait_hook  # type: ignore[method-assign]
    timers.patch(torch_optim._Distributed, "synchronize", "wrapper")
    timers.patch(torch_optim._Distributed, "_plait_fuse", "fuse")
    for cls in (MPICommunicator, HorovodCommunicator):
        for name in ("allreduce_async", "group_allreduce_async", "step_notice"):
            if hasattr(cls, name):
                timers.patch(cls, name, "comm")
    for handle in (base.Done, base.Pending, base.MappedHandle, mpi_wait._Flight):
        timers.patch(handle, "wait", "comm")
    # real Horovod: its optimizer module's own names for the library's calls
    from horovod.torch import optimizer as hvd_optim

    for name in ("allreduce_async_", "grouped_allreduce_async_", "synchronize"):
        setattr(hvd_optim, name, timers.wrap(getattr(hvd_optim, name), "comm"))
    hvd_make_hook = hvd_optim._DistributedOptimizer._make_hook

    def hvd_hook(self: Any, p: Any) -> Any:
        return timers.wrap(hvd_make_hook(self, p), "wrapper")

    hvd_optim._DistributedOptimizer._make_hook = hvd_hook  # type: ignore[method-assign]
    timers.patch(hvd_optim._DistributedOptimizer, "synchronize", "wrapper")


def _timer_cost(timers: Timers) -> float:
    """Seconds one wrapped call adds (a wrapped no-op, timed alone)."""
    noop = timers.wrap(lambda: None, "_noop")
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        noop()
    spent = (time.perf_counter() - t0) / n
    del timers.own["_noop"], timers.calls["_noop"]
    return spent


def worker(args: Any) -> dict[str, Any]:
    """Both plait backends and real Horovod, both models; results on rank 0."""
    import horovod.torch as hvd
    import numpy as np
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    timers = Timers()
    _instrument(timers)
    from plait.adapters.torch_optim import distributed_optimizer
    from plait.collectives.horovod import HorovodCommunicator
    from plait.collectives.mpi import MPICommunicator

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comms = {"plait-mpi": MPICommunicator(world.Dup()), "plait-horovod": HorovodCommunicator("torch")}
    repeats, steps = (2, 2) if args.smoke else (3, 10) if args.quick else (7, 20)
    warmup = 2 if args.smoke else 20  # past the bucket-size tuning (4 sizes x 4 steps, and one)
    timer_s = _timer_cost(timers)
    out: dict[str, Any] = {"timer_us": timer_s * 1e6, "models": {}}
    for kind, widths in MODELS.items():
        g = torch.Generator().manual_seed(world.rank)
        x = torch.randn(BATCH, widths[0], generator=g)
        y = torch.randint(0, 10, (BATCH,), generator=g)
        runs: dict[str, Callable[[], None]] = {}
        for name in IMPLS:
            torch.manual_seed(0)
            layers: list[Any] = []
            for a, b in zip(widths[:-1], widths[1:]):
                layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
            model = torch.nn.Sequential(*layers[:-1])
            sgd = torch.optim.SGD(model.parameters(), lr=0.01)
            if name == "horovod":
                opt = hvd.DistributedOptimizer(sgd, named_parameters=[
                    (f"{kind}.{n}", p) for n, p in model.named_parameters()])
            else:
                opt = distributed_optimizer(sgd, comms[name], model.named_parameters())

            def step(model: Any = model, opt: Any = opt, x: Any = x, y: Any = y) -> None:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            runs[name] = step
            for _ in range(warmup):
                step()
            world.Barrier()
        samples = {name: {"step": [], "wrapper": [], "calls": []} for name in IMPLS}
        for _ in range(repeats):
            for name, step in runs.items():
                world.Barrier()
                timers.own.clear()
                timers.calls.clear()
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                spent = time.perf_counter() - t0
                s = samples[name]
                s["step"].append(spent / steps)
                s["wrapper"].append(timers.own["wrapper"] / steps)
                s["calls"].append(sum(timers.calls.values()) / steps)
        # the slowest rank's figures
        mine = np.array([[v for s in samples.values() for v in s["step"] + s["wrapper"]]])
        top = np.empty_like(mine)
        world.Allreduce(mine, top, MPI.MAX)
        k, n = 0, repeats
        res: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters()),
                               "tensors": len(list(model.parameters())), "impls": {}}
        for name in IMPLS:
            res["impls"][name] = {"step": [float(v) for v in top[0, k:k + n]],
                                  "wrapper": [float(v) for v in top[0, k + n:k + 2 * n]],
                                  "timed_calls": float(np.median(samples[name]["calls"]))}
            k += 2 * n
        out["models"][kind] = res
        if world.rank == 0:
            print(f"  {kind} done", flush=True)
    return out


def _markdown(rows: list[dict[str, Any]], m: dict[str, Any]) -> str:
    table = [[r["model"], f"{r['params'] / 1e6:.2f}M / {r['tensors']}", r["impl"],
              f"{r['step_ms']['median']:.2f}", f"{r['wrapper_ms']['median']:.3f} "
              f"({r['wrapper_ms']['min']:.3f}–{r['wrapper_ms']['max']:.3f})",
              f"{r['share']:.1%}", f"{r['timers_ms']:.3f}"] for r in rows]
    return (f"## The PyTorch data-parallel wrapper's own Python per step, {m['np']} ranks "
            f"(batch {BATCH} per rank)\n\n"
            f"{m['load_note']}; median (min–max) over {m['repeats']} repeats of {m['steps']} steps, "
            "the slowest rank's. `wrapper ms` is the time in the wrapper's gradient hooks, "
            "bucket bookkeeping and `synchronize` (plait's; in the `horovod` rows real "
            "Horovod's `hvd.DistributedOptimizer`, in the same job), without the "
            "communicator's calls (Horovod's `allreduce_async_`, `grouped_allreduce_async_` "
            "and `synchronize(handle)`) and plait's fused copy; it includes the timers' own "
            "cost (`timers ms`, "
            f"{m['timer_us']:.2f} us per timed call), so it is an upper bound.\n\n"
            + md_table(["model", "params / tensors", "impl", "step ms", "wrapper ms",
                        "share of the step", "timers ms"], table) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    if args.worker:
        res = worker(args)
        if int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == 0:
            part = Path(f"{args.out}.part.json")
            part.parent.mkdir(parents=True, exist_ok=True)
            part.write_text(json.dumps({"results": res, "versions": versions()}))
        return 0
    print(f"dp_overhead: torch on {args.np} ranks{' (quick)' if args.quick else ''}", flush=True)
    rc = launch(__file__, args, worker="torch")
    part = Path(f"{args.out}.part.json")
    if rc != 0 or not part.exists():
        print(f"dp_overhead: the job failed (exit status {rc})", file=sys.stderr)
        return rc or 1
    data = json.loads(part.read_text())
    part.unlink()
    res = data["results"]
    rows = []
    for kind, r in res["models"].items():
        for name, v in r["impls"].items():
            step, wrapper = stats(v["step"]), stats(v["wrapper"])
            rows.append({"model": kind, "params": r["params"], "tensors": r["tensors"],
                         "impl": name, "step_ms": {k: x * 1e3 if k != "n" else x
                                                   for k, x in step.items()},
                         "wrapper_ms": {k: x * 1e3 if k != "n" else x for k, x in wrapper.items()},
                         "share": wrapper["median"] / step["median"],
                         "timers_ms": v["timed_calls"] * res["timer_us"] / 1e3})
    repeats, steps = (2, 2) if args.smoke else (3, 10) if args.quick else (7, 20)
    m = meta(quick=args.quick, smoke=args.smoke, np=args.np, repeats=repeats, steps=steps,
             batch_per_rank=BATCH, timer_us=res["timer_us"], versions=data["versions"],
             load_note=load_note())
    write_results(args.out, "dp_overhead", rows, _markdown(rows, m), m)
    for r in rows:
        print(f"  {r['model']:5s} {r['impl']:14s} step {r['step_ms']['median']:7.2f} ms, "
              f"wrapper {r['wrapper_ms']['median']:.3f} ms ({r['share']:.1%})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
