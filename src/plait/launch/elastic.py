"""``plait run --elastic``: elastic training on the MPI backend, by relaunch.

Horovod's elastic mode resizes a running job in place; the MPI backend cannot (a
world communicator is fixed when ``mpirun`` starts it). So ``plait run --elastic``
keeps the job's hosts in step with a host discovery script (horovodrun's
``--host-discovery-script``, ``--min-np``, ``--max-np``) by relaunching it:

* it runs the script every ``interval`` seconds; each output line is ``HOST`` (1
  slot) or ``HOST:SLOTS``. The job runs on the discovered hosts, at most
  ``max_np`` ranks; with fewer than ``min_np`` slots it waits for more (up to
  ``elastic_timeout`` seconds);
* when the hosts change, it tells the job through a small TCP service (its
  address is ``PLAIT_ELASTIC_ADDR`` in every rank's environment): at its next
  ``state.commit()`` every rank persists the commit and exits with
  :data:`EXIT_RELAUNCH` (``hvd.elastic.run`` on the MPI backend does this, see
  :mod:`plait.elastic_relaunch`), and the job is started again on the new hosts;
* when a rank fails (killed, its host lost), the job ends as any MPI job does; the
  hosts blamed for it are left out while enough others remain, and the job is
  started again on what discovery then reports;
* every start resumes from the last commit, which each host's first rank wrote
  under ``PLAIT_ELASTIC_DIR`` (a directory on every host; by default a fresh one
  under the system's temporary directory, removed at the end).

A failed start that committed nothing counts against ``max_failures`` (then the
job gives up, naming the failures); relaunches after commits and host changes are
limited only by ``reset_limit`` when given. Standard library only.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from plait.errors import ConfigError, invalid
from plait.launch.command import LaunchSpec, build_command
from plait.launch.hostfile import HostSlots, parse_hosts, total_slots
from plait.launch.restart import blamed_hosts, rank_hosts

__all__ = [
    "EXIT_RELAUNCH",
    "ElasticPolicy",
    "Notifier",
    "discover",
    "plan_hosts",
    "run_elastic",
]

#: Exit status of every rank that stops for a relaunch (``EX_TEMPFAIL``).
EXIT_RELAUNCH = 75
_PROG = "plait run"
Runner = Callable[..., int]


@dataclass(frozen=True)
class ElasticPolicy:
    """How ``plait run --elastic`` follows the discovered hosts.

    Attributes:
        discovery_script: command printing one ``HOST[:SLOTS]`` per line.
        min_np: fewest ranks the job runs with.
        max_np: most ranks the job runs with.
        interval: seconds between discovery runs.
        elastic_timeout: seconds to wait for ``min_np`` slots before giving up.
        max_failures: failed starts in a row without a commit before giving up.
        reset_limit: most relaunches in all (None: no limit).
        discovery_timeout: seconds one run of the script may take.
    """

    discovery_script: str
    min_np: int
    max_np: int
    interval: float = 1.0
    elastic_timeout: float = 600.0
    max_failures: int = 3
    reset_limit: int | None = None
    discovery_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not self.discovery_script:
            raise invalid("--host-discovery-script", self.discovery_script, "a command")
        if self.min_np < 1:
            raise invalid("--min-np", self.min_np, "an integer >= 1")
        if self.max_np < self.min_np:
            raise invalid("--max-np", self.max_np, f"an integer >= --min-np ({self.min_np})")
        if not self.interval > 0:
            raise invalid("interval", self.interval, "seconds > 0")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise invalid("--reset-limit", self.reset_limit, "an integer >= 0")


def discover(script: str, timeout: float = 30.0) -> list[HostSlots]:
    """Run the discovery script once.

    Args:
        script: a shell command (run through the shell, as horovodrun runs it: the user's
            own command line); each line of its output is ``HOST`` or ``HOST:SLOTS``.
        timeout: seconds it may take.

    Returns:
        The hosts it printed, in order (none if it printed nothing).

    Raises:
        ConfigError: if it fails, times out or prints a malformed line (the line is named).
    """
    try:
        proc = subprocess.run(script, shell=True, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(f"host discovery script {script!r} did not finish within {timeout:g}s") from exc
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise ConfigError(f"host discovery script {script!r} failed with exit status "
                          f"{proc.returncode}: {tail or '(no stderr)'}")
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    hosts: list[HostSlots] = []
    for line in lines:
        hosts += parse_hosts(line, source=f"host discovery script {script!r}, line {line!r}")
    return hosts


def plan_hosts(found: Sequence[HostSlots], left_out: Sequence[str], max_np: int) -> list[HostSlots]:
    """The hosts and slots of the next start: the discovered hosts but those left out,
    cut to ``max_np`` slots.

    Args:
        found: discovered hosts.
        left_out: names of hosts blamed for a failure.
        max_np: most ranks.

    Returns:
        Hosts in discovery order whose slots add up to at most ``max_np``.
    """
    plan: list[HostSlots] = []
    room = max_np
    for h in found:
        if h.host in left_out or room <= 0:
            continue
        plan.append(HostSlots(h.host, min(h.slots, room)))
        room -= plan[-1].slots
    return plan


class Notifier:
    """A TCP service telling the job's rank 0 the current host generation.

    A rank sends ``commit N`` (its commit count) and reads back the generation, which
    :meth:`bump` raises when the hosts changed. It also remembers the last commit count
    reported, so the supervisor knows whether a failed start made progress.
    """

    def __init__(self) -> None:
        self.generation = 0
        self.commits = 0
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(256).decode(errors="replace").split()
                if len(line) == 2 and line[0] == "commit" and line[1].isdigit():
                    owner.commits = max(owner.commits, int(line[1]))
                self.wfile.write(f"{owner.generation}\n".encode())

        self._server = socketserver.ThreadingTCPServer(("0.0.0.0", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def bump(self) -> None:
        """The hosts changed: the job should stop at its next commit."""
        self.generation += 1

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


def _address_for(hosts: Sequence[HostSlots]) -> str:
    """This machine's address as the job's first host reaches it (127.0.0.1 if unknown)."""
    for h in hosts:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((h.host, 9))  # no packet is sent: this only picks the route
                return str(s.getsockname()[0])
        except OSError:
            continue
    return "127.0.0.1"


def _say(text: str) -> None:
    print(f"{_PROG}: {text}", file=sys.stderr, flush=True)


def _wait_for_hosts(policy: ElasticPolicy, left_out: list[str], first: bool) -> list[HostSlots] | None:
    """Discovered hosts with at least ``min_np`` slots, or None after ``elastic_timeout``.

    Raises:
        ConfigError: when discovery fails before the first start (later failures are
            retried until ``elastic_timeout``, as a script may fail for a moment).
    """
    deadline = time.monotonic() + policy.elastic_timeout
    said = False
    while True:
        try:
            found = discover(policy.discovery_script, policy.discovery_timeout)
        except ConfigError as exc:
            if first or time.monotonic() >= deadline:
                raise
            if not said:
                _say(f"host discovery failed, retrying for up to {policy.elastic_timeout:g}s: {exc}")
                said = True
            time.sleep(policy.interval)
            continue
        plan = plan_hosts(found, left_out, policy.max_np)
        if total_slots(plan) < policy.min_np and left_out:
            left_out.clear()  # too few without them: give the blamed hosts another chance
            continue
        if total_slots(plan) >= policy.min_np:
            return plan
        if time.monotonic() >= deadline:
            return None
        if not said:
            _say(f"waiting up to {policy.elastic_timeout:g}s for --min-np={policy.min_np} slots "
                 f"(discovered: {','.join(f'{h.host}:{h.slots}' for h in plan) or 'none'})")
            said = True
        time.sleep(policy.interval)


def _watch(policy: ElasticPolicy, running: list[HostSlots], left_out: Sequence[str],
           notifier: Notifier, stop: threading.Event) -> None:
    """Bump the generation once when discovery's plan differs from the running hosts."""
    while not stop.wait(policy.interval):
        try:
            plan = plan_hosts(discover(policy.discovery_script, policy.discovery_timeout), left_out,
                              policy.max_np)
        except ConfigError as exc:
            _say(f"host discovery failed, keeping the current hosts: {exc}")
            continue
        if set(plan) != set(running) and total_slots(plan) >= policy.min_np:
            _say(f"hosts changed to {','.join(f'{h.host}:{h.slots}' for h in plan)}; the job "
                 "stops at its next commit and starts again on them")
            notifier.bump()
            return


