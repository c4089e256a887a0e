"""numpy adapter: host arrays, the lingua franca of the MPI backend."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .topk import seeded_topk

__all__ = ["BYTE_BITS", "OPS", "NumpyOps", "bf16_to_f32", "f32_to_bf16"]


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Widen bfloat16 values, given as their uint16 bit patterns, to float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even), returned as uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))
    out = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


#: Elements per chunk of :meth:`NumpyOps.random_round` (its temporaries stay this small).
ROUND_CHUNK = 1 << 18


def _chunk_seed(seed: int, index: int) -> int:
    """The seed of chunk ``index``'s draws in a random rounding seeded ``seed``."""
    return (int(seed) * 1_000_003 + index * 0x9E3779B9) % (1 << 63)


_NAMES: dict[np.dtype, str] = {}  # numpy's dtype.name is slow; collectives ask every call


def _dtype_name(dt: np.dtype) -> str:
    name = _NAMES.get(dt)
    if name is None:
        name = "bool" if dt == np.bool_ else str(dt.name)
        _NAMES[dt] = name
    return name


def _loaded_kernels() -> Any:
    """torch's adapter when torch is loaded, else TensorFlow's when it is, else None (numpy
    arrays never load a framework)."""
    if "torch" in sys.modules:
        from .torch import OPS as torch_ops

        return torch_ops
    if "tensorflow" in sys.modules:
        from .tensorflow import OPS as tf_ops

        return tf_ops
    return None


