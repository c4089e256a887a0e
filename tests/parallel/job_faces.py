"""Horovod's names in plait.torch / plait.tensorflow / plait.keras, and plait.DataParallel,
on the world backend chosen by PLAIT_BACKEND (tests/test_jobs.py runs both)."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import time
import warnings
from typing import Any

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


def test_horovods_response_cache_is_off_on_the_horovod_backend():
    """plait names every Horovod op anew: a response cache would only fill up and warn of
    each eviction in every long job (seen in the synthetic benchmark's output)."""
    if hvd.backend() == "horovod":
        assert os.environ.get("HOROVOD_CACHE_CAPACITY") == "0"


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
    assert splits.tolist() == [1] * n and torch.equal(out, torch.full((n,), float(r)))
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
    n, r = hvd.size(), hvd.rank()
    x = torch.arange(8.0 * n).reshape(2 * n, 4) / (10 * n)  # 2 rows per rank
    y = torch.tensor([0, 1] * n)
    serial = torch.nn.Linear(4, 2)
    serial.load_state_dict(m.state_dict())
    torch.nn.functional.cross_entropy(serial(x), y).backward()
    torch.optim.SGD(serial.parameters(), lr=0.5).step()
    rows = slice(2 * r, 2 * r + 2)
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
        hvd.init(comm=[0])  # a sub-group: process_sets= makes those
    hvd.init(comm=list(range(hvd.size())))  # every process, as Horovod takes it: already started
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        from mpi4py import MPI

        hvd.init(comm=MPI.COMM_WORLD)


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


# -- Horovod 0.28 signatures, gradient accumulation and error feedback through the faces ----
def _same_everywhere(flat_weights: np.ndarray) -> None:
    everyone = np.asarray(plait.world().allgather(flat_weights.reshape(1, -1)))
    for r in range(len(everyone)):
        np.testing.assert_array_equal(everyone[r], flat_weights, err_msg=f"rank {r} diverged")


def test_torch_distributed_optimizer_takes_horovods_arguments():
    m = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(m.parameters(), lr=0.1)
    # Horovod 0.28's positional order: compression, backward_passes_per_step, op,
    # gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set
    opt = hvd.DistributedOptimizer(sgd, m.named_parameters(), hvd.Compression.none, 1, hvd.Average,
                                   1.0, 0, None, False, None)
    assert isinstance(opt, torch.optim.SGD)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters(), groups=2,
                                   sparse_as_dense=True, gradient_predivide_factor=2.0)
    assert isinstance(opt, torch.optim.SGD)
    with pytest.raises(TypeError, match="nonsense"):
        hvd.DistributedOptimizer(sgd, m.named_parameters(), nonsense=1)
    with pytest.raises(plait.ConfigError, match="groups=-2"):
        hvd.DistributedOptimizer(sgd, m.named_parameters(), groups=-2)
    with pytest.raises(plait.ConfigError, match="memory="):
        hvd.DistributedOptimizer(sgd, m.named_parameters(), memory=plait.compression.Residual())


def _step_warnings(lib) -> list[int]:
    """Warnings from step() after synchronize(): outside and inside skip_synchronize()."""
    m = torch.nn.Linear(1, 1)
    opt = lib.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    counts = []
    for skip in (False, True, False):
        m(torch.ones(1, 1)).sum().backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            with opt.skip_synchronize() if skip else contextlib.nullcontext():
                opt.step()
        counts.append(sum("skip_synchronize()" in str(w.message) for w in ws))
        opt.zero_grad()
    return counts


def test_step_after_synchronize_warns_as_horovod():
    assert _step_warnings(hvd) == [1, 0, 1]
    if hvd.backend() == "horovod":
        import horovod.torch as real

        assert _step_warnings(real) == [1, 0, 1]


def test_tf_uint16_and_executing_eagerly():
    """uint16, which Horovod's TensorFlow ops take (allgather, broadcast, reductions),
    eagerly and in a tf.function; Horovod's ``_executing_eagerly`` helper."""
    r, n = hvd.rank(), hvd.size()
    base = np.arange(6, dtype=np.uint16).reshape(3, 2)
    x = tf.constant(base + r)
    g = htf.allgather(x)
    assert g.dtype == tf.uint16 and g.numpy().tolist() == np.concatenate(
        [base + q for q in range(n)]).tolist()
    b = htf.broadcast(x, root_rank=n - 1)
    assert b.dtype == tf.uint16 and b.numpy().tolist() == (base + n - 1).tolist()
    s = htf.allreduce(x, op=htf.Sum)
    assert s.dtype == tf.uint16 and s.numpy().tolist() == sum(base + q for q in range(n)).tolist()
    big = htf.allreduce(tf.fill([70001], tf.constant(r + 1, tf.uint16)), op=htf.Sum)
    assert big.dtype == tf.uint16 and set(big.numpy().tolist()) == {n * (n + 1) // 2}
    assert htf._executing_eagerly()

    @tf.function
    def f(t):
        assert not htf._executing_eagerly()
        return htf.allgather(t), htf.allreduce(t, op=htf.Max)

    ga, m = f(x)
    assert ga.dtype == tf.uint16 and m.numpy().tolist() == (base + n - 1).tolist()


def test_keras_and_tf_faces_take_horovods_arguments():
    opt = hk.DistributedOptimizer(
        keras.optimizers.SGD(0.1), name="d", device_dense="", device_sparse="",
        compression=hk.Compression.fp16, sparse_as_dense=True, gradient_predivide_factor=1.0,
        op=hk.Sum, backward_passes_per_step=2, average_aggregated_gradients=True, num_groups=0,
        groups=None, process_set=None, scale_local_gradients=True)
    assert isinstance(opt, keras.optimizers.SGD)
    assert isinstance(htf.DistributedOptimizer(keras.optimizers.Adam(), backward_passes_per_step=3),
                      keras.optimizers.Adam)
    with pytest.raises(TypeError, match="nonsense"):
        hk.DistributedOptimizer(keras.optimizers.SGD(0.1), nonsense=True)
    with pytest.raises(plait.ConfigError, match="op='max'"):
        hk.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hk.Max)
    with pytest.raises(plait.ConfigError, match="backward_passes_per_step=0"):
        hk.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)
    tape = htf.DistributedGradientTape(tf.GradientTape(), "", "", htf.Compression.none, False,
                                       htf.Average, 1.0, 0, None, None, True)
    assert hasattr(tape, "gradient")
    with pytest.raises(TypeError, match="backward_passes_per_step"):  # as in Horovod
        htf.DistributedGradientTape(tf.GradientTape(), backward_passes_per_step=2)


class _SameAfterEachBatch(keras.callbacks.Callback):
    """Checks after every batch that the model's weights are equal on every rank, and keeps
    them (flat) in ``seen``."""

    def __init__(self, seen: list[np.ndarray]) -> None:
        super().__init__()
        self.seen = seen

    def on_train_batch_end(self, batch, logs=None):
        flat = np.concatenate([w.ravel() for w in self.model.get_weights()])
        _same_everywhere(flat)
        self.seen.append(flat)


