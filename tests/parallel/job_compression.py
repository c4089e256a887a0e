"""compressed_allreduce on every rank, for every compressor x framework x backend
(run by tests/test_jobs_compression.py).

Lossless and cast compressors must give the average; lossy ones must give the
same tensor on every rank, equal to the combination of the decodes of what each
rank sent (recomputed here from a twin compressor with the same seeds).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

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
