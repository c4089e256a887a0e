"""A parameter-server job (1 server + 2 workers) killed and resumed (tests/test_fault_tolerance.py).

Run by ``plait run --restarts R`` on every rank (a script, not a pytest file). The
model's gradients are constants in binary fractions (worker ``w`` always pushes
``c_w``) and the optimizer is plain SGD with a power-of-two learning rate, so every
update is exact: after N steps of every worker the weights are exactly
``-lr * N * (c_0 + c_1)`` whatever the order the server applied them in. A
snapshot that lost an update or held one twice shows.

Environment:
    FT_DIR      checkpoint directory; FT_STEPS steps per worker; FT_EVERY snapshot interval.
    FT_KILL     "attempt:rank:step" -- SIGKILL that rank of that attempt just before that step.
    FT_SLEEP    seconds worker rank 2 sleeps per step (rank 1 runs ahead, held at each snapshot).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

LR = 0.0625


def constant(part: int) -> np.ndarray:
    return (np.arange(1, 9, dtype=np.float32) / 8) * (part + 1)


def expected(steps: int) -> np.ndarray:
    return -LR * steps * (constant(0) + constant(1))


def main() -> None:
    import torch

    import plait
    from plait.checkpoint import Checkpoint
    from plait.elastic import restart_count

    comm = plait.init("mpi")
    attempt, rank = restart_count(), comm.rank
    steps, every = int(os.environ["FT_STEPS"]), int(os.environ["FT_EVERY"])
    sleep = float(os.environ.get("FT_SLEEP", "0"))
    kill = None
    for item in filter(None, os.environ.get("FT_KILL", "").split(";")):
        a, r, s = (int(v) for v in item.split(":"))
        if (a, r) == (attempt, rank):
            kill = s

    model = torch.nn.Linear(8, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    dp = plait.DataParallel(comm=comm, mode="async", algorithm="ps", servers=1)
    opt = dp.optimizer(torch.optim.SGD(model.parameters(), lr=LR))
    ckpt = Checkpoint(os.environ["FT_DIR"], every=every, keep=2, comm=comm)
    start = ckpt.restore(model, opt)
    print(f"PS rank={rank} attempt={attempt} resumed={start}", flush=True)
    if opt.is_server:
        opt.serve(checkpoint=ckpt, model=model)
    else:
        c = torch.from_numpy(constant(rank - 1))
        for step in range(start, steps):
            if kill == step:
                os.kill(os.getpid(), signal.SIGKILL)
            (model.weight * c).sum().backward()
            opt.step()
            opt.zero_grad()
            ckpt.step_done(step + 1, model, opt)  # nothing on workers: the server writes
            if rank == 2:
                time.sleep(sleep)
    opt.synchronize()
    got = model.weight.detach().numpy().reshape(-1)
    if not np.array_equal(got, expected(steps)):
        raise RuntimeError(f"rank {rank}: weights {got.tolist()}, expected {expected(steps).tolist()}")
    if rank == 0:
        print(f"PS done steps={steps} exact=True", flush=True)


if __name__ == "__main__":
    main()
