"""TensorFlow / Keras 3 synchronous data parallelism on every rank, both backends.

Equivalence with one process on the whole batch, for DistributedGradientTape
(eager and tf.function) and Keras ``model.fit`` with the distributed optimizer;
replicas compared across ranks so silent divergence (Horovod 0.28 + Keras 3)
cannot pass.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from plait.adapters.keras_callbacks import (  # noqa: E402
    BroadcastGlobalVariablesCallback,
    MetricAverageCallback,
)
from plait.adapters.tf_optim import (  # noqa: E402
    DistributedGradientTape,
    broadcast_variables,
    distributed_keras_optimizer,
)

tf.config.experimental.enable_op_determinism()


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int64)


def model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="tanh"),
                          keras.layers.Dense(10)])
    return m


def flat(m: keras.Model) -> np.ndarray:
    return np.concatenate([np.asarray(w).ravel() for w in m.get_weights()])


def identical_on_all_ranks(comm, m: keras.Model) -> None:
    mine = flat(m)
    everyone = comm.allgather(mine.reshape(1, -1))
    for r in range(comm.size):
        np.testing.assert_array_equal(np.asarray(everyone)[r], mine, err_msg=f"rank {r} diverged")


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def tape_training(comm, graph: bool, distributed: bool, steps: int = 10) -> keras.Model:
    x, y = digits()
    m = model()
    opt = keras.optimizers.SGD(learning_rate=0.2, momentum=0.9)
    batch = 12 * comm.size

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, m(xb))
        if distributed:
            tape = DistributedGradientTape(tape, comm)
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables))
        return loss

    run = tf.function(step) if graph else step
    for s in range(steps):
        xb, yb = x[s * batch : (s + 1) * batch], y[s * batch : (s + 1) * batch]
        if distributed:
            xb, yb = xb[comm.rank :: comm.size], yb[comm.rank :: comm.size]
        run(tf.constant(xb), tf.constant(yb))
        if distributed:
            identical_on_all_ranks(comm, m)
    return m


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_gradient_tape_matches_serial(comm, graph):
    dist = tape_training(comm, graph, distributed=True)
    serial = tape_training(comm, graph, distributed=False)
    np.testing.assert_allclose(flat(dist), flat(serial), rtol=0, atol=1e-6)


def fit(comm, distributed: bool, seed: int) -> keras.Model:
    x, y = digits()
    batch = 10 * comm.size
    n = (len(x) // batch) * batch
    x, y = x[:n], y[:n]
    m = model(seed)
    opt = keras.optimizers.Adam(learning_rate=1e-2)
    callbacks = []
    if distributed:
        opt = distributed_keras_optimizer(opt, comm)
        callbacks = [BroadcastGlobalVariablesCallback(0, comm), MetricAverageCallback(comm)]
        x, y, batch = x[comm.rank :: comm.size], y[comm.rank :: comm.size], batch // comm.size
    m.compile(optimizer=opt, loss=LOSS, metrics=["accuracy"])
    m.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    return m


def test_keras_fit_matches_serial_and_replicas_agree(comm):
    # differently initialised ranks: the broadcast callback must make them agree
    dist = fit(comm, distributed=True, seed=comm.rank)
    identical_on_all_ranks(comm, dist)
    serial = fit(comm, distributed=False, seed=0)
    np.testing.assert_allclose(flat(dist), flat(serial), rtol=0, atol=2e-6)


def test_keras_fit_without_averaging_would_diverge(comm):
    """Guard that the agreement check above can fail: plain Adam on shards diverges."""
    x, y = digits()
    m = model(0)
    m.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS)
    m.fit(x[comm.rank :: comm.size][:100], y[comm.rank :: comm.size][:100], batch_size=10,
          epochs=1, shuffle=False, verbose=0)
    everyone = np.asarray(comm.allgather(flat(m).reshape(1, -1)))
    assert not np.array_equal(everyone[0], everyone[-1])


def test_broadcast_variables_keras_and_tf(comm):
    m = model(seed=10 + comm.rank)
    v = tf.Variable(tf.fill([3], float(comm.rank)))
    broadcast_variables(list(m.variables) + [v], comm, root=comm.size - 1)
    identical_on_all_ranks(comm, m)
    np.testing.assert_array_equal(v.numpy(), np.full(3, comm.size - 1, dtype=np.float32))


def test_metric_average_callback(comm):
    cb = MetricAverageCallback(comm)
    logs = {"loss": float(comm.rank), "accuracy": 1.0}
    cb.on_epoch_end(0, logs)
    assert logs == {"loss": (comm.size - 1) / 2, "accuracy": 1.0}


def test_bad_inputs(comm):
    with pytest.raises(ValueError, match="keras.optimizers.Optimizer"):
        distributed_keras_optimizer(object(), comm)
    with pytest.raises(ValueError, match="tf.GradientTape"):
        DistributedGradientTape(object(), comm)