def test_keras_face_gradient_accumulation_in_fit():
    keras.utils.set_random_seed(hk.rank())
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    opt = hk.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2)
    model.compile(optimizer=opt, loss="mse")
    x = np.random.default_rng(hk.rank()).normal(size=(16, 4)).astype(np.float32)
    seen: list[np.ndarray] = []

    model.fit(x, x[:, :2], batch_size=4, epochs=1, verbose=0, shuffle=False,
              callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0), _SameAfterEachBatch(seen)])
    assert int(opt.iterations) == 2 and len(seen) == 4
    # applied after the 2nd and 4th batch only
    assert not np.array_equal(seen[0], seen[1]) and np.array_equal(seen[1], seen[2])
    assert not np.array_equal(seen[2], seen[3])


def test_keras_broadcast_callback_on_a_model_built_by_its_first_batch():
    """A Sequential without an input shape has no variables until its first batch: the
    callback broadcasts after that batch, as Horovod's (it built the optimizer on no
    variables, and the first step raised "Unknown variable")."""
    keras.utils.set_random_seed(hk.rank())
    model = keras.Sequential([keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    x = np.random.default_rng(hk.rank()).normal(size=(12, 4)).astype(np.float32)
    seen: list[np.ndarray] = []

    model.fit(x, x[:, :2], batch_size=4, epochs=1, verbose=0, shuffle=False,
              callbacks=[hk.callbacks.BroadcastGlobalVariablesCallback(0), _SameAfterEachBatch(seen)])
    assert len(seen) == 3
    _same_everywhere(np.concatenate([np.ravel(v) for v in model.optimizer.variables]))


def _torch_run(compression, memory, steps: int = 4) -> np.ndarray:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.5),
                                   named_parameters=m.named_parameters(),
                                   compression=compression, memory=memory)
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(steps):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        _same_everywhere(torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy())
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy()


def test_torch_face_topk_with_error_feedback_memory():
    from plait.compression import Residual, TopK

    memory = Residual()
    with_memory = _torch_run(TopK(0.1), memory)
    assert memory.residuals, "the memory was never used"
    without = _torch_run(TopK(0.1), None)
    # the dropped 90 % is fed back from the second step on: another trajectory
    assert not np.allclose(with_memory, without)


def test_tf_tape_and_keras_optimizer_with_error_feedback_memory():
    from plait.compression import Residual, TopK

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
    htf.broadcast_variables(model.variables, root_rank=0)
    tape_memory, opt_memory = Residual(), Residual()
    plain = keras.optimizers.SGD(0.5)
    dist = hk.DistributedOptimizer(keras.optimizers.SGD(0.5), compression=TopK(0.2),
                                   memory=opt_memory)
    rng = np.random.default_rng(hk.rank())
    for step in range(4):
        x = rng.normal(size=(6, 8)).astype(np.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x)))
        if step % 2 == 0:  # the tape reduces, the plain optimizer applies
            tape = htf.DistributedGradientTape(tape, compression=TopK(0.2), memory=tape_memory)
            grads = tape.gradient(loss, model.trainable_variables)
            plain.apply_gradients(zip(grads, model.trainable_variables))
        else:  # the local gradients go to the distributed optimizer
            grads = tape.gradient(loss, model.trainable_variables)
            dist.apply_gradients(zip(grads, model.trainable_variables))
        _same_everywhere(np.concatenate([w.ravel() for w in model.get_weights()]))
    assert tape_memory.residuals and opt_memory.residuals


# -- Horovod 0.28 API parity (issue 22): documented behaviour, and real Horovod where it runs ----
_QUERIES = ("mpi_built", "gloo_built", "nccl_built", "ccl_built", "cuda_built", "rocm_built",
            "ddl_built", "mpi_enabled", "gloo_enabled", "mpi_threads_supported", "is_homogeneous")


def test_build_queries_answer_for_the_backend():
    for face in (hvd, htf, hk):
        answers = {q: getattr(face, q)() for q in _QUERIES}
        if hvd.backend() == "mpi":  # plait's own MPI path: MPI only, no GPU kernels
            assert answers == {"mpi_built": True, "gloo_built": False, "nccl_built": 0,
                               "ccl_built": False, "cuda_built": False, "rocm_built": False,
                               "ddl_built": False, "mpi_enabled": True, "gloo_enabled": False,
                               "mpi_threads_supported": True, "is_homogeneous": True}
        else:  # the answers of the Horovod library this backend runs on
            from horovod.torch import mpi_ops as real  # (is_homogeneous is only there)

            assert answers == {q: getattr(real, q)() for q in _QUERIES}
            assert answers["mpi_built"] and answers["mpi_enabled"]  # started by mpirun
        assert face.sycl_built() is False  # newer Horovod's query (0.28 has none): no SYCL here


def test_compression_has_horovods_interface():
    x = torch.tensor([1.5, -2.0])
    half, ctx = hvd.Compression.fp16.compress(x)
    assert half.dtype == torch.float16 and ctx == torch.float32
    back = hvd.Compression.fp16.decompress(half, ctx)
    assert back.dtype == torch.float32 and torch.equal(back, x)
    i = torch.tensor([3, 4])
    assert hvd.Compression.fp16.compress(i)[0] is i  # integers pass unchanged, as in Horovod
    assert hvd.Compression.none.compress(x) == (x, None)
    t = tf.constant([1.5, -2.0])
    th, tctx = htf.Compression.fp16.compress(t)
    assert th.dtype == tf.float16 and tctx == tf.float32
    assert htf.Compression.fp16.decompress(th, tctx).dtype == tf.float32
    assert hk.Compression.fp16 is htf.Compression.fp16 and issubclass(hk.Compressor, object)


def test_user_compressor_subclass_works_in_allreduce_and_optimizer():
    class _Doubling(hvd.Compressor):
        """A user's Horovod compressor: sends 2x, halves after the sum; counts its calls."""

        calls = 0

        @staticmethod
        def compress(tensor):
            _Doubling.calls += 1
            return tensor * 2, None

        @staticmethod
        def decompress(tensor, ctx):
            return tensor / 2

    n = hvd.size()
    x = torch.full((3,), float(hvd.rank() + 1))
    assert torch.allclose(hvd.allreduce(x, op=hvd.Sum, compression=_Doubling),
                          torch.full((3,), n * (n + 1) / 2))
    assert _Doubling.calls == 1
    plain = _torch_run(hvd.Compression.none, None, steps=2)
    assert np.allclose(_torch_run(_Doubling, None, steps=2), plain, atol=1e-6)
    assert _Doubling.calls > 1
    np.testing.assert_allclose(htf.allreduce(tf.fill([2], 1.0), op=htf.Sum,
                                             compression=_Doubling).numpy(), np.full(2, float(n)))


