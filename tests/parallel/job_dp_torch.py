"""PyTorch synchronous data parallelism on every rank, both backends (tests/test_jobs.py).

Equivalence: N ranks each on B/N rows must give the weights one process gets on
the whole batch B, and all ranks must hold identical weights after every step.
"""

from __future__ import annotations

import pytest
import torch
from plait.adapters.torch_optim import (
    broadcast_optimizer_state,
    broadcast_parameters,
    distributed_optimizer,
)

torch.use_deterministic_algorithms(True)


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


def flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def identical_on_all_ranks(comm, m: torch.nn.Module) -> None:
    mine = flat(m)
    everyone = comm.allgather(mine.reshape(1, -1))
    for r in range(comm.size):
        assert torch.equal(everyone[r], mine), f"rank {r} diverged from rank {comm.rank}"


TRAINED: list = []  # the last distributed optimizer of train()


def train(comm, steps: int, batch: int, passes: int, bucket_mb: float | None, make_opt,
          distributed: bool, set_to_none: bool = True):
    x, y = digits()
    m = model()
    opt = make_opt(m.parameters())
    if distributed:
        opt = distributed_optimizer(opt, comm, m.named_parameters(), bucket_mb=bucket_mb,
                                    backward_passes_per_step=passes)
        TRAINED[:] = [opt]
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(steps):
        for k in range(passes):
            start = ((step * passes + k) * batch) % (len(x) - batch)
            xb, yb = x[start : start + batch], y[start : start + batch]
            if distributed:
                xb, yb = xb[comm.rank :: comm.size], yb[comm.rank :: comm.size]
            loss_fn(m(xb), yb).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        if distributed:
            identical_on_all_ranks(comm, m)
    return m


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("bucket_mb", [0.0, 25.0, None])
@pytest.mark.parametrize("passes", [1, 2])
def test_matches_serial_training(comm, opt, bucket_mb, passes, monkeypatch):
    """bucket_mb=None: tuned, three candidates giving three different bucket plans
    (one gradient each, two buckets, one) tried in steps 1-10, the choice from step 11."""
    monkeypatch.setenv("PLAIT_AUTOTUNE_MB", "0,0.004,25")
    monkeypatch.setenv("PLAIT_AUTOTUNE_STEPS", "1")
    batch = 12 * comm.size
    dist = train(comm, 12, batch, passes, bucket_mb, OPTIMIZERS[opt], distributed=True)
    if bucket_mb is None:
        reducer = TRAINED[0]._plait_reducer
        assert reducer.tuner.choice in (0.0, 0.004, 25.0) and len(reducer._tried) == 3
    serial = train(comm, 12, batch, passes, bucket_mb, OPTIMIZERS[opt], distributed=False)
    torch.testing.assert_close(flat(dist), flat(serial), rtol=0, atol=1e-6)


def test_gradients_kept_between_steps_never_see_the_next_bucket(comm, monkeypatch):
    """.grad is a view of the reduced bucket, whose (pooled) buffer is reused by a later step
    only once nothing refers to it: a gradient the script kept is never overwritten, and
    zero_grad(set_to_none=False) (every .grad zeroed and accumulated into in place) still
    trains as the serial run does, with at most two fused buffers per bucket size."""
    monkeypatch.setattr("plait.collectives.pool.MIN_BYTES", 0)  # pool this small model's buckets
    x, y = digits()
    m = model()
    opt = distributed_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), comm, m.named_parameters(),
                                bucket_mb=25.0)
    kept, values = [], []
    for step in range(3):
        part = slice(step * 20 + comm.rank * 10, step * 20 + comm.rank * 10 + 10)
        torch.nn.CrossEntropyLoss()(m(x[part]), y[part]).backward()
        opt.step()
        kept.append([p.grad for p in m.parameters()])  # references, not copies
        values.append([g.clone() for g in kept[-1]])
        opt.zero_grad()
    for got, want in zip(kept, values):
        assert all(torch.equal(g, w) for g, w in zip(got, want)), "a kept gradient was overwritten"
    batch = 12 * comm.size
    dist = train(comm, 6, batch, 1, 25.0, OPTIMIZERS["sgd"], distributed=True, set_to_none=False)
    pooled = TRAINED[0]._plait_pool._by_size
    if comm.backend == "horovod":  # buckets go to Horovod as groups, reduced in place
        assert not pooled, pooled
    else:
        assert pooled and all(len(bufs) <= 2 for bufs in pooled.values()), pooled
    serial = train(comm, 6, batch, 1, 25.0, OPTIMIZERS["sgd"], distributed=False, set_to_none=False)
    torch.testing.assert_close(flat(dist), flat(serial), rtol=0, atol=1e-6)


