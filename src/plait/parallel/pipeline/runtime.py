"""One runtime that executes a pipeline schedule for any framework.

The schedule (:mod:`plait.parallel.pipeline.schedule`) says, per rank, which
forward, backward, send and receive to run in which order. :func:`run_schedule`
interprets one rank's list: compute goes to a per-chunk :class:`StageExecutor`
(framework glue in ``plait.adapters.torch_pipeline`` and
``plait.adapters.keras_pipeline``), messages go through the pipeline
communicator's ``send``/``recv``. Nothing here imports a framework.

Wire format
    Activations and gradients travel as numpy arrays (host buffers). The
    receiver of an activation does not know its shape in advance: the sender
    of stage ``s`` sends a small int64 *header* (dtype code, rank, shape)
    together with the activation of micro-batch 0 of every step, and every
    micro-batch of a step has that shape (the batch is split evenly). A
    gradient has the shape of the activation it belongs to, which its
    receiver produced itself, so gradients need no header.

Eager sends
    In the steady state of 1F1B neighbouring ranks send to each other at the
    same time, so blocking (rendezvous) sends deadlock (the simulator shows
    it). Sends are therefore posted without waiting: with the communicator's
    ``send_async`` where it has one, else on a small pool of sender threads
    (MPI is initialised with ``MPI_THREAD_MULTIPLE``); all sends of a step
    are waited for at its end. Every message has its own tag
    ``(family, stage, micro-batch)``, so the order in which ranks post
    receives never matters.

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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from plait.collectives.timeline import span
from plait.errors import CollectiveTimeoutError
from plait.protocols import Communicator

from .errors import PipelineError
from .schedule import Action, ActionKind

__all__ = ["MAX_TAG", "StageExecutor", "StepStats", "run_schedule", "run_forward", "message_tag"]

#: The MPI standard guarantees tags up to 32767.
MAX_TAG = 32767
_HEADER_LEN = 10  # dtype code, ndim, up to 8 dims
_DTYPES = ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
_ACT, _GRAD, _HEAD = 0, 1, 2


class StageExecutor(Protocol):
    """One model chunk (a virtual stage) on this rank, seen by the runtime.

    ``forward`` keeps what ``backward`` needs for that micro-batch (the
    autograd graph, a gradient tape, or only the input when recomputing).
    Inputs may be numpy arrays or the framework's tensors; outputs and input
    gradients are the framework's tensors.
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
        wall: Seconds from the first to the last action of the schedule.
        busy: Seconds in forward and backward compute.
        forward: Seconds in forward compute.
        backward: Seconds in backward compute.
        peak_live: Largest number of (stage, micro-batch) activations alive
            (forward done, backward not yet) on this rank.
        spans: ``(start, end, "F"|"B", stage, microbatch)`` per compute action,
            times relative to the start of the step.
    """

    wall: float = 0.0
    busy: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
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
    if message_tag(_HEAD, stages - 1, microbatches - 1, stages, microbatches) > MAX_TAG:
        raise PipelineError(
            f"microbatches x virtual stages is too large for MPI tags: "
            f"microbatches={microbatches}, stages={stages}; need "
            f"3 * stages * microbatches < {MAX_TAG}"
        )


def _header(a: np.ndarray) -> np.ndarray:
    name = a.dtype.name
    if name not in _DTYPES:
        raise PipelineError(f"activation dtype must be one of {_DTYPES}, got {name}")
    if a.ndim > _HEADER_LEN - 2:
        raise PipelineError(f"activations may have at most {_HEADER_LEN - 2} dims, got {a.shape}")
    h = np.zeros(_HEADER_LEN, dtype=np.int64)
    h[0], h[1] = _DTYPES.index(name), a.ndim
    h[2:2 + a.ndim] = a.shape
    return h


def _template(h: np.ndarray) -> np.ndarray:
    ndim = int(h[1])
    return np.empty(tuple(int(d) for d in h[2:2 + ndim]), dtype=_DTYPES[int(h[0])])


def _to_numpy(t: Any) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return t
    from plait.adapters import ops_for

    return np.ascontiguousarray(ops_for(t).to_numpy(t))


class _Sender:
    """Posts sends without waiting for their receives (see the module docstring)."""

    def __init__(self, comm: Communicator, workers: int) -> None:
        self.comm = comm
        self.native: Any = getattr(comm, "send_async", None)
        self.timeout = float(getattr(comm, "timeout", 300.0))
        self.pool = None if self.native else ThreadPoolExecutor(
            max_workers=max(2, workers), thread_name_prefix="plait-pipeline-send")
        self.pending: list[Any] = []

    def send(self, array: np.ndarray, dest: int, tag: int) -> None:
        if self.pool is None:
            self.pending.append(self.native(array, dest, tag))
        else:
            self.pending.append(self.pool.submit(self.comm.send, array, dest, tag))

    def flush(self) -> None:
        """Wait for every posted send; re-raise the first failure."""
        deadline = time.monotonic() + self.timeout
        pending, self.pending = self.pending, []
        for p in pending:
            if isinstance(p, Future):
                left = max(0.0, deadline - time.monotonic())
                try:
                    p.result(timeout=left)
                except TimeoutError:
                    raise CollectiveTimeoutError(
                        f"pipeline send not received within {self.timeout:g}s; "
                        f"a neighbouring stage is dead or stuck") from None
            else:
                p.wait()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)


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
        self.sender = _Sender(comm, 2 * stages * microbatches + 2)

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
            PipelineError: An action names a stage this rank does not hold.
            CollectiveTimeoutError: A message did not arrive in time.
            MismatchError: A message had another size than expected.
        """
        last = self.stages - 1
        acts: dict[tuple[int, int], Any] = {}     # input of (stage, mb)
        grads: dict[tuple[int, int], Any] = {}    # output gradient of (stage, mb)
        outbox: dict[tuple[int, int], Any] = {}   # tensor to send for (stage, mb)
        like: dict[tuple[int, int], np.ndarray] = {}  # what a recv_grad of (stage, mb) looks like
        meta: dict[int, np.ndarray] = {}          # activation template received for a stage
        losses: dict[int, float] = {}
        stats = StepStats()
        live = 0
        t0 = time.perf_counter()
        try:
            for a in actions:
                s, mb = a.stage, a.microbatch
                with span(str(a), "pipeline", kind=a.kind.value, stage=s, microbatch=mb,
                          peer=a.peer):
                    if a.kind is ActionKind.FORWARD:
                        ex = self._executor(s)
                        x = inputs[mb] if s == 0 and inputs is not None else acts.pop((s, mb))
                        start = time.perf_counter()
                        out = ex.forward(mb, x, targets[mb] if s == last and targets is not None
                                         else None)
                        end = time.perf_counter()
                        stats.forward += end - start
                        stats.spans.append((start - t0, end - t0, "F", s, mb))
                        live += 1
                        stats.peak_live = max(stats.peak_live, live)
                        if s == last:
                            losses[mb] = float(out)
                        elif s + 1 in self.executors:
                            acts[(s + 1, mb)] = out
                        else:
                            outbox[(s, mb)] = out
                    elif a.kind is ActionKind.BACKWARD:
                        ex = self._executor(s)
                        g = None if s == last else grads.pop((s, mb))
                        start = time.perf_counter()
                        gin = ex.backward(mb, g)
                        end = time.perf_counter()
                        stats.backward += end - start
                        stats.spans.append((start - t0, end - t0, "B", s, mb))
                        live -= 1
                        if s > 0:
                            if s - 1 in self.executors:
                                grads[(s - 1, mb)] = gin
                            else:
                                outbox[(s, mb)] = gin
                    elif a.kind is ActionKind.SEND_ACT:
                        arr = _to_numpy(outbox.pop((s, mb)))
                        like[(s, mb)] = arr
                        if mb == 0:
                            self.sender.send(_header(arr), _peer(a), self._tag(_HEAD, s, 0))
                        self.sender.send(arr, _peer(a), self._tag(_ACT, s, mb))
                    elif a.kind is ActionKind.SEND_GRAD:
                        arr = _to_numpy(outbox.pop((s, mb)))
                        self.sender.send(arr, _peer(a), self._tag(_GRAD, s, mb))
                    elif a.kind is ActionKind.RECV_ACT:
                        if s not in meta:
                            head = np.zeros(_HEADER_LEN, dtype=np.int64)
                            meta[s] = _template(self.comm.recv(head, _peer(a), self._tag(_HEAD, s - 1, 0)))
                        acts[(s, mb)] = self.comm.recv(meta[s], _peer(a), self._tag(_ACT, s - 1, mb))
                    else:  # RECV_GRAD
                        grads[(s, mb)] = self.comm.recv(like.pop((s, mb)), _peer(a),
                                                        self._tag(_GRAD, s + 1, mb))
            self.sender.flush()
        except BaseException:
            self.sender.pending.clear()
            raise
        stats.wall = time.perf_counter() - t0
        stats.busy = stats.forward + stats.backward
        return [losses[mb] for mb in sorted(losses)], stats

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
                head = self.comm.recv(np.zeros(_HEADER_LEN, dtype=np.int64), src,
                                      self._tag(_HEAD, s - 1, 0))
                out = self.comm.recv(_template(head), src, self._tag(_ACT, s - 1, 0))
            elif s == 0:
                out = x
            with span(f"infer(stage={s})", "pipeline", kind="infer", stage=s):
                out = self.executors[s].infer(out)
            if s + 1 < self.stages and s + 1 not in self.executors:
                arr = _to_numpy(out)
                self.sender.send(_header(arr), (s + 1) % ranks, self._tag(_HEAD, s, 0))
                self.sender.send(arr, (s + 1) % ranks, self._tag(_ACT, s, 0))
        self.sender.flush()
        return out if self.stages - 1 in self.executors else None

    def _executor(self, stage: int) -> StageExecutor:
        ex = self.executors.get(stage)
        if ex is None:
            raise PipelineError(
                f"the schedule runs stage {stage} on this rank, which holds stages "
                f"{sorted(self.executors)}")
        return ex

    def close(self) -> None:
        """Release the sender threads."""
        self.sender.close()


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
