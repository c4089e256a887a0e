"""plait.tensorflow's SyncBatchNormalization and PartialDistributedGradientTape, and
plait.keras' load_model and broadcast_global_variables, against single-process Keras
references, on the world backend chosen by PLAIT_BACKEND (tests/test_jobs.py runs
both)."""

from __future__ import annotations

import pickle

import keras
import numpy as np
import pytest
import tensorflow as tf

import plait.keras as hk
import plait.tensorflow as hvd
from plait.errors import ConfigError

hvd.init()
ATOL = 1e-5


def _rows(extra: int = 3) -> tuple[int, int, int]:
    """Uneven rows per rank: rank r has r + ``extra``; returns (start, end, total)."""
    counts = [r + extra for r in range(hvd.size())]
    start = sum(counts[: hvd.rank()])
    return start, start + counts[hvd.rank()], sum(counts)


def _close(a: object, b: object, msg: str = "") -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=ATOL, err_msg=msg)


def _same_on_every_rank(values: list[object]) -> None:
    """Silent divergence check: every rank holds rank 0's values."""
    for v in values:
        a = tf.convert_to_tensor(np.asarray(v))
        _close(hvd.broadcast(a, 0, name="same.check"), a)


def _bn_pair(shape: tuple[int, ...], dtype: str = "float32", **kw: object
             ) -> tuple[keras.layers.BatchNormalization, keras.layers.Layer]:
    ref = keras.layers.BatchNormalization(momentum=0.5, dtype=dtype, **kw)  # type: ignore[arg-type]
    sync = hvd.SyncBatchNormalization(momentum=0.5, dtype=dtype, **kw)  # type: ignore[arg-type]
    for layer in (ref, sync):
        layer.build((None,) + shape)
    c = int(((0,) + shape)[int(kw.get("axis", -1))])  # type: ignore[call-overload]
    if ref.scale:
        for layer in (ref, sync):
            layer.gamma.assign(np.linspace(0.5, 1.5, c))
    if ref.center:
        for layer in (ref, sync):
            layer.beta.assign(np.linspace(-0.2, 0.3, c))
    return ref, sync


def _bn_step(layer: keras.layers.Layer, x: np.ndarray, upstream: np.ndarray, training: bool,
             mask: np.ndarray | None, graph: bool) -> tuple[object, object, list[object]]:
    """The layer's output, input gradient and weight gradients for loss sum(y * upstream)."""
    def step(x: tf.Tensor, up: tf.Tensor, mask: tf.Tensor | None) -> tuple[object, ...]:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=training, mask=mask)
            loss = tf.reduce_sum(y * up)
        grads = tape.gradient(loss, [x] + [v.value for v in layer.trainable_weights])
        return y, grads[0], grads[1:]

    fn = tf.function(step) if graph else step
    m = None if mask is None else tf.constant(mask)
    y, gx, gw = fn(tf.constant(x), tf.constant(upstream), m)
    return y, gx, list(gw)  # type: ignore[arg-type]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("shape,kw,masked", [
    ((4,), {}, False), ((3, 2, 4), {}, False), ((3, 5), {"axis": 1}, False),
    ((4,), {"center": False, "scale": False}, False), ((5, 3), {}, True)])
def test_sync_batch_normalization_equals_batch_norm_on_the_whole_batch(graph, shape, kw, masked):
    ref, sync = _bn_pair(shape, **kw)
    start, end, total = _rows()
    for seed, training in ((1, True), (2, True), (3, False)):  # moving stats accumulate, then used
        rng = np.random.default_rng(seed)
        x = (rng.normal(size=(total,) + shape) * 3 + 1).astype("float32")
        up = rng.normal(size=(total,) + shape).astype("float32")
        mask = (rng.random((total,) + shape[:-1]) > 0.3) if masked else None
        y_ref, gx_ref, gw_ref = _bn_step(ref, x, up, training, mask, graph)
        y, gx, gw = _bn_step(sync, x[start:end], up[start:end], training,
                             None if mask is None else mask[start:end], graph)
        _close(y, np.asarray(y_ref)[start:end], "outputs")
        _close(gx, np.asarray(gx_ref)[start:end], "input gradients")
        for g, g_ref in zip(gw, gw_ref):  # local gamma/beta gradients sum to the global batch's
            _close(hvd.allreduce(g, op=hvd.Sum), g_ref, "gamma/beta gradients")
        _close(sync.moving_mean, ref.moving_mean, "moving mean")
        _close(sync.moving_variance, ref.moving_variance, "moving variance")


