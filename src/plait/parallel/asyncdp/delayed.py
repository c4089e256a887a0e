"""Delayed gradient averaging: step t's allreduce overlaps step t+1 and is applied one step late."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from plait.compression import compressed_allreduce
from plait.protocols import Communicator

from .base import AsyncAlgorithm, load_memory, memory_state
from .replica import Replica

__all__ = ["DelayedAveraging"]


class DelayedAveraging(AsyncAlgorithm):
    """Average gradients with a one-step delay so communication hides behind compute.

    At step t the allreduce of step t's gradients is started (an async handle) and
    the rank applies its own fresh gradient plus the correction of step t-1,
    ``average(g[t-1]) - g_local[t-1]``, whose allreduce finished meanwhile
    (delayed gradient averaging, Zhu et al. 2021). So every step's average is
    applied exactly once, one step late, while the local gradient keeps the
    update fresh; :meth:`synchronize` applies the last correction and averages
    the replicas (which differ by at most the last local step during training).
    With ``correct=False`` only the delayed average is applied (the first step
    applies nothing) and replicas stay identical. With a compressor the compressed
    allreduce runs on one background thread instead of an async handle.

    Args:
        comm: the data-parallel communicator.
        compression: a compressor from ``plait.compression`` or None.
        memory: its error-feedback memory or None.
    """

    name = "delayed"

    def __init__(self, comm: Communicator, correct: bool = True, compression: Any = None,
                 memory: Any = None) -> None:
        super().__init__(comm)
        self.correct = bool(correct)
        self._last: np.ndarray | None = None
        self.compression, self.memory = compression, memory
        self._pending: Any = None
        self._pool: ThreadPoolExecutor | None = None

    def _start_reduce(self, grads: np.ndarray) -> Any:
        self.metrics.messages += 1
        if self.compression is None and self.memory is None:
            return self.comm.allreduce_async(grads, "average", name="asyncdp.delayed")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="plait-delayed")
        return self._pool.submit(compressed_allreduce, self.comm, grads, "asyncdp.delayed",
                                 self.compression, self.memory, True)

    def _wait_pending(self) -> np.ndarray:
        """The average in flight (a handle, or a future on the compression thread)."""
        with self.metrics.waiting():
            pending = self._pending
            return np.asarray(pending.result() if isinstance(pending, Future) else pending.wait(),
                              dtype=np.float32)

    def _apply_pending(self, replica: Replica, fresh: np.ndarray | None) -> None:
        update = fresh if self.correct else None
        if self._pending is not None:
            avg = self._wait_pending()
            self._pending = None
            if self.correct and self._last is not None:
                avg = avg - self._last
            update = avg if update is None else update + avg
            self.metrics.staleness.append(1)
        if update is not None:
            replica.set_grads(update)
            replica.apply()

    def step(self, replica: Replica) -> None:
        """Start averaging this step's gradients; apply the previous step's average."""
        grads = replica.get_grads()
        if self._pending is not None and isinstance(self._pending, Future):
            self._apply_pending(replica, grads)
            self._pending = self._start_reduce(grads)
        else:
            handle = self._start_reduce(grads)
            self._apply_pending(replica, grads)
            self._pending = handle
        self._last = grads
        self.metrics.steps += 1

    def _state(self) -> dict[str, Any]:
        """The average in flight (waited for now; the same on every rank) and this rank's
        gradients it corrects, and its error-feedback residuals."""
        avg = None
        if self._pending is not None:  # waited first: its compression thread updates the memory
            avg = self._wait_pending()
            self._pending = _completed(avg)
        return {"pending": avg, "last": self._last, "memory": memory_state(self.memory)}

    def _load(self, state: Mapping[str, Any], own: bool) -> None:
        super()._load(state, own)
        # another rank's gradients cannot correct this rank's step: drop the late average
        pending, last = (state.get("pending"), state.get("last")) if own else (None, None)
        self._pending = None if pending is None else _completed(np.asarray(pending, dtype=np.float32))
        self._last = None if last is None else np.asarray(last, dtype=np.float32).copy()
        load_memory(self.memory, state.get("memory"), own)

    def _finish(self, replica: Replica) -> None:
        self._apply_pending(replica, None)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def describe(self) -> dict[str, Any]:
        return {"algorithm": self.name, "correct": self.correct,
                "compression": repr(self.compression) if self.compression is not None else None}


def _completed(value: np.ndarray) -> Future[np.ndarray]:
    """A finished future holding ``value`` (a restored or already waited average)."""
    done: Future[np.ndarray] = Future()
    done.set_result(value)
    return done
