"""The Compressor contract (DESIGN.md section 2) and helpers every compressor shares.

A compressor turns one tensor into a *payload* -- a list of tensors, the only
thing that crosses the wire -- and a *ctx* that stays on the rank. Two kinds:

* ``summable`` compressors (FP16, BF16, RandomK with shared indices): the
  payloads of all ranks can be added element-wise by an allreduce, and the
  decode of the sum is the sum of the decodes.
* the others (TopK, Threshold, QSGD, TernGrad, the sign family): every rank's
  payload is allgathered and decoded, and :meth:`Compressor.combine` merges
  the decoded tensors. Their payload entries are 1-d, and their ctx holds only
  what all ranks share (shape, dtype), because a rank decodes the payloads of
  the others with its own ctx.

A compressor that needs to run its own collectives (PowerSGD: an allreduce of
P, then of Q) also implements :class:`Exchanger`.

Compressors are written once, against :class:`~plait.protocols.TensorOps`, so
they work on numpy arrays, torch tensors and (eager) TensorFlow tensors alike.
"""

from __future__ import annotations

import hashlib
import secrets
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from plait.adapters import ops_for
from plait.collectives.pool import BufferPool
from plait.errors import PlaitTypeError, invalid
from plait.protocols import Communicator, Tensor, TensorOps

__all__ = [
    "FLOATS",
    "ITEMSIZE",
    "Compressor",
    "Context",
    "Exchanger",
    "Pooled",
    "SeedStream",
    "check_ratio",
    "compute_dtype",
    "derive_seed",
    "nbytes",
    "prepare",
    "restore",
]

#: Floating dtypes a lossy compressor accepts.
FLOATS = ("float16", "bfloat16", "float32", "float64")

#: Bytes per element of each canonical dtype.
ITEMSIZE = {
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
    "int16": 2, "uint16": 2, "int32": 4, "int64": 8, "bool": 1,
}