def test_errors_are_the_types_horovod_raises():
    assert issubclass(plait.MismatchError, hvd.HorovodInternalError)
    assert issubclass(plait.CollectiveTimeoutError, htf.HorovodInternalError)
    assert issubclass(hvd.HorovodInternalError, RuntimeError) and hk.HorovodInternalError
    if hvd.backend() == "horovod":  # real Horovod's class is a RuntimeError too
        from horovod.common.exceptions import HorovodInternalError

        assert issubclass(HorovodInternalError, RuntimeError)
    with pytest.raises(hvd.HorovodInternalError, match="shape"):  # ranks disagree on the shape
        hvd.allreduce(torch.ones(hvd.rank() + 1), name="mismatched")
    hvd.barrier()
    # TensorFlow: Horovod's TF ops raise FailedPreconditionError; plait's is also a MismatchError
    with pytest.raises(tf.errors.FailedPreconditionError, match="shape") as info:
        htf.allgather(tf.ones([2, hvd.rank() + 1]))
    assert isinstance(info.value, plait.MismatchError)
    htf.barrier()

    @tf.function
    def mismatched():
        return htf.allreduce(tf.ones([hvd.rank() + 2]))

    # inside a tf.function TensorFlow reports any Python error of a host op as UnknownError
    with pytest.raises(tf.errors.OpError, match="shape"):
        mismatched()
    htf.barrier()
    with tf.Graph().as_default():  # in a TF1 graph: FailedPreconditionError, as Horovod's
        op = htf.allreduce(tf.ones([hvd.rank() + 2]))
        with tf.compat.v1.Session() as sess, pytest.raises(tf.errors.FailedPreconditionError,
                                                            match="different_collectives"):
            sess.run(op)
    htf.barrier()
    x = torch.ones(4)
    h = hvd.allreduce_async(x, name="dup")
    with pytest.raises(ValueError, match="'dup'"):  # Horovod: a ValueError, raised locally
        hvd.allreduce_async(x, name="dup")
    # another kind of collective may take the name (Horovod names it "allgather.dup")
    assert hvd.allgather(x, name="dup").shape == (4 * hvd.size(),)
    assert torch.equal(hvd.synchronize(h), x)
    assert torch.equal(hvd.allreduce(x, name="dup"), x)  # free again once synchronized
    h = hvd.broadcast_async(x, 0, name="dup2")
    while not hvd.poll(h):
        pass
    assert torch.equal(hvd.broadcast(x, 0, name="dup2"), x) and torch.equal(h.wait(), x)
    h = hvd.allgather_async(x, name="dup3")  # never waited on: freed once complete
    with pytest.raises(ValueError, match="'dup3'"):  # reused at once: still in flight
        hvd.allgather_async(x, name="dup3")
    hvd.allreduce(x, name="other")
    while not h._handle.done():  # complete, but nobody waited on it through the face
        time.sleep(0.01)
    hvd.allreduce(x, name="another")  # an operation of another name frees it
    assert hvd.allgather(x, name="dup3").shape == (4 * hvd.size(),)
    # Horovod's test_horovod_*_duplicate_name_error: the first operation is never waited
    # on, and after the test's join() the next test takes its name again
    for kind in ("allreduce", "allgather", "broadcast"):
        start = getattr(hvd, f"{kind}_async")
        args = (x, 0) if kind == "broadcast" else (x,)
        start(*args, name="dup5")
        with pytest.raises(ValueError, match="'dup5'"):
            start(*args, name="dup5")
        hvd.join()
    assert torch.equal(hvd.synchronize(hvd.allreduce_async(x, name="dup5")), x)


def _initialised_state(lib) -> tuple[list[Any], list[float]]:
    """Horovod's broadcast_optimizer_state on an optimizer without state: one step with
    zero gradients first (weight decay applies), frozen parameters keep no gradient."""
    torch.manual_seed(hvd.rank())
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    trained = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([frozen, trained], lr=0.5, momentum=0.9, weight_decay=0.1)
    opt = lib.DistributedOptimizer(opt, named_parameters=[("frozen", frozen), ("trained", trained)])
    lib.broadcast_optimizer_state(opt, root_rank=0)
    grads = [None if p.grad is None else p.grad.tolist() for p in (frozen, trained)]
    return grads, trained.detach().tolist() + opt.state[trained]["momentum_buffer"].tolist()


def test_broadcast_optimizer_state_initialises_state_as_horovod():
    grads, values = _initialised_state(hvd)
    assert grads == [None, [0.0] * 3]
    np.testing.assert_allclose(values, [0.95] * 3 + [0.1] * 3, rtol=1e-6)
    if hvd.backend() == "horovod":
        import horovod.torch as real

        assert _initialised_state(real) == (grads, values)


def test_zero_d_tensors_stay_zero_d():
    r, n = hvd.rank(), hvd.size()
    s = torch.tensor(float(r + 1))
    assert hvd.allreduce(s, op=hvd.Sum).shape == () and hvd.allreduce(s, op=hvd.Sum) == n * (n + 1) / 2
    assert hvd.broadcast(s, 0).shape == () and hvd.broadcast(s, 0) == 1.0
    assert hvd.synchronize(hvd.allreduce_async(s, op=hvd.Max)).shape == ()
    assert hvd.grouped_allreduce([s, s], op=hvd.Sum)[1].shape == ()
    t = tf.constant(float(r + 1))
    assert htf.allreduce(t, op=htf.Sum).shape == () and htf.broadcast(t, 0).shape == ()
    assert tf.function(lambda a: htf.allreduce(a, op=htf.Sum))(t).shape == ()


def test_alltoall_returns_what_horovod_returns():
    r, n = hvd.rank(), hvd.size()
    even = hvd.alltoall(torch.arange(float(2 * n)))  # no splits: even parts, a tensor only
    assert isinstance(even, torch.Tensor) and even.tolist() == [float(2 * r), float(2 * r + 1)] * n
    out, received = hvd.alltoall(torch.arange(float(n)), splits=[1] * n)
    assert received.dtype == torch.int32 and received.tolist() == [1] * n
    assert isinstance(htf.alltoall(tf.range(float(n))), tf.Tensor)
    tout, trecv = htf.alltoall(tf.range(float(n)), splits=[1] * n)
    assert trecv.dtype == tf.int32 and trecv.numpy().tolist() == [1] * n
    with pytest.raises(ValueError, match="splits"):
        hvd.alltoall(torch.arange(float(n + 1)))
    for dtype in (torch.float32, torch.int64):  # Horovod's ValueError, on every rank, no exchange
        with pytest.raises(ValueError, match="32-bit integer"):
            hvd.alltoall(torch.arange(float(n)), splits=torch.ones(n, dtype=dtype))
    if hvd.backend() == "horovod":  # the same structure as real horovod.torch
        import horovod.torch as real

        assert isinstance(real.alltoall(torch.arange(float(2 * n)), name="real.a2a"), torch.Tensor)
        assert len(real.alltoall(torch.arange(float(n)), splits=torch.ones(n, dtype=torch.int32),
                                 name="real.a2a.s")) == 2