def test_sync_batch_normalization_with_a_rank_without_rows_in_float64():
    ref, sync = _bn_pair((3,), dtype="float64")
    start, end, total = _rows(0)  # rank 0 has no rows
    x = np.random.default_rng(4).normal(size=(total, 3)) * 1e3 + 1e4  # large mean: cancellation
    up = np.random.default_rng(5).normal(size=(total, 3))
    y_ref, gx_ref, _ = _bn_step(ref, x, up, True, None, False)
    y, gx, _ = _bn_step(sync, x[start:end], up[start:end], True, None, False)
    assert y.dtype == tf.float64 and gx.shape == (end - start, 3)
    _close(y, np.asarray(y_ref)[start:end])
    _close(gx, np.asarray(gx_ref)[start:end])
    _close(sync.moving_variance, ref.moving_variance)


def _mlp(norm: keras.layers.Layer) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), norm,
                             keras.layers.Activation("relu"), keras.layers.Dense(2)])


def test_sync_batch_normalization_model_fit_equals_serial_fit_and_saves():
    n, size = 4, hvd.size()  # equal rows: the averaged local means are the global mean
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n * size, 3)).astype("float32")
    t = rng.normal(size=(n * size, 2)).astype("float32")
    serial = _mlp(keras.layers.BatchNormalization(momentum=0.5))
    dist = _mlp(hvd.SyncBatchNormalization(momentum=0.5))
    serial.compile(keras.optimizers.SGD(0.1), "mse")
    dist.compile(hk.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
    serial.fit(x, t, batch_size=n * size, epochs=3, shuffle=False, verbose=0)
    mine = slice(hvd.rank() * n, (hvd.rank() + 1) * n)
    dist.fit(x[mine], t[mine], batch_size=n, epochs=3, shuffle=False, verbose=0)
    for a, b in zip(serial.weights, dist.weights):
        _close(b, a, a.path)
    _same_on_every_rank(dist.weights)
    _close(dist.predict(x, verbose=0), serial.predict(x, verbose=0))  # inference: moving stats


def test_sync_batch_normalization_bad_arguments_and_config():
    with pytest.raises(ValueError, match="fused=True"):
        hvd.SyncBatchNormalization(fused=True)
    with pytest.raises(ValueError, match="fused=None"):
        hk.SyncBatchNormalization(fused=None)
    with pytest.raises(ValueError, match="renorm"):
        hvd.SyncBatchNormalization(renorm=True)
    layer = hvd.SyncBatchNormalization(axis=1, momentum=0.9, epsilon=1e-4)
    config = layer.get_config()
    assert config["axis"] == 1 and config["momentum"] == 0.9 and "process_set" not in config
    assert type(hvd.SyncBatchNormalization.from_config(config)) is hvd.SyncBatchNormalization
    assert keras.saving.get_registered_object("plait>SyncBatchNormalization") \
        is hvd.SyncBatchNormalization


def test_sync_batch_normalization_follows_process_set():
    import plait

    alone = plait.world().split(hvd.rank(), 0)  # every rank a group of its own
    ref, sync = _bn_pair((4,))
    sync.process_set = alone
    x = np.random.default_rng(hvd.rank()).normal(size=(3 + hvd.rank(), 4)).astype("float32")
    _close(sync(x, training=True), ref(x, training=True))  # this rank's rows only
    _close(sync.moving_mean, ref.moving_mean)


def test_tape_outside_its_process_set_keeps_own_gradients_as_horovod():
    """As Horovod's tests (test_distributed_gradient_tape_process_sets): on a rank outside
    the tape's process set the gradients stay this rank's own (Horovod's _allreduce_cond);
    a registered local source is still divided by the set's size."""
    r = hvd.rank()
    hvd.init(process_sets="dynamic")  # again: keeps the world, allows add_process_set
    first = hvd.add_process_set([0])
    try:
        x, w = tf.constant(float(r)), tf.Variable(float(r))
        with tf.GradientTape() as g:
            g.watch(x)
            y = x * x + 4.0 * w
        tape = hvd.DistributedGradientTape(g, process_set=first)
        tape.register_local_source(w)
        dx, dw = tape.gradient(y, [x, w])
        assert float(dx) == 2.0 * r and float(dw) == 4.0  # [0] is a set of one
    finally:
        assert hvd.remove_process_set(first)


def test_keras_optimizer_outside_its_process_set_applies_own_gradients_as_horovod():
    """As Horovod's Keras optimizer: a rank outside its process set applies its own
    gradients (rank 0, alone in the set, reduces over a set of one: its own too)."""
    r = hvd.rank()
    hvd.init(process_sets="dynamic")
    first = hvd.add_process_set([0])
    try:
        v = tf.Variable([1.0, 2.0])
        opt = hk.DistributedOptimizer(keras.optimizers.SGD(0.5), process_set=first)
        opt.apply_gradients([(tf.constant([float(r), 1.0]), v)])
        np.testing.assert_allclose(v.numpy(), [1.0 - 0.5 * r, 1.5])
    finally:
        assert hvd.remove_process_set(first)


@pytest.mark.skipif(hvd.backend() != "horovod", reason="real Horovod runs on the Horovod backend")
def test_real_horovods_sync_batch_normalization_fails_on_keras_3():
    import horovod.tensorflow as real

    with pytest.raises(Exception):  # noqa: B017 - built on Keras 2's fused argument and _moments
        layer = real.SyncBatchNormalization()
        layer(tf.ones([4, 2]), training=True)


# ---- PartialDistributedGradientTape -----------------------------------------------------


def _two_layers(rank: int) -> tuple[keras.layers.Dense, keras.layers.Dense]:
    """A shared layer (the same on every rank) and ``rank``'s local layer."""
    shared, local = keras.layers.Dense(3), keras.layers.Dense(2)
    shared.build((None, 4))
    local.build((None, 3))
    shared.kernel.assign(np.random.default_rng(0).normal(size=(4, 3)))
    local.kernel.assign(np.random.default_rng(10 + rank).normal(size=(3, 2)))
    return shared, local


def _loss(shared: keras.layers.Layer, local: keras.layers.Layer, x: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(local(tf.tanh(shared(x))) ** 2)


def _data(rank: int) -> tf.Tensor:
    return tf.constant(np.random.default_rng(100 + rank).normal(size=(5, 4)), tf.float32)


def _plain_grads(rank: int) -> list[tf.Tensor]:
    """Single-process gradients of ``rank``'s loss with ``rank``'s layers."""
    shared, local = _two_layers(rank)
    with tf.GradientTape() as tape:
        loss = _loss(shared, local, _data(rank))
    return tape.gradient(loss, shared.trainable_weights + local.trainable_weights)


def _references() -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """This rank's plain gradients, and their average over the ranks."""
    every = [_plain_grads(r) for r in range(hvd.size())]
    return every[hvd.rank()], [sum(e[i] for e in every) / hvd.size() for i in range(len(every[0]))]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("scale", [True, False])
def test_partial_tape_keeps_local_layers_gradients_local(graph, scale):
    shared, local = _two_layers(hvd.rank())
    variables = shared.trainable_weights + local.trainable_weights

    def step(x: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = _loss(shared, local, x)
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local],
                                                  scale_local_gradients=scale)
        return tape.gradient(loss, variables)

    grads = (tf.function(step) if graph else step)(_data(hvd.rank()))
    own, average = _references()
    n_shared = len(shared.trainable_weights)
    for g, a in zip(grads[:n_shared], average):  # shared: the average over ranks
        _close(g, a, "shared")
    for g, o in zip(grads[n_shared:], own[n_shared:]):  # local: this rank's own (scaled)
        _close(g, o / (hvd.size() if scale else 1), "local")


def test_partial_tape_forms_and_horovods_local_source_api():
    shared, local = _two_layers(hvd.rank())
    variables = shared.trainable_weights + local.trainable_weights
    x = _data(hvd.rank())
    own, average = _references()
    for local_layers in (local, (local,)):  # one layer or any iterable
        with tf.GradientTape() as tape:
            loss = _loss(shared, local, x)
        grads = hvd.PartialDistributedGradientTape(tape, local_layers=local_layers).gradient(
            loss, variables)
        _close(grads[-1], own[-1] / hvd.size())
    with tf.GradientTape() as tape:  # no local layers: the DistributedGradientTape
        loss = _loss(shared, local, x)
    for g, a in zip(hvd.PartialDistributedGradientTape(tape).gradient(loss, variables), average):
        _close(g, a)
    with tf.GradientTape() as tape:  # Horovod's register_local_source and the split
        loss = _loss(shared, local, x)
    dtape = hvd.DistributedGradientTape(tape, scale_local_gradients=False)
    dtape.register_local_source(local.kernel)
    local_pairs, global_pairs = dtape.get_local_and_global_gradients(loss, variables)
    assert [v is local.kernel for v, _ in local_pairs] == [True]
    assert [v.path for v, _ in global_pairs] == [v.path for v in variables if v is not local.kernel]
    k = len(shared.trainable_weights)
    _close(local_pairs[0][1], own[k])
    for (v, g), a in zip(global_pairs, average[:k] + average[k + 1:]):
        _close(g, a, v.path)


def test_partial_tape_bad_local_layers():
    with tf.GradientTape() as tape:
        pass
    for bad in (tf.Variable(1.0), "dense", [keras.layers.Dense(1), 3]):
        with pytest.raises(ValueError, match="local_layers"):
            hvd.PartialDistributedGradientTape(tape, local_layers=bad)
    with pytest.raises(ValueError, match="gradtape"):
        hvd.PartialDistributedGradientTape(object(), local_layers=[])


def test_keras_optimizer_get_gradients_reduces_once_as_horovod():
    """An optimizer class with its own ``get_gradients`` (Horovod's process-set test's):
    the distributed one returns them averaged, as Horovod's does, and applying them
    does not average again; Keras 3's optimizers have none, nor does their wrapper."""
    r, n = hvd.rank(), hvd.size()

    class Own(keras.optimizers.Optimizer):
        def __init__(self, learning_rate: float = 0.1, **kw: object) -> None:
            super().__init__(learning_rate=learning_rate, **kw)  # type: ignore[arg-type]

        def get_gradients(self, loss: object, params: object) -> list[tf.Tensor]:
            return [tf.constant([float(r * r)])]

        def update_step(self, gradient: tf.Tensor, variable: tf.Variable,
                        learning_rate: object = None) -> None:
            variable.assign_add(gradient)

    opt = hk.DistributedOptimizer(Own())
    v = tf.Variable([0.0])
    mean = sum(k * k for k in range(n)) / n
    (g,) = opt.get_gradients(None, [v])
    _close(g, [mean])
    opt.apply_gradients([(g, v)])
    _close(v, [mean])
    assert not hasattr(hk.DistributedOptimizer(keras.optimizers.SGD()), "get_gradients")


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("scale", [True, False])
def test_partial_keras_optimizer_keeps_local_layers_gradients_local(graph, scale):
    """Horovod's Keras PartialDistributedOptimizer: ``apply_gradients`` applies the average
    of the shared layers' gradients and this rank's own (scaled) local ones; Horovod's
    ``_compute_gradients`` returns the same pairs."""
    shared, local = _two_layers(hvd.rank())
    variables = shared.trainable_weights + local.trainable_weights
    opt = hk.PartialDistributedOptimizer(keras.optimizers.SGD(0.5), local_layers=[local],
                                         scale_local_gradients=scale)
    before = [np.asarray(v) for v in variables]
    x = _data(hvd.rank())

    def step(x: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = _loss(shared, local, x)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    (tf.function(step) if graph else step)(x)
    own, average = _references()
    k = len(shared.trainable_weights)
    wanted = average[:k] + [g / (hvd.size() if scale else 1) for g in own[k:]]
    for v, b, g in zip(variables, before, wanted):
        _close(v, b - 0.5 * np.asarray(g), v.path)
    for v, b in zip(variables, before):
        v.assign(b)
    with tf.GradientTape() as tape:
        loss = _loss(shared, local, x)
    pairs = opt._compute_gradients(loss, variables, tape=tape)
    assert [v is w for (_, v), w in zip(pairs, variables)] == [True] * len(variables)
    for (g, v), w in zip(pairs, wanted):
        _close(g, w, v.path)

    def compute_and_apply(x: tf.Tensor) -> None:  # Horovod's test_tensorflow2_keras pattern:
        with tf.GradientTape() as tape:  # nested var_list, its pairs applied as they are
            loss = _loss(shared, local, x)
        opt.apply_gradients(opt._compute_gradients(loss, [variables[:k], variables[k:]], tape=tape))

    (tf.function(compute_and_apply) if graph else compute_and_apply)(x)
    for v, b, g in zip(variables, before, wanted):  # reduced once (before: local ones twice)
        _close(v, b - 0.5 * np.asarray(g), v.path)
        v.assign(b)
    plain = hk.DistributedOptimizer(keras.optimizers.SGD(0.5))  # register_local_var by hand
    plain.register_local_var(local.kernel)
    pairs = plain._compute_gradients(lambda: _loss(shared, local, x), variables)
    for (g, v), a, o in zip(pairs, average, own):
        _close(g, o / hvd.size() if v is local.kernel else a, v.path)


def test_broadcast_callback_keeps_local_variables_as_horovod():
    """BroadcastGlobalVariablesCallback(local_variables=...): those keep each rank's value,
    every other variable gets the root's."""
    root = hvd.size() - 1
    init = keras.initializers.Constant(float(hvd.rank()))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer=init,
                                                                    bias_initializer=init),
                              keras.layers.Dense(3, kernel_initializer=init, bias_initializer=init)])
    model.compile(hk.DistributedOptimizer(keras.optimizers.SGD(0.0)), "mse")
    local = list(model.layers[0].variables)
    model.fit(np.ones((2, 3)), np.ones((2, 3)), verbose=0, callbacks=[
        hk.callbacks.BroadcastGlobalVariablesCallback(root_rank=root, local_variables=local)])
    for v in model.variables:
        _close(v, np.full(v.shape, float(hvd.rank() if any(v is w for w in local) else root)), v.path)
    for bad in (local[0], "kernel", 3, [local[0], 1.0]):
        with pytest.raises(ValueError, match="local_variables"):
            hk.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=bad)


