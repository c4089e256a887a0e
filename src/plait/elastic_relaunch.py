"""Horovod's elastic API on the MPI backend: commits persisted, membership changed by relaunch.

Under ``plait run --elastic`` (see :mod:`plait.launch.elastic`) an MPI job cannot
change its world in place, so plait's ``hvd.elastic`` on the MPI backend keeps
Horovod's spelling and semantics with a relaunch in between:

* ``state.commit()`` saves the state in memory (as Horovod's does), writes it to
  ``PLAIT_ELASTIC_DIR`` (one file per host, written by the host's first rank,
  atomically), and checks for host changes: rank 0 asks ``plait run`` and every
  rank learns the answer in one broadcast. After a change every rank raises
  :class:`HostsUpdatedInterrupt` at the same commit;
* ``hvd.elastic.run(func)`` starts by restoring the newest commit any rank's host
  holds (a relaunch), calls the reset callbacks after such a restore (the world
  size may have changed, as after Horovod's reset), makes every rank hold the same
  state (``sync``), and runs ``func``. On :class:`HostsUpdatedInterrupt` the
  process exits with :data:`~plait.launch.elastic.EXIT_RELAUNCH` and ``plait run``
  starts the job again on the new hosts;
* a rank that dies ends the job as any MPI failure does; ``plait run`` starts it
  again and it resumes from the last commit, as Horovod's restore does.

Framework states subclass :class:`State` (``plait.adapters.torch_elastic``).
Without ``plait run --elastic`` (no ``PLAIT_ELASTIC_DIR``) commits stay in memory
and host changes never happen.
"""

from __future__ import annotations

import copy
import glob
import os
import pickle
import socket
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from plait import runtime
from plait.checkpoint.state import Stateful, as_stateful
from plait.collectives.timeline import span
from plait.errors import ConfigError, PlaitError, invalid
from plait.launch.elastic import EXIT_RELAUNCH

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "mismatched", "run", "versions"]

_FILE = "commit-{host}.pkl"


