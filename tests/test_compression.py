"""Compressors and error feedback in one process, once per framework (numpy, torch, TensorFlow)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from plait.collectives.base import Done

import plait
from plait.compression import (
    BF16,
    FP16,
    QSGD,
    Compression,
    EFSignSGD,
    NoMemory,
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
    resolve_compressor,
    resolve_memory,
)
from plait.errors import ConfigError, PlaitTypeError
from plait.parallel.data import GradientReducer, GradSpec

FRAMEWORKS = ["numpy", "torch", "tensorflow"]


def tensor(fw: str, a: np.ndarray) -> Any:
    if fw == "torch":
        import torch

        return torch.from_numpy(np.array(a))
    if fw == "tensorflow":
        import tensorflow as tf

        return tf.convert_to_tensor(np.array(a))
    return np.array(a)


def arr(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):
        t = t.detach()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        return t.numpy()
    if hasattr(t, "numpy"):
        return np.asarray(t.numpy()).astype(np.float64) if "bfloat16" in str(t.dtype) else t.numpy()
    a = np.asarray(t)
    return a.astype(np.float64) if a.dtype.name == "bfloat16" else a


class SelfComm:
    """A communicator of one rank: enough to drive compressed_allreduce in one process."""

    backend, rank, size = "self", 0, 1

    def allreduce(self, t: Any, op: str = "average", name: str | None = None) -> Any:
        return t

    def grouped_allreduce(self, ts: Any, op: str = "average", name: str | None = None) -> Any:
        return list(ts)

    def allgather(self, t: Any, name: str | None = None) -> Any:
        return t

    def allgather_async(self, t: Any, name: str | None = None) -> Done:
        return Done(t)

    def allreduce_async(self, t: Any, op: str = "average", name: str | None = None) -> Done:
        return Done(t)


LOSSY = {
    "TopK": lambda: TopK(0.3), "RandomK": lambda: RandomK(0.3, seed=1),
    "Threshold": lambda: Threshold(0.5), "QSGD": lambda: QSGD(4, seed=2),
    "TernGrad": lambda: TernGrad(seed=3), "SignSGD": SignSGD, "EFSignSGD": EFSignSGD,
    "OneBit": OneBit, "PowerSGD": lambda: PowerSGD(1), "FP16": FP16, "BF16": BF16,
}


def normal(shape: tuple[int, ...], seed: int = 0, dtype: str = "float32") -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# -- round trips -------------------------------------------------------------------------------
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_none_is_exact(fw, dtype):
    x = (normal((3, 5)) * 10).astype(dtype)
    c = NoneCompressor()
    payload, ctx = c.compress(tensor(fw, x), "w")
    out = c.decompress(payload, ctx)
    assert arr(out).dtype == x.dtype
    np.testing.assert_array_equal(arr(out), x)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("compressor,mantissa", [(FP16(), 10), (BF16(), 7)])
def test_half_precision_round_trip_within_rounding(fw, compressor, mantissa):
    x = normal((4, 7), seed=1) * 3
    payload, ctx = compressor.compress(tensor(fw, x), "w")
    out = arr(compressor.decompress(payload, ctx))
    assert out.dtype == np.float32 and out.shape == x.shape
    # round to nearest: error at most half a unit in the last place
    assert np.all(np.abs(out - x) <= np.abs(x) * 2.0 ** -(mantissa + 1))
    assert not np.array_equal(out, x)  # it really was rounded


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_topk_keeps_exactly_the_k_largest_magnitudes(fw):
    rng = np.random.default_rng(3)
    x = (rng.permutation(40) + 1.0) * rng.choice([-1.0, 1.0], 40)
    x = x.reshape(5, 8).astype(np.float32)
    c = TopK(0.25)
    payload, ctx = c.compress(tensor(fw, x), "w")
    assert [arr(p).size for p in payload] == [10, 10]
    out = arr(c.decompress(payload, ctx))
    largest = np.argsort(-np.abs(x).ravel())[:10]
    assert set(np.flatnonzero(out)) == set(largest)
    np.testing.assert_array_equal(out.ravel()[largest], x.ravel()[largest])


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("magnitude", [False, True])
@pytest.mark.parametrize("shape", ["gauss", "block", "ties"])
def test_large_topk_selects_what_a_full_selection_selects(fw, shape, magnitude):
    """From 256K elements every adapter selects among the elements that pass a sampled
    threshold; the result is still the exact top k (of |x| with ``magnitude``: x's signs
    flipped at random then), and torch's RNG does not move."""
    rng = np.random.default_rng(1)
    n, k = 400_000, 4_000
    if shape == "gauss":
        x = np.abs(rng.standard_normal(n))
    elif shape == "block":  # the large values all in one place: a sample may miss them
        x = rng.random(n) * 1e-3
        x[:5_000] += 1.0
    else:  # many equal magnitudes: any k of the largest are a valid answer
        x = rng.integers(0, 50, n).astype(np.float64)
    if magnitude:
        x = x * (rng.integers(0, 2, n) * 2 - 1)
    x = x.astype(np.float32)
    from plait.adapters import ops_for

    t = tensor(fw, x)
    torch = pytest.importorskip("torch") if fw == "torch" else None
    state = None if torch is None else torch.get_rng_state()
    values, idx = ops_for(t).topk(t, k, magnitude=magnitude)
    if torch is not None:
        assert torch.equal(torch.get_rng_state(), state)
    values, idx = arr(values), arr(idx)
    assert idx.size == k and np.unique(idx).size == k
    np.testing.assert_array_equal(x[idx], values)
    key = np.abs(x) if magnitude else x
    np.testing.assert_array_equal(np.sort(key[idx]), np.sort(key)[-k:])
    if shape != "block":  # found through the sample: positions in order (faster to scatter)
        assert bool((idx[1:] > idx[:-1]).all())


