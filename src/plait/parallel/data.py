"""Synchronous data parallelism, framework-agnostic: fusion buckets of gradients.

Gradients are assigned to buckets (same dtype, up to ``bucket_bytes``) in the
reverse of their registration order, which is roughly the order backward
produces them. A bucket is flattened and its allreduce started as soon as all
its gradients are ready *and* every lower-numbered bucket was started, so every
rank starts the same buckets in the same order even when some gradient is
missing on some rank (it is submitted as zeros at :meth:`GradientReducer.finish`).

Frameworks plug in through :class:`~plait.protocols.TensorOps`; only the hooks
that call :meth:`GradientReducer.ready` are framework code (in ``plait.adapters``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from plait.adapters import ops_for
from plait.compression import (
    NoMemory,
    NoneCompressor,
    WireStats,
    check_settings,
    compressed_allreduce,
)
from plait.compression.base import nbytes
from plait.errors import invalid
from plait.protocols import Communicator, Handle, Tensor

__all__ = ["DEFAULT_BUCKET_MB", "Bucket", "GradientReducer", "GradSpec", "plan_buckets"]

#: Default fusion bucket size in MiB (torch DDP's default is 25 MiB as well).
DEFAULT_BUCKET_MB = 25.0
#: The first bucket's limit in bytes (DDP's is 1 MiB), so communication starts early.
FIRST_BUCKET_BYTES = 2**20

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
             "int16": 2, "int32": 4, "int64": 8, "bool": 1}


@dataclass(frozen=True)
class GradSpec:
    """One gradient the reducer expects: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class Bucket:
    """Gradients reduced together as one flat tensor."""

    index: int
    specs: list[GradSpec]
    grads: dict[str, Tensor] = field(default_factory=dict)
    handle: Handle | None = None
    compressed: Tensor | None = None

    @property
    def complete(self) -> bool:
        return len(self.grads) == len(self.specs)


def plan_buckets(specs: Sequence[GradSpec], bucket_bytes: float,
                 first_bucket_bytes: float = FIRST_BUCKET_BYTES) -> list[list[GradSpec]]:
    """Group gradients into buckets, last-registered first.

    The first bucket is small (as in torch DDP), so that its allreduce starts
    early in backward instead of after the whole model's gradients.

    Args:
        specs: gradients in registration (forward) order.
        bucket_bytes: the largest bucket in bytes; 0 puts every gradient alone.
        first_bucket_bytes: the largest first bucket (at most ``bucket_bytes``).

    Returns:
        Lists of specs, one per bucket, in submission order.
    """
    buckets: list[list[GradSpec]] = []
    open_by_dtype: dict[str, tuple[list[GradSpec], int]] = {}
    for spec in reversed(list(specs)):
        nbytes = spec.numel * _ITEMSIZE.get(spec.dtype, 4)
        current = open_by_dtype.get(spec.dtype)
        cap = min(bucket_bytes, first_bucket_bytes) if len(buckets) <= 1 else bucket_bytes
        if current is None or current[1] + nbytes > cap or bucket_bytes <= 0:
            current = ([], 0)
            buckets.append(current[0])
        current[0].append(spec)
        open_by_dtype[spec.dtype] = (current[0], current[1] + nbytes)
    return buckets