def _autograd_grads(lib) -> dict[str, list[float]]:
    """Gradients through allreduce, allgather, broadcast, alltoall and reducescatter of ``lib``."""
    r, n = lib.rank(), lib.size()
    grads = {}
    w = torch.ones(2, requires_grad=True)
    lib.allreduce(w * 1, op=lib.Sum, prescale_factor=2.0).mul(r + 1).sum().backward()
    grads["allreduce"] = w.grad.tolist()
    w = torch.ones(r + 1, requires_grad=True)  # ragged rows
    lib.allgather(w * 1).mul(r + 1).sum().backward()
    grads["allgather"] = w.grad.tolist()
    w = torch.ones(2, requires_grad=True)
    lib.broadcast(w * 1, root_rank=n - 1).mul(r + 1).sum().backward()
    grads["broadcast"] = w.grad.tolist()
    w = torch.arange(float(n), requires_grad=True)
    out, _ = lib.alltoall(w * 1, splits=torch.ones(n, dtype=torch.int32))
    out.mul(r + 1).sum().backward()
    grads["alltoall"] = w.grad.tolist()
    w = torch.ones(n * (r + 1), requires_grad=True)  # even splits, but ragged across ranks
    lib.alltoall(w * 1).mul(r + 1).sum().backward()
    grads["alltoall_even"] = w.grad.tolist()
    a, b = torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)
    outs = lib.grouped_allreduce([a * 1, b * 1], op=lib.Sum)
    (outs[0].mul(r + 1).sum() + outs[1].mul(r + 1).sum()).backward()
    grads["grouped_allreduce"] = a.grad.tolist() + b.grad.tolist()
    w = torch.ones(2 * n, requires_grad=True)
    lib.reducescatter(w * 1, op=lib.Sum).mul(r + 1).sum().backward()
    grads["reducescatter"] = w.grad.tolist()
    a, b = torch.ones(r + 1, requires_grad=True), torch.ones(1, requires_grad=True)
    outs = lib.grouped_allgather([a * 1, b * 1])
    (outs[0].mul(r + 1).sum() + outs[1].mul(r + 1).sum()).backward()
    grads["grouped_allgather"] = a.grad.tolist() + b.grad.tolist()
    a, b = torch.ones(2 * n, requires_grad=True), torch.ones(n, requires_grad=True)
    outs = lib.grouped_reducescatter([a * 1, b * 1], op=lib.Sum)
    (outs[0].mul(r + 1).sum() + outs[1].mul(r + 1).sum()).backward()
    grads["grouped_reducescatter"] = a.grad.tolist() + b.grad.tolist()
    return grads


def test_torch_collectives_are_differentiable_as_in_horovod():
    r, n = hvd.rank(), hvd.size()
    mean = (n + 1) / 2  # the average of the upstream gradients (r + 1)
    expected = {
        "allreduce": [2.0 * n * (n + 1) / 2] * 2,  # allreduce(Sum, prescale 2) of the upstream
        "allgather": [mean] * (r + 1),
        "broadcast": [mean if r == n - 1 else 0.0] * 2,
        "alltoall": [float(q + 1) for q in range(n)],
        "alltoall_even": [float(q + 1) for q in range(n) for _ in range(r + 1)],
        "grouped_allreduce": [n * (n + 1) / 2] * 3,
        "reducescatter": [float(n * (q + 1)) for q in range(n) for _ in (0, 1)],
        "grouped_allgather": [mean] * (r + 2),
        "grouped_reducescatter": [float(n * (q + 1)) for q in range(n) for _ in (0, 1)]
        + [float(n * (q + 1)) for q in range(n)],
    }
    assert _autograd_grads(hvd) == expected
    if hvd.backend() == "horovod":  # real horovod.torch gives the same gradients
        # (before test_process_sets: its ranks start different numbers of Horovod ops, and
        # real Horovod names unnamed ops, backward's too, by the process's op count)
        import horovod.torch as real

        assert _autograd_grads(real) == expected


def test_process_sets():
    r, n = hvd.rank(), hvd.size()
    with pytest.raises(ValueError, match="dynamic"):
        hvd.add_process_set([0])
    hvd.init(process_sets="dynamic")  # again: keeps the world, allows add_process_set
    assert hvd.global_process_set.size() == n and hvd.global_process_set.ranks == list(range(n))
    even = hvd.add_process_set([q for q in range(n) if q % 2 == 0])
    odd = hvd.add_process_set(hvd.ProcessSet([q for q in range(n) if q % 2]))
    mine, other = (even, odd) if r % 2 == 0 else (odd, even)
    assert mine.included() and not other.included() and mine.rank() == mine.ranks.index(r)
    assert mine.size() == len(mine.ranks) and even.process_set_id != odd.process_set_id
    # Horovod's own tests: str, ids and ranks, size_op / included_op by id on every rank
    assert str(even) == f"ProcessSet(process_set_id={even.process_set_id}, ranks={even.ranks}, " \
        "mpi_comm=None)"
    assert htf.mpi_ops._basics._get_process_set_ids_and_ranks() == {
        0: list(range(n)), even.process_set_id: even.ranks, odd.process_set_id: odd.ranks}
    assert int(htf.size_op(process_set_id=other.process_set_id)) == len(other.ranks)
    assert int(htf.process_set_included_op(process_set_id=other.process_set_id)) == 0
    with pytest.raises(ValueError, match="not part"):
        other.rank()
    with pytest.raises(ValueError, match="duplicate"):
        hvd.add_process_set(list(even.ranks))
    with pytest.raises(ValueError, match="int ranks"):  # Horovod's error type
        hvd.ProcessSet([0, "1"])
    x = torch.full((2,), float(r))
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, process_set=mine),
                       torch.full((2,), float(sum(mine.ranks))))
    with pytest.raises(ValueError, match="not a part"):
        hvd.allreduce(x, process_set=other)
    root = mine.ranks[-1]  # roots are global ranks, as in Horovod
    assert torch.equal(hvd.broadcast(x, root, process_set=mine), torch.full((2,), float(root)))
    assert hvd.broadcast_object({"r": r}, root, process_set=mine) == {"r": root}
    assert hvd.allgather_object(r, process_set=mine) == mine.ranks
    assert hvd.allgather(x[:1], process_set=mine).tolist() == [float(q) for q in mine.ranks]
    m = torch.nn.Linear(2, 1)
    with torch.no_grad():
        m.weight.fill_(float(r))
    hvd.broadcast_parameters(m.state_dict(), root_rank=root, process_set=mine)
    assert torch.all(m.weight == float(root))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1.0), m.named_parameters(),
                                   op=hvd.Sum, process_set=mine)
    opt.zero_grad()
    (m(torch.ones(1, 2)).sum() * (r + 1)).backward()
    opt.step()  # weight - sum of the members' (r + 1)
    assert torch.allclose(m.weight, torch.full((1, 2), float(root - sum(q + 1 for q in mine.ranks))))
    np.testing.assert_allclose(
        htf.allreduce(tf.fill([2], float(r)), op=htf.Sum, process_set=mine).numpy(),
        np.full(2, float(sum(mine.ranks))))
    assert int(htf.size_op(process_set=mine)) == mine.size() and int(htf.rank_op()) == r
    assert int(htf.local_rank_op()) == htf.local_rank() and int(htf.local_size_op()) == n
    assert hvd.remove_process_set(odd) and hvd.remove_process_set(even)
    assert not hvd.remove_process_set(even) and not hvd.remove_process_set(hvd.global_process_set)
    assert even.process_set_id is None and even.size() is None
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(x, process_set=mine)
    with pytest.raises(ValueError, match="invalid"):  # as Horovod: then none is registered
        hvd.init(process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet([n])])
    twice = [hvd.ProcessSet([0]), hvd.ProcessSet([0])]
    with pytest.raises(ValueError, match="duplicate"):  # as Horovod: registered once
        hvd.init(process_sets=twice)
    assert htf.mpi_ops._basics._get_process_set_ids_and_ranks() == {0: list(range(n)), 1: [0]}
    assert twice[0].process_set_id == 1 and twice[1].process_set_id is None
    assert hvd.remove_process_set(twice[0])
    assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks() == {0: list(range(n))}
    singles = [hvd.ProcessSet([q]) for q in range(n)]
    hvd.init(process_sets=singles)
    assert [s.process_set_id for s in singles] == list(range(1, n + 1))  # freed ids reused
    assert [s.included() for s in singles] == [q == r for q in range(n)]
    # every rank runs the same ops (real Horovod's unnamed ops, later, count them)
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, process_set=singles[r]), x)
    assert all(hvd.remove_process_set(s) for s in singles)
    hvd.barrier()


