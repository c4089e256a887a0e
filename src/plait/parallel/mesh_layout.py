"""Rank-group arithmetic for a data x pipeline x tensor parallel mesh.

Pure functions; no communicator is touched. A rank's coordinates are its
position along the three axes ``"dp"`` (data), ``"pp"`` (pipeline) and
``"tp"`` (tensor). The ``order`` of a :class:`MeshShape` lists the axes from
the fastest-varying to the slowest, as in Megatron's ``"tp-dp-pp"`` default:
tensor-parallel peers are adjacent ranks (one node, fast links), pipeline
stages are the farthest apart::

    rank = tp + tp_size * (dp + dp_size * pp)          # order "tp-dp-pp"

With 8 ranks and ``dp = pp = tp = 2`` the groups are::

    tp: [0, 1] [2, 3] [4, 5] [6, 7]
    dp: [0, 2] [1, 3] [4, 6] [5, 7]
    pp: [0, 4] [1, 5] [2, 6] [3, 7]

Groups of an axis are listed by their smallest rank; a group lists its ranks
by their coordinate along the axis, which is also the rank's rank inside
the group.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._checks import check_int

__all__ = [
    "AXES",
    "DEFAULT_ORDER",
    "MeshError",
    "MeshShape",
    "MeshTypeError",
    "coords",
    "group_of",
    "groups",
    "rank_of",
    "split_colors",
]

AXES: tuple[str, str, str] = ("dp", "pp", "tp")
"""The mesh axes: data, pipeline and tensor parallel."""

DEFAULT_ORDER = "tp-dp-pp"
"""Megatron's rank order: tensor fastest, then data, then pipeline slowest."""


class MeshError(ValueError):
    """An impossible mesh: bad sizes, a size mismatch, an unknown axis or rank."""


class MeshTypeError(MeshError, TypeError):
    """A mesh argument has the wrong type (also a :class:`TypeError`)."""


def _parse_order(order: object) -> tuple[str, ...]:
    if not isinstance(order, str):
        raise MeshTypeError(
            f"order must be a string such as {DEFAULT_ORDER!r}, got {order!r}"
        )
    parts = tuple(p.strip().lower() for p in order.split("-"))
    if sorted(parts) != sorted(AXES):
        raise MeshError(
            f"order must name each of 'dp', 'pp', 'tp' once, fastest-varying first and "
            f"separated by '-', e.g. {DEFAULT_ORDER!r} or 'tp-pp-dp', got {order!r}"
        )
    return parts