class GradientReducer:
    """Averages (or sums) named gradients across a communicator, bucket by bucket.

    Args:
        comm: the data-parallel communicator.
        specs: every gradient, in registration order (same on all ranks).
        op: "average" or "sum" (or any reduction the backend supports).
        bucket_mb: fusion bucket size in MiB.
        compression: a compressor from :mod:`plait.compression`, one of its names
            ("fp16", ...), or None.
        memory: its error-feedback memory (or "residual"), or None.
        prefix: prefix of the names given to the collectives.

    Traffic is counted into ``compression.stats`` when the compressor has one
    (:meth:`~plait.compression.Compressor.count_into`; a :class:`NoneCompressor`
    with a counter counts plain allreduces), and :meth:`finish` closes the step
    there. Reductions inside ``tf.function`` are not counted.

    Raises:
        ConfigError: for a negative bucket size, duplicate gradient names, a bad
            ``compression``/``memory`` pair, or a compressor with an op other than
            "average" or "sum".
        PlaitTypeError: for a ``compression``/``memory`` of the wrong type.
    """

    def __init__(self, comm: Communicator, specs: Sequence[GradSpec], *, op: str = "average",
                 bucket_mb: float = DEFAULT_BUCKET_MB, compression: Any = None,
                 memory: Any = None, prefix: str = "grad") -> None:
        if bucket_mb < 0:
            raise invalid("bucket_mb", bucket_mb, "a size in MiB >= 0 (0: one gradient per bucket)")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise invalid("named_parameters", dup, "unique parameter names")
        compression, memory = check_settings(compression, memory)
        self.comm, self.op, self.prefix = comm, op, prefix
        self.compression, self.memory = compression, memory
        self.stats: WireStats | None = getattr(compression, "stats", None)
        # no compressor (or NoneCompressor without feedback): a plain asynchronous allreduce
        self._plain = compression is None or (
            type(compression) is NoneCompressor and (memory is None or isinstance(memory, NoMemory)))
        if not self._plain and op not in ("average", "sum"):
            raise invalid("op", op, f"'average' or 'sum' with compression={compression!r}")
        self._counted = False
        if compression is not None and hasattr(compression, "exchange"):
            bucket_mb = 0  # e.g. PowerSGD: factorises each gradient in its own shape
        self.buckets = [Bucket(i, b) for i, b in enumerate(plan_buckets(specs, bucket_mb * 2**20))]
        self._where = {s.name: b for b in self.buckets for s in b.specs}
        self._next = 0

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def ready(self, name: str, grad: Tensor) -> None:
        """Hand over a finished gradient; starts every bucket that can start now."""
        bucket = self._where[name]
        bucket.grads[name] = grad
        self._start_ready()

    def _start_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._start(self.buckets[self._next])
            self._next += 1
        for b in self.buckets[: self._next]:  # drive progress of backends without a thread
            if b.handle is not None:
                b.handle.done()

    def _start(self, bucket: Bucket) -> None:
        first = bucket.grads[bucket.specs[0].name]
        ops = ops_for(first)
        if len(bucket.specs) == 1:
            fused = first  # alone: keeps its shape (matrix compressors need it)
        else:
            fused = ops.concat([ops.reshape(bucket.grads[s.name], [-1]) for s in bucket.specs])
        name = f"{self.prefix}.{bucket.index}"
        self._counted = self.stats is not None and not ops.is_symbolic(fused)
        if self._plain:
            bucket.handle = self.comm.allreduce_async(fused, op=self.op, name=name)
            if self.stats is not None and self._counted:
                size = nbytes(fused)
                self.stats.record(name, size, size)
        else:
            bucket.compressed = compressed_allreduce(
                self.comm, fused, name, self.compression, self.memory,
                average=self.op == "average")

    def finish(self, missing: Callable[[GradSpec], Tensor]) -> dict[str, Tensor]:
        """Start what is left (``missing(spec)`` supplies absent gradients), wait for all.

        Closes the step of the traffic counter, if there is one.

        Returns:
            The reduced gradient of every name, shaped like its spec.
        """
        for bucket in self.buckets[self._next:]:
            for spec in bucket.specs:
                if spec.name not in bucket.grads:
                    bucket.grads[spec.name] = missing(spec)
        self._start_ready()
        out: dict[str, Tensor] = {}
        for bucket in self.buckets:
            fused = bucket.handle.wait() if bucket.handle is not None else bucket.compressed
            ops = ops_for(fused)
            sizes = [s.numel for s in bucket.specs]
            parts = [fused] if len(sizes) == 1 else ops.split(fused, sizes)
            for spec, part in zip(bucket.specs, parts):
                out[spec.name] = ops.reshape(part, spec.shape)
            bucket.grads.clear()
            bucket.handle = bucket.compressed = None
        self._next = 0
        if self.stats is not None and self._counted:
            self.stats.end_step()
            self._counted = False
        return out

    @property
    def pending(self) -> bool:
        """True between the first ready gradient and :meth:`finish`."""
        return self._next > 0 or any(b.grads for b in self.buckets)
