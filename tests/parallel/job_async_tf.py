"""Keras 3 asynchronous data parallelism on every rank (tests/test_jobs_async.py).

Eager custom loops (apply_gradients) and model.fit(run_eagerly=True): local SGD
with H=1 equals synchronous training; every algorithm (local SGD, delayed,
SSP, gossip, parameter server) trains the digits MLP to within 3 accuracy
points of synchronous training; replicas agree after synchronize(). On 3 ranks
the point-to-point algorithms run (the parameter server as 1 server + 2 workers).
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from conftest import make_comm  # noqa: E402

import plait  # noqa: E402
from plait.compression import FP16  # noqa: E402

TRAIN = 1500
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    return (x[order] / 16.0).astype(np.float32), y[order].astype(np.int64)


X, Y = digits()


def model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dense(10)])


def flat(m: keras.Model) -> np.ndarray:
    return np.concatenate([np.asarray(w).ravel() for w in m.get_weights()])


def accuracy(m: keras.Model) -> float:
    return float(np.mean(np.argmax(m(X[TRAIN:]).numpy(), 1) == Y[TRAIN:])) * 100


def identical_on_all_ranks(comm, m: keras.Model) -> None:
    mine = flat(m)
    everyone = np.asarray(comm.allgather(mine.reshape(1, -1)))
    for r in range(comm.size):
        np.testing.assert_array_equal(everyone[r], mine, err_msg=f"rank {r} differs")


def train(comm, steps, mode="sync", lr=0.2, momentum=0.5, global_batch=48, **options):
    m = model()
    dp = plait.DataParallel(comm=comm, mode=mode, **options)
    opt = dp.optimizer(keras.optimizers.SGD(lr, momentum=momentum))
    ps = options.get("algorithm") in ("ps", "parameter_server")
    workers = comm.size - 1 if ps else comm.size
    me = comm.rank - (comm.size - workers)
    if mode == "sync":
        dp.broadcast(m)
    if getattr(opt, "is_server", False):
        opt.serve(m.trainable_variables)
    else:
        for step in range(steps):
            start = (step * global_batch) % (TRAIN - global_batch)
            xb = X[start + me : start + global_batch : workers]
            yb = Y[start + me : start + global_batch : workers]
            with tf.GradientTape() as tape:
                loss = LOSS(yb, m(xb))
            grads = tape.gradient(loss, m.trainable_variables)
            opt.apply_gradients(zip(grads, m.trainable_variables))
    if mode != "sync":
        opt.synchronize(m.trainable_variables)
    identical_on_all_ranks(comm, m)
    return m, opt


@pytest.fixture(scope="module")
def comm():
    return make_comm("mpi")


@pytest.fixture(scope="module")
def sync_acc(comm):
    m, _ = train(comm, 60)
    return accuracy(m)


MODES = {
    "local_sgd": {"algorithm": "local_sgd", "period": 4, "warmup_steps": 10},
    "delayed": {"algorithm": "delayed"},
    "delayed-fp16": {"algorithm": "delayed", "compression": FP16()},
    "ssp": {"algorithm": "ssp", "staleness": 2},
    "gossip": {"algorithm": "gossip"},
    "ps": {"algorithm": "ps"},
}
#: modes run on 3 ranks (the parameter server as 1 server + 2 workers): the point-to-point
#: ones; every extra rank costs seconds of TensorFlow import and training on 2 cores.
ON_3_RANKS = ("gossip", "ps", "ssp")
SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "2"))


@pytest.mark.parametrize("name", [n for n in MODES if SIZE == 2 or n in ON_3_RANKS])
def test_accuracy_close_to_sync(comm, sync_acc, name):
    m, opt = train(comm, 60, mode="async", **MODES[name])
    acc = accuracy(m)
    assert acc >= sync_acc - 3, f"{name}: {acc:.1f}% vs synchronous {sync_acc:.1f}%"
    assert opt.metrics_async.steps > 0
    everyone = opt.gather_metrics()
    workers = [s for s in everyone if s["role"] == "worker"]
    assert all(s["steps"] == 60 and s["updates"] == s["steps"] for s in workers
               if name in ("gossip", "ps")), everyone
    if name == "ps":  # the server applied every push and waited for them
        assert everyone[0]["role"] == "server" and everyone[0]["steps"] == 60 * len(workers)
        assert everyone[0]["wait_seconds"] > 0, everyone


def test_local_sgd_period_one_is_synchronous(comm):
    sync, _ = train(comm, 8, momentum=0.0)
    local, _ = train(comm, 8, mode="async", momentum=0.0, algorithm="local_sgd", period=1)
    np.testing.assert_allclose(flat(local), flat(sync), rtol=0, atol=1e-6)


def test_model_fit_run_eagerly(comm):
    m = model()
    opt = plait.DataParallel(comm=comm, mode="async", algorithm="local_sgd", period=2).optimizer(
        keras.optimizers.SGD(0.1))
    m.compile(optimizer=opt, loss=LOSS, run_eagerly=True)
    part = slice(comm.rank, TRAIN, comm.size)
    m.fit(X[part][:240], Y[part][:240], batch_size=24, epochs=1, verbose=0, shuffle=False)
    opt.synchronize()
    identical_on_all_ranks(comm, m)
    assert opt.metrics_async.steps == 10


def test_inside_tf_function_is_a_clear_error(comm):
    m = model()
    opt = plait.DataParallel(comm=comm, mode="async", algorithm="local_sgd").optimizer(
        keras.optimizers.SGD(0.1))
    m(X[:2])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = LOSS(Y[:8], m(X[:8]))
        opt.apply_gradients(zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables))

    with pytest.raises(Exception, match="runs eagerly"):
        step()
