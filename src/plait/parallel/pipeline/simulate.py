"""A pure simulator for pipeline schedules.

:func:`simulate` executes the per-rank action lists of a schedule (see
:mod:`plait.parallel.pipeline.schedule`) with blocking point-to-point
semantics, checks that the schedule is complete and correctly ordered, and
reports its timing.

Timing model
    Each rank has its own clock and runs its actions in order. A forward
    takes ``forward_time`` and a backward ``backward_time``; when given as one
    number this is the time of one micro-batch through *all* the stages a
    rank holds, split evenly between them (so with ``v`` model chunks per
    rank a chunk takes ``forward_time / v``); a sequence gives the time of
    each virtual stage. A message sent at time ``t`` can be received from
    ``t + comm_time`` on; a recv completes at ``max(clock, arrival)``.

Send semantics
    ``sends="eager"`` (the default): a send is buffered and returns at once
    at no cost to the sender, as ``isend`` or a buffered send does. Only
    recvs block. ``sends="rendezvous"``: a send blocks until the receiver
    reaches the matching recv; both then finish at
    ``max(sender clock, receiver clock) + comm_time``. The schedules of
    :mod:`~plait.parallel.pipeline.schedule` are written for eager sends;
    1F1B deadlocks under rendezvous sends, which is why runtimes pair each
    send with the neighbouring recv.

Under this model, with constant per-stage times and ``comm_time == 0``,
GPipe and 1F1B on ``P`` ranks with ``M`` micro-batches both take
``(M + P - 1) * (forward_time + backward_time)`` and have bubble fraction
``(P - 1) / (M + P - 1)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from .errors import PipelineError, PipelineTypeError, ScheduleDeadlock, ScheduleError
from .schedule import Action, ActionKind

__all__ = ["SimResult", "Span", "simulate"]

_ACT = "act"
_GRAD = "grad"
# (receiver rank, sender rank, "act" | "grad", producing stage, microbatch)
_Key = tuple[int, int, str, int, int]


class Span(NamedTuple):
    """One compute action of a rank on the simulated timeline."""

    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class SimResult:
    """The outcome of :func:`simulate`.

    Attributes:
        makespan: Time at which the last rank finishes.
        busy: Per rank, the time spent in forward and backward.
        idle: Per rank, ``makespan - busy``.
        bubble_fraction: ``sum(idle) / (ranks * makespan)`` (0 when the
            makespan is 0).
        peak_activations: Per rank, the largest number of ``(stage,
            microbatch)`` pairs whose forward has run and backward has not.
        ranks: Number of pipeline ranks.
        stages: Number of (virtual) stages.
        microbatches: Number of micro-batches.
        timeline: Per rank, the compute actions with their start and end.
    """

    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble_fraction: float
    peak_activations: tuple[int, ...]
    ranks: int
    stages: int
    microbatches: int
    timeline: tuple[tuple[Span, ...], ...]


def _check_time(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PipelineTypeError(
            f"{name} must be a non-negative finite number, got {value!r} "
            f"of type {type(value).__name__}"
        )
    if not math.isfinite(value) or value < 0:
        raise PipelineError(f"{name} must be a non-negative finite number, got {value!r}")
    return float(value)


def _stage_times(
    name: str, value: float | Sequence[float], stages: int, rank_of: list[int], ranks: int
) -> list[float]:
    """Return the duration of one action of each virtual stage."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != stages:
            raise PipelineError(
                f"{name} as a sequence needs one time per stage ({stages}), got {len(value)}"
            )
        return [_check_time(f"{name}[{i}]", v) for i, v in enumerate(value)]
    total = _check_time(name, value)
    per_rank = [0] * ranks
    for r in rank_of:
        per_rank[r] += 1
    return [total / per_rank[rank_of[s]] for s in range(stages)]


