"""Pipeline parallelism on every rank of a job (tests/test_jobs_pipeline.py).

Equivalence: a P-stage pipeline (P = world size, or pp=2 of a dp=2 x pp=2
mesh) must give the loss and weights that the unpartitioned model gives on
one process after several optimizer steps; each rank computes that serial
reference itself. Bad settings must raise on every rank before any message.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import make_comm

from plait.parallel.pipeline import PartitionError, Pipeline, PipelineError, PipelineTypeError

STEPS = 3
BATCH = 24
WIDTHS = [8, 16, 16, 12, 5]  # 4 Linear/Dense layers with 3 tanh between: 7 layers


def data(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((BATCH, WIDTHS[0])).astype(np.float32)
    y = rng.integers(0, WIDTHS[-1], size=BATCH).astype(np.int64)
    return x, y


# -- torch -----------------------------------------------------------------------------
def torch_model(drop: float = 0.0):
    import torch

    torch.manual_seed(0)
    layers: list = []
    for i in range(len(WIDTHS) - 1):
        layers.append(torch.nn.Linear(WIDTHS[i], WIDTHS[i + 1]))
        if i < len(WIDTHS) - 2:
            layers.append(torch.nn.Tanh())
            if drop:
                layers.append(torch.nn.Dropout(drop))
    return torch.nn.Sequential(*layers)


def torch_opt(params):
    import torch

    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def torch_meta_model(drop: float = 0.0):
    """torch_model described on the meta device (no weights): each rank builds its stages."""
    import torch

    with torch.device("meta"):
        return torch_model(drop)


def torch_serial(model=None) -> tuple[list[float], list[np.ndarray]]:
    import torch

    model = torch_model() if model is None else model
    opt = torch_opt(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    _TRAINED["torch"] = model
    return losses, [layer_weights(m) for m in model]


def layer_weights(layer) -> np.ndarray:
    """All weights of one layer (torch module or keras layer) as one flat array."""
    if hasattr(layer, "parameters"):
        parts = [p.detach().numpy().reshape(-1) for p in layer.parameters()]
    else:
        parts = [np.asarray(v.numpy()).reshape(-1) for v in layer.trainable_variables]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


# -- keras -----------------------------------------------------------------------------
def keras_model(built: bool = True, drop: float = 0.0):
    """The Keras model; ``built=False``: no keras.Input, so no layer has weights yet."""
    import keras

    keras.utils.set_random_seed(0)
    layers: list = [keras.Input((WIDTHS[0],))] if built else []
    for i in range(len(WIDTHS) - 1):
        layers.append(keras.layers.Dense(WIDTHS[i + 1]))
        if i < len(WIDTHS) - 2:
            layers.append(keras.layers.Activation("tanh"))
            if drop:
                layers.append(keras.layers.Dropout(drop))
    return keras.Sequential(layers)


def keras_loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def keras_opt():
    import keras

    return keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)


def keras_serial() -> tuple[list[float], list[np.ndarray]]:
    import tensorflow as tf

    model, loss_fn, opt = keras_model(), keras_loss(), keras_opt()
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    _TRAINED["keras"] = model
    return losses, [layer_weights(layer) for layer in model.layers]


_SERIAL: dict[str, tuple[list[float], list[np.ndarray]]] = {}
_TRAINED: dict = {}  # the serial model after STEPS steps, by framework


def serial(framework: str) -> tuple[list[float], list[np.ndarray]]:
    if framework not in _SERIAL:
        _SERIAL[framework] = torch_serial() if framework == "torch" else keras_serial()
    return _SERIAL[framework]


def make_pipeline(framework: str, comm, **kw) -> Pipeline:
    if framework == "torch":
        import torch

        kw.setdefault("loss_fn", torch.nn.CrossEntropyLoss())
        kw.setdefault("optimizer", torch_opt)
        return Pipeline(torch_model(), comm=comm, **kw)
    kw.setdefault("loss_fn", keras_loss())
    kw.setdefault("optimizer", keras_opt())
    return Pipeline(keras_model(), comm=comm, **kw)


def batch(framework: str, step: int, rows: slice = slice(None)):
    x, y = data(step)
    x, y = x[rows], y[rows]
    if framework == "torch":
        import torch

        return torch.from_numpy(x), torch.from_numpy(y)
    return x, y


def train_and_compare(framework: str, pipe: Pipeline, rows: slice = slice(None)) -> None:
    ref_losses, ref_weights = serial(framework)
    for step in range(STEPS):
        x, y = batch(framework, step, rows)
        loss = pipe.train_step(x, y)
        assert abs(loss - ref_losses[step]) < 1e-5, (step, loss, ref_losses[step])
    for s, (a, _b) in enumerate(pipe.bounds):
        if s not in pipe.stage_ids:
            continue
        for i, layer in enumerate(pipe.local_layers[s]):
            np.testing.assert_allclose(layer_weights(layer), ref_weights[a + i], rtol=0, atol=1e-5,
                                       err_msg=f"stage {s} layer {a + i}")
    pipe.close()


def schedules(size: int) -> list[tuple[str, int]]:
    """(schedule, microbatches) pairs to run on ``size`` pipeline ranks."""
    m = 2 * size
    fewer = [("1f1b", 1)] if size == 2 else []  # M < P: 1F1B is all warm-up and drain
    return [("gpipe", m), ("1f1b", m), *fewer, ("interleaved", m)]


FRAMEWORKS = ["torch", "keras"]


@pytest.fixture(scope="module")
def comm():
    """The MPI backend (point-to-point is MPI on both backends; see test_horovod_backend)."""
    return make_comm("mpi")


# -- equivalence -------------------------------------------------------------------------------
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_schedule_matches_serial(comm, framework):
    for name, m in schedules(comm.size):
        pipe = make_pipeline(framework, comm, stages=comm.size, microbatches=m, schedule=name)
        assert len(pipe.stage_ids) == (2 if name == "interleaved" else 1)
        train_and_compare(framework, pipe)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_stages_letting_messages_move_match_serial(comm, framework):
    """What the runtime sets up where the pipeline crosses hosts (tests/test_multihost.py runs
    it there for torch): the stages test the messages in flight between their layers (Keras:
    from host calls inside the traced chunk, on TensorFlow's threads)."""
    pipe = make_pipeline(framework, comm, microbatches=2 * comm.size, schedule="gpipe")
    pipe.runtime.wire.crosses_hosts = True
    for ex in pipe.executors.values():
        ex.progress = pipe.runtime.wire.progress
    train_and_compare(framework, pipe)


def test_horovod_backend_matches_serial():
    """Horovod communicator: p2p through its MPI side, loss broadcast through Horovod."""
    hvd = make_comm("horovod")
    pipe = make_pipeline("torch", hvd, microbatches=2 * hvd.size, schedule="1f1b")
    train_and_compare("torch", pipe)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_balance_and_checkpoint_match_serial(comm, framework):
    x, _ = batch(framework, 0)
    for kw in ({"balance": "params", "checkpoint": True},
               {"balance": "time", "sample_input": x},
               {"balance": [1] * (comm.size - 1) + [7 - (comm.size - 1)], "schedule": "gpipe"}):
        pipe = make_pipeline(framework, comm, microbatches=comm.size, **kw)
        everyone = comm.allgather_object(pipe.balance)
        assert all(b == pipe.balance for b in everyone), everyone
        train_and_compare(framework, pipe)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_predict_returns_output_on_last_rank(comm, framework):
    pipe = make_pipeline(framework, comm, microbatches=2)
    x, _ = batch(framework, 0)
    out = pipe.predict(x)
    if pipe.is_last:
        ref = torch_model()(x).detach().numpy() if framework == "torch" else keras_model()(x).numpy()
        got = out.detach().numpy() if framework == "torch" else np.asarray(out)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
    else:
        assert out is None
    pipe.close()


# -- per-stage construction, recomputation ------------------------------------------------------
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_per_stage_construction_builds_only_own_stages_and_matches_serial(comm, framework):
    """A model described without weights (torch meta device, Keras layers not built): each
    rank builds only its own stages' layers, and training matches the serial build."""
    if framework == "torch":
        import torch
        from plait.adapters.torch_pipeline import materialize

        if "torch-meta" not in _SERIAL:
            reference = torch_meta_model()
            materialize(reference, seed=7)
            _SERIAL["torch-meta"] = torch_serial(reference)
        ref_losses, ref_weights = _SERIAL["torch-meta"]
        model = torch_meta_model()
        pipe = Pipeline(model, comm=comm, microbatches=2 * comm.size, seed=7,
                        balance="params", loss_fn=torch.nn.CrossEntropyLoss(), optimizer=torch_opt)
        everything = list(model)

        def built(layer):
            return not any(p.is_meta for p in layer.parameters())

        def weighted(layer):
            return bool(list(layer.parameters()))
    else:
        ref_losses, ref_weights = serial("keras")
        model = keras_model(built=False)
        pipe = Pipeline(model, comm=comm, microbatches=2 * comm.size,
                        input_shape=(WIDTHS[0],), loss_fn=keras_loss(), optimizer=keras_opt())
        everything = model.layers

        def built(layer):
            return layer.built

        def weighted(layer):
            return "dense" in layer.name
    assert pipe.deferred
    held = {id(m) for s in pipe.stage_ids for m in pipe.local_layers[s]}
    for s, (a, b) in enumerate(pipe.bounds):
        for layer in everything[a:b]:
            if weighted(layer):
                assert built(layer) == (id(layer) in held), (s, layer)
    for step in range(STEPS):
        loss = pipe.train_step(*batch(framework, step))
        assert abs(loss - ref_losses[step]) < 1e-5, (step, loss, ref_losses[step])
    for s, (a, _b) in enumerate(pipe.bounds):
        for i, layer in enumerate(pipe.local_layers.get(s, [])):
            np.testing.assert_allclose(layer_weights(layer), ref_weights[a + i], rtol=0, atol=1e-5)
    pipe.close()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_recompute_draws_the_same_dropout_masks(comm, framework):
    """With dropout, checkpoint=True must give the gradients (so the weights) of checkpoint=False."""
    results = []
    for checkpoint in (False, True):
        if framework == "torch":
            import torch

            torch.manual_seed(1234)  # the dropout masks' stream, the same for both runs
            pipe = Pipeline(torch_model(drop=0.5), comm=comm, microbatches=2 * comm.size,
                            checkpoint=checkpoint, loss_fn=torch.nn.CrossEntropyLoss(),
                            optimizer=torch_opt)
        else:
            pipe = Pipeline(keras_model(drop=0.5), comm=comm, microbatches=2 * comm.size,
                            checkpoint=checkpoint, loss_fn=keras_loss(), optimizer=keras_opt())
        losses = [pipe.train_step(*batch(framework, step)) for step in range(2)]
        weights = [layer_weights(m) for s in pipe.stage_ids for m in pipe.local_layers[s]]
        results.append((losses, weights))
        pipe.close()
    (l0, w0), (l1, w1) = results
    np.testing.assert_allclose(l1, l0, rtol=0, atol=1e-6)
    for a, b in zip(w0, w1):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    assert abs(l0[0] - serial(framework)[0][0]) > 1e-4  # dropout really changed the loss


# -- errors, before any communication, on every rank ---------------------------------------------
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_settings_raise_on_every_rank(comm, framework):
    p = comm.size
    with pytest.raises(PartitionError, match="fewer than"):
        make_pipeline(framework, comm, schedule="interleaved", chunks=4, microbatches=p)
    with pytest.raises(PipelineError, match="stages must equal"):
        make_pipeline(framework, comm, stages=p + 1)
    with pytest.raises(PipelineError, match="multiple of stages"):
        make_pipeline(framework, comm, schedule="interleaved", microbatches=p + 1)
    with pytest.raises(PartitionError, match="balance must sum"):
        make_pipeline(framework, comm, balance=[1] * p)
    with pytest.raises(PipelineError, match="schedule must be one of"):
        make_pipeline(framework, comm, schedule="zigzag")
    with pytest.raises(PipelineTypeError, match="loss_fn is required"):
        make_pipeline(framework, comm, loss_fn=None)
    pipe = make_pipeline(framework, comm, microbatches=5)
    x, y = batch(framework, 0)
    with pytest.raises(PartitionError, match="microbatches must divide batch_size=24"):
        pipe.train_step(x, y)
    pipe.close()
    comm.barrier()  # nobody was left waiting for a message


def test_bad_batch_given_only_to_the_end_stages_raises_on_every_rank(comm):
    """x only on the first stage, y only on the last: a middle stage (np=3) has no batch to
    check, yet raises the same error as the others instead of waiting for an activation."""
    pipe = make_pipeline("torch", comm, microbatches=4, schedule="1f1b")
    x, y = batch("torch", 0)
    last = comm.size - 1

    def ends(xb, yb):
        return (xb if pipe.is_first else None), (yb if pipe.is_last else None)

    with pytest.raises(PartitionError, match="x with 22 rows on rank 0: microbatches must divide"):
        pipe.train_step(*ends(x[:22], y[:22]))
    with pytest.raises(PartitionError, match=f"same number of rows, got 20 rows: y on rank {last}; "
                                             f"24 rows: x on rank 0"):
        pipe.train_step(*ends(x, y[:20]))
    with pytest.raises(PipelineTypeError, match="x \\(the input batch\\) is required .* on rank 0"):
        pipe.train_step(*ends(None, y))
    with pytest.raises(PipelineTypeError, match="batch x on rank 0 must have a batch dimension"):
        pipe.train_step(*ends(x[0, 0], y))
    with pytest.raises(PipelineTypeError, match="x \\(the input batch\\) is required"):
        pipe.predict(None)
    comm.barrier()  # nobody was left waiting for a message
    loss = pipe.train_step(*ends(x, y))  # nothing was changed by the failed steps
    assert abs(loss - serial("torch")[0][0]) < 1e-5
    pipe.close()


def test_stage_failing_to_build_on_one_rank_raises_on_every_rank(comm):
    import torch

    class NoReset(torch.nn.Module):  # parameters, but nothing to initialise them with
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(WIDTHS[-2], WIDTHS[-1]))

        def forward(self, x):
            return x @ self.w

    with torch.device("meta"):
        model = torch.nn.Sequential(*list(torch_model())[:-1], NoReset())
    last = comm.size - 1
    with pytest.raises(PartitionError, match=f"building the pipeline stages failed on job rank {last} "
                                             f"\\(stage {last} on pipeline rank {last}: .*NoReset"):
        Pipeline(model, comm=comm, microbatches=2, loss_fn=torch.nn.CrossEntropyLoss())
    comm.barrier()


