"""Horovod's process sets on plait's communicators: ``hvd.ProcessSet``,
``hvd.add_process_set``, ``hvd.remove_process_set``, ``hvd.global_process_set`` and
``hvd.init(process_sets=...)``, built on :meth:`Communicator.split`.

As in Horovod, a process set is named by global ranks (sorted), adding one is a
collective call of every rank (in the same order everywhere), and only its
members may run collectives on it. Framework-free.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from . import runtime
from .errors import ConfigError, PlaitTypeError
from .protocols import Communicator

__all__ = ["ProcessSet", "add_process_set", "communicator", "global_process_set",
           "ids_and_ranks", "included", "init_process_sets", "note_dynamic_env", "outside",
           "remove_process_set", "set_size"]


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Pass it to ``hvd.init(process_sets=[...])`` or :func:`add_process_set`; once
    registered it has a ``process_set_id`` and can be given as ``process_set=`` to
    the faces' collectives and optimizers.

    Args:
        ranks: global ranks of the members (any order; kept sorted).

    Raises:
        PlaitTypeError: for anything but a sequence (plait does not take an mpi4py
            communicator here; use the ranks).
        ConfigError: (a ``ValueError``, as Horovod raises) for ranks that are not ints.
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks: list[int] = []
        self.process_set_id: int | None = None
        #: Horovod's attribute for a set built from an MPI communicator: always None here.
        self.mpi_comm: Any = None
        self._comm: Communicator | None = None
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise PlaitTypeError(
                f"invalid ProcessSet({ranks!r}): expected a list of global ranks (plait does not "
                "build process sets from an MPI communicator)")
        values = list(ranks)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in values):
            raise ConfigError(f"invalid ProcessSet({values!r}): expected a list of int ranks")
        self.ranks = sorted(values)

    def size(self) -> int | None:
        """Number of ranks in the set, or None before it is registered."""
        if self.process_set_id is None:
            return None
        return len(self.ranks) if self.process_set_id else runtime.world().size

    def rank(self) -> int | None:
        """This process's rank within the set, or None before it is registered.

        Raises:
            ConfigError: when this process is not a member (Horovod's ``ValueError``).
        """
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return runtime.world().rank
        me = runtime.world().rank
        if me not in self.ranks:
            raise ConfigError(f"Process is not part of provided process set: rank {me} is not in "
                              f"{self}")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        """Whether this process is a member (None for the global set before ``init``)."""
        if self.process_set_id == 0:
            return True
        if not self.ranks:
            return None
        return runtime.world().rank in self.ranks

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


class _Registry:
    """The process sets of this process (the world is one per process)."""

    def __init__(self) -> None:
        self.sets: dict[int, ProcessSet] = {}
        self.dynamic = False
        #: The user's HOROVOD_DYNAMIC_PROCESS_SETS, as Horovod reads it: when it starts.
        self.env_dynamic = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1"
        self.world: Communicator | None = None

    def free_id(self) -> int:
        """The smallest unused id (Horovod reuses the ids of removed sets)."""
        ps_id = 1
        while ps_id in self.sets:
            ps_id += 1
        return ps_id

    def reset(self, world: Communicator) -> None:
        if self.world is not world:
            for ps in self.sets.values():
                ps.process_set_id, ps._comm = None, None
            self.sets.clear()
            self.world = world


_REG = _Registry()

#: Every rank (Horovod's ``hvd.global_process_set``, id 0).
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _check(ps: ProcessSet, world: Communicator, others: Sequence[ProcessSet] = ()) -> None:
    """Raise ConfigError unless ``ps`` can be registered next to the registered sets and
    ``others`` (local checks only, so every rank decides alike)."""
    bad = [r for r in ps.ranks if not 0 <= r < world.size]
    if not ps.ranks or bad or len(set(ps.ranks)) != len(ps.ranks):
        raise ConfigError(f"invalid process set ranks={ps.ranks!r}: expected distinct global ranks "
                          f"in [0, {world.size}), at least one")
    if ps.ranks == list(range(world.size)) or any(
            s.ranks == ps.ranks for s in (*_REG.sets.values(), *others)):
        raise ConfigError(f"Attempted to add a duplicate process set: {ps}")
    if ps.process_set_id is not None:
        raise ConfigError(f"{ps} is already registered")


def _register(ps: ProcessSet) -> ProcessSet:
    world = runtime.world()
    _REG.reset(world)
    _check(ps, world)
    member = world.rank in ps.ranks
    sub = world.split(0 if member else 1, world.rank)  # collective over every rank
    # every rank leaves together, as from Horovod's registration: the new groups' first ops
    # (their topology) meet only their members, and a rank done with its own that shut
    # Horovod down at once failed another group's still pending (Horovod backend)
    world.barrier()
    ps._comm = sub if member else None
    ps.process_set_id = _REG.free_id()
    _REG.sets[ps.process_set_id] = ps
    return ps


def note_dynamic_env() -> None:
    """Read ``HOROVOD_DYNAMIC_PROCESS_SETS`` when plait starts, as Horovod reads it when it
    starts (a script may set it after importing the face; plait's Horovod backend sets it
    for itself once started). Call before ``runtime.init``."""
    if not runtime.is_initialized():
        _REG.env_dynamic = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1"


def ids_and_ranks() -> dict[int, list[int]]:
    """Every registered process set's global ranks by id, the global set (0) first
    (Horovod's internal ``_basics._get_process_set_ids_and_ranks()``).

    Returns:
        ``{process_set_id: ranks}``.
    """
    world = runtime.world()
    _REG.reset(world)
    out = {0: list(range(world.size))}
    out.update((ps_id, list(ps.ranks)) for ps_id, ps in sorted(_REG.sets.items()))
    return out


def init_process_sets(process_sets: Any) -> None:
    """``hvd.init(process_sets=...)``: register each set (collective), or allow
    :func:`add_process_set` later with ``"dynamic"``.

    Args:
        process_sets: None, ``"dynamic"`` or a list of :class:`ProcessSet`.

    Raises:
        ConfigError: for a duplicate or invalid set, or another kind of value (Horovod's
            ``ValueError``); then none of the sets is registered.
    """
    world = runtime.world()
    _REG.reset(world)
    global_process_set.ranks = list(range(world.size))
    if process_sets is None:
        return
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ConfigError(f"invalid process_sets={process_sets!r}: expected None, 'dynamic' "
                              "or a list of ProcessSet")
        _REG.dynamic = True
        return
    process_sets = list(process_sets)
    for i, ps in enumerate(process_sets):
        if not isinstance(ps, ProcessSet):
            raise ConfigError(f"invalid process_sets[{i}]={ps!r}: expected a ProcessSet")
        _check(ps, world, process_sets[:i])
    for ps in process_sets:
        _register(ps)


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Add a process set after ``init`` (every rank must call it, in the same order).

    Args:
        process_set: a :class:`ProcessSet` or a list of global ranks.

    Returns:
        The registered process set.

    Raises:
        ConfigError: unless ``init(process_sets="dynamic")`` was called (or
            ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` is set), as in Horovod; for a duplicate
            or invalid set.
    """
    if not (_REG.dynamic or _REG.env_dynamic):
        raise ConfigError("add_process_set needs dynamic process sets: call "
                          "hvd.init(process_sets='dynamic') or set HOROVOD_DYNAMIC_PROCESS_SETS=1")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    return _register(ps)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Forget a process set added before.

    Args:
        process_set: the set.

    Returns:
        Whether it was removed (False for the global set or one never registered).
    """
    ps_id = process_set.process_set_id
    if not ps_id or _REG.sets.get(ps_id) is not process_set:
        return False
    del _REG.sets[ps_id]
    process_set.process_set_id, process_set._comm = None, None
    return True


def outside(process_set: Any) -> bool:
    """Whether ``process_set`` is a registered Horovod process set this rank is not in
    (Horovod's optimizers and tapes then keep this rank's own gradients)."""
    return (isinstance(process_set, ProcessSet) and bool(process_set.process_set_id)
            and process_set.included() is False)


def communicator(process_set: Any) -> tuple[Communicator, list[int] | None]:
    """The communicator behind a face's ``process_set=`` argument.

    Args:
        process_set: None (every rank), a :class:`ProcessSet`, or a plait communicator
            (for example from ``plait.world().split``).

    Returns:
        ``(communicator, global ranks of its members)``; the ranks are None for a plait
        communicator, whose roots are given as group ranks.

    Raises:
        ConfigError: for a set that is not registered, or that this rank is not in.
    """
    if process_set is None:
        return runtime.world(), None
    if not isinstance(process_set, ProcessSet):
        return process_set, None
    if process_set.process_set_id == 0:
        world = runtime.world()
        return world, list(range(world.size))
    if process_set.process_set_id is None or process_set._comm is None and not process_set.ranks:
        raise ConfigError(f"{process_set} is not registered: pass it to hvd.init(process_sets=[...]) "
                          "or hvd.add_process_set() first")
    if process_set._comm is None:
        raise ConfigError(f"rank {runtime.world().rank} is not a part of {process_set}: only its "
                          "members may run collectives on it")
    return process_set._comm, process_set.ranks


def _lookup(process_set_id: int) -> ProcessSet:
    ps = _REG.sets.get(process_set_id)
    if ps is None:
        raise ConfigError(f"invalid process_set_id={process_set_id!r}: expected 0 or the id of a "
                          f"registered process set ({sorted(_REG.sets)})")
    return ps


def included(process_set_id: int) -> bool:
    """Whether this process is in the registered process set ``process_set_id``.

    Args:
        process_set_id: 0 (every rank) or a registered set's id.

    Returns:
        Whether this process is a member.

    Raises:
        ConfigError: for an id that is not registered.
    """
    if process_set_id == 0:
        return True
    return bool(_lookup(process_set_id).included())


def set_size(process_set_id: int) -> int:
    """The number of ranks in the registered process set ``process_set_id``.

    Args:
        process_set_id: 0 (every rank) or a registered set's id.

    Returns:
        Its size (also on ranks that are not members, as in Horovod).

    Raises:
        ConfigError: for an id that is not registered.
    """
    if process_set_id == 0:
        return runtime.world().size
    return len(_lookup(process_set_id).ranks)
