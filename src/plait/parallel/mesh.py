"""``Mesh``: the data, pipeline and tensor sub-communicators of a dp x pp x tp job.

The rank arithmetic is in :mod:`plait.parallel.mesh_layout` (pure functions);
this class only creates each axis's sub-communicator once, with
``comm.split(color, key)``, in the same order on every rank.
"""

from __future__ import annotations

from plait import runtime
from plait.protocols import Communicator

from .mesh_layout import AXES, DEFAULT_ORDER, MeshShape, coords, group_of, split_colors

__all__ = ["Mesh"]


class Mesh:
    """A dp x pp x tp layout of a communicator's ranks, with one communicator per axis.

    Args:
        dp: data-parallel size (default: whatever ``size / (pp * tp)`` is).
        pp: pipeline-parallel size.
        tp: tensor-parallel size.
        comm: the communicator to lay out (default: ``plait.init(backend)``).
        order: axes from fastest- to slowest-varying (Megatron's "tp-dp-pp").
        backend: backend for ``plait.init`` when ``comm`` is not given.

    Raises:
        MeshError: when dp * pp * tp differs from the number of ranks (the message
            shows both), or a size is not a positive integer.

    Attributes:
        shape: the :class:`MeshShape`.
        coords: this rank's coordinates, e.g. ``{"dp": 1, "pp": 0, "tp": 1}``.
        data, pipeline, tensor: the communicators of this rank's groups.
    """

    def __init__(self, dp: int | None = None, pp: int = 1, tp: int = 1, *,
                 comm: Communicator | None = None, order: str = DEFAULT_ORDER,
                 backend: str | None = None) -> None:
        self.world = comm if comm is not None else runtime.init(backend)
        self.shape = MeshShape.for_world(self.world.size, dp=dp, pp=pp, tp=tp, order=order)
        self.rank = self.world.rank
        self.coords = coords(self.shape, self.rank)
        subs = {axis: self.world.split(*split_colors(self.shape, self.rank, axis)) for axis in AXES}
        self.data, self.pipeline, self.tensor = subs["dp"], subs["pp"], subs["tp"]

    def axis(self, name: str) -> Communicator:
        """The communicator of axis "dp", "pp" or "tp"."""
        return {"dp": self.data, "pp": self.pipeline, "tp": self.tensor}[name]

    def group(self, name: str) -> list[int]:
        """World ranks of this rank's group along an axis."""
        return group_of(self.shape, self.rank, name)

    def __repr__(self) -> str:
        s = self.shape
        return f"Mesh(dp={s.dp}, pp={s.pp}, tp={s.tp}, rank={self.rank}, coords={self.coords})"
