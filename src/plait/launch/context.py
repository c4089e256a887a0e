"""Where this process sits in the job, read from whichever launcher started it.

:func:`context` understands (first match wins) horovodrun's Gloo mode, Open
MPI, MPICH/Hydra (and Intel MPI), torchrun and Slurm's ``srun``; with none of
their variables set the process is a job of one. :func:`torch_env` and
:func:`tf_config` translate a context into what ``torch.distributed`` and
TensorFlow's ``MultiWorkerMirroredStrategy`` read; :func:`export_framework_env`
does it inside a running job (the ranks exchange their addresses and free
ports), so native framework strategies run under ``plait run``, ``mpirun`` or
``horovodrun``::

    import plait
    from plait.launch.context import export_framework_env

    export_framework_env("torch", plait.init("mpi"))
    torch.distributed.init_process_group("gloo")
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plait.errors import ConfigError, invalid

__all__ = [
    "FRAMEWORKS",
    "JobContext",
    "context",
    "export_framework_env",
    "framework_env",
    "tf_config",
    "torch_env",
]


@dataclass(frozen=True)
class JobContext:
    """This process's place in the job.

    Attributes:
        rank: global rank, ``0 <= rank < size``.
        size: number of ranks.
        local_rank: rank among the ranks on this host.
        local_size: number of ranks on this host.
        cross_rank: index of this host (node) among the hosts.
        cross_size: number of hosts.
        launcher: ``"horovodrun"``, ``"openmpi"``, ``"mpich"``, ``"torchrun"``,
            ``"slurm"`` or ``"single"``.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    launcher: str

    def __post_init__(self) -> None:
        for name in ("size", "local_size", "cross_size"):
            if getattr(self, name) < 1:
                raise invalid(name, getattr(self, name), "an integer >= 1")
        for name, bound in (
            ("rank", "size"),
            ("local_rank", "local_size"),
            ("cross_rank", "cross_size"),
        ):
            value, limit = getattr(self, name), getattr(self, bound)
            if not 0 <= value < limit:
                raise invalid(name, value, f"an integer in [0, {bound}={limit})")
        if self.local_size > self.size:
            raise invalid("local_size", self.local_size, f"at most size={self.size}")


class _Env:
    """Integer lookups in an environment, with errors naming the variable."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def has(self, *names: str) -> bool:
        return all(name in self.env for name in names)

    def int(self, name: str, default: int | None = None) -> int:
        text = self.env.get(name)
        if text is None:
            if default is None:
                raise ConfigError(f"environment variable {name} is not set: expected an integer")
            return default
        try:
            return int(text.strip())
        except ValueError:
            raise invalid(f"environment variable {name}", text, "an integer") from None


def _nodes_by_block(rank: int, size: int, local_size: int) -> tuple[int, int]:
    """Host index and count when ranks fill hosts in blocks of ``local_size`` (map-by slot)."""
    return rank // local_size, -(-size // local_size)


def _tasks_per_node(text: str) -> list[int]:
    """Expand Slurm's ``"2(x3),1"`` into ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise invalid("environment variable SLURM_STEP_TASKS_PER_NODE", text, "like '2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _horovod(e: _Env) -> JobContext:
    return JobContext(
        e.int("HOROVOD_RANK"),
        e.int("HOROVOD_SIZE"),
        e.int("HOROVOD_LOCAL_RANK"),
        e.int("HOROVOD_LOCAL_SIZE"),
        e.int("HOROVOD_CROSS_RANK", 0),
        e.int("HOROVOD_CROSS_SIZE", 1),
        "horovodrun",
    )


def _mpi(e: _Env, launcher: str, names: tuple[str, str, str, str]) -> JobContext:
    rank, size = e.int(names[0]), e.int(names[1])
    local_rank, local_size = e.int(names[2], 0), e.int(names[3], 1)
    cross_rank, cross_size = _nodes_by_block(rank, size, max(local_size, 1))
    return JobContext(rank, size, local_rank, local_size, cross_rank, cross_size, launcher)


def _openmpi(e: _Env) -> JobContext:
    return _mpi(
        e,
        "openmpi",
        (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
    )


def _mpich(e: _Env) -> JobContext:
    return _mpi(e, "mpich", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))