def test_tensorflow_scatter_and_zero_at_equal_the_plain_ops():
    """Eagerly, TFOps.scatter merges several ranks' sorted positions on the host (equal
    positions add up in order) and writes them with one SparseToDense; zero_at masks many
    positions, and with ``inplace`` writes into the tensor itself: all as tf.scatter_nd and
    tf.tensor_scatter_nd_update do."""
    tf = pytest.importorskip("tensorflow")
    from plait.adapters.tensorflow import OPS

    rng = np.random.default_rng(5)
    n = 300_000
    x = tf.constant(rng.standard_normal(n).astype(np.float32))
    runs = [np.sort(rng.choice(n, 3_000, replace=False)) for _ in range(3)]
    runs.append(rng.choice(n, 500, replace=False))  # unsorted
    idx = tf.constant(np.concatenate(runs).astype(np.int32))
    vals = tf.constant(rng.standard_normal(int(idx.shape[0])).astype(np.float32))
    plain = tf.scatter_nd(tf.reshape(tf.cast(idx, tf.int64), [-1, 1]), vals, [n])
    np.testing.assert_allclose(OPS.scatter(idx, vals, n).numpy(), plain.numpy(), rtol=0, atol=1e-6)
    for count in (3_000, 10):  # masked, and one update at a time
        at = tf.constant(runs[0][:count])
        want = tf.tensor_scatter_nd_update(x, tf.reshape(at, [-1, 1]), tf.zeros([count])).numpy()
        np.testing.assert_array_equal(OPS.zero_at(x, at).numpy(), want)
        mine = x + 0.0
        out = OPS.zero_at(mine, at, inplace=True)
        np.testing.assert_array_equal(out.numpy(), want)
        np.testing.assert_array_equal(mine.numpy(), want)  # written into the tensor itself
    assert float(tf.reduce_sum(tf.abs(x))) > 0 and np.count_nonzero(x.numpy()) == n


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_threshold_sends_what_is_above_tau(fw):
    x = np.array([0.1, -2.0, 0.5, 0.7, -0.6, 0.0], dtype=np.float32)
    c = Threshold(0.6)
    payload, ctx = c.compress(tensor(fw, x), "w")
    np.testing.assert_array_equal(arr(c.decompress(payload, ctx)), x * (np.abs(x) > 0.6))
    empty, ctx = Threshold(5.0).compress(tensor(fw, x), "w")
    assert arr(empty[0]).size == 0
    np.testing.assert_array_equal(arr(c.decompress(empty, ctx)), np.zeros(6))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_sign_family_decodes(fw):
    x = np.array([[1.5, -0.5], [0.0, -3.0]], dtype=np.float32)
    p, ctx = SignSGD().compress(tensor(fw, x), "w")
    assert arr(p[0]).dtype == np.uint8 and arr(p[0]).size == 1  # 4 bits in one byte
    np.testing.assert_array_equal(arr(SignSGD().decompress(p, ctx)), [[1, -1], [1, -1]])
    p, ctx = EFSignSGD().compress(tensor(fw, x), "w")
    np.testing.assert_allclose(arr(EFSignSGD().decompress(p, ctx)), [[1.25, -1.25], [1.25, -1.25]])
    p, ctx = OneBit().compress(tensor(fw, x), "w")
    np.testing.assert_allclose(arr(OneBit().decompress(p, ctx)), [[0.75, -1.75], [0.75, -1.75]])


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_packbits_matches_numpy_bit_order(fw):
    from plait.adapters import ops_for

    bits = np.random.default_rng(4).random(21) < 0.5
    t = tensor(fw, bits)
    ops = ops_for(t)
    packed = ops.packbits(t)
    np.testing.assert_array_equal(arr(packed), np.packbits(bits))
    np.testing.assert_array_equal(arr(ops.unpackbits(packed, 21)), bits)
    for dtype, one, zero in (("float32", 1.0, -1.0), ("float64", 0.5, -2.0)):
        as_tensor = tensor(fw, np.array([one], dtype=dtype)) if dtype == "float64" else one
        got = arr(ops.decode_bits(packed, 21, as_tensor, zero, dtype))
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, np.where(bits, one, zero))
    if fw == "torch":  # the path for tensors off the host, run here on the host
        from plait.adapters.torch import _shift_pack, _shift_unpack

        np.testing.assert_array_equal(arr(_shift_pack(t)), np.packbits(bits))
        np.testing.assert_array_equal(arr(_shift_unpack(packed, 21)), bits)


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_powersgd_is_exact_on_low_rank_and_passes_vectors(fw):
    rng = np.random.default_rng(5)
    m = (rng.standard_normal((12, 2)) @ rng.standard_normal((2, 10))).astype(np.float64)
    c = PowerSGD(rank=2)
    payload, ctx = c.compress(tensor(fw, m), "w")
    assert [arr(p).size for p in payload] == [24, 20]
    np.testing.assert_allclose(arr(c.decompress(payload, ctx)), m, atol=1e-9)
    bias = normal((7,))
    payload, ctx = c.compress(tensor(fw, bias), "b")
    np.testing.assert_array_equal(arr(c.decompress(payload, ctx)), bias)