# ---- load_model, broadcast_global_variables ---------------------------------------------


def _saved(tmp_path, optimizer: keras.optimizers.Optimizer, norm: bool = False) -> tuple[str, keras.Model]:
    keras.utils.set_random_seed(1)
    layers = [keras.Input((3,)), keras.layers.Dense(4, activation="tanh")]
    layers += [hvd.SyncBatchNormalization()] if norm else []
    model = keras.Sequential(layers + [keras.layers.Dense(2)])
    model.compile(optimizer, "mse")
    rng = np.random.default_rng(3)  # the same data on every rank: a state to resume from
    model.fit(rng.normal(size=(8, 3)), rng.normal(size=(8, 2)), batch_size=4, verbose=0)
    path = str(tmp_path / f"model{hvd.rank()}.keras")
    model.save(path)
    return path, model


def test_load_model_resumes_with_a_distributed_optimizer_and_averaged_gradients(tmp_path):
    path, _ = _saved(tmp_path, keras.optimizers.Adam(0.01))
    model, serial = hk.load_model(path), keras.models.load_model(path)
    assert getattr(type(model.optimizer), "_plait_distributed", False)
    assert isinstance(model.optimizer, keras.optimizers.Adam)
    assert int(model.optimizer.iterations) == 2
    for a, b in zip(serial.optimizer.variables, model.optimizer.variables):  # saved state kept
        _close(b, a, a.path)
    n, size = 3, hvd.size()
    rng = np.random.default_rng(9)
    x = rng.normal(size=(n * size, 3)).astype("float32")
    t = rng.normal(size=(n * size, 2)).astype("float32")
    mine = slice(hvd.rank() * n, (hvd.rank() + 1) * n)
    model.fit(x[mine], t[mine], batch_size=n, shuffle=False, verbose=0)
    serial.fit(x, t, batch_size=n * size, shuffle=False, verbose=0)  # the averaged gradient
    for a, b in zip(serial.weights, model.weights):
        _close(b, a, a.path)
    _same_on_every_rank(model.weights)


