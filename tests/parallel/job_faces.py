"""Horovod's names in plait.torch / plait.tensorflow / plait.keras, and plait.DataParallel,
on the world backend chosen by PLAIT_BACKEND (tests/test_jobs.py runs both)."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402

import plait  # noqa: E402
import plait.keras as hk  # noqa: E402
import plait.tensorflow as htf  # noqa: E402
import plait.torch as hvd  # noqa: E402

hvd.init()


def test_world_queries_match_the_launcher():
    assert hvd.backend() == os.environ["PLAIT_BACKEND"]
    assert hvd.size() == int(os.environ["OMPI_COMM_WORLD_SIZE"])
    assert hvd.rank() == int(os.environ["OMPI_COMM_WORLD_RANK"])
    assert hvd.local_size() == hvd.size() and hvd.cross_size() == 1
    assert htf.rank() == hk.rank() == hvd.rank() and hvd.is_initialized()
    assert hvd.mpi_threads_supported()


def test_torch_collectives_with_horovod_signatures():
    r, n = hvd.rank(), hvd.size()
    x = torch.full((3,), float(r + 1))
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum), torch.full((3,), n * (n + 1) / 2))
    assert torch.allclose(hvd.allreduce(x, average=True), torch.full((3,), (n + 1) / 2))
    assert torch.allclose(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
                          torch.full((3,), n * (n + 1) / 2))
    fp16 = hvd.allreduce(x, op=hvd.Average, compression=hvd.Compression.fp16, name="fp16")
    assert fp16.dtype == torch.float32 and torch.allclose(fp16, torch.full((3,), (n + 1) / 2))
    h = hvd.allreduce_async(x, op=hvd.Max)
    assert torch.equal(hvd.synchronize(h), torch.full((3,), float(n))) and hvd.poll(h)
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Min) is y and torch.equal(y, torch.ones(3))
    z = torch.full((2,), float(r))
    hvd.broadcast_(z, root_rank=n - 1)
    assert torch.equal(z, torch.full((2,), float(n - 1)))
    assert hvd.allgather(torch.ones(r + 1, 2)).shape == (n * (n + 1) // 2, 2)
    out, splits = hvd.alltoall(torch.arange(float(n)), splits=torch.ones(n, dtype=torch.int32))
    assert splits == [1] * n and torch.equal(out, torch.full((n,), float(r)))
    assert hvd.broadcast_object({"r": r}, root_rank=0) == {"r": 0}
    assert hvd.allgather_object(r) == list(range(n))
    hvd.barrier()


def test_torch_allreduce_is_differentiable():
    w = torch.ones(3, requires_grad=True)
    out = hvd.allreduce(w * (hvd.rank() + 1), op=hvd.Sum)
    out.sum().backward()  # backward allreduces the upstream ones: n, times d(w * (r + 1))/dw
    assert torch.allclose(w.grad, torch.full((3,), float(hvd.size() * (hvd.rank() + 1))))


def test_tensorflow_face_and_keras_variables():
    r, n = htf.rank(), htf.size()
    t = tf.fill([2], float(r + 1))
    np.testing.assert_allclose(htf.allreduce(t, op=htf.Sum).numpy(), np.full(2, n * (n + 1) / 2))
    np.testing.assert_allclose(tf.function(lambda a: htf.allreduce(a))(t).numpy(), np.full(2, (n + 1) / 2))
    v = keras.Variable(np.full(3, float(r), dtype=np.float32))
    htf.broadcast_variables([v], root_rank=0)
    np.testing.assert_array_equal(np.asarray(v), np.zeros(3, dtype=np.float32))


def test_data_parallel_strategy_torch_equals_serial():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    dp = plait.DataParallel(comm=plait.world())
    opt = dp.optimizer(torch.optim.SGD(m.parameters(), lr=0.5), m.named_parameters())
    dp.broadcast(m, opt)
    x = torch.arange(16.0).reshape(4 * 1, 4) / 10
    y = torch.tensor([0, 1, 1, 0])
    serial = torch.nn.Linear(4, 2)
    serial.load_state_dict(m.state_dict())
    torch.nn.functional.cross_entropy(serial(x), y).backward()
    torch.optim.SGD(serial.parameters(), lr=0.5).step()
    n, r = hvd.size(), hvd.rank()
    rows = slice(r * 4 // n, (r + 1) * 4 // n)  # the jobs run on 2 ranks
    torch.nn.functional.cross_entropy(m(x[rows]), y[rows]).backward()
    opt.step()
    torch.testing.assert_close(m.weight, serial.weight, rtol=0, atol=1e-6)


def test_data_parallel_strategy_keras_fit_keeps_replicas_identical():
    keras.utils.set_random_seed(hk.rank())
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    dp = plait.DataParallel(comm=plait.world())
    model.compile(optimizer=dp.optimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x = np.random.default_rng(hk.rank()).normal(size=(8, 4)).astype(np.float32)
    model.fit(x, x[:, :2], batch_size=4, epochs=1, verbose=0, callbacks=dp.callbacks())
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    everyone = np.asarray(plait.world().allgather(flat.reshape(1, -1)))
    np.testing.assert_array_equal(everyone[0], everyone[-1])


def test_faces_reject_bad_arguments():
    with pytest.raises(plait.ConfigError, match="average= or op="):
        hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
    with pytest.raises(plait.ConfigError, match="mode='turbo'"):
        plait.DataParallel(mode="turbo")
    with pytest.raises(plait.ConfigError, match="comm="):
        hvd.init(comm=[0, 1])


def test_shards_are_disjoint_cover_the_data_and_shuffle_alike():
    from plait.parallel.sharding import shard_indices

    n, size, rank = 23, hvd.size(), hvd.rank()
    for epoch in range(3):
        mine = shard_indices(n, rank, size, epoch=epoch, seed=7)
        everyone = plait.world().allgather_object(mine.tolist())
        assert all(len(s) == -(-n // size) for s in everyone)  # padded to equal length
        assert set().union(*map(set, everyone)) == set(range(n))
        dropped = plait.world().allgather_object(
            shard_indices(n, rank, size, epoch=epoch, seed=7, drop_last=True).tolist())
        flat = [i for s in dropped for i in s]
        assert len(flat) == len(set(flat)) == (n // size) * size
    assert not np.array_equal(shard_indices(n, 0, 1, epoch=0), shard_indices(n, 0, 1, epoch=1))
    with pytest.raises(plait.ConfigError, match="rank=5"):
        shard_indices(n, 5, 2)


def test_progress_only_on_rank_zero_log_prefix_and_metric_average(capsys):
    from plait.progress import average_metrics, log, progress

    comm = plait.world()
    bar = progress(range(3), comm, disable=True)
    assert (type(bar).__name__ == "tqdm") == (comm.rank == 0) and list(bar) == [0, 1, 2]
    log(comm, "hello", 1)
    assert capsys.readouterr().out == f"[rank {comm.rank}/{comm.size}] hello 1\n"
    log(comm, "only root", root_only=True)
    assert ("only root" in capsys.readouterr().out) == (comm.rank == 0)
    assert average_metrics({"loss": float(comm.rank), "acc": 1.0}, comm) == {
        "acc": 1.0, "loss": (comm.size - 1) / 2}
