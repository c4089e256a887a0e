"""A chunked, pipelined ring over point-to-point messages: reduce-scatter, allgather
or both (allreduce), on a flat numpy buffer, in place.

The buffer is cut into one segment per rank and every segment into the same
number of chunks. Chunk ``j`` travels its own chain of ring steps: at step
``t`` a rank sends chunk ``j`` of segment ``(rank - t - 1) % size`` to its right
neighbour and receives chunk ``j`` of segment ``(rank - t - 2) % size`` from its
left one. Steps ``0 .. size-2`` reduce what arrives (reduce-scatter: afterwards
rank ``r`` holds the whole reduction of segment ``r``), steps ``size-1 ..
2*size-3`` copy it (allgather). A chunk moves on to its next step as soon as it
arrived, so the link carries later chunks while earlier ones are reduced:
bandwidth-optimal (each rank sends ``2 (size-1)/size`` of the buffer) and it
keeps a link busy, unlike Open MPI's default allreduce of large messages.

Nothing here imports MPI: the backend passes ``isend(buffer, dest, tag)`` and
``irecv(buffer, source, tag)`` returning requests with ``Test()``; messages of
one chunk reuse one tag, matched in order (MPI's non-overtaking rule).
Reductions run in numpy (float16 and bfloat16 included) on received chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["Request", "Ring", "combiner", "segments"]


class Request(Protocol):
    """A nonblocking message in flight."""

    def Test(self) -> bool: ...  # noqa: N802 - MPI's name


Post = Callable[[np.ndarray, int, int], Request]
Combine = Callable[[np.ndarray, np.ndarray], None]

_NP = {"sum": np.add, "average": np.add, "min": np.minimum, "max": np.maximum,
       "product": np.multiply}
_BOOL = {"sum": np.logical_or, "max": np.logical_or, "min": np.logical_and,
         "product": np.logical_and}


def combiner(dtype: str, op: str) -> Combine:
    """``combine(acc, incoming)``: reduce ``incoming`` into ``acc`` in place.

    Args:
        dtype: plait dtype name (bfloat16 buffers hold uint16 bit patterns).
        op: "sum", "average" (summed here, divided by the caller), "min", "max", "product".

    Returns:
        The in-place reduction.
    """
    fn: Any = _BOOL[op] if dtype == "bool" else _NP[op]
    if dtype == "bfloat16":
        from plait.adapters.numpy import bf16_to_f32, f32_to_bf16

        def reduce_bf16(acc: np.ndarray, inc: np.ndarray) -> None:
            acc[...] = f32_to_bf16(fn(bf16_to_f32(acc), bf16_to_f32(inc)))
        return reduce_bf16

    def reduce_any(acc: np.ndarray, inc: np.ndarray) -> None:
        fn(acc, inc, out=acc)
    return reduce_any


def segments(counts: Sequence[int]) -> np.ndarray:
    """Offsets ``[0, c0, c0+c1, ...]`` of consecutive segments of the given sizes."""
    return np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).astype(np.int64)


class Ring:
    """One ring collective in flight; :meth:`progress` drives it, never blocks.

    Args:
        buf: the flat buffer, reduced (and gathered) in place.
        offsets: ``size + 1`` element offsets of the segments (:func:`segments`).
        rank: this rank in the ring.
        size: ranks in the ring.
        isend: starts sending a buffer to a rank with a tag.
        irecv: starts receiving into a buffer from a rank with a tag.
        tags: the first of ``chunks`` consecutive tags this collective may use.
        chunk: elements per chunk (the pipelining grain).
        combine: the reduction (:func:`combiner`), used by the reduce-scatter steps.
        phases: "allreduce", "reducescatter" (each rank ends with its segment
            reduced) or "allgather" (each rank starts with its own segment).
        max_chunks: at most this many chunks (and tags); larger messages get larger chunks.

    Attributes:
        complete: True once this rank's part is done (set by :meth:`progress`).
        moved: chunk steps completed so far (a waiter sees that bytes are moving).
    """

    def __init__(self, buf: np.ndarray, offsets: np.ndarray, rank: int, size: int,
                 isend: Post, irecv: Post, tags: int, chunk: int,
                 combine: Combine | None = None, phases: str = "allreduce",
                 max_chunks: int = 4096) -> None:
        self.buf, self.size, self.rank = buf, size, rank
        self._isend, self._irecv = isend, irecv
        self._combine = combine
        self._right, self._left = (rank + 1) % size, (rank - 1) % size
        self._reduce_steps = size - 1
        first = size - 1 if phases == "allgather" else 0
        self._end = size - 1 if phases == "reducescatter" else 2 * size - 2
        longest = int(np.max(np.diff(offsets))) if size else 0
        self.chunks = max(1, min(max_chunks, -(-longest // max(1, chunk))))
        self.complete = False
        self.moved = 0
        # chunk j of segment s is buf[bounds[s, j]:bounds[s, j + 1]]
        self._bounds = np.array([np.linspace(offsets[s], offsets[s + 1], self.chunks + 1)
                                 .astype(np.int64) for s in range(size)])
        width = int(np.max(np.diff(self._bounds, axis=1))) if first < self._reduce_steps else 0
        self._scratch = [np.empty(width, dtype=buf.dtype) for _ in range(self.chunks)]
        self._tags = tags
        self._step = [first] * self.chunks  # the step whose receive is posted (or due)
        self._recv: list[Any] = [None] * self.chunks
        self._sent: list[dict[int, Any]] = [{} for _ in range(self.chunks)]
        self._live = self.chunks if first < self._end else 0
        if self._live:
            for j in range(self.chunks):
                self._send(j, first)
                self._post_recv(j)

    def _region(self, segment: int, j: int) -> np.ndarray:
        b = self._bounds[segment % self.size]
        return self.buf[b[j] : b[j + 1]]

    def _send(self, j: int, t: int) -> None:
        self._sent[j][t] = self._isend(self._region(self.rank - t - 1, j), self._right,
                                       self._tags + j)

    def _post_recv(self, j: int) -> bool:
        """Post chunk ``j``'s receive of its current step, unless the region it lands
        in is still being sent (allgather steps receive in place)."""
        t = self._step[j]
        region = self._region(self.rank - t - 2, j)
        if t < self._reduce_steps:
            target = self._scratch[j][: region.size]
        else:
            earlier = self._sent[j].get(t + 1 - self.size)  # the send that read this region
            if earlier is not None and not earlier.Test():
                return False
            target = region
        self._recv[j] = self._irecv(target, self._left, self._tags + j)
        return True

    def progress(self) -> bool:
        """Advance every chunk as far as its messages allow.

        Returns:
            True when this rank's part of the collective is complete.
        """
        for j in range(self.chunks):
            while self._step[j] < self._end:
                if self._recv[j] is None and not self._post_recv(j):
                    break
                if not self._recv[j].Test():
                    break
                t = self._step[j]
                if t < self._reduce_steps and self._combine is not None:
                    region = self._region(self.rank - t - 2, j)
                    self._combine(region, self._scratch[j][: region.size])
                self._recv[j] = None
                self._step[j] = t + 1
                self.moved += 1
                if t + 1 < self._end:
                    self._send(j, t + 1)
                else:
                    self._live -= 1
            sent = self._sent[j]
            for t in [t for t, r in sent.items() if r.Test()]:
                del sent[t]
        self.complete = self._live == 0 and not any(self._sent)
        return self.complete
