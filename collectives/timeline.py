"""Observability around any communicator: a timeline and the stall inspector.

:func:`maybe_wrap` puts an :class:`ObservedCommunicator` around a communicator
when ``PLAIT_TIMELINE`` or ``PLAIT_STALL_WARNING`` is set, and returns it
unchanged otherwise (no cost at all when both are off). The proxy records
around each call, so backends stay untouched.

Timeline (``PLAIT_TIMELINE=path.json``): each rank streams Chrome trace events
(JSON array format, viewable in chrome://tracing or Perfetto) to
``path.json.rank<N>``; at exit rank 0 waits a little (``PLAIT_TIMELINE_MERGE_WAIT``
seconds, default 10) for the other parts and merges them into ``path.json`` with
one process per rank. ``python -m plait.collectives.timeline merge path.json``
merges afterwards (what ``plait run --timeline`` can call). Every collective is
one event named ``"<kind> <tensor name>"`` on a row per tensor name, from
enqueue (the call) to end (the result is ready); operations with a handle
(allreduce, allgather, broadcast, also in their sync forms) have two nested
events: ``submit`` (enqueue to start: the agreement check and handing the op
to the backend) and ``wait`` (from ``wait()`` to the end). ``args`` hold bytes, shape,
dtype, op, the call's sequence number and the enqueue/start/end times. Fused
gradient buckets appear under their names (``grad.0``, ``grad.1``...). Inside a
``tf.function`` a collective is recorded once, when the function is traced
(``args.traced``), not at every run.

On the MPI backend ``HOROVOD_TIMELINE`` (what ``horovodrun --timeline-filename``
sets) gets Horovod's own timeline layout instead, written by rank 0
(:mod:`plait.collectives.horovod_timeline`).

Stall inspector: see :mod:`plait.collectives.stall`.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from plait.errors import ConfigError, invalid
from plait.protocols import Communicator, Handle, Tensor

from .horovod_timeline import DYNAMIC, HorovodRecorder

__all__ = ["ObservedCommunicator", "Recorder", "horovod_recorder", "maybe_wrap", "merge",
           "prepare_env", "span"]

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1,
             "int16": 2, "uint16": 2, "int32": 4, "int64": 8, "bool": 1}


def _now_us() -> float:
    return time.time_ns() / 1e3


class Recorder:
    """One rank's timeline: Chrome trace events streamed to ``path.rank<N>``.

    Args:
        path: the merged timeline's path; this rank writes ``path.rank<rank>``.
        rank: this process's global rank (the trace's ``pid``).
        size: number of ranks (rank 0 merges that many parts at :meth:`close`).
    """

    _open: dict[str, Recorder] = {}

    def __init__(self, path: str, rank: int, size: int) -> None:
        self.path, self.rank, self.size = str(path), int(rank), int(size)
        self.part = Path(f"{self.path}.rank{self.rank}")
        self.part.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = open(self.part, "w")  # noqa: SIM115 (closed in close())
        self._file.write("[\n")
        self._lock = threading.Lock()
        self._lanes: dict[str, list[bool]] = {}
        self._tids: dict[tuple[str, int], int] = {}
        self._last_flush = time.monotonic()
        self.write({"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                    "args": {"name": f"rank {self.rank}"}})
        self.write({"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
                    "args": {"sort_index": self.rank}})
        atexit.register(self.close)

    @classmethod
    def for_path(cls, path: str, rank: int, size: int) -> Recorder:
        """The recorder of ``path`` in this process (one per path, shared by all communicators)."""
        rec = cls._open.get(path)
        if rec is None or rec._file is None:
            rec = cls._open[path] = cls(path, rank, size)
        return rec

    def write(self, event: dict[str, Any]) -> None:
        """Append one trace event (flushed to disk at least every second)."""
        with self._lock:
            if self._file is None:
                return
            self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")
            if time.monotonic() - self._last_flush > 1.0:
                self._file.flush()
                self._last_flush = time.monotonic()

    def lane(self, key: str) -> int:
        """A row (``tid``) for ``key`` that has no event in flight; release it with :meth:`release`."""
        with self._lock:
            busy = self._lanes.setdefault(key, [])
            for i, b in enumerate(busy):
                if not b:
                    busy[i] = True
                    return self._tids[(key, i)]
            busy.append(True)
            tid = len(self._tids) + 1
            self._tids[(key, len(busy) - 1)] = tid
        label = key if len(busy) == 1 else f"{key} #{len(busy)}"
        self.write({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                    "args": {"name": label}})
        self.write({"name": "thread_sort_index", "ph": "M", "pid": self.rank, "tid": tid,
                    "args": {"sort_index": tid}})
        return tid

    def release(self, key: str, tid: int) -> None:
        with self._lock:
            for (k, i), t in self._tids.items():
                if k == key and t == tid:
                    self._lanes[key][i] = False

    def complete(self, name: str, cat: str, tid: int, start: float, end: float,
                 args: dict[str, Any] | None = None) -> None:
        """A complete ("X") event from ``start`` to ``end`` (microseconds)."""
        ev: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": tid,
                              "ts": round(start, 3), "dur": round(max(end - start, 0.0), 3)}
        if args:
            ev["args"] = args
        self.write(ev)

    def finish(self, op: _Op, t_end: float) -> None:
        """Record the finished call ``op``: one event on its row, with ``submit`` and
        ``wait`` nested."""
        op.args.update(enqueue_us=round(op.t_enq, 3), start_us=round(op.t_start, 3),
                       end_us=round(t_end, 3))
        self.complete(op.label, "collective", op.tid, op.t_enq, t_end, op.args)
        if op.t_start > op.t_enq:
            self.complete("submit", "collective", op.tid, op.t_enq, op.t_start)
        if op.t_wait is not None:
            self.complete("wait", "collective", op.tid, max(op.t_wait, op.t_start), t_end)
        self.release(op.key, op.tid)

    def close(self) -> None:
        """Finish this rank's part; on rank 0 also merge every part into ``path``."""
        with self._lock:
            if self._file is None:
                return
            self._file.write(json.dumps({"name": "end", "ph": "i", "s": "p", "pid": self.rank,
                                         "tid": 0, "ts": round(_now_us(), 3)}) + "\n]\n")
            self._file.close()
            self._file = None
        if self.rank == 0:
            wait = float(os.environ.get("PLAIT_TIMELINE_MERGE_WAIT", "10"))
            merge(self.path, self.size, wait=wait)


