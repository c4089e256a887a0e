"""plait.torch's SyncBatchNorm and sparse_allreduce_async against single-process torch
references (and real Horovod where it runs), on the world backend chosen by
PLAIT_BACKEND (tests/test_jobs.py runs both)."""

from __future__ import annotations

import pytest
import torch

import plait.torch as hvd

hvd.init()


def _rows(total_extra: int = 3) -> tuple[int, int, int]:
    """Uneven rows per rank: rank r has r + ``total_extra``; returns (start, end, total)."""
    n = hvd.size()
    counts = [r + total_extra for r in range(n)]
    start = sum(counts[: hvd.rank()])
    return start, start + counts[hvd.rank()], sum(counts)


def _pair(dim: int, c: int, **kw: object) -> tuple[torch.nn.Module, hvd.SyncBatchNorm]:
    ref = (torch.nn.BatchNorm1d if dim == 1 else torch.nn.BatchNorm2d)(c, **kw)  # type: ignore[arg-type]
    sync = hvd.SyncBatchNorm(c, **kw)  # type: ignore[arg-type]
    if ref.affine:
        with torch.no_grad():
            ref.weight.copy_(torch.linspace(0.5, 1.5, c))
            ref.bias.copy_(torch.linspace(-0.2, 0.3, c))
    sync.load_state_dict(ref.state_dict())
    return ref, sync


