"""How pipeline messages cross the wire: headers, nonblocking sends, pre-posted receives.

Activations and gradients travel as numpy arrays (host buffers). The receiver
of an activation learns its shape and dtype from a small int64 *header*
(dtype code, ndim, shape) that the sender of stage ``s`` sends once per step,
with micro-batch 0; every micro-batch of a step has that shape (the batch is
split evenly). A gradient has the shape of the activation it belongs to, which
its receiver produced itself, so gradients need no header.

:class:`Wire` posts every send without waiting (the communicator's
``send_async``: no thread, no polling; a pool of sender threads only for a
communicator without it) and receives through handles that the runtime posts
ahead of the action that consumes them (``recv_async``), so a message moves
while the receiver still computes. :class:`Notices` tells every other
pipeline rank, once per step, that this rank finished its step or failed in
it, so a stage that raises (a shape that does not fit, a bad layer) makes every
rank of the pipeline raise at once instead of waiting for its messages.
Nothing here imports a framework.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from plait.errors import CollectiveTimeoutError
from plait.protocols import Communicator, Handle

from .errors import PipelineError, StageFailed

__all__ = ["DTYPES", "HEADER_LEN", "NOTICE_BYTES", "Notices", "Wire", "header", "spans_hosts", "template",
           "to_numpy"]

#: int64 entries of a header: dtype code, ndim, up to 8 dims.
HEADER_LEN = 10
#: Activation dtypes a header can name, by code.
DTYPES = ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")


def header(a: np.ndarray) -> np.ndarray:
    """The header describing ``a``'s dtype and shape.

    Raises:
        PipelineError: ``a`` has a dtype not in :data:`DTYPES` or more than 8 dims.
    """
    name = a.dtype.name
    if name not in DTYPES:
        raise PipelineError(f"activation dtype must be one of {DTYPES}, got {name}")
    if a.ndim > HEADER_LEN - 2:
        raise PipelineError(f"activations may have at most {HEADER_LEN - 2} dims, got {a.shape}")
    h = np.zeros(HEADER_LEN, dtype=np.int64)
    h[0], h[1] = DTYPES.index(name), a.ndim
    h[2:2 + a.ndim] = a.shape
    return h


def template(h: Any) -> np.ndarray:
    """An empty array of the dtype and shape a header describes."""
    h = np.asarray(h)
    ndim = int(h[1])
    return np.empty(tuple(int(d) for d in h[2:2 + ndim]), dtype=DTYPES[int(h[0])])


def to_numpy(t: Any) -> np.ndarray:
    """``t`` (numpy or a framework tensor) as a contiguous numpy array, without a copy where possible."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t)
    from plait.adapters import ops_for

    return np.ascontiguousarray(ops_for(t).to_numpy(t))


def spans_hosts(comm: Any) -> bool:
    """Whether some rank of ``comm`` is on another host (True when the hosts are unknown).

    From the communicator's ``host_names`` where it has them, else from ``cross_size``.
    """
    names = getattr(comm, "host_names", None)
    return len(set(names)) > 1 if names else int(getattr(comm, "cross_size", 2)) > 1


class _Deferred:
    """A receive handle for a communicator without ``recv_async``: a blocking recv at ``wait``."""

    def __init__(self, comm: Communicator, like: np.ndarray, source: int, tag: int) -> None:
        self.args = (comm, like, source, tag)

    def done(self) -> bool:
        return False

    def wait(self) -> Any:
        comm, like, source, tag = self.args
        return comm.recv(like, source, tag)


