"""A bound for calls that block while holding the interpreter lock.

Starting a Horovod op from torch (``horovod.torch.allreduce_async``) is a C++ call
that keeps the GIL. It normally returns in microseconds, but it waits for a lock
that Horovod's background loop holds while it negotiates with the other ranks; when
a rank is stopped (SIGSTOP) or stuck, that negotiation never ends and neither does
the call. No Python thread can run meanwhile, so no timeout written in Python
(:class:`~plait.collectives.watchdog.Watchdog`, a ``threading.Event`` wait) can end
it.

:class:`OutsideWatchdog` runs the bound in another process: a small Python child
(started on first use, without ``site``) that reads the armed call's deadline and
message from memory shared with this process. Arming writes them there (no system
call, about a microsecond); disarming clears the deadline. When a deadline passes
the child writes the message on this process's stderr and ends it with SIGKILL;
the launcher (``mpirun``, ``horovodrun``, ``plait run``) then sees a failed rank and
ends the job. A command given as ``then`` runs next, in the child's place (the launcher
reaper of :mod:`plait.collectives.abort`: a raw ``mpirun`` can hang ending a job with a
host it lost).
The child exits when this process does.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence

__all__ = ["OutsideWatchdog"]

#: Deadline (``time.monotonic()``, the same clock in every process of a host) and the
#: message's length; the message follows at :data:`_TEXT`.
_HEAD = struct.Struct("=dI")
_TEXT = 16
_SIZE = 4096
#: The child looks at the deadline at least this often (seconds).
PERIOD_S = 0.25

# python -S -c _CHILD FD PARENT PERIOD NAME [THEN...]: wait for the parent's armed deadline
# to pass, then tell why, SIGKILL the parent and exec THEN; exit when the parent is gone.
_CHILD = r"""
import mmap, os, signal, struct, sys, time
fd, parent, period = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
shared = mmap.mmap(fd, 4096, prot=mmap.PROT_READ)
head = struct.Struct("=dI")
while os.getppid() == parent:
    deadline, n = head.unpack_from(shared, 0)
    now = time.monotonic()
    if deadline and now > deadline:
        text = shared[16:16 + n]
        if head.unpack_from(shared, 0) == (deadline, n):  # not re-armed while read
            os.write(2, text)
            os.kill(parent, signal.SIGKILL)
            if len(sys.argv) > 5:
                os.execvp(sys.argv[5], sys.argv[5:])
            break
    time.sleep(min(period, deadline - now + 0.01) if deadline > now else period)
"""


class OutsideWatchdog:
    """Ends this process from another process when an armed call outlives its deadline.

    One call is armed at a time per process (the calls it guards hold the GIL, so
    they cannot overlap); a thread that arms while another thread's call is armed
    moves the deadline and the message to its own call, and the guard ends when
    both disarmed.

    Args:
        name: shown in the child's command line (``ps``).
        then: a command (argv) the child runs after it killed this process.
    """

    def __init__(self, name: str = "plait-outside-watchdog", then: Sequence[str] = ()) -> None:
        self._name = name
        self._then = list(then)
        self._shared: mmap.mmap | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._failed = False
        self._depth = 0

    def _start(self) -> bool:
        """Start the child (once). Returns False where it cannot run (warned once)."""
        if self._shared is not None:
            return True
        if self._failed:
            return False
        try:
            if hasattr(os, "memfd_create"):
                fd = os.memfd_create("plait-watchdog")
            else:
                fd, path = tempfile.mkstemp()
                os.unlink(path)
            os.ftruncate(fd, _SIZE)
            shared = mmap.mmap(fd, _SIZE)
            self._child = subprocess.Popen(
                [sys.executable, "-S", "-c", _CHILD, str(fd), str(os.getpid()), str(PERIOD_S),
                 self._name, *self._then], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                pass_fds=(fd,), close_fds=True, start_new_session=True)
            os.close(fd)
        except (OSError, ValueError) as exc:
            self._failed = True
            warnings.warn(f"plait: cannot start the outside watchdog ({exc}); a Horovod call "
                          "that blocks holding the GIL will not time out", RuntimeWarning, stacklevel=3)
            return False
        self._shared = shared
        return True

    def arm(self, seconds: float, message: str) -> None:
        """Bound the call that follows to ``seconds``; call :meth:`disarm` when it
        returned (also when it raised).

        Args:
            seconds: the time the call may take (a non-positive or infinite value
                arms nothing, but still needs its :meth:`disarm`).
            message: written on stderr (a newline is added) if the deadline passes,
                just before this process is killed.
        """
        self._depth += 1
        bounded = isinstance(seconds, (int, float)) and 0 < seconds < float("inf")
        if not bounded or not self._start():
            return
        shared = self._shared
        text = (message.rstrip("\n") + "\n").encode("utf-8", "replace")[:_SIZE - _TEXT]
        _HEAD.pack_into(shared, 0, 0.0, 0)  # type: ignore[arg-type]
        shared[_TEXT:_TEXT + len(text)] = text  # type: ignore[index]
        _HEAD.pack_into(shared, 0, time.monotonic() + seconds, len(text))  # type: ignore[arg-type]

    def disarm(self) -> None:
        """The armed call returned."""
        self._depth -= 1
        if self._depth <= 0:
            self._depth = 0
            if self._shared is not None:
                _HEAD.pack_into(self._shared, 0, 0.0, 0)

    def close(self) -> None:
        """Stop the child (it also stops by itself when this process exits)."""
        if self._child is not None:
            with contextlib.suppress(OSError):
                self._child.kill()
                self._child.wait()
        if self._shared is not None:
            self._shared.close()
        self._child = self._shared = None
