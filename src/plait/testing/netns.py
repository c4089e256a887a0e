"""Emulated hosts: Linux network namespaces on a private bridge, for multi-host tests.

Each emulated host is a network namespace with one interface ``eth0`` plugged
into a bridge that lives in a namespace of its own. Host ``i`` has address
``SUBNET.(i+1)/24`` and resolves every other host by name through
``/etc/netns/HOST/hosts``. Processes started through the harness run with the
host's name as their hostname (``unshare --uts``), so Open MPI sees distinct
nodes. The subnet exists only inside those namespaces; a blackhole route for
it in the root namespace makes sure no packet for it ever leaves the machine.

Open MPI reaches the hosts through an rsh agent script (``--mca
plm_rsh_agent``, see :meth:`EmulatedHosts.mpirun_args`); the same script, named
``ssh`` in :attr:`EmulatedHosts.bin_dir`, serves ``horovodrun``. Launch jobs
from inside the first host (:meth:`EmulatedHosts.exec`).

Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux); ``tc`` for ``rate``.

Command line::

    python -m plait.testing.netns up N [--slots S] [--rate 1gbit]
    python -m plait.testing.netns down PREFIX
    python -m plait.testing.netns cleanup [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

from plait.errors import PlaitError, invalid

__all__ = [
    "NAME_PREFIX",
    "EmulatedHosts",
    "NetnsError",
    "cleanup",
    "main",
    "unavailable_reason",
]

#: Every namespace, hostname and work directory made here starts with this.
NAME_PREFIX = "plait-"
_NAME_RE = re.compile(r"plait-(\d+)-(\d+)-(?:h\d+|br)\Z")
_RATE_RE = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:[kmgt]?bit|[kmgt]?bps)\Z")
_MARKER = ".plait-netns"
_LOCK_FILE = os.path.join("/run" if os.path.isdir("/run") else tempfile.gettempdir(),
                          "plait-netns.lock")
_CMD_TIMEOUT = 30.0
_counter = itertools.count()

# Runs "COMMAND..." (a command line, as ssh would run it) on an emulated host:
# AGENT [ssh options] HOST [COMMAND...]. Unknown hosts are refused.
_AGENT = """#!/bin/sh
# rsh/ssh agent for plait emulated hosts {prefix}: AGENT [ssh-options] HOST [COMMAND...]
# ssh options may come before and after HOST (horovodrun puts some after it).
host=
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-i|-l|-F|-E|-J|-b|-c|-m) [ $# -ge 2 ] && shift 2 || shift ;;
    -*) shift ;;
    *) [ -n "$host" ] && break; host=$1; shift ;;
  esac
done
case "$host" in
{cases}
  *) echo "plait emulated-host agent: unknown host '$host' (known: {known})" >&2; exit 255 ;;
