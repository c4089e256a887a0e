"""Pipeline schedules as data and the pure simulator (no framework, no MPI)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from plait.parallel.pipeline import (
    Action,
    ActionKind,
    PipelineError,
    PipelineTypeError,
    ScheduleDeadlock,
    ScheduleError,
    format_schedule,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
)


def F(mb: int, s: int) -> Action:
    return Action(ActionKind.FORWARD, mb, s)


def B(mb: int, s: int) -> Action:
    return Action(ActionKind.BACKWARD, mb, s)


def SA(mb: int, s: int, peer: int) -> Action:
    return Action(ActionKind.SEND_ACT, mb, s, peer)


def RA(mb: int, s: int, peer: int) -> Action:
    return Action(ActionKind.RECV_ACT, mb, s, peer)


def SG(mb: int, s: int, peer: int) -> Action:
    return Action(ActionKind.SEND_GRAD, mb, s, peer)


def RG(mb: int, s: int, peer: int) -> Action:
    return Action(ActionKind.RECV_GRAD, mb, s, peer)


def valid_grid() -> list[tuple[int, int, int]]:
    return [
        (p, m, v)
        for p in range(1, 6)
        for m in range(1, 9)
        for v in range(1, 4)
        if v == 1 or m % p == 0
    ]


# --- exact action lists -------------------------------------------------------


def test_gpipe_p2_m2_exact() -> None:
    assert gpipe(2, 2) == [
        [F(0, 0), SA(0, 0, 1), F(1, 0), SA(1, 0, 1), RG(0, 0, 1), B(0, 0), RG(1, 0, 1), B(1, 0)],
        [RA(0, 1, 0), F(0, 1), RA(1, 1, 0), F(1, 1), B(0, 1), SG(0, 1, 0), B(1, 1), SG(1, 1, 0)],
    ]


def test_gpipe_p2_m3_exact() -> None:
    assert gpipe(2, 3) == [
        [
            F(0, 0), SA(0, 0, 1), F(1, 0), SA(1, 0, 1), F(2, 0), SA(2, 0, 1),
            RG(0, 0, 1), B(0, 0), RG(1, 0, 1), B(1, 0), RG(2, 0, 1), B(2, 0),
        ],
        [
            RA(0, 1, 0), F(0, 1), RA(1, 1, 0), F(1, 1), RA(2, 1, 0), F(2, 1),
            B(0, 1), SG(0, 1, 0), B(1, 1), SG(1, 1, 0), B(2, 1), SG(2, 1, 0),
        ],
    ]


def test_1f1b_p2_m2_exact() -> None:
    assert one_f_one_b(2, 2) == [
        # one warm-up forward, one steady F+B, one cool-down backward
        [F(0, 0), SA(0, 0, 1), F(1, 0), SA(1, 0, 1), RG(0, 0, 1), B(0, 0), RG(1, 0, 1), B(1, 0)],
        [RA(0, 1, 0), F(0, 1), B(0, 1), SG(0, 1, 0), RA(1, 1, 0), F(1, 1), B(1, 1), SG(1, 1, 0)],
    ]


def test_1f1b_p2_m3_exact() -> None:
    assert one_f_one_b(2, 3) == [
        [
            F(0, 0), SA(0, 0, 1),
            F(1, 0), SA(1, 0, 1), RG(0, 0, 1), B(0, 0),
            F(2, 0), SA(2, 0, 1), RG(1, 0, 1), B(1, 0),
            RG(2, 0, 1), B(2, 0),
        ],
        [
            RA(0, 1, 0), F(0, 1), B(0, 1), SG(0, 1, 0),
            RA(1, 1, 0), F(1, 1), B(1, 1), SG(1, 1, 0),
            RA(2, 1, 0), F(2, 1), B(2, 1), SG(2, 1, 0),
        ],
    ]


def test_1f1b_p3_m4_compute_order() -> None:
    assert format_schedule(one_f_one_b(3, 4)) == (
        "rank 0: F0 F1 F2 B0 F3 B1 B2 B3\n"
        "rank 1: F0 F1 B0 F2 B1 F3 B2 B3\n"
        "rank 2: F0 B0 F1 B1 F2 B2 F3 B3"
    )


def test_interleaved_p2_m4_v2_compute_order() -> None:
    # Megatron's order: micro-batches in groups of P, chunk 0 then chunk 1;
    # rank 0 warms up with 2*(P-1) + (v-1)*P = 4 forwards.
    assert format_schedule(interleaved_1f1b(2, 4, 2)) == (
        "rank 0: F0.0 F1.0 F0.2 F1.2 F2.0 B0.2 F3.0 B1.2 F2.2 B0.0 F3.2 B1.0 B2.2 B3.2 B2.0 B3.0\n"
        "rank 1: F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 F2.1 B0.1 F3.1 B1.1 F2.3 B2.3 F3.3 B3.3 B2.1 B3.1"
    )


def test_interleaved_p2_m4_v2_exact() -> None:
    # Virtual stages 0, 2 on rank 0 and 1, 3 on rank 1 (the compute order above); stage 1
    # hands to stage 2 back on rank 0; the last stage (3) sends no activation and receives
    # no gradient, the first (0) receives no activation and sends no gradient.
    assert interleaved_1f1b(2, 4, 2) == [
        [
            F(0, 0), SA(0, 0, 1), F(1, 0), SA(1, 0, 1),
            RA(0, 2, 1), F(0, 2), SA(0, 2, 1), RA(1, 2, 1), F(1, 2), SA(1, 2, 1),
            F(2, 0), SA(2, 0, 1), RG(0, 2, 1), B(0, 2), SG(0, 2, 1),
            F(3, 0), SA(3, 0, 1), RG(1, 2, 1), B(1, 2), SG(1, 2, 1),
            RA(2, 2, 1), F(2, 2), SA(2, 2, 1), RG(0, 0, 1), B(0, 0),
            RA(3, 2, 1), F(3, 2), SA(3, 2, 1), RG(1, 0, 1), B(1, 0),
            RG(2, 2, 1), B(2, 2), SG(2, 2, 1), RG(3, 2, 1), B(3, 2), SG(3, 2, 1),
            RG(2, 0, 1), B(2, 0), RG(3, 0, 1), B(3, 0),
        ],
        [
            RA(0, 1, 0), F(0, 1), SA(0, 1, 0), RA(1, 1, 0), F(1, 1), SA(1, 1, 0),
            RA(0, 3, 0), F(0, 3), B(0, 3), SG(0, 3, 0),
            RA(1, 3, 0), F(1, 3), B(1, 3), SG(1, 3, 0),
            RA(2, 1, 0), F(2, 1), SA(2, 1, 0), RG(0, 1, 0), B(0, 1), SG(0, 1, 0),
            RA(3, 1, 0), F(3, 1), SA(3, 1, 0), RG(1, 1, 0), B(1, 1), SG(1, 1, 0),
            RA(2, 3, 0), F(2, 3), B(2, 3), SG(2, 3, 0),
            RA(3, 3, 0), F(3, 3), B(3, 3), SG(3, 3, 0),
            RG(2, 1, 0), B(2, 1), SG(2, 1, 0), RG(3, 1, 0), B(3, 1), SG(3, 1, 0),
        ],
    ]


def test_interleaved_wraps_from_last_rank_to_first() -> None:
    sched = interleaved_1f1b(2, 2, 2)
    # virtual stage 1 (rank 1, chunk 0) sends to stage 2 (rank 0, chunk 1)
    assert SA(0, 1, 0) in sched[1]
    assert RA(0, 2, 1) in sched[0]
    # the last virtual stage sends nothing forward, the first nothing backward
    assert not any(a.kind is ActionKind.SEND_ACT and a.stage == 3 for a in sched[1])
    assert not any(a.kind is ActionKind.SEND_GRAD and a.stage == 0 for a in sched[0])


def test_interleaved_single_rank_hands_off_locally() -> None:
    sched = interleaved_1f1b(1, 3, 3)
    assert all(a.kind.is_compute for a in sched[0])
    result = simulate(sched)
    assert result.bubble_fraction == 0.0


def test_interleaved_chunks_1_is_1f1b() -> None:
    for p in range(1, 5):
        for m in range(1, 7):
            assert interleaved_1f1b(p, m, 1) == one_f_one_b(p, m)


def test_get_schedule_dispatch() -> None:
    assert get_schedule("gpipe", 3, 4) == gpipe(3, 4)
    assert get_schedule("1F1B", 3, 4) == one_f_one_b(3, 4)
    assert get_schedule("interleaved", 2, 4, chunks=2) == interleaved_1f1b(2, 4, 2)


# --- properties over a grid --------------------------------------------------


@pytest.mark.parametrize("p,m,v", valid_grid())
def test_every_stage_microbatch_once_and_no_deadlock(p: int, m: int, v: int) -> None:
    names = ["gpipe", "1f1b", "interleaved"] if v == 1 else ["interleaved"]
    for name in names:
        sched = get_schedule(name, p, m, chunks=v)
        assert len(sched) == p
        counts = Counter(
            (a.kind, a.stage, a.microbatch) for rank in sched for a in rank if a.kind.is_compute
        )
        expected = {
            (kind, s, mb)
            for kind in (ActionKind.FORWARD, ActionKind.BACKWARD)
            for s in range(p * v)
            for mb in range(m)
        }
        assert set(counts) == expected
        assert set(counts.values()) == {1}
        # virtual stage s lives on rank s % P
        for rank, actions in enumerate(sched):
            assert {a.stage % p for a in actions} == {rank}
        # every send has exactly one matching recv
        sends = Counter(a.kind for rank in sched for a in rank if a.kind.is_send)
        recvs = Counter(a.kind for rank in sched for a in rank if a.kind.is_recv)
        assert sends[ActionKind.SEND_ACT] == recvs[ActionKind.RECV_ACT]
        assert sends[ActionKind.SEND_GRAD] == recvs[ActionKind.RECV_GRAD]
        result = simulate(sched)  # raises on deadlock or bad order
        assert result.ranks == p and result.stages == p * v and result.microbatches == m
        assert result.busy == pytest.approx([m * 3.0] * p)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("times", [(1.0, 1.0), (1.0, 2.0), (2.0, 3.0), (0.5, 0.25)])
def test_bubble_is_textbook(name: str, times: tuple[float, float]) -> None:
    f, b = times
    for p in range(1, 6):
        for m in range(1, 9):
            r = simulate(get_schedule(name, p, m), forward_time=f, backward_time=b)
            assert r.makespan == pytest.approx((m + p - 1) * (f + b), rel=1e-12)
            assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12, abs=0)


def test_interleaved_bubble_shrinks_by_chunks() -> None:
    for p in range(2, 6):
        for m in range(p, 9, p):
            base = simulate(one_f_one_b(p, m)).bubble_fraction
            for v in (2, 3):
                r = simulate(interleaved_1f1b(p, m, v))
                assert r.bubble_fraction < base
                # Megatron's bubble: (P-1)/v idle slots against M busy ones.
                assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)


def test_peak_live_activations() -> None:
    for p in range(1, 6):
        for m in range(1, 9):
            one = simulate(one_f_one_b(p, m)).peak_activations
            assert one == tuple(min(p - r, m) for r in range(p))
            assert max(one) <= p
            assert simulate(gpipe(p, m)).peak_activations == (m,) * p


def test_comm_time_adds_two_latencies_per_hop() -> None:
    for p in range(1, 5):
        for m in range(1, 6):
            r = simulate(gpipe(p, m), forward_time=1.0, backward_time=2.0, comm_time=0.5)
            assert r.makespan == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * 0.5)


def test_per_stage_times_and_timeline() -> None:
    r = simulate(one_f_one_b(3, 2), forward_time=[1.0, 2.0, 3.0], backward_time=[1.0, 1.0, 1.0])
    assert r.busy == (2 * 2.0, 2 * 3.0, 2 * 4.0)
    assert r.idle == tuple(r.makespan - b for b in r.busy)
    for spans in r.timeline:
        for a, b in itertools.pairwise(spans):
            assert a.end <= b.start
    # the last stage cannot start before stages 0 and 1 have run micro-batch 0
    assert r.timeline[2][0].start == 3.0


def test_rendezvous_sends() -> None:
    # GPipe works with blocking sends; 1F1B's steady state does not.
    eager = simulate(gpipe(3, 4))
    assert simulate(gpipe(3, 4), sends="rendezvous").makespan == eager.makespan
    with pytest.raises(ScheduleDeadlock) as info:
        simulate(one_f_one_b(2, 2), sends="rendezvous")
    assert set(info.value.stuck) == {0, 1}
    assert info.value.stuck[0][1].kind is ActionKind.SEND_ACT
    assert info.value.stuck[1][1].kind is ActionKind.SEND_GRAD


# --- broken schedules --------------------------------------------------------


def test_deadlock_is_detected_and_named() -> None:
    sched = one_f_one_b(2, 2)
    # rank 0 waits for the gradient of micro-batch 0 before sending its activation
    sched[0].remove(RG(0, 0, 1))
    sched[0].insert(0, RG(0, 0, 1))
    with pytest.raises(ScheduleDeadlock) as info:
        simulate(sched)
    assert isinstance(info.value, ScheduleError)
    assert info.value.stuck == {0: (0, RG(0, 0, 1)), 1: (0, RA(0, 1, 0))}
    msg = str(info.value)
    assert "rank 0" in msg and "rank 1" in msg and "recv_grad(mb=0, stage=0, peer=1)" in msg


def test_missing_recv_is_out_of_order() -> None:
    sched = gpipe(2, 2)
    sched[1].remove(RA(1, 1, 0))
    with pytest.raises(ScheduleError, match="before its input activation"):
        simulate(sched)


def test_backward_before_forward() -> None:
    sched = [[B(0, 0), F(0, 0)]]
    with pytest.raises(ScheduleError, match="before forward"):
        simulate(sched)


def test_duplicate_and_missing_compute() -> None:
    with pytest.raises(ScheduleError, match="twice"):
        simulate([[F(0, 0), F(0, 0), B(0, 0)]])
    with pytest.raises(ScheduleError, match=r"missing backward\(mb=1, stage=0\)"):
        simulate([[F(0, 0), F(1, 0), B(0, 0)]])
    with pytest.raises(ScheduleError, match="rank 0 and on rank 1"):
        simulate([[F(0, 0), B(0, 0)], [F(1, 0), B(1, 0)]])


def test_wrong_peer_and_duplicate_send() -> None:
    sched = gpipe(3, 1)
    sched[0][1] = SA(0, 0, 2)
    with pytest.raises(ScheduleError, match="peer must be 1"):
        simulate(sched)
    sched = gpipe(2, 1)
    sched[0].insert(2, SA(0, 0, 1))
    with pytest.raises(ScheduleError, match="sent twice"):
        simulate(sched)


def test_simulate_rejects_bad_arguments() -> None:
    with pytest.raises(ScheduleError, match="empty"):
        simulate([])
    with pytest.raises(PipelineTypeError):
        simulate([["forward"]])  # type: ignore[list-item]
    with pytest.raises(PipelineError, match="forward_time"):
        simulate(gpipe(2, 2), forward_time=-1.0)
    with pytest.raises(PipelineError, match="one time per stage"):
        simulate(gpipe(2, 2), forward_time=[1.0])
    with pytest.raises(PipelineError, match="sends"):
        simulate(gpipe(2, 2), sends="sometimes")  # type: ignore[arg-type]


# --- argument errors ---------------------------------------------------------


def test_action_validation() -> None:
    assert Action("forward", 0, 0).kind is ActionKind.FORWARD  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match="kind must be one of .*'forward'.*got 'fwd'"):
        Action("fwd", 0, 0)  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match="peer .* required"):
        Action(ActionKind.SEND_ACT, 0, 0)
    with pytest.raises(PipelineError, match="peer must be None"):
        Action(ActionKind.FORWARD, 0, 0, 1)
    with pytest.raises(PipelineError, match="microbatch must be an integer >= 0, got -1"):
        Action(ActionKind.FORWARD, -1, 0)
    with pytest.raises(TypeError):
        Action(ActionKind.FORWARD, 0, True)


def test_generator_errors() -> None:
    with pytest.raises(PipelineError, match="stages must be an integer >= 1, got 0"):
        gpipe(0, 4)
    with pytest.raises(PipelineError, match="microbatches must be an integer >= 1, got 0"):
        one_f_one_b(2, 0)
    with pytest.raises(PipelineTypeError, match="stages"):
        one_f_one_b(2.0, 4)  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match=r"multiple of stages=4 .* microbatches=6; use e.g. 4 or 8"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(PipelineError, match="chunks must be an integer >= 1"):
        interleaved_1f1b(2, 4, 0)


def test_get_schedule_errors() -> None:
    with pytest.raises(PipelineError, match="'gpipe', '1f1b', 'interleaved'.*got 'pipedream'"):
        get_schedule("pipedream", 2, 2)
    with pytest.raises(PipelineError, match="chunks must be 1 for the 'gpipe' schedule"):
        get_schedule("gpipe", 2, 2, chunks=2)
    with pytest.raises(PipelineTypeError):
        get_schedule(None, 2, 2)  # type: ignore[arg-type]
    assert issubclass(PipelineError, ValueError)
    assert issubclass(PipelineTypeError, TypeError)