def _validate(schedule: object) -> tuple[list[list[Action]], list[int], int]:
    """Check the static structure; return (actions, rank of each stage, microbatches)."""
    if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Sequence):
        raise PipelineTypeError(
            f"schedule must be a sequence of per-rank action lists, got {type(schedule).__name__}"
        )
    if len(schedule) == 0:
        raise ScheduleError("schedule must have at least one rank, got an empty schedule")
    actions: list[list[Action]] = []
    for rank, lst in enumerate(schedule):
        if isinstance(lst, (str, bytes)) or not isinstance(lst, Sequence):
            raise PipelineTypeError(
                f"schedule[{rank}] must be a sequence of Action, got {type(lst).__name__}"
            )
        for i, a in enumerate(lst):
            if not isinstance(a, Action):
                raise PipelineTypeError(
                    f"schedule[{rank}][{i}] must be an Action, got {a!r}"
                )
        actions.append(list(lst))
    ranks = len(actions)

    placed: dict[int, int] = {}
    seen: dict[tuple[ActionKind, int, int], int] = {}
    for rank, lst in enumerate(actions):
        for a in lst:
            if not a.kind.is_compute:
                continue
            other = placed.setdefault(a.stage, rank)
            if other != rank:
                raise ScheduleError(
                    f"stage {a.stage} is computed on rank {other} and on rank {rank}; "
                    f"each stage must live on exactly one rank"
                )
            key = (a.kind, a.stage, a.microbatch)
            if key in seen:
                raise ScheduleError(f"{a} appears twice on rank {rank}; each runs exactly once")
            seen[key] = rank
    if not placed:
        raise ScheduleError("schedule has no forward or backward action")
    stages = max(placed) + 1
    missing_stages = [s for s in range(stages) if s not in placed]
    if missing_stages:
        raise ScheduleError(
            f"stages {missing_stages} are never computed; stages must be 0..{stages - 1}"
        )
    microbatches = max(mb for (_, _, mb) in seen) + 1
    missing = [
        str(Action(kind, mb, s))
        for s in range(stages)
        for mb in range(microbatches)
        for kind in (ActionKind.FORWARD, ActionKind.BACKWARD)
        if (kind, s, mb) not in seen
    ]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ScheduleError(
            f"every stage must run forward and backward of every micro-batch 0..{microbatches - 1}"
            f" exactly once; missing {', '.join(missing[:5])}{more}"
        )
    rank_of = [placed[s] for s in range(stages)]

    for rank, lst in enumerate(actions):
        for i, a in enumerate(lst):
            if a.kind.is_compute:
                continue
            where = f"{a} at schedule[{rank}][{i}]"
            if a.peer is None or a.peer >= ranks:
                raise ScheduleError(f"{where}: peer must be a rank in 0..{ranks - 1}")
            if a.stage >= stages:
                raise ScheduleError(f"{where}: stage must be in 0..{stages - 1}")
            if a.microbatch >= microbatches:
                raise ScheduleError(f"{where}: microbatch must be in 0..{microbatches - 1}")
            # The stage on the other side of the message.
            if a.kind in (ActionKind.SEND_ACT, ActionKind.RECV_GRAD):
                other_stage = a.stage + 1
            else:
                other_stage = a.stage - 1
            if not 0 <= other_stage < stages:
                raise ScheduleError(
                    f"{where}: stage {a.stage} has no neighbour stage {other_stage} to "
                    f"{'send to' if a.kind.is_send else 'receive from'}"
                )
            if rank_of[a.stage] != rank:
                raise ScheduleError(
                    f"{where}: stage {a.stage} runs on rank {rank_of[a.stage]}, not rank {rank}"
                )
            if rank_of[other_stage] != a.peer:
                raise ScheduleError(
                    f"{where}: peer must be {rank_of[other_stage]}, the rank of stage "
                    f"{other_stage}, got {a.peer}"
                )
    return actions, rank_of, microbatches


