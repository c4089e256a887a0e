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
:data:`EXIT_GRACE_S` seconds; the launcher then sees a failed rank. That is not
enough under a raw ``mpirun``: once it queued its kill order for the lost host's
daemon it waits for that daemon (TCP retransmits for about 15 minutes, and Open MPI's
keepalive does not probe a connection with data in flight). So a rank whose parent
is the launcher (``mpirun``/``orterun``/``mpiexec``/``prterun``: the ranks on the
host where it runs) also starts a detached *reaper* before calling ``MPI_Abort``;
if that launcher is still alive :data:`LAUNCHER_GRACE_S` seconds later, the reaper
tells why on stderr and signals it as a user's repeated Ctrl-C would (SIGTERM three
times, which makes Open MPI's launcher kill its local ranks and exit with status 1),
then SIGKILLs it if it is still there. ``plait run`` ends such a launcher itself
(see :mod:`plait.launch.run`); the reaper covers ``mpirun`` started by hand. Without MPI
(``install(mpi=False)``: the Horovod backend under ``horovodrun --gloo``) the rank
prints the error and exits at once with :data:`ABORT_CODE` instead of hanging in
Horovod's shutdown; horovodrun then ends the other ranks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from types import TracebackType
from typing import Any

from plait.errors import CollectiveTimeoutError, MismatchError, invalid

__all__ = ["ABORT_CODE", "EXIT_GRACE_S", "LAUNCHER_GRACE_S", "LAUNCHERS", "end_job", "install",
           "installed", "launcher_pid", "reaper_argv"]

#: Exit status of a rank ended by :func:`install`'s hook (and of a job it aborted).
ABORT_CODE = 3
#: Seconds an aborting rank gives ``MPI_Abort`` to end it before it exits by itself.
EXIT_GRACE_S = 5.0
#: Seconds the launcher gets to end the job after a rank's ``MPI_Abort`` before that rank's
#: reaper ends the launcher (``plait run`` ends it 10 s after the abort, which is cleaner:
#: it kills the launcher's whole process tree, so it goes first).
LAUNCHER_GRACE_S = 12.0
#: Process names of MPI launchers whose ranks start a reaper (``/proc/PID/comm``).
LAUNCHERS = ("mpirun", "orterun", "mpiexec", "prterun")
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


def _start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (start time in clock ticks), None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def launcher_pid() -> int | None:
    """The pid of this process's parent when it is an MPI launcher (see :data:`LAUNCHERS`).

    Returns:
        The pid, or None (a rank started by a remote daemon ``orted``, or no ``/proc``).
    """
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/comm") as f:
            name = f.read().strip()
    except OSError:
        return None
    return ppid if name in LAUNCHERS else None


# sh -c REAPER PID START GRACE RANK: after GRACE s, if PID is the same process (start
# time), say why and end it as repeated Ctrl-C would, then SIGKILL it.
_REAPER = r"""
pid=$1 start=$2 grace=$3 rank=$4
same() { [ -r /proc/$pid/stat ] && [ "$(sed 's/.*) //' /proc/$pid/stat | cut -d' ' -f20)" = "$start" ]; }
sleep "$grace"
same || exit 0
echo "plait: the launcher ($(cat /proc/$pid/comm 2>/dev/null) pid $pid) did not end the job" \
  "within ${grace}s after rank $rank called MPI_Abort (a host unreachable?); ending it" >&2
for i in 1 2 3; do same && kill -TERM "$pid" 2>/dev/null; sleep 0.5; done
sleep 3
same && kill -KILL "$pid" 2>/dev/null
exit 0
"""


def reaper_argv(rank: str, grace: float = LAUNCHER_GRACE_S) -> list[str]:
    """The command of a reaper of this rank's launcher: after ``grace`` seconds, if that
    launcher is still alive, it says why on stderr and ends it (see the module's text).

    Args:
        rank: names the rank in the message.
        grace: seconds the launcher gets to end the job by itself.

    Returns:
        The argv, or an empty list when this process's parent is not a launcher.
    """
    pid = launcher_pid()
    start = _start_time(pid) if pid is not None else None
    if pid is None or start is None:
        return []
    return ["sh", "-c", _REAPER, "plait-reaper", str(pid), start, f"{grace:g}", rank]


def _reap_launcher_later(rank: str, grace: float) -> None:
    """Start the detached reaper of this rank's launcher (if its parent is one)."""
    argv = reaper_argv(rank, grace)
    if not argv:
        return
    with contextlib.suppress(OSError):
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True)


def _abort(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    from mpi4py import MPI

    if MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    rank = str(MPI.COMM_WORLD.Get_rank())
    _report(kind, value, tb, rank, "aborts the job (MPI_Abort)")
    _exit_later(float(_STATE.get("grace", EXIT_GRACE_S)))
    _reap_launcher_later(rank, LAUNCHER_GRACE_S)
    MPI.COMM_WORLD.Abort(ABORT_CODE)


def _exit(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    rank = os.environ.get("HOROVOD_RANK", "?")
    _report(kind, value, tb, rank, f"exits with status {ABORT_CODE}")
    os._exit(ABORT_CODE)


def end_job(error: BaseException, mpi: bool = True) -> None:
    """Print ``error`` and end the whole job now, as an uncaught error would with
    :func:`install` (for a thread that cannot raise into the one that is stuck).

    Args:
        error: what happened.
        mpi: end the job with ``MPI_Abort``; False: exit this process.
    """
    (_abort if mpi else _exit)(type(error), error, error.__traceback__)
    os._exit(ABORT_CODE)  # a job of one rank: MPI_Abort is not called


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