class Pooled:
    """Mixin for compressors whose decoded (or cast) tensors are large: they write them
    into buffers of a pool of their own, reused once nothing refers to them any more
    (a fresh 43 MB tensor costs ~20 ms of first-touch page faults here, see
    :class:`~plait.collectives.pool.BufferPool`), so a result the caller keeps is never
    overwritten. Only frameworks whose ops offer pooled forms use it (torch on the CPU)."""

    _pool: BufferPool | None = None

    def _buffers(self) -> BufferPool:
        if self._pool is None:
            self._pool = BufferPool()
        return self._pool

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the buffers behind (the pool holds a lock)."""
        return {k: v for k, v in self.__dict__.items() if k != "_pool"}


@dataclass(frozen=True)
class Context:
    """What a rank keeps to decode a payload.

    Attributes:
        shape: the original tensor's shape.
        dtype: the original tensor's canonical dtype name.
        extra: compressor-specific data (never sent).
    """

    shape: tuple[int, ...]
    dtype: str
    extra: Any = None

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n


class Compressor(ABC):
    """Encode a tensor into a payload that crosses the wire, and decode it again.

    Class attributes:
        summable: payloads of different ranks may be summed by an allreduce.
        ragged: payload lengths may differ between ranks (allgather path only);
            the exchange then first gathers the lengths.
        graph_safe: encodes symbolic TensorFlow tensors as graph ops (inside
            ``tf.function``; the others run there in a host op, see
            :func:`~plait.compression.compressed_allreduce`).
        elementwise: a summable payload whose every element depends only on the same
            element of the tensor (the casts): how tensors are grouped into one
            compressed tensor cannot change the result, so a data-parallel reducer
            may tune its buckets and reduce them asynchronously as uncompressed ones.

    Attributes:
        stats: a :class:`~plait.compression.stats.WireStats` that every
            :func:`~plait.compression.compressed_allreduce` through this compressor
            counts into (None: not counted). This is how a data-parallel optimiser's
            traffic is seen: ``c = TopK(0.01).count_into(WireStats())``, then pass ``c``
            as ``compression=`` and read ``c.stats``.
    """

    summable: bool = False
    ragged: bool = False
    graph_safe: bool = False
    elementwise: bool = False
    stats: Any = None

    def count_into(self, stats: Any) -> Compressor:
        """Count the traffic of every reduction through this compressor into ``stats``.

        Args:
            stats: a :class:`~plait.compression.stats.WireStats`, or None to stop counting.

        Returns:
            This compressor (for chaining).

        Raises:
            ConfigError: for anything but a WireStats or None.
        """
        from .stats import WireStats

        if stats is not None and not isinstance(stats, WireStats):
            raise invalid("stats", stats, "a plait.compression.WireStats or None")
        self.stats = stats
        return self

    @abstractmethod
    def compress(self, tensor: Tensor, name: str) -> tuple[list[Tensor], Any]:
        """Encode ``tensor``.

        Args:
            tensor: the (error-compensated) tensor to send.
            name: the tensor's name, the same on every rank (keys per-tensor state).

        Returns:
            ``(payload, ctx)``: the tensors to send, and what this rank keeps.

        Raises:
            PlaitTypeError: for a tensor the compressor cannot encode (e.g. integers).
        """

    @abstractmethod
    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """Decode a payload (this rank's, another rank's, or a sum of them).

        Args:
            payload: tensors as produced by :meth:`compress` (or their allreduced sum).
            ctx: the context :meth:`compress` returned on this rank.

        Returns:
            A tensor of the original shape and dtype.
        """

    def decode_gathered(self, gathered: Sequence[Tensor], counts: Any, ctx: Any,
                        average: bool) -> Tensor:
        """Decode the reduction of every rank's payload from their allgather (allgather path).

        Args:
            gathered: payload entry ``i`` of every rank, concatenated in rank order.
            counts: ``counts[r][i]``: rows of entry ``i`` that rank ``r`` sent.
            ctx: this rank's context.
            average: divide the sum by the number of ranks.

        Returns:
            The reduced tensor; the default decodes each rank's payload and combines them (:meth:`combine`).
        """
        parts = [ops_for(g).split(g, [int(row[i]) for row in counts]) for i, g in enumerate(gathered)]
        decoded = [self.decompress([part[r] for part in parts], ctx) for r in range(len(counts))]
        return self.combine(decoded, average)

    def combine(self, decoded: Sequence[Tensor], average: bool) -> Tensor:
        """Merge the decoded tensors of all ranks (allgather path).

        Args:
            decoded: one decoded tensor per rank, in rank order.
            average: divide the sum by the number of ranks.

        Returns:
            The reduced tensor; the default is the sum (or the mean).
        """
        total = decoded[0]
        for d in decoded[1:]:
            total = total + d
        return total / len(decoded) if average else total

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                         if not k.startswith("_") and k != "stats")
        return f"{type(self).__name__}({args})"


@runtime_checkable
class Exchanger(Protocol):
    """A compressor that runs its own collectives instead of one allreduce/allgather."""

    def exchange(
        self, comm: Communicator, tensor: Tensor, name: str, average: bool
    ) -> tuple[list[Tensor], Any, int]:
        """Reduce ``tensor`` over ``comm`` in compressed form.

        Args:
            comm: the communicator; every rank calls this together.
            tensor: this rank's (error-compensated) tensor.
            name: the tensor's name, the same on every rank.
            average: average over ranks (else sum).

        Returns:
            ``(payload, ctx, sent_bytes)``: ``decompress(payload, ctx)`` is the
            reduced tensor (and what error feedback subtracts); ``sent_bytes`` is
            what this rank handed to the communicator.
        """
        ...


def prepare(tensor: Tensor, name: str, who: object) -> tuple[TensorOps, Tensor, Context]:
    """Check that ``tensor`` is floating and flatten it in its compute dtype.

    16-bit floats are computed in float32; float32 and float64 as they are.

    Args:
        tensor: the tensor to compress.
        name: its name, for the error message.
        who: the compressor, for the error message.

    Returns:
        ``(ops, flat, ctx)``: the tensor's adapter, a 1-d compute-dtype copy or view,
        and a :class:`Context` with the original shape and dtype.

    Raises:
        PlaitTypeError: when the tensor is not floating.
    """
    ops = ops_for(tensor)
    dtype = ops.dtype_name(tensor)
    if dtype not in FLOATS:
        raise PlaitTypeError(
            f"cannot compress tensor {name!r} of dtype {dtype} with {type(who).__name__}: "
            f"it compresses floating tensors ({', '.join(FLOATS)}); use NoneCompressor for others"
        )
    flat = ops.reshape(ops.cast(tensor, compute_dtype(dtype)), [-1])
    return ops, flat, Context(ops.shape(tensor), dtype)


def compute_dtype(dtype: str) -> str:
    """The dtype compressors compute in: float32 for 16-bit floats, else ``dtype`` itself."""
    return "float32" if ITEMSIZE[dtype] == 2 else dtype


def restore(ops: TensorOps, flat: Tensor, ctx: Context) -> Tensor:
    """Give a decoded flat tensor back its original dtype and shape."""
    return ops.reshape(ops.cast(flat, ctx.dtype), ctx.shape)


def nbytes(tensor: Tensor) -> int:
    """Bytes of a tensor's data (numel x item size)."""
    ops = ops_for(tensor)
    n = 1
    for d in ops.shape(tensor):
        n *= max(d, 0)
    return n * ITEMSIZE[ops.dtype_name(tensor)]


def derive_seed(seed: int, name: str, step: int, purpose: str = "") -> int:
    """A 63-bit seed that is a fixed function of its arguments (the same on every rank).

    Args:
        seed: the compressor's base seed.
        name: the tensor's name.
        step: how many times this tensor was compressed before.
        purpose: separates independent streams of one compressor.

    Returns:
        A non-negative int below 2**63.
    """
    text = f"{seed}|{name}|{step}|{purpose}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def check_ratio(ratio: float) -> float:
    """Validate a sparsification ratio in (0, 1].

    Raises:
        ConfigError: outside (0, 1].
    """
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise invalid("ratio", ratio, "a fraction of elements to keep in (0, 1]")
    return float(ratio)


class SeedStream:
    """Per-tensor-name seeds that advance on every draw.

    With a fixed ``seed`` the sequence is reproducible and equal on every rank
    that draws for the same names in the same order; with ``seed=None`` the base
    seed comes from the operating system (different on every rank and run).

    Args:
        seed: base seed, or None for a fresh random one.
    """

    def __init__(self, seed: int | None) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise invalid("seed", seed, "a non-negative int or None")
        self.seed = seed
        self._base = secrets.randbits(62) if seed is None else seed
        self._steps: dict[str, int] = {}

    def next(self, name: str, purpose: str = "") -> int:
        """The next seed for tensor ``name`` (advances that name's counter)."""
        key = f"{name}|{purpose}"
        step = self._steps.get(key, 0)
        self._steps[key] = step + 1
        return derive_seed(self._base, name, step, purpose)
