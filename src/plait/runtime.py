"""Creating communicators: :func:`init`, :func:`world`, :func:`shutdown`.

The world communicator made by :func:`init` is remembered (like Horovod's
``hvd.init()`` state) so that the Horovod-compatible faces can find it; groups
made by ``split`` are never global.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

from .config import Config
from .errors import BackendUnavailableError, ConfigError, NotInitializedError, PlaitError
from .protocols import Communicator

__all__ = ["choose_backend", "init", "is_initialized", "shutdown", "started_by_horovodrun", "world"]


class _Runtime:
    """Holder of the world communicator of this process."""

    def __init__(self) -> None:
        self.world: Communicator | None = None


_RUNTIME = _Runtime()


def started_by_horovodrun(env: Any = None) -> bool:
    """True when horovodrun (Gloo or MPI mode) started this process.

    In Gloo mode horovodrun gives every rank ``HOROVOD_RANK`` and friends. In MPI
    mode it sets no variable of its own; it always runs Open MPI's ``mpirun`` with
    ``-mca pml ob1 -mca btl ^openib``, which every rank sees as ``OMPI_MCA_pml`` and
    ``OMPI_MCA_btl`` (a plain mpirun job with exactly these settings counts too).

    Args:
        env: the environment to look at (default: ``os.environ``).

    Returns:
        Whether the job looks started by horovodrun.
    """
    env = os.environ if env is None else env
    if any(k in env for k in ("HOROVOD_RANK", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_HOSTNAME")):
        return True
    return env.get("OMPI_MCA_pml") == "ob1" and env.get("OMPI_MCA_btl") == "^openib"


def choose_backend(requested: str) -> str:
    """Resolve "auto": Horovod when importable and the job came from horovodrun, else MPI."""
    if requested != "auto":
        return requested
    if started_by_horovodrun() and importlib.util.find_spec("horovod") is not None:
        return "horovod"
    return "mpi"


def _framework(requested: str) -> str:
    if requested != "auto":
        return requested
    if "torch" in sys.modules:
        return "torch"
    if "tensorflow" in sys.modules:
        return "tensorflow"
    return "torch" if importlib.util.find_spec("torch") is not None else "tensorflow"


def init(backend: str | None = None, *, check: bool | None = None, timeout: float | None = None,
         framework: str | None = None) -> Communicator:
    """Create (once) and return the world communicator.

    Args:
        backend: "mpi", "horovod" or "auto" (default: ``PLAIT_BACKEND`` or "auto").
        check: verify before each collective that all ranks make the same call
            (default: ``PLAIT_CHECK`` or True).
        timeout: seconds to wait for other ranks (default: ``PLAIT_TIMEOUT`` or 300).
        framework: for Horovod, which library to initialise ("torch"/"tensorflow";
            default: the framework already imported).

    Returns:
        The world :class:`~plait.protocols.Communicator`.

    Raises:
        ConfigError: for an unknown backend or bad setting (listing valid ones).
        BackendUnavailableError: when the backend cannot be imported here.
        PlaitError: when already initialised with a different backend.
    """
    cfg = Config.from_env(backend=backend, check=check, timeout=timeout, framework=framework)
    name = choose_backend(cfg.backend)
    current = _RUNTIME.world
    if current is not None:
        if current.backend != name:
            raise PlaitError(
                f"plait is already initialised with backend {current.backend!r}; "
                f"cannot re-initialise with {name!r} (call plait.shutdown() first)"
            )
        return current
    timeline = importlib.import_module("plait.collectives.timeline")
    timeline.prepare_env(name)  # PLAIT_STALL_* -> HOROVOD_STALL_* before hvd.init
    comm: Communicator
    if name == "mpi":
        try:
            mpi = importlib.import_module("plait.collectives.mpi")
        except ImportError as exc:
            raise BackendUnavailableError(
                f"backend 'mpi' needs mpi4py and an MPI library ({exc}); run `make setup`"
            ) from exc
        comm = mpi.MPICommunicator(mpi.MPI.COMM_WORLD.Dup(), check=cfg.check, timeout=cfg.timeout)
    else:
        hvd = importlib.import_module("plait.collectives.horovod")
        comm = hvd.HorovodCommunicator(_framework(cfg.framework), check=cfg.check,
                                       timeout=cfg.timeout)
    if name == "mpi" or importlib.import_module("plait.collectives.horovod").mpi_launched():
        # a rank dying of any uncaught exception ends the job instead of hanging its peers
        importlib.import_module("plait.collectives.abort").install(every_exception=True)
    comm = timeline.maybe_wrap(comm)  # itself unless PLAIT_TIMELINE / PLAIT_STALL_WARNING is set
    _RUNTIME.world = comm
    return comm


def world() -> Communicator:
    """The communicator made by :func:`init`.

    Raises:
        NotInitializedError: (a ``ValueError``) before :func:`init` or after :func:`shutdown`.
    """
    if _RUNTIME.world is None:
        raise NotInitializedError("plait is not initialised: call plait.init() (or hvd.init()) first")
    return _RUNTIME.world


def is_initialized() -> bool:
    """True after :func:`init` and before :func:`shutdown`."""
    return _RUNTIME.world is not None


def shutdown() -> None:
    """Forget the world communicator (MPI itself is finalised at exit). Horovod's timeline
    (``HOROVOD_TIMELINE`` on the MPI backend) is closed, a valid JSON file, as Horovod's
    ``shutdown`` leaves it; plait's own (``PLAIT_TIMELINE``) is merged at exit."""
    comm, _RUNTIME.world = _RUNTIME.world, None
    if comm is not None and os.environ.get("HOROVOD_TIMELINE"):
        timeline = importlib.import_module("plait.collectives.timeline")
        try:
            timeline.horovod_recorder(comm).stop()
        except ConfigError:  # no Horovod timeline on this communicator
            pass