class HostsUpdatedInterrupt(PlaitError):
    """The job's hosts changed: every rank stops at this commit (Horovod's exception).

    Args:
        skip_sync: Horovod's flag (kept for compatibility; a relaunch always syncs).
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the job's hosts changed; it stops here and starts again on them")
        self.skip_sync = skip_sync


def _ask_launcher(addr: str, commits: int) -> int | str:
    """The host generation from ``plait run`` at ``addr``, or why it could not be had."""
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"commit {commits}\n".encode())
            answer = s.makefile().readline().strip()
    except (OSError, ValueError) as exc:
        return str(exc)
    return int(answer) if answer.isdigit() else f"unexpected answer {answer!r}"


class State:
    """Horovod's elastic state: commit, restore, sync and reset callbacks, persisted for a
    relaunch.

    Subclasses extend :meth:`snapshot` and :meth:`load_snapshot` (everything the state
    holds, as picklable copies); this class keeps plain attributes (``State(epoch=0,
    batch=0)`` gives ``state.epoch``, ``state.batch``) and plait state objects.

    Args:
        state: plait state objects by name (``state_dict()``/``load_state_dict()``, or
            residual memories), committed, restored and synchronised with the rest.
        **kwargs: plain attributes, committed and restored with the rest.
    """

    def __init__(self, state: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self._objects: dict[str, Stateful] = {k: as_stateful(v, k) for k, v in (state or {}).items()}
        self._attrs = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._callbacks: list[Callable[[], None]] = []
        self._commits = 0
        self._unreachable = False
        self._saved: Any = None
        self.save()

    # -- what a framework state provides ----------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything to commit, as picklable objects (copies, not views).

        Returns:
            The plain attributes and plait state objects; subclasses add theirs.
        """
        return copy.deepcopy({"attrs": {name: getattr(self, name) for name in self._attrs},
                              "objects": {k: dict(s.state_dict()) for k, s in self._objects.items()}})

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        """Take the state back from :meth:`snapshot`'s result (the caller passes a copy).

        Args:
            snap: a snapshot.
        """
        for name, value in snap["attrs"].items():
            setattr(self, name, value)
        for name, value in snap["objects"].items():
            self._objects[name].load_state_dict(value)

    def gather(self) -> None:
        """Combine what every rank holds before a commit or sync (a collective; here nothing:
        framework states may override it)."""

    # -- Horovod's State API ------------------------------------------------------------
    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called after the world changed (here: after a relaunch restored a commit).

        Args:
            callbacks: functions of no arguments.
        """
        self._callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Call the reset callbacks."""
        for callback in self._callbacks:
            callback()

    def save(self) -> None:
        """Remember the state in memory (the last commit)."""
        self._saved = self.snapshot()

    def restore(self) -> None:
        """Go back to the last commit."""
        self.load_snapshot(copy.deepcopy(self._saved))  # loading may keep the tensors it gets

    def sync(self, root_rank: int = 0) -> None:
        """Make every rank hold ``root_rank``'s state.

        Args:
            root_rank: the rank whose state every rank takes.
        """
        world = runtime.world()
        self.gather()
        if world.size > 1:
            self.load_snapshot(world.broadcast_object(self.snapshot() if world.rank == root_rank
                                                      else None, root_rank))
        self.save()

    def commit(self) -> None:
        """Save the state, persist it for a relaunch, and check for host changes.

        Raises:
            HostsUpdatedInterrupt: on every rank, when the job's hosts changed.
        """
        self._commits += 1
        self.gather()
        self.save()
        self._persist()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when the hosts changed.

        Raises:
            HostsUpdatedInterrupt: the hosts changed since this job started.
        """
        addr = os.environ.get("PLAIT_ELASTIC_ADDR")
        if not addr:
            return
        world = runtime.world()
        changed = False
        if world.rank == 0:
            generation = _ask_launcher(addr, self._commits)
            if isinstance(generation, str):
                if not self._unreachable:  # said once: the job goes on with its hosts
                    print(f"plait elastic: could not ask plait run at {addr} ({generation}); "
                          "host changes are not seen", file=sys.stderr, flush=True)
                self._unreachable = True
            else:
                changed = generation != int(os.environ.get("PLAIT_ELASTIC_GENERATION", "0"))
        if world.broadcast_object(changed, 0):
            raise HostsUpdatedInterrupt()

    # -- persistence -------------------------------------------------------------------
    def _path(self) -> str | None:
        directory = os.environ.get("PLAIT_ELASTIC_DIR")
        if not directory:
            return None
        return os.path.join(directory, _FILE.format(host=socket.gethostname()))

    def _persist(self) -> None:
        path = self._path()
        if path is None or runtime.world().local_rank != 0:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:  # no fsync: a killed process's writes survive; a lost host's
            pickle.dump({"commits": self._commits, "state": self._saved}, f)  # are lost anyway
        os.replace(tmp, path)

    def resume(self) -> bool:
        """Restore the newest persisted commit any rank's host holds, on every rank.

        Returns:
            True when a commit was restored (then every rank holds it).

        Raises:
            ConfigError: on every rank, when some ranks run other plait, torch, TensorFlow
                or Keras versions than most (those ranks also name their host for
                ``plait run``, which leaves it out of the next start).
        """
        world = runtime.world()
        path = self._path()
        mine: dict[str, Any] | None = None
        if path is not None and world.local_rank == 0:  # a killed writer's half-written commit
            for stale in glob.glob(f"{glob.escape(path)}.*.tmp"):
                os.remove(stale)
        if path is not None and os.path.exists(path):
            with open(path, "rb") as f:
                mine = pickle.load(f)
        every = world.allgather_object((-1 if mine is None else int(mine["commits"]), versions()))
        common, odd = mismatched([v for _, v in every])
        if odd:
            if world.rank in odd:  # plait run leaves this host out of the next start
                print(f"plait: rank {world.rank} on host {socket.gethostname()} failed: it runs "
                      f"{every[world.rank][1]}, the job {common}", file=sys.stderr, flush=True)
            raise ConfigError(f"ranks {odd} run other versions than the job ({common}): "
                              f"{', '.join(f'rank {r}: {every[r][1]}' for r in odd)}")
        counts = [c for c, _ in every]
        best = max(counts)
        if best < 0:
            return False
        root = counts.index(best)
        with span("elastic resume", cat="elastic", commit=best, size=world.size,
                  restart=int(os.environ.get("PLAIT_RESTART", "0")), from_rank=root):
            if world.rank == root and mine is not None:
                self.load_snapshot(mine["state"])
            self._commits = best
            self.sync(root)
        return True


def versions() -> str:
    """plait's version and those of the frameworks this process imported (joiners must match)."""
    import plait

    names = ("torch", "tensorflow", "keras")
    found = [f"{n} {getattr(sys.modules[n], '__version__', '?')}" for n in names if n in sys.modules]
    return ", ".join([f"plait {plait.__version__}", *found])


def mismatched(every: list[str]) -> tuple[str, list[int]]:
    """The versions most ranks run, and the ranks that run others.

    Args:
        every: each rank's :func:`versions`.

    Returns:
        ``(common, odd ranks)``; on a tie the lowest rank's versions are the common ones.
    """
    common = max(every, key=lambda v: (every.count(v), -every.index(v)))
    return common, [r for r, v in enumerate(every) if v != common]


class ObjectState(State):
    """Horovod's ``ObjectState``: only plain attributes."""


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``hvd.elastic.run`` on the MPI backend.

    Args:
        func: the training function; its first argument is a :class:`State`.

    Returns:
        The wrapped function: it resumes from the last persisted commit (calling the reset
        callbacks after one), syncs the state from rank 0 otherwise, and runs ``func``; when
        the hosts change, the process exits with ``EXIT_RELAUNCH`` for ``plait run`` to
        start the job again on them.

    Raises:
        ConfigError: when the first argument is not a :class:`State`.
    """

    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise invalid("state", type(state).__name__,
                          "a plait elastic State (e.g. hvd.elastic.TorchState)")
        if state.resume():
            state.on_reset()
        else:
            state.sync()
        try:
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            # every rank raised it at the same commit, so shutting down stays in step
            raise SystemExit(EXIT_RELAUNCH) from None

    return wrapper
