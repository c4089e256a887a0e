"""One runtime that executes a pipeline schedule for any framework.

The schedule (:mod:`plait.parallel.pipeline.schedule`) says, per rank, which
forward, backward, send and receive to run in which order. :func:`run_schedule`
interprets one rank's list: compute goes to a per-chunk :class:`StageExecutor`
(framework glue in ``plait.adapters.torch_pipeline`` and
``plait.adapters.keras_pipeline``), messages go through the pipeline
communicator's ``send``/``recv``. Nothing here imports a framework.

Wire format
    See :mod:`.wire`: activations and gradients travel as numpy arrays; the
    sender of stage ``s`` describes the shape and dtype of its activations in a
    small header once per step, with micro-batch 0.

Nonblocking messages
    In the steady state of 1F1B neighbouring ranks send to each other at the
    same time, so blocking (rendezvous) sends deadlock (the simulator shows
    it). Sends are therefore posted without waiting (the communicator's
    ``send_async``) and waited for at the end of the step. Receives are posted
    ahead: each step starts by posting the headers' receives, and before every
    action the next :data:`RECV_AHEAD` receives of the rank's action list are
    posted (as soon as their shape is known), so a message moves while its
    receiver still computes and a receive action mostly finds its data there.
    Every message has its own tag ``(family, stage, micro-batch)``, so the
    order in which ranks post receives never matters. Nothing is agreed per
    message: there is no collective inside a step.

Timeline
    With ``PLAIT_TIMELINE`` set (see :mod:`plait.collectives.timeline`) every
    action of a step (forward, backward, send and receive) is one event of
    category ``"pipeline"`` named after the action, e.g.
    ``forward(mb=0, stage=1)``, with its kind, stage, micro-batch and peer;
    :meth:`Runtime.forward_only` records one ``infer(stage=s)`` event per stage.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from plait.collectives.timeline import Recorder, span
from plait.protocols import Communicator

from .errors import PipelineError, StageFailed
from .schedule import Action, ActionKind
from .wire import HEADER_LEN, Notices, Wire, header, template, to_numpy

__all__ = ["MAX_TAG", "RECV_AHEAD", "StageExecutor", "StepStats", "run_schedule", "run_forward",
           "message_tag"]

#: The MPI standard guarantees tags up to 32767.
MAX_TAG = 32767
#: Receives posted ahead of the action that consumes them (each holds one buffer).
RECV_AHEAD = 2
#: Sends in flight before a compute action forgets the oldest completed ones.
REAP_AFTER = 4
_ACT, _GRAD, _HEAD, _NOTICE = 0, 1, 2, 3


class StageExecutor(Protocol):
    """One model chunk (a virtual stage) on this rank, seen by the runtime.

    ``forward`` keeps what ``backward`` needs for that micro-batch (the
    autograd graph, a gradient tape, or only the input when recomputing).
    Inputs may be numpy arrays or the framework's tensors; outputs and input
    gradients are the framework's tensors. An executor with an attribute
    ``progress`` gets it set by the runtime, where the pipeline crosses hosts, to a
    callable that lets the messages in flight move (:meth:`.wire.Wire.progress`):
    call it between layers.
    """

    def forward(self, mb: int, x: Any, target: Any | None = None) -> Any:
        """Run micro-batch ``mb``; return the output, or on the last stage the loss (float)."""
        ...

    def backward(self, mb: int, grad: Any | None) -> Any | None:
        """Backpropagate ``grad`` (None on the last stage: the loss); return the input
        gradient (None on the first stage) and accumulate parameter gradients."""
        ...

    def infer(self, x: Any) -> Any:
        """Forward without keeping anything for backward (evaluation mode)."""
        ...


@dataclass
class StepStats:
    """Timers of one rank for one pipeline step.

    Attributes:
        wall: Seconds from the first action of the schedule to the end of its sends.
        busy: Seconds in forward and backward compute.
        forward: Seconds in forward compute.
        backward: Seconds in backward compute.
        send: Seconds spent posting sends (copying to host buffers included).
        wait: Seconds waiting for messages: receive actions, and the sends
            still in flight at the end of the schedule (``wall - busy - send - wait``
            is the runtime's own bookkeeping).
        peak_live: Largest number of (stage, micro-batch) activations alive
            (forward done, backward not yet) on this rank.
        spans: ``(start, end, "F"|"B", stage, microbatch)`` per compute action,
            times relative to the start of the step.
    """

    wall: float = 0.0
    busy: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    send: float = 0.0
    wait: float = 0.0
    peak_live: int = 0
    spans: list[tuple[float, float, str, int, int]] = field(default_factory=list)


def message_tag(family: int, stage: int, mb: int, stages: int, microbatches: int) -> int:
    """The MPI tag of one message: unique per (family, stage, micro-batch) in a step."""
    return 1 + (family * stages + stage) * microbatches + mb


def check_tags(stages: int, microbatches: int) -> None:
    """Raise when ``stages x microbatches`` needs more tags than MPI guarantees.

    Raises:
        PipelineError: ``3 * stages * microbatches + 1 > MAX_TAG``.
    """
    if message_tag(_NOTICE, 0, 0, stages, microbatches) > MAX_TAG:
        raise PipelineError(
            f"microbatches x virtual stages is too large for MPI tags: "
            f"microbatches={microbatches}, stages={stages}; need "
            f"3 * stages * microbatches < {MAX_TAG}"
        )


class Runtime:
    """Executes schedules of one pipeline rank through its executors and a communicator.

    Args:
        comm: The pipeline communicator (rank ``r`` runs stages ``r, r+P, ...``).
        executors: Executor of each virtual stage this rank runs, by stage.
        stages: Number of virtual stages ``V``.
        microbatches: Micro-batches per step ``M``.

    Raises:
        PipelineError: ``3 * V * M`` tags do not fit MPI's tag range.
    """

    def __init__(self, comm: Communicator, executors: dict[int, StageExecutor], stages: int,
                 microbatches: int) -> None:
        check_tags(stages, microbatches)
        self.comm, self.executors = comm, executors
        self.stages, self.microbatches = stages, microbatches
        self.wire = Wire(comm, 2 * stages * microbatches + 2)
        peers = [r for r in range(comm.size) if r != comm.rank]
        self.notices = Notices(self.wire, peers, message_tag(_NOTICE, 0, 0, stages, microbatches))
        self.broken = ""
        if self.wire.crosses_hosts:  # stages that can, let messages move during their compute
            for ex in executors.values():
                if hasattr(ex, "progress"):
                    ex.progress = self.wire.progress  # type: ignore[attr-defined]

    def _tag(self, family: int, stage: int, mb: int) -> int:
        return message_tag(family, stage, mb, self.stages, self.microbatches)

    def run(self, actions: Sequence[Action], inputs: Sequence[Any] | None,
            targets: Sequence[Any] | None) -> tuple[list[float], StepStats]:
        """Run one rank's action list for one step.

        Args:
            actions: This rank's actions, in order.
            inputs: The micro-batches of the model input (needed where stage 0 runs).
            targets: The micro-batches of the target (needed where the last stage runs).

        Returns:
            The loss of each micro-batch (empty unless this rank runs the last
            stage) and this rank's timers.

        Raises:
            PipelineError: An action names a stage this rank does not hold, or an
                earlier step failed half-way (its messages may still be in flight).
            StageFailed: A forward or backward raised, on this rank (the original
                error is its cause; the other pipeline ranks are told) or on another.
            CollectiveTimeoutError: A message did not arrive in time.
            MismatchError: A message had another size than expected.
        """
        if self.broken:
            raise PipelineError(
                f"an earlier step of this pipeline failed half-way ({self.broken}); its messages "
                f"may still be in flight, so build a new Pipeline")
        self.notices.open()
        try:
            step = _Step(self, actions)
            losses = step.execute(inputs, targets)
            start = time.perf_counter()
            self.wire.flush(self.notices.wait)
            step.stats.wait += time.perf_counter() - start
            step.stats.wall += time.perf_counter() - start
            self.notices.finish()
            self.wire.receiving.clear()
        except BaseException as exc:
            self.wire.pending.clear()
            self.wire.receiving.clear()
            self.broken = f"{type(exc).__name__}: {exc}"[:300]
            if not (isinstance(exc, StageFailed) and exc.remote):
                self.notices.tell(f"{type(exc).__name__}: {exc}")
            raise
        return losses, step.stats

    def forward_only(self, x: Any, ranks: int) -> Any:
        """Run the whole model forward on one batch without keeping activations.

        Args:
            x: The input batch (used where stage 0 runs).
            ranks: Number of pipeline ranks ``P`` (stage ``s`` runs on rank ``s % P``).

        Returns:
            The model output on the rank running the last stage, None elsewhere.
        """
        out: Any = None
        for s in range(self.stages):
            if s not in self.executors:
                continue
            if s > 0 and s - 1 not in self.executors:
                src = (s - 1) % ranks
                head = self.comm.recv(np.zeros(HEADER_LEN, dtype=np.int64), src,
                                      self._tag(_HEAD, s - 1, 0))
                out = self.comm.recv(template(head), src, self._tag(_ACT, s - 1, 0))
            elif s == 0:
                out = x
            with span(f"infer(stage={s})", "pipeline", kind="infer", stage=s):
                out = self.executors[s].infer(out)
            if s + 1 < self.stages and s + 1 not in self.executors:
                arr = to_numpy(out)
                self.wire.send(header(arr), (s + 1) % ranks, self._tag(_HEAD, s, 0))
                self.wire.send(arr, (s + 1) % ranks, self._tag(_ACT, s, 0))
        self.wire.flush()
        return out if self.stages - 1 in self.executors else None

    def executor(self, stage: int) -> StageExecutor:
        """The executor of ``stage``.

        Raises:
            PipelineError: This rank does not hold ``stage``.
        """
        ex = self.executors.get(stage)
        if ex is None:
            raise PipelineError(
                f"the schedule runs stage {stage} on this rank, which holds stages "
                f"{sorted(self.executors)}")
        return ex

    def close(self) -> None:
        """Release the sender threads."""
        self.wire.close()


class _Step:
    """One step of one rank: the state that :meth:`Runtime.run` threads through its actions."""

    def __init__(self, rt: Runtime, actions: Sequence[Action]) -> None:
        self.rt, self.actions, self.wire = rt, actions, rt.wire
        self.last = rt.stages - 1
        self.acts: dict[tuple[int, int], Any] = {}     # input of (stage, mb)
        self.grads: dict[tuple[int, int], Any] = {}    # output gradient of (stage, mb)
        self.outbox: dict[tuple[int, int], Any] = {}   # tensor to send for (stage, mb)
        self.like: dict[int, np.ndarray] = {}          # an activation this rank sent, by stage
        self.meta: dict[int, np.ndarray] = {}          # activation template received, by stage
        self.heads: dict[int, Any] = {}                # header receive in flight, by stage
        self.posted: dict[int, Any] = {}               # receive in flight, by action index
        self.recvs = [i for i, a in enumerate(actions) if a.kind.is_recv]
        self.next_recv = 0                             # first entry of recvs not posted yet
        self.losses: dict[int, float] = {}
        self.stats = StepStats()
        self.live = 0
        self.failed_input: Any = None                  # input of the forward running now
        for a in actions:
            if a.kind is ActionKind.RECV_ACT and a.stage not in self.heads:
                self.heads[a.stage] = self.wire.recv(np.zeros(HEADER_LEN, dtype=np.int64),
                                                     _peer(a), rt._tag(_HEAD, a.stage - 1, 0))

    # -- receives posted ahead ---------------------------------------------------------
    def _template(self, a: Action, block: bool) -> np.ndarray | None:
        """What the message of recv action ``a`` looks like, or None while unknown."""
        if a.kind is ActionKind.RECV_GRAD:
            return self.like.get(a.stage)
        if a.stage not in self.meta:
            head = self.heads[a.stage]
            if not block and not head.done():
                return None
            self.meta[a.stage] = template(self.rt.notices.wait(head))
        return self.meta[a.stage]

    def _post(self, until: int, block: bool) -> None:
        """Post receives in action order: through action index ``until`` (waiting for a
        header if needed) or, with ``block=False``, while at most RECV_AHEAD are posted."""
        while self.next_recv < len(self.recvs):
            i = self.recvs[self.next_recv]
            if i > until and (block or len(self.posted) >= RECV_AHEAD):
                return
            a = self.actions[i]
            like = self._template(a, block and i <= until)
            if like is None:
                if block and i <= until:
                    raise PipelineError(f"{a} comes before any send_act of stage {a.stage} on this rank")
                return
            family, src = (_ACT, a.stage - 1) if a.kind is ActionKind.RECV_ACT else (_GRAD, a.stage + 1)
            self.posted[i] = self.wire.recv(like, _peer(a), self.rt._tag(family, src, a.microbatch))
            self.next_recv += 1

    # -- the actions ---------------------------------------------------------------------
    def execute(self, inputs: Sequence[Any] | None, targets: Sequence[Any] | None) -> list[float]:
        t0 = time.perf_counter()
        named = bool(Recorder._open)
        recvs, posted = self.recvs, self.posted
        for i, a in enumerate(self.actions):
            if self.next_recv < len(recvs) and (len(posted) < RECV_AHEAD or recvs[self.next_recv] <= i):
                self._post(i, block=False)  # (the test above spares most calls)
            try:
                if named:
                    with span(str(a), "pipeline", kind=a.kind.value, stage=a.stage,
                              microbatch=a.microbatch, peer=a.peer):
                        self._do(i, a, inputs, targets, t0)
                else:
                    self._do(i, a, inputs, targets, t0)
            except Exception as exc:
                if isinstance(exc, PipelineError) or not a.kind.is_compute:
                    raise
                raise StageFailed(
                    f"{a} failed on pipeline rank {self.rt.comm.rank}{self._shapes(a, inputs)}: "
                    f"{type(exc).__name__}: {exc}") from exc
        self.stats.wall = time.perf_counter() - t0
        self.stats.busy = self.stats.forward + self.stats.backward
        return [self.losses[mb] for mb in sorted(self.losses)]

    def _shapes(self, a: Action, inputs: Sequence[Any] | None) -> str:
        """`` (input shape (..))`` of a forward that failed, for its error message."""
        if a.kind is not ActionKind.FORWARD:
            return ""
        x = (inputs[a.microbatch] if a.stage == 0 and inputs is not None
             else self.acts.get((a.stage, a.microbatch), self.failed_input))
        shape = getattr(x, "shape", None)
        return "" if shape is None else f" (its input has shape {tuple(int(d) for d in shape)})"

    def _do(self, i: int, a: Action, inputs: Sequence[Any] | None, targets: Sequence[Any] | None,
            t0: float) -> None:
        s, mb, rt, stats = a.stage, a.microbatch, self.rt, self.stats
        if a.kind is ActionKind.FORWARD:
            ex = rt.executor(s)
            x = inputs[mb] if s == 0 and inputs is not None else self.acts.pop((s, mb))
            self.failed_input = x
            start = time.perf_counter()
            out = ex.forward(mb, x, targets[mb] if s == self.last and targets is not None else None)
            end = time.perf_counter()
            stats.forward += end - start
            stats.spans.append((start - t0, end - t0, "F", s, mb))
            self.live += 1
            stats.peak_live = max(stats.peak_live, self.live)
            if s == self.last:
                self.losses[mb] = float(out)
            elif s + 1 in rt.executors:
                self.acts[(s + 1, mb)] = out
            else:
                self.outbox[(s, mb)] = out
            if len(self.wire.pending) > REAP_AFTER:
                self.wire.reap()
        elif a.kind is ActionKind.BACKWARD:
            ex = rt.executor(s)
            g = None if s == self.last else self.grads.pop((s, mb))
            start = time.perf_counter()
            gin = ex.backward(mb, g)
            end = time.perf_counter()
            stats.backward += end - start
            stats.spans.append((start - t0, end - t0, "B", s, mb))
            self.live -= 1
            if s > 0:
                if s - 1 in rt.executors:
                    self.grads[(s - 1, mb)] = gin
                else:
                    self.outbox[(s, mb)] = gin
            if len(self.wire.pending) > REAP_AFTER:
                self.wire.reap()
        elif a.kind is ActionKind.SEND_ACT:
            start = time.perf_counter()
            arr = to_numpy(self.outbox.pop((s, mb)))
            if s not in self.like:
                self.like[s] = arr
            if mb == 0:
                self.wire.send(header(arr), _peer(a), rt._tag(_HEAD, s, 0))
            self.wire.send(arr, _peer(a), rt._tag(_ACT, s, mb))
            stats.send += time.perf_counter() - start
        elif a.kind is ActionKind.SEND_GRAD:
            start = time.perf_counter()
            self.wire.send(to_numpy(self.outbox.pop((s, mb))), _peer(a), rt._tag(_GRAD, s, mb))
            stats.send += time.perf_counter() - start
        else:
            start = time.perf_counter()
            self._post(i, block=True)
            got = self.rt.notices.wait(self.posted.pop(i))
            stats.wait += time.perf_counter() - start
            if a.kind is ActionKind.RECV_ACT:
                self.acts[(s, mb)] = got
            else:
                self.grads[(s, mb)] = got


def _peer(a: Action) -> int:
    if a.peer is None:  # Action guarantees a peer for send/recv
        raise PipelineError(f"{a} has no peer")
    return a.peer


def run_schedule(runtime: Runtime, actions: Sequence[Action], inputs: Sequence[Any] | None,
                 targets: Sequence[Any] | None) -> tuple[list[float], StepStats]:
    """Functional form of :meth:`Runtime.run`."""
    return runtime.run(actions, inputs, targets)


def run_forward(runtime: Runtime, x: Any, ranks: int) -> Any:
    """Functional form of :meth:`Runtime.forward_only`."""
    return runtime.forward_only(x, ranks)
