"""TensorFlow / Keras 3 synchronous data parallelism on every rank, both backends.

Equivalence with one process on the whole batch, for DistributedGradientTape
(eager and tf.function) and Keras ``model.fit`` with the distributed optimizer;
replicas compared across ranks so silent divergence (Horovod 0.28 + Keras 3)
cannot pass.
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from plait.adapters.keras_callbacks import (  # noqa: E402
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
from plait.adapters.tf_optim import (  # noqa: E402
    DistributedGradientTape,
    broadcast_variables,
    distributed_keras_optimizer,
)

from plait.parallel.data import DEFAULT_BUCKET_MB  # noqa: E402

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


def tape_training(comm, graph: bool, distributed: bool, bucket_mb: float = DEFAULT_BUCKET_MB,
                  steps: int = 10) -> keras.Model:
    x, y = digits()
    m = model()
    opt = keras.optimizers.SGD(learning_rate=0.2, momentum=0.9)
    batch = 12 * comm.size

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, m(xb))
        if distributed:
            tape = DistributedGradientTape(tape, comm, bucket_mb=bucket_mb)
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


FUSION = [DEFAULT_BUCKET_MB, 0.0]  # one fused bucket for the whole model / one gradient each
FUSION_IDS = ["fused", "unfused"]


@pytest.mark.parametrize("bucket_mb", FUSION, ids=FUSION_IDS)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_gradient_tape_matches_serial(comm, graph, bucket_mb):
    dist = tape_training(comm, graph, distributed=True, bucket_mb=bucket_mb)
    serial = tape_training(comm, graph, distributed=False)
    np.testing.assert_allclose(flat(dist), flat(serial), rtol=0, atol=1e-6)


@pytest.mark.parametrize("sparse_as_dense", [False, True], ids=["allgathered", "dense"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_gradient_tape_reduces_an_embeddings_sparse_gradient(comm, graph, sparse_as_dense):
    """An embedding's gradient (tf.IndexedSlices) is allgathered and stays IndexedSlices, as
    Horovod's tape leaves it (dense with sparse_as_dense); either way its value, and the
    dense layer's, is the average of every rank's own gradient."""
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(20, 4),
                          keras.layers.Flatten(), keras.layers.Dense(5)])
    r = comm.rank
    tokens = tf.constant([[r, r + 1, 7], [2 * r % 20, 3, r]], tf.int32)
    labels = tf.constant([r % 5, 1])

    def gradients(distributed: bool):
        with tf.GradientTape() as tape:
            loss = LOSS(labels, m(tokens))
        if distributed:
            tape = DistributedGradientTape(tape, comm, sparse_as_dense=sparse_as_dense)
        return tape.gradient(loss, m.trainable_variables)

    own = [tf.convert_to_tensor(g).numpy() for g in gradients(False)]
    got = (tf.function(gradients) if graph else gradients)(True)
    assert isinstance(got[0], tf.IndexedSlices) is not sparse_as_dense, type(got[0])
    for mine, reduced in zip(own, got):
        everyone = np.asarray(comm.allgather(mine[None]))
        np.testing.assert_allclose(tf.convert_to_tensor(reduced).numpy(), everyone.mean(0),
                                   rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("graph,sparse_as_dense", [(False, False), (True, False), (True, True)],
                         ids=["eager-allgathered", "traced-allgathered", "traced-dense"])
def test_keras_optimizer_reduces_an_embeddings_sparse_gradient(comm, graph, sparse_as_dense):
    """The distributed Keras optimizer allgathers an embedding's tf.IndexedSlices gradient,
    as Horovod's does (dense with sparse_as_dense): it gets the IndexedSlices, and Adam's
    steps equal one process's on the whole batch either way."""
    n, r = comm.size, comm.rank
    tokens = tf.constant((np.arange(2 * n * 3).reshape(2 * n, 3) * 7) % 20, tf.int32)
    labels = tf.constant(np.arange(2 * n) % 5)

    def train(distributed: bool) -> np.ndarray:
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(20, 4),
                              keras.layers.Flatten(), keras.layers.Dense(5)])
        opt = keras.optimizers.Adam(0.05)
        xb, yb = tokens, labels
        if distributed:
            opt = distributed_keras_optimizer(opt, comm, sparse_as_dense=sparse_as_dense)
            xb, yb = tokens[r::n], labels[r::n]
        seen = []
        real = keras.optimizers.Adam.apply  # what the distributed one applies with

        def apply(self, grads, variables=None):
            seen.append(isinstance(grads[0], tf.IndexedSlices))
            return real(self, grads, variables)

        keras.optimizers.Adam.apply = apply
        try:
            def step() -> None:
                with tf.GradientTape() as tape:
                    loss = LOSS(yb, m(xb))
                grads = tape.gradient(loss, m.trainable_variables)
                opt.apply_gradients(zip(grads, m.trainable_variables))

            run = tf.function(step) if graph else step
            for _ in range(2):
                run()
        finally:
            keras.optimizers.Adam.apply = real
        if distributed:
            assert seen and seen[0] is not sparse_as_dense, seen
        return flat(m)

    np.testing.assert_allclose(train(True), train(False), rtol=0, atol=1e-6)


