"""Checkpoints of state that differs per rank, on every rank of a 3-rank job (tests/test_jobs_async.py).

Asynchronous algorithms and error-feedback memories keep state that differs from
rank to rank; a job restored from a checkpoint must go on exactly where the saved
one stood. Each test trains without interruption, then again with a checkpoint at
step K, a few steps that a crash throws away, and a fresh start from the
checkpoint (new model, optimizer and algorithm objects), and compares:

* every rank's own replica bit for bit, where the run is deterministic (local SGD,
  delayed averaging, gossip, a parameter server with one worker and momentum,
  top-k with error feedback), for torch and Keras 3;
* where arrival order decides the trajectory (SSP, a parameter server with two
  workers), a model whose gradients are constants in binary fractions: every
  update is exact, so the final weights say whether any update was lost or applied
  twice, and the server's snapshot must hold exactly K updates of every worker.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402
from conftest import make_comm  # noqa: E402

import plait  # noqa: E402
from plait.checkpoint import Checkpoint, CheckpointError  # noqa: E402
from plait.compression import FP16, Residual, TopK  # noqa: E402

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)
tf.config.experimental.enable_op_determinism()

LR = 0.0625  # 2**-4: updates of the linear model are exact in float32
TRAIN = 1500
K, T, LOST = 4, 8, 2  # checkpoint at K; train to T; the crashed run did LOST steps more


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    return (x[order] / 16.0).astype(np.float32), y[order].astype(np.int64)


X, Y = digits()


def batch(step: int, part: int) -> tuple[np.ndarray, np.ndarray]:
    start = (step * 48 + part * 16) % (TRAIN - 16)
    return X[start : start + 16], Y[start : start + 16]


def constant(part: int) -> np.ndarray:
    """The linear model's gradient on worker ``part``: multiples of 1/8."""
    return (np.arange(1, 9, dtype=np.float32) / 8) * (part + 1)


class Torch:
    name = "torch"

    def model(self, seed: int, linear: bool = False) -> Any:
        torch.manual_seed(seed)
        if linear:
            m = torch.nn.Linear(8, 1, bias=False)
            torch.nn.init.zeros_(m.weight)
            return m
        return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))

    def optimizer(self, m: Any, momentum: float) -> Any:
        return torch.optim.SGD(m.parameters(), lr=LR, momentum=momentum)

    def step(self, m: Any, opt: Any, step: int, part: int) -> None:
        xb, yb = batch(step, part)
        torch.nn.functional.cross_entropy(m(torch.from_numpy(xb)), torch.from_numpy(yb)).backward()
        opt.step()
        opt.zero_grad()

    def linear_step(self, m: Any, opt: Any, part: int) -> None:
        (m.weight * torch.from_numpy(constant(part))).sum().backward()
        opt.step()
        opt.zero_grad()

    def flat(self, m: Any) -> np.ndarray:
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy().copy()

    def serve(self, opt: Any, m: Any, ckpt: Any) -> None:
        opt.serve(checkpoint=ckpt, model=m)

    def synchronize(self, opt: Any, m: Any) -> None:
        opt.synchronize()


class Keras:
    name = "keras"

    def model(self, seed: int, linear: bool = False) -> Any:
        keras.utils.set_random_seed(seed)
        if linear:
            return keras.Sequential([keras.Input((8,)),
                                     keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="tanh"),
                                 keras.layers.Dense(10)])

    def optimizer(self, m: Any, momentum: float) -> Any:
        return keras.optimizers.SGD(learning_rate=LR, momentum=momentum)

    def _apply(self, m: Any, opt: Any, loss_fn: Any) -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn()
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables, strict=True))

    def step(self, m: Any, opt: Any, step: int, part: int) -> None:
        xb, yb = batch(step, part)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self._apply(m, opt, lambda: loss(yb, m(xb, training=True)))

    def linear_step(self, m: Any, opt: Any, part: int) -> None:
        c = tf.constant(constant(part).reshape(8, 1))
        self._apply(m, opt, lambda: tf.reduce_sum(m.trainable_variables[0] * c))

    def flat(self, m: Any) -> np.ndarray:
        return np.concatenate([np.asarray(w).ravel() for w in m.get_weights()])

    def serve(self, opt: Any, m: Any, ckpt: Any) -> None:
        opt.serve(m.trainable_variables, checkpoint=ckpt, model=m)

    def synchronize(self, opt: Any, m: Any) -> None:
        opt.synchronize(m.trainable_variables)


FRAMEWORKS = {"torch": Torch(), "keras": Keras()}


#: directories this process made; removed when the module's tests end
MADE: list[str] = []


@pytest.fixture(scope="module")
def comm() -> Iterator[Any]:
    c = make_comm("mpi")
    yield c
    c.barrier()  # every rank is done with the shared directories
    for path in MADE:
        shutil.rmtree(path, ignore_errors=True)