def test_horovod_reduces_each_bucket_as_one_group(comm, monkeypatch):
    """On the Horovod backend a bucket's gradients go to Horovod as one grouped allreduce
    (Horovod fuses them on its own thread): every float bucket is a group, reduced in
    place (``.grad`` stays the tensor backward made, not a view of a fused buffer), and
    training equals the serial run.
    A group Horovod cannot take as it is (bfloat16) is left to the fused path."""
    if comm.backend != "horovod":
        return  # the MPI backend's rings need one fused buffer
    started = []
    group = comm.group_allreduce_async

    def recording(tensors, op="average", name=None):
        handle = group(tensors, op, name)
        started.append((len(tensors), handle is not None))
        return handle

    monkeypatch.setattr(comm, "group_allreduce_async", recording)
    batch = 12 * comm.size
    dist = train(comm, 4, batch, 1, 25.0, OPTIMIZERS["sgd"], distributed=True)
    assert started and all(ok for _, ok in started), started
    assert max(n for n, _ in started) == 4  # one bucket of the model's 4 gradients
    serial = train(comm, 4, batch, 1, 25.0, OPTIMIZERS["sgd"], distributed=False)
    torch.testing.assert_close(flat(dist), flat(serial), rtol=0, atol=1e-6)
    x, y = digits()  # one more step: .grad is reduced in place, not a view of a fused buffer
    torch.nn.CrossEntropyLoss()(dist(x[:8]), y[:8]).backward()
    made = [p.grad for p in dist.parameters()]
    TRAINED[0].step()
    assert all(p.grad is g and g._base is None for p, g in zip(dist.parameters(), made))
    TRAINED[0].zero_grad()
    assert group([torch.ones(3, dtype=torch.bfloat16)]) is None
    assert group([torch.ones(3), torch.ones(3, dtype=torch.float64)]) is None
    both = group([torch.full((3,), float(comm.rank)), torch.ones(2, 2)], op="sum").wait()
    want = float(sum(range(comm.size)))
    assert torch.equal(both[0], torch.full((3,), want))
    assert torch.equal(both[1], torch.full((2, 2), float(comm.size)))


def test_distributed_differs_from_local_only_training(comm):
    """Guard: without the allreduce, ranks on different shards would diverge."""
    x, y = digits()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    torch.nn.CrossEntropyLoss()(m(x[comm.rank :: comm.size][:24]), y[comm.rank :: comm.size][:24]).backward()
    opt.step()
    everyone = comm.allgather(flat(m).reshape(1, -1))
    assert not torch.equal(everyone[0], everyone[1])


def test_broadcast_makes_differently_initialised_ranks_identical(comm):
    x, y = digits()
    m = model(seed=100 + comm.rank)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    part = slice(comm.rank * 50, comm.rank * 50 + 50)
    torch.nn.CrossEntropyLoss()(m(x[part]), y[part]).backward()
    opt.step()  # optimizer state now differs per rank
    broadcast_parameters(m.state_dict(), comm, root=comm.size - 1)
    broadcast_optimizer_state(opt, comm, root=comm.size - 1)
    identical_on_all_ranks(comm, m)
    state = opt.state_dict()["state"]
    states = comm.allgather_object({k: v["exp_avg"].sum().item() for k, v in state.items()})
    assert all(s == states[0] for s in states)


def test_parameter_without_gradient_on_some_rank_does_not_hang(comm):
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    params = list(a.named_parameters(prefix="a")) + list(b.named_parameters(prefix="b"))
    opt = distributed_optimizer(torch.optim.SGD([p for _, p in params], lr=0.1), comm, params)
    x = torch.ones(2, 4)
    out = a(x) if comm.rank == 0 else b(a(x))  # b gets no gradient on rank 0
    out.sum().backward()
    opt.step()
    opt.zero_grad()
    mine = torch.cat([p.detach().reshape(-1) for _, p in params])
    everyone = comm.allgather(mine.reshape(1, -1))
    assert torch.equal(everyone[0], everyone[-1])


def test_too_many_backward_passes_is_a_clear_error(comm):
    m = model()
    opt = distributed_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), comm, m.named_parameters())
    x, y = digits()
    torch.nn.CrossEntropyLoss()(m(x[:8]), y[:8]).backward()
    with pytest.raises(RuntimeError, match="backward_passes_per_step=1"):
        torch.nn.CrossEntropyLoss()(m(x[:8]), y[:8]).backward()
    opt.synchronize()


def test_bad_arguments(comm):
    m = model()
    with pytest.raises(ValueError, match="backward_passes_per_step=0"):
        distributed_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), comm, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="named_parameters"):
        distributed_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), comm, [("only", m[0].weight)])