def test_tf_function_checks_its_buckets_in_the_first_run_only(comm, monkeypatch):
    """On the MPI backend a traced tape's buckets start on the checked communicator in the
    first run only (later runs: a private unchecked copy, split in the second). The weights
    still match the serial run."""
    if comm.backend != "mpi":
        pytest.skip("the Horovod backend builds Horovod's ops into the graph while tracing; "
                    "Horovod's coordinator compares them in every run")
    started = []
    real = comm.allreduce_async
    monkeypatch.setattr(comm, "allreduce_async",
                        lambda *a, **k: started.append(k.get("name", a[2] if len(a) > 2 else None))
                        or real(*a, **k))
    dist = tape_training(comm, graph=True, distributed=True, bucket_mb=0.0, steps=4)
    monkeypatch.undo()
    assert len(started) == len(model().trainable_variables), started  # one gradient a bucket
    serial = tape_training(comm, graph=True, distributed=False, steps=4)
    np.testing.assert_allclose(flat(dist), flat(serial), rtol=0, atol=1e-6)


def test_tf_function_tape_with_uneven_data_and_join(comm):
    """Horovod's pattern for uneven data inside a tf.function: rank r has 3 + r batches; a
    rank out of data joins, and the others' later steps (on the MPI backend: on the unchecked
    copy, announced to it) average its zeros in, as a serial run with those zeros does."""
    if comm.backend != "mpi":
        pytest.skip("TensorFlow on the Horovod backend: join() only with every rank joining "
                    "(README, What does not work); job_faces.py tests torch's join there")
    n, me = comm.size, comm.rank
    x, y = digits()

    def batch(r, s):
        lo = (s * n + r) * 6
        return tf.constant(x[lo : lo + 6]), tf.constant(y[lo : lo + 6])

    m, ref = model(), model()
    opt = keras.optimizers.SGD(learning_rate=0.1)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, m(xb))
        grads = DistributedGradientTape(tape, comm).gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables))

    for s in range(3 + me):
        step(*batch(me, s))
    assert comm.join() == n - 1
    for s in range(3 + me):  # the serial reference of this rank's steps: a joined rank's gradient is 0
        total = [tf.zeros_like(v) for v in ref.trainable_variables]
        for r in range(n):
            if s < 3 + r:
                xb, yb = batch(r, s)
                with tf.GradientTape() as tape:
                    loss = LOSS(yb, ref(xb))
                total = [t + g for t, g in zip(total, tape.gradient(loss, ref.trainable_variables))]
        for v, t in zip(ref.trainable_variables, total):
            v.assign_sub(0.1 * t / n)
    np.testing.assert_allclose(flat(m), flat(ref), rtol=0, atol=1e-6)