def made(prefix: str) -> str:
    """A fresh temporary directory, removed after the module's tests."""
    MADE.append(tempfile.mkdtemp(prefix=prefix))
    return MADE[-1]


def shared_dir(comm: Any) -> str:
    """A fresh directory every rank of ``comm`` sees (one machine: one file system)."""
    path = made("plait-ckpt-") if comm.rank == 0 else None
    return str(comm.broadcast_object(path, 0))


def train(fw: Any, comm: Any, options: dict[str, Any], steps: int, *, momentum: float = 0.5,
          linear: bool = False, ckpt: Checkpoint | None = None, resume: bool = False, seed: int = 0,
          slow: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Train asynchronously to ``steps`` (from the checkpoint with ``resume``).

    Returns:
        (this rank's replica before synchronize, the synchronized model, the step started from).
    """
    m = fw.model(seed, linear)
    opt = plait.DataParallel(comm=comm, mode="async", **options).optimizer(fw.optimizer(m, momentum))
    start = ckpt.restore(m, opt) if resume and ckpt is not None else 0
    if opt.is_server:
        fw.serve(opt, m, ckpt)
    else:
        servers = options.get("servers", 1) if options["algorithm"] == "ps" else 0
        part = comm.rank - servers
        for step in range(start, steps):
            if slow is not None and (comm.rank, step) == slow:
                time.sleep(1.0)  # the others run ahead (SSP inboxes, parameter-server holds)
            if linear:
                fw.linear_step(m, opt, part)
            else:
                fw.step(m, opt, step, part)
            if ckpt is not None:
                ckpt.step_done(step + 1, m, opt)
    replica = fw.flat(m)
    fw.synchronize(opt, m)
    return replica, fw.flat(m), start


def interrupted(fw: Any, comm: Any, options: dict[str, Any], **kw: Any) -> tuple[np.ndarray, np.ndarray]:
    """Checkpoint at K, crash after K + LOST steps, restart from the checkpoint to T."""
    ckpt = Checkpoint(shared_dir(comm), every=K, keep=2, comm=comm)
    train(fw, comm, options, K + LOST, ckpt=ckpt, **kw)
    replica, final, start = train(fw, comm, options, T, ckpt=ckpt, resume=True, seed=1, **kw)
    assert start == K
    return replica, final


COLLECTIVE = {
    "local_sgd": {"algorithm": "local_sgd", "period": 3},
    "local_sgd-fp16-ef": {"algorithm": "local_sgd", "period": 3, "compression": FP16(),
                          "memory": Residual()},
    "delayed": {"algorithm": "delayed"},
    "delayed-fp16-ef": {"algorithm": "delayed", "compression": FP16(), "memory": Residual()},
    "gossip-shift": {"algorithm": "gossip", "topology": "shift"},
}


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
@pytest.mark.parametrize("name", sorted(COLLECTIVE))
def test_collective_algorithm_resumes_every_replica_bit_for_bit(comm, framework, name):
    fw, options = FRAMEWORKS[framework], COLLECTIVE[name]
    if "memory" in options:  # one memory per run: each run's own residuals
        options = {**options, "memory": Residual()}
    replica, final, _ = train(fw, comm, options, T)
    if "memory" in options:
        options = {**options, "memory": Residual()}
    got_replica, got_final = interrupted(fw, comm, options)
    np.testing.assert_array_equal(got_replica, replica)  # this rank's own replica
    np.testing.assert_array_equal(got_final, final)
    # the replicas really differ between ranks at the checkpoint, else this proves little
    every = comm.allgather(replica.reshape(1, -1))
    if name.startswith(("local_sgd", "gossip", "delayed")):
        assert any(not np.array_equal(np.asarray(every[0]), np.asarray(r)) for r in every[1:])


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_ssp_applies_every_gradient_once_across_a_restore(comm, framework):
    """Rank 1 is slow at step K-1, so the others' inboxes hold its gradients at the
    checkpoint; after the restore every gradient of the job is applied exactly once."""
    fw = FRAMEWORKS[framework]
    _, final = interrupted(fw, comm, {"algorithm": "ssp", "staleness": 2}, momentum=0.0, linear=True,
                           slow=(1, K - 1))
    expected = -LR * T * sum(constant(r) for r in range(comm.size)) / comm.size
    np.testing.assert_allclose(final, expected, rtol=1e-6)


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_parameter_server_snapshot_holds_exactly_k_updates_of_every_worker(comm, framework):
    """1 server + 2 workers: arrival order varies, the sums of exact updates do not. Worker
    rank 2 is slow before step K-1, so worker rank 1 would run past K unless held."""
    fw = FRAMEWORKS[framework]
    options = {"algorithm": "ps", "servers": 1}
    workers = comm.size - 1
    directory = shared_dir(comm)
    ckpt = Checkpoint(directory, every=K, keep=2, comm=comm)
    train(fw, comm, options, K + LOST, momentum=0.0, linear=True, ckpt=ckpt, slow=(2, K - 1))
    per_step = sum(constant(w) for w in range(workers))
    # the snapshot, read back by this process alone: the whole model after K steps of each worker
    alone = fw.model(5, linear=True)
    assert Checkpoint(directory, comm=None).restore(alone) == K
    np.testing.assert_array_equal(fw.flat(alone), -LR * K * per_step)
    _, final, start = train(fw, comm, options, T, momentum=0.0, linear=True, ckpt=ckpt, resume=True,
                            seed=1)
    assert start == K
    np.testing.assert_array_equal(final, -LR * T * per_step)


@pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
def test_two_parameter_servers_resume_bit_for_bit(comm, framework):
    """2 servers (each its shard and momentum) + 1 worker: deterministic, so exact."""
    fw = FRAMEWORKS[framework]
    options = {"algorithm": "ps", "servers": 2}
    _, final, _ = train(fw, comm, options, T)
    _, got = interrupted(fw, comm, options)
    np.testing.assert_array_equal(got, final)


@pytest.mark.parametrize("backend", ["mpi", "horovod"])
@pytest.mark.parametrize("read", ["broadcast", "shared"])
def test_error_feedback_memories_are_saved_per_rank(backend, read):
    """Synchronous top-k with error feedback: each rank gets its own residuals back."""
    comm = make_comm(backend)

    def run(ckpt: Checkpoint | None, stop: int, resume: bool) -> tuple[Any, Residual]:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))
        memory = Residual()
        dp = plait.DataParallel(comm=comm, compression=TopK(0.1), memory=memory)
        opt = dp.optimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5), m.named_parameters())
        start = ckpt.restore(m, opt, {"ef": memory}) if resume and ckpt is not None else 0
        for step in range(start, stop):
            Torch().step(m, opt, step, comm.rank)
            if ckpt is not None:
                ckpt.step_done(step + 1, m, opt, {"ef": memory})
        return m, memory

    reference, ref_memory = run(None, T, False)
    ckpt = Checkpoint(shared_dir(comm), every=K, comm=comm, read=read)
    _, memory = run(ckpt, K, False)
    at_k = {k: v.clone() for k, v in memory.residuals.items()}
    assert at_k
    mine = torch.cat([v.reshape(-1) for v in at_k.values()])
    every = comm.allgather(mine.reshape(1, -1))
    assert any(not torch.equal(every[0], r) for r in every[1:]), "residuals should differ per rank"
    m, memory = run(ckpt, T, True)
    assert ckpt.restored_own is True
    np.testing.assert_array_equal(Torch().flat(m), Torch().flat(reference))
    for key, value in ref_memory.residuals.items():
        assert torch.equal(memory.residuals[key], value), key


def test_shared_read_of_directories_that_differ_is_an_error_on_every_rank(comm):
    mine = made(f"plait-ckpt-rank{comm.rank}-")
    m = Torch().model(0)
    if comm.rank == 0:
        Checkpoint(mine, comm=None).save(3, m)
    with pytest.raises(CheckpointError, match="the ranks see different latest checkpoints"):
        Checkpoint(mine, comm=comm, read="shared").restore(m)


def test_restore_on_fewer_ranks_starts_every_rank_from_rank_zero(comm):
    """A local-SGD checkpoint of 3 ranks restored by groups of 2 and 1 ranks: a warning,
    rank 0's replica everywhere, the step count kept."""
    fw = Torch()
    options = {"algorithm": "local_sgd", "period": 3}
    ckpt = Checkpoint(shared_dir(comm), every=K, comm=comm)
    replica, _, _ = train(fw, comm, options, K, ckpt=ckpt)
    saved_zero = np.asarray(comm.broadcast(replica, 0))
    group = comm.split(0 if comm.rank < 2 else 1, comm.rank)
    m = fw.model(3)
    opt = plait.DataParallel(comm=group, mode="async", **options).optimizer(fw.optimizer(m, 0.5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = Checkpoint(ckpt.directory, comm=group).restore(m, opt)
    assert start == K
    np.testing.assert_array_equal(fw.flat(m), saved_zero)
    assert opt.async_algorithm.metrics.steps == K
    said = [str(w.message) for w in caught]
    assert (group.rank == 0) == any("written by 3 ranks and is restored on" in s for s in said), said
    opt.synchronize()


def test_another_algorithm_cannot_restore_the_checkpoint(comm):
    fw = Torch()
    ckpt = Checkpoint(shared_dir(comm), every=K, comm=comm)
    train(fw, comm, {"algorithm": "local_sgd", "period": 3}, K, ckpt=ckpt)
    m = fw.model(0)
    opt = plait.DataParallel(comm=comm, mode="async", algorithm="gossip").optimizer(fw.optimizer(m, 0.5))
    with pytest.raises(CheckpointError, match="written by asynchronous algorithm 'local_sgd'"):
        ckpt.restore(m, opt)
    opt.synchronize()
