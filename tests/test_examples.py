"""The examples train to the single-process accuracy under every launcher (real jobs)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from jobs import ROOT, mpi_env, run_job

PLAIT_RUN = [sys.executable, "-m", "plait.cli", "run", "-np", "2", "--timeout", "600", "--"]


def accuracy(output: str) -> float:
    found = re.findall(r"test accuracy: ([0-9.]+)", output)
    assert found, output[-3000:]
    return float(found[-1])


def test_torch_digits_with_plait_run_on_mpi():
    proc = subprocess.run([*PLAIT_RUN, sys.executable, "examples/torch_digits.py", "--backend", "mpi",
                           "--epochs", "8"], cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                          timeout=700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 ranks, backend mpi" in proc.stdout
    assert accuracy(proc.stdout) >= 0.93


@pytest.mark.parametrize(("launcher", "script", "backend"), [
    ("horovodrun-gloo", "torch_digits.py", "horovod"),
    ("mpirun", "keras_digits.py", "horovod"),
])
def test_example_reaches_single_process_accuracy(launcher, script, backend):
    result = run_job(launcher, 2, [sys.executable, f"examples/{script}", "--backend", backend,
                                   "--epochs", "8"], timeout=700)
    assert result.returncode == 0, result.tail()
    assert accuracy(result.output) >= 0.93
