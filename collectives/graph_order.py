"""Collectives inside a TensorFlow graph, run in an order every rank agrees on.

TensorFlow's executor runs independent ops in any order, and in several threads
at once (a TF1 session does). A host op that calls a collective directly would
then pair with a different collective on another rank (``MPI_ERR_TRUNCATE``,
then a hang). Two mechanisms, chosen per op when the graph is built:

* *Build order.* The TensorFlow adapter chains plait's host ops of a graph in the
  order they were built: by control dependencies in a TF1 ``tf.Graph``, by a token
  passed from each host op to the next in a ``tf.function``. Every rank
  then runs them in the same order, with no extra message (the default for these
  ops; a mismatch is caught by the collective's own agreement check).
* *Negotiation by key* (Horovod's coordinator), for ops whose graph does not fix
  the order (a ``tf.cond`` branch inside a TF1 graph), or for every graph op with
  ``PLAIT_GRAPH_ORDER=negotiate`` (graphs run concurrently by several threads).
  Each host op has a *key* fixed when the graph is built (outermost graph name
  and position, the same on every rank that builds the same graph); its host
  call announces the key and waits: the ranks exchange the keys they have ready
  (one small allgather, a *negotiation round*), run every collective ready on all
  ranks, in rank 0's order, and hand each result to the host call waiting for it.
  There is no coordinator thread: a waiting host call runs the rounds itself (one
  thread at a time), and a round also runs the collectives other threads wait
  for. A rank joins a round only while it has collectives waiting, so rounds pair
  up like any collective. When every rank has collectives waiting but none is
  waiting on all of them for :func:`mismatch_seconds` seconds (different graphs,
  or host calls blocked in different collectives holding every executor thread),
  every waiting host call raises :class:`~plait.errors.MismatchError` on every
  rank, naming what each rank waits for. Ranks decide from the exchanged rows
  only, so they decide alike.

Framework-free and MPI-free: the MPI backend supplies the exchange (an allgather
on its ring communicator, bounded by its timeout); the TensorFlow adapter
supplies the keys.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from plait.errors import MismatchError

__all__ = ["MISMATCH_S", "ROW", "Coordinator", "OrderedCall", "graph_key", "graph_order",
           "mismatch_seconds", "ordered"]

#: int64 entries of a negotiation row: count, flags, then up to ``ROW - 2`` keys.
ROW = 128
#: Default seconds every rank may wait with no collective ready on all ranks before
#: the waiting ones raise :class:`~plait.errors.MismatchError` (``PLAIT_GRAPH_MISMATCH_S``).
MISMATCH_S = 5.0
_STALLED = 1  # flag: this rank has waited MISMATCH_S with nothing in common
_NAP_S = 5e-4  # pause between rounds that found nothing to run


def mismatch_seconds() -> float:
    """``PLAIT_GRAPH_MISMATCH_S`` or :data:`MISMATCH_S`.

    Raises:
        ConfigError: for a value that is not a positive number.
    """
    from plait.errors import invalid

    raw = os.environ.get("PLAIT_GRAPH_MISMATCH_S")
    if raw is None:
        return MISMATCH_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise invalid("PLAIT_GRAPH_MISMATCH_S", raw, "a positive number of seconds")
    return value


def graph_order() -> str:
    """``PLAIT_GRAPH_ORDER``: "auto" (default: negotiate the order of graph collectives
    only where the graph does not already run them in build order) or "negotiate"
    (every graph collective; for graphs run concurrently by several threads).

    Raises:
        ConfigError: for another value.
    """
    from plait.errors import invalid

    value = os.environ.get("PLAIT_GRAPH_ORDER", "auto").strip().lower() or "auto"
    if value not in ("auto", "negotiate"):
        raise invalid("PLAIT_GRAPH_ORDER", value, "'auto' or 'negotiate'")
    return value


def graph_key(graph_name: str, index: int) -> int:
    """The key of the ``index``-th collective host op built in the graph ``graph_name``:
    a 62-bit number, equal on every rank that builds the same graph."""
    h = hashlib.blake2b(f"{graph_name}\0{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 62) - 1)


class _Slot:
    """One host call waiting for its collective."""

    def __init__(self, key: int, thunk: Callable[[], Any], what: str) -> None:
        self.key, self.thunk, self.what = key, thunk, what
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None


class Coordinator:
    """Agrees with the other ranks on the order of keyed collectives and runs them.

    Args:
        exchange: allgather of one int64 row of :data:`ROW` entries; returns
            ``(size, ROW)`` rows in rank order (a collective over the group).
        size: ranks in the group.
        where: the group, named in errors.
        mismatch_s: see :func:`mismatch_seconds`.
    """

    def __init__(self, exchange: Callable[[np.ndarray], np.ndarray], size: int, where: str,
                 mismatch_s: float | None = None) -> None:
        self._exchange, self.size, self.where = exchange, int(size), where
        self.mismatch_s = mismatch_seconds() if mismatch_s is None else float(mismatch_s)
        self._pending: dict[int, _Slot] = {}  # insertion order = this rank's order
        self._lock = threading.Lock()  # guards _pending
        self._round = threading.Lock()  # one negotiation (and its collectives) at a time
        self._stall_since: float | None = None
        self.rounds = 0  # negotiation rounds so far (tests and profiling)

    def run(self, key: int, thunk: Callable[[], Any], what: str = "a collective") -> Any:
        """Run ``thunk`` (a collective) once every rank is ready to run key ``key``.

        Args:
            key: the op's key (:func:`graph_key`), equal on every rank.
            thunk: runs the collective; called in the agreed order, maybe in another
                thread waiting here.
            what: the op, named if the ranks never agree.

        Returns:
            What ``thunk`` returned.

        Raises:
            MismatchError: when the ranks wait for different collectives, or
                ``thunk`` raised it.
            Exception: whatever ``thunk`` raised.
        """
        slot = _Slot(int(key), thunk, what)
        while True:  # the same key twice on this rank (two runs of a graph): one at a time
            with self._lock:
                if slot.key not in self._pending:
                    self._pending[slot.key] = slot
                    break
            time.sleep(_NAP_S)
        while not slot.done:
            with self._round:
                if not slot.done:
                    self._negotiate()
        if slot.error is not None:
            raise slot.error
        return slot.result

    def _negotiate(self) -> None:
        """One round: exchange ready keys, run the common ones (or fail on a mismatch)."""
        with self._lock:
            mine = list(self._pending.values())[: ROW - 2]
        now = time.monotonic()
        stalled = self._stall_since is not None and now - self._stall_since > self.mismatch_s
        row = np.zeros(ROW, dtype=np.int64)
        row[0], row[1] = len(mine), _STALLED if stalled else 0
        row[2 : 2 + len(mine)] = [s.key for s in mine]
        rows = np.asarray(self._exchange(row)).reshape(self.size, ROW)
        self.rounds += 1
        keys = [rows[r, 2 : 2 + int(rows[r, 0])].tolist() for r in range(self.size)]
        others = [set(k) for k in keys[1:]]
        agreed = [k for k in keys[0] if all(k in s for s in others)]
        if agreed:
            self._stall_since = None
            for key in agreed:
                with self._lock:
                    slot = self._pending.pop(key)
                self._execute(slot)
            return
        if (rows[:, 1] & _STALLED).any():
            self._stall_since = None
            self._fail(mine)
            return
        if self._stall_since is None:
            self._stall_since = now
        time.sleep(_NAP_S)

    @staticmethod
    def _execute(slot: _Slot) -> None:
        try:
            slot.result = slot.thunk()
        except BaseException as exc:  # handed to the waiting host call
            slot.error = exc
        slot.done = True

    def _fail(self, mine: list[_Slot]) -> None:
        """Every rank: exchange what each waits for and fail those host calls."""
        text = "; ".join(s.what for s in mine).encode()[: ROW * 8]
        row = np.zeros(ROW * 8, dtype=np.uint8)
        row[: len(text)] = np.frombuffer(text, dtype=np.uint8)
        rows = np.asarray(self._exchange(row.view(np.int64))).reshape(self.size, ROW)
        lines = [f"  rank {r}: " + bytes(rows[r].view(np.uint8)).rstrip(b"\0").decode(errors="replace")
                 for r in range(self.size)]
        error = MismatchError(
            f"ranks of {self.where} wait for different collectives inside a TensorFlow graph "
            f"(none was ready on every rank for {self.mismatch_s:g}s: different graphs, "
            "different collectives, or a rank that skipped one); waiting:\n" + "\n".join(lines))
        with self._lock:
            for slot in mine:
                self._pending.pop(slot.key, None)
                slot.error = error
                slot.done = True


class OrderedCall:
    """A host function whose collective runs in the order the ranks agree on.

    The framework adapter calls :meth:`bind` while it builds the graph op (giving the
    op's key and name); an unbound call runs its function directly.

    Args:
        fn: the host function (runs the collective on numpy arrays).
        coordinator: gives the coordinator of the communicator, on first use (None: a
            backend that orders collectives itself; the call only gets a key).
        group: the communicator the collective runs on.
    """

    def __init__(self, fn: Callable[..., Any],
                 coordinator: Callable[[], Coordinator] | None, group: object = None) -> None:
        self.fn, self._coordinator = fn, coordinator
        self.group = group  # the communicator: a TF1 graph chains each one's ops apart
        self.key: int | None = None
        self.label = "a collective"
        self.negotiate = True

    def bind(self, key: int, label: str, in_order: bool = False) -> None:
        """Fix this op's key (:func:`graph_key`), its name in errors, and whether its
        graph runs such ops in the order they were built on every rank (then, unless
        ``PLAIT_GRAPH_ORDER=negotiate``, it needs no negotiation round)."""
        self.key, self.label = int(key), label
        self.negotiate = not in_order or graph_order() == "negotiate"

    def __call__(self, *arrays: Any) -> Any:
        if self.key is None or self._coordinator is None or not self.negotiate:
            return self.fn(*arrays)
        shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in arrays if hasattr(a, "shape"))
        return self._coordinator().run(self.key, lambda: self.fn(*arrays),
                                       f"{self.label}({shapes})")


_COORDINATORS: dict[int, Coordinator] = {}
_CREATE = threading.Lock()


def _exchange_for(comm: Any) -> Callable[[np.ndarray], np.ndarray]:
    """The negotiation allgather of ``comm``: on the MPI backend one nonblocking
    allgather on its ring communicator (which carries no other collective), bounded by
    the communicator's timeout; elsewhere the backend's raw byte allgather."""
    size = comm.size
    mpi = getattr(comm, "_ring_comm", None)
    if mpi is not None and hasattr(comm, "_poll"):
        def exchange(row: np.ndarray) -> np.ndarray:
            rows = np.empty((size, row.size), dtype=np.int64)
            comm._poll(mpi.Iallgather(np.ascontiguousarray(row), rows),
                       "the agreement on the order of collectives in a TensorFlow graph")
            return rows
        return exchange

    def gather_bytes(row: np.ndarray) -> np.ndarray:
        out = comm._raw_allgather_bytes(np.ascontiguousarray(row).view(np.uint8))
        return np.asarray(out).view(np.int64).reshape(size, -1)
    return gather_bytes


def coordinator_of(comm: Any) -> Coordinator:
    """The coordinator of ``comm`` (one per communicator, made on first use)."""
    with _CREATE:
        found = _COORDINATORS.get(id(comm))
        if found is None or getattr(found, "_comm", None) is not comm:
            found = Coordinator(_exchange_for(comm), comm.size, repr(comm))
            found._comm = comm  # type: ignore[attr-defined]  # keeps id(comm) from being reused
            _COORDINATORS[id(comm)] = found
        return found


def ordered(comm: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a graph op's host function running a collective on ``comm``) wrapped so
    that its collective runs in the order all ranks agree on (on a backend with its
    own ordering, Horovod's coordinator, the call is only keyed, which makes a TF1
    graph chain it); ``fn`` itself for a group of one.

    Args:
        comm: the communicator.
        fn: the host function.

    Returns:
        An :class:`OrderedCall` (the adapter binds its key while building the op), or ``fn``.
    """
    if comm.size < 2:
        return fn
    if getattr(comm, "backend", None) != "mpi":
        return OrderedCall(fn, None, comm)  # keyed (a TF1 graph chains it), run directly
    return OrderedCall(fn, lambda: coordinator_of(comm), comm)