# -- unbiasedness ------------------------------------------------------------------------------
def _mean_of_draws(fw: str, compressor: Any, x: np.ndarray, draws: int) -> np.ndarray:
    t = tensor(fw, x)
    total = np.zeros_like(x, dtype=np.float64)
    for _ in range(draws):
        payload, ctx = compressor.compress(t, "w")
        total += arr(compressor.decompress(payload, ctx))
    return total / draws


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("kind", ["qsgd", "terngrad", "randomk"])
def test_stochastic_compressors_are_unbiased(fw, kind):
    x = np.array([0.9, -0.35, 0.1, -1.2, 0.55, 0.0, 2.0, -0.8], dtype=np.float64)
    draws = 800
    if kind == "qsgd":
        c: Any = QSGD(levels=2, seed=11)
        std = np.full(8, np.linalg.norm(x) / 2 / 2)        # (norm / s) * sqrt(p(1-p)) <= .. / 2
    elif kind == "terngrad":
        c = TernGrad(seed=12)
        std = np.full(8, np.abs(x).max() / 2)
    else:
        c = RandomK(0.5, seed=13)
        std = np.abs(x)                                      # x * sqrt(n/k - 1)
    got = _mean_of_draws(fw, c, x, draws)
    # 6 standard deviations of the mean of `draws` draws: a fair coin cannot fail this
    np.testing.assert_array_less(np.abs(got - x), 6 * std / np.sqrt(draws) + 1e-12)
    single = arr(c.decompress(*c.compress(tensor(fw, x), "w")))
    assert not np.allclose(single, x)  # each draw is lossy; only the mean is exact


