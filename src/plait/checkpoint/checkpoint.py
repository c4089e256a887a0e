"""``plait.Checkpoint``: periodic atomic checkpoints written by rank 0, restored on every rank."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from plait.errors import invalid

from .atomic import CheckpointError, Entry, list_complete, read_checkpoint, read_manifest, write_checkpoint
from .state import Stateful, as_stateful

__all__ = ["READ_MODES", "Checkpoint", "Codec", "codec_for"]

#: How ranks read a checkpoint: rank 0 reads and broadcasts, or every rank reads a shared directory.
READ_MODES = ("broadcast", "shared")


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


class Checkpoint:
    """Periodic, atomic checkpoints of a training job (DESIGN.md section 4, "Lost work").

    Rank 0 writes (see :mod:`plait.checkpoint.atomic` for the protocol); every rank
    restores. Usage::

        ckpt = plait.Checkpoint("ckpt", every=100, keep=3)
        start = ckpt.restore(model, optimizer)          # 0 on a fresh start
        for step in range(start, steps):
            train_one_step(step)
            ckpt.step_done(step + 1, model, optimizer)  # writes when (step + 1) % every == 0

    Args:
        directory: where checkpoints live (shared by all ranks in ``read="shared"`` mode).
        every: write on steps that are multiples of ``every``.
        keep: how many complete checkpoints to keep.
        comm: the communicator (default: ``plait.world()`` when initialised, else one process).
        read: ``"broadcast"`` (rank 0 reads and broadcasts; default) or ``"shared"``
            (every rank reads the directory itself).

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
        """Write a checkpoint now (rank 0 only; other ranks return ``None`` at once).

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
        if self.rank != 0:
            return None
        codec = codec_for(model)
        states = {k: as_stateful(v, k) for k, v in (state or {}).items()}
        files = codec.gather(model, optimizer, states, dict(extra or {}))
        meta = {"framework": codec.framework, "world_size": self.size, "state": sorted(states),
                "optimizer": optimizer is not None}
        return write_checkpoint(self.directory, step, files, meta, self.keep)

    # -- reading -------------------------------------------------------------------------------
    def latest(self) -> Entry | None:
        """The checkpoint :meth:`restore` would load (on this process's view of the directory)."""
        entry = read_manifest(self.directory)
        if entry is None:
            complete = list_complete(self.directory)
            entry = complete[-1] if complete else None
        return entry

    def _read_local(self) -> tuple[int, dict[str, bytes], dict[str, Any]] | None:
        entry = self.latest()
        if entry is None:
            return None
        files, meta = read_checkpoint(self.directory, entry)
        return entry.step, files, meta

    def _read(self) -> tuple[int, dict[str, bytes], dict[str, Any]] | None:
        comm = self.comm
        if self.read == "shared" or comm is None or comm.size == 1:
            return self._read_local()
        blob = None
        if comm.rank == 0:
            try:
                got = self._read_local()
                blob = _pack(got)
            except CheckpointError as exc:
                blob = _pack_error(str(exc))
        n = comm.broadcast(np.array([0 if blob is None else blob.size], dtype=np.int64), 0,
                           name="plait.checkpoint.size")
        buf = blob if blob is not None else np.empty(int(np.asarray(n)[0]), dtype=np.uint8)
        buf = np.asarray(comm.broadcast(buf, 0, name="plait.checkpoint.data"))
        return _unpack(buf)

    def restore(self, model: Any, optimizer: Any = None, state: Mapping[str, Any] | None = None) -> int:
        """Load the latest complete checkpoint into the objects, on every rank.

        Args:
            model: the model to load weights into.
            optimizer: its optimizer (its state is loaded when the checkpoint has one).
            state: plait state objects by name, as given to :meth:`save`.

        Returns:
            The step to continue from (0 when there is no checkpoint yet).

        Raises:
            CheckpointError: on every rank, naming the file and why, when the latest
                checkpoint is corrupt or does not fit the objects.
        """
        got = self._read()
        if got is None:
            return 0
        step, files, meta = got
        codec = codec_for(model)
        where = os.path.join(self.directory, f"step-{step:08d}-*")
        if meta.get("framework") != codec.framework:
            raise CheckpointError(
                f"checkpoint {where}: written by framework {meta.get('framework')!r}, "
                f"cannot load into a {codec.framework} model")
        states = {k: as_stateful(v, k) for k, v in (state or {}).items()}
        self.extra = codec.apply(files, model, optimizer, states, where)
        self.saved_size = int(meta.get("world_size", 1))
        return step


def _pack(got: tuple[int, dict[str, bytes], dict[str, Any]] | None) -> np.ndarray:
    header: dict[str, Any]
    if got is None:
        header = {"ok": True, "none": True}
        body = b""
    else:
        step, files, meta = got
        header = {"ok": True, "none": False, "step": step, "meta": meta,
                  "files": [[k, len(v)] for k, v in files.items()]}
        body = b"".join(files.values())
    head = json.dumps(header).encode()
    data = len(head).to_bytes(8, "little") + head + body
    return np.frombuffer(data, dtype=np.uint8).copy()


def _pack_error(message: str) -> np.ndarray:
    head = json.dumps({"ok": False, "error": message}).encode()
    return np.frombuffer(len(head).to_bytes(8, "little") + head, dtype=np.uint8).copy()


def _unpack(buf: np.ndarray) -> tuple[int, dict[str, bytes], dict[str, Any]] | None:
    data = buf.tobytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    if not header["ok"]:
        raise CheckpointError(f"{header['error']} (read on rank 0)")
    if header["none"]:
        return None
    files, offset = {}, 8 + n
    for name, size in header["files"]:
        files[name] = data[offset : offset + size]
        offset += size
    return int(header["step"]), files, dict(header["meta"])
