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

Nothing here imports MPI: the backend passes ``isend(buffer, dest, tag)``,
``irecv(buffer, source, tag)`` and ``testsome(requests)`` (one call polls every
message of a collective); messages of one chunk reuse one tag, matched in order
(MPI's non-overtaking rule). Reductions run in numpy (float16 and bfloat16
included) on received chunks.

Built from the same parts: :class:`Chain` (rings one after the other: the
hierarchical allreduce), :class:`Exchange` (a pairwise alltoall) and
:class:`Relay` (a pipelined broadcast along the ring).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["Chain", "Exchange", "Relay", "Request", "Ring", "combiner", "segments"]


class Request(Protocol):
    """A nonblocking message in flight."""

    def Test(self) -> bool: ...  # noqa: N802 - MPI's name


Post = Callable[[np.ndarray, int, int], Request]
#: ``testsome(requests)``: indices of the completed ones (MPI's Testsome), or None.
TestSome = Callable[[list[Any]], "list[int] | None"]
Combine = Callable[[np.ndarray, np.ndarray, np.ndarray], None]

_NP = {"sum": np.add, "average": np.add, "min": np.minimum, "max": np.maximum,
       "product": np.multiply}
_BOOL = {"sum": np.logical_or, "max": np.logical_or, "min": np.logical_and,
         "product": np.logical_and}