def test_process_sets_from_mpi_communicators():
    """Horovod's test_process_sets_multi_comm.py: each rank's own mpi4py communicator names
    a set (a Split makes one per colour), every distinct set is registered once, and an
    entry that repeats one is refused on the ranks where it does."""
    from mpi4py import MPI

    r, n = hvd.rank(), hvd.size()
    world = MPI.COMM_WORLD
    sub = world.Split(color=r % 2, key=r)
    world_clone, sub_clone = world.Dup(), sub.Dup()
    evens = hvd.ProcessSet(range(0, n, 2))  # a clone of sub on the even ranks
    assert str(hvd.ProcessSet(sub)).startswith("ProcessSet(process_set_id=None, ranks=None, mpi_")
    with pytest.raises(NotImplementedError, match="global MPI communicator"):
        hvd.init(process_sets=[hvd.ProcessSet(sub)])
    with pytest.raises(ValueError, match="duplicate"):
        hvd.init(comm=world, process_sets=[hvd.ProcessSet(sub), hvd.ProcessSet(world_clone),
                                           hvd.ProcessSet(sub_clone), evens, hvd.ProcessSet([0])])
    mine = [hvd.ProcessSet(sub), evens, hvd.ProcessSet([0])]
    if n == 2 or r % 2 == 0:
        with pytest.raises(ValueError, match=r"duplicate process set: process_sets\[[12]\]"):
            hvd.init(comm=world, process_sets=mine)
    else:
        hvd.init(comm=world, process_sets=mine)
    mine = [hvd.ProcessSet(sub)] + ([hvd.ProcessSet([0])] if n > 2 else [])
    hvd.init(comm=world, process_sets=mine)
    assert hvd.global_process_set.mpi_comm == world
    expected = {0: list(range(n)), 1: list(range(0, n, 2)), 2: list(range(1, n, 2))}
    if n > 2:
        expected[3] = [0]
    assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks() == expected
    assert mine[0].process_set_id == 1 + r % 2 and mine[0].ranks == expected[1 + r % 2]
    assert hvd.mpi_ops._basics._comm_process_set_id(sub_clone) == 1 + r % 2
    assert htf.mpi_ops._basics._comm_process_set_id(world_clone) == 0
    x = torch.full((2,), float(r))
    assert torch.equal(hvd.allreduce(x, op=hvd.Sum, process_set=mine[0]),
                       torch.full((2,), float(sum(mine[0].ranks))))
    with pytest.raises(NotImplementedError, match="MPI communicator"):
        hvd.add_process_set(hvd.ProcessSet(sub))
    # init again maps sets already registered to their ids: one object for each, to remove
    held = [hvd.ProcessSet(ranks) for ps_id, ranks in sorted(expected.items()) if ps_id]
    hvd.init(process_sets=held)
    assert [ps.process_set_id for ps in held] == sorted(expected)[1:]
    assert all(hvd.remove_process_set(ps) for ps in held)
    assert mine[0].process_set_id is None  # every object of a removed set, as in Horovod
    assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks() == {0: list(range(n))}
    hvd.global_process_set.mpi_comm = None
    for c in (sub, world_clone, sub_clone):
        c.Free()
    hvd.barrier()