def test_load_model_of_distributed_custom_and_sync_bn_models(tmp_path):
    class MySGD(keras.optimizers.SGD):
        pass

    path, _ = _saved(tmp_path, hk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
                     norm=True)
    model = hk.load_model(path, compression=hk.Compression.fp16)
    assert type(model.layers[1]) is hvd.SyncBatchNormalization
    optimizer = model.optimizer
    assert type(optimizer).__mro__[1] is keras.optimizers.SGD  # wrapped once, not twice
    assert optimizer.get_config()["momentum"] == 0.9
    path, _ = _saved(tmp_path, MySGD(0.1))
    with pytest.raises(TypeError, match="MySGD"):
        hk.load_model(path)
    assert isinstance(hk.load_model(path, custom_optimizers=[MySGD]).optimizer, MySGD)
    with pytest.raises(ValueError, match="custom_optimizers"):
        hk.load_model(path, custom_optimizers=MySGD)
    with pytest.raises(ValueError, match="legacy_opts"):
        hk.load_model(path, legacy_opts=True)
    keras.utils.set_random_seed(1)
    bare = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])  # saved uncompiled
    bare.save(str(tmp_path / f"bare{hvd.rank()}.keras"))
    assert getattr(hk.load_model(str(tmp_path / f"bare{hvd.rank()}.keras")), "optimizer", None) is None


