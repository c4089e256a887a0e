"""``plait.run(func, np=N)``: Horovod's ``horovod.run``. Start a job of ``np`` ranks, call
``func(*args, **kwargs)`` on every rank, return the ranks' results in rank order.

The function, its arguments and each rank's result travel as pickles (``cloudpickle``, so
functions defined in a notebook or a script's ``__main__`` work) through a work directory
that every rank can read: the system's temporary directory for a job on this machine, the
current directory when ``hosts`` or ``hostfile`` name other hosts (it must then be on a
filesystem the hosts share, as for ``plait serve``'s ssh hosts); ``PLAIT_RUN_DIR`` chooses
another. The job is started as ``plait run`` starts one: ``mpirun`` (any plait backend) or,
with ``use_gloo=True``, ``horovodrun --gloo`` (the Horovod backend).

Each rank runs ``python -m plait.launch.call_rank WORKDIR``.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from plait.errors import ConfigError, invalid
from plait.launch.command import build_command
from plait.launch.run import build_parser, run_command, spec_from_args

__all__ = ["CALL", "result_path", "run"]

#: The file in the work directory holding ``(func, args, kwargs)``.
CALL = "call.pkl"

#: Horovod's ``run`` arguments that plait's does not take (elastic jobs: ``plait run --elastic``).
_NOT_TAKEN = ("min_np", "max_np", "slots", "reset_limit", "cooldown_range", "ssh_port",
              "ssh_identity_file", "output_filename", "mpi_args")


def result_path(workdir: Path, rank: int) -> Path:
    """The file where ``rank`` writes ``("ok", value)`` or ``("error", traceback)``."""
    return workdir / f"result.{rank}.pkl"


def _dumps(obj: Any) -> bytes:
    try:
        import cloudpickle  # a dependency of plait; without it only importable functions travel
    except ImportError:
        return pickle.dumps(obj)
    return bytes(cloudpickle.dumps(obj))


def _launch_argv(np: int, hosts: str | None, hostfile: str | None, use_gloo: bool | None,
                 start_timeout: float | None, network_interfaces: str | Sequence[str] | None,
                 timeout: float | None) -> list[str]:
    """``plait run``'s arguments for the job, up to its command."""
    argv = ["-np", str(np)]
    if hostfile is not None:
        argv += ["--hostfile", str(hostfile)]
    else:  # as horovodrun: all ranks on this machine unless told otherwise
        argv += ["-H", hosts if hosts is not None else f"localhost:{np}"]
    if use_gloo:
        argv += ["--launcher", "horovodrun", "--gloo", "--backend", "horovod"]
    if start_timeout is not None:
        argv += ["--start-timeout", str(start_timeout)]
    if network_interfaces is not None:
        argv += ["--network-interface", network_interfaces if isinstance(network_interfaces, str)
                 else ",".join(network_interfaces)]
    if timeout is not None:
        argv += ["--timeout", str(timeout)]
    return argv


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
        np: int = 1, hosts: str | None = None, hostfile: str | None = None,
        use_gloo: bool | None = None, use_mpi: bool | None = None,
        start_timeout: float | None = None, network_interfaces: str | Sequence[str] | None = None,
        executable: str | None = None, verbose: int | None = None, disable_cache: bool | None = None,
        timeout: float | None = None, **unsupported: Any) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on every rank of a new job (Horovod's ``horovod.run``).

    ``func`` calls ``hvd.init()`` (or ``plait.init()``) itself, as with Horovod.

    Args:
        func: the function; with ``cloudpickle`` installed also a lambda or a function
            defined in ``__main__`` or a notebook.
        args: its positional arguments (picklable).
        kwargs: its keyword arguments (picklable).
        np: the number of ranks.
        hosts: ``"host1:2,host2:2"`` (default: ``localhost:np``).
        hostfile: a hostfile of ``HOST slots=N`` lines instead of ``hosts``.
        use_gloo: start with ``horovodrun --gloo`` (the Horovod backend) instead of mpirun.
        use_mpi: start with mpirun (the default; exclusive with ``use_gloo``).
        start_timeout: seconds horovodrun waits for the ranks to start.
        network_interfaces: interface names (or a CIDR subnet) for the job's traffic.
        executable: the Python that runs the ranks (default: this one).
        verbose: accepted for Horovod's signature; the launcher's output is shown anyway.
        disable_cache: accepted for Horovod's signature (nothing is cached).
        timeout: seconds after which the job is killed (default: none).
        **unsupported: Horovod's elastic and ssh arguments (:data:`_NOT_TAKEN`), refused.

    Returns:
        Each rank's return value, by rank.

    Raises:
        ConfigError: for a bad argument (naming it), or one plait does not take.
        FileNotFoundError: when the launcher is not installed.
        RuntimeError: when a rank raised (with its traceback), or the job failed or timed
            out before every rank returned (with the launcher's exit status).
    """
    _check(func, np, use_gloo, use_mpi, unsupported)
    for name, seconds in (("timeout", timeout), ("start_timeout", start_timeout)):
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or seconds <= 0):
            raise invalid(name, seconds, "a number of seconds > 0, or None")
    argv = _launch_argv(np, hosts, hostfile, use_gloo, start_timeout, network_interfaces, timeout)
    remote = hostfile is not None or hosts is not None
    base = os.environ.get("PLAIT_RUN_DIR") or (os.getcwd() if remote else None)
    workdir = Path(tempfile.mkdtemp(prefix="plait-run-", dir=base))
    try:
        (workdir / CALL).write_bytes(_dumps((func, tuple(args), dict(kwargs or {}))))
        parsed = build_parser().parse_args(
            [*argv, "--", executable or sys.executable, "-m", "plait.launch.call_rank", str(workdir)])
        cmd = build_command(spec_from_args(parsed), os.environ, is_root=os.geteuid() == 0)
        try:
            status = run_command(cmd, parsed.timeout)
        except FileNotFoundError as exc:
            raise FileNotFoundError(
                f"plait.run: the launcher {cmd.argv[0]!r} is not on PATH (mpirun: apt-get install "
                "openmpi-bin; horovodrun: pip install horovod)") from exc
        return _results(workdir, np, status)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _check(func: Any, np: Any, use_gloo: bool | None, use_mpi: bool | None,
           unsupported: Mapping[str, Any]) -> None:
    if not callable(func):
        raise invalid("func", func, "a callable")
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise invalid("np", np, "an integer >= 1")
    if use_gloo and use_mpi:
        raise ConfigError("use_gloo=True and use_mpi=True: choose one launcher (horovodrun --gloo "
                          "or mpirun)")
    for name, value in unsupported.items():
        if name not in _NOT_TAKEN:
            raise TypeError(f"run() got an unexpected keyword argument {name!r}")
        if value is not None:
            raise ConfigError(
                f"{name}={value!r}: plait.run does not take Horovod's {name} (elastic jobs: "
                "`plait run --elastic`; ssh settings: ~/.ssh/config; extra mpirun flags: "
                "`plait run --mca`)")


def _results(workdir: Path, np: int, status: int) -> list[Any]:
    """Each rank's result, or the error of the first rank that raised or did not return."""
    outcomes = {}
    for rank in range(np):
        path = result_path(workdir, rank)
        if path.exists():
            outcomes[rank] = pickle.loads(path.read_bytes())
    for rank, (kind, value) in sorted(outcomes.items()):
        if kind == "error":
            raise RuntimeError(f"plait.run: rank {rank} raised:\n{value}")
    missing = [r for r in range(np) if r not in outcomes]
    if missing:
        raise RuntimeError(f"plait.run: the job ended with exit status {status} before ranks "
                           f"{missing} returned (the launcher's output above says why)")
    if status != 0:
        raise RuntimeError(f"plait.run: the job ended with exit status {status} after every "
                           "rank returned")
    return [outcomes[r][1] for r in range(np)]