@pytest.mark.parametrize(("n", "m", "r"), [(4099, 7, 3), (3, 5, 2), (1, 1, 1), (1031, 2053, 4)])
def test_torch_products_equal_numpy_in_every_layout(n, m, r):
    """The torch adapter's tall narrow products (computed transposed) and pooled products
    (in bands of rows, the last one short) give numpy's result."""
    torch = pytest.importorskip("torch")
    from plait.adapters.torch import OPS
    from plait.collectives.pool import BufferPool

    def exact(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return x.astype(np.float64) @ y.astype(np.float64)

    a, b = normal((n, m), seed=1), normal((m, r), seed=2)  # float32: sums of m terms round
    np.testing.assert_allclose(arr(OPS.matmul(torch.from_numpy(a), torch.from_numpy(b))), exact(a, b),
                               rtol=1e-4, atol=1e-4)
    p, q = normal((n, r), seed=3), normal((r, m), seed=4)
    pool = BufferPool()
    for _ in range(2):  # the second time into a reused buffer
        out = OPS.matmul_pooled(torch.from_numpy(p), torch.from_numpy(q), pool)
        np.testing.assert_allclose(arr(out), exact(p, q), rtol=1e-5, atol=1e-5)


def test_numpy_pooled_products_and_scatters_equal_the_plain_ops_and_keep_held_results():
    """numpy's pooled forms (PowerSGD's decode, the sparse decode: also what a TensorFlow
    graph's host op runs) give the plain ops' results, into a buffer nobody else holds."""
    from plait.adapters.numpy import OPS
    from plait.collectives.pool import BufferPool

    pool = BufferPool(min_bytes=0)
    p, q = normal((7, 3), seed=5), normal((3, 11), seed=6)
    first = OPS.matmul_pooled(p, q, pool)
    np.testing.assert_array_equal(first, OPS.matmul(p, q))
    second = OPS.matmul_pooled(2 * p, q, pool)  # the first is held: another buffer
    np.testing.assert_array_equal(first, OPS.matmul(p, q))
    np.testing.assert_array_equal(second, OPS.matmul(2 * p, q))
    at, values = np.array([4, 0, 4, 9]), np.array([1.5, -2.0, 0.25, 3.0], np.float32)
    held = OPS.scatter_pooled(at, values, 10, pool)
    np.testing.assert_array_equal(held, OPS.scatter(at, values, 10))
    again = OPS.scatter_pooled(at[:2], values[:2], 10, pool)
    np.testing.assert_array_equal(held, OPS.scatter(at, values, 10))
    np.testing.assert_array_equal(again, OPS.scatter(at[:2], values[:2], 10))
    address = held.ctypes.data
    del held
    reused = OPS.scatter_pooled(at[2:], values[2:], 10, pool)  # a released buffer, zeroed
    assert reused.ctypes.data == address
    np.testing.assert_array_equal(reused, OPS.scatter(at[2:], values[2:], 10))


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("kind", ["qsgd", "terngrad"])
def test_pooled_decode_of_scaled_codes_equals_decoding_each_rank(kind, average):
    """QSGD's and TernGrad's torch decode of 3 ranks' gathered payloads, summed in pooled
    buffers, is bitwise what decoding each part and combining them gives, also the second
    time (into reused buffers)."""
    torch = pytest.importorskip("torch")
    from plait.compression.base import Compressor

    c = QSGD(5, seed=1) if kind == "qsgd" else TernGrad(seed=2)
    payloads = [c.compress(torch.from_numpy(normal((7, 11), seed=r)), "w") for r in range(3)]
    ctx = payloads[0][1]
    gathered = [torch.cat([p[0][i] for p in payloads]) for i in range(2)]
    counts = np.array([[1, 77]] * 3)
    want = Compressor.decode_gathered(c, gathered, counts, ctx, average)
    for _ in range(2):
        got = c.decode_gathered(gathered, counts, ctx, average)
        assert got.shape == (7, 11) and got.dtype == torch.float32 and torch.equal(got, want)


def test_randomk_positions_are_distinct_increasing_and_shared_by_seed():
    """numpy and torch draw the k positions directly (one draw per call, from the seed's
    stream): k distinct, increasing, equal across compressors of one seed and across the two
    frameworks, new at each call."""
    pytest.importorskip("torch")
    n, k = 10_000, 100
    x = normal((n,), seed=8)
    c = RandomK(k / n, seed=4)
    first, second = (arr(c.compress(tensor("torch", x), "w")[1].extra) for _ in range(2))
    for idx in (first, second):
        assert idx.size == k and np.unique(idx).size == k and np.all(np.diff(idx) > 0)
    for fw in ("numpy", "torch"):  # a fresh compressor of the same seed: the same first draw
        np.testing.assert_array_equal(arr(RandomK(k / n, seed=4).compress(tensor(fw, x), "w")[1].extra),
                                      first)
    assert not np.array_equal(first, second)


def test_seeded_draws_repeat_and_unseeded_differ():
    x = normal((50,), seed=6)
    a = [arr(QSGD(3, seed=7).compress(x, "w")[0][1]) for _ in range(2)]
    np.testing.assert_array_equal(a[0], a[1])
    b = [arr(QSGD(3).compress(x, "w")[0][1]) for _ in range(2)]
    assert not np.array_equal(b[0], b[1])


# -- error feedback ----------------------------------------------------------------------------
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("kind", LOSSY)
def test_error_feedback_accumulates_exactly_what_was_dropped(fw, kind):
    compressor = LOSSY[kind]()
    memory = Residual()
    total_in = np.zeros((6, 5))
    total_sent = np.zeros((6, 5))
    for step in range(5):
        g = normal((6, 5), seed=100 + step, dtype="float64")
        total_in += g
        given = tensor(fw, g)
        c = memory.compensate_in_place(given, "layer.w")
        payload, ctx = compressor.compress(c, "layer.w")
        memory.update(c, "layer.w", compressor, payload, ctx)
        total_sent += arr(compressor.decompress(payload, ctx))
        np.testing.assert_array_equal(arr(given), g)  # only the memory's own tensors are written
    residual = arr(memory.residuals["layer.w"])
    np.testing.assert_allclose(total_sent + residual, total_in, rtol=0, atol=1e-12)
    assert np.abs(residual).max() > 0  # something was held back


@pytest.mark.parametrize("kind", ["TopK", "QSGD"])
def test_error_feedback_after_the_first_step_touches_no_new_memory(kind):
    """torch: from the second step on, the compensated tensor is the residual's own memory,
    and the new residual is stored in it (through the sparse residual or a decode)."""
    torch = pytest.importorskip("torch")
    compressor, memory = LOSSY[kind](), Residual()
    where = []
    for step in range(3):
        c = memory.compensate_in_place(torch.from_numpy(normal((6, 5), seed=step)), "w")
        payload, ctx = compressor.compress(c, "w")
        memory.update(c, "w", compressor, payload, ctx)
        where.append((c.data_ptr(), memory.residuals["w"].data_ptr()))
    assert where[1][0] == where[0][1] and where[1] == where[2] and len(set(where[1])) == 1


def test_residual_weights_and_reset():
    m = Residual(beta=0.5, gamma=2.0)
    m.residuals["w"] = np.ones(2)
    np.testing.assert_array_equal(m.compensate(np.array([1.0, 3.0]), "w"), [2.5, 6.5])
    m.reset()
    np.testing.assert_array_equal(m.compensate(np.array([1.0, 3.0]), "w"), [2.0, 6.0])
    np.testing.assert_array_equal(NoMemory().compensate(np.ones(2), "w"), np.ones(2))


# -- compressed_allreduce on one rank, and what it counts ---------------------------------------
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_compressed_allreduce_counts_bytes(fw):
    x = tensor(fw, normal((20, 20)))  # 1600 bytes of float32
    stats = WireStats()
    out = compressed_allreduce(SelfComm(), x, "w", FP16(), stats=stats)
    np.testing.assert_allclose(arr(out), arr(x), rtol=1e-3)
    assert (stats.last_call.sent, stats.last_call.raw) == (800, 1600)
    compressed_allreduce(SelfComm(), x, "w", TopK(0.25), Residual(), stats=stats)
    assert stats.last_call.sent == 100 * 4 + 100 * 4  # float32 values + int32 positions
    compressed_allreduce(SelfComm(), x, "w", SignSGD(), stats=stats)
    assert stats.last_call.sent == 50 and stats.last_call.ratio == 32
    compressed_allreduce(SelfComm(), x, "w", Threshold(100.0), stats=stats)
    assert stats.last_call.sent == 16  # two empty entries and their two int64 lengths
    step = stats.end_step()
    assert step.calls == 4 and step.raw == 4 * 1600 and stats.current.calls == 0
    assert stats.ratio == pytest.approx(6400 / (800 + 800 + 50 + 16))
    assert stats.by_name["w"].calls == 4 and len(stats.steps) == 1


@pytest.mark.parametrize("compressor", [TopK(0.01), PowerSGD(rank=2)], ids=["topk", "powersgd"])
def test_tensorflow_error_feedback_in_place_equals_new_tensors(compressor, monkeypatch):
    """Eager TensorFlow's memory writes into its own tensors (add_into(own=True), zero_at
    in place); over several steps its results and residuals equal those of new tensors
    every time, bitwise, and the gradients handed in are never written."""
    import copy

    tf = pytest.importorskip("tensorflow")
    from plait.adapters.tensorflow import OPS, TFOps

    rng = np.random.default_rng(8)
    grads = [rng.standard_normal((512, 640)).astype(np.float32) for _ in range(4)]

    def run() -> tuple[list[np.ndarray], np.ndarray]:
        c, memory, out = copy.deepcopy(compressor), Residual(), []
        for g in grads:
            t = tf.constant(g)
            out.append(np.array(arr(compressed_allreduce(SelfComm(), t, "w", c, memory))))
            np.testing.assert_array_equal(t.numpy(), g)
        return out, np.array(arr(memory.residuals["w"])).reshape(512, 640)

    in_place = run()
    add_into, zero_at = TFOps.add_into, TFOps.zero_at
    monkeypatch.setattr(TFOps, "add_into", lambda self, acc, x, a=1.0, b=1.0, own=False:
                        add_into(self, acc, x, a, b))
    monkeypatch.setattr(TFOps, "zero_at", lambda self, x, indices, inplace=False:
                        zero_at(self, x, indices))
    fresh = run()
    for x, y in zip([*in_place[0], in_place[1]], [*fresh[0], fresh[1]]):
        np.testing.assert_array_equal(x, y)
    monkeypatch.undo()
    acc = tf.constant(grads[0]) + 0.0
    assert OPS.add_into(acc, tf.constant(grads[1]), 1.0, -1.0, own=True) is acc
    np.testing.assert_array_equal(acc.numpy(), grads[0] - grads[1])
    shared = OPS.add_into(acc, acc, 1.0, -1.0, own=True)  # x is acc: a new tensor
    assert shared is not acc and not shared.numpy().any() and acc.numpy().any()


def test_compressed_allreduce_inside_tf_function():
    import tensorflow as tf

    x = tf.constant(normal((3, 4)))
    fp16 = tf.function(lambda t: compressed_allreduce(SelfComm(), t, "w", Compression.fp16))
    np.testing.assert_allclose(fp16(x).numpy(), x.numpy(), rtol=1e-3)
    ints = tf.function(lambda t: compressed_allreduce(SelfComm(), t, "w", TopK(0.5)), autograph=False)
    with pytest.raises(PlaitTypeError, match="int32"):
        ints(tf.constant([[1, 2], [3, 4]]))


@pytest.mark.parametrize("kind", sorted(LOSSY))
def test_lossy_compressors_with_memory_inside_tf_function_equal_their_numpy_steps(kind):
    """Inside ``tf.function`` (as under Keras ``model.fit``) a lossy compressor and its error
    feedback run on the host: step after step, what they give on the numpy arrays."""
    import tensorflow as tf

    grads = [normal((6, 5), seed=s) for s in range(4)]
    compressor, memory = LOSSY[kind](), Residual()
    on_host = [np.asarray(compressed_allreduce(SelfComm(), g, "w", compressor, memory)) for g in grads]
    compressor, memory = LOSSY[kind](), Residual()
    step = tf.function(lambda t: compressed_allreduce(SelfComm(), t, "w", compressor, memory))
    for g, want in zip(grads, on_host):
        got = step(tf.constant(g))
        assert isinstance(got, tf.Tensor) and got.shape == g.shape
        np.testing.assert_array_equal(got.numpy(), want)


# -- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("make,match", [
    (lambda: TopK(0), "ratio=0"), (lambda: TopK(1.5), "ratio=1.5"), (lambda: TopK(-0.1), "ratio"),
    (lambda: TopK("half"), "ratio='half'"), (lambda: RandomK(0.0), "ratio=0.0"),
    (lambda: RandomK(0.5, seed=None), "seed=None"), (lambda: PowerSGD(0), "rank=0"),
    (lambda: PowerSGD(-1), "rank=-1"), (lambda: PowerSGD(1.5), "rank=1.5"),
    (lambda: QSGD(0), "levels=0"), (lambda: QSGD(-3), "levels=-3"), (lambda: Threshold(-1), "tau=-1"),
    (lambda: Threshold(float("nan")), "tau=nan"), (lambda: QSGD(4, seed=-1), "seed=-1"),
    (lambda: Residual(beta=2), "beta=2"), (lambda: Residual(gamma=0), "gamma=0"),
    (lambda: resolve_compressor("zip"), "compression='zip'"), (lambda: resolve_memory(3), "memory=3"),
    (lambda: compressed_allreduce(SelfComm(), np.ones(2), None), "name=None"),
])
def test_bad_settings_raise_config_error(make, match):
    with pytest.raises(ConfigError, match=match) as info:
        make()
    assert "expected" in str(info.value)


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("kind", LOSSY)
def test_integer_tensor_rejected_naming_tensor_and_dtype(fw, kind):
    compressor = LOSSY[kind]()
    x = tensor(fw, np.arange(12, dtype=np.int32).reshape(3, 4))
    with pytest.raises(PlaitTypeError, match=r"'fc1\.weight'.*int32"):
        compressed_allreduce(SelfComm(), x, "fc1.weight", compressor, Residual())


