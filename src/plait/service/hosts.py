"""The ``hosts`` backend: workers are slots on hosts from a hostfile (this machine by default).

Capacity is the hosts' slots; a worker takes ``processes_per_worker`` slots on
one host. Processes on this machine are started directly; on another host
through an agent (``ssh``, or the rsh agent of :mod:`plait.testing.netns`),
called as ``AGENT HOST 'env NAME=VALUE ... COMMAND'`` with every word quoted
(the agent hands the line to the remote shell, as ssh does). Jobs of the
``horovod`` and ``mpi`` frameworks are one ``mpirun`` over the allocated hosts,
built by :func:`plait.launch.build_command` (with the agent as Open MPI's
``plm_rsh_agent``). Every process is a session leader, so a job is a list of
process groups that can be killed, or polled after the service restarted.
Standard library only.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from plait.errors import invalid
from plait.launch.command import LaunchSpec, build_command, forwarded_env_names
from plait.launch.hostfile import HostSlots
from plait.launch.run import KEEPALIVE_MCA, _descendants
from plait.service.bootstrap import exit_path
from plait.service.contract import SVC_PREFIX, layout_env
from plait.service.spec import JobSpec

__all__ = ["HostsBackend", "Launched", "kill_groups", "groups_alive"]

_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}
#: Seconds between SIGTERM and SIGKILL.
KILL_GRACE_S = 5.0
_BASE_ENV = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "HOME", "LANG")


def groups_alive(pgids: Sequence[int]) -> bool:
    """Whether any process of these process groups still runs (zombies count as gone)."""
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            return True
        # a zombie leader keeps the group "alive" for killpg; look for a live member
        if _live_member(pgid):
            return True
    return False


def _live_member(pgid: int) -> bool:
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def kill_groups(pgids: Sequence[int], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM the process groups and every descendant, wait ``grace`` s, SIGKILL what is left.

    mpirun puts its agents (and so the remote daemons, and the ranks under them) in process
    groups of their own; they are found through /proc while their parents live, remembered,
    and waited for too.
    """
    known: set[int] = set()

    def alive() -> bool:
        known.update(d for g in pgids for d in _descendants(g))
        return groups_alive(pgids) or any(_pid_alive(p) for p in known)

    alive()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for target in [-g for g in pgids] + sorted(known):
            try:
                os.kill(target, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and alive():
            time.sleep(0.1)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass
class Launched:
    """A started job on hosts.

    Attributes:
        procs: the processes started (own children; empty for an adopted job).
        pgids: their process groups.
        world_size: number of ranks.
        job_dir: where the ranks write their logs and exit files.
        mpirun: whether ``procs[0]`` is one mpirun for every rank.
    """

    procs: list[subprocess.Popen[bytes]]
    pgids: list[int]
    world_size: int
    job_dir: str
    mpirun: bool = False
    _closed: list[int] = field(default_factory=list)

    def poll(self) -> bool:
        """Whether every process has ended."""
        if self.procs:
            return all(p.poll() is not None for p in self.procs)
        return not groups_alive(self.pgids)

    def failed_rank(self) -> tuple[int, int] | None:
        """The first rank (and its status) that has already ended with a non-zero status, if any."""
        codes = self.exit_codes(final=False)
        return next(((r, c) for r, c in sorted(codes.items()) if c != 0), None)

    def exit_codes(self, final: bool = True) -> dict[int, int]:
        """Exit status per rank: from the ranks' exit files, else from the process.

        Args:
            final: the job has ended: a rank with neither is reported as -1 (lost).
        """
        codes: dict[int, int] = {}
        for rank in range(self.world_size):
            try:
                with open(exit_path(self.job_dir, rank)) as f:
                    codes[rank] = int(f.read().strip())
                continue
            except (OSError, ValueError):
                pass
            if not self.mpirun and rank < len(self.procs) and self.procs[rank].poll() is not None:
                rc = int(self.procs[rank].returncode)
                codes[rank] = 128 - rc if rc < 0 else rc
            elif final:
                codes[rank] = -1
        return codes

    def launcher_code(self) -> int | None:
        """mpirun's exit status (``None`` without mpirun or while it runs)."""
        if self.mpirun and self.procs:
            return self.procs[0].poll()
        return None

    def kill(self) -> None:
        """Kill every process of the job (see :func:`kill_groups`) and reap our children."""
        kill_groups(self.pgids)
        for p in self.procs:
            try:
                p.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass


class HostsBackend:
    """Workers on hosts; thread-safe slot accounting.

    Args:
        hosts: the hosts and their slots (process slots).
        agent: argv of the remote-start agent (``["ssh"]``, or an rsh agent script);
            ``None``: every host must be this machine.
        network_interface: interface names or CIDR for MPI traffic (``btl``/``oob_tcp_if_include``).
        python: the interpreter the ranks run ``plait.service.bootstrap`` with.

    Raises:
        ConfigError: on an empty host list, or a remote host without an agent.
    """

    name = "hosts"

    def __init__(self, hosts: Sequence[HostSlots], agent: Sequence[str] | None = None,
                 network_interface: str | None = None, python: str = sys.executable) -> None:
        if not hosts:
            raise invalid("hosts", list(hosts), "at least one 'HOST slots=N'")
        self.hosts = list(hosts)
        self.agent = list(agent) if agent else None
        for h in self.hosts:
            if not self.is_local(h.host) and self.agent is None:
                raise invalid("hosts", h.host,
                              "this machine's names only, unless an agent (--agent) is given")
        self.network_interface = network_interface
        self.python = python
        self._free = {h.host: h.slots for h in self.hosts}
        self._lock = threading.Lock()
        self._ports: set[int] = set()

    @property
    def capacity(self) -> int:
        """Process slots in all."""
        return sum(h.slots for h in self.hosts)

    def free_slots(self) -> int:
        """Process slots not taken by running jobs."""
        with self._lock:
            return sum(self._free.values())

    def is_local(self, host: str) -> bool:
        """Whether ``host`` names this machine (processes start without the agent)."""
        return self.agent is None or host in _LOCAL_NAMES or host == socket.gethostname()

    # -- slots ---------------------------------------------------------------------------
    def allocate(self, spec: JobSpec) -> list[str] | None:
        """Take slots for every worker of ``spec``; ``None`` if they do not fit.

        Workers are spread over the hosts round-robin (one per host before a second on any),
        then listed in host order, so that worker ``i`` runs ranks ``i*P .. i*P+P-1`` as
        ``mpirun --map-by slot`` places them.
        """
        with self._lock:
            free = dict(self._free)
            count = {h.host: 0 for h in self.hosts}
            placed = 0
            while placed < spec.instances:
                room = [h.host for h in self.hosts if free[h.host] >= spec.processes_per_worker]
                if not room:
                    return None
                for host in room[: spec.instances - placed]:
                    free[host] -= spec.processes_per_worker
                    count[host] += 1
                    placed += 1
            self._free = free
            return [h.host for h in self.hosts for _ in range(count[h.host])]

    def adopt(self, job_id: str, spec: JobSpec, pgids: Sequence[int], job_dir: str) -> Launched | None:
        """Watch a job started by a previous service (its process groups); ``None`` without any."""
        return Launched([], list(pgids), spec.world_size, job_dir) if pgids else None

    def reserve(self, workers: Sequence[str], per_worker: int) -> None:
        """Take the slots of an adopted job (it runs since before a restart)."""
        with self._lock:
            for host in workers:
                if host in self._free:
                    self._free[host] -= per_worker

    def release(self, workers: Sequence[str], per_worker: int, ports: Sequence[int] = ()) -> None:
        """Give back a finished job's slots and ports."""
        with self._lock:
            for host in workers:
                if host in self._free:
                    self._free[host] += per_worker
            self._ports.difference_update(ports)

    def _port(self) -> int:
        """A TCP port free on this machine now and not handed to another running job."""
        with self._lock:
            while True:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("", 0))
                    port = int(s.getsockname()[1])
                if port not in self._ports:
                    self._ports.add(port)
                    return port

    # -- launching -----------------------------------------------------------------------
    def endpoints(self, spec: JobSpec, workers: Sequence[str]) -> list[str]:
        """``host:port`` per rank (tensorflow), rank 0's (torch) or none, with ports taken here."""
        if spec.world_size == 1 or spec.framework not in ("torch", "tensorflow"):
            return []
        ranks = [w for w in workers for _ in range(spec.processes_per_worker)]
        if spec.framework == "torch":
            ranks = ranks[:1]
        return [f"{host}:{self._port()}" for host in ranks]

    def _remote(self, host: str, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
        if self.agent is None:
            raise RuntimeError(f"no remote agent (ssh) to start a process on host {host!r}")
        words = ["env", *(f"{k}={v}" for k, v in sorted(env.items())), *argv]
        return [*self.agent, host, shlex.join(words)]

    def _start(self, host: str, argv: Sequence[str], extra: Mapping[str, str],
               log: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, **extra}
        if not self.is_local(host):
            names = set(forwarded_env_names(env)) | set(_BASE_ENV) | set(extra)
            argv = self._remote(host, argv, {k: env[k] for k in sorted(names) if k in env})
        with open(log, "ab") as out:
            return subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def launch(self, job_id: str, spec: JobSpec, workers: Sequence[str], job_env: Mapping[str, str],
               job_dir: str, endpoints: Sequence[str]) -> Launched:
        """Start every process of a job.

        Args:
            job_id: the job.
            spec: what to run.
            workers: the host of each worker (from :meth:`allocate`).
            job_env: the job's variables (``PLAIT_JOB_ID``, parameters, progress file...).
            job_dir: the job's directory (logs, exit files).
            endpoints: from :meth:`endpoints`.

        Returns:
            The started job.
        """
        base = {**job_env, **layout_env(spec.framework, spec.instances, spec.processes_per_worker, endpoints),
                f"{SVC_PREFIX}DIR": job_dir}
        command = [self.python, "-m", "plait.service.bootstrap", "--", *spec.argv()]
        launcher_log = os.path.join(job_dir, "launcher.log")
        if spec.framework in ("horovod", "mpi") and spec.world_size > 1:
            proc = self._mpirun(spec, workers, base, command, launcher_log)
            return Launched([proc], [proc.pid], spec.world_size, job_dir, mpirun=True)
        procs = []
        try:
            for rank in range(spec.world_size):
                host = workers[rank // spec.processes_per_worker]
                procs.append(self._start(host, command, {**base, f"{SVC_PREFIX}RANK": str(rank)},
                                         launcher_log))
        except OSError:
            kill_groups([p.pid for p in procs])
            raise
        return Launched(procs, [p.pid for p in procs], spec.world_size, job_dir)

    def _mpirun(self, spec: JobSpec, workers: Sequence[str], base: Mapping[str, str],
                command: Sequence[str], log: str) -> subprocess.Popen[bytes]:
        slots: dict[str, int] = {}
        for host in workers:
            slots[host] = slots.get(host, 0) + spec.processes_per_worker
        mca = list(KEEPALIVE_MCA)
        if self.agent is not None and not all(self.is_local(h) for h in slots):
            mca.append(("plm_rsh_agent", shlex.join(self.agent)))
        launch = LaunchSpec(
            command=tuple(command), np=spec.world_size,
            hosts=tuple(HostSlots(h, n) for h, n in slots.items()), launcher="mpirun",
            backend="horovod" if spec.framework == "horovod" else "mpi",
            network_interface=self.network_interface, oversubscribe=True, mca=tuple(mca),
            env_vars=tuple(k for k in base if not k.startswith(("PLAIT_", "HOROVOD_"))),
        )
        env = {**os.environ, **base}
        cmd = build_command(launch, env, is_root=os.geteuid() == 0)
        first = workers[0]
        argv = cmd.argv
        if not self.is_local(first):
            names = set(forwarded_env_names(env)) | set(_BASE_ENV) | set(base) | set(cmd.env)
            argv = self._remote(first, argv, {k: {**env, **cmd.env}[k] for k in sorted(names)
                                              if k in env or k in cmd.env})
        return self._start("localhost", argv, {**base, **cmd.env}, log)