def _torchrun(e: _Env) -> JobContext:
    rank, size = e.int("RANK"), e.int("WORLD_SIZE")
    local_rank = e.int("LOCAL_RANK", 0)
    local_size = e.int("LOCAL_WORLD_SIZE", 1)
    cross_rank, cross_size = _nodes_by_block(rank, size, max(local_size, 1))
    return JobContext(
        rank,
        size,
        local_rank,
        local_size,
        e.int("GROUP_RANK", cross_rank),
        e.int("GROUP_WORLD_SIZE", cross_size),
        "torchrun",
    )


def _slurm(e: _Env) -> JobContext:
    rank = e.int("SLURM_PROCID")
    size = e.int("SLURM_STEP_NUM_TASKS", e.int("SLURM_NTASKS", 1))
    node = e.int("SLURM_NODEID", 0)
    nodes = e.int("SLURM_STEP_NUM_NODES", e.int("SLURM_NNODES", 1))
    per_node = e.env.get("SLURM_STEP_TASKS_PER_NODE") or e.env.get("SLURM_TASKS_PER_NODE")
    if per_node:
        counts = _tasks_per_node(per_node)
        local_size = counts[node] if node < len(counts) else counts[-1]
    else:
        local_size = e.int("SLURM_NTASKS_PER_NODE", -(-size // nodes))
    return JobContext(
        rank, size, e.int("SLURM_LOCALID", 0), local_size, node, nodes, "slurm"
    )


_DETECTORS: tuple[tuple[tuple[str, ...], Callable[[_Env], JobContext]], ...] = (
    (("HOROVOD_RANK", "HOROVOD_SIZE"), _horovod),
    (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), _openmpi),
    (("PMI_RANK", "PMI_SIZE"), _mpich),
    (("RANK", "WORLD_SIZE"), _torchrun),
    (("SLURM_PROCID", "SLURM_NTASKS"), _slurm),
)


def context(env: Mapping[str, str] | None = None) -> JobContext:
    """Read this process's place in the job from its launcher's environment variables.

    Open MPI and MPICH do not export the host index: ``cross_rank`` and
    ``cross_size`` are then computed as if ranks fill hosts in order, the same
    number per host (``--map-by slot``, what ``plait run`` uses). A
    communicator's own ``cross_rank`` is exact.

    Args:
        env: the environment to read (default: ``os.environ``).

    Returns:
        The job context; a single-process context if no launcher is recognised.

    Raises:
        ConfigError: if a launcher's variable is not an integer or the values
            are inconsistent (for example ``rank >= size``); the message names it.
    """
    e = _Env(os.environ if env is None else env)
    for names, detect in _DETECTORS:
        if e.has(*names):
            return detect(e)
    return JobContext(0, 1, 0, 1, 0, 1, "single")


def torch_env(ctx: JobContext, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables ``torch.distributed.init_process_group("env://")`` reads.

    Args:
        ctx: the job context.
        master_addr: host name or address of rank 0.
        master_port: a free TCP port on ``master_addr``.

    Returns:
        ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
        ``GROUP_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``.

    Raises:
        ConfigError: if ``master_addr`` is empty or ``master_port`` is not in 1..65535.
    """
    if not master_addr or any(c.isspace() for c in master_addr):
        raise invalid("master_addr", master_addr, "a host name or IP address")
    if isinstance(master_port, bool) or not isinstance(master_port, int):
        raise invalid("master_port", master_port, "an integer port in 1..65535")
    if not 1 <= master_port <= 65535:
        raise invalid("master_port", master_port, "an integer port in 1..65535")
    return {
        "RANK": str(ctx.rank),
        "WORLD_SIZE": str(ctx.size),
        "LOCAL_RANK": str(ctx.local_rank),
        "LOCAL_WORLD_SIZE": str(ctx.local_size),
        "GROUP_RANK": str(ctx.cross_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def tf_config(workers: Sequence[str], index: int) -> str:
    """The ``TF_CONFIG`` JSON for ``tf.distribute.MultiWorkerMirroredStrategy``.

    Args:
        workers: ``"host:port"`` of every worker, in rank order.
        index: this worker's position in ``workers`` (its rank).

    Returns:
        ``{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": index}}`` as JSON.

    Raises:
        ConfigError: if ``workers`` is empty or has an entry that is not
            ``host:port``, a duplicate, or ``index`` is out of range.
    """
    if isinstance(workers, str) or not workers:
        raise invalid("workers", workers, "a non-empty list of 'host:port' strings")
    for worker in workers:
        host, sep, port = worker.rpartition(":") if isinstance(worker, str) else ("", "", "")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise invalid("workers", worker, "'host:port' entries with a port in 1..65535")
    if len(set(workers)) != len(workers):
        raise invalid("workers", list(workers), "distinct 'host:port' entries")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(workers):
        raise invalid("index", index, f"an integer in [0, {len(workers)})")
    config = {"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}}
    return json.dumps(config)


#: Frameworks :func:`framework_env` knows.
FRAMEWORKS = ("torch", "tensorflow")


def framework_env(
    framework: str, ctx: JobContext, addresses: Sequence[str], ports: Sequence[int]
) -> dict[str, str]:
    """The variables a framework's own distributed runtime reads, for every rank's endpoint.

    Args:
        framework: ``"torch"`` (``torch.distributed`` with ``init_method="env://"``) or
            ``"tensorflow"`` (``TF_CONFIG`` for ``MultiWorkerMirroredStrategy``).
        ctx: this process's place in the job.
        addresses: host name or address of every rank, in rank order.
        ports: a free TCP port on each rank's host, in rank order (torch uses rank 0's).

    Returns:
        ``torch``: :func:`torch_env` for rank 0's endpoint; ``tensorflow``:
        ``{"TF_CONFIG": ...}`` with one worker per rank and this rank's index.

    Raises:
        ConfigError: for an unknown framework, or lists whose length is not ``ctx.size``.
    """
    if framework not in FRAMEWORKS:
        raise invalid("framework", framework, f"one of {', '.join(FRAMEWORKS)}")
    for name, values in (("addresses", addresses), ("ports", ports)):
        if isinstance(values, str) or len(values) != ctx.size:
            raise invalid(name, values, f"a sequence of {ctx.size} entries (one per rank)")
    if framework == "torch":
        return torch_env(ctx, addresses[0], ports[0])
    workers = [f"{a}:{p}" for a, p in zip(addresses, ports, strict=True)]
    return {"TF_CONFIG": tf_config(workers, ctx.rank)}


def _address(cross_size: int, env: Mapping[str, str]) -> str:
    """This host's address for peers: ``PLAIT_ADDRESS``, else what the host name resolves to."""
    override = env.get("PLAIT_ADDRESS")
    if override:
        return override
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = name
    if address.startswith("127.") and cross_size > 1:
        raise ConfigError(
            f"host name {name!r} resolves to the loopback address {address}, which other hosts "
            "cannot reach: set PLAIT_ADDRESS to this host's address on the job network"
        )
    return address


def _free_port(address: str) -> int:
    """A TCP port that is free on ``address`` now (the OS picks it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, 0))
        except OSError:
            s.bind(("", 0))
        return int(s.getsockname()[1])


def export_framework_env(framework: str, comm: Any = None) -> dict[str, str]:
    """Set the variables ``torch.distributed`` or ``tf.distribute`` read, inside a running job.

    Call it on every rank (it is collective) before the framework initialises its
    own runtime: ``torch.distributed.init_process_group("gloo")`` or
    ``tf.distribute.MultiWorkerMirroredStrategy()``. Each rank finds its host's
    address (``PLAIT_ADDRESS`` if set, else what its host name resolves to) and a
    free port on it; the ranks exchange them through ``comm``, so the result names
    real, reachable endpoints whichever launcher started the job.

    Args:
        framework: ``"torch"`` or ``"tensorflow"``.
        comm: a plait communicator spanning the job (anything with ``rank``, ``size``,
            ``local_rank``, ``local_size``, ``cross_rank``, ``cross_size`` and
            ``allgather_object``); default: ``plait.init()``'s world communicator.

    Returns:
        The variables set in ``os.environ`` (see :func:`framework_env`).

    Raises:
        ConfigError: for an unknown framework, or when this host's name resolves to a
            loopback address in a job spanning several hosts (set ``PLAIT_ADDRESS``).
    """
    if framework not in FRAMEWORKS:
        raise invalid("framework", framework, f"one of {', '.join(FRAMEWORKS)}")
    if comm is None:
        from plait.runtime import init

        comm = init()
    ctx = JobContext(int(comm.rank), int(comm.size), int(comm.local_rank), int(comm.local_size),
                     int(comm.cross_rank), int(comm.cross_size), context().launcher)
    address = _address(ctx.cross_size, os.environ)
    endpoints = comm.allgather_object([address, _free_port(address)])
    values = framework_env(framework, ctx, [str(a) for a, _ in endpoints],
                           [int(p) for _, p in endpoints])
    os.environ.update(values)
    return values