def _message_key(rank: int, a: Action) -> _Key:
    """The mailbox key a send posts or a recv waits for."""
    peer = a.peer if a.peer is not None else rank
    if a.kind is ActionKind.SEND_ACT:
        return (peer, rank, _ACT, a.stage, a.microbatch)
    if a.kind is ActionKind.SEND_GRAD:
        return (peer, rank, _GRAD, a.stage, a.microbatch)
    if a.kind is ActionKind.RECV_ACT:
        return (rank, peer, _ACT, a.stage - 1, a.microbatch)
    return (rank, peer, _GRAD, a.stage + 1, a.microbatch)


def simulate(
    schedule: Sequence[Sequence[Action]],
    forward_time: float | Sequence[float] = 1.0,
    backward_time: float | Sequence[float] = 2.0,
    comm_time: float = 0.0,
    *,
    sends: Literal["eager", "rendezvous"] = "eager",
) -> SimResult:
    """Execute a schedule on simulated clocks and check it.

    Args:
        schedule: One action list per pipeline rank, in execution order.
        forward_time: Time of one micro-batch's forward through all stages
            of a rank (split evenly between them), or one time per virtual
            stage.
        backward_time: The same for backward.
        comm_time: Latency from a send to the matching recv, ``>= 0``.
        sends: ``"eager"`` (buffered, non-blocking sends) or
            ``"rendezvous"`` (a send waits for its recv).

    Returns:
        The makespan, per-rank busy and idle time, bubble fraction, peak live
        activations and compute timeline.

    Raises:
        PipelineTypeError: ``schedule`` is not a sequence of action lists or
            a time is not a number.
        PipelineError: A time is negative or not finite, or ``sends`` is
            unknown.
        ScheduleError: A stage runs on two ranks; a (stage, micro-batch)
            forward or backward is missing or duplicated; a forward runs
            before its input arrived or a backward before its forward or its
            output gradient; a send/recv names the wrong peer or stage; a
            message is sent but never received.
        ScheduleDeadlock: Every unfinished rank is blocked; the error names
            each stuck rank and the action it waits on.
    """
    if sends not in ("eager", "rendezvous"):
        raise PipelineError(f"sends must be 'eager' or 'rendezvous', got {sends!r}")
    actions, rank_of, microbatches = _validate(schedule)
    ranks, stages = len(actions), len(rank_of)
    t_fwd = _stage_times("forward_time", forward_time, stages, rank_of, ranks)
    t_bwd = _stage_times("backward_time", backward_time, stages, rank_of, ranks)
    latency = _check_time("comm_time", comm_time)

    pc = [0] * ranks
    clock = [0.0] * ranks
    busy = [0.0] * ranks
    live = [0] * ranks
    peak = [0] * ranks
    spans: list[list[Span]] = [[] for _ in range(ranks)]
    # (kind, stage, mb) inputs available on each rank: ("act", s, mb) is the
    # input of forward s; ("grad", s, mb) the output gradient of backward s.
    ready: list[set[tuple[str, int, int]]] = [set() for _ in range(ranks)]
    forwarded: set[tuple[int, int]] = set()
    produced: set[tuple[str, int, int]] = set()
    mailbox: dict[_Key, float] = {}

    def deliver(rank: int, a: Action) -> None:
        if a.kind is ActionKind.RECV_ACT:
            ready[rank].add((_ACT, a.stage, a.microbatch))
        else:
            ready[rank].add((_GRAD, a.stage, a.microbatch))

    def check_send(rank: int, i: int, a: Action) -> None:
        family = _ACT if a.kind is ActionKind.SEND_ACT else _GRAD
        if (family, a.stage, a.microbatch) not in produced:
            compute = "forward" if family == _ACT else "backward"
            raise ScheduleError(
                f"{a} at schedule[{rank}][{i}] runs before "
                f"{compute}(mb={a.microbatch}, stage={a.stage}) produced what it sends"
            )

    def compute(rank: int, i: int, a: Action) -> None:
        s, mb = a.stage, a.microbatch
        where = f"{a} at schedule[{rank}][{i}]"
        if a.kind is ActionKind.FORWARD:
            if s > 0 and (_ACT, s, mb) not in ready[rank]:
                raise ScheduleError(
                    f"{where} runs before its input activation from stage {s - 1} is "
                    f"received (add recv_act before it)"
                )
            duration = t_fwd[s]
            forwarded.add((s, mb))
            produced.add((_ACT, s, mb))
            live[rank] += 1
            peak[rank] = max(peak[rank], live[rank])
            if s + 1 < stages and rank_of[s + 1] == rank:
                ready[rank].add((_ACT, s + 1, mb))
        else:
            if (s, mb) not in forwarded:
                raise ScheduleError(f"{where} runs before forward(mb={mb}, stage={s})")
            if s + 1 < stages and (_GRAD, s, mb) not in ready[rank]:
                raise ScheduleError(
                    f"{where} runs before its output gradient from stage {s + 1} is "
                    f"received (add recv_grad before it)"
                )
            duration = t_bwd[s]
            produced.add((_GRAD, s, mb))
            live[rank] -= 1
            if s > 0 and rank_of[s - 1] == rank:
                ready[rank].add((_GRAD, s - 1, mb))
        start = clock[rank]
        clock[rank] = start + duration
        busy[rank] += duration
        spans[rank].append(Span(start, clock[rank], a))

    progress = True
    while progress:
        progress = False
        for rank in range(ranks):
            lst = actions[rank]
            while pc[rank] < len(lst):
                i = pc[rank]
                a = lst[i]
                if a.kind.is_compute:
                    compute(rank, i, a)
                elif a.kind.is_send:
                    check_send(rank, i, a)
                    key = _message_key(rank, a)
                    if sends == "eager":
                        if key in mailbox:
                            raise ScheduleError(f"{a} at schedule[{rank}][{i}] is sent twice")
                        mailbox[key] = clock[rank] + latency
                    else:
                        peer = key[0]
                        j = pc[peer]
                        if j >= len(actions[peer]):
                            break
                        b = actions[peer][j]
                        if not b.kind.is_recv or _message_key(peer, b) != key:
                            break
                        done = max(clock[rank], clock[peer]) + latency
                        clock[rank] = clock[peer] = done
                        deliver(peer, b)
                        pc[peer] += 1
                else:
                    if sends == "rendezvous":
                        break
                    key = _message_key(rank, a)
                    if key not in mailbox:
                        break
                    clock[rank] = max(clock[rank], mailbox.pop(key))
                    deliver(rank, a)
                pc[rank] += 1
                progress = True

    unfinished = [r for r in range(ranks) if pc[r] < len(actions[r])]
    if unfinished:
        stuck = {r: (pc[r], actions[r][pc[r]]) for r in unfinished}
        lines = []
        for r, (i, a) in stuck.items():
            verb = "sending" if a.kind.is_send else "receiving"
            lines.append(f"rank {r} blocked at schedule[{r}][{i}] {verb} {a}")
        raise ScheduleDeadlock(
            f"schedule deadlocks with {sends} sends: " + "; ".join(lines), stuck
        )
    if mailbox:
        src = sorted(mailbox)[0]
        raise ScheduleError(
            f"{len(mailbox)} message(s) sent but never received, e.g. {src[2]} of "
            f"stage {src[3]} micro-batch {src[4]} from rank {src[1]} to rank {src[0]}"
        )

    makespan = max(clock)
    idle = tuple(makespan - b for b in busy)
    bubble = sum(idle) / (ranks * makespan) if makespan > 0 else 0.0
    return SimResult(
        makespan=makespan,
        busy=tuple(busy),
        idle=idle,
        bubble_fraction=bubble,
        peak_activations=tuple(peak),
        ranks=ranks,
        stages=stages,
        microbatches=microbatches,
        timeline=tuple(tuple(s) for s in spans),
    )
