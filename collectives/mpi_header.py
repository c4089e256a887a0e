"""The header of the MPI backend: the agreement check, sizes and small payloads in one
allgather (a layer of :class:`~plait.collectives.mpi.MPICommunicator`).

Every collective starts with one small allgather, the *header*: each rank's call
digest (the agreement check), a number (the rows of an allgather), the rank's role
(what a rank that called ``join`` does with the call, see
:mod:`plait.collectives.join`) and up to :data:`SLOT` bytes (alltoall splits; the
whole tensor of a small allreduce, reducescatter, broadcast, allgather or alltoall,
which is then finished locally: one message round instead of two). Ranks whose
digests differ raise :class:`~plait.errors.MismatchError`, every one of them.
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from plait.errors import MismatchError
from plait.protocols import Handle

from .base import Done, Pending
from .check import Call, mismatch
from .join import JOINED, OTHER, STEP
from .mpi_wait import MPIWaits

__all__ = ["HEAD", "MAX_PLANS", "SLOT", "Gathered", "MPIHeader", "Sig", "flat_bytes"]

#: Payload bytes the header carries (a small allreduce travels whole in it); with the
#: header's fields a multiple of 8 bytes, so that rows read in place as int64s.
SLOT = 1024
HEAD = 24  # digest, one number and the role (see plait.collectives.join), int64 each
_HEAD_FORMAT = struct.Struct("=3q")  # native int64s, as the rows are read back
_NUMBER = struct.Struct("=q")  # the header's number, at byte 8
#: In a header's first number, beside the 62-bit digest: this rank asks for the blocking
#: call (a blocking collective matches only blocking ones, see ``_blocks``).
_BLOCK = 1 << 62
_DIGEST = _BLOCK - 1
#: Plans kept per kind of call (a loop has a few dozen call signatures; forgotten all at
#: once beyond).
MAX_PLANS = 1024


def flat_bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of ``a`` as a flat uint8 array (a view when ``a`` is contiguous)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


@dataclass(eq=False)
class Sig:
    """A collective's call signature, with its header row made once (see ``MPIHeader._sig``)."""

    call: Call
    row: np.ndarray  # the header row: digest (and the block bit), role; number 0, no payload
    role: int
    what: str  # the call, for messages
    gathered: Gathered | None = None  # an allgather's last layout (the ranks' rows)


@dataclass(frozen=True)
class Gathered:
    """Where an allgather's parts go, for the ranks' numbers of rows ``numbers``."""

    numbers: list[int]
    counts: list[int]  # bytes from each rank
    fits: bool  # every rank's part came in the header
    even: bool  # every part is as long
    ring: bool  # plait's ring (else Open MPI's allgather)