def test_horovod_spelling():
    assert isinstance(Compression.none, NoneCompressor)
    assert isinstance(Compression.fp16, FP16) and isinstance(Compression.bf16, BF16)
    assert resolve_compressor(None) is Compression.none
    assert resolve_compressor("FP16") is Compression.fp16
    topk = TopK(0.1)
    assert resolve_compressor(topk) is topk
    assert isinstance(resolve_memory("residual"), Residual)
    assert repr(TopK(0.1)) == "TopK(ratio=0.1)"


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("kind", LOSSY)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_tensors_decode_to_their_own_dtype(fw, kind, dtype):
    from plait.adapters import ops_for

    x = tensor(fw, normal((6, 5), seed=9))
    ops = ops_for(x)
    x = ops.cast(x, dtype)
    compressor = LOSSY[kind]()
    payload, ctx = compressor.compress(x, "h")
    out = compressor.decompress(payload, ctx)
    assert ops.dtype_name(out) == dtype and ops.shape(out) == (6, 5)


# -- compression=/memory= at the data-parallel entry points (no processes) ---------------------
@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"compression": "zip"}, ConfigError, r"compression='zip'.*\['bf16', 'fp16', 'none'\]"),
    ({"compression": 0.01}, PlaitTypeError, r"compression=0\.01.*Compressor object"),
    ({"compression": TopK}, PlaitTypeError, r"compression=<class .*TopK'>.*not the class"),
    ({"compression": "fp16", "memory": "ef"}, ConfigError, r"memory='ef'.*\['none', 'residual'\]"),
    ({"compression": "fp16", "memory": Residual}, PlaitTypeError, r"memory=<class .*not the class"),
    ({"compression": "fp16", "memory": 1}, PlaitTypeError, r"memory=1.*Memory object"),
    ({"memory": Residual()}, ConfigError, r"memory=Residual\(.*\).*compression=None"),
    ({"memory": "residual"}, ConfigError, r"memory='residual'.*compression=None"),
    ({"compression": NoneCompressor(), "memory": Residual()}, ConfigError,
     r"memory=Residual.*compression=NoneCompressor\(\)"),
    ({"compression": "none", "memory": "residual"}, ConfigError, r"memory='residual'.*compression='none'"),
])
def test_data_parallel_rejects_bad_compression_settings(kwargs, error, match):
    with pytest.raises(error, match=match) as info:
        plait.DataParallel(**kwargs)
    assert "expected" in str(info.value)


