"""Launch a real multi-process job (mpirun or horovodrun) from a test, under timeouts.

Each rank usually runs a whole pytest file (``tests/parallel/job_*.py``), so the
seconds every rank pays to import torch and TensorFlow are paid once per launch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ROOT", "JobResult", "mpi_env", "pytest_argv", "run_job"]

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@dataclass
class JobResult:
    """Exit status and combined output of a job."""

    returncode: int
    output: str

    def tail(self, lines: int = 80) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every job gets: Open MPI as root, yielding when idle on 2 cores."""
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_mpi_yield_when_idle": "1", "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT),
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    })
    env.update(extra or {})
    return env


def pytest_argv(job_file: str, *args: str) -> list[str]:
    """argv for one rank running ``tests/parallel/<job_file>`` with pytest."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
            "python_files=job_*.py", "--color=no", "-x", "--timeout=240", "-W", "ignore::DeprecationWarning",
            str(ROOT / "tests" / "parallel" / job_file), *args]


def run_job(launcher: str, np: int, argv: list[str], timeout: float = 600,
            env: dict[str, str] | None = None) -> JobResult:
    """Run ``argv`` on ``np`` ranks started by ``launcher`` and wait for it.

    Args:
        launcher: "mpirun", "horovodrun-gloo" or "horovodrun-mpi".
        np: number of ranks (oversubscribing the 2 cores is allowed).
        argv: the program each rank runs.
        timeout: seconds for the whole job; the launcher's own timeout is a
            little shorter so that it reports which ranks were stuck.
        env: extra environment variables.

    Returns:
        The job's exit status and output.
    """
    inner = max(10, int(timeout) - 15)
    if launcher == "mpirun":
        cmd = [shutil.which("mpirun") or "mpirun", "-np", str(np), "--oversubscribe",
               "--bind-to", "none", "--tag-output", "--timeout", str(inner), *argv]
    elif launcher.startswith("horovodrun"):
        mode = "--gloo" if launcher.endswith("gloo") else "--mpi"
        cmd = [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", mode,
               "--start-timeout", "60", *argv]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(env), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode()
        return JobResult(124, out + f"\n[job killed after {timeout}s]")
    return JobResult(proc.returncode, proc.stdout)