esac
# Like an ssh client, the agent relays for the remote command and ends it when it is told
# to end (SIGTERM/SIGHUP/SIGINT): the command runs in a process group of its own (setsid),
# which the agent signals as a whole, so no orphan keeps the launcher's pipes open (horovodrun
# waits for them) after the launcher terminated its ssh.
{env}setsid ip netns exec "$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$*"' "$host" "$@" 0<&0 &
child=$!
trap 'kill -TERM -- -$child 2>/dev/null; sleep 1; kill -KILL -- -$child 2>/dev/null; exit 143' TERM HUP INT
wait $child
"""


class NetnsError(PlaitError, RuntimeError):
    """A namespace, link or route could not be created or used."""


def unavailable_reason(need_tc: bool = False) -> str | None:
    """Say why emulated hosts cannot be made here, if they cannot.

    Args:
        need_tc: also require ``tc`` (for a rate limit).

    Returns:
        ``None`` if they can, else a sentence (for ``pytest.skip``).
    """
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")) + (
        (("tc", "iproute2"),) if need_tc else ()
    ):
        if shutil.which(tool) is None:
            return f"emulated hosts need '{tool}' (apt-get install {package})"
    return None


def _run(argv: Sequence[str], check: bool = True, timeout: float = _CMD_TIMEOUT) -> str:
    """Run a short administrative command; return its stdout."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{shlex.join(argv)} failed: {exc}") from exc
    if check and proc.returncode != 0:
        raise NetnsError(
            f"{shlex.join(argv)} failed with exit status {proc.returncode}: {proc.stderr.strip()}"
        )
    return proc.stdout


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    """Serialise route and namespace bookkeeping between processes."""
    with open(_LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process left in namespace ``ns`` (all were started by the harness)."""
    for pid in _run(["ip", "netns", "pids", ns], check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _remove_namespace(ns: str) -> None:
    _kill_namespace(ns)
    _run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(os.path.join("/etc/netns", ns), ignore_errors=True)
    _remove_session_dirs(ns)


def _remove_session_dirs(host: str) -> None:
    """Remove Open MPI session directories (``ompi.HOST.UID``) of an emulated host."""
    for tmp in {tempfile.gettempdir(), "/tmp"}:
        with contextlib.suppress(OSError):
            for name in os.listdir(tmp):
                if name.startswith(f"ompi.{host}."):
                    shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


def _ensure_blackhole(cidr: str) -> None:
    routes = _run(["ip", "route", "show", "exact", cidr]).strip()
    if not routes:
        _run(["ip", "route", "add", "blackhole", cidr])
    elif not routes.startswith("blackhole"):
        raise NetnsError(
            f"subnet {cidr} is already routed in the root namespace ({routes!r}); "
            "it must be unused on this machine: choose another private subnet"
        )


def _drop_blackholes_if_unused(cidrs: Iterable[str]) -> None:
    """Remove the blackhole routes for ``cidrs`` once no plait namespace is left (under _lock)."""
    if any(ns.startswith(NAME_PREFIX) for ns in _namespaces()):
        return
    for cidr in sorted(set(cidrs)):
        if _run(["ip", "route", "show", "exact", cidr], check=False).startswith("blackhole"):
            _run(["ip", "route", "del", "blackhole", cidr], check=False)


def _work_dir_subnet(path: str) -> str | None:
    with contextlib.suppress(OSError):
        with open(os.path.join(path, _MARKER)) as f:
            return f.read().strip()
    return None


def _work_dirs(prefix: str) -> list[str]:
    tmp = tempfile.gettempdir()
    found = []
    for name in sorted(os.listdir(tmp)):
        path = os.path.join(tmp, name)
        if name.startswith(prefix) and os.path.isfile(os.path.join(path, _MARKER)):
            found.append(path)
    return found


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmulatedHosts:
    """``n`` emulated hosts on one private subnet; a context manager.

    Entering creates everything; leaving deletes everything (namespaces,
    processes still running in them, ``/etc/netns`` entries, the work
    directory and, when no other instance needs it, the blackhole route),
    whatever happened inside.

    Args:
        n: number of hosts (1..250).
        subnet: first three octets of a private IPv4 /24, e.g. ``"10.77.0"``.
        rate: optional per-link egress limit for ``tc tbf``, e.g. ``"1gbit"``.
        slots: slots per host written to :attr:`hostfile`.
        clean_env: start remote commands with an almost empty environment
            (``PATH``, ``HOME``, ``LANG``), as ssh would; otherwise they inherit the
            launcher's environment.

    Attributes:
        prefix: unique name prefix of this instance (``plait-PID-K``).
        hosts: host names (also namespace names and hostnames).
        hostfile: path of a hostfile listing every host with ``slots`` slots.
        plain_hostfile: the same hosts without a comment line, for readers that do not
            skip comments (``horovodrun --hostfile``).
        hosts_arg: the same hosts as a ``-H`` value, ``HOST:SLOTS,...``.
        agent: path of the rsh agent script for ``plm_rsh_agent``.
        bin_dir: directory with an ``ssh`` for horovodrun (put it first in PATH).

    Raises:
        ConfigError: on a bad ``n``, ``subnet``, ``rate`` or ``slots``.
    """

    def __init__(
        self,
        n: int,
        subnet: str = "10.77.0",
        rate: str | None = None,
        slots: int = 1,
        clean_env: bool = True,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 250:
            raise invalid("n", n, "an integer in 1..250")
        try:
            net = ipaddress.IPv4Network(f"{subnet}.0/24")
        except ValueError:
            net = None
        if net is None or not net.is_private or subnet.count(".") != 2:
            raise invalid("subnet", subnet, "three octets of a private IPv4 /24, e.g. '10.77.0'")
        if rate is not None and not _RATE_RE.match(rate):
            raise invalid("rate", rate, "a tc rate such as '1gbit', '100mbit' or '10mbps'")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise invalid("slots", slots, "an integer >= 1")
        self.n, self.subnet, self.rate, self.slots = n, subnet, rate, slots
        self.clean_env = clean_env
        self.cidr = str(net)
        self.prefix = f"{NAME_PREFIX}{os.getpid()}-{next(_counter)}"
        self.hosts = [f"{self.prefix}-h{i}" for i in range(n)]
        self.bridge = f"{self.prefix}-br"
        self.workdir = ""
        self.hostfile = ""
        self.plain_hostfile = ""
        self.hosts_arg = ",".join(f"{h}:{slots}" for h in self.hosts)
        self.agent = ""
        self.bin_dir = ""
        self._up = False

    # -- lifecycle -----------------------------------------------------------------
    def __enter__(self) -> EmulatedHosts:
        self.up()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    def up(self) -> None:
        """Create the namespaces, links, names, hostfile and agent.

        Raises:
            NetnsError: if something cannot be created (everything made so far is removed).
        """
        reason = unavailable_reason(need_tc=self.rate is not None)
        if reason is not None:
            raise NetnsError(reason)
        try:
            self.workdir = tempfile.mkdtemp(prefix=self.prefix + "-")
            with open(os.path.join(self.workdir, _MARKER), "w") as f:
                f.write(self.cidr + "\n")
            with _lock():
                _run(["ip", "netns", "add", self.bridge])
                _ensure_blackhole(self.cidr)
            br = ["ip", "-n", self.bridge]
            _run([*br, "link", "add", "br0", "type", "bridge"])
            _run([*br, "link", "set", "br0", "up"])
            for i, host in enumerate(self.hosts):
                _run(["ip", "netns", "add", host])
                _run([*br, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0",
                      "netns", host])
                _run([*br, "link", "set", f"v{i}", "master", "br0"])
                _run([*br, "link", "set", f"v{i}", "up"])
                h = ["ip", "-n", host]
                _run([*h, "addr", "add", f"{self.address(host)}/24", "dev", "eth0"])
                _run([*h, "link", "set", "eth0", "up"])
                _run([*h, "link", "set", "lo", "up"])
                if self.rate is not None:
                    _run(["ip", "netns", "exec", host, "tc", "qdisc", "add", "dev", "eth0",
                          "root", "tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"])
                self._write_etc_hosts(host)
            self._write_files()
            self._up = True
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Delete everything this instance created; safe to call more than once.

        Never raises: problems are reported on stderr.
        """
        try:
            with _lock():
                for ns in [*self.hosts, self.bridge]:
                    _remove_namespace(ns)
                _drop_blackholes_if_unused([self.cidr])
        except Exception as exc:  # teardown must go on, and must not mask the test's error
            print(f"plait.testing.netns: teardown of {self.prefix}: {exc}", file=sys.stderr)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self._up = False

    # -- files -----------------------------------------------------------------------
    def _write_etc_hosts(self, host: str) -> None:
        os.makedirs(os.path.join("/etc/netns", host), exist_ok=True)
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [f"{self.address(h)} {h}" for h in self.hosts]
        with open(os.path.join("/etc/netns", host, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def _write_files(self) -> None:
        self.hostfile = os.path.join(self.workdir, "hostfile")
        with open(self.hostfile, "w") as f:
            f.write(f"# plait emulated hosts {self.prefix} ({self.cidr})\n")
            f.writelines(f"{h} slots={self.slots}\n" for h in self.hosts)
        self.plain_hostfile = os.path.join(self.workdir, "hostfile.plain")
        with open(self.plain_hostfile, "w") as f:
            f.writelines(f"{h} slots={self.slots}\n" for h in self.hosts)
        cases = "\n".join(f"  {h}) ;;" for h in self.hosts)
        cases += "\n" + "\n".join(f"  {self.address(h)}) host={h} ;;" for h in self.hosts)
        env = 'env -i PATH="$PATH" HOME="${HOME:-/root}" LANG=C.UTF-8 ' if self.clean_env else ""
        script = _AGENT.format(
            prefix=self.prefix, cases=cases, known=" ".join(self.hosts), env=env
        )
        self.agent = os.path.join(self.workdir, "agent")
        self.bin_dir = os.path.join(self.workdir, "bin")
        os.makedirs(self.bin_dir)
        for path in (self.agent, os.path.join(self.bin_dir, "ssh")):
            with open(path, "w") as f:
                f.write(script)
            os.chmod(path, 0o755)

    # -- queries ---------------------------------------------------------------------
    def _index(self, host: str) -> int:
        try:
            return self.hosts.index(host)
        except ValueError:
            raise invalid("host", host, f"one of {self.hosts}") from None

    def address(self, host: str) -> str:
        """IPv4 address of ``host``.

        Args:
            host: one of :attr:`hosts`.

        Returns:
            ``SUBNET.(i+1)``.

        Raises:
            ConfigError: if ``host`` is not one of :attr:`hosts`.
        """
        return f"{self.subnet}.{self._index(host) + 1}"

    def mpirun_args(self) -> list[str]:
        """Open MPI flags that start ranks on these hosts and keep MPI on their subnet.

        Returns:
            ``--mca plm_rsh_agent AGENT --mca btl_tcp_if_include CIDR
            --mca oob_tcp_if_include CIDR``; add ``--hostfile`` yourself.

        Raises:
            NetnsError: if the hosts are not up.
        """
        if not self._up:
            raise NetnsError(f"emulated hosts {self.prefix} are not up (use 'with EmulatedHosts')")
        return [
            "--mca", "plm_rsh_agent", self.agent,
            "--mca", "btl_tcp_if_include", self.cidr,
            "--mca", "oob_tcp_if_include", self.cidr,
        ]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment whose PATH finds this instance's ``ssh`` first (for horovodrun).

        Args:
            base: environment to start from (default: ``os.environ``).

        Returns:
            A copy of ``base`` with :attr:`bin_dir` prepended to ``PATH``.
        """
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` on ``host`` (its namespace and hostname).

        Args:
            host: one of :attr:`hosts`.
            argv: the program and its arguments (passed as arguments, never through a shell
                string).

        Returns:
            ``ip netns exec HOST unshare --uts sh -c 'hostname "$0" && exec "$@"' HOST argv...``

        Raises:
            ConfigError: if ``host`` is unknown or ``argv`` is empty.
        """
        self._index(host)
        if not argv:
            raise invalid("argv", argv, "a non-empty list of strings")
        return ["ip", "netns", "exec", host, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', host, *argv]

    def exec(
        self, host: str, argv: Sequence[str], timeout: float = 120.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` and wait; on timeout kill its whole process group.

        Args:
            host: one of :attr:`hosts`.
            argv: the program and its arguments.
            timeout: seconds before the command's process group is killed.
            **kwargs: passed to :class:`subprocess.Popen` (``env``, ``cwd``...); output is
                captured as text.

        Returns:
            The finished process with ``stdout`` and ``stderr``.

        Raises:
            subprocess.TimeoutExpired: if it ran longer than ``timeout`` (it is killed first).
            ConfigError: if ``host`` is unknown.
        """
        cmd = self.command(host, argv)
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, **kwargs,
        ) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[str]:
        """Start ``argv`` on ``host`` in a new session (kill it with ``os.killpg``).

        Args:
            host: one of :attr:`hosts`.
            argv: the program and its arguments.
            **kwargs: passed to :class:`subprocess.Popen`; ``text=True`` is set.

        Returns:
            The running process (leader of its own process group).

        Raises:
            ConfigError: if ``host`` is unknown.
        """
        return subprocess.Popen(
            self.command(host, argv), text=True, start_new_session=True, **kwargs
        )

    def link_down(self, host: str) -> None:
        """Unplug ``host`` from the bridge (its bridge port goes down).

        Args:
            host: one of :attr:`hosts`.
        """
        _run(["ip", "-n", self.bridge, "link", "set", f"v{self._index(host)}", "down"])

    def link_up(self, host: str) -> None:
        """Plug ``host`` back into the bridge.

        Args:
            host: one of :attr:`hosts`.
        """
        _run(["ip", "-n", self.bridge, "link", "set", f"v{self._index(host)}", "up"])

    def _counter(self, host: str, name: str) -> int:
        self._index(host)
        path = f"/sys/class/net/eth0/statistics/{name}"
        return int(_run(["ip", "netns", "exec", host, "cat", path]).strip())

    def tx_bytes(self, host: str) -> int:
        """Bytes ``host`` has sent on its interface.

        Args:
            host: one of :attr:`hosts`.

        Returns:
            The ``tx_bytes`` counter of ``eth0`` inside the host.
        """
        return self._counter(host, "tx_bytes")

    def rx_bytes(self, host: str) -> int:
        """Bytes ``host`` has received on its interface.

        Args:
            host: one of :attr:`hosts`.

        Returns:
            The ``rx_bytes`` counter of ``eth0`` inside the host.
        """
        return self._counter(host, "rx_bytes")


def cleanup(prefix: str = NAME_PREFIX, force: bool = False) -> list[str]:
    """Remove leftover emulated hosts whose names start with ``prefix``.

    Args:
        prefix: ``"plait-"`` for all, or one instance's ``plait-PID-K``.
        force: also remove instances whose creating process is still alive.

    Returns:
        The namespaces removed.
    """
    removed: list[str] = []
    with _lock():
        for ns in _namespaces():
            m = _NAME_RE.match(ns)
            if m is None or not ns.startswith(prefix):
                continue
            if not force and int(m.group(1)) != os.getpid() and _pid_alive(int(m.group(1))):
                continue
            _remove_namespace(ns)
            removed.append(ns)
        for entry in os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []:
            if _NAME_RE.match(entry) and entry.startswith(prefix) and entry not in _namespaces():
                shutil.rmtree(os.path.join("/etc/netns", entry), ignore_errors=True)
        subnets = {"10.77.0.0/24"}
        live = {ns for ns in _namespaces() if _NAME_RE.match(ns)}
        for tmp in {tempfile.gettempdir(), "/tmp"}:
            for name in os.listdir(tmp) if os.path.isdir(tmp) else []:
                host = name.split(".")[1] if name.count(".") >= 2 else ""
                if name.startswith(f"ompi.{prefix}") and _NAME_RE.match(host) and host not in live:
                    shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
        for path in _work_dirs(prefix):
            subnets.add(_work_dir_subnet(path) or "10.77.0.0/24")
            m = re.match(r"plait-(\d+)-", os.path.basename(path))
            if force or m is None or not _pid_alive(int(m.group(1))):
                shutil.rmtree(path, ignore_errors=True)
        _drop_blackholes_if_unused(subnets)
    return removed


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m plait.testing.netns up N | down PREFIX | cleanup``.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    p = argparse.ArgumentParser(prog="python -m plait.testing.netns")
    sub = p.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="create N emulated hosts and leave them up")
    up.add_argument("n", type=int)
    up.add_argument("--slots", type=int, default=1)
    up.add_argument("--rate", default=None)
    up.add_argument("--subnet", default="10.77.0")
    down = sub.add_parser("down", help="remove the emulated hosts of one 'up'")
    down.add_argument("prefix")
    clean = sub.add_parser("cleanup", help="remove leftovers of dead processes")
    clean.add_argument("--force", action="store_true", help="also those of live processes")
    args = p.parse_args(argv)
    try:
        if args.action == "up":
            hosts = EmulatedHosts(args.n, args.subnet, args.rate, args.slots)
            hosts.up()
            first = hosts.hosts[0]
            print(f"prefix:   {hosts.prefix}")
            print(f"hosts:    {' '.join(hosts.hosts)}")
            print(f"hostfile: {hosts.hostfile}")
            print(f"agent:    {hosts.agent}")
            print("run:      " + shlex.join(hosts.command(first, ["mpirun", "--hostfile",
                  hosts.hostfile, *hosts.mpirun_args(), "hostname"])))
            print(f"remove:   python -m plait.testing.netns down {hosts.prefix}")
            return 0
        if args.action == "down":
            if not re.fullmatch(r"plait-\d+-\d+", args.prefix):
                print(f"invalid prefix {args.prefix!r}: expected 'plait-PID-K'", file=sys.stderr)
                return 2
            removed = cleanup(args.prefix + "-", force=True)
        else:
            removed = cleanup(NAME_PREFIX, force=args.force)
    except (NetnsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("removed: " + (" ".join(removed) or "nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
