"""compressed_allreduce on every rank, for every compressor x framework x backend
(run by tests/test_jobs.py), and compression through ``plait.DataParallel``.

Lossless and cast compressors must give the average; lossy ones must give the
same tensor on every rank, equal to the combination of the decodes of what each
rank sent (recomputed here from a twin compressor with the same seeds).

Through the public entry point: ``DataParallel(...).wire_stats`` counts exactly
the analytic payload of every step (none, fp16, top-k; fused and unfused), and
``DataParallel(compression=TopK(0.1), memory=Residual()).optimizer(...)`` trains
torch and Keras (eager) models to the weights of a one-process simulation of
the same algorithm, with identical replicas.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

import plait
from plait.compression import (
    BF16,
    FP16,
    QSGD,
    EFSignSGD,
    NoneCompressor,
    OneBit,
    PowerSGD,
    RandomK,
    Residual,
    SignSGD,
    TernGrad,
    Threshold,
    TopK,
    WireStats,
    compressed_allreduce,
)
from plait.errors import MismatchError, PlaitTypeError

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# rank -> compressor; twins built with the same arguments draw the same numbers
LOSSY = {
    "topk": lambda r: TopK(0.2),
    "randomk": lambda r: RandomK(0.3, seed=5),
    "threshold": lambda r: Threshold(0.8),
    "qsgd": lambda r: QSGD(4, seed=100 + r),
    "terngrad": lambda r: TernGrad(seed=200 + r),
    "signsgd": lambda r: SignSGD(),
    "efsignsgd": lambda r: EFSignSGD(),
    "onebit": lambda r: OneBit(),
}


def data(rank: int, shape: tuple[int, ...] = (8, 6)) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(shape).astype(np.float32)


def same_on_all_ranks(comm: Any, a: np.ndarray) -> None:
    for other in comm.allgather_object(np.asarray(a)):
        np.testing.assert_array_equal(other, a)


@pytest.mark.parametrize("kind,tol", [("none", 1e-6), ("fp16", 2e-3), ("bf16", 1e-2)])
@pytest.mark.parametrize("average", [True, False])
def test_cast_compressors_give_the_average(comm, efw, kind, tol, average):
    c = {"none": NoneCompressor(), "fp16": FP16(), "bf16": BF16()}[kind]
    out = compressed_allreduce(comm, efw.tensor(data(comm.rank)), f"cast.{kind}", c, average=average)
    want = sum(data(r).astype(np.float64) for r in range(comm.size))
    want = want / comm.size if average else want
    got = efw.numpy(out)
    assert got.dtype == np.float32 and got.shape == (8, 6)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    same_on_all_ranks(comm, got)


def test_fp16_inside_tf_function_and_every_framework(comm, fw):
    out = fw.run(lambda t: compressed_allreduce(comm, t, "graph.fp16", FP16()), fw.tensor(data(comm.rank)))
    want = sum(data(r).astype(np.float64) for r in range(comm.size)) / comm.size
    np.testing.assert_allclose(fw.numpy(out), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("kind", LOSSY)
@pytest.mark.parametrize("average", [True, False])
def test_lossy_result_is_the_decode_of_what_every_rank_sent(comm, efw, kind, average):
    x = data(comm.rank)
    if kind == "threshold" and comm.rank == 0:
        x = x * 0.1  # rank 0 sends nothing: ragged, with an empty part
    name = f"lossy.{kind}.{average}"
    c, twin = LOSSY[kind](comm.rank), LOSSY[kind](comm.rank)
    memory = Residual()
    stats = WireStats()
    got = efw.numpy(compressed_allreduce(comm, efw.tensor(x), name, c, memory, average, stats=stats))
    assert got.shape == x.shape and got.dtype == np.float32
    same_on_all_ranks(comm, got)

    payload, ctx = twin.compress(efw.tensor(x), name)
    mine = [efw.numpy(p) for p in payload]
    everyone = comm.allgather_object(mine)
    if twin.summable:  # RandomK: positions agree, values are reduced
        values = sum(p[0].astype(np.float64) for p in everyone)
        values = values / comm.size if average else values
        want = efw.numpy(twin.decompress([efw.tensor(values.astype(np.float32))], ctx))
    else:
        decoded = [twin.decompress([efw.tensor(a, str(a.dtype)) for a in parts], ctx) for parts in everyone]
        want = efw.numpy(twin.combine(decoded, average))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

    # error feedback kept exactly what this rank's payload did not carry
    local = efw.numpy(twin.decompress(payload, ctx))
    np.testing.assert_allclose(efw.numpy(memory.residuals[name]), x - local, rtol=1e-6, atol=1e-6)
    assert stats.last_call.sent == sum(a.nbytes for a in mine) + (16 if twin.ragged else 0)
    assert stats.last_call.raw == x.nbytes


def test_sign_bits_compress_32x(comm, efw):
    stats = WireStats()
    compressed_allreduce(comm, efw.tensor(data(comm.rank, (64, 16))), "ratio.sign", SignSGD(), stats=stats)
    assert stats.ratio == 32.0


@pytest.mark.parametrize("average", [True, False])
def test_powersgd_matches_two_allreduces_of_factors(comm, efw, average):
    name = f"powersgd.{average}"
    c, twin = PowerSGD(rank=2), PowerSGD(rank=2)
    memory = Residual()
    xs = [data(r, (10, 12)).astype(np.float64) for r in range(comm.size)]
    stats = WireStats()
    for step in range(2):  # the second step starts from the first one's Q
        x = efw.tensor(xs[comm.rank].astype(np.float32) * (step + 1))
        q0 = efw.numpy(twin.q[name]) if step else efw.numpy(
            twin._start_q(__import__("plait").adapters.ops_for(x), name, 12, 2, x, "float32"))
        # what every rank will compress: its tensor plus its error-feedback residual
        mats = [m.astype(np.float64) for m in comm.allgather_object(efw.numpy(memory.compensate(x, name)))]
        got = efw.numpy(compressed_allreduce(comm, x, name, c, memory, average, stats=stats))
        same_on_all_ranks(comm, got)
        reduce = (lambda ms: sum(ms) / comm.size) if average else sum
        p, _ = np.linalg.qr(reduce([m @ q0 for m in mats]))
        q = reduce([m.T @ p for m in mats])
        np.testing.assert_allclose(got, p @ q.T, rtol=1e-3, atol=1e-4)
        twin.q[name] = efw.tensor(q.astype(np.float32))
    assert stats.last_call.sent == (10 * 2 + 12 * 2) * 4 and stats.last_call.raw == 10 * 12 * 4
    bias = compressed_allreduce(comm, efw.tensor(data(comm.rank, (5,))), "powersgd.bias", c)
    want = sum(data(r, (5,)).astype(np.float64) for r in range(comm.size)) / comm.size
    np.testing.assert_allclose(efw.numpy(bias), want, rtol=1e-6)


def test_integer_tensor_raises_on_every_rank(comm, efw):
    x = efw.tensor(np.arange(6).reshape(2, 3), "int32")
    with pytest.raises(PlaitTypeError, match=r"'step\.count'.*int32"):
        compressed_allreduce(comm, x, "step.count", TopK(0.5))


def test_ranks_with_different_compressors_get_an_error_not_a_hang(comm, efw):
    c = TopK(0.5) if comm.rank == 0 else SignSGD()
    with pytest.raises(MismatchError):
        compressed_allreduce(comm, efw.tensor(data(comm.rank)), "mixed", c)
    out = compressed_allreduce(comm, efw.tensor(np.ones(3, np.float32)), "after", FP16(), average=False)
    np.testing.assert_array_equal(efw.numpy(out), np.full(3, comm.size))


# -- through plait.DataParallel ------------------------------------------------------------------
# a 10-8-3 MLP: parameters of 80, 8, 24 and 3 float32 elements (115 in all, 460 bytes)
SIZES = [80, 8, 24, 3]
STEPS = 3


def topk_count(n: int, ratio: float) -> int:
    return min(n, max(1, round(n * ratio)))


# kind -> (compression=, bytes sent for a bucket of n float32 elements)
WIRE: dict[str, tuple[Any, Any]] = {
    "none": (lambda: None, lambda n: 4 * n),
    "fp16": (lambda: "fp16", lambda n: 2 * n),
    "topk": (lambda: TopK(0.1), lambda n: 8 * topk_count(n, 0.1)),  # float32 values + int32 positions
}


def batch(step: int, rank: int | None = None, size: int = 1, n: int = 16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((n, 10)).astype(np.float32)
    y = rng.integers(0, 3, n)
    return (x, y) if rank is None else (x[rank::size], y[rank::size])


def torch_mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def keras_mlp() -> Any:
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


def torch_grads(m: Any, x: np.ndarray, y: np.ndarray) -> list[Any]:
    import torch

    m.zero_grad()
    torch.nn.functional.cross_entropy(m(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    return [p.grad.clone() for p in m.parameters()]


def keras_grads(m: Any, x: np.ndarray, y: np.ndarray) -> list[Any]:
    import keras
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, m(x))
    return tape.gradient(loss, m.trainable_variables)


def torch_weights(m: Any) -> np.ndarray:
    return np.concatenate([p.detach().numpy().ravel() for p in m.parameters()])


def keras_weights(m: Any) -> np.ndarray:
    return np.concatenate([np.asarray(w).ravel() for w in m.get_weights()])


def train_torch(comm: Any, dp: Any, lr: float = 0.5, steps: int = STEPS) -> Any:
    import torch

    m = torch_mlp()
    opt = dp.optimizer(torch.optim.SGD(m.parameters(), lr=lr), m.named_parameters())
    dp.broadcast(m)
    for step in range(steps):
        torch_grads(m, *batch(step, comm.rank, comm.size))
        opt.step()
    return m


def train_keras(comm: Any, dp: Any, lr: float = 0.5, steps: int = STEPS) -> Any:
    import keras

    m = keras_mlp()
    opt = dp.optimizer(keras.optimizers.SGD(lr))
    dp.broadcast(m)
    for step in range(steps):
        opt.apply_gradients(zip(keras_grads(m, *batch(step, comm.rank, comm.size)), m.trainable_variables))
    return m


@pytest.mark.parametrize("framework", ["torch", "keras"])
@pytest.mark.parametrize("bucket_mb", [25.0, 0.0])
@pytest.mark.parametrize("kind", sorted(WIRE))
def test_wire_stats_count_the_payload_of_every_step(comm, framework, bucket_mb, kind):
    make, per_bucket = WIRE[kind]
    dp = plait.DataParallel(comm=comm, compression=make(), bucket_mb=bucket_mb)
    (train_torch if framework == "torch" else train_keras)(comm, dp)
    buckets = [sum(SIZES)] if bucket_mb else SIZES  # 460 bytes: one fused bucket
    sent, raw = sum(per_bucket(n) for n in buckets), 4 * sum(SIZES)
    stats = dp.wire_stats
    assert [(t.sent, t.raw, t.calls) for t in stats.steps] == [(sent, raw, len(buckets))] * STEPS
    assert stats.last_step.sent == sent and stats.current.calls == 0
    assert (stats.total.sent, stats.total.raw) == (STEPS * sent, STEPS * raw)
    assert stats.ratio == pytest.approx(raw / sent)


def simulate(grads_of: Any, weights: list[Any], size: int, lr: float, steps: int = STEPS) -> None:
    """One process running what ``size`` ranks do with TopK(0.1) + Residual, one bucket per
    parameter: every rank's gradient compensated, compressed and decoded, the decodes
    averaged in rank order, plain SGD applied to ``weights`` (tensors updated in place
    by ``assign(weight, new)``)."""
    twins = [(TopK(0.1), Residual()) for _ in range(size)]
    for step in range(steps):
        per_rank = [grads_of(*batch(step, r, size)) for r in range(size)]
        for i, (w, assign) in enumerate(weights):
            decoded = []
            for (c, mem), grads in zip(twins, per_rank):
                g = mem.compensate(grads[i], f"p{i}")
                payload, ctx = c.compress(g, f"p{i}")
                mem.update(g, f"p{i}", c, payload, ctx)
                decoded.append(c.decompress(payload, ctx))
            assign(w, w - lr * c.combine(decoded, average=True))


def test_topk_with_error_feedback_trains_torch_through_data_parallel(comm):
    import torch

    dp = plait.DataParallel(comm=comm, compression=TopK(0.1), memory=Residual(), bucket_mb=0)
    m = train_torch(comm, dp)
    same_on_all_ranks(comm, torch_weights(m))

    twin = torch_mlp()

    def assign(w: Any, new: Any) -> None:
        with torch.no_grad():
            w.copy_(new)

    simulate(lambda x, y: torch_grads(twin, x, y), [(p, assign) for p in twin.parameters()],
             comm.size, 0.5)
    np.testing.assert_allclose(torch_weights(m), torch_weights(twin), rtol=0, atol=1e-6)
    assert not np.allclose(torch_weights(m), torch_weights(torch_mlp()))  # it did train
    assert dp.wire_stats.ratio > 4


def test_topk_with_error_feedback_trains_keras_eagerly_through_data_parallel(comm):
    import tensorflow as tf

    dp = plait.DataParallel(comm=comm, compression=TopK(0.1), memory=Residual(), bucket_mb=0)
    m = train_keras(comm, dp)
    same_on_all_ranks(comm, keras_weights(m))

    twin = keras_mlp()
    simulate(lambda x, y: keras_grads(twin, x, y),
             [(v, lambda w, new: w.assign(tf.convert_to_tensor(new))) for v in twin.trainable_variables],
             comm.size, 0.5)
    np.testing.assert_allclose(keras_weights(m), keras_weights(twin), rtol=0, atol=1e-6)
    assert not np.allclose(keras_weights(m), keras_weights(keras_mlp()))
    assert dp.wire_stats.ratio > 4


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_data_parallel_accumulates_backward_passes_and_counts_one_step_per_update(comm, framework):
    dp = plait.DataParallel(comm=comm, compression="fp16", backward_passes_per_step=2)
    if framework == "torch":
        import torch

        m = torch_mlp()
        opt = dp.optimizer(torch.optim.SGD(m.parameters(), lr=0.5), m.named_parameters())
        for step in range(4):
            x, y = batch(step, comm.rank, comm.size)
            torch.nn.functional.cross_entropy(m(torch.from_numpy(x)), torch.from_numpy(y)).backward()
            if step % 2:
                opt.step()
                opt.zero_grad()
        weights = torch_weights(m)
    else:
        m = train_keras(comm, dp, steps=4)
        weights = keras_weights(m)
    same_on_all_ranks(comm, weights)
    assert [(t.sent, t.raw) for t in dp.wire_stats.steps] == [(2 * sum(SIZES), 4 * sum(SIZES))] * 2