def _slices(rank: int) -> tf.IndexedSlices:
    """Rows ``rank`` and ``rank + 1`` of a sparse gradient, values ``rank + 1``."""
    return tf.IndexedSlices(tf.fill([2, 3], float(rank + 1)), tf.constant([rank, rank + 1]))


def _dense(s: tf.IndexedSlices, rows: int) -> np.ndarray:
    return tf.math.unsorted_segment_sum(s.values, s.indices, rows).numpy()


def _sparse_reference(rows: int, average: bool) -> np.ndarray:
    """The sum (or mean) over ranks of every rank's :func:`_slices`, as a dense array."""
    ref = np.zeros([rows, 3], np.float32)
    for r in range(hvd.size()):
        ref[[r, r + 1]] += r + 1
    return ref / hvd.size() if average else ref


def test_grouped_allreduce_reduces_indexed_slices_in_their_places():
    """Horovod's grouped_allreduce takes tf.IndexedSlices among dense tensors: each comes
    back as tf.IndexedSlices (allgathered values and indices), in its place."""
    rows, r = hvd.size() + 1, hvd.rank()
    for op, average in ((hvd.Sum, False), (hvd.Average, True)):
        out = hvd.grouped_allreduce([_slices(r), tf.fill([2], float(r)), _slices(r)], op=op)
        assert [type(o) for o in out][::2] == [tf.IndexedSlices, tf.IndexedSlices]
        for s in (out[0], out[2]):
            _close(_dense(s, rows), _sparse_reference(rows, average))
        dense = sum(range(hvd.size())) / (hvd.size() if average else 1)
        _close(out[1], [dense, dense])