def test_data_parallel_resolves_names_to_private_objects():
    dp = plait.DataParallel(compression="FP16", memory="residual")
    assert isinstance(dp.compression, FP16) and dp.compression is not Compression.fp16
    assert isinstance(dp.memory, Residual)
    shared = plait.DataParallel(compression=Compression.bf16)
    assert isinstance(shared.compression, BF16) and shared.compression is not Compression.bf16
    assert Compression.bf16.stats is None  # counting into a DataParallel never touches the shared one
    topk, ef = TopK(0.1), Residual()
    dp = plait.DataParallel(compression=topk, memory=ef)
    assert dp.compression is topk and dp.memory is ef and topk.stats is dp.wire_stats
    mine = WireStats()
    dp = plait.DataParallel(compression=TopK(0.1).count_into(mine))
    assert dp.wire_stats is mine
    assert plait.DataParallel(compression="none", memory="none").compression is None
    assert plait.DataParallel(memory=NoMemory()).memory is not None


def test_data_parallel_optimizer_revalidates_reassigned_settings():
    dp = plait.DataParallel(compression=TopK(0.1))
    dp.compression = "zip"
    with pytest.raises(ConfigError, match="compression='zip'"):
        dp.optimizer(object())  # raises before any framework or communicator is touched
    dp.compression, dp.memory = None, Residual()
    with pytest.raises(ConfigError, match="memory=Residual"):
        dp.optimizer(object())


