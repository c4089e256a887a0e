"""An elastic reset lands between a gradient bucket's start and its completion.

Run by ``tests/test_jobs.py`` under ``horovodrun --gloo`` with ``PLAIT_BACKEND=horovod``
and one gradient per bucket (``PLAIT_BUCKET_MB=0``), so backward starts allreduces
that the reset (Horovod's shutdown and init, what ``hvd.elastic.run`` does between
attempts) leaves behind. Horovod's elastic examples hit this when a worker dies
during backward: ``state.sync()`` then steps the optimizer, which used to poll a
handle Horovod had cleared (``ValueError: Handle N was not created or has been
cleared``). The step after the reset must reduce the gradients again and give the
weights a serial step gives.
"""

from __future__ import annotations

import numpy as np
import torch

import plait.torch as hvd
from plait import runtime

DIM, HIDDEN, OUT, BATCH = 16, 32, 4, 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(100 + rank))


def _serial(size: int, lr: float) -> list[np.ndarray]:
    """One SGD step on the mean of every rank's gradients, in one process."""
    model = _model()
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for r in range(size):
        model.zero_grad()
        model(_batch(r)).sum().backward()
        for g, p in zip(grads, model.parameters()):
            g += p.grad / size
    with torch.no_grad():
        for g, p in zip(grads, model.parameters()):
            p -= lr * g
    return [p.detach().numpy().copy() for p in model.parameters()]


def test_step_after_reset_drops_buckets_started_before_it() -> None:
    hvd.init()
    world = runtime.world()
    assert world.backend == "horovod", "run with PLAIT_BACKEND=horovod"
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters())
    model(_batch(hvd.rank())).sum().backward()  # every bucket starts its allreduce here
    world.barrier()  # every rank resets at the same point, as hvd.elastic.run does
    generation = world.generation
    world.reset()  # type: ignore[attr-defined]
    assert world.generation == generation + 1
    opt.step()  # must not wait on the handles the reset cleared
    expected = _serial(hvd.size(), 0.5)
    for got, want in zip(model.parameters(), expected):
        np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-5, atol=1e-6)
    # and training goes on normally
    opt.zero_grad()
    model(_batch(hvd.rank())).sum().backward()
    opt.step()
    same = hvd.allgather_object([p.detach().numpy() for p in model.parameters()])
    for other in same[1:]:
        for a, b in zip(same[0], other):
            np.testing.assert_array_equal(a, b)


def test_horovod_gets_dynamic_process_sets_at_the_first_split_that_needs_one() -> None:
    """Horovod starts without dynamic process sets (they cost every background cycle an
    allgather); the first ``split`` into a real sub-group restarts it with them, and an
    elastic reset keeps them."""
    hvd.init()
    world = runtime.world()
    assert world._w.dynamic is False  # type: ignore[attr-defined]
    whole = world.split(0, hvd.rank())  # the world again: no process set, no restart
    assert world._w.dynamic is False  # type: ignore[attr-defined]
    alone = world.split(hvd.rank(), 0)  # singletons: a process set each
    assert world._w.dynamic is True  # type: ignore[attr-defined]
    assert alone.size == 1
    np.testing.assert_array_equal(alone.allreduce(torch.full((3,), float(hvd.rank())), op="sum"),
                                  np.full(3, float(hvd.rank())))
    total = float(sum(range(hvd.size())))
    for comm in (world, whole):
        np.testing.assert_array_equal(comm.allreduce(torch.full((3,), float(hvd.rank())), op="sum"),
                                      np.full(3, total))
    world.barrier()
    world.reset()  # type: ignore[attr-defined]
    assert world._w.dynamic is True  # type: ignore[attr-defined]
    again = world.split(hvd.rank(), 0)
    assert again.allreduce(torch.ones(2), op="sum").tolist() == [1.0, 1.0]
