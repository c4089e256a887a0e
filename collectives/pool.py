"""Output buffers reused once nothing refers to them any more.

A collective returns a new tensor, so each call needs a fresh output buffer. A
fresh large buffer is not free: glibc maps it anew from the kernel and every
page faults on first touch (measured here in MPI ranks: a 1 MiB output costs
about 450 us of page faults, more than the 200 us the allreduce itself takes
over shared memory). :class:`BufferPool` keeps the buffers it handed out and
gives one again once no array or tensor refers to it: every array it hands out
is a view of a pooled buffer, and a view (and a tensor made from it, by
``torch.from_numpy``) keeps its base alive, so a base that only the pool still
refers to is not used by anybody. Nothing here imports MPI or a framework.
"""

from __future__ import annotations

import math
import sys
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = ["BufferPool"]

#: Outputs smaller than this come from numpy's allocator (cheap at that size).
MIN_BYTES = 64 * 1024
#: The pool forgets its oldest buffers beyond this many bytes in all.
MAX_BYTES = 1 << 30
#: ... and its oldest buffer of a size beyond this many of that size.
MAX_PER_SIZE = 16
#: Buffers start at a multiple of this many bytes: TensorFlow takes a host op's
#: numpy output without a copy only when it is this aligned (measured: 19 MB
#: returned by ``tf.numpy_function``, 1.8 ms copied, 0.36 ms aligned).
ALIGN = 64


class BufferPool:
    """Output buffers, reused once nobody holds them.

    Args:
        min_bytes: smaller buffers are allocated anew each time (default :data:`MIN_BYTES`).
        max_bytes: the most bytes the pool refers to; the oldest buffers are
            forgotten beyond it (freed when nobody else holds them).
    """

    def __init__(self, min_bytes: int | None = None, max_bytes: int = MAX_BYTES) -> None:
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self.max_bytes = max_bytes
        # per size: (buffer, offset of its first ALIGN-aligned byte), oldest first
        self._by_size: OrderedDict[int, list[tuple[np.ndarray, int]]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # two threads must not take the same free buffer

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype`` that nobody else uses.

        Returns:
            A view of a pooled buffer (or a new array below ``min_bytes``).
        """
        n = dtype.itemsize * math.prod(shape)
        if n < self.min_bytes:
            return np.empty(shape, dtype=dtype)
        with self._lock:
            return self._take(n, dtype, shape)

    def _take(self, n: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> np.ndarray:
        bases = self._by_size.get(n)
        if bases is None:
            bases = self._by_size[n] = []
        else:
            self._by_size.move_to_end(n)
        for entry in bases:
            # referred to by its tuple and by getrefcount's argument only: unused
            if sys.getrefcount(entry[0]) == 2:
                return entry[0][entry[1]:entry[1] + n].view(dtype).reshape(shape)
        base = np.empty(n + ALIGN, dtype=np.uint8)
        start = _aligned_start(base)
        bases.append((base, start))
        self._bytes += n
        if len(bases) > MAX_PER_SIZE:
            bases.pop(0)
            self._bytes -= n
        while self._bytes > self.max_bytes and len(self._by_size) > 1:
            size, dropped = self._by_size.popitem(last=False)
            self._bytes -= size * len(dropped)
        return base[start:start + n].view(dtype).reshape(shape)


def _aligned_start(base: np.ndarray) -> int:
    """The offset of the first byte of ``base`` at a multiple of :data:`ALIGN` (computed
    once per buffer: reading the address costs about 2 us)."""
    return int(-base.ctypes.data % ALIGN)
