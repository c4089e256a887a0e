"""Crash guard: a process must not leave its peers waiting for asynchronous messages.

Algorithms register here once set up and unregister at the end of
``synchronize()``. If the process exits while one is still registered (an
exception escaped the training loop), an exit handler writes why to stderr and
ends the process with status 1 *without* finalising MPI (finalising would wait
for the peers, which wait for this rank): mpirun then ends the whole job at once
with a clear report instead of every other rank waiting for its timeout.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

__all__ = ["in_flight", "track", "untrack"]

_LIVE: dict[int, str] = {}


def track(obj: object, what: str) -> None:
    """Mark ``obj`` (described by ``what``) as having asynchronous work in flight."""
    _LIVE[id(obj)] = what


def untrack(obj: object) -> None:
    """``obj`` finished cleanly."""
    _LIVE.pop(id(obj), None)


def in_flight() -> list[str]:
    """Descriptions of what is still in flight."""
    return list(_LIVE.values())


def _abort_if_in_flight() -> None:
    if not _LIVE:
        return
    sys.stdout.flush()
    sys.stderr.write(
        f"plait.asyncdp: {', '.join(in_flight())} is exiting before synchronize() (after an error?) "
        "with asynchronous work in flight; aborting so that the other ranks do not hang\n")
    sys.stderr.flush()
    time.sleep(0.5)  # let the launcher forward this rank's last output before it ends the job
    os._exit(1)


atexit.register(_abort_if_in_flight)
