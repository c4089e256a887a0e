"""``plait run``: start a command on every rank through ``mpirun`` or ``horovodrun``.

Usage::

    plait run [-np N] [-H host1:2,host2:2 | --hostfile FILE]
              [--launcher mpirun|horovodrun] [--backend mpi|horovod|auto]
              [--network-interface IF] [--timeout S] [--oversubscribe]
              [-x VAR]... [--mca KEY VALUE]... [--timeline FILE]
              [horovodrun's tuning flags: --fusion-threshold-mb MB, --hierarchical-allreduce,
               --timeline-filename FILE, --stall-check-warning-time-seconds S...] [--dry-run]
              [--restarts R [--restart-backoff S] [--exclude-after K]]
              [--elastic --min-np N --max-np M --host-discovery-script CMD] -- COMMAND...

The launcher runs in its own process group; SIGINT and SIGTERM sent to
``plait run`` are forwarded to that group. With ``--timeout`` the whole group
is killed when the time is up and the exit status is 124 (like ``timeout(1)``).
Otherwise the exit status is the launcher's (128 + N if it died of signal N).

A job never outlives its failure, with or without ``--timeout``: ``plait run``
reads the launcher's stderr (copying it to its own), and once a rank reported
that it aborts the job (or mpirun reported a failed rank or a lost daemon) the
launcher gets :data:`ABORT_GRACE_S` seconds to exit before its whole process
tree is killed (exit status 1): ``mpirun`` cannot finish an abort while a host
is unreachable. mpirun also gets Open MPI's out-of-band TCP keepalive settings
:data:`KEEPALIVE_MCA` (unless given with ``--mca``), so that it notices a lost
host in 10 to 15 s instead of Open MPI's default 8 minutes.

With ``--restarts R`` a failed job (non-zero exit or timeout, ``--timeout``
applying to each attempt) is relaunched up to R times with exponential back-off;
with hosts, failing or unreachable hosts are excluded first and the job runs on
the rest (see :mod:`plait.launch.restart`). Each attempt gets ``PLAIT_RESTART``
(0, 1, ...) in its environment.

With ``--elastic`` the job follows a host discovery script and is started again
on the new hosts after a change or a failure, resuming from the last elastic
commit (MPI backend; see :mod:`plait.launch.elastic`).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import MutableSequence, Sequence
from types import FrameType

from plait.errors import ConfigError, invalid
from plait.launch.command import (
    BACKENDS,
    CONTROLLERS,
    LAUNCHERS,
    LaunchCommand,
    LaunchSpec,
    build_command,
)
from plait.launch.elastic import ElasticPolicy, run_elastic
from plait.launch.hostfile import HostSlots, check_np, parse_hostfile, parse_hosts, total_slots
from plait.launch.restart import RestartPolicy, run_with_restarts

__all__ = [
    "ABORT_GRACE_S",
    "EXIT_TIMEOUT",
    "KEEPALIVE_MCA",
    "KILL_GRACE_S",
    "build_parser",
    "elastic_policy",
    "main",
    "run_command",
    "spec_from_args",
]

#: Exit status when ``--timeout`` expires (the same as ``timeout(1)``).
EXIT_TIMEOUT = 124
#: Seconds between SIGTERM and SIGKILL when the job is killed.
KILL_GRACE_S = 5.0
#: Open MPI out-of-band TCP keepalive for mpirun and its daemons: probe a connection idle
#: for 5 s every 2 s, give up after 5 unanswered probes. A lost host (link down, powered
#: off) then ends the job 10 to 15 s later ("ORTE has lost communication with a remote
#: daemon", naming the host) instead of after Open MPI's 300 + 9 x 20 s.
KEEPALIVE_MCA = (("oob_tcp_keepalive_time", "5"), ("oob_tcp_keepalive_intvl", "2"),
                 ("oob_tcp_keepalive_probes", "5"))
_PROG = "plait run"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected an integer >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected seconds > 0")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected an integer >= 0")
    return value


def _nonnegative(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected {what} >= 0")
    return value


def _amount(text: str) -> float:
    return _nonnegative(text, "a number")


def _seconds(text: str) -> float:
    return _nonnegative(text, "seconds")


def build_parser() -> argparse.ArgumentParser:
    """Build the ``plait run`` argument parser.

    Returns:
        The parser; its ``command`` attribute holds everything after ``--``.
    """
    p = argparse.ArgumentParser(
        prog=_PROG,
        description="Run COMMAND on every rank through mpirun or horovodrun.",
        epilog="Example: plait run -np 4 -H node1:2,node2:2 -- python train.py",
    )
    p.add_argument("-np", "--num-proc", dest="np", type=_positive_int, metavar="N",
                   help="number of ranks (default: total slots of the hosts, or 1)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="hosts and slots, e.g. node1:2,node2:2")
    where.add_argument("--hostfile", metavar="FILE", help="hostfile of 'HOST slots=N' lines")
    p.add_argument("--launcher", choices=LAUNCHERS, default="mpirun")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="communication backend for the ranks (exported as PLAIT_BACKEND)")
    ctl = p.add_mutually_exclusive_group()
    for name in CONTROLLERS:
        ctl.add_argument(f"--{name}", dest="controller", action="store_const", const=name,
                         help=f"horovodrun: use the {name} controller")
    p.add_argument("--network-interface", metavar="IF",
                   help="interface name(s) or CIDR subnet for MPI/Horovod traffic")
    p.add_argument("--timeout", type=_positive_float, metavar="S",
                   help="kill the job after S seconds and exit with status 124")
    p.add_argument("--start-timeout", type=_positive_float, metavar="S",
                   help="horovodrun: seconds to wait for all ranks to start")
    p.add_argument("--oversubscribe", action="store_true", help="allow more ranks than slots")
    p.add_argument("--tag-output", action="store_true", help="mpirun: prefix lines with the rank")
    p.add_argument("-x", dest="env_vars", action="append", default=[], metavar="VAR[=VALUE]",
                   help="forward (or set) an environment variable on every rank")
    p.add_argument("--mca", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                   help="mpirun: extra MCA parameter")
    p.add_argument("--timeline", metavar="FILE",
                   help="record every rank's collectives to FILE (Chrome trace; sets "
                        "PLAIT_TIMELINE on every rank)")
    h = p.add_argument_group("horovodrun's tuning flags (set HOROVOD_* on every rank; the MPI "
                             "backend honours fusion, hierarchical allreduce, autotune, timeline "
                             "and stall check)")
    h.add_argument("--fusion-threshold-mb", type=_amount, metavar="MB")
    h.add_argument("--cycle-time-ms", type=_amount, metavar="MS")
    h.add_argument("--cache-capacity", type=_count, metavar="N")
    h.add_argument("--hierarchical-allreduce", action="store_true")
    h.add_argument("--hierarchical-allgather", action="store_true")
    h.add_argument("--autotune", action="store_true")
    h.add_argument("--timeline-filename", metavar="FILE",
                   help="Horovod's timeline, written by rank 0")
    h.add_argument("--timeline-mark-cycles", action="store_true")
    h.add_argument("--no-stall-check", action="store_true")
    h.add_argument("--stall-check-warning-time-seconds", type=_count, metavar="S")
    h.add_argument("--stall-check-shutdown-time-seconds", type=_count, metavar="S")
    h.add_argument("--log-level", choices=("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"))
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("--restarts", type=_count, default=0, metavar="R",
                   help="relaunch a failed job up to R times (it resumes from its checkpoint)")
    p.add_argument("--restart-backoff", type=_seconds, default=1.0, metavar="S",
                   help="seconds before the first relaunch, doubled each time (default 1)")
    p.add_argument("--exclude-after", type=_positive_int, default=2, metavar="K",
                   help="exclude a host blamed for K failures (default 2)")
    p.add_argument("--probe-timeout", type=_positive_float, default=15.0, metavar="S",
                   help="after a failure, seconds each host has to answer a probe job (default 15)")
    el = p.add_argument_group("elastic (MPI backend: the job is started again when hosts change)")
    el.add_argument("--elastic", action="store_true",
                    help="follow --host-discovery-script (requires --min-np and --max-np)")
    el.add_argument("--host-discovery-script", metavar="CMD",
                    help="prints one HOST or HOST:SLOTS per line")
    el.add_argument("--min-np", type=_positive_int, metavar="N", help="fewest ranks")
    el.add_argument("--max-np", type=_positive_int, metavar="N", help="most ranks")
    el.add_argument("--elastic-timeout", type=_positive_float, default=600.0, metavar="S",
                    help="seconds to wait for --min-np slots (default 600)")
    el.add_argument("--discovery-interval", type=_positive_float, default=1.0, metavar="S",
                    help="seconds between discovery runs (default 1)")
    el.add_argument("--reset-limit", type=_count, metavar="K", help="most relaunches (default: no limit)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return p


def spec_from_args(args: argparse.Namespace) -> LaunchSpec:
    """Turn parsed ``plait run`` arguments into a :class:`LaunchSpec`.

    Args:
        args: the namespace returned by :func:`build_parser`.

    Returns:
        The validated spec. A hostfile is read here (to check it and count its
        slots); horovodrun gets its hosts as ``-H``, since its own reader does not
        understand comments or bare host names.

    Raises:
        ConfigError: on a bad hostfile, host list, ``-np`` or option combination
            (:class:`~plait.launch.hostfile.HostfileError` is one).
    """
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("missing COMMAND: expected 'plait run [options] -- COMMAND [ARGS...]'")
    hosts: list[HostSlots] = parse_hosts(args.hosts) if args.hosts is not None else []
    hostfile = None
    np = args.np
    if args.hostfile is not None:
        listed = parse_hostfile(args.hostfile)
        check_np(np if np is not None else total_slots(listed), listed, args.oversubscribe)
        if np is None:
            np = total_slots(listed)
        if args.launcher == "horovodrun":
            # horovodrun's own hostfile reader fails on comments and bare host names.
            hosts = listed
        else:
            hostfile = os.path.abspath(args.hostfile)
    mca = tuple((k, v) for k, v in args.mca)
    if args.launcher == "mpirun":
        given = {k for k, _ in mca}
        mca = tuple(kv for kv in KEEPALIVE_MCA if kv[0] not in given) + mca
    return LaunchSpec(
        command=tuple(command),
        np=np,
        hosts=tuple(hosts),
        hostfile=hostfile,
        launcher=args.launcher,
        backend=args.backend,
        controller=args.controller,
        network_interface=args.network_interface,
        timeout=args.timeout,
        start_timeout=args.start_timeout,
        oversubscribe=args.oversubscribe,
        tag_output=args.tag_output,
        env_vars=tuple(args.env_vars) + horovodrun_settings(args),
        mca=mca,
        timeline=args.timeline and os.path.abspath(args.timeline),  # "" stays (and is refused)
    )


#: horovodrun's tuning flags (argparse dest) -> the variable each sets, as horovodrun sets it.
HOROVODRUN_FLAGS = {
    "fusion_threshold_mb": "HOROVOD_FUSION_THRESHOLD", "cycle_time_ms": "HOROVOD_CYCLE_TIME",
    "cache_capacity": "HOROVOD_CACHE_CAPACITY",
    "hierarchical_allreduce": "HOROVOD_HIERARCHICAL_ALLREDUCE",
    "hierarchical_allgather": "HOROVOD_HIERARCHICAL_ALLGATHER", "autotune": "HOROVOD_AUTOTUNE",
    "timeline_filename": "HOROVOD_TIMELINE", "timeline_mark_cycles": "HOROVOD_TIMELINE_MARK_CYCLES",
    "no_stall_check": "HOROVOD_STALL_CHECK_DISABLE",
    "stall_check_warning_time_seconds": "HOROVOD_STALL_CHECK_TIME_SECONDS",
    "stall_check_shutdown_time_seconds": "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    "log_level": "HOROVOD_LOG_LEVEL",
}


def horovodrun_settings(args: argparse.Namespace) -> tuple[str, ...]:
    """horovodrun's tuning flags given to ``plait run`` as ``-x NAME=VALUE`` entries.

    Raises:
        ConfigError: when ``--timeline-filename`` is empty.
    """
    entries = []
    for dest, name in HOROVODRUN_FLAGS.items():
        value = getattr(args, dest)
        if value is None or value is False:
            continue
        if dest == "timeline_filename":
            if not value.strip():
                raise invalid("--timeline-filename", value, "a file path (e.g. 'timeline.json')")
            value = os.path.abspath(value)
        elif dest == "fusion_threshold_mb":
            value = int(value * 2**20)
        elif value is True:
            value = 1
        entries.append(f"{name}={value}")
    return tuple(entries)


def elastic_policy(args: argparse.Namespace) -> ElasticPolicy | None:
    """The ``--elastic`` options as a policy (checked even without ``--elastic``).

    Args:
        args: the namespace returned by :func:`build_parser`.

    Returns:
        The policy, or None without ``--elastic``.

    Raises:
        ConfigError: when ``--elastic`` lacks its options, or they contradict each other
            or the launch.
    """
    given = [f for f in ("host_discovery_script", "min_np", "max_np") if getattr(args, f) is not None]
    if not args.elastic:
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --elastic")
        return None
    missing = [f"--{f.replace('_', '-')}" for f in ("host_discovery_script", "min_np", "max_np")
               if getattr(args, f) is None]
    if missing:
        raise ConfigError(f"--elastic needs {', '.join(missing)}")
    if args.hosts is not None or args.hostfile is not None:
        raise ConfigError("--elastic takes its hosts from --host-discovery-script: drop "
                          + ("-H" if args.hosts is not None else "--hostfile"))
    if args.launcher != "mpirun" or args.restarts:
        raise ConfigError("--elastic runs through mpirun and restarts by itself: drop "
                          + ("--launcher horovodrun (use horovodrun's own --host-discovery-script)"
                             if args.launcher != "mpirun" else "--restarts"))
    return ElasticPolicy(args.host_discovery_script, args.min_np, args.max_np,
                         interval=args.discovery_interval, elastic_timeout=args.elastic_timeout,
                         reset_limit=args.reset_limit)


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc; empty where there is no /proc).

    mpirun puts its ssh/rsh agents in process groups of their own, so killing
    its group alone can leave them, and the remote daemons behind them, running.
    """
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal_group(pgid: int, sig: int, others: Sequence[int] = ()) -> None:
    for target in (-pgid, *others):
        try:
            os.kill(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_group(pgid: int, proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the launcher's group and process tree, wait ``grace`` s, SIGKILL what is left."""
    tree = _descendants(proc.pid)
    _signal_group(pgid, signal.SIGTERM, tree)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    tree += [pid for pid in _descendants(proc.pid) if pid not in tree]
    _signal_group(pgid, signal.SIGKILL, tree)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass


#: Seconds mpirun gets to exit once it reported a failed rank, before plait kills it
#: (mpirun can hang in its own abort when a host is unreachable: its kill message to
#: that host's daemon never leaves, and while it is queued TCP keepalive is off).
ABORT_GRACE_S = 10.0
_FAILURE_MARKERS = ("MPI_ABORT was invoked", "aborts the job (MPI_Abort)",
                    "ORTE has lost communication", "mpirun noticed that process",
                    "mpirun detected that one or more processes exited")


def _tee(stream: object, sink: MutableSequence[str], failed: threading.Event) -> None:
    """Copy ``stream`` to our stderr as it comes (progress bars without newlines too),
    append its lines to ``sink`` and set ``failed`` on a line reporting a failure."""
    out = getattr(sys.stderr, "buffer", None)
    pending = b""
    for chunk in iter(lambda: stream.read1(1 << 16), b""):  # type: ignore[attr-defined]
        if out is not None:
            out.write(chunk)
            out.flush()
        else:
            sys.stderr.write(chunk.decode(errors="replace"))
            sys.stderr.flush()
        *complete, pending = (pending + chunk).split(b"\n")
        for raw in complete:
            line = raw.decode(errors="replace") + "\n"
            sink.append(line)
            if any(marker in line for marker in _FAILURE_MARKERS):
                failed.set()
    if pending:
        sink.append(pending.decode(errors="replace"))


def _wait(proc: subprocess.Popen[bytes], timeout: float | None, failed: threading.Event,
          grace: float) -> tuple[int | None, bool]:
    """Wait for ``proc`` up to ``timeout``; give up ``grace`` s after ``failed`` is set.

    Returns:
        ``(returncode or None, True if it gave up because of a reported failure)``.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    failed_at = None
    while True:
        step = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
        try:
            return proc.wait(timeout=step), False
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if failed.is_set():
            failed_at = failed_at if failed_at is not None else now
            if now - failed_at >= grace:
                return None, True
        if deadline is not None and now >= deadline:
            return None, False


def run_command(
    cmd: LaunchCommand, timeout: float | None = None, grace: float = KILL_GRACE_S,
    capture: list[str] | None = None, signals: list[int] | None = None,
    abort_grace: float = ABORT_GRACE_S,
) -> int:
    """Run a launcher command in its own process group and wait for it.

    Args:
        cmd: the argv and environment additions.
        timeout: seconds after which the group is killed; ``None``: no time limit (a
            failed job is still ended ``abort_grace`` s after its failure is reported).
        grace: seconds between SIGTERM and SIGKILL when killing.
        capture: the launcher's stderr is always copied to ours (to see failures);
            when given, its lines are also appended here (to see which host failed).
        signals: when given, the signals forwarded to the job are appended here.
        abort_grace: seconds the launcher gets to exit after it (or a rank) reported a
            failed rank; then its group is killed (exit status 1).

    Returns:
        The launcher's exit status; 128 + N if it died of signal N, or if it failed
        after plait forwarded signal N to it; 124 on timeout.

    Raises:
        FileNotFoundError: if the launcher is not installed.
    """
    env = {**os.environ, **cmd.env}
    start = time.monotonic()
    proc = subprocess.Popen(cmd.argv, env=env, start_new_session=True, stderr=subprocess.PIPE)
    pgid = proc.pid
    failed = threading.Event()
    # without capture keep the last lines only: a long job may write a lot to stderr
    lines: MutableSequence[str] = capture if capture is not None else collections.deque(maxlen=100)
    reader = threading.Thread(target=_tee, args=(proc.stderr, lines, failed), daemon=True)
    reader.start()
    received: list[int] = signals if signals is not None else []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        _signal_group(pgid, signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread: cannot install handlers
            break
    try:
        got, gave_up = _wait(proc, timeout, failed, abort_grace)
        if gave_up:
            _kill_group(pgid, proc, grace)
            print(f"{_PROG}: a rank failed and the launcher did not exit within {abort_grace:g}s; "
                  "killed it", file=sys.stderr, flush=True)
            return 1
        if got is not None:
            rc = got
        else:
            _kill_group(pgid, proc, grace)
            print(
                f"{_PROG}: the job ran longer than --timeout={timeout:g}s and was killed "
                f"(exit status {EXIT_TIMEOUT})",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_TIMEOUT
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        reader.join(timeout=grace)  # orphans may hold the pipe: do not wait for ever
    if timeout is not None and rc != 0 and time.monotonic() - start >= timeout:
        # mpirun's own --timeout fired at the same moment as ours.
        print(f"{_PROG}: the job ran longer than --timeout={timeout:g}s", file=sys.stderr)
        return EXIT_TIMEOUT
    if rc < 0:
        return 128 - rc
    if rc != 0 and received:
        return 128 + received[0]  # interrupted: report the signal, as a shell would
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``plait run``.

    Args:
        argv: arguments after ``run`` (default: ``sys.argv[1:]``).

    Returns:
        The exit status: the job's, 124 on timeout, 2 on bad arguments,
        127 if the launcher is not installed.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help, or a usage error already printed by argparse
        return exc.code if isinstance(exc.code, int) else 2
    try:
        spec = spec_from_args(args)
        elastic = elastic_policy(args)
    except ConfigError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    cmd = build_command(spec, os.environ, is_root=os.geteuid() == 0)
    if args.dry_run:
        print(cmd.shell())
        return 0
    try:
        if elastic is not None:
            return run_elastic(spec, elastic, os.environ, os.geteuid() == 0, run_command)
        if args.restarts > 0:
            hosts = list(spec.hosts)
            if not hosts and args.hostfile is not None:
                hosts = parse_hostfile(args.hostfile)
            policy = RestartPolicy(args.restarts, backoff=args.restart_backoff,
                                   backoff_max=max(30.0, args.restart_backoff),
                                   exclude_after=args.exclude_after,
                                   probe_timeout=args.probe_timeout)
            return run_with_restarts(spec, policy, os.environ, os.geteuid() == 0, hosts, run_command)
        return run_command(cmd, spec.timeout)
    except FileNotFoundError:
        print(
            f"{_PROG}: error: launcher {cmd.argv[0]!r} not found on PATH; install it "
            "(Open MPI's mpirun: apt-get install openmpi-bin; horovodrun: pip install horovod) "
            f"or choose another with --launcher {{{','.join(LAUNCHERS)}}}",
            file=sys.stderr,
        )
        return 127


if __name__ == "__main__":
    sys.exit(main())
