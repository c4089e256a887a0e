"""Pipeline schedules as data.

A schedule is one list of :class:`Action` per pipeline rank, in the order that
rank executes them. Generators here build the classic schedules; the
simulator (:mod:`plait.parallel.pipeline.simulate`) checks them and computes
their bubble; a runtime interprets them through the framework adapter and the
communicator.

Stages and ranks
    ``stages`` is the number of pipeline *ranks* ``P``. Without interleaving,
    rank ``r`` runs stage ``r``. With ``chunks = v`` model chunks per rank
    (Megatron's virtual pipeline), there are ``V = P * v`` virtual stages and
    virtual stage ``s`` runs on rank ``s % P`` as its chunk ``s // P``;
    :attr:`Action.stage` is always the virtual stage.

Communication actions
    A forward of stage ``s > 0`` is preceded by ``recv_act`` from the rank of
    stage ``s - 1``; a forward of stage ``s < V - 1`` is followed by
    ``send_act`` to the rank of stage ``s + 1``. Backward is symmetric:
    ``recv_grad`` from the rank of ``s + 1`` before, ``send_grad`` to the rank
    of ``s - 1`` after. When both stages live on the same rank (interleaving
    with ``P == 1``) the hand-off is local and no send/recv is emitted.

    The ``stage`` of a send is the stage that produced the tensor, the
    ``stage`` of a recv is the stage that will consume it, so
    ``send_act(mb, s)`` matches ``recv_act(mb, s + 1)`` and
    ``send_grad(mb, s)`` matches ``recv_grad(mb, s - 1)``; ``peer`` is the
    other pipeline rank.

    These schedules assume *eager* (buffered / non-blocking) sends: in the
    steady state of 1F1B neighbouring ranks send to each other at the same
    time, so a runtime using rendezvous (blocking, unbuffered) sends must
    post them with ``isend`` or batch each send with the following recv, as
    Megatron does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from .._checks import check_int
from .errors import PipelineError, PipelineTypeError

__all__ = [
    "Action",
    "ActionKind",
    "SCHEDULES",
    "Schedule",
    "format_schedule",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
]


class ActionKind(str, Enum):
    """What a pipeline rank does in one step of a schedule."""

    FORWARD = "forward"
    BACKWARD = "backward"
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"

    @property
    def is_compute(self) -> bool:
        """True for ``forward`` and ``backward``."""
        return self in (ActionKind.FORWARD, ActionKind.BACKWARD)

    @property
    def is_send(self) -> bool:
        """True for ``send_act`` and ``send_grad``."""
        return self in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        """True for ``recv_act`` and ``recv_grad``."""
        return self in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)


_VALID_KINDS = ", ".join(repr(k.value) for k in ActionKind)
_SHORT = {ActionKind.FORWARD: "F", ActionKind.BACKWARD: "B"}


@dataclass(frozen=True)
class Action:
    """One step of a pipeline schedule.

    Args:
        kind: An :class:`ActionKind` or its string value (``"forward"``,
            ``"backward"``, ``"send_act"``, ``"recv_act"``, ``"send_grad"``,
            ``"recv_grad"``).
        microbatch: Micro-batch index, ``>= 0``.
        stage: Virtual stage index, ``>= 0`` (the pipeline rank without
            interleaving). For a send, the stage that produced the tensor; for
            a recv, the stage that consumes it.
        peer: The other pipeline rank of a send/recv; ``None`` for compute.

    Raises:
        PipelineTypeError: A field has the wrong type.
        PipelineError: An unknown kind, a negative index, a send/recv without
            a peer, or a compute action with one.
    """

    kind: ActionKind
    microbatch: int
    stage: int
    peer: int | None = None

    def __post_init__(self) -> None:
        kind: object = self.kind
        if not isinstance(kind, ActionKind):
            try:
                kind = ActionKind(kind)
            except ValueError:
                raise PipelineError(
                    f"kind must be one of {_VALID_KINDS}, got {kind!r}"
                ) from None
            object.__setattr__(self, "kind", kind)
        check_int(
            "microbatch", self.microbatch, minimum=0,
            value_error=PipelineError, type_error=PipelineTypeError,
        )
        check_int(
            "stage", self.stage, minimum=0,
            value_error=PipelineError, type_error=PipelineTypeError,
        )
        if self.kind.is_compute:
            if self.peer is not None:
                raise PipelineError(
                    f"peer must be None for a {self.kind.value} action, got {self.peer!r}"
                )
        else:
            if self.peer is None:
                raise PipelineError(
                    f"peer (the other pipeline rank) is required for a "
                    f"{self.kind.value} action, got None"
                )
            check_int(
                "peer", self.peer, minimum=0,
                value_error=PipelineError, type_error=PipelineTypeError,
            )

    def __str__(self) -> str:
        if self.kind.is_compute:
            return f"{self.kind.value}(mb={self.microbatch}, stage={self.stage})"
        return f"{self.kind.value}(mb={self.microbatch}, stage={self.stage}, peer={self.peer})"


Schedule = list[list[Action]]
"""One list of actions per pipeline rank, in execution order."""


def _forward(rank: int, stage: int, mb: int, ranks: int, vstages: int) -> list[Action]:
    """Return recv_act?, forward, send_act? for one forward on ``rank``."""
    out: list[Action] = []
    if stage > 0 and (stage - 1) % ranks != rank:
        out.append(Action(ActionKind.RECV_ACT, mb, stage, (stage - 1) % ranks))
    out.append(Action(ActionKind.FORWARD, mb, stage))
    if stage < vstages - 1 and (stage + 1) % ranks != rank:
        out.append(Action(ActionKind.SEND_ACT, mb, stage, (stage + 1) % ranks))
    return out


def _backward(rank: int, stage: int, mb: int, ranks: int, vstages: int) -> list[Action]:
    """Return recv_grad?, backward, send_grad? for one backward on ``rank``."""
    out: list[Action] = []
    if stage < vstages - 1 and (stage + 1) % ranks != rank:
        out.append(Action(ActionKind.RECV_GRAD, mb, stage, (stage + 1) % ranks))
    out.append(Action(ActionKind.BACKWARD, mb, stage))
    if stage > 0 and (stage - 1) % ranks != rank:
        out.append(Action(ActionKind.SEND_GRAD, mb, stage, (stage - 1) % ranks))
    return out


def _check_counts(stages: object, microbatches: object) -> tuple[int, int]:
    p = check_int(
        "stages", stages, minimum=1, value_error=PipelineError, type_error=PipelineTypeError
    )
    m = check_int(
        "microbatches", microbatches, minimum=1,
        value_error=PipelineError, type_error=PipelineTypeError,
    )
    return p, m


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: every rank runs all forwards, then all backwards.

    Backwards run in the same micro-batch order as forwards (first in, first
    out). Every rank holds the activations of all ``microbatches`` at once.

    Args:
        stages: Number of pipeline ranks ``P >= 1``.
        microbatches: Number of micro-batches ``M >= 1`` per step.

    Returns:
        One action list per rank.

    Raises:
        PipelineTypeError: An argument is not an integer.
        PipelineError: An argument is smaller than 1.
    """
    p, m = _check_counts(stages, microbatches)
    schedule: Schedule = []
    for rank in range(p):
        actions: list[Action] = []
        for mb in range(m):
            actions += _forward(rank, rank, mb, p, p)
        for mb in range(m):
            actions += _backward(rank, rank, mb, p, p)
        schedule.append(actions)
    return schedule


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush, Megatron's non-interleaved schedule).

    Rank ``r`` runs ``min(P - r - 1, M)`` warm-up forwards, then alternates
    one forward and one backward, then drains the remaining backwards. At most
    ``P - r`` micro-batches' activations are alive on rank ``r``.

    Args:
        stages: Number of pipeline ranks ``P >= 1``.
        microbatches: Number of micro-batches ``M >= 1`` per step.

    Returns:
        One action list per rank.

    Raises:
        PipelineTypeError: An argument is not an integer.
        PipelineError: An argument is smaller than 1.
    """
    p, m = _check_counts(stages, microbatches)
    schedule: Schedule = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        actions: list[Action] = []
        fwd = bwd = 0
        for _ in range(warmup):
            actions += _forward(rank, rank, fwd, p, p)
            fwd += 1
        for _ in range(m - warmup):
            actions += _forward(rank, rank, fwd, p, p)
            fwd += 1
            actions += _backward(rank, rank, bwd, p, p)
            bwd += 1
        for _ in range(warmup):
            actions += _backward(rank, rank, bwd, p, p)
            bwd += 1
        schedule.append(actions)
    return schedule


def interleaved_1f1b(stages: int, microbatches: int, chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B with ``chunks`` model chunks per rank.

    Virtual stage ``s`` runs on rank ``s % P``. Forwards visit micro-batches
    in groups of ``P``: the ``k``-th forward of a rank is chunk
    ``(k % (P*v)) // P`` of micro-batch ``(k // (P*v)) * P + k % P``;
    backwards visit chunks in the reverse order. Rank ``r`` warms up with
    ``2 * (P - r - 1) + (v - 1) * P`` forwards (all of them when ``M == P``),
    then alternates one forward and one backward, then drains. With
    ``chunks == 1`` this is exactly :func:`one_f_one_b`.

    Args:
        stages: Number of pipeline ranks ``P >= 1``.
        microbatches: Number of micro-batches ``M >= 1``; with ``chunks > 1``
            it must be a multiple of ``stages`` (as Megatron requires).
        chunks: Number of model chunks (virtual stages) per rank ``v >= 1``.

    Returns:
        One action list per rank; ``Action.stage`` is the virtual stage
        ``chunk * P + rank``.

    Raises:
        PipelineTypeError: An argument is not an integer.
        PipelineError: An argument is smaller than 1, or ``chunks > 1`` and
            ``microbatches`` is not a multiple of ``stages``.
    """
    p, m = _check_counts(stages, microbatches)
    v = check_int(
        "chunks", chunks, minimum=1, value_error=PipelineError, type_error=PipelineTypeError
    )
    if v == 1:
        return one_f_one_b(p, m)
    if m % p != 0:
        lower = (m // p) * p
        hint = f"{lower} or {lower + p}" if lower else f"{p}"
        raise PipelineError(
            f"microbatches must be a multiple of stages={p} for the interleaved schedule "
            f"(chunks={v}), got microbatches={m}; use e.g. {hint}, or chunks=1"
        )
    vstages = p * v
    total = m * v
    group = p * v

    def chunk_and_mb(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % group) // p
        if not forward:
            chunk = v - 1 - chunk
        return chunk, (k // group) * p + k % p

    schedule: Schedule = []
    for rank in range(p):
        warmup = total if m == p else min(2 * (p - rank - 1) + (v - 1) * p, total)
        actions: list[Action] = []

        def fwd(k: int, rank: int = rank, actions: list[Action] = actions) -> None:
            chunk, mb = chunk_and_mb(k, True)
            actions.extend(_forward(rank, chunk * p + rank, mb, p, vstages))

        def bwd(k: int, rank: int = rank, actions: list[Action] = actions) -> None:
            chunk, mb = chunk_and_mb(k, False)
            actions.extend(_backward(rank, chunk * p + rank, mb, p, vstages))

        for k in range(warmup):
            fwd(k)
        for k in range(total - warmup):
            fwd(k + warmup)
            bwd(k)
        for k in range(total - warmup, total):
            bwd(k)
        schedule.append(actions)
    return schedule


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
}
"""Schedule generators by name, as accepted by :func:`get_schedule`."""


def get_schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Build a schedule by name.

    Args:
        name: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (case-insensitive).
        stages: Number of pipeline ranks ``P >= 1``.
        microbatches: Number of micro-batches ``M >= 1``.
        chunks: Model chunks per rank; only ``"interleaved"`` accepts a value
            other than 1.

    Returns:
        One action list per rank.

    Raises:
        PipelineTypeError: ``name`` is not a string or a count is not an integer.
        PipelineError: Unknown ``name``, ``chunks != 1`` for a
            non-interleaved schedule, or invalid counts.
    """
    if not isinstance(name, str):
        raise PipelineTypeError(
            f"name must be a string, one of {sorted(SCHEDULES)}, got {name!r}"
        )
    key = name.strip().lower()
    if key not in SCHEDULES:
        raise PipelineError(
            f"name must be one of {', '.join(repr(n) for n in SCHEDULES)}, got {name!r}"
        )
    if key == "interleaved":
        return interleaved_1f1b(stages, microbatches, chunks)
    check_int("chunks", chunks, minimum=1, value_error=PipelineError,
              type_error=PipelineTypeError)
    if chunks != 1:
        raise PipelineError(
            f"chunks must be 1 for the {key!r} schedule, got chunks={chunks}; "
            f"model chunks per rank need name='interleaved'"
        )
    return SCHEDULES[key](stages, microbatches)


def format_schedule(schedule: Schedule, *, comm: bool = False) -> str:
    """Render a schedule as one line per rank, e.g. ``rank 0: F0 F1 B0 B1``.

    Compute actions print as ``F``/``B`` plus the micro-batch, with
    ``.stage`` appended when a rank runs more than one stage.

    Args:
        schedule: One action list per rank.
        comm: Also print send/recv actions (as ``kind:mb.stage>peer``).

    Returns:
        The rendered text, without a trailing newline.
    """
    lines = []
    for rank, actions in enumerate(schedule):
        multi = len({a.stage for a in actions if a.kind.is_compute}) > 1
        parts = []
        for a in actions:
            if a.kind.is_compute:
                parts.append(f"{_SHORT[a.kind]}{a.microbatch}" + (f".{a.stage}" if multi else ""))
            elif comm:
                parts.append(f"{a.kind.value}:{a.microbatch}.{a.stage}>{a.peer}")
        lines.append(f"rank {rank}: " + " ".join(parts))
    return "\n".join(lines)
