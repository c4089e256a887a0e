"""Horovod's elastic torch loop on the MPI backend, run by ``plait run --elastic``
(tests/test_fault_tolerance.py).

A linear model trained for EL_STEPS steps on fixed batches of 48 rows; each rank
takes its share of the batch (any world size), and the summed gradients divided
by 48 are the whole batch's, so the weights equal a one-process run whatever
relaunches and world sizes happened, as long as every committed step is applied
exactly once. Commits after every step. Environment: EL_STEPS, EL_SLEEP (seconds
per step), EL_OUT (final weights, .npy, written by rank 0), EL_PIDS (a directory:
each rank writes its pid to ``pid-RANK-RESTART`` there), EL_BLOB (MiB of zeros that the
state also carries, so that writing a commit takes a while).
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

import plait.torch as hvd

BATCH = 48


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(240, 16, generator=g), torch.randn(240, 1, generator=g)


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Linear(16, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, k: int, rank: int, size: int) -> None:
    """Step ``k``: this rank's rows of batch ``k``, gradients summed over the ranks / BATCH."""
    x, y = data()
    start = (k * BATCH) % len(x)
    rows = torch.arange(start, start + BATCH)[rank::size]
    opt.zero_grad()
    (((model(x[rows]) - y[rows]) ** 2).sum() / BATCH).backward()
    for p in model.parameters():
        if size > 1:
            p.grad = hvd.allreduce(p.grad, op=hvd.Sum, name=f"g{k}.{tuple(p.shape)}")
    opt.step()


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def main() -> None:
    hvd.init()
    if "EL_PIDS" in os.environ:
        restart = os.environ.get("PLAIT_RESTART", "0")
        with open(os.path.join(os.environ["EL_PIDS"], f"pid-{hvd.rank()}-{restart}"), "w") as f:
            f.write(str(os.getpid()))
    steps, pause = int(os.environ["EL_STEPS"]), float(os.environ.get("EL_SLEEP", "0"))
    model, opt = model_and_optimizer()
    blob = np.zeros(int(os.environ.get("EL_BLOB", "0")) << 17)  # float64: 2**17 per MiB
    state = hvd.elastic.TorchState(model, opt, batch=0, blob=blob)
    state.register_reset_callbacks([lambda: print(f"EL reset rank={hvd.rank()} size={hvd.size()}",
                                                  flush=True)])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        print(f"EL start rank={hvd.rank()} size={hvd.size()} batch={state.batch}", flush=True)
        while state.batch < steps:
            step(state.model, state.optimizer, state.batch, hvd.rank(), hvd.size())
            state.batch += 1
            time.sleep(pause)
            state.commit()

    train(state)
    every = hvd.allgather_object(flat(model))
    same = all(np.array_equal(every[0], w) for w in every)
    print(f"EL done rank={hvd.rank()} size={hvd.size()} batch={state.batch} replicas_equal={same}",
          flush=True)
    if hvd.rank() == 0:
        np.save(os.environ["EL_OUT"], flat(model))


def serial(steps: int) -> np.ndarray:
    """The one-process weights after ``steps`` steps."""
    model, opt = model_and_optimizer()
    for k in range(steps):
        step(model, opt, k, 0, 1)
    return flat(model)


if __name__ == "__main__":
    main()
