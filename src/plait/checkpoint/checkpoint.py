"""``plait.Checkpoint``: periodic atomic checkpoints written by rank 0, restored on every rank."""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from plait.errors import invalid

from .atomic import CheckpointError, Entry, list_complete, read_checkpoint, read_manifest, write_checkpoint
from .ranks import gather_to_root, merge_ranks, pack, scatter_from_root, split_ranks, unpack
from .state import Stateful, as_stateful, is_per_rank

__all__ = ["ASYNC_STATE", "READ_MODES", "AlgorithmState", "Checkpoint", "Codec", "ServerSnapshot",
           "async_algorithm", "codec_for"]

#: How ranks read a checkpoint: rank 0 reads and broadcasts, or every rank reads a shared directory.
READ_MODES = ("broadcast", "shared")
#: Name of an asynchronous algorithm's state among the plait states of a checkpoint.
ASYNC_STATE = "plait.async"

#: (step, rank 0's files, this rank's own files or None, meta)
_Read = tuple[int, dict[str, bytes], "dict[str, bytes] | None", dict[str, Any]]


class Codec(Protocol):
    """Per-framework state gathering/restoring (``plait.adapters.torch_ckpt``, ``tf_ckpt``)."""

    framework: str

    def gather(self, model: Any, optimizer: Any, states: Mapping[str, Stateful],
               extra: Mapping[str, Any]) -> dict[str, bytes]:
        """Serialise everything to named byte strings (no pickle)."""
        ...

    def apply(self, files: Mapping[str, bytes], model: Any, optimizer: Any,
              states: Mapping[str, Stateful], where: str) -> dict[str, Any]:
        """Load ``files`` into the objects; return the ``extra`` mapping saved with them."""
        ...


def codec_for(model: Any) -> Codec:
    """The codec of ``model``'s framework (importing only the adapter of a framework already in use).

    Args:
        model: a ``torch.nn.Module`` or a Keras model.

    Returns:
        The framework's :class:`Codec`.

    Raises:
        ConfigError: for a model of another kind.
    """
    top = type(model).__module__.split(".", 1)[0]
    path = {"torch": "plait.adapters.torch_ckpt", "keras": "plait.adapters.tf_ckpt",
            "tensorflow": "plait.adapters.tf_ckpt", "tf_keras": "plait.adapters.tf_ckpt"}.get(top)
    if path is None:
        for klass in type(model).__mro__:  # a user subclass of nn.Module / keras.Model
            top = klass.__module__.split(".", 1)[0]
            if top in ("torch", "keras", "tensorflow"):
                path = "plait.adapters.torch_ckpt" if top == "torch" else "plait.adapters.tf_ckpt"
                break
    if path is None:
        raise invalid("model", type(model).__qualname__, "a torch.nn.Module or a Keras model")
    codec: Codec = importlib.import_module(path).CODEC
    return codec


def async_algorithm(optimizer: Any) -> Any:
    """The asynchronous algorithm driving ``optimizer`` (``DataParallel(mode="async")``), or None."""
    return getattr(optimizer, "async_algorithm", None) if optimizer is not None else None


