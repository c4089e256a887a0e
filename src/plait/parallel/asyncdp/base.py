"""The interface every asynchronous algorithm implements, and what they share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from plait.checkpoint.atomic import CheckpointError
from plait.protocols import Communicator

from .guard import track, untrack
from .metrics import AsyncMetrics
from .replica import Replica

__all__ = ["AsyncAlgorithm", "load_memory", "memory_state", "require_point_to_point"]


def memory_state(memory: Any) -> dict[str, Any] | None:
    """An error-feedback memory's residuals (name -> numpy array), or None without one."""
    residuals = getattr(memory, "residuals", None)
    # copies: the memory updates its tensors in place
    return None if not isinstance(residuals, dict) else {k: np.array(v) for k, v in residuals.items()}


def load_memory(memory: Any, saved: Mapping[str, Any] | None, own: bool) -> None:
    """Give ``memory`` its saved residuals back (another rank's are dropped: it starts empty)."""
    residuals = getattr(memory, "residuals", None)
    if not isinstance(residuals, dict):
        return
    residuals.clear()
    if own and saved:
        residuals.update({k: np.asarray(v, dtype=np.float32).copy() for k, v in saved.items()})


def require_point_to_point(comm: Communicator, algorithm: str) -> None:
    """Raise a clear error when ``comm`` cannot send point-to-point messages.

    Horovod has no point-to-point messages; plait's Horovod communicator sends them
    through MPI when the job was started by mpirun (or horovodrun --mpi).

    Raises:
        NotImplementedError: under horovodrun --gloo (no MPI world).
    """
    probe = getattr(comm, "_p2p", None)
    if probe is None:
        return
    try:
        probe()
    except NotImplementedError as exc:
        raise NotImplementedError(
            f"asynchronous data parallelism with algorithm={algorithm!r} needs point-to-point "
            f"messages, which the {comm.backend} backend only has when the job is started by "
            "mpirun (or horovodrun --mpi). Start it with mpirun, or use algorithm='local_sgd' "
            f"or 'delayed' (collectives only). ({exc})"
        ) from None


class AsyncAlgorithm:
    """One asynchronous data-parallel algorithm, framework-free.

    Life cycle on every rank of ``comm``: :meth:`setup` (collective; makes all
    replicas equal), then :meth:`step` once per training step on workers (or
    :meth:`serve` on parameter-server ranks), then :meth:`synchronize`
    (collective; leaves one model on every rank). ``step`` is called after the
    backward pass, with the local gradients in the replica; it applies whatever
    update the algorithm prescribes.

    Args:
        comm: the data-parallel communicator.
    """

    name = "base"
    #: True for algorithms that need point-to-point messages.
    point_to_point = False
    #: How ``plait.Checkpoint`` captures the algorithm: ``"collective"`` (every rank saves
    #: at the same step, after :meth:`state_dict` drained what is in flight) or
    #: ``"server"`` (parameter servers write snapshots from :meth:`serve`).
    checkpoint_kind = "collective"

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.metrics = AsyncMetrics(comm.rank, self.role, self.name)
        self._setup_done = False
        self._finished = False
        self._loaded: tuple[Mapping[str, Any], bool] | None = None

    # -- roles ------------------------------------------------------------------------
    @property
    def role(self) -> str:
        """"worker" or "server"."""
        return "worker"

    @property
    def is_server(self) -> bool:
        """True on ranks that serve parameters instead of training."""
        return self.role == "server"

    # -- life cycle -----------------------------------------------------------------------
    def setup(self, replica: Replica) -> None:
        """Collective: give every replica rank 0's parameters and start the algorithm."""
        if self._setup_done:
            return
        if self.point_to_point:
            require_point_to_point(self.comm, self.name)
        if self._loaded is None:  # restored replicas are already what they must be
            params = self.comm.broadcast(replica.get_params(), 0, name="asyncdp.setup")
            replica.set_params(params)
        self._start(replica)
        if self._loaded is not None:
            self._load(*self._loaded)
            self._loaded = None
        self._setup_done = True
        if self.comm.size > 1:
            track(self, f"rank {self.comm.rank} ({self.name} {self.role})")

    def _start(self, replica: Replica) -> None:
        """Algorithm-specific start (after the initial broadcast)."""

    def step(self, replica: Replica) -> None:
        """One training step on a worker: the local gradients are in ``replica``."""
        raise NotImplementedError

    def serve(self, replica: Replica, snapshot: Any = None) -> None:
        """Serve until every worker finished (parameter-server ranks only).

        Raises:
            RuntimeError: on a rank that is not a server.
        """
        raise RuntimeError(
            f"rank {self.comm.rank} is a {self.role} of algorithm {self.name!r}: only server ranks "
            "call serve(); workers call step()")

    def synchronize(self, replica: Replica) -> None:
        """Collective: finish pending work and leave one identical model on every rank.

        Every rank calls it once after its last step (the numbers of steps may
        differ only for the point-to-point algorithms).
        """
        if not self._finished:
            self._finish(replica)
            self._finished = True
        self._average(replica)
        untrack(self)

    def _finish(self, replica: Replica) -> None:
        """Algorithm-specific end (drain messages, apply pending updates)."""

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's algorithm state (plain numbers, lists and float32 numpy arrays).

        For ``checkpoint_kind == "collective"`` every rank calls it at the same step:
        it first finishes what is in flight, so the state is consistent across ranks.

        Returns:
            The state; the model and optimizer are saved by the checkpoint itself.
        """
        return {"algorithm": self.name, "steps": self.metrics.steps, **self._state()}

    def _state(self) -> dict[str, Any]:
        """Algorithm-specific part of :meth:`state_dict`."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any], own: bool = True) -> None:
        """Take a saved state (before or after :meth:`setup`).

        Args:
            state: what :meth:`state_dict` returned.
            own: True when it is this rank's own state; False when it is another rank's
                (rank 0's, after a restart on another number of ranks): the algorithm then
                keeps only what every rank shares (the step count, a common anchor).

        Raises:
            CheckpointError: when the state is another algorithm's.
        """
        if state.get("algorithm") != self.name:
            raise CheckpointError(f"saved state of asynchronous algorithm {state.get('algorithm')!r} "
                                  f"cannot be loaded into {self.name!r}")
        if self._setup_done:
            self._load(state, own)
        else:
            self._loaded = (state, own)

    def _load(self, state: Mapping[str, Any], own: bool) -> None:
        """Algorithm-specific loading (after :meth:`_start`)."""
        self.metrics.steps = int(state["steps"])

    def restores_own_state(self, saved: Mapping[str, Any], saved_size: int) -> bool:
        """Whether this rank's own saved state fits the job now.

        Args:
            saved: the saved algorithm's :meth:`describe`.
            saved_size: the number of ranks that saved it.

        Returns:
            True when the number of ranks is unchanged.
        """
        return saved_size == self.comm.size

    def _average(self, replica: Replica) -> None:
        avg = self.comm.allreduce(replica.get_params(), "average", name="asyncdp.synchronize")
        replica.set_params(np.asarray(avg, dtype=np.float32))

    def gather_metrics(self) -> list[dict[str, Any]]:
        """Collective: every rank's :meth:`AsyncMetrics.summary`, in rank order."""
        return self.comm.allgather_object(self.metrics.summary())

    def describe(self) -> dict[str, Any]:
        """The algorithm's settings."""
        return {"algorithm": self.name}