def _check_step(ref: torch.nn.Module, sync: torch.nn.Module, shape: tuple[int, ...], seed: int,
                extra: int = 3) -> None:
    start, end, total = _rows(extra)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((total,) + shape, generator=gen) * 3 + 1
    upstream = torch.randn((total,) + shape, generator=gen)
    xr = x.clone().requires_grad_(True)
    y_ref = ref(xr)
    (y_ref * upstream).sum().backward()
    xs = x[start:end].clone().requires_grad_(True)
    y = sync(xs)
    (y * upstream[start:end]).sum().backward()
    torch.testing.assert_close(y, y_ref[start:end].detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(xs.grad, xr.grad[start:end], atol=1e-5, rtol=1e-5)
    for a, b in zip(ref.buffers(), sync.buffers()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    if getattr(ref, "affine", False):  # local weight gradients sum to the global batch's
        for p_ref, p in zip(ref.parameters(), sync.parameters()):
            torch.testing.assert_close(hvd.allreduce(p.grad, op=hvd.Sum), p_ref.grad, atol=1e-5,
                                       rtol=1e-5)
    for m in (ref, sync):
        m.zero_grad()


@pytest.mark.parametrize("dim,shape", [(1, (4,)), (1, (4, 5)), (2, (3, 4, 2))])
@pytest.mark.parametrize("kw", [{}, {"momentum": None}, {"affine": False},
                                {"track_running_stats": False}])
def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch(dim, shape, kw):
    ref, sync = _pair(dim, shape[0], **kw)
    for seed in (1, 2):  # two training steps: the running statistics accumulate
        _check_step(ref, sync, shape, seed)
    ref.eval(), sync.eval()
    _check_step(ref, sync, shape, 3)
    assert int(sync.num_batches_tracked or 0) == int(ref.num_batches_tracked or 0)


def test_sync_batch_norm_with_a_rank_without_rows_and_float64():
    ref, sync = _pair(2, 3)
    ref, sync = ref.double(), sync.double()
    start, end, total = _rows(0)  # rank 0 has no rows
    x = torch.randn(total, 3, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    xs = x[start:end].clone().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    ref(xr).pow(2).sum().backward()
    sync(xs).pow(2).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad[start:end])
    torch.testing.assert_close(sync.running_var, ref.running_var)
    assert sync.state_dict().keys() == ref.state_dict().keys()


def test_sync_batch_norm_bad_input_raises_on_every_rank():
    sync = hvd.SyncBatchNorm(3)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        sync(torch.ones(3))
    with pytest.raises(ValueError, match="3 channels"):
        sync(torch.ones(2, 4))
    rows = 1 if hvd.rank() == 0 else 0  # one value per channel over all ranks
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync(torch.ones(rows, 3))


@pytest.mark.skipif(hvd.backend() != "horovod", reason="real Horovod runs on the Horovod backend")
def test_real_horovod_sync_batch_norm_refuses_cpu_tensors_plaits_works():
    import horovod.torch as real

    with pytest.raises(ValueError, match="GPU"):
        real.SyncBatchNorm(2)(torch.ones(4, 2))
    assert hvd.SyncBatchNorm(2)(torch.arange(8.0).reshape(4, 2)).shape == (4, 2)


def _sparse(rank: int, size: tuple[int, ...], dense: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank r: r + 1 entries, indices repeating (uncoalesced); rank 1 of 3+ ranks: none."""
    gen = torch.Generator().manual_seed(10 + rank)
    nnz = 0 if rank == 1 and hvd.size() > 2 else rank + 1
    idx = torch.stack([torch.randint(0, s, (nnz,), generator=gen) for s in size])
    idx[:, -1:] = idx[:, :1]
    vals = torch.randint(-5, 6, (nnz,) + dense, generator=gen).to(dtype)
    return torch.sparse_coo_tensor(idx, vals, size + dense, check_invariants=True)


@pytest.mark.parametrize("size,dense,dtype,op", [
    ((6,), (3,), torch.float32, hvd.Average), ((5, 4), (), torch.float64, hvd.Sum),
    ((5, 4), (), torch.int64, hvd.Sum)])
def test_sparse_allreduce_async_equals_the_dense_allreduce(size, dense, dtype, op):
    t = _sparse(hvd.rank(), size, dense, dtype)
    handle = hvd.sparse_allreduce_async(t, name="sparse", op=op)
    out = hvd.synchronize(handle)
    assert out.is_sparse and out.dtype == dtype and out.shape == t.shape and hvd.poll(handle)
    assert handle() is out  # Horovod's handle is a function
    assert out._nnz() == sum(_sparse(r, size, dense, dtype)._nnz() for r in range(hvd.size()))
    torch.testing.assert_close(out.to_dense(), hvd.allreduce(t.to_dense(), op=op))
    empty = torch.sparse_coo_tensor(torch.zeros(len(size), 0, dtype=torch.int64),
                                    torch.zeros((0,) + dense, dtype=dtype), size + dense,
                                    check_invariants=True)
    assert hvd.sparse_allreduce_async(empty, op=op)().to_dense().abs().sum() == 0
    if hvd.backend() == "horovod":  # real Horovod answers the same
        import horovod.torch as real

        real_op = real.Average if op == hvd.Average else real.Sum
        real_out = real.sparse_allreduce_async(t, name=f"real.{dtype}", op=real_op)()
        torch.testing.assert_close(real_out.to_dense(), out.to_dense())


def test_sparse_allreduce_async_errors():
    t = torch.ones(2, 2).to_sparse()
    with pytest.raises(TypeError, match="sparse COO"):
        hvd.sparse_allreduce_async(torch.ones(2))
    with pytest.raises(ValueError, match="op='max'"):
        hvd.sparse_allreduce_async(t, op=hvd.Max)
    first = hvd.sparse_allreduce_async(t, name="twice")
    with pytest.raises(ValueError, match="twice"):
        hvd.sparse_allreduce_async(t, name="twice")
    assert first().to_dense().tolist() == [[float(hvd.size())] * 2] * 2 or hvd.size() != 1
    hvd.sparse_allreduce_async(t, name="twice")()  # released once synchronized


def test_sync_batch_norm_training_with_distributed_optimizer_equals_serial():
    start, end, total = _rows()
    gen = torch.Generator().manual_seed(7)
    x, target = torch.randn(total, 3, generator=gen), torch.randn(total, 2, generator=gen)

    def model(norm: torch.nn.Module) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), norm, torch.nn.ReLU(), torch.nn.Linear(4, 2))

    serial, dist = model(torch.nn.BatchNorm1d(4)), model(hvd.SyncBatchNorm(4))
    opt_s = torch.optim.SGD(serial.parameters(), lr=0.1)
    opt_d = hvd.DistributedOptimizer(torch.optim.SGD(dist.parameters(), lr=0.1),
                                     named_parameters=dist.named_parameters())
    for _ in range(3):  # the averaged gradient of size * local_sum / total is the serial one
        opt_s.zero_grad(), opt_d.zero_grad()
        ((serial(x) - target) ** 2).sum().div(total).backward()
        ((dist(x[start:end]) - target[start:end]) ** 2).sum().mul(hvd.size() / total).backward()
        opt_s.step(), opt_d.step()
    for (name, a), b in zip(serial.state_dict().items(), dist.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=name)


def test_sync_batch_norm_and_sparse_allreduce_follow_process_set():
    import plait

    alone = plait.world().split(hvd.rank(), 0)  # every rank a group of its own
    ref, sync = _pair(1, 4)
    sync.process_set = alone
    x = torch.randn(3 + hvd.rank(), 4, generator=torch.Generator().manual_seed(hvd.rank()))
    torch.testing.assert_close(sync(x), ref(x))  # this rank's rows only
    torch.testing.assert_close(sync.running_mean, ref.running_mean)
    t = _sparse(hvd.rank(), (4,), (), torch.float32)
    out = hvd.synchronize(hvd.sparse_allreduce_async(t, op=hvd.Sum, process_set=alone))
    torch.testing.assert_close(out.to_dense(), t.to_dense())


def test_sync_batch_norm_channel_count_mismatch_fails_on_every_rank():
    from plait.errors import MismatchError

    c = 2 + hvd.rank()
    with pytest.raises(MismatchError):
        hvd.SyncBatchNorm(c)(torch.ones(2, c))
    hvd.barrier()


def test_sparse_allreduce_size_mismatch_fails_on_every_rank():
    from plait.errors import MismatchError

    t = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1), (2 + hvd.rank(),),
                                check_invariants=True)
    with pytest.raises(MismatchError, match="differ in size"):
        hvd.sparse_allreduce_async(t).wait()
    hvd.barrier()


def test_distributed_optimizer_checks_named_parameters_before_any_communication(monkeypatch):
    # Horovod checks named_parameters in the optimizer's constructor, before any
    # collective: its ValueError comes even without hvd.init(). Here the communicator
    # lookup fails loudly, so only the early check can give the ValueError.
    def no_comm(process_set=None):
        raise AssertionError("DistributedOptimizer looked up a communicator before its checks")

    monkeypatch.setattr(hvd._F, "comm", no_comm)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    chained = iter(list(a.named_parameters()) + list(b.named_parameters()))  # read once
    with pytest.raises(ValueError, match=r"duplicate names \['bias', 'weight'\]"):
        hvd.DistributedOptimizer(opt, named_parameters=chained)
    with pytest.raises(ValueError, match="optimizer parameters without a name"):
        hvd.DistributedOptimizer(opt, named_parameters=list(a.named_parameters()))
    with pytest.raises(ValueError, match=r"\(name, parameter\) pairs"):
        hvd.DistributedOptimizer(opt, named_parameters=[p for p in a.parameters()])
    monkeypatch.undo()
    # a generator of unique names is read once and works
    model = torch.nn.Sequential(a, b)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dist = hvd.DistributedOptimizer(opt, named_parameters=(kv for kv in model.named_parameters()))
    model(torch.full((1, 2), float(hvd.rank()))).sum().backward()
    dist.step()
    gathered = hvd.allgather(torch.cat([p.detach().reshape(-1) for p in model.parameters()])[None])
    torch.testing.assert_close(gathered[0], gathered[-1])


def test_distributed_optimizer_outside_its_process_set_steps_on_own_gradients_as_horovod():
    """As Horovod (its optimizer registers no hooks there and ``synchronize`` returns):
    a rank outside the optimizer's process set steps on its own gradients, while the
    set's ranks average theirs among themselves."""
    hvd.init(process_sets="dynamic")  # again: keeps the world, allows add_process_set
    members = list(range(max(1, hvd.size() - 1)))
    firsts = hvd.add_process_set(members)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        batches = [torch.full((4, 3), float(r + 1)) for r in range(hvd.size())]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), process_set=firsts)
        expected = [p.detach().clone() for p in model.parameters()]
        for r in members if hvd.rank() in members else [hvd.rank()]:
            grads = torch.autograd.grad(torch.func.functional_call(
                model, dict(model.named_parameters()), (batches[r],)).sum(), list(model.parameters()))
            for e, g in zip(expected, grads):
                e -= 0.1 * g / (len(members) if hvd.rank() in members else 1)
        model(batches[hvd.rank()]).sum().backward()
        opt.step()
        for p, e in zip(model.parameters(), expected):
            torch.testing.assert_close(p.detach(), e)
        opt.zero_grad()
        opt.synchronize()  # returns at once outside the set, as in Horovod
    finally:
        assert hvd.remove_process_set(firsts)