def test_sparse_embedding_gradients_beside_dense_ones_equal_one_process(comm):
    """Embedding(sparse=True) gives sparse gradients: allgathered (the default), beside the
    dense layer's in buckets, the steps are the same as one process's."""

    def run(distributed: bool) -> torch.Tensor:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True), torch.nn.Flatten(),
                                torch.nn.Linear(12, 3))
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        if distributed:
            opt = distributed_optimizer(opt, comm, m.named_parameters())
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            xb = torch.randint(0, 20, (4 * comm.size, 3), generator=g)
            yb = torch.randint(0, 3, (4 * comm.size,), generator=g)
            if distributed:
                xb, yb = xb[comm.rank :: comm.size], yb[comm.rank :: comm.size]
            torch.nn.functional.cross_entropy(m(xb), yb).backward()
            opt.step()
            opt.zero_grad()
        if distributed:
            identical_on_all_ranks(comm, m)
        return flat(m)

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=1e-6)


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("as_dense", [False, True], ids=["allgathered", "sparse_as_dense"])
@pytest.mark.parametrize("kind", ["embedding", "mixed"])
def test_sparse_gradients_come_back_sparse_for_sparse_adam(comm, passes, as_dense, kind):
    """Horovod's test_sparse_embeddings: SparseAdam takes only sparse gradients. By
    default their rows are allgathered (Horovod's sparse_as_dense=False): a row a rank
    touched with a zero gradient still reaches SparseAdam, which moves it (its moments),
    as one process's step does; with sparse_as_dense=True they are reduced dense and come
    back sparse (rows, as the embedding made them; no zero rows in this data). Beside
    dense gradients ("mixed", SGD) the reducer's buckets go on without the sparse one.
    The steps equal one process's on the whole batch; Horovod's ``_parameter_names``
    names every parameter."""

    def run(distributed: bool) -> torch.Tensor:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(20, 4, sparse=True)
        m = emb if kind == "embedding" else torch.nn.Sequential(emb, torch.nn.Linear(4, 3))
        opt = (torch.optim.SparseAdam(list(m.parameters()), lr=0.1) if kind == "embedding"
               else torch.optim.SGD(m.parameters(), lr=0.1))
        if distributed:
            opt = distributed_optimizer(opt, comm, backward_passes_per_step=passes,
                                        sparse_as_dense=as_dense)
            assert list(opt._parameter_names.values())[0] == "param.0"
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            for _ in range(passes):
                xb = torch.randint(0, 20, (2 * comm.size, 3), generator=g)
                xb[0, 0] = 7  # on rank 0
                coef = torch.randn(2 * comm.size, 3, 4 if kind == "embedding" else 3, generator=g)
                if step > 0 and not as_dense:
                    coef[xb == 7] = 0.0  # row 7: touched, with a zero gradient
                if distributed:
                    xb, coef = xb[comm.rank :: comm.size], coef[comm.rank :: comm.size]
                (m(xb) * coef).sum().div(xb.shape[0] * passes).backward()
            if distributed:
                opt.synchronize()
                assert emb.weight.grad.is_sparse and emb.weight.grad.sparse_dim() == 1
                assert opt._plait_apart == ({} if as_dense else {"param.0": 1})
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            opt.zero_grad()
        if distributed:
            identical_on_all_ranks(comm, m)
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=1e-6)


class _SlowInput(torch.autograd.Function):
    """Identity whose backward (the last of the model's backward) first lets every
    started bucket's collective finish in the background (where ``wait``): it only
    watches, it makes no MPI call, so only the communicator's progress thread can
    complete them. It records whether nothing was left in flight."""

    watch: list[bool] = []
    comms: list = []
    wait = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        import time

        deadline = time.monotonic() + 20
        comms = _SlowInput.comms
        while _SlowInput.wait and any(c._rings for c in comms) and time.monotonic() < deadline:
            time.sleep(0.01)
        _SlowInput.watch.append(not any(c._rings for c in comms))
        return grad


@pytest.mark.parametrize("progress", ["auto", "always"])
def test_buckets_reduce_while_backward_still_runs(comm, progress):
    """Overlap, tested structurally: the gradients of the later layers (the first buckets)
    are started before backward reaches the input, and where the progress thread drives
    Open MPI's requests (``always``; ``auto`` with two cores per rank, see
    ``Tuning.drives_requests``) they are reduced then too, with nobody waiting on them;
    else they are still in flight there (they move inside the rank's next MPI call).
    Twice: the first step checks the bucket plan, the second reduces on the reducer's
    private unchecked communicator."""
    if comm.backend != "mpi":
        return  # Horovod's own background thread overlaps; nothing of plait's to test
    from plait.collectives.mpi import MPICommunicator
    from plait.collectives.tuning import Tuning

    mine = MPICommunicator(comm.comm.Dup(), tuning=Tuning(progress=progress), timeout=comm.timeout)
    drives = mine._drive_requests
    assert drives or progress == "auto"
    torch.manual_seed(0)
    width = 1024  # 4 MiB buckets: each needs many polls of Open MPI's progress engine
    m = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)])
    opt = distributed_optimizer(torch.optim.SGD(m.parameters(), lr=0.1), mine,
                                m.named_parameters(), bucket_mb=(width + 1) * width * 4 / 2**20)
    _SlowInput.comms, _SlowInput.watch, _SlowInput.wait = [mine], [], drives
    x = torch.randn(8, width, requires_grad=True)
    m(_SlowInput.apply(x)).sum().backward()
    opt.step()
    opt.zero_grad()
    fast = opt._plait_reducer._fast
    assert fast is not None and not fast.check  # the plan was checked: the rest runs unchecked
    _SlowInput.comms = [mine, fast]
    m(_SlowInput.apply(x)).sum().backward()
    opt.step()
    assert _SlowInput.watch == [drives, drives], (
        "started buckets were not reduced during backward" if drives
        else "no bucket was started before backward reached the input")
