"""A bound for calls that block while holding the interpreter lock.

Starting a Horovod op from torch (``horovod.torch.allreduce_async``) is a C++ call
that keeps the GIL. It normally returns in microseconds, but it waits for a lock
that Horovod's background loop holds while it negotiates with the other ranks; when
a rank is stopped (SIGSTOP) or stuck, that negotiation never ends and neither does
the call. No Python thread can run meanwhile, so no timeout written in Python
(:class:`~plait.collectives.watchdog.Watchdog`, a ``threading.Event`` wait) can end
it. A Horovod op inside a TensorFlow graph waits the same way, in a kernel that
Python cannot interrupt (:func:`plait.adapters.tensorflow.bracketed` arms it there).

:class:`OutsideWatchdog` runs the bound in another process: a small Python child
(started on first use, without ``site``) that reads the armed call's deadline and
message from memory shared with this process. Arming writes them there (no system
call, about 1.5 us with the disarm); disarming clears the deadline. When a deadline passes
the child writes the message on this process's stderr (opened through ``/proc`` only
then: a child holding the rank's output pipes would outlive a killed rank by up to
:data:`PERIOD_S`, and launchers such as horovodrun's elastic driver wait for those pipes
to close before they count the rank as gone) and ends it with SIGKILL;
the launcher (``mpirun``, ``horovodrun``, ``plait run``) then sees a failed rank and
ends the job. A command given as ``then`` runs next, in the child's place (the launcher
reaper of :mod:`plait.collectives.abort`: a raw ``mpirun`` can hang ending a job with a
host it lost).
The child exits when this process does.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Hashable, Sequence

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
            try:  # the parent's stderr, borrowed now: holding it meanwhile would delay
                err = os.open("/proc/%d/fd/2" % parent, os.O_WRONLY | os.O_APPEND)
                os.dup2(err, 2)
                os.write(2, text)
            except OSError:
                pass
            os.kill(parent, signal.SIGKILL)
            if len(sys.argv) > 5:
                os.execvp(sys.argv[5], sys.argv[5:])
            break
    time.sleep(min(period, deadline - now + 0.01) if deadline > now else period)
"""


class OutsideWatchdog:
    """Ends this process from another process when an armed call outlives its deadline.

    Several calls may be armed at once (threads; graph ops running in parallel): each
    :meth:`arm` returns a key for its :meth:`disarm`, and the child watches the
    earliest deadline of those armed. Arming again with a key still armed replaces
    its deadline: an op of a graph that failed before its disarm ran is armed again,
    with a fresh deadline, the next time the graph runs.

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
        self._armed: dict[Hashable, tuple[float, bytes]] = {}
        self._shown: tuple[float, bytes] | None = None
        self._keys = itertools.count()
        self._lock = threading.Lock()

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
                stderr=subprocess.DEVNULL, pass_fds=(fd,), close_fds=True, start_new_session=True)
            os.close(fd)
        except (OSError, ValueError) as exc:
            self._failed = True
            warnings.warn(f"plait: cannot start the outside watchdog ({exc}); a Horovod call "
                          "that blocks holding the GIL will not time out", RuntimeWarning, stacklevel=3)
            return False
        self._shared = shared
        return True

    def arm(self, seconds: float, message: str, key: Hashable | None = None) -> Hashable:
        """Bound the call that follows to ``seconds``; call :meth:`disarm` with the key
        returned when it returned (also when it raised).

        Args:
            seconds: the time the call may take (a non-positive or infinite value
                arms nothing).
            message: written on stderr (a newline is added) if the deadline passes,
                just before this process is killed.
            key: names the call (default: a new key); arming a key that is armed
                replaces its deadline and message.

        Returns:
            The key to disarm with.
        """
        if key is None:
            key = next(self._keys)
        bounded = isinstance(seconds, (int, float)) and 0 < seconds < float("inf")
        if not bounded or not self._start():
            return key
        text = (message.rstrip("\n") + "\n").encode("utf-8", "replace")[:_SIZE - _TEXT]
        with self._lock:
            self._armed[key] = (time.monotonic() + seconds, text)
            self._show()
        return key

    def disarm(self, key: Hashable) -> None:
        """The call armed with ``key`` returned (a key not armed is ignored).

        Args:
            key: what :meth:`arm` returned.
        """
        with self._lock:
            if self._armed.pop(key, None) is not None:
                self._show()

    def clear(self) -> None:
        """Disarm every call (the library was shut down: nothing armed will return)."""
        with self._lock:
            self._armed.clear()
            self._show()

    def _show(self) -> None:
        """Give the child the earliest deadline armed and its message (the lock is held)."""
        shared = self._shared
        if shared is None:
            return
        armed = self._armed
        if not armed:
            shown = None
        elif len(armed) == 1:
            shown = next(iter(armed.values()))
        else:
            shown = min(armed.values(), key=lambda v: v[0])
        if shown == self._shown:
            return
        self._shown = shown
        _HEAD.pack_into(shared, 0, 0.0, 0)  # type: ignore[arg-type]
        if shown is not None:
            deadline, text = shown
            shared[_TEXT:_TEXT + len(text)] = text  # type: ignore[index]
            _HEAD.pack_into(shared, 0, deadline, len(text))  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop the child (it also stops by itself when this process exits)."""
        if self._child is not None:
            with contextlib.suppress(OSError):
                self._child.kill()
                self._child.wait()
        if self._shared is not None:
            self._shared.close()
        self._child = self._shared = None