def accumulation_training(comm, graph: bool, distributed: bool, passes: int, steps: int = 10,
                          bucket_mb: float = DEFAULT_BUCKET_MB) -> keras.Model:
    """Custom loop through ``apply_gradients``: ``passes`` local passes per step on each
    rank, against one process taking one step on all of them (at ``passes`` times the
    learning rate: Horovod applies the sum of the passes by default)."""
    x, y = digits()
    m = model()
    b = 6  # samples per rank and pass
    total = b * passes * comm.size  # samples per step
    if distributed:
        opt = distributed_keras_optimizer(keras.optimizers.SGD(0.1, momentum=0.9), comm,
                                          backward_passes_per_step=passes, bucket_mb=bucket_mb)
    else:
        opt = keras.optimizers.SGD(0.1 * passes, momentum=0.9)

    def one_pass(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, m(xb))
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables))

    run = tf.function(one_pass) if graph else one_pass
    for s in range(steps):
        xb, yb = x[s * total : (s + 1) * total], y[s * total : (s + 1) * total]
        if not distributed:
            run(tf.constant(xb), tf.constant(yb))
            continue
        xb, yb = xb[comm.rank :: comm.size], yb[comm.rank :: comm.size]
        for p in range(passes):
            before = flat(m)
            run(tf.constant(xb[p * b : (p + 1) * b]), tf.constant(yb[p * b : (p + 1) * b]))
            if p < passes - 1:  # accumulated, not applied
                np.testing.assert_array_equal(flat(m), before)
        identical_on_all_ranks(comm, m)
    assert int(opt.iterations) == steps
    return m


@pytest.mark.parametrize("bucket_mb", FUSION, ids=FUSION_IDS)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_gradient_accumulation_matches_serial(comm, graph, bucket_mb):
    dist = accumulation_training(comm, graph, distributed=True, passes=2, bucket_mb=bucket_mb)
    serial = accumulation_training(comm, graph, distributed=False, passes=2)
    np.testing.assert_allclose(flat(dist), flat(serial), rtol=0, atol=1e-6)


class SameOnAllRanks(keras.callbacks.Callback):
    """Compares the weights across ranks after every batch of ``fit``."""

    def __init__(self, comm) -> None:
        super().__init__()
        self.comm, self.batches = comm, 0

    def on_train_batch_end(self, batch, logs=None):
        identical_on_all_ranks(self.comm, self.model)
        self.batches += 1


def fit(comm, distributed: bool, seed: int, bucket_mb: float = DEFAULT_BUCKET_MB,
        passes: int = 1, average_passes: bool = True, samples: int = 600) -> keras.Model:
    """2 epochs of ``fit``; the distributed run takes ``passes`` batches of 10 per rank
    and step, the serial one batches of ``10 * size * passes``.

    Adam without accumulation; with it, SGD with momentum at ``passes`` times the
    serial rate when the passes are summed (Adam's normalisation turns the float
    rounding of a sum of 4 means instead of one mean of 40 into 1e-5 differences on
    near-zero gradients; ``iterations`` is checked instead).
    """
    x, y = digits()
    batch = 10 * comm.size * passes
    n = (samples // batch) * batch
    x, y = x[:n], y[:n]
    m = model(seed)
    if passes == 1:
        opt = keras.optimizers.Adam(learning_rate=1e-2)
    else:
        rate = 0.05 if average_passes or distributed else 0.05 * passes
        opt = keras.optimizers.SGD(learning_rate=rate, momentum=0.9)
    callbacks = []
    if distributed:
        opt = distributed_keras_optimizer(opt, comm, bucket_mb=bucket_mb,
                                          backward_passes_per_step=passes,
                                          average_aggregated_gradients=average_passes)
        check = SameOnAllRanks(comm)
        callbacks = [BroadcastGlobalVariablesCallback(0, comm), MetricAverageCallback(comm), check]
        x, y, batch = x[comm.rank :: comm.size], y[comm.rank :: comm.size], 10
    m.compile(optimizer=opt, loss=LOSS, metrics=["accuracy"])
    m.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    assert int(opt.iterations) == 2 * n // (10 * comm.size * passes)  # updates, not passes
    if distributed:
        assert check.batches == 2 * len(x) // 10
    return m


_SERIAL: dict[tuple[int, int, bool], np.ndarray] = {}


def serial_fit(comm, passes: int, average_passes: bool = True) -> np.ndarray:
    key = (comm.size, passes, average_passes)
    if key not in _SERIAL:
        _SERIAL[key] = flat(fit(comm, distributed=False, seed=0, passes=passes,
                                average_passes=average_passes))
    return _SERIAL[key]


@pytest.mark.parametrize("bucket_mb", FUSION, ids=FUSION_IDS)
def test_keras_fit_matches_serial_and_replicas_agree(comm, bucket_mb):
    # differently initialised ranks: the broadcast callback must make them agree
    dist = fit(comm, distributed=True, seed=comm.rank, bucket_mb=bucket_mb)
    identical_on_all_ranks(comm, dist)
    np.testing.assert_allclose(flat(dist), serial_fit(comm, 1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("average_passes", [True, False], ids=["mean-of-passes", "sum-of-passes"])
@pytest.mark.parametrize("bucket_mb", FUSION, ids=FUSION_IDS)
def test_keras_fit_with_gradient_accumulation_matches_serial(comm, bucket_mb, average_passes):
    dist = fit(comm, distributed=True, seed=comm.rank, bucket_mb=bucket_mb, passes=2,
               average_passes=average_passes)
    identical_on_all_ranks(comm, dist)
    np.testing.assert_allclose(flat(dist), serial_fit(comm, 2, average_passes), rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["topk", "powersgd"])
def test_keras_fit_with_lossy_compression_and_error_feedback(comm, kind):
    """``model.fit`` with top-k or PowerSGD and error feedback: inside the compiled step each
    bucket's compression and exchange run in one host op. Replicas agree, the bytes sent
    are the compressed ones, and top-k's weights equal those of the same fit run eagerly
    (PowerSGD's random start differs between TensorFlow's and numpy's generators)."""
    from plait.compression import PowerSGD, Residual, TopK, WireStats

    x, y = digits()
    x, y = x[comm.rank :: comm.size][:200], y[comm.rank :: comm.size][:200]
    weights = {}
    for eager in (False, True) if kind == "topk" else (False,):
        compressor = TopK(0.05) if kind == "topk" else PowerSGD(2)
        stats = WireStats()
        compressor.count_into(stats)
        m = model(comm.rank)
        opt = distributed_keras_optimizer(keras.optimizers.SGD(0.1, momentum=0.9), comm,
                                          compression=compressor, memory=Residual())
        m.compile(optimizer=opt, loss=LOSS, run_eagerly=eager)
        m.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0, comm)])
        identical_on_all_ranks(comm, m)
        assert 0 < stats.total.sent < stats.total.raw / 4, stats.total
        weights[eager] = flat(m)
    assert not np.allclose(weights[False], flat(model(0)), atol=1e-3)  # it trained
    if kind == "topk":
        np.testing.assert_allclose(weights[False], weights[True], rtol=0, atol=1e-6)


