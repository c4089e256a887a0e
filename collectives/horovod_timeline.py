"""Horovod's timeline (``HOROVOD_TIMELINE``) on the MPI backend.

On the Horovod backend Horovod writes its own timeline. On the MPI backend a
script started as Horovod's are (``horovodrun --timeline-filename F`` or
``mpirun -x HOROVOD_TIMELINE=F``) gets the same file from plait: rank 0 streams
Chrome trace events to ``F`` in Horovod's layout, flushed after every
collective, so a tool (or a test) that reads Horovod timelines reads it:

- one trace process per tensor, named ``<op>.<name>`` (``allreduce.grad``;
  ``<op>.noname.<N>`` for an unnamed call), as Horovod names them;
- on it, ``NEGOTIATE_<OP>`` (from the call until plait's agreement check let it
  start) then ``<OP>`` (until the result is ready) with one nested activity
  naming how the bytes moved (``MPI_ALLREDUCE`` for Open MPI's own collective,
  ``RING_ALLREDUCE``, ``HIERARCHICAL_ALLREDUCE``, ``HEADER_ALLREDUCE`` for a
  tensor that travelled inside the agreement check); the end carries dtype and
  shape;
- with ``HOROVOD_TIMELINE_MARK_CYCLES=1`` a ``CYCLE_START`` instant before each
  collective: plait negotiates every collective on its own, so each is a cycle.

Differences from Horovod, which sees every worker through its coordinator: the
file holds rank 0's view only (no per-rank ticks under ``NEGOTIATE_*``), and a
collective inside a ``tf.function`` is recorded once, when it is traced.
``HOROVOD_TIMELINE=DYNAMIC`` starts with no file; ``hvd.start_timeline(path,
mark_cycles)`` and ``hvd.stop_timeline()`` open and close one, as in Horovod.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from typing import Any, TextIO

__all__ = ["DYNAMIC", "HorovodRecorder"]

#: The value of ``HOROVOD_TIMELINE`` that starts without a file (see :meth:`HorovodRecorder.start`).
DYNAMIC = "DYNAMIC"
#: plait's kinds of call -> Horovod's op names (point-to-point calls are not in Horovod's timeline).
_OPS = {"allreduce": "allreduce", "grouped_allreduce": "allreduce", "allgather": "allgather",
        "allgather_object": "allgather", "broadcast": "broadcast",
        "broadcast_object": "broadcast", "alltoall": "alltoall",
        "reducescatter": "reducescatter", "barrier": "barrier"}


class HorovodRecorder:
    """Writes Horovod's timeline layout on rank 0 (other ranks write nothing).

    Used by :class:`plait.collectives.timeline.ObservedCommunicator` in place of
    its own per-rank recorder.

    Args:
        path: the file, or None (or :data:`DYNAMIC`) to start without one.
        rank: this process's global rank.
        mark_cycles: write a ``CYCLE_START`` instant before each collective.
    """

    def __init__(self, path: str | None, rank: int, mark_cycles: bool = False) -> None:
        self.rank = int(rank)
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        self._origin = 0.0
        self._pids: dict[str, int] = {}
        self._nonames = 0
        self.mark_cycles = False
        atexit.register(self.stop)
        if path and path != DYNAMIC:
            self.start(path, mark_cycles)

    @property
    def active(self) -> bool:
        """Whether a file is being written (on this rank)."""
        return self._file is not None

    def start(self, path: str, mark_cycles: bool = False) -> None:
        """Start writing ``path`` (rank 0; other ranks only note ``mark_cycles``), ending
        any file being written.

        Args:
            path: the timeline file.
            mark_cycles: write ``CYCLE_START`` instants.
        """
        self.stop()
        with self._lock:
            self.mark_cycles = bool(mark_cycles)
            if self.rank != 0:
                return
            self._origin = time.time_ns() / 1e3
            self._pids = {}
            self._file = open(path, "w")  # noqa: SIM115 (closed in stop())
            self._file.write("[\n")
            self._event({"name": "process_name", "ph": "M", "pid": 0,
                         "args": {"start_time_since_epoch_in_micros": int(self._origin)}})
            self._event({"name": "process_sort_index", "ph": "M", "pid": 0,
                         "args": {"sort_index": 0}})
            self._file.flush()

    def stop(self) -> None:
        """Close the file (a valid JSON array); nothing when none is open."""
        with self._lock:
            if self._file is None:
                return
            self._file.write(json.dumps({"name": "end", "ph": "i", "s": "g",
                                         "ts": self._ts(time.time_ns() / 1e3)}) + "\n]\n")
            self._file.close()
            self._file = None

    # -- the recorder interface of ObservedCommunicator ---------------------------------------
    def lane(self, key: str) -> int:
        """Rows are per tensor here: always 0."""
        return 0

    def release(self, key: str, tid: int) -> None:
        """Nothing to release (see :meth:`lane`)."""

    def finish(self, call: Any, t_end: float) -> None:
        """Record one finished call.

        Args:
            call: the call (its ``kind``, ``name``, ``t_enq``, ``t_start`` in microseconds
                since the epoch, and ``args``: dtype, shape, algorithm...).
            t_end: when its result was ready.
        """
        kind, name, args = call.kind, call.name, call.args
        t_enq, t_start = call.t_enq, call.t_start
        op = _OPS.get(kind)
        if op is None or self._file is None:
            return
        with self._lock:
            if self._file is None:
                return
            if name is None:
                self._nonames += 1
                name = f"noname.{self._nonames}"
            tensor = f"{op}.{name}"
            pid = self._pids.get(tensor)
            if pid is None:
                pid = self._pids[tensor] = len(self._pids) + 1
                self._event({"name": "process_name", "ph": "M", "pid": pid,
                             "args": {"name": tensor}})
                self._event({"name": "process_sort_index", "ph": "M", "pid": pid,
                             "args": {"sort_index": pid}})
            upper = op.upper()
            start = max(t_start, t_enq)
            if self.mark_cycles:
                self._event({"ph": "i", "name": "CYCLE_START", "ts": self._ts(t_enq), "s": "g"})
            self._event({"ph": "B", "name": f"NEGOTIATE_{upper}", "ts": self._ts(t_enq), "pid": pid})
            self._event({"ph": "E", "ts": self._ts(start), "pid": pid})
            self._event({"ph": "B", "name": upper, "ts": self._ts(start), "pid": pid})
            algorithm = args.get("algorithm")
            if algorithm:
                self._event({"ph": "B", "name": f"{str(algorithm).upper()}_{upper}",
                             "ts": self._ts(start), "pid": pid})
                self._event({"ph": "E", "ts": self._ts(t_end), "pid": pid})
            end: dict[str, Any] = {"ph": "E", "ts": self._ts(t_end), "pid": pid}
            if "dtype" in args:
                end["args"] = {"dtype": args["dtype"], "shape": str(list(args.get("shape", [])))}
            self._event(end)
            self._file.flush()

    # -- helpers ------------------------------------------------------------------------------
    def _ts(self, t_us: float) -> int:
        return max(0, int(t_us - self._origin))

    def _event(self, event: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")
