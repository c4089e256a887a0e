"""A bound for blocking calls that cannot time out by themselves.

A blocking MPI collective (``MPI_Allreduce``) is faster than its nonblocking form
on shared memory, but it cannot be interrupted: a peer stopped in the middle of
it would keep this rank waiting for ever. The MPI backend makes such a call only
after every rank proved that it arrived at the collective (the header round), and
between :meth:`Watchdog.arm` and :meth:`Watchdog.disarm`: if the call is still running after the timeout, the
watchdog's thread calls ``expire`` with the call's description (which ends the
job: the blocked thread cannot raise).

Arming costs a dictionary store (no lock, no wake-up): the thread looks at the
armed calls a few times per timeout and sleeps otherwise. Nothing here imports
MPI.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

__all__ = ["Watchdog"]

#: The watchdog looks at most this long after a call's deadline (and at least every
#: tenth of the timeout).
MAX_LATE_S = 1.0


class Watchdog:
    """Calls ``expire(description)`` once for each guarded call that outlives its time.

    Args:
        expire: called in the watchdog's thread with the description of the call
            that ran past its deadline (expected to end the process or the job).
        name: the thread's name.
    """

    def __init__(self, expire: Callable[[str], None], name: str = "plait-watchdog") -> None:
        self._expire = expire
        self._name = name
        self._armed: dict[int, tuple[float, Callable[[], str]]] = {}
        self._ids = itertools.count()
        self._period = MAX_LATE_S
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, describe: Callable[[], str]) -> int:
        """Start bounding a call to ``seconds``; pass the result to :meth:`disarm` when
        it returned (also when it raised).

        Args:
            seconds: the time the call may take.
            describe: names the call, for the message (called only on expiry).

        Returns:
            The key of this call.
        """
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        if seconds / 10 < self._period:
            self._period = max(0.01, seconds / 10)
        key = next(self._ids)
        self._armed[key] = (time.monotonic() + seconds, describe)
        return key

    def disarm(self, key: int) -> None:
        """The call of ``key`` returned."""
        self._armed.pop(key, None)

    def _run(self) -> None:
        while True:
            time.sleep(self._period)
            now = time.monotonic()
            for key, (deadline, describe) in list(self._armed.items()):
                if now > deadline and self._armed.pop(key, None) is not None:
                    self._expire(describe())