def test_grouped_forms_and_scale_factors():
    r, n = hvd.rank(), hvd.size()
    got = hvd.grouped_allgather([torch.ones(1), torch.full((2,), float(r))])
    assert got[0].shape == (n,) and got[1].tolist() == [float(q) for q in range(n) for _ in (0, 1)]
    rows = torch.arange(float(2 * n)).reshape(2 * n, 1)
    parts = hvd.grouped_reducescatter([rows, rows * 2], op=hvd.Sum)
    assert parts[0].flatten().tolist() == [float(n * (2 * r)), float(n * (2 * r + 1))]
    assert torch.equal(parts[1], parts[0] * 2)
    h = hvd.reducescatter_async(rows, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert torch.equal(hvd.synchronize(h), parts[0])
    big = torch.ones(4096 * n, 64)  # started, waited later (Horovod's test polls them)
    handles = [hvd.reducescatter_async(big, name=f"rs.poll.{i}") for i in range(4)]
    assert all(isinstance(hvd.poll(h), bool) for h in handles)
    assert all(torch.equal(hvd.synchronize(h), torch.ones(4096, 64)) for h in handles)
    with pytest.raises(NotImplementedError, match="reducescatter"):  # a RuntimeError, as
        hvd.reducescatter(rows, op=hvd.Adasum)  # Horovod's HorovodInternalError
    ts = [torch.ones(2), torch.full((1,), float(r))]
    assert hvd.grouped_allreduce_(ts, op=hvd.Sum) == ts
    assert torch.equal(ts[0], torch.full((2,), float(n)))
    i = torch.tensor([3, 5], dtype=torch.int32)  # integers: scaled, still integers
    out = hvd.allreduce(i, op=hvd.Sum, prescale_factor=2.0)
    assert out.dtype == torch.int32 and out.tolist() == [6 * n, 10 * n]
    ti = htf.allreduce(tf.constant([3, 5]), op=htf.Sum, prescale_factor=2.0, postscale_factor=0.5)
    assert ti.dtype == tf.int32 and ti.numpy().tolist() == [3 * n, 5 * n]
    tg = htf.grouped_allgather([tf.ones([1]), tf.ones([2])])
    assert [int(t.shape[0]) for t in tg] == [n, 2 * n]


def test_join_returns_the_last_rank_to_join_and_timeline_calls():
    import time

    n = hvd.size()
    time.sleep(0.5 if hvd.rank() == n - 1 else 0.0)
    assert hvd.join() == n - 1  # every rank joins; the slowest one was last
    if hvd.backend() == "horovod":  # real Horovod answers the same
        import horovod.torch as real

        time.sleep(0.5 if real.rank() == 0 else 0.0)
        assert real.join() == 0
    with pytest.raises(ValueError, match="DYNAMIC"):  # Horovod's own rule, on both backends
        hvd.start_timeline("/tmp/never.json")


def test_joined_ranks_contribute_zeros_to_the_others_allreduces():
    # Horovod's test_horovod_join_allreduce, with tensors past the header (ring and MPI
    # paths), sync, async and grouped forms, and every rank joining first in turn
    n, me = hvd.size(), hvd.rank()
    for numel, dtype, first in itertools.product((5, 300, 70_000), (torch.float32, torch.int64),
                                                 range(n)):
        torch.manual_seed(numel)
        a = torch.randint(-100, 100, (numel,)).to(dtype)
        b = torch.randint(-100, 100, (numel, 3)).to(dtype)
        last_to_join = n - 1 if first != n - 1 else n - 2
        if me == first:
            last = hvd.join()
        else:
            ha = hvd.allreduce_async(a, name="join.a", average=True)
            hb = hvd.allreduce_async(b, name="join.b", op=hvd.Sum)
            avg, total = hvd.synchronize(ha), hvd.synchronize(hb)
            grouped = hvd.grouped_allreduce([a, b], op=hvd.Sum)
            if n > 2 and me == last_to_join:
                time.sleep(0.1)  # the others join first: the last one is known
            last = hvd.join()
            expect = a * (n - 1)
            expect = expect / n if dtype.is_floating_point else expect.div(n, rounding_mode="trunc")
            # an average divides by the whole group (Horovod multiplies by 1 / n: not exact at 3)
            torch.testing.assert_close(avg, expect.to(dtype), rtol=1e-6, atol=0)
            assert torch.equal(total, b * (n - 1))
            assert torch.equal(grouped[0], a * (n - 1)) and torch.equal(grouped[1], b * (n - 1))
        assert last == last_to_join


def test_collectives_other_than_allreduce_raise_while_a_rank_has_joined():
    t = torch.ones(17, 17)
    if hvd.rank() == 0:
        assert hvd.join() == hvd.size() - 1
        return
    for call in (lambda: hvd.allgather(t), lambda: hvd.broadcast(t, 1, name="join.bcast")):
        with pytest.raises(RuntimeError, match="[Jj]oin"):  # Horovod's test catches RuntimeError
            call()
    hvd.join()


def test_distributed_optimizer_with_uneven_data_and_join():
    # rank r has 2 + r batches; a rank out of data joins, the others go on stepping with
    # its zeros in the average (Horovod's pattern for uneven data)
    n, me = hvd.size(), hvd.rank()
    torch.manual_seed(0)
    data = [[torch.randn(4, 3) for _ in range(2 + r)] for r in range(n)]
    m = torch.nn.Linear(3, 1)
    w0 = [p.detach().clone() for p in m.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                   named_parameters=m.named_parameters())
    for x in data[me]:
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()
    hvd.join()
    ref = torch.nn.Linear(3, 1)  # the serial reference: a missing rank's gradient is zero
    with torch.no_grad():
        for p, w in zip(ref.parameters(), w0):
            p.copy_(w)
    for step in range(2 + me):
        grads = []
        for r in range(n):
            ref.zero_grad()
            if step < len(data[r]):
                ref(data[r][step]).pow(2).mean().backward()
            grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone()
                          for p in ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= 0.1 * sum(g[i] for g in grads) / n
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_tensorflow_state_syncs_restores_and_commits_variables():
    # Horovod's hvd.elastic.TensorFlowState over plain variables, on both backends
    v = 1.0 if htf.rank() == 0 else 2.0
    variables = [tf.Variable(np.full((2, 2), v)), tf.Variable(np.full(2, v))]
    state = htf.elastic.TensorFlowState(variables, batch=20 + htf.rank())
    state.sync()
    assert [float(x.numpy().max()) for x in variables] == [1.0, 1.0] and state.batch == 20
    variables[0].assign(np.zeros((2, 2)))
    state.batch = 21
    state.restore()
    assert float(variables[0].numpy().min()) == 1.0 and state.batch == 20
    variables[0].assign(np.zeros((2, 2)))
    state.commit()
    state.restore()
    assert float(variables[0].numpy().max()) == 0.0
    with pytest.raises(NotImplementedError, match="session"):
        htf.elastic.TensorFlowState(variables, session=object())


def test_torch_state_syncs_restores_commits_and_resumes(tmp_path, monkeypatch):
    # Horovod's hvd.elastic.TorchState on both backends; on the MPI backend (plait's
    # relaunch state) a commit is also persisted and a fresh state resumes from it
    torch.manual_seed(hvd.rank())
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step():
        opt.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        opt.step()

    directory = hvd.broadcast_object(str(tmp_path), 0)  # one machine: rank 0's directory
    monkeypatch.setenv("PLAIT_ELASTIC_DIR", directory)
    state = hvd.elastic.TorchState(model, opt, epoch=hvd.rank())
    state.sync()
    every = hvd.allgather_object(model.weight.detach().numpy())
    assert state.epoch == 0 and all(np.array_equal(every[0], w) for w in every)
    step()
    state.epoch = 1
    state.commit()
    kept = [p.detach().clone() for p in model.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    # twice: a restored optimizer's buffers must not be the commit's own (Horovod's own
    # TorchState loads its saved optimizer state without a copy, so a second restore
    # without a commit in between would give the buffers the first one's steps left)
    for _ in range(2):
        step()
        step()
        state.epoch = 5
        state.restore()
        assert state.epoch == 1
        for p, k, m in zip(model.parameters(), kept, momentum):
            assert torch.equal(p, k) and torch.equal(opt.state[p]["momentum_buffer"], m)
    if plait.world().backend != "mpi":
        return
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    resumed = hvd.elastic.TorchState(fresh, fresh_opt, epoch=0)
    assert resumed.resume() and resumed.epoch == 1
    for p, k in zip(fresh.parameters(), kept):
        assert torch.equal(p, k)
    hvd.barrier()  # every rank has read the commit before rank 0's directory goes
    # ElasticSampler: a commit records what every rank processed; a sync re-shards the rest
    monkeypatch.delenv("PLAIT_ELASTIC_DIR")
    sampler = hvd.elastic.ElasticSampler(list(range(11)), shuffle=True, seed=3)
    ours = list(sampler)
    every = hvd.allgather_object(ours)
    assert sorted(set().union(*every)) == list(range(11)) and len(sampler) == len(ours)
    with_sampler = hvd.elastic.TorchState(model, opt, train_sampler=sampler, batch=0)
    assert with_sampler.train_sampler is sampler and "train_sampler" not in with_sampler._attrs
    sampler.record_batch(0, 2)
    with_sampler.commit()
    done = set().union(*(e[:2] for e in every))
    assert sampler.processed_indices == done
    sampler.record_batch(1, 2)  # the next commit sends only what is new
    with_sampler.commit()
    done = set().union(*(e[:4] for e in every))
    assert sampler.processed_indices == done
    with_sampler.sync()
    left = set().union(*hvd.allgather_object(list(sampler)))
    assert left == set(range(11)) - done
    assert sampler.processed_num == 2 * 2 * hvd.size()  # Horovod 0.28's count
    # a state Horovod 0.28's sampler saved: the first processed_num of the epoch's order
    order = list(range(11))
    random.Random(3 + 0).shuffle(order)
    sampler.load_state_dict({"epoch": 0, "processed_num": 4})
    assert sampler.processed_indices == set(order[:4]) and sampler.processed_num == 4
    sampler.set_epoch(1)
    assert sampler.processed_num == 0 and not sampler.processed_indices


def test_tf_face_errors_util_and_global_variables_as_horovod():
    n = htf.size()
    with pytest.raises(tf.errors.InvalidArgumentError, match="splits"):  # Horovod's error type
        htf.alltoall(tf.ones([n + 1]))
    assert htf.util._executing_eagerly()
    with pytest.raises(RuntimeError, match="eager"):
        htf.broadcast_global_variables(0)
    for bad in (lambda: htf.DistributedGradientTape(tf.GradientTape(), op=htf.Sum,
                                                    gradient_predivide_factor=2.0),
                lambda: htf.DistributedOptimizer(keras.optimizers.SGD(), op=htf.Sum,
                                                 gradient_predivide_factor=2.0),
                lambda: htf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                                 op=htf.Sum, gradient_predivide_factor=0.5)):
        with pytest.raises(ValueError, match="gradient_predivide_factor"):  # as Horovod
            bad()
    with tf.Graph().as_default():
        assert not htf.util._executing_eagerly()
        v = tf.compat.v1.Variable(float(htf.rank() + 1))
        op = htf.broadcast_global_variables(0)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(op)
            assert sess.run(v) == 1.0


# names of Horovod 0.28's modules that plait leaves out: submodules and internals
_NOT_FACES = {
    "check_extension", "mpi_lib_v2", "LocalGradientAggregationHelper",
    "broadcast_object_fn", "gradient_aggregation",
    "handle_average_backwards_compatibility", "os", "refs_to_vars", "tf", "util",
    "vars_to_refs", "version", "warnings", "K", "inspect", "is_version_greater_equal_than",
    "keras",
}


# Horovod's submodules that scripts import from (from horovod.torch.mpi_ops import Sum), and
# the names they define that plait leaves out: autograd Functions, Spark's checkpoint, helpers
_SUBMODULES = {
    "horovod.torch": ("mpi_ops", "functions", "optimizer", "sync_batch_norm", "compression", "elastic"),
    "horovod.tensorflow": ("mpi_ops", "functions", "sync_batch_norm", "compression", "elastic"),
    "horovod.tensorflow.keras": ("callbacks", "elastic"),
}
_NOT_IN_SUBMODULES = {
    "HorovodAllgather", "HorovodAllreduce", "HorovodAlltoall", "HorovodBroadcast",
    "HorovodGroupedAllgather", "HorovodGroupedAllreduce", "HorovodGroupedReducescatter",
    "HorovodReducescatter", "BestModelCheckpoint", "is_version_greater_equal_than",
}


def test_adasum_as_horovods():
    """op=Adasum on both backends: Horovod's pairwise tree (checked against real Horovod's
    results once: [3.5448606, 0.9433798, 3.1711671] for these two vectors), parallel
    gradients averaged, a zero one adding nothing, any scale; Horovod's errors elsewhere."""
    from plait.collectives.adasum import adasum

    n = hvd.size()
    if n & (n - 1):
        with pytest.raises(NotImplementedError, match="power"):
            hvd.allreduce(torch.ones(3), op=hvd.Adasum)
        return
    rows = np.random.default_rng(5).normal(size=(n, 7))
    rows[0, :3], rows[-1, :3] = [1.0, 2.0, 3.0], [3.0, -1.0, 0.5]
    for dtype, scale in ((torch.float32, 1.0), (torch.float32, 1e-30), (torch.float64, 1.0),
                         (torch.float16, 1.0)):
        mine = torch.tensor(rows[hvd.rank()] * scale, dtype=dtype)
        got = hvd.allreduce(mine, op=hvd.Adasum)
        want = adasum(np.stack([np.asarray(torch.tensor(r * scale, dtype=dtype)) for r in rows]))
        half = dtype == torch.float16  # Horovod rounds to float16 at each level of the tree
        torch.testing.assert_close(got, torch.from_numpy(want), rtol=2e-3 if half else 1e-5,
                                   atol=2e-3 if half else 0)
    if n == 2:
        got = hvd.allreduce(torch.tensor([[1.0, 2.0, 3.0], [3.0, -1.0, 0.5]][hvd.rank()]),
                            op=hvd.Adasum)
        torch.testing.assert_close(got, torch.tensor([3.5448606, 0.9433798, 3.1711671]))
    parallel = torch.tensor([1.0, -2.0, 0.5]) * (hvd.rank() + 1)
    torch.testing.assert_close(hvd.allreduce(parallel, op=hvd.Adasum),
                               torch.tensor([1.0, -2.0, 0.5]) * (n + 1) / 2)
    zero_or_one = torch.ones(4) if hvd.rank() == 0 else torch.zeros(4)
    assert torch.equal(hvd.allreduce(zero_or_one, op=hvd.Adasum), torch.ones(4))
    if hvd.backend() == "mpi":  # Horovod's torch op takes integers; plait's MPI backend not
        with pytest.raises(ValueError, match="adasum"):
            hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum)


