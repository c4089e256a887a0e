"""Tensor parallelism on a wide MLP: per-rank parameter memory, step time, communication volume.

Model: an input ``Linear(H, H)`` (replicated) then ``blocks`` Megatron MLP blocks
``x + fc2(gelu(fc1(x)))`` with ``fc1: H -> 4H`` column-parallel and ``fc2: 4H -> H``
row-parallel, PyTorch, SGD, synthetic data, batch ``B``, float32. Two variants
in one mpirun job on ``--np`` ranks (default 2):

* ``dense``: the whole model on rank 0 (the other ranks wait at a barrier);
* ``tp``: the same model sharded over all ranks with
  ``plait.parallel.tensor.TensorParallel`` on the MPI backend.

Each rank uses one compute thread, so dense is one core and tp=2 is two cores.
Communication is counted by a wrapper around the tensor-parallel communicator
(bytes handed to each allreduce/allgather per rank per step) and shown next to
the analytic value: 2 allreduces of the ``B x H`` activation per block (forward
of ``fc2``, backward of ``fc1``'s input). Reported, not asserted.

Run: ``python benchmarks/tensor.py [--quick|--smoke] [--out BASE] [--np N]``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    fmt_bytes,
    launch,
    load_note,
    md_table,
    meta,
    parse_args,
    stats,
    time_repeats,
    write_results,
)


class CountingComm:
    """A communicator wrapper that counts the bytes given to each collective."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.bytes: dict[str, int] = {"allreduce": 0, "allgather": 0}
        self.calls: dict[str, int] = {"allreduce": 0, "allgather": 0}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def _count(self, kind: str, t: Any) -> None:
        self.bytes[kind] += t.numel() * t.element_size()
        self.calls[kind] += 1

    def allreduce(self, t: Any, op: str = "average", name: str | None = None) -> Any:
        self._count("allreduce", t)
        return self._comm.allreduce(t, op=op, name=name)

    def allgather(self, t: Any, name: str | None = None) -> Any:
        self._count("allgather", t)
        return self._comm.allgather(t, name=name)

    def reset(self) -> None:
        self.bytes = dict.fromkeys(self.bytes, 0)
        self.calls = dict.fromkeys(self.calls, 0)


def build(width: int, blocks: int) -> Any:
    import torch

    torch.manual_seed(0)
    layers: dict[str, Any] = {"inp": torch.nn.Linear(width, width)}
    for b in range(blocks):
        layers[f"b{b}"] = torch.nn.ModuleDict({"fc1": torch.nn.Linear(width, 4 * width),
                                                "fc2": torch.nn.Linear(4 * width, width)})
    return torch.nn.ModuleDict(layers)


def forward(model: Any, x: Any, blocks: int) -> Any:
    import torch.nn.functional as F

    h = model["inp"](x)
    for b in range(blocks):
        h = h + model[f"b{b}"]["fc2"](F.gelu(model[f"b{b}"]["fc1"](h)))
    return h


def worker(args: Any) -> None:
    import torch
    from mpi4py import MPI
    from plait.collectives.mpi import MPICommunicator

    from plait.parallel.tensor import Colwise, Rowwise, TensorParallel

    torch.set_num_threads(1)
    world = MPICommunicator(MPI.COMM_WORLD.Dup(), timeout=300)
    width, blocks, batch = (256, 2, 32) if args.quick else (1024, 4, 64)
    iters, repeats = (1, 2) if args.smoke else (3, 3) if args.quick else (5, 5)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))
    target = torch.randn(batch, width, generator=torch.Generator().manual_seed(2))

    def param_bytes(m: Any) -> int:
        return sum(p.numel() * p.element_size() for p in m.parameters())

    def stepper(m: Any) -> Any:
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)

        def step() -> float:
            opt.zero_grad()
            loss = (forward(m, x, blocks) - target).square().mean()
            loss.backward()
            opt.step()
            return float(loss.detach())
        return step

    rows: list[dict[str, Any]] = []
    dense = build(width, blocks)
    if world.rank == 0:
        step = stepper(dense)
        step()
        samples = time_repeats(step, iters, repeats)
        rows.append({"variant": "dense", "ranks": 1, "param_bytes_per_rank": param_bytes(dense),
                     "step_s": stats(samples), "comm_bytes_per_step": 0, "analytic_bytes_per_step": 0})
    world.barrier()

    tp = CountingComm(world)
    plan = {f"b{b}.{n}": s for b in range(blocks) for n, s in (("fc1", Colwise()), ("fc2", Rowwise()))}
    model = TensorParallel(plan, comm=tp).apply(build(width, blocks))
    step = stepper(model)
    step()
    tp.reset()
    step()
    per_step = dict(tp.bytes)
    calls = dict(tp.calls)
    samples = time_repeats(step, iters, repeats, sync=world.barrier)
    slowest = world.allreduce(torch.tensor(samples, dtype=torch.float64), op="max").tolist()
    analytic = 2 * blocks * batch * width * 4
    rows.append({"variant": f"tp={world.size}", "ranks": world.size,
                 "param_bytes_per_rank": param_bytes(model), "step_s": stats(slowest),
                 "comm_bytes_per_step": per_step["allreduce"] + per_step["allgather"],
                 "comm_calls_per_step": calls, "analytic_bytes_per_step": analytic})
    if world.rank != 0:
        return
    header = ["variant", "ranks", "params/rank", "step (median, s)", "step min-max (s)",
              "comm/rank/step", "analytic"]
    table = [[r["variant"], r["ranks"], fmt_bytes(r["param_bytes_per_rank"]),
              f"{r['step_s']['median']:.4f}", f"{r['step_s']['min']:.4f}-{r['step_s']['max']:.4f}",
              fmt_bytes(r["comm_bytes_per_step"]), fmt_bytes(r["analytic_bytes_per_step"])]
             for r in rows]
    md = (f"# Tensor parallelism: wide MLP, H={width}, {blocks} blocks, batch {batch}\n\n"
          f"PyTorch, MPI backend, one compute thread per rank. {load_note()}.\n\n"
          + md_table(header, table)
          + "\nComm is the bytes this rank hands to allreduce/allgather per training step; analytic "
          "is 2 allreduces of the B x H float32 activation per block.\n")
    write_results(args.out, "tensor", rows, md,
                  meta=meta(quick=args.quick, width=width, blocks=blocks, batch=batch, np=world.size))


def main() -> None:
    args = parse_args("tensor parallelism: memory, step time and communication of a wide MLP")
    if not args.worker:
        raise SystemExit(launch(__file__, args))
    worker(args)


if __name__ == "__main__":
    main()
