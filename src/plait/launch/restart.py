"""Automatic restarts for ``plait run --restarts R`` (elastic by restart).

When a job fails, ``plait run`` relaunches it up to R times with exponential
back-off; the training script resumes from its latest checkpoint
(:class:`plait.Checkpoint`). With a host list, hosts are judged after each
failure in two ways:

* the launcher's own report: Open MPI names the host of a process that died of
  a signal (``... on node HOST exited on signal 9``), a lost daemon
  (``Remote daemon: ... on node HOST``), or the rank of the first process that
  failed / called MPI_Abort (mapped to its host through the slot layout). A host
  blamed ``exclude_after`` times is excluded;
* a reachability probe: a one-rank ``mpirun`` is started on every host with a
  short timeout; a host that does not answer (dead, or its link is down) is
  excluded at once.

The job is then relaunched on the remaining hosts with their slots as the new
world size; ranks re-shard their data by rank/size (see :mod:`plait.elastic`).
Standard library only.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from plait.errors import invalid
from plait.launch.command import LaunchSpec, build_command, mpirun_argv
from plait.launch.hostfile import HostSlots, total_slots

__all__ = [
    "RestartPolicy",
    "RestartState",
    "blamed_hosts",
    "probe_hosts",
    "rank_hosts",
    "run_with_restarts",
]

_PROG = "plait run"
#: Runs one attempt: ``(cmd, timeout, capture=lines, signals=signals) -> exit status``.
Runner = Callable[..., int]

_SIGNAL_NODE = re.compile(r"process rank (\d+) with PID \d+ on node (\S+?)[ .,]")
_REMOTE_DAEMON = re.compile(r"Remote daemon:\s*\S+ on node (\S+)")
_PROCESS_NAME = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]")
_ABORT_RANK = re.compile(r"MPI_ABORT was invoked on rank (\d+)")
_PLAIT_HOST = re.compile(r"plait: rank (\d+) on host (\S+) failed")


@dataclass(frozen=True)
class RestartPolicy:
    """How ``plait run`` restarts a failed job.

    Attributes:
        restarts: how many times to relaunch after a failure (0: never).
        backoff: seconds before the first relaunch; doubled each time.
        backoff_max: the longest wait between relaunches.
        exclude_after: a host blamed for this many failures is excluded.
        probe_timeout: seconds a host has to answer the reachability probe.
    """

    restarts: int = 0
    backoff: float = 1.0
    backoff_max: float = 30.0
    exclude_after: int = 2
    probe_timeout: float = 15.0

    def __post_init__(self) -> None:
        if isinstance(self.restarts, bool) or not isinstance(self.restarts, int) or self.restarts < 0:
            raise invalid("restarts", self.restarts, "an integer >= 0")
        if not 0 <= self.backoff <= self.backoff_max:
            raise invalid("backoff", self.backoff, f"seconds in [0, backoff_max={self.backoff_max}]")
        if self.exclude_after < 1:
            raise invalid("exclude_after", self.exclude_after, "an integer >= 1")
        if not self.probe_timeout > 0:
            raise invalid("probe_timeout", self.probe_timeout, "seconds > 0")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before relaunch number ``attempt`` (1-based)."""
        return float(min(self.backoff_max, self.backoff * 2 ** (attempt - 1)))


def rank_hosts(hosts: Sequence[HostSlots], np: int) -> list[str]:
    """The host of each rank under ``--map-by slot`` (slots filled host by host, wrapping).

    Args:
        hosts: the job's hosts in order.
        np: number of ranks.

    Returns:
        ``result[rank]`` is that rank's host name.
    """
    order = [h.host for h in hosts for _ in range(h.slots)]
    if not order:
        return []
    return [order[r % len(order)] for r in range(np)]


def blamed_hosts(output: str, ranks: Sequence[str]) -> list[str]:
    """Hosts the launcher's output blames for a failure.

    Args:
        output: mpirun's (and the ranks') stderr of the failed attempt.
        ranks: ``ranks[r]`` is rank r's host (see :func:`rank_hosts`).

    Returns:
        Host names, each once, in order of appearance.
    """
    found: list[str] = []

    def add(host: str) -> None:
        if host not in found:
            found.append(host)

    def add_rank(text: str) -> None:
        r = int(text)
        if 0 <= r < len(ranks):
            add(ranks[r])

    for m in _SIGNAL_NODE.finditer(output):
        add(m.group(2))
    for m in _REMOTE_DAEMON.finditer(output):
        add(m.group(1))
    for m in _PLAIT_HOST.finditer(output):
        add(m.group(2))
    for m in _ABORT_RANK.finditer(output):
        add_rank(m.group(1))
    for m in _PROCESS_NAME.finditer(output):
        add_rank(m.group(1))
    return found