def _adasum_reference(passes: int, steps: int, ranks: int) -> list[torch.Tensor]:
    """Horovod's Adasum optimizer worked out in one process: every rank's replica steps its own
    SGD (momentum, weight decay: per-rank state) on its own batches, the replicas' parameter
    changes are combined by Adasum's pairwise tree, and every replica moves by the result
    (after the local step with zero gradients of broadcast_optimizer_state)."""
    from plait.collectives.adasum import adasum

    replicas, opts = [], []
    for _ in range(ranks):
        torch.manual_seed(3)
        replicas.append(torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)))
        opts.append(torch.optim.SGD(replicas[-1].parameters(), lr=0.1, momentum=0.5, weight_decay=0.01))
    gens = [torch.Generator().manual_seed(100 + r) for r in range(ranks)]
    for model, opt in zip(replicas, opts):  # broadcast_optimizer_state's local step
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    for _ in range(steps):
        deltas = []
        for model, opt, g in zip(replicas, opts, gens):
            start = [p.detach().clone() for p in model.parameters()]
            for _ in range(passes):
                x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
                ((model(x) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            deltas.append([p.detach() - s0 for p, s0 in zip(model.parameters(), start)])
            with torch.no_grad():
                for p, s0 in zip(model.parameters(), start):
                    p.copy_(s0)
        combined = [torch.from_numpy(adasum(np.stack([d[i].numpy().ravel() for d in deltas])))
                    .view_as(deltas[0][i]) for i in range(len(deltas[0]))]
        for model in replicas:
            with torch.no_grad():
                for p, c in zip(model.parameters(), combined):
                    p.add_(c)
    return [p.detach() for p in replicas[0].parameters()]


def test_adasum_optimizer_steps_locally_and_combines_the_changes():
    """DistributedOptimizer(op=Adasum) as Horovod's: each rank steps on its own gradients
    (momentum stays per rank) and the ranks combine the parameters' changes with Adasum
    (bitwise the numbers of real Horovod 0.28.1 for SGD with momentum, Adam, AdamW, 2 passes
    and fp16, compared once); Horovod's errors around it."""
    n = hvd.size()
    m = torch.nn.Linear(2, 2)  # the errors first: they do not depend on the number of ranks
    with pytest.raises(plait.ConfigError, match="compression"):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                 op=hvd.Adasum, compression=plait.compression.TopK(0.5))
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                 op=hvd.Sum, gradient_predivide_factor=2.0)
    for passes in (1, 2):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5, weight_decay=0.01)
        opt = hvd.DistributedOptimizer(sgd, model.named_parameters(), op=hvd.Adasum,
                                       backward_passes_per_step=passes)
        assert isinstance(opt, torch.optim.SGD)
        hvd.broadcast_optimizer_state(opt, root_rank=0)  # a local step first, as in Horovod
        g = torch.Generator().manual_seed(100 + hvd.rank())
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
        if n & (n - 1):  # Horovod's Adasum needs a power of two of ranks
            with pytest.raises(NotImplementedError, match="power"):
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
            return
        for step in range(3):
            for k in range(passes):
                if step or k:
                    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
                ((model(x) - y) ** 2).mean().backward()
            if step == 0:
                with pytest.raises(AssertionError, match="zero_grad"):
                    opt.zero_grad()
            opt.step()
            opt.zero_grad()
        for got, want in zip(model.parameters(), _adasum_reference(passes, 3, n)):
            torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match="Skipping synchronization"):
        with opt.skip_synchronize():
            pass


