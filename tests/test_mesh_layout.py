"""Rank-group arithmetic of a dp x pp x tp mesh (pure, no MPI)."""

from __future__ import annotations

import itertools

import pytest

from plait.parallel.mesh_layout import (
    AXES,
    MeshError,
    MeshShape,
    MeshTypeError,
    coords,
    group_of,
    groups,
    rank_of,
    split_colors,
)

ORDERS = ["-".join(p) for p in itertools.permutations(AXES)]


def shapes(max_world: int = 16) -> list[MeshShape]:
    out: list[MeshShape] = []
    for world in range(1, max_world + 1):
        for dp in range(1, world + 1):
            for pp in range(1, world // dp + 1):
                if world % (dp * pp) == 0:
                    tp = world // (dp * pp)
                    out.extend(MeshShape(dp, pp, tp, order=o) for o in ORDERS)
    return out


ALL_SHAPES = shapes()


def test_megatron_example_8() -> None:
    s = MeshShape(dp=2, pp=2, tp=2)
    assert s.order == "tp-dp-pp" and s.size == 8 and s.world_size == 8
    assert groups(s, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(s, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(s, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_megatron_docstring_example_16() -> None:
    # Megatron's parallel_state docstring: 16 GPUs, tp=2, pp=4, so dp=2.
    s = MeshShape.for_world(16, tp=2, pp=4)
    assert s.dp == 2
    assert groups(s, "tp") == [[i, i + 1] for i in range(0, 16, 2)]
    assert groups(s, "dp") == [
        [0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15],
    ]
    assert groups(s, "pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_other_order() -> None:
    s = MeshShape(dp=2, pp=3, tp=1, order="pp-dp-tp")
    assert groups(s, "pp") == [[0, 1, 2], [3, 4, 5]]
    assert groups(s, "dp") == [[0, 3], [1, 4], [2, 5]]
    assert groups(s, "tp") == [[r] for r in range(6)]
    assert MeshShape(order=" TP-PP-DP ").order == "tp-pp-dp"


@pytest.mark.parametrize("axis", AXES)
def test_every_rank_in_exactly_one_group(axis: str) -> None:
    for s in ALL_SHAPES:
        gs = groups(s, axis)
        flat = sorted(r for g in gs for r in g)
        assert flat == list(range(s.size)), (s, axis)
        assert len(gs) == s.size // s.axis_size(axis)
        assert all(len(g) == s.axis_size(axis) for g in gs)
        assert [g[0] for g in gs] == sorted(g[0] for g in gs)


def test_coords_rank_of_round_trip_and_formula() -> None:
    for s in ALL_SHAPES:
        strides = s.strides()
        for r in range(s.size):
            c = coords(s, r)
            assert rank_of(s, **c) == r
            assert sum(c[a] * strides[a] for a in AXES) == r
            if s.order == "tp-dp-pp":
                assert r == c["tp"] + s.tp * (c["dp"] + s.dp * c["pp"])


def test_group_of_and_split_colors_agree_with_groups() -> None:
    for s in ALL_SHAPES:
        cs = [coords(s, r) for r in range(s.size)]
        for axis in AXES:
            gs = groups(s, axis)
            others = [a for a in AXES if a != axis]
            for r in range(s.size):
                g = group_of(s, r, axis)
                color, key = split_colors(s, r, axis)
                assert gs[color] == g
                assert g[key] == r
                assert key == cs[r][axis]
                # members of a group differ only along the axis
                assert {tuple(cs[m][a] for a in others) for m in g} == {
                    tuple(cs[r][a] for a in others)
                }


def test_world_size_mismatch() -> None:
    with pytest.raises(MeshError, match=r"dp=2 \* pp=2 \* tp=2 = 8, but world_size=6"):
        MeshShape(dp=2, pp=2, tp=2, world_size=6)
    with pytest.raises(MeshError, match=r"pp=4 \* tp=1 = 4 does not divide world_size=6"):
        MeshShape.for_world(6, pp=4)
    with pytest.raises(MeshError, match=r"= 4, but world_size=8"):
        MeshShape.for_world(8, dp=2, pp=2)
    assert MeshShape.for_world(8, tp=2) == MeshShape(dp=4, tp=2)


def test_bad_arguments() -> None:
    with pytest.raises(MeshError, match="tp must be an integer >= 1, got 0"):
        MeshShape(dp=1, pp=1, tp=0)
    with pytest.raises(MeshError, match="dp must be an integer >= 1, got -2"):
        MeshShape(dp=-2)
    with pytest.raises(MeshTypeError, match="pp"):
        MeshShape(pp=True)
    with pytest.raises(TypeError):
        MeshShape(dp=2.0)  # type: ignore[arg-type]
    with pytest.raises(MeshError, match="order must name each of .* got 'tp-dp'"):
        MeshShape(order="tp-dp")
    with pytest.raises(MeshError, match="order"):
        MeshShape(order="tp-tp-pp")
    s = MeshShape(dp=2, tp=2)
    with pytest.raises(MeshError, match="axis must be one of 'dp', 'pp', 'tp', got 'ep'"):
        groups(s, "ep")
    with pytest.raises(MeshError, match=r"rank must be in 0..3 for a mesh of 4 ranks, got 4"):
        coords(s, 4)
    with pytest.raises(MeshError, match=r"tp must be in 0..1 for tp size 2, got 2"):
        rank_of(s, tp=2)
    with pytest.raises(MeshError, match="rank"):
        split_colors(s, -1, "dp")
    with pytest.raises(MeshTypeError, match="MeshShape"):
        groups((2, 1, 2), "dp")  # type: ignore[arg-type]
    assert issubclass(MeshError, ValueError) and issubclass(MeshTypeError, TypeError)