class Wire:
    """Nonblocking sends and posted receives of one pipeline rank.

    Args:
        comm: The pipeline communicator.
        workers: Sender threads, used only when ``comm`` has no ``send_async``.
    """

    def __init__(self, comm: Communicator, workers: int) -> None:
        self.comm = comm
        self.send_async: Any = getattr(comm, "send_async", None)
        self.recv_async: Any = getattr(comm, "recv_async", None)
        self.timeout = float(getattr(comm, "timeout", 300.0))
        self.workers = max(2, workers)
        self.pool: ThreadPoolExecutor | None = None
        self.pending: list[Any] = []
        self.receiving: list[Any] = []  # posted receives not seen complete (crossing hosts only)
        #: Whether some pipeline rank is on another host (or the hosts are unknown).
        self.crosses_hosts = spans_hosts(comm)

    def send(self, array: np.ndarray, dest: int, tag: int) -> None:
        """Post a send of ``array`` (kept alive until it completed)."""
        if self.send_async is not None:
            self.pending.append(self.send_async(array, dest, tag))
            return
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=self.workers,
                                           thread_name_prefix="plait-pipeline-send")
        self.pending.append(self.pool.submit(self.comm.send, array, dest, tag))

    def recv(self, like: np.ndarray, source: int, tag: int) -> Handle:
        """Post a receive of an array like ``like``; its handle's ``wait()`` returns it."""
        if self.recv_async is not None:
            handle = self.recv_async(like, source, tag)
            if self.crosses_hosts:  # only progress() reads it
                self.receiving.append(handle)
            return handle  # type: ignore[no-any-return]
        return _Deferred(self.comm, like, source, tag)

    def progress(self) -> None:
        """Test every posted send and receive once, so their bytes move.

        MPI moves a message larger than its eager limit (64 KiB over TCP) only inside MPI
        calls on both sides: posted before a stage's compute and not tested during it, it
        waits for the end of that compute. Where the pipeline :attr:`crosses_hosts`, the
        stages call this between their layers (measured across 2 emulated hosts at 1 Gbit/s,
        ``benchmarks/pipeline.py --rate 1gbit``: GPipe's step about 15 % shorter at M=4; on
        shared memory, where the receiver copies the message, it changed nothing).
        """
        for h in self.pending:
            if not isinstance(h, Future):
                h.done()
        if self.receiving:
            self.receiving = [h for h in self.receiving if not h.done()]

    def reap(self) -> None:
        """Forget the oldest sends that completed (their buffers may be freed)."""
        while self.pending and not isinstance(self.pending[0], Future) and self.pending[0].done():
            self.pending.pop(0).wait()

    def flush(self, wait: Callable[[Any], Any] | None = None) -> None:
        """Wait for every posted send; re-raise the first failure.

        Args:
            wait: Waits for one send handle (default: its ``wait()``), e.g.
                :meth:`Notices.wait`.

        Raises:
            CollectiveTimeoutError: A send was not received within the timeout.
        """
        deadline = time.monotonic() + self.timeout
        pending, self.pending = self.pending, []
        for p in pending:
            if isinstance(p, Future):
                try:
                    p.result(timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise CollectiveTimeoutError(
                        f"pipeline send not received within {self.timeout:g}s; "
                        f"a neighbouring stage is dead or stuck") from None
            elif wait is not None:
                wait(p)
            else:
                p.wait()

    def close(self) -> None:
        """Release the sender threads (if any were started)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False)


#: Bytes of one notice: a status byte (0 done, 1 failed) and the reason in UTF-8.
NOTICE_BYTES = 512
# A waiting rank polls (yielding the CPU) for 1 ms, then naps 50 us between polls: on a
# loaded machine a process that keeps yielding waits behind every other runnable one,
# while a short sleep is woken promptly (measured: spinning 20 ms made 1F1B slower).
_SPIN_S, _NAP_S = 1e-3, 5e-5


class Notices:
    """Each step, every pipeline rank sends every other one notice: done, or failed and why.

    The notices of a step are received while the rank waits for its messages
    (:meth:`wait` watches them), so a failure anywhere raises on every rank at
    once. Only with a communicator that has ``send_async`` and ``recv_async``
    (else :attr:`enabled` is False and waits are plain waits).

    Args:
        wire: The rank's :class:`Wire`.
        peers: The other pipeline ranks.
        tag: The notices' tag (unused by any other pipeline message).
    """

    def __init__(self, wire: Wire, peers: Sequence[int], tag: int) -> None:
        self.wire, self.peers, self.tag = wire, list(peers), tag
        self.enabled = wire.send_async is not None and wire.recv_async is not None and bool(peers)
        self.inbox: dict[int, Any] = {}
        self.sent: list[Any] = []

    def open(self) -> None:
        """Post this step's receives of the peers' notices."""
        if self.enabled:
            self.sent = [h for h in self.sent if not h.done()]
            self.inbox = {p: self.wire.recv(np.zeros(NOTICE_BYTES, np.uint8), p, self.tag)
                          for p in self.peers}

    def tell(self, failure: str | None) -> None:
        """Send this step's notice to every peer: done (None) or the failure's text."""
        if not self.enabled:
            return
        buf = np.zeros(NOTICE_BYTES, np.uint8)
        if failure is not None:
            text = failure.encode("utf-8", "replace")[: NOTICE_BYTES - 1]
            buf[0], buf[1:1 + len(text)] = 1, np.frombuffer(text, np.uint8)
        for p in self.peers:
            self.sent.append(self.wire.send_async(buf, p, self.tag))

    def check(self) -> None:
        """Take the notices that arrived.

        Raises:
            StageFailed: A peer failed in this step (naming it and its error).
        """
        for p, h in list(self.inbox.items()):
            if h.done():
                msg = np.asarray(h.wait())
                del self.inbox[p]
                if msg[0] == 1:
                    self.inbox.clear()
                    text = bytes(msg[1:]).rstrip(b"\0").decode("utf-8", "replace")
                    raise StageFailed(f"pipeline rank {p} failed in this step: {text}", remote=True)

    def wait(self, h: Any) -> Any:
        """``h.wait()``, raising as soon as a peer's failure notice arrives.

        Raises:
            StageFailed: A peer failed in this step.
            CollectiveTimeoutError: Nothing arrived within the communicator's timeout.
        """
        if not self.inbox:
            return h.wait()
        start = time.monotonic()
        while not h.done():
            self.check()
            if not self.inbox:
                break
            now = time.monotonic()
            if now - start > self.wire.timeout:
                raise CollectiveTimeoutError(self._absent(getattr(h, "what", "")))
            if now - start < _SPIN_S:
                os.sched_yield()
            else:
                time.sleep(_NAP_S)
        return h.wait()

    def _absent(self, what: str = "") -> str:
        """The timeout message: the awaited message (``what``, if known) and the pipeline
        ranks (and their hosts) that sent neither it nor a notice of this step."""
        missing = sorted(self.inbox)
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        on_hosts = getattr(self.wire.comm, "on_hosts", None)
        hosts = on_hosts(missing) if on_hosts is not None else ""
        return (f"pipeline: waited {self.wire.timeout:g}s for {what or 'a message'}; pipeline {who} did not "
                f"arrive ({hosts}no message and no notice of this step: dead, stuck, or "
                "unreachable)")

    def finish(self) -> None:
        """End a step that went well: tell the peers, then take their notices.

        Raises:
            StageFailed: A peer failed in this step.
        """
        self.tell(None)
        for p in list(self.inbox):
            if p in self.inbox:
                self.wait(self.inbox[p])
                self.check()