class NumpyOps:
    """:class:`~plait.protocols.TensorOps` for numpy arrays (bfloat16 via ml_dtypes)."""

    framework = "numpy"

    def owns(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def dtype_name(self, x: Any) -> str:
        return _dtype_name(np.asarray(x).dtype)

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in np.shape(x))

    def is_symbolic(self, x: Any) -> bool:
        return False

    def to_numpy(self, x: Any) -> np.ndarray:
        a = np.ascontiguousarray(x)
        return a.view(np.uint16) if _dtype_name(a.dtype) == "bfloat16" else a

    def from_numpy(self, a: np.ndarray, like: Any) -> np.ndarray:
        if a.dtype == np.uint16 and _dtype_name(np.asarray(like).dtype) == "bfloat16":
            return a.view(np.asarray(like).dtype)
        return a

    def host_call(
        self, fn: Callable[..., Any], inputs: Sequence[Any], like: Any, same_shape: bool = True
    ) -> Any:
        return fn(*inputs)

    # -- math -----------------------------------------------------------------
    def cast(self, x: Any, dtype: str) -> np.ndarray:
        # ``x`` itself when it has the dtype already, as torch's ``to`` and ``tf.cast`` give
        # (a copy of 10.8M float32 costs ~5 ms, several per PowerSGD call)
        if dtype == "bfloat16":
            import ml_dtypes

            return np.asarray(x).astype(ml_dtypes.bfloat16, copy=False)
        return np.asarray(x).astype(dtype, copy=False)

    def reshape(self, x: Any, shape: Sequence[int]) -> np.ndarray:
        return np.reshape(x, tuple(shape))

    def zeros(self, shape: Sequence[int], dtype: str, like: Any) -> np.ndarray:
        return self.cast(np.zeros(tuple(shape)), dtype)

    def abs(self, x: Any) -> np.ndarray:
        return np.abs(x)

    def sign(self, x: Any) -> np.ndarray:
        return np.sign(x)

    def norm(self, x: Any) -> np.ndarray:
        return np.asarray(np.linalg.norm(np.asarray(x, dtype=np.float64).ravel()), dtype=x.dtype)

    def topk(self, x: Any, k: int, magnitude: bool = False) -> tuple[np.ndarray, np.ndarray]:
        flat = np.asarray(x).ravel()
        found = seeded_topk(flat, k, magnitude)
        if found is not None:
            return found
        key = -np.abs(flat) if magnitude else -flat
        idx = np.argpartition(key, k - 1)[:k] if k < flat.size else np.arange(flat.size)
        return flat[idx], idx.astype(np.int64)

    def gather(self, x: Any, indices: Any) -> np.ndarray:
        return np.asarray(x).ravel()[np.asarray(indices)]

    def scatter(self, indices: Any, values: Any, size: int) -> np.ndarray:
        out = np.zeros(size, dtype=np.asarray(values).dtype)
        np.add.at(out, np.asarray(indices), values)
        return out

    def scatter_pooled(self, indices: Any, values: Any, size: int, pool: Any) -> np.ndarray:
        """:meth:`scatter` into a zeroed buffer of ``pool`` (a
        :class:`~plait.collectives.pool.BufferPool`): 10.8M float32 with 216K values took
        24 ms into new zeros while the last result was still held (page faults), 2.6 ms so."""
        values = np.asarray(values)
        out = pool.empty((size,), values.dtype)
        out.fill(0)
        np.add.at(out, np.asarray(indices), values)
        return out  # type: ignore[no-any-return]

    def zero_at(self, x: Any, indices: Any, inplace: bool = False) -> np.ndarray:
        out = x.reshape(-1) if inplace else np.array(x).ravel()  # a view of x, or a copy
        out[np.asarray(indices)] = 0
        return out

    def add_into(self, acc: Any, x: Any, a: float = 1.0, b: float = 1.0, own: bool = False) -> np.ndarray:
        if a != 1.0:
            np.multiply(acc, a, out=acc)
        return np.add(acc, x if b == 1.0 else np.multiply(x, b), out=acc)  # type: ignore[no-any-return]

    def host_reduce(self, op: str, dtype: str) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None:
        """The loaded framework's ``host_reduce`` (torch's, else TensorFlow's): numpy's
        float16 arithmetic converts element by element (2M elements: 16 ms, torch's or
        TensorFlow's kernels 1.4 ms, bitwise the same). A TensorFlow graph's collectives
        reach the MPI ring as numpy arrays. None where neither is loaded or has one.

        Args:
            op: "sum" (also for "average"), "min", "max" or "product".
            dtype: the buffers' plait dtype name.
        """
        kernels = _loaded_kernels()
        return None if kernels is None else kernels.host_reduce(op, dtype)  # type: ignore[no-any-return]

    def host_divide(self, dtype: str) -> Callable[[np.ndarray, int], None] | None:
        """The loaded framework's ``host_divide`` (see :meth:`host_reduce`)."""
        kernels = _loaded_kernels()
        return None if kernels is None else kernels.host_divide(dtype)  # type: ignore[no-any-return]

    def matmul(self, a: Any, b: Any) -> np.ndarray:
        return np.matmul(a, b)

    def matmul_pooled(self, a: Any, b: Any, pool: Any) -> np.ndarray:
        """``a @ b`` (2-d, one dtype) into a buffer of ``pool`` (see :meth:`scatter_pooled`):
        PowerSGD's decode (``P Q^T``, 4096 x 2560) took 45 ms into a new array while the
        last result was still held, 3 ms so."""
        a, b = np.asarray(a), np.asarray(b)
        if a.ndim != 2 or b.ndim != 2 or a.dtype != b.dtype:
            return np.matmul(a, b)
        return np.matmul(a, b, out=pool.empty((a.shape[0], b.shape[1]), a.dtype))  # type: ignore[no-any-return]

    def qr(self, x: Any) -> np.ndarray:
        q, _ = np.linalg.qr(x)
        return q

    def concat(self, xs: Sequence[Any], axis: int = 0) -> np.ndarray:
        return np.concatenate(list(xs), axis=axis)

    def split(self, x: Any, sizes: Sequence[int], axis: int = 0) -> list[np.ndarray]:
        bounds = np.cumsum(list(sizes))[:-1]
        return list(np.split(x, bounds, axis=axis))

    def uniform(self, shape: Sequence[int], seed: int, like: Any) -> np.ndarray:
        return np.random.default_rng(seed).random(tuple(shape), dtype=np.float32)

    def choose(self, n: int, k: int, seed: int, like: Any) -> np.ndarray:
        """``k`` distinct positions out of ``n`` (int64, increasing), drawn uniformly from
        ``seed``: the same on every rank given the same seed."""
        return np.sort(np.random.default_rng(seed).choice(n, k, replace=False))

    def random_round(self, x: Any, scale: Any, seed: int, code: str) -> np.ndarray:
        flat = np.asarray(x).reshape(-1)
        s = flat.dtype.type(np.asarray(scale).reshape(-1)[0])
        out = np.empty(flat.size, dtype=code)
        work = np.empty(min(flat.size, ROUND_CHUNK), dtype=flat.dtype)
        for i, start in enumerate(range(0, flat.size, ROUND_CHUNK)):
            part = flat[start:start + ROUND_CHUNK]
            t = work[:part.size]
            np.multiply(np.abs(part, out=t), s, out=t)
            t += self.uniform((part.size,), _chunk_seed(seed, i), part)  # the chunk's own draws
            np.copysign(np.floor(t, out=t), part, out=t)
            out[start:start + part.size] = t
        return out

    def floor(self, x: Any) -> np.ndarray:
        return np.floor(x)

    def sum(self, x: Any) -> np.ndarray:
        return np.asarray(np.sum(x))

    def amax(self, x: Any) -> np.ndarray:
        return np.asarray(np.max(x))

    def clamp_min(self, x: Any, value: float) -> np.ndarray:
        a = np.asarray(x)
        return np.maximum(a, np.asarray(value, dtype=a.dtype))

    def transpose(self, x: Any) -> np.ndarray:
        return np.ascontiguousarray(np.asarray(x).T)

    def nonzero(self, x: Any) -> np.ndarray:
        return np.flatnonzero(x).astype(np.int64)

    def packbits(self, bits: Any) -> np.ndarray:
        return np.packbits(np.asarray(bits, dtype=bool).ravel())

    def unpackbits(self, packed: Any, count: int) -> np.ndarray:
        return np.unpackbits(np.asarray(packed, dtype=np.uint8), count=count).astype(bool)

    def decode_bits(self, packed: Any, count: int, one: Any, zero: Any, dtype: str) -> np.ndarray:
        table = np.where(BYTE_BITS, np.asarray(one, dtype=dtype), np.asarray(zero, dtype=dtype))
        return np.take(table, np.asarray(packed, dtype=np.uint8).ravel(), axis=0).ravel()[:count]


#: Row ``b`` holds the 8 bits of byte ``b``, top bit first: the table of every
#: adapter's ``decode_bits``.
BYTE_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)).reshape(256, 8).view(np.bool_)


OPS = NumpyOps()
