"""Horovod's process sets on plait's communicators: ``hvd.ProcessSet``,
``hvd.add_process_set``, ``hvd.remove_process_set``, ``hvd.global_process_set`` and
``hvd.init(process_sets=...)``, built on :meth:`Communicator.split`.

As in Horovod, a process set is named by global ranks (sorted) or by an mpi4py
communicator (each rank's own: ``ProcessSet(MPI.COMM_WORLD.Split(...))`` makes one set
per colour), adding one is a collective call of every rank (in the same order
everywhere), and only its members may run collectives on it. Framework-free.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from . import runtime
from .errors import ConfigError, PlaitTypeError
from .protocols import Communicator

__all__ = ["ProcessSet", "add_process_set", "comm_process_set_id", "communicator",
           "global_process_set", "ids_and_ranks", "included", "init_process_sets",
           "note_dynamic_env", "outside", "remove_process_set", "set_size"]


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Pass it to ``hvd.init(process_sets=[...])`` or :func:`add_process_set`; once
    registered it has a ``process_set_id`` and can be given as ``process_set=`` to
    the faces' collectives and optimizers.

    Args:
        ranks_or_comm: global ranks of the members (any order; kept sorted), or an
            mpi4py communicator (its ranks are known once ``hvd.init`` registers it).

    Raises:
        PlaitTypeError: for anything but a sequence of ranks or an mpi4py communicator.
        ConfigError: (a ``ValueError``, as Horovod raises) for ranks that are not ints.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        #: The sorted global ranks; None for a set built from a communicator before ``init``.
        self.ranks: list[int] | None = None
        self.process_set_id: int | None = None
        #: The mpi4py communicator the set was built from (Horovod's attribute), else None.
        self.mpi_comm: Any = None
        self._comm: Communicator | None = None
        if _is_mpi_comm(ranks_or_comm):
            self.mpi_comm = ranks_or_comm
            return
        if isinstance(ranks_or_comm, (str, bytes)) or not hasattr(ranks_or_comm, "__iter__"):
            raise PlaitTypeError(
                f"invalid ProcessSet({ranks_or_comm!r}): expected a list of global ranks or an "
                "mpi4py communicator")
        values = list(ranks_or_comm)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in values):
            raise ConfigError(f"invalid ProcessSet({values!r}): expected a list of int ranks")
        self.ranks = sorted(values)

    def size(self) -> int | None:
        """Number of ranks in the set, or None before it is registered."""
        if self.process_set_id is None:
            return None
        return len(self.ranks or ()) if self.process_set_id else runtime.world().size

    def rank(self) -> int | None:
        """This process's rank within the set, or None before it is registered.

        Raises:
            ConfigError: when this process is not a member (Horovod's ``ValueError``).
        """
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return runtime.world().rank
        me, ranks = runtime.world().rank, self.ranks or []
        if me not in ranks:
            raise ConfigError(f"Process is not part of provided process set: rank {me} is not in "
                              f"{self}")
        return ranks.index(me)

    def included(self) -> bool | None:
        """Whether this process is a member (None for the global set before ``init``)."""
        if self.process_set_id == 0:
            return True
        if not self.ranks:
            return None
        return runtime.world().rank in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id, self._comm = None, None

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


def _is_mpi_comm(value: Any) -> bool:
    """Whether ``value`` is an mpi4py communicator (without importing mpi4py otherwise)."""
    if not type(value).__module__.startswith("mpi4py"):
        return False
    from mpi4py import MPI

    return isinstance(value, MPI.Comm)


def _world_ranks(comm: Any, world: Communicator) -> list[int]:
    """The sorted global ranks of the mpi4py communicator ``comm``'s members.

    Raises:
        NotImplementedError: when plait's world is not MPI's ``COMM_WORLD`` (a job not
            started by ``mpirun``).
    """
    from mpi4py import MPI

    if (MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()) != (world.size, world.rank):
        raise NotImplementedError(
            f"process sets from an MPI communicator need a job whose ranks are MPI's COMM_WORLD "
            f"(started by mpirun); here MPI has {MPI.COMM_WORLD.Get_size()} rank(s) and plait "
            f"{world.size}: pass the global ranks instead, ProcessSet([...])")
    group, whole = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return sorted(int(r) for r in MPI.Group.Translate_ranks(
            group, list(range(comm.Get_size())), whole))
    finally:
        group.Free()
        whole.Free()


class _Registry:
    """The process sets of this process (the world is one per process)."""

    def __init__(self) -> None:
        self.sets: dict[int, ProcessSet] = {}
        #: Every object given each registered id (Horovod invalidates them all on removal).
        self.holders: dict[int, list[ProcessSet]] = {}
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

    def find(self, ranks: list[int]) -> int | None:
        """The id of the registered set of exactly ``ranks``, if any."""
        return next((i for i, ps in self.sets.items() if ps.ranks == ranks), None)

    def hold(self, ps: ProcessSet, ps_id: int) -> None:
        """Give ``ps`` the registered set ``ps_id``'s id, ranks and communicator."""
        reg = self.sets[ps_id]
        ps.process_set_id, ps._comm, ps.ranks = ps_id, reg._comm, list(reg.ranks or ())
        held = self.holders.setdefault(ps_id, [])
        if not any(h is ps for h in held):
            held.append(ps)

    def drop(self, ps_id: int) -> None:
        del self.sets[ps_id]
        for ps in self.holders.pop(ps_id, []):
            ps._invalidate()

    def reset(self, world: Communicator) -> None:
        if self.world is not world:
            for ps_id in list(self.sets):
                self.drop(ps_id)
            self.world = world


_REG = _Registry()

#: Every rank (Horovod's ``hvd.global_process_set``, id 0).
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _check_ranks(ranks: list[int], world: Communicator, what: str) -> None:
    """Raise ConfigError unless ``ranks`` are distinct global ranks, at least one."""
    bad = [r for r in ranks if not 0 <= r < world.size]
    if not ranks or bad or len(set(ranks)) != len(ranks):
        raise ConfigError(f"invalid {what} ranks={ranks!r}: expected distinct global ranks in "
                          f"[0, {world.size}), at least one")


def _add(ps: ProcessSet, world: Communicator) -> int:
    """Register ``ps`` (its ranks checked, new) under a free id, returned: collective over
    the world."""
    ranks = ps.ranks or []
    member = world.rank in ranks
    sub = world.split(0 if member else 1, world.rank)  # collective over every rank
    # every rank leaves together, as from Horovod's registration: the new groups' first ops
    # (their topology) meet only their members, and a rank done with its own that shut
    # Horovod down at once failed another group's still pending (Horovod backend)
    world.barrier()
    ps_id = _REG.free_id()
    ps._comm, ps.process_set_id = (sub if member else None), ps_id
    _REG.sets[ps_id] = ps
    _REG.holders[ps_id] = [ps]
    return ps_id


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
    out.update((ps_id, list(ps.ranks or ())) for ps_id, ps in sorted(_REG.sets.items()))
    return out


def comm_process_set_id(comm: Any) -> int:
    """The id of the registered process set whose members are those of the mpi4py
    communicator ``comm`` (Horovod's internal ``_basics._comm_process_set_id``).

    Args:
        comm: an mpi4py communicator.

    Returns:
        0 for every rank, else the registered set's id.

    Raises:
        ConfigError: for anything but a communicator, or one no registered set matches.
    """
    if not _is_mpi_comm(comm):
        raise ConfigError(f"invalid comm={comm!r}: expected an mpi4py communicator")
    world = runtime.world()
    _REG.reset(world)
    ranks = _world_ranks(comm, world)
    ps_id = 0 if ranks == list(range(world.size)) else _REG.find(ranks)
    if ps_id is None:
        raise ConfigError(f"invalid comm={comm!r}: its ranks {ranks} are no registered process set "
                          f"({ids_and_ranks()})")
    return ps_id


def init_process_sets(process_sets: Any, comm: Any = None) -> None:
    """``hvd.init(process_sets=...)``: register each set (collective), or allow
    :func:`add_process_set` later with ``"dynamic"``.

    As Horovod does, every distinct set is registered once, those built from an mpi4py
    communicator first (each rank's own communicator: one set per distinct group of
    ranks, in order of their lowest rank), then the entries given by ranks; a set that
    is already registered keeps its id. An entry that names the same ranks as an earlier
    one (or every rank) is then refused on the ranks where it does.

    Args:
        process_sets: None, ``"dynamic"`` or a list of :class:`ProcessSet`.
        comm: ``hvd.init``'s ``comm``; sets built from a communicator need it to be an
            mpi4py communicator of every process, as in Horovod.

    Raises:
        ConfigError: for invalid ranks (then none of the sets is registered), a
            duplicate entry, or another kind of value (Horovod's ``ValueError``).
        NotImplementedError: for sets built from a communicator without an mpi4py
            ``comm`` (Horovod's error), or in a job not started by ``mpirun``.
    """
    world = runtime.world()
    _REG.reset(world)
    global_process_set.ranks = list(range(world.size))
    if _is_mpi_comm(comm):
        global_process_set.mpi_comm = comm
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
        if ps.ranks is not None:
            _check_ranks(ps.ranks, world, f"process_sets[{i}]")
    by_comm = [ps for ps in process_sets if ps.ranks is None]
    mine: list[list[int]] = []
    groups: list[list[int]] = []
    if by_comm:
        if not _is_mpi_comm(comm):
            raise NotImplementedError(
                "process sets defined via MPI communicators are only supported when calling "
                "hvd.init() with comm set to a global MPI communicator (as in Horovod)")
        mine = [_world_ranks(ps.mpi_comm, world) for ps in by_comm]
        everyone = world.allgather_object(mine)
        counts = [len(theirs) for theirs in everyone]
        if len(set(counts)) > 1:
            raise ConfigError(f"invalid process_sets: the ranks give different numbers of sets "
                              f"built from an MPI communicator ({counts}, by rank)")
        groups = [theirs[i] for i in range(len(mine)) for theirs in everyone]
    groups += [ps.ranks for ps in process_sets if ps.ranks is not None]
    whole = list(range(world.size))
    ids = {tuple(whole): 0}
    for ranks in groups:
        if tuple(ranks) not in ids:
            found = _REG.find(ranks)
            ids[tuple(ranks)] = found if found is not None else _add(ProcessSet(ranks), world)
    seen, dups = {0}, []
    for i, ps in enumerate(process_sets):
        ranks = ps.ranks if ps.ranks is not None else mine[by_comm.index(ps)]
        ps_id = ids[tuple(ranks)]
        if ps_id in seen:
            ps.ranks = ranks
            ps._invalidate()
            dups.append(f"process_sets[{i}]={ps}")
            continue
        seen.add(ps_id)
        _REG.hold(ps, ps_id)
    if dups:
        raise ConfigError(f"Attempted to add a duplicate process set: {', '.join(dups)} names the "
                          "ranks of an earlier entry or of every rank (the distinct sets are "
                          "registered)")


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
        NotImplementedError: for a set built from an MPI communicator (as in Horovod).
    """
    if not (_REG.dynamic or _REG.env_dynamic):
        raise ConfigError("add_process_set needs dynamic process sets: call "
                          "hvd.init(process_sets='dynamic') or set HOROVOD_DYNAMIC_PROCESS_SETS=1")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None:
        raise NotImplementedError("adding a process set built from an MPI communicator after "
                                  "init is not implemented (as in Horovod): give its ranks")
    world = runtime.world()
    _REG.reset(world)
    _check_ranks(ps.ranks, world, "process set")
    if ps.ranks == list(range(world.size)) or _REG.find(ps.ranks) is not None:
        raise ConfigError(f"Attempted to add a duplicate process set: {ps}")
    if ps.process_set_id is not None:
        raise ConfigError(f"{ps} is already registered")
    _add(ps, world)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Forget a process set added before (and every object that holds its id).

    Args:
        process_set: the set.

    Returns:
        Whether it was removed (False for the global set or one never registered).
    """
    ps_id = process_set.process_set_id
    if not ps_id or not any(h is process_set for h in _REG.holders.get(ps_id, [])):
        return False
    _REG.drop(ps_id)
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
    return len(_lookup(process_set_id).ranks or ())