def test_keras_fit_without_averaging_would_diverge(comm):
    """Guard that the agreement check above can fail: plain Adam on shards diverges."""
    x, y = digits()
    m = model(0)
    m.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS)
    m.fit(x[comm.rank :: comm.size][:100], y[comm.rank :: comm.size][:100], batch_size=10,
          epochs=1, shuffle=False, verbose=0)
    everyone = np.asarray(comm.allgather(flat(m).reshape(1, -1)))
    assert not np.array_equal(everyone[0], everyone[-1])


def test_learning_rate_warmup_callback_ramps_the_rate(comm):
    x, y = digits()
    x, y = x[: 40 * comm.size], y[: 40 * comm.size]
    m = model(0)
    m.compile(optimizer=distributed_keras_optimizer(keras.optimizers.SGD(0.1, momentum=0.9), comm),
              loss=LOSS)
    rates = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            rates.append(float(np.asarray(self.model.optimizer.learning_rate)))

    warmup = LearningRateWarmupCallback(0.1, comm, warmup_epochs=2, verbose=1)
    with pytest.warns(UserWarning, match="momentum correction not applied"):
        history = m.fit(x[comm.rank :: comm.size], y[comm.rank :: comm.size], batch_size=10,
                        epochs=3, shuffle=False, verbose=0, callbacks=[warmup, Record()])
    steps, n = 4, comm.size  # Horovod's formula, ending at exactly 0.1 on the last warm-up batch
    ramp = [0.1 / n * ((e + (b + 1) / steps) * (n - 1) / 2 + 1) for e in range(2) for b in range(steps)]
    np.testing.assert_allclose(rates, ramp + [0.1] * steps, rtol=1e-6)
    assert all(a < b for a, b in zip(ramp, ramp[1:])) and rates[0] < 0.1 / n * (1 + n / (2 * steps))
    np.testing.assert_allclose(history.history["lr"], [ramp[3], 0.1, 0.1], rtol=1e-6)


