"""PyTorch asynchronous data parallelism on every rank (tests/test_jobs_async.py).

Run under mpirun with 2 and 3 ranks. Each algorithm trains the digits MLP to
within 3 accuracy points of synchronous training; s=0 SSP and H=1 local SGD equal
synchronous training; a slowed rank shows SSP's bound and the parameter server's
asynchrony in the step counts; ranks that stop after different numbers of steps
shut down cleanly.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from conftest import make_comm

import plait
from plait.compression import FP16
from plait.errors import ConfigError

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)

TRAIN = 1500


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    return torch.tensor(x[order] / 16.0, dtype=torch.float32), torch.tensor(y[order])


X, Y = digits()


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


def flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def accuracy(m: torch.nn.Module) -> float:
    with torch.no_grad():
        return float((m(X[TRAIN:]).argmax(1) == Y[TRAIN:]).float().mean()) * 100


def identical_on_all_ranks(comm, m: torch.nn.Module) -> None:
    mine = flat(m)
    everyone = comm.allgather(mine.reshape(1, -1))
    for r in range(comm.size):
        assert torch.equal(everyone[r], mine), f"rank {r} differs from rank {comm.rank}"


def batch(index: int, parts: int, part: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    start = (index * size) % (TRAIN - size)
    return X[start + part : start + size : parts], Y[start + part : start + size : parts]


def train(comm, steps, mode="sync", lr=0.2, momentum=0.5, slow=None, seconds=None, step_counts=None,
          global_batch=48, **options):
    """Train; every rank joins. Returns (model, optimizer)."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum)
    dp = plait.DataParallel(comm=comm, mode=mode, **options)
    dopt = dp.optimizer(opt)
    if mode == "sync":
        dp.broadcast(m)
    loss_fn = torch.nn.CrossEntropyLoss()
    if getattr(dopt, "is_server", False):
        dopt.serve()
    else:
        ps = options.get("algorithm") in ("ps", "parameter_server")
        workers = comm.size - options.get("servers", 1) if ps else comm.size
        me = comm.rank - (comm.size - workers)
        n = step_counts[comm.rank] if step_counts else steps
        start = time.monotonic()
        step = 0
        while (step < n) if seconds is None else (time.monotonic() - start < seconds):
            xb, yb = batch(step, workers, me, global_batch)
            loss_fn(m(xb), yb).backward()
            dopt.step()
            dopt.zero_grad()
            if slow is not None and comm.rank == slow:
                time.sleep(0.02)
            step += 1
    if mode != "sync":
        dopt.synchronize()
    identical_on_all_ranks(comm, m)
    return m, dopt


@pytest.fixture(scope="module")
def comm():
    return make_comm("mpi")


@pytest.fixture(scope="module")
def sync_acc(comm):
    m, _ = train(comm, 150)
    return accuracy(m)


MODES = {
    "ps": {"algorithm": "ps"},
    "ps-bounded": {"algorithm": "parameter_server", "staleness": 2},
    "ssp": {"algorithm": "ssp", "staleness": 2},
    "local_sgd": {"algorithm": "local_sgd", "period": 4, "warmup_steps": 10},
    "local_sgd-fp16": {"algorithm": "local_sgd", "period": 4, "compression": FP16()},
    "delayed": {"algorithm": "delayed"},
    "delayed-fp16": {"algorithm": "delayed", "compression": FP16()},
    "gossip-ring": {"algorithm": "gossip"},
    "gossip-shift": {"algorithm": "gossip", "topology": "shift"},
}


@pytest.mark.parametrize("name", sorted(MODES))
def test_accuracy_close_to_sync(comm, sync_acc, name):
    m, opt = train(comm, 150, mode="async", **MODES[name])
    acc = accuracy(m)
    assert acc >= sync_acc - 3, f"{name}: {acc:.1f}% vs synchronous {sync_acc:.1f}%"
    summary = opt.gather_metrics()
    assert all(s["algorithm"] in (name.split("-")[0], "parameter_server") for s in summary)


def test_ssp_zero_is_synchronous(comm):
    sync, _ = train(comm, 25, momentum=0.0)
    ssp, opt = train(comm, 25, mode="async", momentum=0.0, algorithm="ssp", staleness=0)
    torch.testing.assert_close(flat(ssp), flat(sync), rtol=0, atol=1e-6)
    assert opt.metrics.max_staleness == 0


def test_local_sgd_period_one_is_synchronous(comm):
    sync, _ = train(comm, 25, momentum=0.0)
    local, _ = train(comm, 25, mode="async", momentum=0.0, algorithm="local_sgd", period=1)
    torch.testing.assert_close(flat(local), flat(sync), rtol=0, atol=1e-6)


def test_ssp_keeps_a_slowed_rank_within_the_bound(comm):
    _, opt = train(comm, 40, mode="async", slow=comm.size - 1, algorithm="ssp", staleness=2)
    everyone = opt.gather_metrics()
    assert all(s["max_staleness"] <= 2 for s in everyone), everyone
    assert all(s["updates"] == 40 * (comm.size - 1) for s in everyone), everyone
    fast = [s for s in everyone if s["rank"] != comm.size - 1]
    assert any(s["blocked_steps"] > 0 for s in fast), everyone


def test_parameter_server_fast_worker_does_more_steps(comm):
    _, opt = train(comm, 0, mode="async", slow=comm.size - 1, seconds=1.5, algorithm="ps")
    everyone = opt.gather_metrics()
    workers = [s for s in everyone if s["role"] == "worker"]
    server = everyone[0]
    assert server["role"] == "server" and server["steps"] == sum(w["steps"] for w in workers)
    assert server["wait_seconds"] > 0, everyone  # it waits for the pushes of the slowed worker
    assert all(w["updates"] == w["steps"] for w in workers), everyone  # one staleness per step
    if len(workers) > 1:
        assert workers[0]["steps"] > workers[-1]["steps"], everyone


@pytest.mark.parametrize("algorithm", ["ssp", "ps"])
def test_unequal_step_counts_shut_down_cleanly(comm, algorithm):
    counts = [10 + 7 * r for r in range(comm.size)]
    _, opt = train(comm, 0, mode="async", step_counts=counts, algorithm=algorithm)
    everyone = opt.gather_metrics()
    for s in everyone:
        if s["role"] == "worker":
            assert s["steps"] == counts[s["rank"]]


def test_horovod_backend(comm):
    hvd = make_comm("horovod")
    for options in ({"algorithm": "local_sgd", "period": 2}, {"algorithm": "delayed"},
                    {"algorithm": "ps"}):
        m, _ = train(hvd, 30, mode="async", **options)


def test_bad_options(comm):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="algorithm"):
        plait.DataParallel(comm=comm, mode="async", algorithm="nope").optimizer(opt)
    with pytest.raises(ConfigError, match="period"):
        plait.DataParallel(comm=comm, mode="async", algorithm="local_sgd", period=0).optimizer(opt)
    with pytest.raises(ConfigError, match="servers"):
        plait.DataParallel(comm=comm, mode="async", algorithm="ps", servers=comm.size).optimizer(opt)
    with pytest.raises(ConfigError, match="compression"):
        plait.DataParallel(comm=comm, mode="async", algorithm="ssp", compression=FP16()).optimizer(opt)
    with pytest.raises(ConfigError, match="options"):
        plait.DataParallel(comm=comm, mode="async", algorithm="gossip", period=3).optimizer(opt)