def test_faces_have_horovods_public_names():
    import importlib

    for real, face in (("horovod.torch", hvd), ("horovod.tensorflow", htf),
                       ("horovod.tensorflow.keras", hk)):
        names = {n for n in dir(importlib.import_module(real)) if not n.startswith("_")}
        assert sorted(n for n in names - _NOT_FACES if not hasattr(face, n)) == [], real
        # the script's import with horovod replaced by plait gives the face itself
        assert importlib.import_module(real.replace("horovod", "plait")) is face, real
        for sub in _SUBMODULES[real]:
            theirs = importlib.import_module(f"{real}.{sub}")
            ours = importlib.import_module(f"{real}.{sub}".replace("horovod", "plait"))
            defined = {n for n in dir(theirs) if not n.startswith("_")
                       and str(getattr(getattr(theirs, n), "__module__", "")).startswith(theirs.__name__)}
            assert sorted(n for n in defined - _NOT_IN_SUBMODULES if not hasattr(ours, n)) == [], sub
    real_tf = importlib.import_module("horovod.tensorflow")
    for items, parts in (([1, 2, 3, 4, 5], 2), (list(range(7)), 3), ([], 2)):
        assert htf.split_list(items, parts) == real_tf.split_list(items, parts)
    assert [htf.check_num_rank_power_of_2(k) for k in range(9)] == [
        real_tf.check_num_rank_power_of_2(k) for k in range(9)]
    assert htf.gpu_available("tensorflow") == real_tf.gpu_available("tensorflow")  # a CPU build here
    assert hvd.mpi_ops.gpu_available("torch") is False and hvd.mpi_ops.num_rank_is_power_2(8)


def test_in_place_and_grouped_async_forms():
    r, n = hvd.rank(), hvd.size()
    x = torch.full((2,), float(r + 1))
    assert hvd.synchronize(hvd.allreduce_async_(x, op=hvd.Sum)) is x
    assert torch.equal(x, torch.full((2,), n * (n + 1) / 2))
    y = torch.full((2,), float(r))
    assert hvd.synchronize(hvd.broadcast_async_(y, n - 1)) is y and torch.equal(y, torch.full((2,), n - 1.0))
    ts = [torch.ones(1), torch.ones(2)]
    assert [t.tolist() for t in hvd.synchronize(hvd.grouped_allreduce_async(ts, op=hvd.Sum))] == [
        [float(n)], [float(n)] * 2]
    assert hvd.synchronize(hvd.grouped_allreduce_async_(ts, op=hvd.Sum)) == ts and ts[0].item() == n
    assert [t.shape[0] for t in hvd.synchronize(hvd.grouped_allgather_async(ts))] == [n, 2 * n]
    rows = [torch.ones(n, 1)]
    assert hvd.synchronize(hvd.grouped_reducescatter_async(rows, op=hvd.Sum))[0].tolist() == [[float(n)]]
    assert int(htf.process_set_included_op(0)) == 1
    v = tf.Variable([float(r)] * 2)
    vals = htf.broadcast_([v], root_rank=0)
    assert v.numpy().tolist() == [0.0, 0.0] and vals[0].numpy().tolist() == [0.0, 0.0]
    assert hk.cross_rank() == 0 and hk.cross_size() == 1
    assert hk.reducescatter(tf.ones([n, 2]), op=hk.Sum).numpy().tolist() == [[float(n)] * 2]