@dataclass(frozen=True)
class MeshShape:
    """Sizes and rank order of a dp x pp x tp mesh.

    Args:
        dp: Data-parallel size, ``>= 1``.
        pp: Pipeline-parallel size, ``>= 1``.
        tp: Tensor-parallel size, ``>= 1``.
        order: Axes from fastest- to slowest-varying rank, ``"-"``-separated
            (default ``"tp-dp-pp"``, Megatron's).
        world_size: If given, checked to equal ``dp * pp * tp``.

    Raises:
        MeshTypeError: A size is not an integer or ``order`` not a string.
        MeshError: A size is below 1, ``order`` is not a permutation of the
            three axes, or ``dp * pp * tp != world_size``.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    order: str = DEFAULT_ORDER
    world_size: int | None = None

    def __post_init__(self) -> None:
        for axis in AXES:
            check_int(
                axis, getattr(self, axis), minimum=1,
                value_error=MeshError, type_error=MeshTypeError,
            )
        object.__setattr__(self, "order", "-".join(_parse_order(self.order)))
        size = self.dp * self.pp * self.tp
        if self.world_size is None:
            object.__setattr__(self, "world_size", size)
        else:
            world = check_int(
                "world_size", self.world_size, minimum=1,
                value_error=MeshError, type_error=MeshTypeError,
            )
            if world != size:
                raise MeshError(
                    f"dp * pp * tp must equal the world size: dp={self.dp} * pp={self.pp} "
                    f"* tp={self.tp} = {size}, but world_size={world}"
                )

    @classmethod
    def for_world(
        cls,
        world_size: int,
        *,
        dp: int | None = None,
        pp: int = 1,
        tp: int = 1,
        order: str = DEFAULT_ORDER,
    ) -> MeshShape:
        """Build a mesh for ``world_size`` ranks, deriving ``dp`` when omitted.

        Args:
            world_size: Number of ranks, ``>= 1``.
            dp: Data-parallel size; ``None`` means ``world_size // (pp * tp)``.
            pp: Pipeline-parallel size.
            tp: Tensor-parallel size.
            order: Rank order, see :class:`MeshShape`.

        Returns:
            The validated shape.

        Raises:
            MeshTypeError: An argument has the wrong type.
            MeshError: ``pp * tp`` does not divide ``world_size`` (when ``dp``
                is omitted) or ``dp * pp * tp != world_size``.
        """
        world = check_int(
            "world_size", world_size, minimum=1, value_error=MeshError, type_error=MeshTypeError
        )
        if dp is None:
            check_int("pp", pp, minimum=1, value_error=MeshError, type_error=MeshTypeError)
            check_int("tp", tp, minimum=1, value_error=MeshError, type_error=MeshTypeError)
            if world % (pp * tp) != 0:
                raise MeshError(
                    f"pp * tp must divide the world size to derive dp: pp={pp} * tp={tp} = "
                    f"{pp * tp} does not divide world_size={world}"
                )
            dp = world // (pp * tp)
        return cls(dp=dp, pp=pp, tp=tp, order=order, world_size=world)

    @property
    def size(self) -> int:
        """Number of ranks, ``dp * pp * tp``."""
        return self.dp * self.pp * self.tp

    def axis_size(self, axis: str) -> int:
        """Size of ``axis`` (``"dp"``, ``"pp"`` or ``"tp"``).

        Raises:
            MeshError: Unknown axis.
        """
        return int(getattr(self, _check_axis(axis)))

    def strides(self) -> dict[str, int]:
        """Rank distance between neighbours along each axis."""
        out: dict[str, int] = {}
        stride = 1
        for axis in self.order.split("-"):
            out[axis] = stride
            stride *= getattr(self, axis)
        return out


def _check_axis(axis: object) -> str:
    if not isinstance(axis, str) or axis not in AXES:
        raise MeshError(f"axis must be one of 'dp', 'pp', 'tp', got {axis!r}")
    return axis


def _check_shape(shape: object) -> MeshShape:
    if not isinstance(shape, MeshShape):
        raise MeshTypeError(f"shape must be a MeshShape, got {type(shape).__name__}")
    return shape


def _check_rank(shape: MeshShape, rank: object) -> int:
    r = check_int("rank", rank, minimum=0, value_error=MeshError, type_error=MeshTypeError)
    if r >= shape.size:
        raise MeshError(
            f"rank must be in 0..{shape.size - 1} for a mesh of {shape.size} ranks, got {r}"
        )
    return r


def coords(shape: MeshShape, rank: int) -> dict[str, int]:
    """Coordinates of ``rank`` along each axis.

    Args:
        shape: The mesh.
        rank: A rank in ``0..shape.size - 1``.

    Returns:
        ``{"dp": ..., "pp": ..., "tp": ...}``.

    Raises:
        MeshTypeError: ``shape`` is not a :class:`MeshShape` or ``rank`` not an int.
        MeshError: ``rank`` is out of range.
    """
    shape = _check_shape(shape)
    rest = _check_rank(shape, rank)
    out: dict[str, int] = {}
    for axis in shape.order.split("-"):
        size = getattr(shape, axis)
        out[axis] = rest % size
        rest //= size
    return {axis: out[axis] for axis in AXES}


def rank_of(shape: MeshShape, *, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
    """The rank at the given coordinates.

    Args:
        shape: The mesh.
        dp: Data-parallel coordinate, ``0 <= dp < shape.dp``.
        pp: Pipeline coordinate, ``0 <= pp < shape.pp``.
        tp: Tensor-parallel coordinate, ``0 <= tp < shape.tp``.

    Returns:
        The global rank.

    Raises:
        MeshTypeError: ``shape`` is not a :class:`MeshShape` or a coordinate not an int.
        MeshError: A coordinate is out of range.
    """
    shape = _check_shape(shape)
    given = {"dp": dp, "pp": pp, "tp": tp}
    strides = shape.strides()
    rank = 0
    for axis in AXES:
        c = check_int(axis, given[axis], minimum=0, value_error=MeshError,
                      type_error=MeshTypeError)
        size = getattr(shape, axis)
        if c >= size:
            raise MeshError(f"{axis} must be in 0..{size - 1} for {axis} size {size}, got {c}")
        rank += c * strides[axis]
    return rank


def groups(shape: MeshShape, axis: str) -> list[list[int]]:
    """All process groups along ``axis``.

    Args:
        shape: The mesh.
        axis: ``"dp"``, ``"pp"`` or ``"tp"``.

    Returns:
        The groups, ordered by smallest rank; each lists its ranks by their
        coordinate along ``axis``. Every rank is in exactly one group.

    Raises:
        MeshTypeError: ``shape`` is not a :class:`MeshShape`.
        MeshError: Unknown axis.
    """
    shape = _check_shape(shape)
    axis = _check_axis(axis)
    stride = shape.strides()[axis]
    size = getattr(shape, axis)
    return [
        [base + i * stride for i in range(size)]
        for base in range(shape.size)
        if (base // stride) % size == 0
    ]


def group_of(shape: MeshShape, rank: int, axis: str) -> list[int]:
    """The group along ``axis`` that contains ``rank``.

    Args:
        shape: The mesh.
        rank: A rank in ``0..shape.size - 1``.
        axis: ``"dp"``, ``"pp"`` or ``"tp"``.

    Returns:
        The ranks of the group, by coordinate along ``axis``.

    Raises:
        MeshTypeError: ``shape`` is not a :class:`MeshShape` or ``rank`` not an int.
        MeshError: Unknown axis or rank out of range.
    """
    shape = _check_shape(shape)
    axis = _check_axis(axis)
    r = _check_rank(shape, rank)
    stride = shape.strides()[axis]
    size = getattr(shape, axis)
    base = r - ((r // stride) % size) * stride
    return [base + i * stride for i in range(size)]


def split_colors(shape: MeshShape, rank: int, axis: str) -> tuple[int, int]:
    """``(color, key)`` for ``comm.split`` to build the ``axis`` group of ``rank``.

    Ranks of one group share ``color``, the index of the group in
    :func:`groups`; ``key`` is the rank's coordinate along ``axis``, so the
    rank inside the new communicator equals that coordinate.

    Args:
        shape: The mesh.
        rank: A rank in ``0..shape.size - 1``.
        axis: ``"dp"``, ``"pp"`` or ``"tp"``.

    Returns:
        ``(color, key)``, both non-negative.

    Raises:
        MeshTypeError: ``shape`` is not a :class:`MeshShape` or ``rank`` not an int.
        MeshError: Unknown axis or rank out of range.
    """
    shape = _check_shape(shape)
    axis = _check_axis(axis)
    c = coords(shape, rank)
    color = 0
    radix = 1
    for other in shape.order.split("-"):
        if other != axis:
            color += c[other] * radix
            radix *= getattr(shape, other)
    return color, c[axis]
