"""The wrapper every process of a service job runs in: ``python -m plait.service.bootstrap -- CMD...``.

It finds the process's rank (``PLAIT_SVC_RANK`` set by the service; or, on
Kubernetes, the pod's ``JOB_COMPLETION_INDEX`` times the processes per worker,
starting one child per process; or the MPI launcher's variables), adds the
framework's group variables (:func:`plait.service.contract.group_env`), keeps
``PLAIT_PROGRESS_FILE`` on rank 0 only, sends the program's output to
``PLAIT_SVC_DIR/rank-N.log`` and, when the program ends, writes its exit status
to ``PLAIT_SVC_DIR/rank-N.exit`` (so a restarted service can read it) and exits
with it. SIGTERM and SIGINT are passed on to the program. Standard library only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from types import FrameType

from plait.launch.context import context
from plait.service.contract import SVC_PREFIX, group_env

__all__ = ["exit_path", "log_path", "main", "resolve_rank"]


def log_path(job_dir: str, rank: int) -> str:
    """The file that holds ``rank``'s output."""
    return os.path.join(job_dir, f"rank-{rank}.log")


def exit_path(job_dir: str, rank: int) -> str:
    """The file that holds ``rank``'s exit status once it has ended."""
    return os.path.join(job_dir, f"rank-{rank}.exit")


def resolve_rank(env: Mapping[str, str]) -> int | None:
    """This process's rank, or ``None`` for a Kubernetes pod that must start its processes.

    Raises:
        ConfigError: if a launcher variable is malformed.
    """
    if env.get(f"{SVC_PREFIX}RANK"):
        return int(env[f"{SVC_PREFIX}RANK"])
    if env.get("JOB_COMPLETION_INDEX"):
        per_worker = int(env.get(f"{SVC_PREFIX}PER_WORKER", "1"))
        if per_worker == 1:
            return int(env["JOB_COMPLETION_INDEX"])
        return None
    return context(env).rank


def _write_exit(job_dir: str, rank: int, code: int) -> None:
    path = exit_path(job_dir, rank)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{code}\n")
    os.replace(tmp, path)


def _run(argv: Sequence[str], env: dict[str, str], rank: int) -> int:
    job_dir = env.get(f"{SVC_PREFIX}DIR", "")
    out = open(log_path(job_dir, rank), "ab", buffering=0) if job_dir else None  # noqa: SIM115
    try:
        proc = subprocess.Popen(list(argv), env=env, stdout=out, stderr=subprocess.STDOUT if out else None)
    except OSError as exc:
        print(f"plait.service.bootstrap: cannot start {argv[0]!r}: {exc}", file=sys.stderr)
        code = 127
    else:
        def forward(signum: int, frame: FrameType | None) -> None:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, forward)
        rc = proc.wait()
        code = 128 - rc if rc < 0 else rc
    finally:
        if out is not None:
            out.close()
    if job_dir:
        _write_exit(job_dir, rank, code)
    return code


def _pod(argv: Sequence[str], env: dict[str, str]) -> int:
    """Kubernetes pod with several processes: one child bootstrap per process, first failure wins."""
    per_worker = int(env[f"{SVC_PREFIX}PER_WORKER"])
    index = int(env["JOB_COMPLETION_INDEX"])
    children = []
    for local in range(per_worker):
        child_env = {**env, f"{SVC_PREFIX}RANK": str(index * per_worker + local)}
        children.append(subprocess.Popen([sys.executable, "-m", "plait.service.bootstrap", "--", *argv],
                                         env=child_env))
    codes = [c.wait() for c in children]
    return next((c for c in codes if c != 0), 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command after ``--`` as this process's rank (see the module doc).

    Returns:
        The program's exit status (128 + N if it died of signal N).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m plait.service.bootstrap -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    env = dict(os.environ)
    rank = resolve_rank(env)
    if rank is None:
        return _pod(args, env)
    try:
        env.update(group_env(rank, env))
    except ValueError as exc:
        print(f"plait.service.bootstrap: rank {rank}: {exc}", file=sys.stderr, flush=True)
        if env.get(f"{SVC_PREFIX}DIR"):
            _write_exit(env[f"{SVC_PREFIX}DIR"], rank, 2)
        return 2
    if rank != 0:
        env.pop("PLAIT_PROGRESS_FILE", None)
    return _run(args, env, rank)


if __name__ == "__main__":
    sys.exit(main())