class AlgorithmState:
    """:class:`Stateful` view of an asynchronous algorithm (``plait.parallel.asyncdp``).

    Args:
        algorithm: the algorithm (its ``state_dict()`` / ``load_state_dict(state, own)``).
        own: at loading, whether the state is this rank's own (else another rank's, rank 0's,
            of which the algorithm takes only what all ranks share).
    """

    per_rank = True

    def __init__(self, algorithm: Any, own: bool = True) -> None:
        self.algorithm = algorithm
        self.own = own

    def state_dict(self) -> dict[str, Any]:
        """The algorithm's state on this rank."""
        state: dict[str, Any] = self.algorithm.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Give the algorithm its saved state."""
        self.algorithm.load_state_dict(state, own=self.own)


class Checkpoint:
    """Periodic, atomic checkpoints of a training job (DESIGN.md section 4, "Lost work").

    Rank 0 writes (see :mod:`plait.checkpoint.atomic` for the protocol); every rank
    restores. Usage::

        ckpt = plait.Checkpoint("ckpt", every=100, keep=3)
        start = ckpt.restore(model, optimizer)          # 0 on a fresh start
        for step in range(start, steps):
            train_one_step(step)
            ckpt.step_done(step + 1, model, optimizer)  # writes when (step + 1) % every == 0

    What differs per rank is saved for every rank: with an error-feedback memory in
    ``state`` or an asynchronous optimizer (``DataParallel(mode="async")``), saving is
    collective (every rank calls it at the same step) and each rank's model, optimizer,
    RNG and plait state go to rank 0, which writes them next to its own. Restoring gives
    each rank its own state back; on another number of ranks every rank starts from
    rank 0's (with a warning). Parameter servers write their own consistent snapshots:
    server ranks call ``optimizer.serve(checkpoint=ckpt, model=model)``; a worker's
    ``save`` does nothing.

    Args:
        directory: where checkpoints live (shared by all ranks in ``read="shared"`` mode).
        every: write on steps that are multiples of ``every``.
        keep: how many complete checkpoints to keep.
        comm: the communicator (default: ``plait.world()`` when initialised, else one process).
        read: ``"broadcast"`` (rank 0 reads and broadcasts; default) or ``"shared"``
            (every rank reads the directory itself; the ranks check they read the same one).

    Raises:
        ConfigError: for a bad ``every``, ``keep`` or ``read``.
    """

    def __init__(self, directory: str | os.PathLike[str], every: int = 1, keep: int = 2,
                 comm: Any = None, read: str = "broadcast") -> None:
        for name, value in (("every", every), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise invalid(name, value, "an integer >= 1")
        if read not in READ_MODES:
            raise invalid("read", read, f"one of {', '.join(READ_MODES)}")
        self.directory = os.fspath(directory)
        self.every = every
        self.keep = keep
        self.read = read
        self._comm = comm
        #: The ``extra`` mapping of the last restored checkpoint (empty before).
        self.extra: dict[str, Any] = {}
        #: World size recorded in the last restored checkpoint (None before).
        self.saved_size: int | None = None
        #: Whether the last restore gave this rank its own per-rank state (None before).
        self.restored_own: bool | None = None

    # -- who am I ------------------------------------------------------------------------------
    @property
    def comm(self) -> Any:
        """The communicator in use, or ``None`` for a single process."""
        if self._comm is None:
            from plait.runtime import is_initialized, world

            if is_initialized():
                self._comm = world()
        return self._comm

    @property
    def rank(self) -> int:
        """This process's rank (0 without a communicator)."""
        return 0 if self.comm is None else int(self.comm.rank)

    @property
    def size(self) -> int:
        """Number of ranks (1 without a communicator)."""
        return 1 if self.comm is None else int(self.comm.size)

    # -- writing -------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """True when ``step`` is a multiple of ``every``."""
        return step > 0 and step % self.every == 0

    def step_done(self, step: int, model: Any, optimizer: Any = None,
                  state: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None) -> bool:
        """Save if :meth:`due` (call after finishing ``step`` steps: ``step`` is where to resume).

        Returns:
            True when a checkpoint was written (on rank 0) or would have been (other ranks).
        """
        if not self.due(step):
            return False
        self.save(step, model, optimizer, state, extra)
        return True

    def save(self, step: int, model: Any, optimizer: Any = None,
             state: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None) -> Entry | None:
        """Write a checkpoint now.

        Rank 0 writes. Without per-rank state the other ranks return at once; with it
        (an error-feedback memory in ``state``, an asynchronous optimizer) every rank must
        call ``save`` with the same ``step`` (ranks that do not get a ``MismatchError``).
        On parameter-server workers it does nothing (the servers write).

        Args:
            step: the step to resume from when this checkpoint is restored.
            model: the model (``torch.nn.Module`` or Keras model).
            optimizer: its optimizer, or ``None``.
            state: plait state objects by name (:class:`Stateful`, or residual memories).
            extra: plain numbers/strings/lists to save along (e.g. the epoch).

        Returns:
            The written :class:`Entry` on rank 0.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise invalid("step", step, "an integer >= 0")
        algorithm = async_algorithm(optimizer)
        if algorithm is not None and algorithm.checkpoint_kind == "server":
            return None  # parameter servers write consistent snapshots from serve()
        states = {k: as_stateful(v, k) for k, v in (state or {}).items()}
        if algorithm is not None:
            states[ASYNC_STATE] = AlgorithmState(algorithm)
        per_rank = self.size > 1 and any(is_per_rank(s) for s in states.values())
        if not per_rank and self.rank != 0:
            return None
        codec = codec_for(model)
        files = codec.gather(model, optimizer, states, dict(extra or {}))
        others: dict[int, dict[str, bytes]] = {}
        if per_rank:
            blobs = gather_to_root(self.comm, pack({}, files), f"plait.checkpoint.step{step}")
            if blobs is None:
                return None
            others = {r: unpack(b)[1] for r, b in enumerate(blobs) if r}
        return self._write(step, codec.framework, files, others, states, optimizer, algorithm)

    def _write(self, step: int, framework: str, files: Mapping[str, bytes],
               others: Mapping[int, Mapping[str, bytes]], states: Mapping[str, Stateful], optimizer: Any,
               algorithm: Any) -> Entry:
        """Rank 0: write its ``files`` and the other ranks' (``others``) as one checkpoint."""
        meta = {"framework": framework, "world_size": self.size,
                "state": sorted(k for k in states if k != ASYNC_STATE), "optimizer": optimizer is not None,
                "per_rank": sorted(others), "async": None if algorithm is None else algorithm.describe()}
        return write_checkpoint(self.directory, step, merge_ranks(files, others), meta, self.keep)

    def snapshot(self, model: Any, optimizer: Any) -> ServerSnapshot:
        """What a parameter server writes through (``optimizer.serve(checkpoint=self, model=model)``).

        Args:
            model: this server's model.
            optimizer: its asynchronous optimizer.

        Returns:
            The :class:`ServerSnapshot`.

        Raises:
            ConfigError: when ``optimizer`` is not asynchronous, or this checkpoint's
                communicator is not the optimizer's (server 0 must be rank 0 here).
        """
        algorithm = async_algorithm(optimizer)
        if algorithm is None:
            raise invalid("optimizer", type(optimizer).__name__,
                          "an asynchronous optimizer (DataParallel(mode='async').optimizer(...))")
        if (self.rank, self.size) != (int(algorithm.comm.rank), int(algorithm.comm.size)):
            raise invalid("comm", f"rank {self.rank} of {self.size}",
                          f"the optimizer's communicator (rank {algorithm.comm.rank} of "
                          f"{algorithm.comm.size}): server 0 writes as rank 0")
        return ServerSnapshot(self, model, optimizer, algorithm)

    # -- reading -------------------------------------------------------------------------------
    def latest(self) -> Entry | None:
        """The checkpoint :meth:`restore` would load (on this process's view of the directory)."""
        entry = read_manifest(self.directory)
        if entry is None:
            complete = list_complete(self.directory)
            entry = complete[-1] if complete else None
        return entry

    def _read_local(self) -> tuple[Entry, dict[str, bytes], dict[str, Any]] | None:
        """Read the latest checkpoint that verifies: the manifest's, else the newest older one.

        Returns:
            ``(entry, files, meta)``, or ``None`` when there is no checkpoint yet.

        Raises:
            CheckpointError: when the manifest is unreadable, or no checkpoint verifies
                (naming each one tried and why).
        """
        latest = self.latest()
        if latest is None:
            return None
        older = [e for e in reversed(list_complete(self.directory))
                 if (e.step, e.name) < (latest.step, latest.name)]
        tried: list[tuple[Entry, CheckpointError]] = []
        for entry in [latest, *older]:
            try:
                files, meta = read_checkpoint(self.directory, entry)
            except CheckpointError as exc:
                tried.append((entry, exc))
                continue
            if tried:
                bad = "; ".join(f"{self._where(e)} ({exc})" for e, exc in tried)
                warnings.warn(f"latest checkpoint does not verify: {bad}; restoring the previous one "
                              f"that does, {self._where(entry)}", RuntimeWarning, stacklevel=2)
            return entry, files, meta
        if len(tried) == 1:
            raise tried[0][1]
        raise CheckpointError(f"no checkpoint in {self.directory} verifies; tried "
                              + "; ".join(f"{self._where(e)} ({exc})" for e, exc in tried))

    def _where(self, entry: Entry) -> str:
        return f"{os.path.join(self.directory, entry.name)} (step {entry.step})"

    def _read(self) -> _Read | None:
        comm = self.comm
        if comm is None or comm.size == 1:
            got = self._read_local()
            if got is None:
                return None
            top = split_ranks(got[1])[0]
            return got[0].step, top, top, got[2]
        if self.read == "shared":
            return self._read_shared(comm)
        return self._read_broadcast(comm)

    def _read_broadcast(self, comm: Any) -> _Read | None:
        blob: np.ndarray | None = None
        ranked: dict[int, dict[str, bytes]] = {}
        if comm.rank == 0:
            try:
                got = self._read_local()
                if got is None:
                    blob = pack({"ok": True, "none": True}, {})
                else:
                    top, ranked = split_ranks(got[1])
                    blob = pack({"ok": True, "none": False, "step": got[0].step, "meta": got[2]}, top)
            except CheckpointError as exc:
                blob = pack({"ok": False, "error": str(exc)}, {})
        n = comm.broadcast(np.array([0 if blob is None else blob.size], dtype=np.int64), 0,
                           name="plait.checkpoint.size")
        buf = blob if blob is not None else np.empty(int(np.asarray(n)[0]), dtype=np.uint8)
        header, top = unpack(comm.broadcast(buf, 0, name="plait.checkpoint.data"))
        if not header["ok"]:
            raise CheckpointError(f"{header['error']} (read on rank 0)")
        if header["none"]:
            return None
        meta = dict(header["meta"])
        own: dict[str, bytes] | None = top if comm.rank == 0 else None
        if meta.get("per_rank"):  # each rank gets its own files (rank 0 has them above)
            blobs = None
            if comm.rank == 0:
                blobs = [pack({}, ranked.get(r, {}) if r else {}) for r in range(comm.size)]
            _, mine = unpack(scatter_from_root(comm, blobs, "plait.checkpoint.ranks"))
            if comm.rank != 0 and mine:
                own = mine
        return int(header["step"]), top, own, meta

    def _read_shared(self, comm: Any) -> _Read | None:
        got, error = None, None
        try:
            got = self._read_local()
        except CheckpointError as exc:
            error = str(exc)
        name = None if got is None else got[0].name
        reports = comm.allgather_object([name, error])
        failed = [f"rank {r}: {e}" for r, (_, e) in enumerate(reports) if e is not None]
        if failed:
            raise CheckpointError("; ".join(failed))
        names = sorted({str(n) for n, _ in reports})
        if len(names) > 1:
            seen = ", ".join(f"rank {r}: {n}" for r, (n, _) in enumerate(reports))
            raise CheckpointError(
                f"checkpoint directory {self.directory} (read='shared'): the ranks see different "
                f"latest checkpoints ({seen}); read='shared' needs one directory all ranks share")
        if got is None:
            return None
        entry, files, meta = got
        top, ranked = split_ranks(files)
        return entry.step, top, top if comm.rank == 0 else ranked.get(int(comm.rank)), meta

    def restore(self, model: Any, optimizer: Any = None, state: Mapping[str, Any] | None = None) -> int:
        """Load the latest complete checkpoint into the objects, on every rank (collective).

        Each rank gets its own per-rank state back when the checkpoint has it and fits
        (same number of ranks; for parameter servers, the same servers); otherwise the
        rank takes rank 0's model, optimizer and RNG, and per-rank state starts afresh.

        Args:
            model: the model to load weights into.
            optimizer: its optimizer (its state is loaded when the checkpoint has one).
            state: plait state objects by name, as given to :meth:`save`.

        Returns:
            The step to continue from (0 when there is no checkpoint yet).

        Raises:
            CheckpointError: on every rank, naming the file and why, when the latest
                checkpoint does not fit the objects, or when no checkpoint verifies
                (naming each one tried). A latest checkpoint that does not verify
                (truncated, altered, a file missing) is skipped for the newest older one
                that does, with a ``RuntimeWarning`` naming both.
        """
        got = self._read()
        if got is None:
            return 0
        step, top, own, meta = got
        codec = codec_for(model)
        where = os.path.join(self.directory, f"step-{step:08d}-*")
        if meta.get("framework") != codec.framework:
            raise CheckpointError(
                f"checkpoint {where}: written by framework {meta.get('framework')!r}, "
                f"cannot load into a {codec.framework} model")
        saved_size = int(meta.get("world_size", 1))
        algorithm, saved_async = async_algorithm(optimizer), meta.get("async")
        if algorithm is not None and saved_async and saved_async.get("algorithm") != algorithm.name:
            raise CheckpointError(
                f"checkpoint {where}: written by asynchronous algorithm {saved_async.get('algorithm')!r}, "
                f"cannot restore algorithm {algorithm.name!r}")
        if algorithm is not None and saved_async:
            fits = algorithm.restores_own_state(saved_async, saved_size)
        else:
            fits = saved_size == self.size
        use_own = own is not None and fits
        if meta.get("per_rank") and not fits and self.rank == 0:
            warnings.warn(f"checkpoint {where} was written by {saved_size} ranks and is restored on "
                          f"{self.size}: per-rank state (error-feedback memories, asynchronous "
                          "replicas) starts afresh; every rank starts from rank 0's model",
                          stacklevel=2)
        states = {k: s for k, s in ((k, as_stateful(v, k)) for k, v in (state or {}).items())
                  if use_own or not is_per_rank(s)}
        if algorithm is not None and saved_async:
            states[ASYNC_STATE] = AlgorithmState(algorithm, own=use_own)
        files = own if use_own and own is not None else top
        self.extra = codec.apply(files, model, optimizer, states, where)
        self.saved_size = saved_size
        self.restored_own = use_own
        return step


