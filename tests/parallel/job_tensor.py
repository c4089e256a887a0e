"""Tensor parallelism on every rank: sharded layers equal the dense layer (values and gradients).

Run under mpirun with 2 and 3 ranks (all dimensions divisible by 2 and 3), the
whole world as the tensor-parallel group, torch and Keras 3, both backends.
``test_mesh_*`` needs no framework and runs alone in the 8-rank job
(``-k mesh``). Frameworks are imported inside the tests so that job stays light.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TOL = {"rtol": 0, "atol": 1e-5}
IN, HIDDEN, OUT, VOCAB = 6, 12, 6, 12


@pytest.fixture(scope="session")
def mcomm():
    """The MPI world alone, for tests whose collectives the ``comm`` tests already cover on Horovod."""
    from mpi4py import MPI
    from plait.collectives.mpi import MPICommunicator

    return MPICommunicator(MPI.COMM_WORLD.Dup(), timeout=60)


def close(a, b, what):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), err_msg=what, **TOL)


def shard(a, comm, axis):
    return np.split(np.asarray(a), comm.size, axis=axis)[comm.rank]


# -- mesh (numpy only; the 8-rank job runs just these) -----------------------------------------
def test_mesh_groups_match_layout_and_reduce(comm):
    from plait.parallel.mesh import Mesh
    from plait.parallel.mesh_layout import group_of

    size = comm.size
    tp = 2 if size % 2 == 0 else 1
    pp = 2 if size % 4 == 0 else 1
    mesh = Mesh(pp=pp, tp=tp, comm=comm)
    assert (mesh.shape.dp, mesh.shape.pp, mesh.shape.tp) == (size // (tp * pp), pp, tp)
    for axis in ("dp", "pp", "tp"):
        group = group_of(mesh.shape, comm.rank, axis)
        sub = mesh.axis(axis)
        assert mesh.group(axis) == group
        assert (sub.size, sub.rank) == (len(group), group.index(comm.rank)), axis
        assert sub.allgather_object(comm.rank) == group, axis
        total = sub.allreduce(np.array([float(comm.rank)]), op="sum")
        assert float(np.asarray(total)[0]) == float(sum(group)), axis


# -- torch ------------------------------------------------------------------------------------
def torch_dense(seed=0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Linear(IN, HIDDEN), torch.nn.Linear(HIDDEN, OUT)


@pytest.mark.parametrize("row_input_parallel", [True, False])
def test_torch_column_row_mlp(comm, row_input_parallel):
    import torch
    from plait.adapters.torch_tp import ColumnParallelLinear, RowParallelLinear

    d1, d2 = torch_dense(seed=comm.rank)  # different per rank: the layers broadcast rank 0's
    c = ColumnParallelLinear.from_dense(d1, comm, gather_output=not row_input_parallel)
    r = RowParallelLinear.from_dense(d2, comm, input_is_parallel=row_input_parallel)
    d1, d2 = torch_dense(seed=0)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1))
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd = d2(torch.tanh(d1(xd)))
    yp = r(torch.tanh(c(xp)))
    close(yp.detach(), yd.detach(), "output")
    (yd * torch.arange(OUT)).sum().backward()
    (yp * torch.arange(OUT)).sum().backward()
    close(xp.grad, xd.grad, "input grad")
    close(c.weight.grad, shard(d1.weight.grad, comm, 0), "column weight grad")
    close(c.bias.grad, shard(d1.bias.grad, comm, 0), "column bias grad")
    close(r.weight.grad, shard(d2.weight.grad, comm, 1), "row weight grad")
    close(r.bias.grad, d2.bias.grad, "row bias grad")


def test_torch_embedding_and_vocab_parallel_cross_entropy(mcomm):
    comm = mcomm
    import torch
    import torch.nn.functional as F
    from plait.adapters.torch_tp import (
        ColumnParallelLinear,
        VocabParallelEmbedding,
        vocab_parallel_cross_entropy,
    )

    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(VOCAB, IN), torch.nn.Linear(IN, VOCAB)
    pemb = VocabParallelEmbedding.from_dense(emb, comm)
    phead = ColumnParallelLinear.from_dense(head, comm)
    ids = torch.tensor([[0, 5, 11], [7, 3, 6]])
    target = torch.tensor([[11, 0, 4], [6, 9, 1]])
    dense_loss = F.cross_entropy(head(emb(ids)).reshape(-1, VOCAB), target.reshape(-1))
    loss = vocab_parallel_cross_entropy(phead(pemb(ids)), target, comm)
    close(loss.item(), dense_loss.item(), "loss")
    dense_loss.backward()
    loss.backward()
    close(pemb.weight.grad, shard(emb.weight.grad, comm, 0), "embedding grad")
    close(phead.weight.grad, shard(head.weight.grad, comm, 0), "head grad")
    per_row = vocab_parallel_cross_entropy(phead(pemb(ids)), target, comm, reduction="none")
    close(per_row.detach(), F.cross_entropy(head(emb(ids)).transpose(1, 2), target,
                                            reduction="none").detach(), "per-row loss")


@pytest.mark.parametrize("gather", [True, False])
def test_torch_channel_split_conv(mcomm, gather):
    comm = mcomm
    import torch
    from plait.adapters.torch_tp import ChannelParallelConv2d

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 6, 3, padding=1)
    pconv = ChannelParallelConv2d.from_dense(conv, comm, gather_output=gather)
    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(2))
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd, yp = conv(xd), pconv(xp)
    close(yp.detach(), yd.detach() if gather else shard(yd.detach(), comm, 1), "output")
    yd.square().sum().backward()
    yp.square().sum().backward()  # without gathering, each rank's sum covers its own channels
    if gather:
        close(xp.grad, xd.grad, "input grad")
    close(pconv.weight.grad, shard(conv.weight.grad, comm, 0), "weight grad")
    close(pconv.bias.grad, shard(conv.bias.grad, comm, 0), "bias grad")


class TorchNet:
    @staticmethod
    def make(seed):
        import torch

        torch.manual_seed(seed)
        return torch.nn.ModuleDict({
            "emb": torch.nn.Embedding(VOCAB, IN),
            "block": torch.nn.ModuleDict({"fc1": torch.nn.Linear(IN, HIDDEN),
                                          "fc2": torch.nn.Linear(HIDDEN, IN)}),
            "head": torch.nn.Linear(IN, VOCAB),
        })

    @staticmethod
    def loss(m, ids, target, comm=None):
        import torch
        import torch.nn.functional as F
        from plait.adapters.torch_tp import vocab_parallel_cross_entropy

        h = m["emb"](ids)
        h = h + m["block"]["fc2"](torch.tanh(m["block"]["fc1"](h)))
        logits = m["head"](h)
        if comm is None:
            return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
        return vocab_parallel_cross_entropy(logits, target, comm)


def test_torch_plan_on_existing_model_trains_like_dense(mcomm):
    comm = mcomm
    import torch

    from plait.parallel.tensor import Colwise, Rowwise, TensorParallel, VocabParallel

    ids = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(3))
    target = torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(4))
    dense, model = TorchNet.make(0), TorchNet.make(comm.rank)
    before = TorchNet.loss(TorchNet.make(0), ids, target).item()
    plan = {"emb": VocabParallel(), "block.fc1": Colwise(), "block.fc2": Rowwise(), "head": Colwise()}
    model = TensorParallel(plan, comm=comm).apply(model)
    assert type(model["block"]["fc1"]).__name__ == "ColumnParallelLinear"
    close(TorchNet.loss(model, ids, target, comm).item(), before, "loss after sharding")
    opt_d = torch.optim.SGD(dense.parameters(), lr=0.5)
    opt_p = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        for m, opt, c in ((dense, opt_d, None), (model, opt_p, comm)):
            opt.zero_grad()
            loss = TorchNet.loss(m, ids, target, c)
            loss.backward()
            opt.step()
            if c is None:
                dl = loss.item()
            else:
                close(loss.item(), dl, "training loss")
    close(model["block"]["fc1"].weight.detach(), shard(dense["block"]["fc1"].weight.detach(), comm, 0),
          "fc1 after training")
    close(model["block"]["fc2"].weight.detach(), shard(dense["block"]["fc2"].weight.detach(), comm, 1),
          "fc2 after training")


def test_torch_plan_errors_name_the_layer(mcomm):
    comm = mcomm
    import torch

    from plait.errors import ConfigError, PlaitTypeError
    from plait.parallel.tensor import ChannelSplit, Colwise, TensorParallel

    odd = torch.nn.Sequential(torch.nn.Linear(4, 6 * comm.size + 1))
    with pytest.raises(ConfigError, match=r"layer 0: out_features=\d+ is not divisible"):
        TensorParallel({"0": Colwise()}, comm=comm).apply(odd)
    with pytest.raises(PlaitTypeError, match="layer '0' is a torch.nn.modules.linear.Linear"):
        TensorParallel({"0": ChannelSplit()}, comm=comm).apply(odd)
    with pytest.raises(ConfigError, match="plan='fc9'"):
        TensorParallel({"fc9": Colwise()}, comm=comm).apply(odd)
    with pytest.raises(ConfigError, match="plan"):
        TensorParallel({"0": "colwise"}, comm=comm)  # type: ignore[dict-item]


def test_mappings_on_a_group_of_one_are_identity(mcomm):
    comm = mcomm
    import torch

    from plait.parallel.tensor import copy_to_group, gather_from_group, reduce_from_group, scatter_to_group

    alone = comm.split(comm.rank, 0)
    assert alone.size == 1
    x = torch.randn(3, 4, requires_grad=True)
    for f in (copy_to_group, reduce_from_group, scatter_to_group, gather_from_group):
        assert f(x, alone) is x


def test_scatter_gather_roundtrip_along_dims(comm):
    import torch

    from plait.parallel.tensor import gather_from_group, scatter_to_group

    x = torch.arange(2 * 6 * 6, dtype=torch.float32).reshape(2, 6, 6).requires_grad_()
    for dim in (0 if comm.size == 2 else 1, 1, 2, -1):
        part = scatter_to_group(x, comm, dim)
        assert part.shape[dim] == x.shape[dim] // comm.size
        back = gather_from_group(part, comm, dim)
        close(back.detach(), x.detach(), f"roundtrip dim {dim}")
    (back * 2).sum().backward()
    close(x.grad, np.full(x.shape, 2.0), "gradient of the roundtrip")


# -- Keras 3 ----------------------------------------------------------------------------------
def keras_dense_mlp(seed):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(HIDDEN, activation="tanh", name="fc1"),
                             keras.layers.Dense(OUT, name="fc2")])


@pytest.mark.parametrize("row_input_parallel", [True, False])
def test_keras_column_row_mlp(comm, row_input_parallel):
    import tensorflow as tf
    from plait.adapters.keras_tp import ColumnParallelLinear, RowParallelLinear

    noisy = keras_dense_mlp(comm.rank)  # different per rank: the layers broadcast rank 0's
    c = ColumnParallelLinear(IN, HIDDEN, comm, gather_output=not row_input_parallel, activation="tanh",
                             dense=noisy.get_layer("fc1"))
    r = RowParallelLinear(HIDDEN, OUT, comm, input_is_parallel=row_input_parallel,
                          dense=noisy.get_layer("fc2"))
    dense = keras_dense_mlp(0)
    x = tf.constant(np.random.default_rng(1).standard_normal((5, IN)).astype(np.float32))
    weight = tf.range(OUT, dtype=tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        yd = dense(x)
        yp = r(c(x))
        ld, lp = tf.reduce_sum(yd * weight), tf.reduce_sum(yp * weight)
    close(yp, yd, "output")
    close(tape.gradient(lp, x), tape.gradient(ld, x), "input grad")
    gd = tape.gradient(ld, dense.trainable_variables)
    gp = tape.gradient(lp, c.trainable_variables + r.trainable_variables)
    close(gp[0], shard(gd[0], comm, 1), "column kernel grad")
    close(gp[1], shard(gd[1], comm, 0), "column bias grad")
    close(gp[2], shard(gd[2], comm, 0), "row kernel grad")
    close(gp[3], gd[3], "row bias grad")


def test_keras_embedding_and_vocab_parallel_cross_entropy(mcomm):
    comm = mcomm
    import keras
    import tensorflow as tf
    from plait.adapters.keras_tp import (
        ColumnParallelLinear,
        VocabParallelEmbedding,
        vocab_parallel_cross_entropy,
    )

    keras.utils.set_random_seed(0)
    emb, head = keras.layers.Embedding(VOCAB, IN), keras.layers.Dense(VOCAB)
    ids = tf.constant([[0, 5, 11], [7, 3, 6]])
    target = tf.constant([[11, 0, 4], [6, 9, 1]])
    head(emb(ids))  # build
    pemb = VocabParallelEmbedding(VOCAB, IN, comm, dense=emb)
    phead = ColumnParallelLinear(IN, VOCAB, comm, dense=head)
    with tf.GradientTape(persistent=True) as tape:
        dl = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(target, head(emb(ids)),
                                                                         from_logits=True))
        pl = vocab_parallel_cross_entropy(phead(pemb(ids)), target, comm)
    close(pl, dl, "loss")
    close(tf.convert_to_tensor(tape.gradient(pl, pemb.embeddings)),
          shard(tf.convert_to_tensor(tape.gradient(dl, emb.embeddings)), comm, 0), "embedding grad")
    close(tape.gradient(pl, phead.kernel), shard(tape.gradient(dl, head.kernel), comm, 1), "head grad")


@pytest.mark.parametrize("gather", [True, False])
def test_keras_channel_split_conv(mcomm, gather):
    comm = mcomm
    import keras
    import tensorflow as tf
    from plait.adapters.keras_tp import ChannelParallelConv2D

    keras.utils.set_random_seed(0)
    conv = keras.layers.Conv2D(6, 3, padding="same")
    x = tf.constant(np.random.default_rng(2).standard_normal((2, 5, 5, 3)).astype(np.float32))
    conv(x)
    pconv = ChannelParallelConv2D(3, 6, 3, comm, padding="same", gather_output=gather, dense=conv)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        yd, yp = conv(x), pconv(x)
        ld, lp = tf.reduce_sum(yd ** 2), tf.reduce_sum(yp ** 2)
    close(yp, yd if gather else shard(yd, comm, 3), "output")
    if gather:
        close(tape.gradient(lp, x), tape.gradient(ld, x), "input grad")
    close(tape.gradient(lp, pconv.kernel), shard(tape.gradient(ld, conv.kernel), comm, 3), "kernel grad")
    close(tape.gradient(lp, pconv.bias), shard(tape.gradient(ld, conv.bias), comm, 0), "bias grad")


def keras_net(seed):
    import keras

    keras.utils.set_random_seed(seed)
    inp = keras.Input((IN,))
    h = keras.layers.Dense(HIDDEN, activation="tanh", name="fc1")(inp)
    h = keras.layers.Dense(HIDDEN, activation="relu", name="fc2")(h)
    out = keras.layers.Dense(10, name="head")(h)
    return keras.Model(inp, out)


def test_keras_plan_on_existing_model_fits_like_dense(mcomm):
    comm = mcomm
    import keras

    from plait.parallel.tensor import Colwise, Rowwise, TensorParallel

    rng = np.random.default_rng(5)
    x = rng.standard_normal((40, IN)).astype(np.float32)
    y = rng.integers(0, 10, 40)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dense = keras_net(0)
    before = float(loss(y, dense(x)))
    sharded = TensorParallel({"fc1": Colwise(), "fc2": Rowwise()}, comm=comm).apply(keras_net(comm.rank))
    assert type(sharded.get_layer("fc1")).__name__ == "ColumnParallelLinear"
    close(float(loss(y, sharded(x))), before, "loss after sharding")
    hist = []
    for m in (dense, sharded):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        hist.append(m.fit(x, y, batch_size=10, epochs=1, shuffle=False, verbose=0).history["loss"])
    close(hist[1], hist[0], "fit loss")
    close(sharded.get_layer("fc1").kernel, shard(dense.get_layer("fc1").kernel, comm, 1), "fc1 kernel")
    close(sharded.get_layer("fc2").kernel, shard(dense.get_layer("fc2").kernel, comm, 0), "fc2 kernel")
    close(sharded.get_layer("head").kernel, dense.get_layer("head").kernel, "head kernel")


def test_keras_plan_errors_name_the_layer(mcomm):
    comm = mcomm
    import keras

    from plait.errors import ConfigError, PlaitTypeError
    from plait.parallel.tensor import Colwise, TensorParallel, VocabParallel

    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6 * comm.size + 1, name="odd")])
    with pytest.raises(ConfigError, match=r"layer odd: out_features=\d+ is not divisible"):
        TensorParallel({"odd": Colwise()}, comm=comm).apply(m)
    with pytest.raises(PlaitTypeError, match="layer 'odd' is a keras"):
        TensorParallel({"odd": VocabParallel()}, comm=comm).apply(m)
    with pytest.raises(ConfigError, match="plan='nope'"):
        TensorParallel({"nope": Colwise()}, comm=comm).apply(m)


def test_torch_plan_channel_split_conv_model(mcomm):
    import torch

    from plait.parallel.tensor import ChannelSplit, TensorParallel

    def net(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                   torch.nn.Linear(6 * 3 * 3, 4))

    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(6))
    dense = net(0)
    sharded = TensorParallel({"0": ChannelSplit()}, comm=mcomm).apply(net(mcomm.rank))
    close(sharded(x).detach(), dense(x).detach(), "conv model output")
    dense(x).square().sum().backward()
    sharded(x).square().sum().backward()
    close(sharded[0].weight.grad, shard(dense[0].weight.grad, mcomm, 0), "conv weight grad")
    close(sharded[3].weight.grad, dense[3].weight.grad, "replicated head grad")


def test_keras_plan_embedding_and_conv_models(mcomm):
    import keras

    from plait.parallel.tensor import ChannelSplit, TensorParallel, VocabParallel

    def emb_net(seed):
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((3,), dtype="int32"),
                                 keras.layers.Embedding(VOCAB, IN, name="emb"),
                                 keras.layers.Flatten(), keras.layers.Dense(4, name="head")])

    def conv_net(seed):
        keras.utils.set_random_seed(seed)
        inp = keras.Input((5, 5, 3))
        h = keras.layers.Conv2D(6, 3, padding="same", activation="relu", name="conv")(inp)
        return keras.Model(inp, keras.layers.Dense(2, name="head")(keras.layers.Flatten()(h)))

    ids = np.array([[0, 5, 11], [7, 3, 6]], dtype=np.int32)
    sharded = TensorParallel({"emb": VocabParallel()}, comm=mcomm).apply(emb_net(mcomm.rank))
    close(sharded(ids), emb_net(0)(ids), "embedding model output")
    x = np.random.default_rng(7).standard_normal((2, 5, 5, 3)).astype(np.float32)
    sharded = TensorParallel({"conv": ChannelSplit()}, comm=mcomm).apply(conv_net(mcomm.rank))
    close(sharded(x), conv_net(0)(x), "conv model output")


@pytest.mark.parametrize("causal", [False, True])
def test_torch_ulysses_attention_equals_full_attention(mcomm, causal):
    import torch
    import torch.nn.functional as F
    from plait.adapters.torch_tp import ulysses_attention

    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 6, 6, 4, generator=gen) for _ in range(3))  # [B, S, H, D]
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in full), is_causal=causal)
    want = want.transpose(1, 2)
    mine = [shard(t, mcomm, 1).copy() for t in (q, k, v)]
    mine = [torch.from_numpy(t).requires_grad_() for t in mine]
    got = ulysses_attention(*mine, mcomm, causal=causal)
    close(got.detach(), shard(want.detach(), mcomm, 1), "attention output")
    weight = torch.arange(6.0).reshape(1, 1, 6, 1)
    (want * weight).sum().backward()
    (got * weight).sum().backward()
    for name, a, b in zip("qkv", mine, full):
        close(a.grad, shard(b.grad, mcomm, 1), f"d{name}")