def test_stage_output_not_fitting_the_next_stage_raises_on_every_rank(comm):
    """The last stage's Linear expects 12 features and gets 16: its rank fails in forward and
    every other rank (waiting for messages of that step) raises too, naming stage and shape."""
    import torch

    from plait.parallel.pipeline import StageFailed

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
              torch.nn.Linear(12, 5)]
    last = comm.size - 1
    pipe = Pipeline(torch.nn.Sequential(*layers), comm=comm, microbatches=4,
                    balance=[1] * last + [5 - last], loss_fn=torch.nn.CrossEntropyLoss(),
                    optimizer=torch_opt)
    with pytest.raises(StageFailed, match=f"forward\\(mb=0, stage={last}\\) failed on pipeline rank "
                                          f"{last} \\(its input has shape \\(6, "):
        pipe.train_step(*batch("torch", 0))
    with pytest.raises(PipelineError, match="failed half-way"):
        pipe.train_step(*batch("torch", 0))
    pipe.close()
    comm.barrier()
    train_and_compare("torch", make_pipeline("torch", comm, microbatches=4))  # nothing left behind


def test_timeline_records_every_pipeline_action(comm):
    """Run by the np=3 job with PLAIT_TIMELINE set; tests/test_jobs_pipeline.py reads the file."""
    from plait.collectives.timeline import Recorder, maybe_wrap

    pipe = make_pipeline("torch", maybe_wrap(comm), microbatches=comm.size, schedule="1f1b")
    x, y = batch("torch", 0)
    assert abs(pipe.train_step(x, y) - serial("torch")[0][0]) < 1e-5
    pipe.close()
    Recorder._open[os.environ["PLAIT_TIMELINE"]].close()


