"""The MPI backend's algorithms at odd sizes, on every rank (run by tests/test_jobs.py at 2,
3 and 4 ranks, and across emulated hosts by tests/test_multihost.py).

Each algorithm (plait's pipelined ring with tiny chunks, Open MPI's collectives, the
one-round header path of small messages) must equal the numpy reference computed from
every rank's input, for every dtype and op, at sizes of 0, 1, fewer elements than
ranks, primes and several chunks; results must be bitwise equal on every rank.
numpy only: the launch pays no framework import.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from mpi4py import MPI
from plait.collectives.base import reducescatter_counts
from plait.collectives.mpi import SLOT, MPICommunicator
from plait.collectives.tuning import Tuning

DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"]
OPS = ["sum", "average", "min", "max", "product"]
SIZES = [0, 1, 3, 1031, 4099, 70001]
TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12}
_COMMS: dict[str, MPICommunicator] = {}


def communicator(algorithm: str) -> MPICommunicator:
    """One communicator per algorithm; 1 KiB ring chunks, so messages have many."""
    if algorithm not in _COMMS:
        tuning = Tuning(algorithm, algorithm, chunk_bytes=1024, ring_min_bytes=1024)
        _COMMS[algorithm] = MPICommunicator(MPI.COMM_WORLD.Dup(), timeout=60, tuning=tuning)
    return _COMMS[algorithm]


@pytest.fixture(params=["ring", "hierarchical", "mpi"], scope="module")
def comm(request: pytest.FixtureRequest) -> MPICommunicator:
    return communicator(request.param)


def data(rank: int, dtype: str, n: int, op: str = "sum", size: int = 0) -> np.ndarray:
    """Rank-dependent values that stay exact-ish in every dtype (a product is 2 at
    most: one rank of ``size`` contributes the 2 of each element)."""
    i = np.arange(n)
    if dtype == "bool":
        return (i + rank) % 3 == 0
    if op == "product":
        vals = 1 + ((i * 7 + rank) % size == 0)
    else:
        vals = (i * 7 + rank * 3) % 11 + 1
    if dtype.startswith("float") or dtype == "bfloat16":
        return (vals * 0.25).astype(np.float64)
    return vals.astype(np.float64)


def as_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes

        return a.astype(ml_dtypes.bfloat16)
    return a.astype(dtype)


def reference(op: str, dtype: str, size: int, n: int) -> np.ndarray:
    stack = np.stack([data(r, dtype, n, op, size).astype(np.float64) for r in range(size)])
    if dtype == "bool":
        return stack.any(0) if op in ("sum", "max") else stack.all(0)
    if op in ("sum", "average"):
        out = stack.sum(0)
        if op == "average":
            out = out / size if dtype in TOL else np.trunc(out / size)
        return out
    return {"min": stack.min, "max": stack.max, "product": stack.prod}[op](0)


def same_everywhere(comm: MPICommunicator, a: np.ndarray) -> None:
    digest = hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
    assert len(set(comm.allgather_object(digest))) == 1, "ranks got different results"


def close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want.astype(np.float64),
                               rtol=TOL.get(dtype, 0), atol=TOL.get(dtype, 0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_allreduce_every_dtype_op_and_odd_size(comm, op, dtype):
    if (op, dtype) == ("average", "bool"):
        return  # not a valid reduction (a ConfigError, tested in job_collectives)
    for n in SIZES:
        x = as_dtype(data(comm.rank, dtype, n, op, comm.size), dtype)
        out = comm.allreduce(x, op=op, name=f"ring.{op}.{dtype}.{n}")
        assert out.shape == (n,) and out.dtype == x.dtype
        close(out, reference(op, dtype, comm.size, n), dtype)
        same_everywhere(comm, out)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int64", "bool"])
def test_reducescatter_uneven_rows_including_fewer_rows_than_ranks(comm, dtype):
    op = "max" if dtype == "bool" else "sum"
    for rows in [1, comm.size + 1, 1031]:
        x = as_dtype(data(comm.rank, dtype, rows * 3, op, comm.size).reshape(rows, 3), dtype)
        out = comm.reducescatter(x, op=op)
        counts = reducescatter_counts(rows, comm.size)
        start = sum(counts[: comm.rank])
        want = reference(op, dtype, comm.size, rows * 3).reshape(rows, 3)
        assert out.shape == (counts[comm.rank], 3)
        close(out, want[start : start + counts[comm.rank]], dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "int8", "bool"])
def test_allgather_ragged_including_empty_parts(comm, dtype):
    for scale in [1, 997]:
        rows = (comm.rank % 2) * scale + comm.rank  # rank 0 sends nothing
        x = as_dtype(data(comm.rank, dtype, rows * 2).reshape(rows, 2), dtype)
        out = comm.allgather(x)
        want = np.concatenate([data(r, dtype, ((r % 2) * scale + r) * 2).reshape(-1, 2)
                               for r in range(comm.size)])
        close(out, want, dtype)


def test_many_in_flight_waited_in_reverse_order(comm):
    xs = [np.full(5000 + 17 * k, comm.rank + k, dtype=np.float32) for k in range(8)]
    handles = [comm.allreduce_async(x, op="sum", name=f"flight.{k}") for k, x in enumerate(xs)]
    for k in reversed(range(8)):
        want = sum(r + k for r in range(comm.size))
        np.testing.assert_array_equal(handles[k].wait(), np.full(xs[k].size, want, np.float32))


def test_many_in_flight_on_a_split_communicator(comm):
    """A communicator made by split (the gradient reducer's private one) gets as many tag
    ranges for its rings as the world: MPI defines TAG_UB on MPI_COMM_WORLD only, and the
    fallback of 7 ranges let a training step with more buckets in flight reuse the tags of
    rings still running (measured across hosts: MPI_ERR_TRUNCATE, or corrupted memory)."""
    sub = comm.split(0, comm.rank)
    assert sub._tag_slots == comm._tag_slots >= 64
    xs = [np.full(3000 + 131 * k, comm.rank + k, dtype=np.float32) for k in range(24)]
    handles = [sub.allreduce_async(x, op="sum", name=f"split.{k}") for k, x in enumerate(xs)]
    for k in range(24):
        want = sum(r + k for r in range(comm.size))
        np.testing.assert_array_equal(handles[k].wait(), np.full(xs[k].size, want, np.float32))


def test_small_messages_travel_in_the_header(comm):
    """A tensor of up to SLOT bytes is reduced in one round on any algorithm."""
    for n in [SLOT // 4, SLOT // 4 + 1]:
        x = np.full(n, comm.rank + 1, dtype=np.float32)
        out = comm.allreduce(x, op="average")
        np.testing.assert_allclose(out, np.full(n, (comm.size + 1) / 2), rtol=1e-6)
    b = comm.broadcast(np.arange(7, dtype=np.int16) * (comm.rank + 1), root=comm.size - 1)
    np.testing.assert_array_equal(b, np.arange(7, dtype=np.int16) * comm.size)


@pytest.mark.parametrize("dtype", ["float16", "float64", "uint8", "bool"])
def test_alltoall_pairwise_uneven_splits_with_empty_parts(comm, dtype):
    for scale in [1, 301]:
        # rank s sends (s + d) % 3 * scale rows to rank d: some parts are empty
        splits = [(comm.rank + d) % 3 * scale for d in range(comm.size)]
        x = as_dtype(data(comm.rank, dtype, sum(splits) * 2).reshape(-1, 2), dtype)
        out, received = comm.alltoall(x, splits=splits)
        assert received == [(s + comm.rank) % 3 * scale for s in range(comm.size)]
        parts = []
        for s in range(comm.size):
            theirs = [(s + d) % 3 * scale for d in range(comm.size)]
            start = sum(theirs[: comm.rank])
            whole = data(s, dtype, sum(theirs) * 2).reshape(-1, 2)
            parts.append(whole[start : start + theirs[comm.rank]])
        close(out, np.concatenate(parts), dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "int8", "bool"])
def test_broadcast_from_every_root_at_odd_sizes(comm, dtype):
    for n in SIZES:
        for root in range(comm.size):
            x = as_dtype(data(comm.rank, dtype, n), dtype)
            out = comm.broadcast(x, root=root)
            close(out, data(root, dtype, n), dtype)


def test_alltoall_where_some_ranks_parts_fit_the_header_and_others_do_not(comm):
    """Rank 0 sends one row to each rank (its data fits the header), the others 200 rows
    each (theirs does not): every rank must take the same second round."""
    n = 1 if comm.rank == 0 else 200
    x = np.arange(n * comm.size * 2, dtype=np.float64).reshape(-1, 2) + 1000 * comm.rank
    out, received = comm.alltoall(x, splits=[n] * comm.size)
    assert received == [1 if s == 0 else 200 for s in range(comm.size)]
    want = [(np.arange((1 if s == 0 else 200) * comm.size * 2, dtype=np.float64).reshape(-1, 2)
             + 1000 * s)[comm.rank * (1 if s == 0 else 200):(comm.rank + 1) * (1 if s == 0 else 200)]
            for s in range(comm.size)]
    np.testing.assert_array_equal(out, np.concatenate(want))


@pytest.mark.parametrize("width", [1, 300])
def test_alltoall_repeated_while_the_other_ranks_splits_change(comm, width):
    """Rank 0 makes the same call every time (its layout of the last call is kept); what
    the others send it changes from one call to the next (in the header, and past it)."""
    for i in range(4):
        if comm.rank == 0:
            splits = [1] * comm.size
        else:
            splits = [1 + (i + comm.rank) % 2] + [1] * (comm.size - 1)

        def rows(s: int, i: int = i) -> tuple[np.ndarray, list[int]]:
            theirs = [1] * comm.size if s == 0 else [1 + (i + s) % 2] + [1] * (comm.size - 1)
            return (np.arange(sum(theirs) * width, dtype=np.float32).reshape(-1, width)
                    + 1000 * s + 100 * i), theirs

        x, _ = rows(comm.rank)
        out, received = comm.alltoall(x, splits=splits)
        parts = []
        for s in range(comm.size):
            whole, theirs = rows(s)
            start = sum(theirs[: comm.rank])
            parts.append(whole[start : start + theirs[comm.rank]])
        assert received == [len(p) for p in parts]
        np.testing.assert_array_equal(out, np.concatenate(parts))


@pytest.mark.parametrize("n", [3, 5000])
def test_every_async_collective_in_flight_at_once_waited_in_reverse(comm, n):
    """The asynchronous forms (driven by the progress thread) next to one another: small
    ones travel in the header, larger ones move while the others are started."""
    rank, size = comm.rank, comm.size
    x = np.full((size * n, 2), rank + 1, dtype=np.float32)
    handles = [comm.allgather_async(x[: rank + 1]), comm.broadcast_async(x + 1, root=size - 1),
               comm.alltoall_async(x), comm.reducescatter_async(x, op="sum"),
               comm.allreduce_async(x, op="sum")]
    got = [h.wait() for h in reversed(handles)][::-1]
    np.testing.assert_array_equal(
        got[0], np.concatenate([np.full((r + 1, 2), r + 1, np.float32) for r in range(size)]))
    np.testing.assert_array_equal(got[1], np.full((size * n, 2), size + 1, np.float32))
    out, received = got[2]
    assert received == [n] * size
    np.testing.assert_array_equal(out, np.repeat(np.arange(1, size + 1, dtype=np.float32), n)[:, None]
                                  * np.ones((1, 2), np.float32))
    total = size * (size + 1) / 2
    np.testing.assert_array_equal(got[3], np.full((n, 2), total, np.float32))
    np.testing.assert_array_equal(got[4], np.full((size * n, 2), total, np.float32))


def test_ranks_may_mix_the_synchronous_and_asynchronous_forms(comm):
    """As in Horovod, one rank's ``allreduce`` meets another's ``allreduce_async``: MPI
    matches a blocking collective only with blocking ones, so the ranks agree in the
    header which call to make (the blocking one only when all wait synchronously)."""
    rank, size, n = comm.rank, comm.size, 3000
    x = np.full((size * n, 2), rank + 1, dtype=np.float32)
    total = size * (size + 1) / 2

    def run(name, *args, **kwargs):
        if rank == 0:
            return getattr(comm, name)(*args, **kwargs)
        return getattr(comm, f"{name}_async")(*args, **kwargs).wait()

    np.testing.assert_array_equal(run("allreduce", x, op="sum"), np.full_like(x, total))
    np.testing.assert_array_equal(
        run("allgather", x), np.repeat(np.arange(1, size + 1, dtype=np.float32), size * n)[:, None]
        * np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(run("broadcast", x, root=size - 1), np.full_like(x, size))
    out, received = run("alltoall", x)
    assert list(received) == [n] * size
    np.testing.assert_array_equal(out[::n, 0], np.arange(1, size + 1, dtype=np.float32))
    np.testing.assert_array_equal(run("reducescatter", x, op="sum"), np.full((n, 2), total))
