"""Abort the whole MPI job when a rank dies of an uncaught plait error (no hang at exit).

A rank whose collective timed out (:class:`~plait.errors.CollectiveTimeoutError`)
must not simply exit: ``MPI_Finalize`` at interpreter exit waits for the peers
that are still blocked, so the job would hang. :func:`install` wraps
``sys.excepthook`` (and ``threading.excepthook``) so that such an error prints its
message, naming what the rank waited for, then calls ``MPI_Abort``, which ends
every rank of the job at once with a non-zero status.
"""

from __future__ import annotations

import sys
import threading
import traceback
from types import TracebackType
from typing import Any

from mpi4py import MPI

from plait.errors import CollectiveTimeoutError, MismatchError

__all__ = ["ABORT_CODE", "install", "installed"]

#: Exit status of a job aborted by :func:`install`'s hook.
ABORT_CODE = 3
_ABORT_ON: tuple[type[BaseException], ...] = (CollectiveTimeoutError, MismatchError)
_STATE: dict[str, Any] = {}


def _abort(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    rank = MPI.COMM_WORLD.Get_rank()
    traceback.print_exception(kind, value, tb, file=sys.stderr)
    sys.stderr.write(f"plait: rank {rank} aborts the job (MPI_Abort) after an uncaught "
                     f"{kind.__name__}: {value}\n")
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(ABORT_CODE)


def install(every_exception: bool = False) -> None:
    """Make uncaught plait timeouts and mismatches abort the whole job (idempotent).

    Args:
        every_exception: abort on any uncaught exception, not only
            :class:`~plait.errors.CollectiveTimeoutError` / :class:`~plait.errors.MismatchError`.
    """
    if _STATE:
        return
    previous = sys.excepthook
    previous_thread = threading.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if every_exception or issubclass(kind, _ABORT_ON):
            _abort(kind, value, tb)
        previous(kind, value, tb)

    def thread_hook(args: Any) -> None:
        if args.exc_value is not None and (every_exception or isinstance(args.exc_value, _ABORT_ON)):
            _abort(args.exc_type, args.exc_value, args.exc_traceback)
        previous_thread(args)

    sys.excepthook = hook
    threading.excepthook = thread_hook
    _STATE["previous"] = (previous, previous_thread)


def installed() -> bool:
    """True once :func:`install` ran in this process."""
    return bool(_STATE)