def test_model_type_is_checked():
    with pytest.raises(PipelineTypeError, match="model must be"):
        Pipeline(object(), loss_fn=lambda a, b: 0)


# -- dp x pp and pp x tp meshes (run with 4 ranks: -k mesh) ------------------------------------------
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_mesh_pp2_tp2_with_tensor_parallel_stages_matches_serial(comm, framework):
    """Each stage's Linear/Dense layers split column- then row-wise over mesh.tensor."""
    from plait import Colwise, Mesh, Rowwise, TensorParallel

    mesh = Mesh(pp=2, tp=2, comm=comm)
    model = torch_model() if framework == "torch" else keras_model()
    names = ([str(i) for i in range(len(model))] if framework == "torch"
             else [layer.name for layer in model.layers])
    plan = {names[0]: Colwise(), names[2]: Rowwise(), names[4]: Colwise(), names[6]: Rowwise()}
    model = TensorParallel(plan, comm=mesh.tensor).apply(model)
    if framework == "torch":
        import torch

        pipe = Pipeline(model, comm=mesh, microbatches=4, loss_fn=torch.nn.CrossEntropyLoss(),
                        optimizer=torch_opt)
    else:
        pipe = Pipeline(model, comm=mesh, microbatches=4, loss_fn=keras_loss(), optimizer=keras_opt())
    assert pipe.stages == 2 and pipe.balance == [4, 3] and pipe.rank == mesh.coords["pp"]
    ref_losses, _ = serial(framework)
    for step in range(STEPS):
        loss = pipe.train_step(*batch(framework, step))
        assert abs(loss - ref_losses[step]) < 1e-5, (step, loss, ref_losses[step])
    x, _ = batch(framework, 0)
    out = pipe.predict(x)  # the trained shards compute what the trained serial model does
    if pipe.is_last:
        ref = _TRAINED[framework](x)
        ref = ref.detach().numpy() if framework == "torch" else ref.numpy()
        got = out.detach().numpy() if framework == "torch" else np.asarray(out)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    else:
        assert out is None
    pipe.close()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_mesh_dp2_pp2_matches_serial(comm, framework):
    from plait import Mesh

    mesh = Mesh(dp=2, pp=2, comm=comm)
    dp = mesh.coords["dp"]
    rows = slice(dp * BATCH // 2, (dp + 1) * BATCH // 2)
    for name in ("1f1b", "interleaved") if framework == "torch" else ("1f1b",):
        pipe = make_pipeline(framework, mesh, microbatches=2, schedule=name)
        assert pipe.stages == 2 and pipe.rank == mesh.coords["pp"]
        train_and_compare(framework, pipe, rows)


def test_mesh_bad_batch_on_one_replica_raises_on_every_rank(comm):
    from plait import Mesh

    mesh = Mesh(dp=2, pp=2, comm=comm)
    pipe = make_pipeline("torch", mesh, microbatches=2)
    x, y = batch("torch", 0, slice(0, 12 if mesh.coords["dp"] == 0 else 11))
    # world rank 1 is (dp=1, pp=0) in the default "tp-dp-pp" order: the first one given 11 rows
    with pytest.raises(PartitionError, match="with 11 rows on rank 1: microbatches must divide"):
        pipe.train_step(x, y)
    comm.barrier()
    pipe.close()