def probe_hosts(hosts: Sequence[str], argv_for: Callable[[str], list[str]],
                env: Mapping[str, str], timeout: float, tries: int = 2) -> dict[str, str]:
    """Hosts that do not answer a tiny job within ``timeout`` seconds (probed in parallel).

    A host must fail ``tries`` probes in a row (one second apart) to be reported, so
    that one slow start under load does not cost a healthy host.

    Args:
        hosts: host names to probe.
        argv_for: the probe command for one host (a one-rank ``mpirun ... true``).
        env: the probe's environment.
        timeout: seconds per probe.
        tries: probes a host must fail.

    Returns:
        Unreachable host -> why (exit status or timeout, and the end of its stderr).
    """
    def check(host: str) -> str | None:
        try:
            proc = subprocess.run(argv_for(host), env=dict(env), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, timeout=timeout + 5, text=True,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return f"no answer within {timeout + 5:g}s"
        except OSError as exc:
            return str(exc)
        if proc.returncode == 0:
            return None
        tail = " | ".join(line for line in proc.stderr.splitlines()[-3:] if line.strip())
        return f"probe exit status {proc.returncode}: {tail}"

    failed: dict[str, str] = {}
    todo = list(hosts)
    for attempt in range(tries):
        if not todo:
            break
        if attempt:
            time.sleep(1.0)
        with ThreadPoolExecutor(max_workers=min(8, len(todo))) as pool:
            answers = list(pool.map(check, todo))
        failed = {h: why for h, why in zip(todo, answers, strict=True) if why is not None}
        todo = list(failed)
    return {h: failed[h] for h in hosts if h in failed}


@dataclass
class RestartState:
    """Hosts still in the job and how often each was blamed.

    Attributes:
        hosts: the hosts still used (in the original order).
        failures: host -> number of failed attempts it was blamed for.
        excluded: hosts excluded so far, with the reason.
    """

    hosts: list[HostSlots]
    failures: dict[str, int] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)

    def blame(self, names: Sequence[str], exclude_after: int) -> list[str]:
        """Count one failure for each of ``names``; exclude those blamed ``exclude_after`` times.

        Returns:
            The hosts excluded now.
        """
        now = []
        for name in names:
            self.failures[name] = self.failures.get(name, 0) + 1
            if self.failures[name] >= exclude_after and name not in self.excluded:
                now.append(name)
                self.excluded[name] = f"its ranks failed {self.failures[name]} times"
        self._drop(now)
        return now

    def unreachable(self, names: Mapping[str, str]) -> list[str]:
        """Exclude hosts that did not answer the probe (host -> why).

        Returns:
            The hosts excluded now.
        """
        now = [n for n in names if n not in self.excluded]
        for name in now:
            self.excluded[name] = f"it did not answer a probe job ({names[name]})"
        self._drop(now)
        return now

    def _drop(self, names: Sequence[str]) -> None:
        if names:
            self.hosts = [h for h in self.hosts if h.host not in names]


def _probe_argv(spec: LaunchSpec, is_root: bool, timeout: float) -> Callable[[str], list[str]]:
    def argv_for(host: str) -> list[str]:
        probe = dataclasses.replace(spec, command=("true",), np=1, hosts=(HostSlots(host, 1),),
                                    hostfile=None, timeout=timeout, tag_output=False,
                                    oversubscribe=True)
        return mpirun_argv(probe, None, is_root)

    return argv_for


def run_with_restarts(spec: LaunchSpec, policy: RestartPolicy, env: Mapping[str, str],
                      is_root: bool, hosts: Sequence[HostSlots], run: Runner) -> int:
    """Run the job; when it fails, relaunch it up to ``policy.restarts`` times.

    Args:
        spec: the first attempt's spec.
        policy: restarts, back-off and host exclusion.
        env: the environment of the launcher.
        is_root: running as root (mpirun needs ``--allow-run-as-root``).
        hosts: the job's hosts (from ``-H`` or the hostfile); empty for a local job,
            which is restarted without exclusion.
        run: runs one attempt (``plait.launch.run.run_command``).

    Returns:
        The last attempt's exit status (0 once an attempt succeeds).
    """
    state = RestartState(list(hosts))
    np = spec.num_ranks
    attempt = 0
    while True:
        attempt_env = {**env, "PLAIT_RESTART": str(attempt)}  # forwarded to every host by -x
        cmd = build_command(spec, attempt_env, is_root)
        cmd.env["PLAIT_RESTART"] = str(attempt)
        lines: list[str] = []
        signals: list[int] = []
        rc = run(cmd, spec.timeout, capture=lines, signals=signals)
        used = ",".join(h.host for h in spec.hosts) if spec.hosts else "localhost"
        if rc == 0:
            print(f"{_PROG}: job finished after {attempt} restart(s) with {spec.num_ranks} ranks "
                  f"on hosts {used}", file=sys.stderr, flush=True)
            return 0
        if signals or attempt >= policy.restarts:
            if not signals:
                print(f"{_PROG}: job failed (exit status {rc}); no restarts left "
                      f"({policy.restarts} used)", file=sys.stderr, flush=True)
            return rc
        attempt += 1
        if state.hosts and spec.launcher == "mpirun":
            blamed = blamed_hosts("".join(lines), rank_hosts(spec.hosts or state.hosts, spec.num_ranks))
            gone = state.blame(blamed, policy.exclude_after)
            names = [h.host for h in state.hosts]
            probe = _probe_argv(spec, is_root, policy.probe_timeout)
            gone += state.unreachable(
                probe_hosts(names, probe, {**attempt_env, **cmd.env}, policy.probe_timeout))
            for name in gone:
                print(f"{_PROG}: excluding host {name}: {state.excluded[name]}", file=sys.stderr,
                      flush=True)
            if not state.hosts:
                print(f"{_PROG}: no hosts left to restart on (excluded: "
                      f"{', '.join(state.excluded)})", file=sys.stderr, flush=True)
                return rc
            new_np = min(np, total_slots(state.hosts)) if gone else spec.num_ranks
            spec = dataclasses.replace(spec, hosts=tuple(state.hosts), hostfile=None, np=new_np)
        delay = policy.delay(attempt)
        print(f"{_PROG}: job failed (exit status {rc}); restart {attempt}/{policy.restarts} in "
              f"{delay:g}s with {spec.num_ranks} ranks"
              + (f" on hosts {','.join(h.host for h in spec.hosts)}" if spec.hosts else ""),
              file=sys.stderr, flush=True)
        time.sleep(delay)