class MPIHeader(MPIWaits):
    """The header layer of an MPI communicator (see the module's docstring): its
    per-signature rows and the announcements of gradient reducers' steps.

    Args:
        comm: the mpi4py communicator (default ``MPI.COMM_WORLD``).
        check: verify before each collective that all ranks make the same call.
        timeout: seconds a wait lasts at most.
    """

    def __init__(self, comm: Any = None, *, check: bool = True, timeout: float = 300.0) -> None:
        super().__init__(comm, check=check, timeout=timeout)
        self._sigs: dict[tuple[Any, ...], Sig] = {}  # see _sig
        # the last header rows checked and their leading numbers, read once (see _heads)
        self._checked: tuple[np.ndarray | None, list[list[int]]] = (None, [])
        self._joiners: list[weakref.WeakMethod[Any]] = []  # see serve_joined

    def _raw_allgather_bytes(self, data: np.ndarray) -> np.ndarray:
        data = flat_bytes(data)
        counts = np.empty(self.size, dtype=np.int64)
        self._poll(self.comm.Iallgather(np.array([data.size], dtype=np.int64), counts),
                   "an object allgather")
        out = np.empty(int(counts.sum()), dtype=np.uint8)
        self._poll(self.comm.Iallgatherv([data, MPI.BYTE], [out, counts, MPI.BYTE]),
                   "an object allgather")
        return out

    def _raw_bcast_bytes(self, data: np.ndarray | None, root: int) -> np.ndarray:
        n = np.array([0 if data is None else data.size], dtype=np.int64)
        self._poll(self.comm.Ibcast(n, root=root), "an object broadcast")
        out = flat_bytes(data).copy() if data is not None else np.empty(int(n[0]), np.uint8)
        self._poll(self.comm.Ibcast(out, root=root), "an object broadcast")
        return out

    def _verify(self, call: Call, payload: np.ndarray | None = None, role: int = OTHER) -> None:
        if self.check and self.size > 1:
            self._header(call, 0, payload, role)

    def _header(self, call: Call, number: int = 0, payload: np.ndarray | None = None,
                role: int = OTHER, block: bool = False) -> np.ndarray:
        """Allgather every rank's call digest, ``number``, ``role`` (what a rank that
        called :meth:`join` does with this call), whether it asks for the blocking call
        (``block``, see :meth:`_blocks`) and ``payload`` (at most :data:`SLOT` bytes);
        raise on every rank when the digests differ.

        Returns:
            One row per rank: ``[digest, number, role]`` as int64, then the payload bytes.

        Raises:
            MismatchError: when the ranks' calls differ (with the check on), or when
                some ranks joined and this call is not an allreduce.
            CollectiveTimeoutError: when the others do not arrive in time.
        """
        return self._header_row(call, self._row(call, number, role, payload, block), role)

    def _header_row(self, call: Call, row: np.ndarray, role: int) -> np.ndarray:
        """:meth:`_header` of a row made by :meth:`_row`."""
        req, rows = self._header_start(call, row)
        self._poll(req, "a collective")
        return self._header_check(call, rows, role)

    def _row(self, call: Call, number: int, role: int, payload: np.ndarray | None,
             block: bool = False) -> np.ndarray:
        """This rank's header row: the call's digest (and ``block``), ``number``, ``role``,
        ``payload``."""
        row = np.zeros(HEAD + SLOT, dtype=np.uint8)
        digest = call.digest() if self.check else 0
        _HEAD_FORMAT.pack_into(row.data, 0, digest | _BLOCK if block else digest, number, role)
        if payload is not None:
            row[HEAD : HEAD + payload.size] = payload
        return row

    def _sig(self, kind: str, shape: tuple[int, ...], dtype: str, op: str | None = None,
             root: int | None = None, name: str | None = None, block: bool = False,
             role: int = OTHER) -> Sig:
        """The :class:`Call` of a collective and its header row, kept per signature (a
        training loop repeats its calls; making them anew cost ~3 us of a small one).
        Allgather and alltoall are ragged (their first dimension may differ)."""
        key = (kind, shape, dtype, op, root, name, block, role, self.check)
        sig = self._sigs.get(key)
        if sig is None:
            call = Call(kind, shape, dtype, op=op, root=root, name=name,
                        ragged=kind in ("allgather", "alltoall"))
            if len(self._sigs) >= MAX_PLANS:
                self._sigs.clear()
            sig = self._sigs[key] = Sig(call, self._row(call, 0, role, None, block), role,
                                         call.describe())
        return sig

    def _head(self, sig: Sig, number: int = 0, *payload: np.ndarray | None) -> np.ndarray:
        """:meth:`_header` of the call of ``sig``, with ``number`` and the bytes of
        ``payload`` one after another (None: none)."""
        row = sig.row.copy()
        if number:
            _NUMBER.pack_into(row.data, 8, number)
        at = HEAD
        for part in payload:
            if part is not None:
                row[at : at + part.size] = part
                at += part.size
        return self._header_row(sig.call, row, sig.role)

    def _header_start(self, call: Call, row: np.ndarray) -> tuple[Any, np.ndarray]:
        """Start allgathering every rank's header ``row``; return the request and the rows."""
        self._call = call
        rows = np.empty((self.size, HEAD + SLOT), dtype=np.uint8)
        return self.comm.Iallgather(row, rows), rows

    def _header_check(self, call: Call, rows: np.ndarray, role: int) -> np.ndarray:
        # a few rows of three numbers: plain Python is faster than numpy here (every
        # collective passes through; measured ~5 us less per call)
        heads = rows.view(np.int64)[:, :3].tolist()
        self._checked = (rows, heads)
        first = heads[0][0] & _DIGEST
        if all(head[0] & _DIGEST == first and head[2] != JOINED for head in heads):
            return rows  # the usual case: one digest, nobody joined
        joined = [r for r, head in enumerate(heads) if head[2] == JOINED]
        digests = {head[0] & _DIGEST for head in heads if head[2] != JOINED}
        if self.check and len(digests) > 1:
            raise mismatch(call, self._raw_allgather_bytes,
                           f"the {self.backend} communicator of size {self.size}")
        if role == OTHER and joined:
            raise MismatchError(
                f"{self!r}: {call.describe()} while rank(s) {joined} have called join(); "
                "joined ranks only take part in allreduce (contributing zeros), as in Horovod")
        return rows

    def _blocks(self, rows: np.ndarray) -> bool:
        """Whether every rank that has not joined asked for the blocking call in its header
        row (``block``). MPI matches a blocking collective only with blocking ones: where
        one rank waits for an asynchronous collective (Horovod lets ranks mix
        ``allreduce`` and ``allreduce_async``), all take the nonblocking call. A joined
        rank's row always asks (it follows the others)."""
        return all(head[0] & _BLOCK for head in self._heads(rows))

    def _heads(self, rows: np.ndarray) -> list[list[int]]:
        """``[digest, number, role]`` of every rank's header row in ``rows``, as
        :meth:`_header_check` read them when it checked these rows (each read of a few
        numbers from numpy costs ~1 us)."""
        checked, heads = self._checked
        if checked is rows:
            return heads
        return rows.view(np.int64)[:, :3].tolist()  # type: ignore[no-any-return]

    def serve_joined(self, step: Callable[[], Any]) -> int:
        """Register a gradient reducer's step for ranks that joined (see :meth:`join`):
        a reducer that moves its buckets on a private unchecked communicator announces
        each step with :meth:`step_notice`, and a joined rank then runs ``step``
        (its own reducer's step with zero gradients). Ranks register in the same order.

        Args:
            step: a bound method (held weakly: a dropped reducer is forgotten).

        Returns:
            The key to pass to :meth:`step_notice`.
        """
        self._joiners.append(weakref.WeakMethod(step))  # type: ignore[arg-type]
        return len(self._joiners) - 1

    def step_notice(self, key: int) -> Handle:
        """Announce a step of the reducer registered as ``key`` to joined ranks (a
        header, not waited for here); wait for the handle before the step ends.

        Raises (from ``wait()``):
            MismatchError: when another rank made a different call meanwhile.
        """
        if self.size == 1 or not self.check:
            return Done(None)
        sig = self._sig("reducer step", (), "none", role=STEP)
        call, row = sig.call, sig.row.copy()
        _NUMBER.pack_into(row.data, 8, key)
        req, rows = self._header_start(call, row)
        # not driven by this communicator's progress thread (waking it during backward
        # cost ~0.5 ms a step, measured): MPI moves it inside the buckets' calls
        return Pending(req.Test, lambda: self._poll(req, "the announcement of a gradient "
                                                    "reducer's step"),
                       lambda: self._header_check(call, rows, STEP), rows)