class ServerSnapshot:
    """How a parameter server writes checkpoints from inside ``serve`` (made by
    :meth:`Checkpoint.snapshot`): every server packs its files; server 0 (rank 0)
    writes them all as one checkpoint.

    Args:
        checkpoint: the :class:`Checkpoint`.
        model: this server's model.
        optimizer: its asynchronous optimizer.
        algorithm: the algorithm behind it.
    """

    def __init__(self, checkpoint: Checkpoint, model: Any, optimizer: Any, algorithm: Any) -> None:
        self.checkpoint, self.model, self.optimizer, self.algorithm = checkpoint, model, optimizer, algorithm
        self.every = checkpoint.every
        self._codec = codec_for(model)

    def files(self) -> dict[str, bytes]:
        """This server's files: model, optimizer, RNG and the algorithm's state."""
        return self._codec.gather(self.model, self.optimizer, {ASYNC_STATE: AlgorithmState(self.algorithm)},
                                  {})

    def pack(self) -> np.ndarray:
        """:meth:`files` as one uint8 array, to send to server 0."""
        return pack({}, self.files())

    def write(self, step: int, others: Mapping[int, Any]) -> Entry:
        """Server 0: write its files and the other servers' (``rank -> packed array``).

        Returns:
            The written entry.
        """
        theirs = {int(r): unpack(b)[1] for r, b in others.items()}
        return self.checkpoint._write(step, self._codec.framework, self.files(), theirs,
                                      {ASYNC_STATE: AlgorithmState(self.algorithm)}, self.optimizer,
                                      self.algorithm)