def combiner(dtype: str, op: str, kernels: Any = None) -> Combine:
    """``combine(out, a, b)``: ``out = a (op) b`` element-wise (``out`` may be ``a``).

    Args:
        dtype: plait dtype name (bfloat16 buffers hold uint16 bit patterns).
        op: "sum", "average" (summed here, divided by the caller), "min", "max", "product".
        kernels: the tensor's framework adapter; its ``host_reduce(op, dtype)``, where it
            has one for ``dtype``, replaces numpy (16-bit floats: numpy converts each
            element on its own, a framework's vectorised kernel is ~20x faster).

    Returns:
        The reduction.
    """
    fast = getattr(kernels, "host_reduce", None)
    found = fast(op, dtype) if fast is not None else None
    if found is not None:
        return found  # type: ignore[no-any-return]
    fn: Any = _BOOL[op] if dtype == "bool" else _NP[op]
    if dtype == "bfloat16":
        from plait.adapters.numpy import bf16_to_f32, f32_to_bf16

        def reduce_bf16(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
            out[...] = f32_to_bf16(fn(bf16_to_f32(a), bf16_to_f32(b)))
        return reduce_bf16

    def reduce_any(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        fn(a, b, out=out)
    return reduce_any


def _poll(testsome: TestSome, reqs: list[Any], what: list[Any]
          ) -> tuple[list[Any], list[Any], list[Any]]:
    """Test ``reqs`` once (``what`` labels each); return the requests still in flight,
    their labels, and the labels of the completed ones in posting order."""
    done = testsome(reqs) if reqs else None
    if not done:
        return reqs, what, []
    finished = set(done)
    return ([r for i, r in enumerate(reqs) if i not in finished],
            [w for i, w in enumerate(what) if i not in finished],
            [what[i] for i in sorted(finished)])


def segments(counts: Sequence[int]) -> np.ndarray:
    """Offsets ``[0, c0, c0+c1, ...]`` of consecutive segments of the given sizes."""
    return np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).astype(np.int64)


class Ring:
    """One ring collective in flight; :meth:`progress` drives it, never blocks.

    Args:
        buf: the flat output buffer (for "allgather": holding this rank's segment).
        offsets: ``size + 1`` element offsets of the segments (:func:`segments`).
        rank: this rank in the ring.
        size: ranks in the ring.
        isend: starts sending a buffer to a rank with a tag.
        irecv: starts receiving into a buffer from a rank with a tag.
        testsome: which of a list of requests completed (one call polls them all).
        tags: the first of ``chunks`` consecutive tags this collective may use.
        chunk: elements per chunk (the pipelining grain).
        combine: the reduction (:func:`combiner`), used by the reduce-scatter steps.
        phases: "allreduce", "reducescatter" (each rank ends with its segment
            reduced) or "allgather" (each rank starts with its own segment).
        max_chunks: at most this many chunks (and tags); larger messages get larger chunks.
        window: chunks whose first step is in flight at once; chunk ``j + window``
            starts when chunk ``j`` finished its first step, so chunks arrive in order
            and their reduction overlaps the transfer of later ones.
        src: the flat input, read-only, for "allreduce"/"reducescatter" (default: ``buf``).
            Every segment of ``buf`` is written once (by a reduction or a received
            copy), so nothing is copied in advance.

    Attributes:
        complete: True once this rank's part is done (set by :meth:`progress`).
        moved: chunk steps completed so far (a waiter sees that bytes are moving).
    """

    def __init__(self, buf: np.ndarray, offsets: np.ndarray, rank: int, size: int,
                 isend: Post, irecv: Post, testsome: TestSome, tags: int, chunk: int,
                 combine: Combine | None = None, phases: str = "allreduce",
                 max_chunks: int = 4096, window: int = 8,
                 src: np.ndarray | None = None) -> None:
        self.buf, self.size, self.rank = buf, size, rank
        self._src = buf if src is None else src
        self._isend, self._irecv, self._testsome = isend, irecv, testsome
        self._combine = combine
        self._right, self._left = (rank + 1) % size, (rank - 1) % size
        self._reduce_steps = size - 1
        self._first = size - 1 if phases == "allgather" else 0
        self._end = size - 1 if phases == "reducescatter" else 2 * size - 2
        longest = int(np.max(np.diff(offsets))) if size else 0
        self.chunks = max(1, min(max_chunks, -(-longest // max(1, chunk))))
        self.complete = False
        self.moved = 0
        # chunk j of segment s is buf[bounds[s, j]:bounds[s, j + 1]]
        self._bounds = np.array([np.linspace(offsets[s], offsets[s + 1], self.chunks + 1)
                                 .astype(np.int64) for s in range(size)])
        reduces = self._first < self._reduce_steps
        width = int(np.max(np.diff(self._bounds, axis=1))) if reduces else 0
        self._scratch = [np.empty(width, dtype=buf.dtype) for _ in range(self.chunks)]
        self._tags = tags
        self._step = [self._first] * self.chunks  # the step whose receive is posted (or due)
        self._reqs: list[Any] = []  # every message in flight ...
        self._what: list[tuple[bool, int, int]] = []  # ... as (is_recv, chunk, step)
        self._sending: set[tuple[int, int]] = set()  # (chunk, step) of sends in flight
        self._deferred: list[int] = []  # chunks whose receive waits for a send to finish
        self._live = self.chunks if self._first < self._end else 0
        self._started = 0
        self._window = max(1, window)
        while self._live and self._started < min(self._window, self.chunks):
            self._start_chunk()
        self.complete = self._live == 0

    def _region(self, segment: int, j: int, of: np.ndarray | None = None) -> np.ndarray:
        b = self._bounds[segment % self.size]
        return (self.buf if of is None else of)[b[j] : b[j + 1]]

    def _start_chunk(self) -> None:
        j = self._started
        self._started += 1
        self._send(j, self._first)
        self._post_recv(j)

    def _send(self, j: int, t: int) -> None:
        from_src = t == self._first and self._first < self._reduce_steps
        data = self._region(self.rank - t - 1, j, self._src if from_src else None)
        self._reqs.append(self._isend(data, self._right, self._tags + j))
        self._what.append((False, j, t))
        if not from_src or self._src is self.buf:
            self._sending.add((j, t))  # reads buf: a later receive into it must wait

    def _post_recv(self, j: int) -> bool:
        """Post chunk ``j``'s receive of its current step, unless the region it lands
        in is still being sent (allgather steps receive in place): then defer it."""
        t = self._step[j]
        region = self._region(self.rank - t - 2, j)
        if t < self._reduce_steps:
            target = self._scratch[j][: region.size]
        elif (j, t + 1 - self.size) in self._sending:  # the send that read this region
            self._deferred.append(j)
            return False
        else:
            target = region
        self._reqs.append(self._irecv(target, self._left, self._tags + j))
        self._what.append((True, j, t))
        return True

    def _arrived(self, j: int, t: int) -> None:
        if t < self._reduce_steps and self._combine is not None:
            segment = self.rank - t - 2
            region = self._region(segment, j)
            self._combine(region, self._region(segment, j, self._src),
                          self._scratch[j][: region.size])
        self._step[j] = t + 1
        self.moved += 1
        if t + 1 < self._end:
            self._send(j, t + 1)
            self._post_recv(j)
        else:
            self._live -= 1
        if t == self._first and self._started < self.chunks:
            self._start_chunk()

    def progress(self) -> bool:
        """Advance every chunk as far as its messages allow (one ``testsome`` call).

        Returns:
            True when this rank's part of the collective is complete.
        """
        self._reqs, self._what, what = _poll(self._testsome, self._reqs, self._what)
        if what:
            self._sending.difference_update((j, t) for is_recv, j, t in what if not is_recv)
            if self._deferred:
                waiting, self._deferred = self._deferred, []
                for j in waiting:
                    self._post_recv(j)
            for is_recv, j, t in what:
                if is_recv:
                    self._arrived(j, t)
        self.complete = self._live == 0 and not self._reqs and not self._deferred
        return self.complete


class Chain:
    """Rings run one after the other (the stages of a hierarchical allreduce); it
    quacks like a :class:`Ring` (``progress``, ``complete``, ``moved``).

    Args:
        stages: each starts one stage (called when the previous one completed);
            every tag a stage uses must be fixed before the chain starts, since
            ranks reach later stages at different times.
    """

    def __init__(self, stages: Sequence[Callable[[], Ring]]) -> None:
        self._stages = list(stages)
        self.moved = 0
        self._ring: Ring | None = None
        self.complete = False
        self._advance()

    def _advance(self) -> None:
        while self._ring is None or self._ring.complete:
            if not self._stages:
                self._ring, self.complete = None, True
                return
            self._ring = self._stages.pop(0)()

    def progress(self) -> bool:
        """Drive the current stage; start the next when it completes.

        Returns:
            True once the last stage completed.
        """
        while self._ring is not None:
            before = self._ring.moved
            done = self._ring.progress()
            self.moved += self._ring.moved - before
            if not done:
                break
            self._advance()
        return self.complete


class Exchange:
    """Point-to-point messages posted all at once and completed together (a pairwise
    alltoall keeps every link busy in both directions); it quacks like a :class:`Ring`.

    Args:
        sends: ``(buffer, dest)`` pairs; empty buffers are skipped.
        recvs: ``(buffer, source)`` pairs; empty buffers are skipped.
        isend: starts sending a buffer to a rank with a tag.
        irecv: starts receiving into a buffer from a rank with a tag.
        testsome: which of a list of requests completed.
        tag: the tag of every message (one message per pair of ranks).
    """

    def __init__(self, sends: Sequence[tuple[np.ndarray, int]],
                 recvs: Sequence[tuple[np.ndarray, int]], isend: Post, irecv: Post,
                 testsome: TestSome, tag: int) -> None:
        self._testsome = testsome
        self._reqs: list[Any] = [irecv(b, r, tag) for b, r in recvs if b.size]
        self._reqs += [isend(b, r, tag) for b, r in sends if b.size]
        self.moved = 0
        self.complete = not self._reqs

    def progress(self) -> bool:
        """Test every message once.

        Returns:
            True when every message of this rank completed.
        """
        self._reqs, _, what = _poll(self._testsome, self._reqs, [None] * len(self._reqs))
        self.moved += len(what)
        self.complete = not self._reqs
        return self.complete


class Relay:
    """A pipelined broadcast along the ring from ``root``: every rank but the root
    receives each chunk from its left neighbour and forwards it to its right one
    (the last rank before the root only receives). With ranks numbered host by host,
    each host link carries the tensor once; it quacks like a :class:`Ring`.

    Args:
        buf: the flat buffer (the root's data on the root; filled on the others).
        rank: this rank.
        size: ranks in the ring.
        root: the broadcasting rank.
        isend: starts sending a buffer to a rank with a tag.
        irecv: starts receiving into a buffer from a rank with a tag.
        testsome: which of a list of requests completed.
        tags: the first of ``chunks`` consecutive tags this broadcast may use.
        chunk: elements per chunk.
        max_chunks: at most this many chunks (and tags).
        window: receives (on the root: sends) in flight at once.
    """

    def __init__(self, buf: np.ndarray, rank: int, size: int, root: int, isend: Post,
                 irecv: Post, testsome: TestSome, tags: int, chunk: int,
                 max_chunks: int = 4096, window: int = 8) -> None:
        self._testsome = testsome
        self._isend, self._irecv, self._tags = isend, irecv, tags
        self._right, self._left = (rank + 1) % size, (rank - 1) % size
        self._forward = self._right != root
        self._receive = rank != root
        chunks = max(1, min(max_chunks, -(-buf.size // max(1, chunk))))
        bounds = np.linspace(0, buf.size, chunks + 1).astype(np.int64)
        self._parts = [buf[bounds[j] : bounds[j + 1]] for j in range(chunks)]
        self._reqs: list[Any] = []
        self._what: list[tuple[bool, int]] = []  # (is_recv, chunk)
        self._window = max(1, window)
        self._next = 0  # the next chunk to receive (or, on the root, to send)
        self.moved = 0
        self.complete = False
        self._open()

    def _open(self) -> None:
        """Post receives (or, on the root, sends) up to the window."""
        busy = sum(1 for is_recv, _ in self._what if is_recv == self._receive)
        while self._next < len(self._parts) and busy < self._window:
            j = self._next
            self._next += 1
            busy += 1
            if self._receive:
                self._reqs.append(self._irecv(self._parts[j], self._left, self._tags + j))
                self._what.append((True, j))
            elif self._forward:
                self._reqs.append(self._isend(self._parts[j], self._right, self._tags + j))
                self._what.append((False, j))

    def progress(self) -> bool:
        """Forward what arrived; post more receives.

        Returns:
            True when this rank received (and forwarded) every chunk.
        """
        self._reqs, self._what, what = _poll(self._testsome, self._reqs, self._what)
        self.moved += len(what)
        for is_recv, j in what:
            if is_recv and self._forward:
                self._reqs.append(self._isend(self._parts[j], self._right, self._tags + j))
                self._what.append((False, j))
        self._open()
        self.complete = not self._reqs and self._next >= len(self._parts)
        return self.complete