def test_async_tape_is_an_error_not_a_synchronous_tape():
    with pytest.raises(ConfigError, match=r"mode='async'.*'sync' for DataParallel.tape\(\)"):
        plait.DataParallel(mode="async", algorithm="local_sgd").tape(object())


def test_gradient_reducer_validates_and_counts_plain_and_compressed_traffic():
    specs = [GradSpec("w", (10, 10), "float32"), GradSpec("b", (10,), "float32")]
    with pytest.raises(ConfigError, match="memory='residual'"):
        GradientReducer(SelfComm(), specs, memory="residual")
    with pytest.raises(ConfigError, match="op='max'.*'average' or 'sum'"):
        GradientReducer(SelfComm(), specs, op="max", compression=FP16())
    for compressor, sent in [(NoneCompressor(), 440), (FP16(), 220), (TopK(0.1), 11 * 8)]:
        stats = WireStats()
        reducer = GradientReducer(SelfComm(), specs, compression=compressor.count_into(stats))
        for step in range(2):
            reducer.ready("b", normal((10,), seed=step))
            reducer.ready("w", normal((10, 10), seed=step))
            reducer.finish(lambda spec: None)
        assert [(t.sent, t.raw, t.calls) for t in stats.steps] == [(sent, 440, 1)] * 2, compressor
        assert stats.last_step.sent == sent and stats.ratio == pytest.approx(440 / sent)