@pytest.mark.parametrize("grouped", [False, True])
def test_indexed_slices_refuse_other_ops_and_scaling_as_horovod(grouped):
    """Min/Max/Product/Adasum and pre/postscaling of tf.IndexedSlices raise
    NotImplementedError (Horovod's error) on every rank, before any communication."""
    def call(**kw: object) -> object:
        s = _slices(hvd.rank())
        return hvd.grouped_allreduce([s, tf.ones([2])], **kw) if grouped else hvd.allreduce(s, **kw)

    for kw in ({"op": hvd.Min}, {"op": hvd.Max}, {"op": hvd.Product}, {"op": hvd.Adasum},
               {"op": hvd.Sum, "prescale_factor": 0.5}, {"op": hvd.Sum, "postscale_factor": 2.0}):
        with pytest.raises(NotImplementedError):
            call(**kw)
    _close(hvd.allreduce(tf.ones([1]), op=hvd.Sum), [hvd.size()])  # still in step


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("kind", ["allgather", "reducescatter"])
def test_grouped_allgather_and_reducescatter_have_horovods_gradients(kind, graph):
    """grouped_allgather's gradient is allgather's (the averaged upstream gradient's rows
    of this rank), grouped_reducescatter's is reducescatter's (the allgathered upstream
    gradient, times the ranks for Sum), for each tensor of the group, eagerly and inside
    tf.function."""
    r, n = hvd.rank(), hvd.size()

    def grads() -> list[tf.Tensor]:
        if kind == "allgather":
            xs = [tf.fill([r + 1, 2], float(r)), tf.fill([1, 3], 1.0)]
        else:
            xs = [tf.fill([2 * n, 2], float(r)), tf.fill([n, 1], 2.0)]
        with tf.GradientTape() as tape:
            tape.watch(xs)
            ys = (hvd.grouped_allgather(xs) if kind == "allgather"
                  else hvd.grouped_reducescatter(xs, op=hvd.Sum))
            loss = tf.add_n([tf.reduce_sum(y) * w for y, w in zip(ys, (2.0, 1.0))])
        return tape.gradient(loss, xs)

    got = tf.function(grads)() if graph else grads()
    want = (2.0, 1.0) if kind == "allgather" else (2.0 * n, 1.0 * n)
    for g, w in zip(got, want):
        _close(g, np.full(g.shape, w))


