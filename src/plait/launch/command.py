"""Build the argv of an ``mpirun`` or ``horovodrun`` command from a :class:`LaunchSpec`.

Pure functions: nothing here runs a process or reads the real environment
unless asked to. The result is always a list of arguments, never a shell
string; :meth:`LaunchCommand.shell` renders one only for display.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from plait.errors import invalid
from plait.launch.hostfile import HostSlots, check_np, format_hosts, total_slots

__all__ = [
    "BACKENDS",
    "CONTROLLERS",
    "FORWARD_NAMES",
    "FORWARD_PREFIXES",
    "LAUNCHERS",
    "LaunchCommand",
    "LaunchSpec",
    "build_command",
    "forwarded_env_names",
    "horovodrun_argv",
    "mpirun_argv",
    "plait_env",
]

#: Launchers ``plait run`` can drive.
LAUNCHERS = ("mpirun", "horovodrun")
#: Values of ``--backend`` (handed to the ranks as ``PLAIT_BACKEND``).
BACKENDS = ("mpi", "horovod", "auto")
#: horovodrun controllers.
CONTROLLERS = ("gloo", "mpi")
#: Environment variables forwarded to every rank by ``mpirun -x`` when set.
FORWARD_NAMES = (
    "PATH",
    "PYTHONPATH",
    "LD_LIBRARY_PATH",
    "VIRTUAL_ENV",
    "PYTHONUNBUFFERED",
    "PYTHONHASHSEED",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "KERAS_BACKEND",
    "TF_USE_LEGACY_KERAS",
    "TF_CPP_MIN_LOG_LEVEL",
    "OMPI_ALLOW_RUN_AS_ROOT",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
)
#: Prefixes of environment variables forwarded by ``mpirun -x`` when set.
FORWARD_PREFIXES = ("PLAIT_", "HOROVOD_", "NCCL_")

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_IFACE = re.compile(r"[A-Za-z0-9_.:/@-]+(?:,[A-Za-z0-9_.:/@-]+)*\Z")
_MCA_KEY = re.compile(r"[A-Za-z0-9_]+\Z")


@dataclass(frozen=True)
class LaunchSpec:
    """What to launch and where; validated on construction.

    Attributes:
        command: the program and its arguments, run once per rank.
        np: number of ranks; ``None`` means the total slots of ``hosts``, or 1.
        hosts: hosts and slots (from ``-H`` or a parsed hostfile).
        hostfile: a hostfile path to hand to the launcher instead of ``-H``.
        launcher: ``"mpirun"`` or ``"horovodrun"``.
        backend: ``"mpi"``, ``"horovod"`` or ``"auto"``, exported as ``PLAIT_BACKEND``.
        controller: horovodrun controller, ``"gloo"``, ``"mpi"`` or ``None`` (its default;
            ``"mpi"`` when ``backend="mpi"``).
        network_interface: interface name(s) or CIDR subnet(s) to restrict traffic to.
        timeout: seconds before the job is killed (``mpirun --timeout``).
        start_timeout: seconds horovodrun waits for all ranks to start.
        oversubscribe: allow more ranks than slots.
        tag_output: prefix every output line with the rank (mpirun ``--tag-output``).
        env_vars: extra ``-x`` entries: ``NAME`` (forward) or ``NAME=VALUE`` (set).
        mca: extra Open MPI MCA parameters as ``(key, value)`` pairs.
        timeline: a Chrome-trace file to record the job's collectives to, exported to
            every rank as ``PLAIT_TIMELINE`` (each rank writes ``FILE.rankN`` and rank 0
            merges them into ``FILE``; across hosts that needs a shared directory).
    """

    command: tuple[str, ...]
    np: int | None = None
    hosts: tuple[HostSlots, ...] = ()
    hostfile: str | None = None
    launcher: str = "mpirun"
    backend: str = "auto"
    controller: str | None = None
    network_interface: str | None = None
    timeout: float | None = None
    start_timeout: float | None = None
    oversubscribe: bool = False
    tag_output: bool = False
    env_vars: tuple[str, ...] = ()
    mca: tuple[tuple[str, str], ...] = ()
    timeline: str | None = None

    def __post_init__(self) -> None:
        if not self.command or not all(isinstance(a, str) for a in self.command):
            raise invalid("command", self.command, "a non-empty sequence of strings (after '--')")
        if self.launcher not in LAUNCHERS:
            raise invalid("launcher", self.launcher, f"one of {', '.join(LAUNCHERS)}")
        if self.backend not in BACKENDS:
            raise invalid("backend", self.backend, f"one of {', '.join(BACKENDS)}")
        if self.controller is not None and self.controller not in CONTROLLERS:
            raise invalid("controller", self.controller, f"one of {', '.join(CONTROLLERS)}")
        if self.controller is not None and self.launcher != "horovodrun":
            raise invalid("controller", self.controller, "None unless launcher='horovodrun'")
        if self.backend == "mpi" and self.controller == "gloo":
            raise invalid(
                "controller", self.controller, "'mpi' or None with backend='mpi' (mpi4py needs MPI)"
            )
        if self.hosts and self.hostfile is not None:
            raise invalid("hostfile", self.hostfile, "None when hosts (-H) are given (not both)")
        if self.np is not None:
            check_np(self.np, self.hosts, self.oversubscribe)
        for name, seconds in (("timeout", self.timeout), ("start_timeout", self.start_timeout)):
            if seconds is not None and not (seconds > 0 and math.isfinite(seconds)):
                raise invalid(name, seconds, "a positive number of seconds")
        if self.network_interface is not None and not _IFACE.match(self.network_interface):
            raise invalid(
                "network_interface",
                self.network_interface,
                "interface names or CIDR subnets, comma separated (e.g. 'eth0' or '10.0.0.0/24')",
            )
        for entry in self.env_vars:
            if not _ENV_NAME.match(entry.partition("=")[0]):
                raise invalid("env_vars", entry, "'NAME' or 'NAME=VALUE' with NAME like PLAIT_FOO")
        for key, mca_value in self.mca:
            if not _MCA_KEY.match(key) or not mca_value or "\n" in mca_value:
                raise invalid(
                    "mca", (key, mca_value), "(key, value) with key like btl_tcp_if_include"
                )
        if self.timeline is not None and (
            not isinstance(self.timeline, str) or not self.timeline.strip()
            or any(c in self.timeline for c in "\n\0")
        ):
            raise invalid("timeline", self.timeline, "a file path (e.g. 'timeline.json')")
        if self.mca and self.launcher != "mpirun":
            raise invalid("mca", self.mca, "() unless launcher='mpirun'")

    @property
    def num_ranks(self) -> int:
        """Number of ranks: ``np``, else the total slots of ``hosts``, else 1."""
        if self.np is not None:
            return self.np
        return total_slots(self.hosts) if self.hosts else 1


@dataclass(frozen=True)
class LaunchCommand:
    """A launcher invocation: an argv and the variables to add to its environment.

    Attributes:
        argv: the full argument list (``argv[0]`` is the launcher).
        env: variables to set in the launcher's environment (e.g. ``PLAIT_BACKEND``).
    """

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """Render the command for display, as a line a POSIX shell would run.

        Returns:
            ``NAME=VALUE ... launcher args...``, every word quoted with ``shlex``.
        """
        prefix = [f"{k}={v}" for k, v in sorted(self.env.items())]
        return shlex.join([*prefix, *self.argv])


def forwarded_env_names(env: Mapping[str, str], extra: Sequence[str] = ()) -> list[str]:
    """Names of the variables ``mpirun -x`` forwards, in a stable order.

    Args:
        env: the launcher's environment.
        extra: user ``-x`` entries (``NAME`` or ``NAME=VALUE``), kept in order at the end.

    Returns:
        The matching names in ``env`` (sorted), then ``extra`` entries not already listed.
    """
    names = sorted(
        name
        for name in env
        if name in FORWARD_NAMES or name.startswith(FORWARD_PREFIXES)
    )
    for entry in extra:
        if entry not in names:
            names.append(entry)
    return names


def plait_env(spec: LaunchSpec) -> dict[str, str]:
    """The variables plait sets for every rank of ``spec``'s job.

    Args:
        spec: what to launch.

    Returns:
        ``PLAIT_BACKEND``, and ``PLAIT_TIMELINE`` when ``spec.timeline`` is set.
    """
    env = {"PLAIT_BACKEND": spec.backend}
    if spec.timeline is not None:
        env["PLAIT_TIMELINE"] = spec.timeline
    return env


def mpirun_argv(
    spec: LaunchSpec, env: Mapping[str, str] | None = None, is_root: bool = False
) -> list[str]:
    """Build the Open MPI 4.1 ``mpirun`` argv for ``spec``.

    Args:
        spec: what to launch.
        env: the environment mpirun will get (decides which ``-x`` are emitted);
            ``None`` forwards only plait's own variables (:func:`plait_env`) and
            ``spec.env_vars``.
        is_root: add ``--allow-run-as-root``.

    Returns:
        ``["mpirun", "-np", N, ..., "--", *spec.command]``.
    """
    argv = ["mpirun", "-np", str(spec.num_ranks)]
    if is_root:
        argv.append("--allow-run-as-root")
    if spec.hosts:
        argv += ["-H", format_hosts(spec.hosts)]
    elif spec.hostfile is not None:
        argv += ["--hostfile", spec.hostfile]
    argv += ["--bind-to", "none", "--map-by", "slot"]
    if spec.oversubscribe:
        argv.append("--oversubscribe")
    if spec.timeout is not None:
        argv += ["--timeout", str(math.ceil(spec.timeout))]
    if spec.tag_output:
        argv.append("--tag-output")
    if spec.network_interface is not None:
        argv += ["--mca", "btl_tcp_if_include", spec.network_interface]
        argv += ["--mca", "oob_tcp_if_include", spec.network_interface]
    for key, value in spec.mca:
        argv += ["--mca", key, value]
    env_with_backend = dict(env or {})
    env_with_backend.update(plait_env(spec))
    for name in forwarded_env_names(env_with_backend, spec.env_vars):
        argv += ["-x", name]
    return [*argv, "--", *spec.command]


def horovodrun_argv(spec: LaunchSpec) -> list[str]:
    """Build the ``horovodrun`` argv for ``spec`` (horovodrun forwards the environment itself).

    Args:
        spec: what to launch.

    Returns:
        ``["horovodrun", "-np", N, ..., *spec.command]``.
    """
    argv = ["horovodrun", "-np", str(spec.num_ranks)]
    if spec.hosts:
        argv += ["-H", format_hosts(spec.hosts)]
    elif spec.hostfile is not None:
        argv += ["--hostfile", spec.hostfile]
    controller = spec.controller or ("mpi" if spec.backend == "mpi" else None)
    if controller is not None:
        argv.append(f"--{controller}")
    if spec.network_interface is not None:
        argv += ["--network-interfaces", spec.network_interface]
    if spec.start_timeout is not None:
        argv += ["--start-timeout", str(math.ceil(spec.start_timeout))]
    if controller == "mpi":
        mpi_args = ["--oversubscribe"] if spec.oversubscribe else []
        if spec.timeout is not None:
            mpi_args += ["--timeout", str(math.ceil(spec.timeout))]
        if mpi_args:
            argv += ["--mpi-args", shlex.join(mpi_args)]
    return [*argv, *spec.command]


def build_command(
    spec: LaunchSpec, env: Mapping[str, str] | None = None, is_root: bool = False
) -> LaunchCommand:
    """Build the launcher invocation for ``spec``.

    Args:
        spec: what to launch.
        env: the environment the launcher will get (for mpirun's ``-x`` list).
        is_root: running as root (mpirun needs ``--allow-run-as-root``).

    Returns:
        The argv and the environment additions (``PLAIT_BACKEND``, ``PLAIT_TIMELINE``
        with ``spec.timeline``, and for
        horovodrun the ``-x NAME=VALUE`` entries of ``spec.env_vars``).
    """
    extra = plait_env(spec)
    if spec.launcher == "mpirun":
        return LaunchCommand(mpirun_argv(spec, env, is_root), extra)
    for entry in spec.env_vars:
        name, sep, value = entry.partition("=")
        if sep:
            extra[name] = value
    return LaunchCommand(horovodrun_argv(spec), extra)