@pytest.mark.parametrize("kind", ["qsgd", "terngrad"])
def test_random_rounding_never_passes_the_top_level(kind, monkeypatch):
    """Every uniform draw at its largest, just below 1: rounding to nearest in the
    random rounding must not make the largest element's code the next level up."""
    from plait.adapters import numpy as numpy_adapter

    top = np.nextafter(np.float32(1), np.float32(0))
    monkeypatch.setattr(numpy_adapter.NumpyOps, "uniform",
                        lambda self, shape, seed, like: np.full(shape, top, dtype=np.float32))
    for x in (np.array([3.0, 0.0, -0.0], np.float32), np.array([-1e-3, 2.5, -2.5, 1e-30], np.float32)):
        c: Any = QSGD(levels=1, seed=1) if kind == "qsgd" else TernGrad(seed=1)
        payload, ctx = c.compress(x, "w")
        codes = np.asarray(payload[1])
        assert np.abs(codes).max() <= 1, codes
        decoded = np.asarray(c.decompress(payload, ctx))
        assert set(np.abs(decoded).tolist()) <= {0.0, float(payload[0][0])}, decoded


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_sparse_residual_is_the_dropped_part_also_for_a_subclass(fw):
    class Scaled(TopK):  # sends its values doubled: the residual must follow its decode
        def compress(self, tensor, name):
            payload, ctx = super().compress(tensor, name)
            return [payload[0] * 2, payload[1]], ctx

    x = normal((6, 5), seed=9)
    for c in (TopK(0.2), Threshold(0.5), Scaled(0.2)):
        payload, ctx = c.compress(tensor(fw, x), "w")
        want = arr(tensor(fw, x)) - arr(c.decompress(payload, ctx))
        got = arr(c.residual(tensor(fw, x), payload, ctx))
        assert got.shape == x.shape
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("path", ["host", "autograd"])
def test_torch_random_round_codes_are_a_neighbouring_level(path):
    """torch's random rounding (chunked through numpy on the host; in torch for tensors that
    need autograd or live off the host): every code is sign(x) * floor(|x| s) or one more,
    and over many elements the codes average |x| s."""
    torch = pytest.importorskip("torch")
    from plait.adapters.torch import OPS

    x = torch.from_numpy(normal((3, 200_000), seed=4)).requires_grad_(path == "autograd")
    codes = OPS.random_round(x, torch.tensor(2.5), seed=11, code="int8").to(torch.float64)
    flat = x.detach().reshape(-1).double()
    low = torch.floor(flat.abs() * 2.5) * flat.sign()
    up = codes - low
    assert codes.shape == (600_000,) and set(up.abs().unique().tolist()) <= {0.0, 1.0}
    assert bool(((up == 0) | (up.sign() == flat.sign())).all())
    mean = (codes.abs() - flat.abs() * 2.5).mean().item()
    assert abs(mean) < 5e-3, mean


class _CopyingResidual(Residual):
    """Error feedback that never writes in place: the reference for the in-place one."""

    def compensate(self, tensor, name):
        held = self.residuals.get(name)
        return tensor if held is None else tensor + held

    def update(self, tensor, name, compressor, payload, ctx):
        self.residuals[name] = tensor - compressor.decompress(payload, ctx)

    def update_decoded(self, tensor, name, decoded):
        self.residuals[name] = tensor - decoded


@pytest.mark.parametrize("fw", ["numpy", "torch"])
@pytest.mark.parametrize("kind", ["none", *LOSSY])
def test_in_place_error_feedback_equals_copying_error_feedback(fw, kind):
    """Through compressed_allreduce on a one-rank communicator that hands the payload back
    as it is (so a lossless compressor's result is the compensated tensor itself): every
    step's result and the final residual equal those of error feedback that never writes
    in place, and the caller's results of earlier steps stay as they were."""
    make = NoneCompressor if kind == "none" else LOSSY[kind]
    memories = Residual(), _CopyingResidual()
    compressors = make(), make()
    kept: list[list[np.ndarray]] = [[], []]
    for step in range(4):
        g = normal((6, 5), seed=200 + step)
        for i in range(2):
            out = compressed_allreduce(SelfComm(), tensor(fw, g), "w", compressors[i], memories[i])
            kept[i].append((out, arr(out).copy()))
        np.testing.assert_array_equal(arr(kept[0][-1][0]), arr(kept[1][-1][0]), err_msg=f"step {step}")
    for out, seen in kept[0]:
        np.testing.assert_array_equal(arr(out), seen)  # later steps did not write into it
    np.testing.assert_array_equal(arr(memories[0].residuals["w"]), arr(memories[1].residuals["w"]))


def test_a_residual_restored_as_numpy_still_compensates_a_torch_gradient():
    """Async checkpoints restore residuals as numpy arrays: compensating a torch gradient
    then gives a torch tensor, as before error feedback wrote in place."""
    torch = pytest.importorskip("torch")
    memory = Residual()
    memory.residuals["w"] = np.ones((2, 3), dtype=np.float32)
    c = memory.compensate_in_place(torch.full((2, 3), 2.0), "w")
    assert isinstance(c, torch.Tensor) and torch.equal(c, torch.full((2, 3), 3.0))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_compensate_leaves_the_residual_and_compensate_in_place_uses_it_up(fw):
    """``compensate`` can be called to look at what will be compressed (twice, the same);
    ``compensate_in_place`` (what compressed_allreduce calls) returns the same values."""
    memory = Residual(beta=0.5, gamma=2.0)
    memory.residuals["w"] = tensor(fw, np.full((2, 3), 4.0, np.float32))
    g = tensor(fw, np.ones((2, 3), np.float32))
    first, second = arr(memory.compensate(g, "w")), arr(memory.compensate(g, "w"))
    np.testing.assert_array_equal(first, np.full((2, 3), 4.0))
    np.testing.assert_array_equal(second, first)
    np.testing.assert_array_equal(arr(memory.compensate_in_place(g, "w")), first)
    assert "w" not in memory.residuals  # until the update stores the new residual
    np.testing.assert_array_equal(arr(g), np.ones((2, 3)))
