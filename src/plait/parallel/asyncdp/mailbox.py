"""Point-to-point messages without a global barrier: one receiving thread per peer.

A message is an int64 header ``[kind, step, a, b]`` followed (for updates) by a
float32 payload. Receiving threads block in ``comm.recv`` (which gives up after
the communicator's timeout) and queue what arrives; one sending thread sends in
order, so a rank never blocks on a slow peer when posting. A peer ends its stream
with a DONE header.

An open mailbox is registered with :mod:`.guard`: a process that exits with one
open (a crash) aborts instead of leaving its peers waiting.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from plait.errors import CollectiveTimeoutError
from plait.protocols import Communicator

from .guard import track, untrack

__all__ = ["DONE", "UPDATE", "Mailbox", "Message"]

UPDATE, DONE = 1, 2

#: (peer, header, payload or None)
Message = tuple[int, np.ndarray, "np.ndarray | None"]

class Mailbox:
    """Queued receiving from ``peers`` and ordered sending, on background threads.

    Args:
        comm: the communicator (point-to-point capable).
        peers: ranks to receive from.
        payload_size: float32 elements of an update payload from ``peer``.
        tag: first of the two tags used (header, payload).
    """

    def __init__(self, comm: Communicator, peers: Iterable[int], payload_size: Callable[[int], int],
                 tag: int) -> None:
        self.comm, self.tag = comm, tag
        self.peers = list(peers)
        self._size = payload_size
        self._cond = threading.Condition()
        self._queue: deque[Message] = deque()
        self._error: BaseException | None = None
        self._sent: list[Future[None]] = []
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="plait-async-send")
        self._threads = [threading.Thread(target=self._receive, args=(p,), daemon=True,
                                          name=f"plait-async-recv-{p}") for p in self.peers]
        track(self, f"rank {comm.rank}'s mailbox")
        for t in self._threads:
            t.start()

    # -- receiving ---------------------------------------------------------------------
    def _receive(self, peer: int) -> None:
        try:
            while True:
                header = np.asarray(self.comm.recv(np.zeros(4, np.int64), peer, self.tag))
                payload = None
                if int(header[0]) != DONE:
                    payload = np.asarray(self.comm.recv(np.zeros(self._size(peer), np.float32),
                                                        peer, self.tag + 1))
                with self._cond:
                    self._queue.append((peer, header, payload))
                    self._cond.notify_all()
                if int(header[0]) == DONE:
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def take(self, wait: bool, what: str) -> list[Message]:
        """Everything received so far; with ``wait``, block until at least one message.

        Raises:
            CollectiveTimeoutError: when nothing arrives within the communicator's timeout.
            Exception: a receiving thread's error (e.g. a peer's timeout).
        """
        timeout = float(getattr(self.comm, "timeout", 300.0))
        deadline = time.monotonic() + timeout
        with self._cond:
            while wait and not self._queue and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeoutError(
                        f"rank {self.comm.rank}: waited {timeout:g}s for {what}; a peer is dead or stuck")
                self._cond.wait(min(left, 1.0))
            if self._error is not None and not self._queue:
                raise self._error
            out = list(self._queue)
            self._queue.clear()
        self._check_sent()
        return out

    # -- sending -------------------------------------------------------------------------
    def _send(self, peer: int, header: np.ndarray, payload: np.ndarray | None) -> None:
        self.comm.send(header, peer, self.tag)
        if payload is not None:
            self.comm.send(payload, peer, self.tag + 1)

    def post(self, peer: int, kind: int, step: int, a: int = 0, b: int = 0,
             payload: np.ndarray | None = None) -> None:
        """Queue a message to ``peer`` (sent in order on the sending thread)."""
        header = np.array([kind, step, a, b], dtype=np.int64)
        data = None if payload is None else np.ascontiguousarray(payload, dtype=np.float32)
        self._sent.append(self._sender.submit(self._send, peer, header, data))
        self._check_sent()

    def _check_sent(self) -> None:
        keep = []
        for f in self._sent:
            if f.done():
                f.result()
            else:
                keep.append(f)
        self._sent = keep

    # -- end ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for every send and for every peer's DONE.

        Raises:
            CollectiveTimeoutError: when a peer does not finish within the timeout.
        """
        timeout = float(getattr(self.comm, "timeout", 300.0))
        for f in self._sent:
            f.result(timeout=timeout)
        self._sender.shutdown(wait=True)
        for t in self._threads:
            t.join(timeout)
            if t.is_alive():
                raise CollectiveTimeoutError(
                    f"rank {self.comm.rank}: {t.name} got no DONE within {timeout:g}s")
        if self._error is not None:
            raise self._error
        untrack(self)

    def __repr__(self) -> str:
        return f"<Mailbox rank={self.comm.rank} peers={self.peers}>"


