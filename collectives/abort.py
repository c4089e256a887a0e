"""End the whole job when a rank dies of an uncaught plait error (no hang at exit).

A rank whose collective timed out (:class:`~plait.errors.CollectiveTimeoutError`)
must not simply exit: ``MPI_Finalize`` at interpreter exit waits for the peers
that are still blocked, so the job would hang. :func:`install` wraps
``sys.excepthook`` (and ``threading.excepthook``) so that such an error prints its
message, naming what the rank waited for, then calls ``MPI_Abort``, which ends
every rank of the job at once with a non-zero status.

``MPI_Abort`` itself can block for ever when the launcher cannot reach a host (a
lost link: ``mpirun`` waits for the daemon it cannot kill), so before calling it
the rank arms a watchdog that ends the process with :data:`ABORT_CODE` after
:data:`EXIT_GRACE_S` seconds; the launcher then sees a failed rank. Without MPI
(``install(mpi=False)``: the Horovod backend under ``horovodrun --gloo``) the rank
prints the error and exits at once with :data:`ABORT_CODE` instead of hanging in
Horovod's shutdown; horovodrun then ends the other ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any

from plait.errors import CollectiveTimeoutError, MismatchError, invalid

__all__ = ["ABORT_CODE", "EXIT_GRACE_S", "install", "installed"]

#: Exit status of a rank ended by :func:`install`'s hook (and of a job it aborted).
ABORT_CODE = 3
#: Seconds an aborting rank gives ``MPI_Abort`` to end it before it exits by itself.
EXIT_GRACE_S = 5.0
_ABORT_ON: tuple[type[BaseException], ...] = (CollectiveTimeoutError, MismatchError)
_STATE: dict[str, Any] = {}


def _report(kind: type[BaseException], value: BaseException, tb: TracebackType | None,
            rank: str, action: str) -> None:
    traceback.print_exception(kind, value, tb, file=sys.stderr)
    sys.stderr.write(f"plait: rank {rank} {action} after an uncaught {kind.__name__}: {value}\n")
    sys.stderr.flush()


def _exit_later(grace: float) -> None:
    """Arm the watchdog: exit with :data:`ABORT_CODE` after ``grace`` seconds.

    A daemon thread exits with the code; ``SIGALRM`` (default action: terminate) a
    second later covers a call that blocks holding the interpreter lock.
    """

    def run() -> None:
        time.sleep(grace)
        with contextlib.suppress(Exception):
            sys.stderr.write(f"plait: MPI_Abort did not end this rank within {grace:g}s "
                             f"(a host unreachable?); exiting with status {ABORT_CODE}\n")
            sys.stderr.flush()
        os._exit(ABORT_CODE)

    threading.Thread(target=run, name="plait-abort-exit", daemon=True).start()
    with contextlib.suppress(ValueError, OSError, AttributeError):  # not the main thread
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    with contextlib.suppress(ValueError, OSError, AttributeError):
        signal.alarm(int(grace) + 2)


def _abort(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    from mpi4py import MPI

    if MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    rank = str(MPI.COMM_WORLD.Get_rank())
    _report(kind, value, tb, rank, "aborts the job (MPI_Abort)")
    _exit_later(float(_STATE.get("grace", EXIT_GRACE_S)))
    MPI.COMM_WORLD.Abort(ABORT_CODE)


def _exit(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    rank = os.environ.get("HOROVOD_RANK", "?")
    _report(kind, value, tb, rank, f"exits with status {ABORT_CODE}")
    os._exit(ABORT_CODE)


def install(every_exception: bool = False, mpi: bool = True, grace: float = EXIT_GRACE_S) -> None:
    """Make uncaught plait timeouts and mismatches end the whole job (idempotent).

    Args:
        every_exception: also on any other uncaught exception, not only
            :class:`~plait.errors.CollectiveTimeoutError` / :class:`~plait.errors.MismatchError`.
        mpi: end the job with ``MPI_Abort`` (the job was started by an MPI launcher);
            False: exit this process at once (the launcher ends the others).
        grace: seconds ``MPI_Abort`` gets to end this rank before it exits by itself.

    Raises:
        ConfigError: for a ``grace`` that is not a positive number of seconds.
    """
    if not 0 < grace < float("inf"):
        raise invalid("grace", grace, "a positive number of seconds")
    if _STATE:
        return
    end = _abort if mpi else _exit
    previous = sys.excepthook
    previous_thread = threading.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if every_exception or issubclass(kind, _ABORT_ON):
            end(kind, value, tb)
        previous(kind, value, tb)

    def thread_hook(args: Any) -> None:
        if args.exc_value is not None and (every_exception or isinstance(args.exc_value, _ABORT_ON)):
            end(args.exc_type, args.exc_value, args.exc_traceback)
        previous_thread(args)

    sys.excepthook = hook
    threading.excepthook = thread_hook
    _STATE["previous"] = (previous, previous_thread)
    _STATE["grace"] = grace


def installed() -> bool:
    """True once :func:`install` ran in this process."""
    return bool(_STATE)