def run_elastic(spec: LaunchSpec, policy: ElasticPolicy, env: Mapping[str, str], is_root: bool,
                run: Runner) -> int:
    """Run the job elastically: start it on the discovered hosts, start it again on the new
    hosts after every change or failure, until it succeeds or cannot go on.

    Args:
        spec: the launch (its hosts, hostfile and np are replaced by discovery's).
        policy: discovery and limits.
        env: the launcher's environment.
        is_root: running as root (mpirun needs ``--allow-run-as-root``).
        run: runs one start (``plait.launch.run.run_command``).

    Returns:
        0 once the job succeeded; otherwise the last start's exit status (1 when no
        hosts could be found or discovery failed).
    """
    made = "PLAIT_ELASTIC_DIR" not in env
    directory = tempfile.mkdtemp(prefix="plait-elastic-") if made else env["PLAIT_ELASTIC_DIR"]
    notifier = Notifier()
    left_out: list[str] = []
    failures = relaunches = 0
    try:
        while True:
            try:
                hosts = _wait_for_hosts(policy, left_out, first=relaunches == 0)
            except ConfigError as exc:
                _say(f"error: {exc}")
                return 1
            if hosts is None:
                _say(f"error: fewer than --min-np={policy.min_np} slots discovered within "
                     f"{policy.elastic_timeout:g}s")
                return 1
            attempt = dataclasses.replace(spec, hosts=tuple(hosts), hostfile=None, np=total_slots(hosts))
            job_env = {**env, "PLAIT_ELASTIC_DIR": directory, "PLAIT_RESTART": str(relaunches),
                       "PLAIT_ELASTIC_ADDR": f"{_address_for(hosts)}:{notifier.port}",
                       "PLAIT_ELASTIC_GENERATION": str(notifier.generation)}
            cmd = build_command(attempt, job_env, is_root)
            cmd.env.update({k: job_env[k] for k in job_env if k.startswith("PLAIT_ELASTIC_")
                            or k == "PLAIT_RESTART"})
            _say(f"starting {attempt.num_ranks} ranks on {','.join(f'{h.host}:{h.slots}' for h in hosts)}")
            stop = threading.Event()
            watcher = threading.Thread(target=_watch, args=(policy, hosts, left_out, notifier, stop),
                                       daemon=True)
            watcher.start()
            lines: list[str] = []
            signals: list[int] = []
            commits_before = notifier.commits
            try:
                rc = run(cmd, spec.timeout, capture=lines, signals=signals)
            finally:
                stop.set()
                watcher.join()
            if rc == 0:
                _say(f"job finished after {relaunches} relaunch(es)")
                return 0
            if signals:
                return rc
            if rc != EXIT_RELAUNCH:
                blamed = blamed_hosts("".join(lines), rank_hosts(hosts, attempt.num_ranks))
                left_out += [h for h in blamed if h in {x.host for x in hosts} and h not in left_out]
                failures = 0 if notifier.commits > commits_before else failures + 1
                if failures >= policy.max_failures:
                    _say(f"error: {failures} starts in a row failed before their first commit "
                         f"(last exit status {rc}); giving up")
                    return rc
                _say(f"job failed (exit status {rc})"
                     + (f"; leaving out {','.join(left_out)} while others remain" if left_out else ""))
            relaunches += 1
            if policy.reset_limit is not None and relaunches > policy.reset_limit:
                _say(f"error: --reset-limit={policy.reset_limit} relaunches used")
                return rc
    finally:
        notifier.close()
        if made:
            shutil.rmtree(directory, ignore_errors=True)

