"""Resumable 2-rank digits training, killed at chosen points (tests/test_fault_tolerance.py).

Run by ``plait run --restarts R`` on every rank (a script, not a pytest file).
Environment:
    FT_DATA     .npz with the digits (x, y); FT_DIR checkpoint directory; FT_OUT final weights.
    FT_STEPS    steps to train; FT_EVERY checkpoint interval; FT_BASE_SIZE ranks planned.
    FT_KILL     "attempt:rank:step[:w];..." -- SIGKILL that rank of that attempt just before
                step (``w``: during the checkpoint written after that step).
    FT_BATCH    global batch (default 64), kept when the world shrinks (PLAIT_ELASTIC_POLICY).
    FT_SLEEP    seconds to sleep per step (to give an outside test time to act).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import threading
import time


def kill_points() -> dict[tuple[int, int], tuple[int, bool]]:
    points = {}
    for item in filter(None, os.environ.get("FT_KILL", "").split(";")):
        a, r, s, *w = item.split(":")
        points[(int(a), int(r))] = (int(s), bool(w))
    return points


def main() -> None:
    import numpy as np
    import torch

    import plait
    from plait.checkpoint import Checkpoint
    from plait.elastic import plan, restart_count

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    comm = plait.init()  # on the MPI backend an uncaught error aborts the whole job
    attempt = restart_count()
    rank, size = comm.rank, comm.size
    steps, every = int(os.environ["FT_STEPS"]), int(os.environ.get("FT_EVERY", "2"))
    base = int(os.environ.get("FT_BASE_SIZE", str(size)))
    sleep = float(os.environ.get("FT_SLEEP", "0"))
    kill = kill_points().get((attempt, rank))

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    with np.load(os.environ["FT_DATA"]) as data:  # sklearn's load_digits, saved by the test
        x_all = torch.tensor(data["x"] / 16.0, dtype=torch.float32)
        y_all = torch.tensor(data["y"], dtype=torch.int64)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 10))
    p = plan(global_batch=int(os.environ.get("FT_BATCH", "64")), lr=0.05, size=size, base_size=base)
    opt = torch.optim.SGD(model.parameters(), lr=p.lr, momentum=0.9)
    ckpt = Checkpoint(os.environ["FT_DIR"], every=every, keep=2, comm=comm)
    start = ckpt.restore(model, opt)
    print(f"FT rank={rank} attempt={attempt} resumed={start} size={size} "
          f"host={socket.gethostname()}", flush=True)
    per_epoch = len(y_all) // p.global_batch
    last_loss = float("nan")  # no step left when the killed attempt had saved the last one
    for step in range(start, steps):
        if kill is not None and kill[0] == step and not kill[1]:
            os.kill(os.getpid(), signal.SIGKILL)
        perm = np.random.RandomState(1000 + step // per_epoch).permutation(len(y_all))
        batch = perm[(step % per_epoch) * p.global_batch:][: p.global_batch]
        mine = torch.from_numpy(batch[rank * p.local_batch:(rank + 1) * p.local_batch])
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x_all[mine]), y_all[mine])
        loss.backward()
        last_loss = loss.item()
        grads = [q.grad for q in model.parameters()]
        for q, g in zip(model.parameters(), comm.grouped_allreduce(grads, "average", "grads"),
                        strict=True):
            q.grad = g
        opt.step()
        if kill is not None and kill[0] == step and kill[1]:
            delay = random.Random(step).uniform(0, 0.004)
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        ckpt.step_done(step + 1, model, opt)
        if kill is not None and kill[1] and kill[0] == step:
            time.sleep(1)  # the timer fires; never go on
        if sleep:
            time.sleep(sleep)
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    every_rank = comm.allgather(flat.reshape(1, -1))
    if not all(torch.equal(every_rank[0], row) for row in every_rank):
        raise RuntimeError("replicas diverged")
    if rank == 0:
        torch.save({k: v for k, v in model.state_dict().items()}, os.environ["FT_OUT"])
        print(f"FT done size={size} loss={last_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