def test_many_collectives_gradients_in_one_tf_function_equal_eager_ones():
    """One tf.function whose backward runs the gradients of grouped and single allgathers,
    reducescatters, an alltoall, a broadcast and allreduces (tensors of different sizes on
    different ranks): every call equals the eager gradients, on every rank."""
    r, n = hvd.rank(), hvd.size()

    def grads(k: tf.Tensor) -> list[tf.Tensor]:
        xs = [tf.fill([r + 1, 2], float(r)) * k, tf.fill([1, 3], 1.0) * k,
              tf.fill([2 * n, 2], float(r)) * k, tf.fill([n, 1], 2.0) * k, tf.ones([5]) * k]
        with tf.GradientTape() as tape:
            tape.watch(xs)
            ys = [*hvd.grouped_allgather(xs[:2]), *hvd.grouped_reducescatter(xs[2:4], op=hvd.Sum),
                  hvd.allgather(xs[0]), hvd.broadcast(xs[4], 0), hvd.allreduce(xs[4]),
                  hvd.alltoall(xs[2]), *hvd.grouped_allreduce(xs[2:4], op=hvd.Sum)]
            loss = tf.add_n([tf.reduce_sum(y) * float(i + 1) for i, y in enumerate(ys)])
        return tape.gradient(loss, xs)

    graph = tf.function(grads)
    for k in (1.0, 2.0, 3.0):
        for got, want in zip(graph(tf.constant(k)), grads(tf.constant(k)), strict=True):
            _close(got, want.numpy())


def test_alltoall_of_rows_unknown_when_traced_splits_evenly_at_run_time():
    """Horovod's model-parallel test: a Keras model alltoalls its embedding output inside a
    tf.function traced with rows of unknown length; splits=None splits evenly at run time,
    and rows that do not split evenly raise InvalidArgumentError (a ConfigError) on every
    rank, also through Keras' error filter, which remakes TensorFlow errors."""
    r, n = hvd.rank(), hvd.size()

    class Swap(keras.Model):
        def call(self, x: tf.Tensor) -> tf.Tensor:
            return hvd.alltoall(x * 2.0)

    model = Swap()
    step = tf.function(model, input_signature=[tf.TensorSpec([None, 2], tf.float32)])
    x = tf.reshape(tf.range(2 * n * 2, dtype=tf.float32), [2 * n, 2]) + 100.0 * r
    want = np.concatenate([x.numpy()[2 * r : 2 * r + 2] * 2.0 - 200.0 * r + 200.0 * s
                           for s in range(n)])
    _close(step(x), want)
    if n > 1:
        with pytest.raises(tf.errors.InvalidArgumentError):
            step(tf.ones([2 * n + 1, 2]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="splits") as info:
        hvd.alltoall(tf.ones([3, 2]), splits=[3])
    e = info.value  # Keras re-raises an op error as type(e)(node_def, op, message, error_code)
    again = type(e)(e.node_def, e.op, "filtered: " + e.message, e.error_code)
    assert isinstance(again, ConfigError) and again.message == "filtered: " + e.message
    assert type(pickle.loads(pickle.dumps(e))) is type(e)


def test_object_collectives_take_horovods_tensorflow_arguments():
    """horovod.tensorflow's broadcast_object / allgather_object take a TF1 ``session``
    before ``name``; broadcast_object_fn returns the broadcasting function."""
    r, n = hvd.rank(), hvd.size()
    assert hvd.broadcast_object({"r": r}, n - 1, None, "obj") == {"r": n - 1}
    assert hvd.broadcast_object({"r": r}, session=None, name="obj2") == {"r": 0}
    assert hvd.broadcast_object_fn(root_rank=n - 1, name="fn")([r]) == [n - 1]
    assert hvd.allgather_object(r, None, "all") == list(range(n))


def test_reducescatter_of_a_scalar_raises_value_error_as_horovod():
    """A 0-d tensor has no first dimension to scatter: ValueError on every rank (Horovod
    raises too), before any communication, also in the grouped form."""
    with pytest.raises(ValueError, match="tensor"):
        hvd.reducescatter(tf.constant(1.0))
    with pytest.raises(ValueError, match="tensor"):
        hvd.grouped_reducescatter([tf.ones([2, 1]), tf.constant(1.0)])
    _close(hvd.reducescatter(tf.ones([hvd.size()]), op=hvd.Sum), [hvd.size()])

def test_keras_broadcast_global_variables_in_a_session_as_horovod():
    with pytest.raises(RuntimeError, match="eager"):
        hk.broadcast_global_variables(0)
    with tf.Graph().as_default():
        v = tf.compat.v1.Variable(float(hvd.rank() + 1))
        sess = tf.compat.v1.Session()  # not yet the default session
        sess.run(tf.compat.v1.global_variables_initializer())
        with pytest.raises(RuntimeError, match="default"):
            hk.broadcast_global_variables(0)  # Keras 3 has no backend session
        with sess.as_default():
            hk.broadcast_global_variables(hvd.size() - 1)
        assert sess.run(v) == float(hvd.size())
        sess.close()


def test_inplace_broadcast_in_a_tf1_graph_assigns_ref_and_resource_variables():
    """hvd.broadcast_ in TF1 graph mode: the returned tensors assign root's values to the
    variables when run, also TF1 RefVariables (dtype uint8_ref) and bool. Kept last (with
    the other TF1-session test): on the Horovod backend a later tf.function's agreement
    check has been seen to stall after collectives ran in a TF1 session."""
    from tensorflow.python.ops.ref_variable import RefVariable

    r, root = hvd.rank(), hvd.size() - 1
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        ref = RefVariable(tf.cast(tf.fill([3], r), tf.uint8))
        res = tf.compat.v1.Variable(tf.fill([2, 2], float(r)), use_resource=True)
        flag = tf.compat.v1.Variable(tf.fill([2], r % 2 == 1), use_resource=True)
        sess.run(tf.compat.v1.global_variables_initializer())
        out = hvd.broadcast_([ref, res, flag], root)
        assert [o.dtype.base_dtype for o in out] == [tf.uint8, tf.float32, tf.bool]
        got = sess.run(out)
        for value, var in zip(got, (ref, res, flag)):
            np.testing.assert_array_equal(value, sess.run(var))
        np.testing.assert_array_equal(got[0], [root] * 3)
        _close(got[1], np.full([2, 2], root))
        np.testing.assert_array_equal(got[2], [root % 2 == 1] * 2)


def test_tf1_graph_broadcast_variables_op_and_legacy_optimizer_over_a_process_set():
    """As Horovod's tests (test_broadcast_variables_process_sets, test_legacy_Distributed
    Optimizer_process_sets): in a TF1 graph broadcast_variables returns the op that
    assigns; a tf.compat.v1.train optimizer's DistributedOptimizer averages over its
    process set and leaves the gradients of ranks outside it their own. Kept last (TF1)."""
    r, n = hvd.rank(), hvd.size()
    hvd.init(process_sets="dynamic")
    evens = hvd.add_process_set([q for q in range(n) if q % 2 == 0])
    try:
        with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
            v = tf.compat.v1.Variable([r], dtype=tf.int32)
            w = tf.compat.v1.Variable([0.0])
            sess.run(tf.compat.v1.global_variables_initializer())
            op = hvd.broadcast_variables([v], root_rank=n - 1)
            assert isinstance(op, tf.Operation)
            sess.run(op)
            assert sess.run(v).tolist() == [n - 1]
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0),
                                           process_set=evens)
            pairs = opt.compute_gradients(-w * float(r))  # gradient -r
            sess.run(opt.apply_gradients(pairs))
            mean = sum(range(0, n, 2)) / len(evens.ranks)
            assert sess.run(w)[0] == pytest.approx(mean if r % 2 == 0 else float(r))
    finally:
        assert hvd.remove_process_set(evens)


