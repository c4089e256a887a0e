"""A posted point-to-point message of the MPI backend and its handle, in one object.

``MPICommunicator.send_async`` and ``recv_async`` return a :class:`Point`: the
mpi4py request, the buffers it must keep alive and what ``wait`` returns. Its
owner tests it (``done``, ``wait``): no progress thread, no lock, no closure per
message, and the words naming it (for a timeout's message) are made only when
a wait does not complete at once. A pipeline posts several of these per
micro-batch, so each microsecond here is one on its critical path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from plait.errors import MismatchError

if TYPE_CHECKING:
    from plait.adapters import TensorOps

    from .mpi import MPICommunicator

__all__ = ["Point"]


class Point:
    """One ``Isend`` or ``Irecv`` and its :class:`~plait.protocols.Handle`.

    An MPI error while it is tested (a message longer than the receive buffer) is
    kept for ``wait`` instead of escaping.

    Args:
        comm: The communicator (its timeout and waiting report bound ``wait``).
        req: The mpi4py request.
        peer: The other rank.
        tag: The message's tag.
        data: The numpy buffer MPI reads (a send) or writes (a receive).
        keep: The caller's tensor (a send's, kept alive until sent) or a receive's ``like``.
        ops: The adapter of ``keep``; None for a numpy array.
        receive: Whether this is a receive.
    """

    __slots__ = ("_comm", "_req", "peer", "tag", "_data", "_keep", "_ops", "_status", "error",
                 "complete", "_result", "_finished")

    def __init__(self, comm: MPICommunicator, req: Any, peer: int, tag: int, data: np.ndarray,
                 keep: Any, ops: TensorOps | None, receive: bool = False) -> None:
        self._comm, self._req, self.peer, self.tag = comm, req, peer, tag
        self._data: np.ndarray | None = data
        self._keep, self._ops = keep, ops
        self._status = MPI.Status() if receive else None
        self.error: Exception | None = None
        self.complete = False
        self._result: Any = None
        self._finished = False

    @property
    def what(self) -> str:
        """The message in words, e.g. ``a recv from rank 0 (tag 5) of 512 bytes``."""
        way = "a recv from" if self._status is not None else "a send to"
        nbytes = self._data.nbytes if self._data is not None else "?"
        return f"{way} rank {self.peer} (tag {self.tag}) of {nbytes} bytes"

    def progress(self) -> bool:
        """Test the request once (MPI moves its bytes); True once it completed."""
        if not self.complete:
            try:
                self.complete = bool(self._req.Test(self._status))
            except MPI.Exception as exc:
                self.error, self.complete = exc, True
        return self.complete

    def done(self) -> bool:
        return self._finished or self.progress()

    def wait(self) -> Any:
        """Wait for the message (bounded by the communicator's timeout); a receive's tensor.

        Raises:
            MismatchError: A received message's size differs from ``like``'s.
            CollectiveTimeoutError: It did not complete within the timeout.
        """
        if self._finished:
            return self._result
        comm = self._comm
        comm._calls += 1
        if not self.complete:
            seq, what = comm._calls, self.what
            comm._wait_until(self.progress, lambda: comm._timeout_report(what, seq), seq,
                             (self.peer, what))
        if self._status is not None and self._data is not None:
            self._result = self._received(self._data, self._status)
        self._finished = True
        self._keep = self._data = None
        return self._result

    def _received(self, data: np.ndarray, status: Any) -> Any:
        """The received tensor, like ``like`` (a numpy ``like``'s buffer has its dtype)."""
        got = "more" if self.error is not None else status.Get_count(MPI.BYTE)
        if got != data.nbytes:
            dtype = data.dtype.name if self._ops is None else self._ops.dtype_name(self._keep)
            raise MismatchError(
                f"{self._comm!r}: recv from rank {self.peer} (tag {self.tag}) expected "
                f"{data.nbytes} bytes (shape {data.shape}, {dtype}) "
                f"but the message has {got}")
        if self._ops is None:  # a numpy ``like``
            return data
        return self._ops.from_numpy(data, self._keep)