def _read_part(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """Events of one rank's part and whether the part was closed (complete)."""
    text = path.read_text()
    complete = text.rstrip().endswith("]")
    body = text.strip().lstrip("[").rstrip("]").strip().rstrip(",")
    events = []
    for line in body.splitlines():
        line = line.strip().rstrip(",")
        if line:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                complete = False  # a torn last line of a rank that died
    return events, complete


def merge(path: str, size: int | None = None, wait: float = 0.0) -> Path:
    """Merge the parts ``path.rank<N>`` into one Chrome trace ``path`` and remove them.

    Args:
        path: the timeline's path.
        size: number of ranks expected (default: the parts found).
        wait: seconds to wait for missing or unfinished parts.

    Returns:
        The merged file's path. Its ``otherData.missing_ranks`` lists ranks whose
        part was missing or unfinished.
    """
    base = Path(path)
    deadline = time.monotonic() + wait

    def parts() -> dict[int, Path]:
        found = {}
        for p in base.parent.glob(base.name + ".rank*"):
            suffix = p.name[len(base.name) + 5:]
            if suffix.isdigit():
                found[int(suffix)] = p
        return found

    while True:
        found = parts()
        n = size if size is not None else len(found)
        done = {r: _read_part(p) for r, p in found.items()}
        if all(r in done and done[r][1] for r in range(n)) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    events = [e for r in sorted(done) for e in done[r][0]]
    timed = [e["ts"] for e in events if "ts" in e]
    origin = min(timed) if timed else 0.0
    for e in events:
        if "ts" in e:
            e["ts"] = round(e["ts"] - origin, 3)
    missing = [r for r in range(n) if r not in done or not done[r][1]]
    out = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"tool": "plait", "ranks": n, "origin_unix_us": origin,
                         "missing_ranks": missing}}
    tmp = base.with_name(base.name + ".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(base)
    for r, p in found.items():
        if r not in missing:
            p.unlink(missing_ok=True)
    return base


class span:  # noqa: N801 (used like a function: ``with span("forward 3"):``)
    """Record a block of work (e.g. a pipeline action) on the timeline, if one is on.

    Args:
        name: the event's name.
        cat: its category ("pipeline", "compute", ...).
        **args: shown with the event.
    """

    def __init__(self, name: str, cat: str = "compute", **args: Any) -> None:
        self.name, self.cat, self.args = name, cat, args
        self.rec = next(iter(Recorder._open.values()), None)

    def __enter__(self) -> span:
        if self.rec is not None:
            self.key = self.cat
            self.tid = self.rec.lane(self.key)
            self.t0 = _now_us()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.rec is not None:
            self.rec.complete(self.name, self.cat, self.tid, self.t0, _now_us(), self.args or None)
            self.rec.release(self.key, self.tid)


class _Op:
    """One collective in flight: its row, times and description."""

    __slots__ = ("args", "ended", "key", "kind", "label", "name", "rec", "t_enq", "t_start",
                 "t_wait", "tid")

    def __init__(self, rec: Recorder | HorovodRecorder | None, kind: str, name: str | None,
                 label: str, key: str, args: dict[str, Any]) -> None:
        self.rec, self.kind, self.name = rec, kind, name
        self.label, self.key, self.args = label, key, args
        self.tid = rec.lane(key) if rec is not None else 0
        self.t_enq = _now_us()
        self.t_start = self.t_enq
        self.t_wait: float | None = None
        self.ended = False

    def end(self) -> None:
        if self.ended or self.rec is None:
            self.ended = True
            return
        self.ended = True
        self.rec.finish(self, _now_us())


class _TracedHandle:
    """A handle that ends its timeline event when the result is ready."""

    def __init__(self, inner: Handle, op: _Op) -> None:
        self._inner, self._op = inner, op

    def wait(self) -> Any:
        if self._op.t_wait is None:
            self._op.t_wait = _now_us()
        result = self._inner.wait()
        self._op.end()
        return result

    def done(self) -> bool:
        return bool(self._inner.done())


def _describe(tensor: Tensor) -> dict[str, Any]:
    try:
        from plait.adapters import ops_for

        ops = ops_for(tensor)
        dtype = ops.dtype_name(tensor)
        shape = ops.shape(tensor)
        out: dict[str, Any] = {"dtype": dtype, "shape": list(shape)}
        if ops.is_symbolic(tensor):
            out["traced"] = True
        if all(isinstance(d, int) for d in shape):
            n = 1
            for d in shape:
                n *= d
            out["bytes"] = n * _ITEMSIZE.get(dtype, 4)
        return out
    except Exception:  # a type plait cannot handle: the communicator will raise the real error
        return {}


class ObservedCommunicator:
    """A :class:`~plait.protocols.Communicator` that records each call of ``inner``.

    Attributes other than the collectives (``rank``, ``size``, ``backend``,
    ``timeout``, ``check``...) are read from and written to ``inner``.

    Args:
        inner: the communicator doing the work.
        recorder: where timeline events go, or None.
        inspector: the stall inspector (:class:`plait.collectives.stall.StallInspector`), or None.
        cid: this communicator's identity, equal on all its ranks ("w" for the world).
        members: global ranks of the group, in group order (default: ``range(size)``).
    """

    def __init__(self, inner: Communicator, recorder: Recorder | HorovodRecorder | None = None,
                 inspector: Any = None, cid: str = "w",
                 members: Sequence[int] | None = None) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_rec", recorder)
        object.__setattr__(self, "_inspector", inspector)
        object.__setattr__(self, "_cid", cid)
        object.__setattr__(self, "_members", tuple(members) if members is not None
                           else tuple(range(inner.size)))
        object.__setattr__(self, "_seq", 0)
        object.__setattr__(self, "_splits", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def __repr__(self) -> str:
        return f"<observed {self._inner!r}>"

    @property
    def inner(self) -> Communicator:
        """The wrapped communicator."""
        return self._inner

    # -- recording ------------------------------------------------------------------------
    def _begin(self, kind: str, tensor: Tensor | None, name: str | None, **extra: Any) -> _Op:
        self._seq += 1
        label = kind if name is None else f"{kind} {name}"
        if self._inspector is not None:
            self._inspector.enter(self._cid, self._members, self._seq, label)
        args: dict[str, Any] = {"seq": self._seq, "backend": self._inner.backend}
        if self._cid != "w":
            args["comm"] = self._cid
        if name is not None:
            args["name"] = name
        args.update({k: v for k, v in extra.items() if v is not None})
        if tensor is not None and self._rec is not None:
            args.update(_describe(tensor))
            algorithm = getattr(self._inner, "algorithm", None)
            if algorithm is not None and "bytes" in args:
                args["algorithm"] = algorithm(kind, args["bytes"], args["dtype"])
        return _Op(self._rec, kind, name, label, name or kind, args)

    def _sync(self, op: _Op, call: Callable[[], Any]) -> Any:
        """A call with no handle: one event, no nested phases (start is not visible)."""
        try:
            result = call()
        finally:
            op.end()
        return result

    def _async(self, op: _Op, call: Callable[[], Handle]) -> Handle:
        try:
            handle = call()
        except BaseException:
            op.end()
            raise
        op.t_start = _now_us()
        return _TracedHandle(handle, op)

    # -- collectives -----------------------------------------------------------------------
    def allreduce_async(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Handle:
        rec = self._begin("allreduce", tensor, name, op=op)
        return self._async(rec, lambda: self._inner.allreduce_async(tensor, op, name))

    def allreduce(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Tensor:
        return self.allreduce_async(tensor, op, name).wait()

    def grouped_allreduce(self, tensors: Sequence[Tensor], op: str = "average",
                          name: str | None = None) -> list[Tensor]:
        rec = self._begin("grouped_allreduce", None, name, op=op, count=len(tensors))
        if self._rec is not None:
            rec.args["bytes"] = sum(_describe(t).get("bytes", 0) for t in tensors)
        return self._sync(rec, lambda: self._inner.grouped_allreduce(tensors, op, name))  # type: ignore[no-any-return]

    def group_allreduce_async(self, tensors: Sequence[Tensor], op: str = "average",
                              name: str | None = None) -> Handle | None:
        """A gradient bucket reduced as one group where the backend takes it (see
        ``HorovodCommunicator.group_allreduce_async``), recorded as one allreduce of
        ``name``; None (nothing recorded) where it does not."""
        group = getattr(self._inner, "group_allreduce_async", None)
        enqueued = _now_us()
        handle = group(tensors, op, name) if group is not None else None
        if handle is None:
            return None
        rec = self._begin("allreduce", None, name, op=op, count=len(tensors))
        if self._rec is not None:
            rec.args["bytes"] = sum(_describe(t).get("bytes", 0) for t in tensors)
        rec.t_enq, rec.t_start = enqueued, _now_us()
        return _TracedHandle(handle, rec)

    def allgather_async(self, tensor: Tensor, name: str | None = None) -> Handle:
        rec = self._begin("allgather", tensor, name)
        return self._async(rec, lambda: self._inner.allgather_async(tensor, name))

    def allgather(self, tensor: Tensor, name: str | None = None) -> Tensor:
        return self.allgather_async(tensor, name).wait()

    def broadcast_async(self, tensor: Tensor, root: int = 0, name: str | None = None) -> Handle:
        rec = self._begin("broadcast", tensor, name, root=root)
        return self._async(rec, lambda: self._inner.broadcast_async(tensor, root, name))

    def broadcast(self, tensor: Tensor, root: int = 0, name: str | None = None) -> Tensor:
        return self.broadcast_async(tensor, root, name).wait()

    def alltoall(self, tensor: Tensor, splits: Sequence[int] | None = None,
                 name: str | None = None) -> tuple[Tensor, list[int]]:
        rec = self._begin("alltoall", tensor, name)
        return self._sync(rec, lambda: self._inner.alltoall(tensor, splits, name))  # type: ignore[no-any-return]

    def reducescatter(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Tensor:
        rec = self._begin("reducescatter", tensor, name, op=op)
        return self._sync(rec, lambda: self._inner.reducescatter(tensor, op, name))

    def reducescatter_async(self, tensor: Tensor, op: str = "average",
                            name: str | None = None) -> Handle:
        rec = self._begin("reducescatter", tensor, name, op=op)
        return self._async(rec, lambda: self._inner.reducescatter_async(  # type: ignore[attr-defined]
            tensor, op, name))

    def barrier(self) -> None:
        rec = self._begin("barrier", None, None)
        self._sync(rec, self._inner.barrier)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        rec = self._begin("broadcast_object", None, None, root=root)
        return self._sync(rec, lambda: self._inner.broadcast_object(obj, root))

    def allgather_object(self, obj: Any) -> list[Any]:
        rec = self._begin("allgather_object", None, None)
        return self._sync(rec, lambda: self._inner.allgather_object(obj))  # type: ignore[no-any-return]

    # -- point to point (timeline only: not matched across ranks by the inspector) ------------
    def send(self, tensor: Tensor, dest: int, tag: int = 0) -> None:
        op = _Op(self._rec, "send", None, f"send to {dest}", f"send->{dest}", {"tag": tag, **(
            _describe(tensor) if self._rec is not None else {})})
        self._sync(op, lambda: self._inner.send(tensor, dest, tag))

    def recv(self, like: Tensor, source: int, tag: int = 0) -> Tensor:
        op = _Op(self._rec, "recv", None, f"recv from {source}", f"recv<-{source}", {"tag": tag, **(
            _describe(like) if self._rec is not None else {})})
        return self._sync(op, lambda: self._inner.recv(like, source, tag))

    # -- groups ---------------------------------------------------------------------------------
    def split(self, color: int, key: int = 0) -> ObservedCommunicator:
        """Split ``inner`` and observe the new group too."""
        self._splits += 1
        sub = self._inner.split(color, key)
        me = self._members[self._inner.rank]
        members = sub.allgather_object(me) if self._inspector is not None else None
        return ObservedCommunicator(sub, self._rec, self._inspector,
                                    f"{self._cid}/{self._splits}:{int(color)}", members)


def _seconds(env: Mapping[str, str], name: str) -> float:
    raw = env.get(name, "") or "0"
    try:
        value = float(raw)
    except ValueError:
        raise invalid(name, raw, "a number of seconds (0: off)") from None
    if value < 0:
        raise invalid(name, raw, "a number of seconds >= 0 (0: off)")
    return value


def prepare_env(backend: str, env: Any = None) -> None:
    """Before a Horovod communicator is built: pass ``PLAIT_STALL_WARNING`` /
    ``PLAIT_STALL_SHUTDOWN`` on to Horovod's own stall inspector
    (``HOROVOD_STALL_CHECK_TIME_SECONDS`` / ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``)
    unless those are set. Does nothing for other backends.

    Raises:
        ConfigError: when a setting is not a number of seconds.
    """
    env = os.environ if env is None else env
    if backend != "horovod":
        return
    for ours, theirs in (("PLAIT_STALL_WARNING", "HOROVOD_STALL_CHECK_TIME_SECONDS"),
                         ("PLAIT_STALL_SHUTDOWN", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")):
        value = _seconds(env, ours)
        if value > 0 and not env.get(theirs):
            env[theirs] = str(max(1, round(value)))


def _on(raw: str | None) -> bool:
    return (raw or "").strip().lower() in ("1", "true", "yes", "on")


def _stall_settings(env: Mapping[str, str], backend: str) -> tuple[float, float]:
    """``(warning, shutdown)`` seconds of the stall inspector (0: off): ``PLAIT_STALL_*``;
    on the MPI backend with ``PLAIT_STALL_WARNING`` unset, Horovod's warning
    (``HOROVOD_STALL_CHECK_TIME_SECONDS``, unless ``HOROVOD_STALL_CHECK_DISABLE``), which
    the Horovod backend leaves to Horovod. Horovod's shutdown time is not taken: past it
    Horovod fails the stalled operations and the ranks go on, where plait's shutdown
    ends the job."""
    warning = _seconds(env, "PLAIT_STALL_WARNING")
    shutdown = _seconds(env, "PLAIT_STALL_SHUTDOWN")
    if (backend == "mpi" and not env.get("PLAIT_STALL_WARNING")
            and not _on(env.get("HOROVOD_STALL_CHECK_DISABLE"))):
        warning = _seconds(env, "HOROVOD_STALL_CHECK_TIME_SECONDS")
    return warning, shutdown


def maybe_wrap(comm: Communicator, env: Mapping[str, str] | None = None) -> Communicator:
    """``comm`` observed as the environment asks, or ``comm`` itself when nothing is asked.

    Collective over ``comm`` when the stall inspector is on (it duplicates the MPI world).

    Args:
        comm: the world communicator just created by ``plait.init``.
        env: where to read ``PLAIT_TIMELINE``, ``PLAIT_STALL_WARNING`` and
            ``PLAIT_STALL_SHUTDOWN``, and on the MPI backend ``HOROVOD_TIMELINE``,
            ``HOROVOD_TIMELINE_MARK_CYCLES`` and ``HOROVOD_STALL_CHECK_*`` (Horovod's timeline, see
            :mod:`plait.collectives.horovod_timeline`; ``PLAIT_TIMELINE`` wins when both
            are set) (default ``os.environ``).

    Returns:
        An :class:`ObservedCommunicator`, or ``comm`` unchanged.

    Raises:
        ConfigError: when a setting is invalid.
    """
    env = os.environ if env is None else env
    path = env.get("PLAIT_TIMELINE", "")
    backend = getattr(comm, "backend", "")
    horovod = env.get("HOROVOD_TIMELINE", "") if backend == "mpi" and not path else ""
    warning, shutdown = _stall_settings(env, backend)
    if not path and not horovod and warning <= 0:
        return comm
    recorder: Recorder | HorovodRecorder | None = None
    if path:
        recorder = Recorder.for_path(path, comm.rank, comm.size)
    elif horovod:
        marks = _on(env.get("HOROVOD_TIMELINE_MARK_CYCLES"))
        recorder = HorovodRecorder(None if horovod == DYNAMIC else horovod, comm.rank, marks)
    inspector = None
    if warning > 0:
        from . import stall

        inspector = stall.StallInspector.create(comm, warning, shutdown)
    return ObservedCommunicator(comm, recorder, inspector)  # type: ignore[return-value]


def horovod_recorder(comm: Communicator) -> HorovodRecorder:
    """The recorder of Horovod's timeline observing ``comm`` (see :func:`maybe_wrap`),
    for ``hvd.start_timeline`` / ``hvd.stop_timeline`` on the MPI backend.

    Raises:
        ConfigError: (a ``ValueError``, as Horovod raises) when ``HOROVOD_TIMELINE`` was
            not set before ``init``.
    """
    rec = comm._rec if isinstance(comm, ObservedCommunicator) else None
    if not isinstance(rec, HorovodRecorder):
        raise ConfigError("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage "
                          "(before init; plait's own timeline is PLAIT_TIMELINE)")
    return rec


def _main(argv: Sequence[str]) -> int:
    if len(argv) >= 2 and argv[0] == "merge":
        size = int(argv[2]) if len(argv) > 2 else None
        print(merge(argv[1], size))
        return 0
    print("usage: python -m plait.collectives.timeline merge PATH [SIZE]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