def test_learning_rate_schedule_callback_staircase_decay(comm):
    x, y = digits()
    m = model(0)
    m.compile(optimizer=distributed_keras_optimizer(keras.optimizers.SGD(0.1), comm), loss=LOSS)
    schedule = LearningRateScheduleCallback(0.1, 0.5, comm, start_epoch=1, end_epoch=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = m.fit(x[:20], y[:20], batch_size=10, epochs=4, verbose=0, callbacks=[schedule])
    assert not [w for w in caught if "momentum" in str(w.message)]  # plain SGD: nothing to correct
    np.testing.assert_allclose(history.history["lr"], [0.1, 0.1, 0.05, 0.05], rtol=1e-6)


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
    with pytest.raises(ValueError, match="backward_passes_per_step=0"):
        distributed_keras_optimizer(keras.optimizers.SGD(), comm, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor=-1"):
        distributed_keras_optimizer(keras.optimizers.SGD(), comm, gradient_predivide_factor=-1)


# -- collectives inside graphs: any executor order, on every rank ----------------------------
GRAPH_DTYPES = [tf.float32, tf.float64, tf.int32, tf.int64, tf.float16]
GRAPH_SPECS = [(GRAPH_DTYPES[i % 5], (i * 7919) % 20000 + 1) for i in range(20)]


def _graph_inputs(comm):
    return [tf.cast(tf.range(n) % 7 + comm.rank, dt) for dt, n in GRAPH_SPECS]


def _check_sums(comm, outs):
    n = comm.size
    for (dt, size), out in zip(GRAPH_SPECS, outs):
        ref = (np.arange(size) % 7) * n + n * (n - 1) / 2
        np.testing.assert_array_equal(np.asarray(out).astype(np.float64), ref, err_msg=str(dt))


@pytest.mark.parametrize("grouped", [False, True], ids=["allreduce", "grouped_allreduce"])
def test_tf1_session_twenty_independent_allreduces_fifty_times(comm, grouped):
    """A session runs independent ops in any order in several threads (the host calls
    paired up wrongly: MPI_ERR_TRUNCATE, then a hang)."""
    with tf.Graph().as_default():
        xs = [x * 1 for x in _graph_inputs(comm)]
        outs = (comm.grouped_allreduce(xs, op="sum") if grouped
                else [comm.allreduce(x, op="sum") for x in xs])
        with tf.compat.v1.Session() as sess:
            for _ in range(50):
                _check_sums(comm, sess.run(outs))


def test_tf_function_twenty_allreduces_and_a_cond_twenty_times(comm):
    @tf.function
    def step(flag, *xs):
        outs = [comm.allreduce(x * 1, op="sum") for x in xs]
        extra = tf.cond(flag > 0, lambda: comm.allreduce(xs[0] * 2, op="sum"), lambda: xs[0] * 0)
        return outs, extra

    xs = _graph_inputs(comm)
    for i in range(20):
        outs, extra = step(tf.constant(i % 2), *xs)
        _check_sums(comm, outs)
        np.testing.assert_array_equal(extra.numpy(), np.asarray(outs[0]) * 2 * (i % 2))


def _host_ops(tensor):
    """The names of the host ops (``tf.numpy_function``) ``tensor`` depends on."""
    found, seen, stack = set(), set(), [tensor.op]
    while stack:
        op = stack.pop()
        if op.name not in seen:
            seen.add(op.name)
            if op.type in ("PyFunc", "EagerPyFunc", "PyFuncStateless"):
                found.add(op.name)
            stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
    return found


def test_tf1_session_runs_a_broadcast_apart_from_a_fed_allreduce(comm):
    """Horovod's ``tensorflow_word2vec.py``: the variables' broadcast, built after a
    training op fed by placeholders, runs alone in its own ``session.run`` (it needed the
    placeholders' feeds: the host ops were chained in build order); a broadcast built
    before it does not run with every step."""
    with tf.Graph().as_default():
        v = tf.Variable(tf.fill([4], float(comm.rank)))
        before = comm.broadcast(v.read_value(), root=0)
        x = tf.compat.v1.placeholder(tf.float32, [None])
        summed = comm.allreduce(x * 2, op="sum")
        after = comm.broadcast(v.read_value() + 1, root=0)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            np.testing.assert_array_equal(sess.run(after), np.ones(4))
            for step in range(3):
                out = sess.run(summed, {x: np.full(step + 1, comm.rank, np.float32)})
                np.testing.assert_array_equal(out, np.full(step + 1, comm.size * (comm.size - 1)))
            np.testing.assert_array_equal(sess.run(before), np.zeros(4))
        assert not _host_ops(summed) & _host_ops(before)
        assert not _host_ops(after) & _host_ops(summed)


@pytest.mark.parametrize("order", ["auto", "negotiate"])
def test_tf1_session_allreduces_in_a_negotiated_order(comm, order, monkeypatch):
    """The same graph with every op negotiated by key (PLAIT_GRAPH_ORDER=negotiate)."""
    if comm.backend != "mpi":
        pytest.skip("Horovod's own coordinator orders its ops on the Horovod backend")
    from plait.collectives.graph_order import coordinator_of

    monkeypatch.setenv("PLAIT_GRAPH_ORDER", order)
    before = coordinator_of(comm).rounds
    with tf.Graph().as_default():
        outs = [comm.allreduce(x * 1, op="sum") for x in _graph_inputs(comm)]
        with tf.compat.v1.Session() as sess:
            for _ in range(5):
                _check_sums(comm, sess.run(outs))
    rounds = coordinator_of(comm).rounds - before
    assert rounds == 0 if order == "auto" else rounds >= 5 * len(outs)


def test_graph_mismatch_raises_on_every_rank_within_seconds(comm, monkeypatch):
    """Ranks running different graph collectives get MismatchError on every rank (not a
    hang), and the communicator works afterwards: negotiated keys that never match
    (differently named graphs), and build-ordered collectives of different shapes."""
    if comm.backend != "mpi":
        pytest.skip("Horovod's own coordinator orders graph ops on the Horovod backend")
    from plait.collectives.graph_order import coordinator_of

    @tf.function
    def one(x):
        return comm.allreduce(x, op="sum")

    with pytest.raises(tf.errors.OpError, match="MismatchError"):
        one(tf.ones([3 + comm.rank]))  # build order: the agreement check catches it
    monkeypatch.setenv("PLAIT_GRAPH_ORDER", "negotiate")
    coordinator_of(comm).mismatch_s = 1.0

    @tf.function
    def left(x):
        return comm.allreduce(x, op="sum")

    @tf.function
    def right(x):
        return comm.allreduce(x, op="sum")

    fn = left if comm.rank == 0 else right  # differently named graphs: keys that never match
    with pytest.raises(tf.errors.OpError, match="MismatchError") as caught:
        fn(tf.ones([3]))
    assert "wait for different collectives" in str(caught.value)
    out = tf.function(lambda x: comm.allreduce(x, op="sum"))(tf.ones([3]))
    np.testing.assert_array_equal(out.numpy(), np.full(3, comm.size, np.float32))


# -- gradients of the TensorFlow face's collectives (Horovod's definitions) -------------------
def _upstream(shape, rank):
    """A different upstream gradient on every rank and element."""
    return (rank + 1) * np.arange(1, int(np.prod(shape)) + 1, dtype=np.float32).reshape(shape)


GRAD_KINDS = ["allreduce-sum", "allreduce-average", "grouped_allreduce", "allgather",
              "broadcast", "alltoall", "reducescatter-sum", "reducescatter-average"]


def _collective(htf, kind, x, n):
    if kind.startswith("allreduce"):
        return htf.allreduce(x, op=htf.Sum if kind.endswith("sum") else htf.Average)
    if kind == "grouped_allreduce":
        return htf.grouped_allreduce([x], op=htf.Sum)[0]
    if kind == "allgather":
        return htf.allgather(x)
    if kind == "broadcast":
        return htf.broadcast(x, root_rank=0)
    if kind == "alltoall":
        return htf.alltoall(x, splits=[2] * n)[0]
    return htf.reducescatter(x, op=htf.Sum if kind.endswith("sum") else htf.Average)


def _out_shape(kind, rows, n):
    """The collective's output shape (a graph knows no first dimension of an allgather)."""
    return (rows * n if kind == "allgather" else rows // n if kind.startswith("reducescatter")
            else rows, 2)


def _expected_gradient(kind, rank, n, rows):
    ups = [_upstream(_out_shape(kind, rows, n), q) for q in range(n)]
    if kind in ("allreduce-sum", "grouped_allreduce"):
        return sum(ups)
    if kind == "allreduce-average":
        return sum(ups) / n
    if kind == "allgather":  # the averaged upstream gradient's rows of this rank
        return (sum(ups) / n)[rank * rows : (rank + 1) * rows]
    if kind == "broadcast":
        return sum(ups) / n * (rank == 0)
    if kind == "alltoall":  # block j of this rank's input went to rank j, at position `rank`
        return np.concatenate([ups[j][rank * 2 : rank * 2 + 2] for j in range(n)])
    return np.concatenate(ups) * (n if kind.endswith("sum") else 1)  # Horovod's reducescatter


def _face(comm):
    """plait.tensorflow on the world of ``comm``'s backend (the MPI backend here: the
    face's world is one per process, and this job's other communicators are fixtures)."""
    if comm.backend != "mpi":
        pytest.skip("the face's world runs on the MPI backend in this job")
    import plait.tensorflow as htf

    htf.init(backend="mpi")
    return htf


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_face_collectives_have_horovods_gradients(comm, graph):
    htf = _face(comm)
    n, rows = comm.size, 2 * comm.size
    x = tf.Variable(tf.fill([rows, 2], float(comm.rank + 1)))

    def gradients():
        out = []
        for kind in GRAD_KINDS:
            with tf.GradientTape() as tape:
                y = _collective(htf, kind, x, n)
                loss = tf.reduce_sum(y * _upstream(_out_shape(kind, rows, n), comm.rank))
            out.append(tape.gradient(loss, x))
        return out

    got = tf.function(gradients)() if graph else gradients()
    for kind, g in zip(GRAD_KINDS, got):
        np.testing.assert_allclose(g.numpy(), _expected_gradient(kind, comm.rank, n, rows),
                                   rtol=1e-6, err_msg=kind)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_indexed_slices_of_any_dtype_and_row_shape_gather_exactly(comm, graph):
    """An ``IndexedSlices``' values and indices travel together as rows of bytes: exact for
    each dtype and row shape, with uneven row counts (none on rank 0)."""
    htf = _face(comm)
    r, n = comm.rank, comm.size
    cases = [("float64", [3], "int64"), ("float16", [], "int32"), ("bfloat16", [2, 2], "int64"),
             ("int32", [2], "int32")]

    def rows(q, rest, dtype, index_dtype):
        width = int(np.prod(rest))
        values = (np.arange(q * width) % 7 + q).reshape([q, *rest])
        return tf.cast(values, dtype), tf.constant(np.arange(q) + 10 * q, index_dtype)

    def reduce():
        outs = []
        for dtype, rest, index_dtype in cases:
            values, indices = rows(r, rest, dtype, index_dtype)
            s = tf.IndexedSlices(values, indices, dense_shape=tf.constant([10 * n, *rest], tf.int64))
            out = htf.allreduce(s, op=htf.Sum)
            outs.append((tf.cast(out.values, tf.float64), tf.cast(out.indices, tf.int64)))
        return outs

    for (dtype, rest, index_dtype), (values, indices) in zip(cases, (tf.function(reduce) if graph
                                                                     else reduce)()):
        want = [rows(q, rest, dtype, index_dtype) for q in range(n)]
        np.testing.assert_array_equal(values.numpy(), np.concatenate(
            [tf.cast(v, tf.float64).numpy() for v, _ in want]), err_msg=dtype)
        np.testing.assert_array_equal(indices.numpy(), np.concatenate(
            [i.numpy().astype(np.int64) for _, i in want]), err_msg=dtype)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_face_allreduce_of_indexed_slices(comm, graph):
    """Sparse gradients are allgathered (values and indices), as Horovod reduces them."""
    htf = _face(comm)
    r, n = comm.rank, comm.size

    def reduce(op):
        s = tf.IndexedSlices(tf.fill([2, 3], float(r + 1)), tf.constant([r, r + 1], tf.int64),
                             dense_shape=tf.constant([n + 1, 3], tf.int64))
        return tf.convert_to_tensor(htf.allreduce(s, op=op))

    run = tf.function(reduce) if graph else reduce
    dense = np.zeros((n + 1, 3), np.float32)
    for q in range(n):
        dense[q : q + 2] += q + 1
    np.testing.assert_allclose(run(htf.Sum).numpy(), dense)
    np.testing.assert_allclose(run(htf.Average).numpy(), dense / n)
    with pytest.raises(Exception if graph else NotImplementedError, match="IndexedSlices"):
        run(htf.Max)  # Horovod's error (autograph turns it into its StagingError)
