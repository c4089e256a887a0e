"""Waiting on a Horovod handle with a timeout.

``horovod.torch.synchronize(handle)`` has no timeout: in C++ it polls the handle and
yields the CPU between polls, holding the GIL (its binding does not release it). Two
bounded waits:

* :class:`BlockingWaits` (MPI jobs) runs ``synchronize`` on a parked daemon thread and
  lets the caller wait on an event with a timeout. Polling on the caller's thread with
  short sleeps took CPU from Horovod's background thread there (2 ranks on 2 cores, a
  19 MiB allreduce: 14.5 ms against 11 ms). A thread whose handle never completes is
  left behind (a daemon thread: it does not keep the process alive); the next wait
  takes another thread.
* :func:`spin` (``horovodrun --gloo``) polls on the caller's thread as ``synchronize``
  does, up to a deadline: there the thread's hand-over cost more than it saved.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HOROVOD_WAIT", "BlockingWaits", "spin", "wait_ticking"]

#: Where a rank waiting in a Horovod op says it waits when a rank that timed out asks
#: (see :meth:`plait.collectives.mpi.MPICommunicator.arrivals`).
HOROVOD_WAIT = -2


def wait_ticking(wait: Callable[[float], bool], timeout: float,
                 tick: Callable[[], object] | None = None, every: float = 0.05) -> bool:
    """Wait with ``wait`` (which waits at most the seconds it is given and says whether
    it is done) for at most ``timeout`` seconds, calling ``tick`` every ``every`` seconds
    meanwhile.

    Args:
        wait: e.g. ``threading.Event.wait``.
        timeout: seconds.
        tick: called between waits (None: one wait of ``timeout``).
        every: seconds between ticks.

    Returns:
        Whether it was done in time.
    """
    if tick is None:
        return wait(timeout)
    deadline = time.monotonic() + timeout
    while not wait(min(every, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            return False
        tick()
    return True


def spin(done: Callable[[], bool], deadline: float) -> None:
    """Poll ``done`` until it is true, giving the CPU away between polls, as Horovod's own
    ``synchronize`` does (a ``sched_yield`` loop), but only until ``deadline``.

    Used where no MPI answers ticks (``horovodrun --gloo``): there, handing the wait to a
    :class:`BlockingWaits` thread made a 1.9M-parameter MLP step ~1.3x Horovod's (2 ranks,
    interleaved in one job). Between polls ``os.sched_yield`` gives the core to Horovod's
    background thread: ``time.sleep(0)`` does not (an absolute sleep already due returns
    without scheduling), and with it the same step took 28-32 ms where Horovod's own took
    22-26 ms (and Horovod's took 41-51 ms beside it: the ranks' background threads starved
    while the other rank spun); with ``sched_yield`` 24-28 ms (1.01-1.09x, 5 jobs).

    Args:
        done: e.g. ``lambda: hvd.poll(handle)``.
        deadline: ``time.monotonic()`` value to give up at.

    Raises:
        TimeoutError: ``done`` was still false at ``deadline``.
    """
    polls = 0
    while not done():
        os.sched_yield()  # releases the GIL and lets this core run another thread
        polls += 1
        if not polls & 255 and time.monotonic() > deadline:
            raise TimeoutError("no result before the deadline")


class _Box:
    """One wait's outcome, handed from a waiting thread to the caller."""

    def __init__(self, handle: Any, block: Callable[[Any], Any]) -> None:
        self.handle = handle
        self.block = block
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class _Thread:
    """A daemon thread that runs ``box.block(box.handle)`` for one box at a time."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[_Box] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name=name).start()

    def _run(self) -> None:
        while True:
            box = self.jobs.get()
            try:
                box.value = box.block(box.handle)
            except BaseException as exc:  # handed to the caller, who raises it
                box.error = exc
            box.done.set()


class BlockingWaits:
    """Bounded waits on handles through a blocking wait function.

    Args:
        block: waits for a handle and returns its result (e.g. Horovod's
            ``synchronize``); must release the GIL while it blocks.
        name: name prefix of the waiting threads.
    """

    def __init__(self, block: Callable[[Any], Any], name: str = "plait-wait") -> None:
        self._block = block
        self._name = name
        self._idle: list[_Thread] = []
        self._lock = threading.Lock()
        self.threads = 0  #: threads started so far (one per concurrent or abandoned wait)

    def wait(self, handle: Any, timeout: float, tick: Callable[[], object] | None = None,
             every: float = 0.05, block: Callable[[Any], Any] | None = None) -> Any:
        """``block(handle)``, waited for at most ``timeout`` seconds.

        Args:
            handle: what ``block`` waits for.
            timeout: seconds.
            tick: called every ``every`` seconds while it waits (answers the other
                ranks' questions, see :meth:`plait.collectives.mpi.MPICommunicator.arrivals`).
            every: seconds between ticks.
            block: this wait's blocking function instead of the one given at
                construction (e.g. one that waits for two handles in one go).

        Returns:
            What ``block`` returned.

        Raises:
            TimeoutError: ``block`` did not return within ``timeout`` (it goes on
                blocking on its thread, which is not used again).
            BaseException: what ``block`` raised.
        """
        with self._lock:
            if self._idle:
                thread = self._idle.pop()
            else:
                self.threads += 1
                thread = _Thread(f"{self._name}-{self.threads}")
        box = _Box(handle, self._block if block is None else block)
        thread.jobs.put(box)
        if not wait_ticking(box.done.wait, timeout, tick, every):
            raise TimeoutError(f"no result within {timeout:g}s")
        with self._lock:
            self._idle.append(thread)
        if box.error is not None:
            raise box.error
        return box.value
