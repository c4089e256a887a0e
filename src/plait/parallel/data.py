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

import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plait.adapters import ops_for
from plait.collectives.base import MappedHandle
from plait.collectives.timeline import span
from plait.compression import (
    NoMemory,
    NoneCompressor,
    Residual,
    WireStats,
    check_settings,
    compressed_allreduce,
)
from plait.compression.base import nbytes
from plait.errors import PlaitError, invalid
from plait.protocols import Communicator, Handle, Tensor

from .autotune import BucketTuner, bucket_setting

__all__ = ["DEFAULT_BUCKET_MB", "Bucket", "GradientReducer", "GradSpec", "checks_once",
           "plan_buckets", "unchecked_copy"]

#: Default fusion bucket size in MiB (torch DDP's default is 25 MiB as well).
DEFAULT_BUCKET_MB = 25.0
#: The first bucket's limit in bytes (DDP's is 1 MiB), so communication starts early.
FIRST_BUCKET_BYTES = 2**20

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
             "int16": 2, "uint16": 2, "int32": 4, "int64": 8, "bool": 1}


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
    name: str = ""  # its collectives' name (the reducer's prefix and the index)
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
        bucket_mb: fusion bucket size in MiB; None: tuned in the first steps
            (:mod:`plait.parallel.autotune`; ``PLAIT_BUCKET_MB`` fixes it) when there is
            no compression (a compressor's result depends on the grouping: then
            :data:`DEFAULT_BUCKET_MB`).
        compression: a compressor from :mod:`plait.compression`, one of its names
            ("fp16", ...), or None.
        memory: its error-feedback memory (or "residual"), or None.
        prefix: prefix of the names given to the collectives.
        fuse: makes a bucket's flat tensor from its gradients (default: concatenate;
            a framework can reuse a buffer). Used without compression only.
        check_once: on the MPI backend (and horovod.torch's) with the agreement check
            on, check each bucket plan in its first step only, then reduce on a private
            unchecked copy of ``comm`` (its collectives meet only this reducer's, whose
            order and shapes the checked step verified), so starting a bucket never
            waits for the other ranks in the middle of backward (on Horovod: one op per
            bucket instead of two; Horovod's coordinator still compares the ops' names,
            shapes and dtypes). ``PLAIT_BUCKET_CHECK=always`` checks every step.
        zeros: a zero gradient for a spec; with ``check_once``, lets a rank that called
            Horovod's ``join()`` take part in the other ranks' steps (each step is then
            announced on ``comm``, see ``MPICommunicator.serve_joined``).
        group: without compression, hand each bucket's gradients to the communicator's
            ``group_allreduce_async`` where it has one and takes them (Horovod's torch
            ops: Horovod fuses them on its own background thread, no copy into a fused
            buffer here); :meth:`finish_buckets` then gives such a bucket's reduced
            gradients as a list.

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
                 bucket_mb: float | None = DEFAULT_BUCKET_MB, compression: Any = None,
                 memory: Any = None, prefix: str = "grad",
                 fuse: Callable[[Bucket], Tensor] | None = None, check_once: bool = False,
                 zeros: Callable[[GradSpec], Tensor] | None = None, group: bool = False) -> None:
        start_mb, tune = bucket_setting(bucket_mb, DEFAULT_BUCKET_MB)
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
        # a cast (fp16, bf16) without error feedback: its buckets are cast, reduced
        # asynchronously (backward overlaps them) and cast back, and tuned like plain ones
        self._cast = (not self._plain and bool(getattr(compression, "elementwise", False))
                      and (memory is None or isinstance(memory, NoMemory)))
        self._counted = False
        if tune and not self._plain and not self._cast:
            # a lossy compressor's result (and its error-feedback memory, kept per bucket)
            # depends on the grouping: no tuning, the default size
            start_mb, tune = DEFAULT_BUCKET_MB, False
        if compression is not None and hasattr(compression, "exchange"):
            start_mb, tune = 0.0, False  # e.g. PowerSGD: factorises each gradient in its own shape
        self._specs = list(specs)
        self._fuse = fuse if self._plain or self._cast else None
        self._group = group and hasattr(comm, "group_allreduce_async")
        self._tune_on = tune
        self.tuner = BucketTuner() if tune and comm.size > 1 else None
        self._tried: list[list[list[str]]] = []
        self.bucket_mb = start_mb
        self._plan(self.tuner.current if self.tuner is not None else start_mb)
        if self.tuner is not None:
            self._same_plan(self.tuner.current)  # remember the first candidate's buckets
        self._next = 0
        self._last: float | None = None
        # checked once per plan: the private unchecked communicator, and whether the
        # current plan already ran once (checked)
        self._check_once_asked = check_once and (self._plain or self._cast)
        self._check_once = self._check_once_asked and checks_once(comm)
        self._fast: Communicator | None = None
        self._verified = False
        self._generation = getattr(comm, "generation", 0)
        # Horovod's join: steps on the private communicator are announced on ``comm``,
        # where a joined rank then runs this reducer's step with ``zeros``
        self._zeros = zeros
        self._join_key = comm.serve_joined(self._joined_step) if (
            self._check_once and zeros is not None and hasattr(comm, "serve_joined")) else None
        self._notice: Any = None
        self._serving = False

    def _plan(self, mb: float) -> None:
        self.bucket_mb = mb
        self.buckets = [Bucket(i, b, name=f"{self.prefix}.{i}")
                        for i, b in enumerate(plan_buckets(self._specs, mb * 2**20))]
        self._where = {s.name: b for b in self.buckets for s in b.specs}
        self._verified = False

    def exclude(self, names: Iterable[str]) -> None:
        """Reduce the gradients of ``names`` elsewhere from the next step on (a sparse
        gradient that the caller allgathers): buckets are planned again without them,
        and checked and tuned again. Call it between steps, on every rank alike.

        Raises:
            ConfigError: for a name this reducer does not have.
        """
        drop = set(names)
        unknown = sorted(drop - {s.name for s in self._specs})
        if unknown:
            raise invalid("names", unknown, f"names of this reducer's gradients {self.names}")
        self._specs = [s for s in self._specs if s.name not in drop]
        self._tried, self._last = [], None
        if self._tune_on and self.comm.size > 1:
            self.tuner = BucketTuner()
        self._plan(self.tuner.current if self.tuner is not None else self.bucket_mb)
        if self.tuner is not None:
            self._same_plan(self.tuner.current)

    @property
    def names(self) -> list[str]:
        return list(self._where)

    @property
    def plain(self) -> bool:
        """True when buckets are plain allreduces (no compression, no error feedback)."""
        return self._plain

    @property
    def fresh(self) -> bool:
        """True when every bucket's reduced tensor is new memory that nothing else holds,
        which ``.grad`` may then view instead of copying (for 10.8M gradients a copy took
        7 ms of a 145 ms top-k step): plain and cast buckets, and plait's own compressors
        with plait's own memories (another compressor may return a tensor it keeps)."""
        return self._plain or self._cast or (
            type(self.compression).__module__.startswith("plait.compression.")
            and (self.memory is None or type(self.memory) in (NoMemory, Residual)))

    def ready(self, name: str, grad: Tensor) -> None:
        """Hand over a finished gradient; starts every bucket that can start now."""
        bucket = self._where[name]
        bucket.grads[name] = grad
        if bucket.index == self._next and len(bucket.grads) == len(bucket.specs):
            self._start_ready()

    def _start_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._start(self.buckets[self._next])
            self._next += 1

    def _start(self, bucket: Bucket) -> None:
        name, fast = bucket.name, self._fast
        comm = fast if self._verified and fast is not None else self.comm
        if comm is fast:
            if hasattr(comm, "timeout"):  # the caller's timeout, also when changed later
                comm.timeout = self.comm.timeout  # type: ignore[attr-defined]
            if bucket.index == 0 and self._join_key is not None and not self._serving:
                self._notice = self.comm.step_notice(self._join_key)  # type: ignore[attr-defined]
        if self._group and self._plain:
            grads = [bucket.grads[s.name] for s in bucket.specs]
            handle = comm.group_allreduce_async(grads, op=self.op, name=name)  # type: ignore[attr-defined]
            if handle is not None:
                bucket.handle = handle
                self._counted = self.stats is not None
                if self.stats is not None:
                    size = sum(nbytes(g) for g in grads)
                    self.stats.record(name, size, size)
                return
        if self._fuse is not None:
            fused = self._fuse(bucket)
            ops = ops_for(fused)
        else:
            first = bucket.grads[bucket.specs[0].name]
            ops = ops_for(first)
            if len(bucket.specs) == 1:
                fused = first  # alone: keeps its shape (matrix compressors need it)
            else:
                fused = ops.concat([ops.reshape(bucket.grads[s.name], [-1]) for s in bucket.specs])
        self._counted = self.stats is not None and not ops.is_symbolic(fused)
        if self._plain:
            bucket.handle = comm.allreduce_async(fused, op=self.op, name=name)
            if self.stats is not None and self._counted:
                size = nbytes(fused)
                self.stats.record(name, size, size)
        elif self._cast and not ops.is_symbolic(fused):  # in a tf.function: as any compressor
            bucket.handle = self._cast_async(comm, fused, name)
        else:
            bucket.compressed = compressed_allreduce(
                comm, fused, name, self.compression, self.memory,
                average=self.op == "average")

    def _cast_async(self, comm: Communicator, fused: Tensor, name: str) -> Handle:
        """Start reducing ``fused`` cast by the (elementwise) compressor; the handle's
        result is cast back (see ``_cast``)."""
        compression = self.compression
        if compression is None:  # only reducers with a cast compressor get here
            raise PlaitError("a reducer without a compressor has no cast buckets")
        payload, ctx = compression.compress(fused, name)
        handle = comm.allreduce_async(payload[0], op=self.op, name=name)
        if self.stats is not None:
            self.stats.record(name, nbytes(payload[0]), nbytes(fused))
        return MappedHandle(handle, lambda out: compression.decompress([out], ctx))

    def finish_buckets(self, missing: Callable[[GradSpec], Tensor]) -> list[tuple[list[GradSpec], Tensor]]:
        """Start what is left (``missing(spec)`` supplies absent gradients), wait for all.

        Closes the step of the traffic counter, if there is one; while tuning, times
        the step and may change the buckets of the next one.

        Returns:
            ``(specs, reduced flat tensor)`` of every bucket (a bucket of one gradient
            with a compressor: the tensor in its own shape; a bucket reduced as a group,
            see ``group``: the list of its reduced gradients).
        """
        self._drop_stale()
        for bucket in self.buckets[self._next:]:
            for spec in bucket.specs:
                if spec.name not in bucket.grads:
                    bucket.grads[spec.name] = missing(spec)
        self._start_ready()
        out: list[tuple[list[GradSpec], Tensor]] = []
        for bucket in self.buckets:
            fused = bucket.handle.wait() if bucket.handle is not None else bucket.compressed
            out.append((bucket.specs, fused))
            bucket.grads.clear()
            bucket.handle = bucket.compressed = None
        self._next = 0
        if self._notice is not None:
            notice, self._notice = self._notice, None
            notice.wait()
        if self.stats is not None and self._counted:
            self.stats.end_step()
            self._counted = False
        if not self._verified:
            self._verified = True
            if self._check_once and self._fast is None:
                self._fast = unchecked_copy(self.comm)
        if self.tuner is not None and self.tuner.tuning and out:
            last = out[-1][1]
            self._tune(last[0] if isinstance(last, list) else last)
        return out

    def _joined_step(self) -> None:
        """This rank called ``join()``: take part in another rank's step with zero
        gradients (the results are dropped).

        Raises:
            RuntimeError: for a reducer made without ``zeros`` (it is never registered).
        """
        if self._zeros is None:
            raise RuntimeError("a joined rank stepped a gradient reducer made without zeros=")
        self._serving = True
        try:
            self.finish_buckets(self._zeros)
        finally:
            self._serving = False

    def finish(self, missing: Callable[[GradSpec], Tensor]) -> dict[str, Tensor]:
        """Start what is left (``missing(spec)`` supplies absent gradients), wait for all.

        Closes the step of the traffic counter, if there is one.

        Returns:
            The reduced gradient of every name, shaped like its spec.
        """
        out: dict[str, Tensor] = {}
        for specs, fused in self.finish_buckets(missing):
            if isinstance(fused, list):  # reduced as a group
                out.update((spec.name, grad) for spec, grad in zip(specs, fused))
                continue
            ops = ops_for(fused)
            sizes = [s.numel for s in specs]
            parts = [fused] if len(sizes) == 1 else ops.split(fused, sizes)
            for spec, part in zip(specs, parts):
                out[spec.name] = ops.reshape(part, spec.shape)
        return out

    # -- tuning the bucket size -------------------------------------------------------------
    def _tune(self, like: Tensor) -> None:
        """Time the step that just ended; move to the next candidate or decide."""
        tuner = self.tuner
        if tuner is None:  # not tuning: nothing to time
            return
        now = time.perf_counter()
        last, self._last = self._last, now
        ops = ops_for(like)
        if ops.is_symbolic(like):  # inside a graph: no timing, keep the size
            tuner.choice = self.bucket_mb
            return
        if last is None or not tuner.observe(now - last):
            return
        while not tuner.measured and self._same_plan(tuner.current):
            tuner.drop_current()
        if not tuner.measured:
            self._plan(tuner.current)
            return
        mine = np.array(tuner.medians(), dtype=np.float64)
        agreed = ops.to_numpy(self.comm.allreduce(ops.from_numpy(mine, like), op="max",
                                                  name=f"{self.prefix}.autotune"))
        chosen = tuner.decide([float(x) for x in agreed])
        self._report(chosen, [float(x) for x in agreed])
        if chosen != self.bucket_mb:
            self._plan(chosen)

    def _same_plan(self, mb: float) -> bool:
        """Whether ``mb`` gives the buckets of a size already tried (then it is skipped)."""
        plan = [[s.name for s in b] for b in plan_buckets(self._specs, mb * 2**20)]
        if plan in self._tried:
            return True
        self._tried.append(plan)
        return False

    def _report(self, chosen: float, agreed: list[float]) -> None:
        """Print the choice on rank 0 and record it in the timeline."""
        if self.tuner is None:
            return
        tried = {f"{c:g}": round(t * 1e3, 2) for c, t in zip(self.tuner.candidates, agreed)
                 if t != float("inf")}
        sizes = [sum(s.numel * _ITEMSIZE.get(s.dtype, 4) for s in b.specs)
                 for b in self.buckets] if chosen == self.bucket_mb else []
        algorithm = ""
        if hasattr(self.comm, "algorithm") and self._specs:
            big = max(sizes, default=int(chosen * 2**20))
            algorithm = str(self.comm.algorithm("allreduce", big, self._specs[0].dtype))
        with span(f"autotune bucket_mb={chosen:g}", cat="autotune", bucket_mb=chosen,
                  step_ms_by_bucket_mb=tried, algorithm=algorithm):
            pass
        if self.comm.rank == 0:
            steps = ", ".join(f"{k} MiB {v:.1f} ms" for k, v in tried.items())
            how = f"; MPI allreduce algorithm: {algorithm}" if algorithm else ""
            print(f"plait: gradient bucket size {chosen:g} MiB, tuned over the first steps "
                  f"(median step time by size: {steps}){how}; set PLAIT_BUCKET_MB or bucket_mb= "
                  "to fix it", file=sys.stderr, flush=True)

    @property
    def pending(self) -> bool:
        """True between the first ready gradient and :meth:`finish`."""
        self._drop_stale()
        return self._next > 0 or any(b.grads for b in self.buckets)

    def _drop_stale(self) -> None:
        """Forget the buckets of a step that an elastic reset interrupted (Horovod's
        elastic mode resets the library when a worker dies mid-step): their handles
        went with the old library state, so the step starts over from the
        gradients the caller still holds (``missing``), on the new membership."""
        generation = getattr(self.comm, "generation", 0)
        if generation == self._generation:
            return
        self._generation = generation
        for bucket in self.buckets:
            bucket.grads.clear()
            bucket.handle = bucket.compressed = None
        self._next = 0
        self._fast, self._verified = None, False  # groups split before a reset are gone too
        self._notice = None
        # decided again on the new membership, as a worker that just joined decides it (a
        # reducer made on one worker never checked once; grown to 2, its new peer did, and
        # waited alone in the split of its unchecked copy: a hang, measured)
        self._check_once = self._check_once_asked and checks_once(self.comm)
        if self._tune_on:  # tune again with the new members, in step with a worker that
            # just joined (its tuner is new: an old decision left it alone in the agreeing
            # allreduce, waiting for the timeout, measured)
            self.tuner = BucketTuner() if self.comm.size > 1 else None
            self._tried, self._last = [], None
            self._plan(self.tuner.current if self.tuner is not None else self.bucket_mb)
            if self.tuner is not None:
                self._same_plan(self.tuner.current)


def checks_once(comm: Communicator) -> bool:
    """Whether a bucket plan verified on ``comm`` may then be reduced unchecked: a group of
    several ranks with the agreement check on, unless ``PLAIT_BUCKET_CHECK=always``, on
    MPI, or Horovod for torch (whose ops Horovod's coordinator matches by name and checks
    itself)."""
    backend = getattr(comm, "backend", "")
    return (comm.size > 1 and bool(getattr(comm, "check", False))
            and os.environ.get("PLAIT_BUCKET_CHECK", "once") != "always"
            and (backend == "mpi"
                 or (backend == "horovod" and getattr(comm, "framework", "") == "torch")))


def unchecked_copy(comm: Communicator) -> Communicator:
    """A private copy of ``comm`` without the agreement check (a collective over ``comm``,
    checked there): its collectives meet only those of whoever holds it.

    Returns:
        The new communicator.
    """
    fast = comm.split(0, comm.rank)
    fast.check = False  # type: ignore[attr-defined]
    return fast