def test_tf1_monitored_session_with_broadcast_hook_as_horovods_tensorflow_mnist():
    """Horovod's examples/tensorflow/tensorflow_mnist.py: ``BroadcastGlobalVariablesHook``
    builds its broadcast after a training op fed by placeholders (on the MPI backend its
    ``session.run`` needed their feeds), then ``MonitoredTrainingSession`` with
    ``StopAtStepHook``: every rank starts from the root's values and takes the averaged
    steps. Kept last (TF1)."""
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        w = tf.compat.v1.Variable(tf.fill([3, 1], float(r + 1)))
        loss = tf.reduce_mean(tf.square(x @ w - 1.0))
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.01))
        train = opt.minimize(loss, global_step=step)
        seen: list[np.ndarray] = []  # w when the session is created, and at its end

        class Record(tf.compat.v1.train.SessionRunHook):
            def after_create_session(self, session: object, coord: object) -> None:
                seen.append(session.run(w))  # type: ignore[attr-defined]

            def end(self, session: object) -> None:
                seen.append(session.run(w))  # type: ignore[attr-defined]

        hooks = [hvd.BroadcastGlobalVariablesHook(n - 1), Record(),
                 tf.compat.v1.train.StopAtStepHook(last_step=4)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            while not sess.should_stop():
                sess.run(train, {x: np.full([2, 3], r + 1.0, np.float32)})
    _close(seen[0], np.full([3, 1], float(n)))
    value = float(n)
    for _ in range(4):  # every rank's gradient 2c(3c w - 1) (rows of c = rank + 1), averaged
        value -= 0.01 * np.mean([2 * c * (3 * c * value - 1) for c in range(1, n + 1)])
    _close(seen[1], np.full([3, 1], value))
