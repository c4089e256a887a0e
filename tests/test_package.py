"""Packaging, import hygiene, configuration errors and the command line (single process;
one 2-rank launch: MPI started by plait for the Horovod backend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from jobs import ROOT, run_job

import plait
from plait.config import Config


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_plait_imports_no_framework_mpi_or_horovod():
    out = run_python(
        "import sys, plait, plait.parallel, plait.compression, plait.launch; "
        "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'mpi4py', 'horovod') if m in sys.modules))"
    )
    assert out.strip() == "[]"


def test_readme_compression_spelling_works_after_import_plait_alone():
    out = run_python(
        "import sys, plait; "
        "dp = plait.DataParallel(compression=plait.compression.TopK(0.1), "
        "memory=plait.compression.Residual()); "
        "print(type(dp.compression).__name__, type(dp.memory).__name__, "
        "plait.compression.FP16 is plait.compression.cast.FP16, "
        "sorted(m for m in ('torch', 'tensorflow', 'keras', 'mpi4py', 'horovod') if m in sys.modules))"
    )
    assert out.split() == ["TopK", "Residual", "True", "[]"]


def test_wheel_contains_every_package(tmp_path: Path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(ROOT)], check=True, timeout=300, capture_output=True)
    wheel = next(tmp_path.glob("plait-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    on_disk = {"plait/" + str(p.parent.relative_to(ROOT / "src" / "plait")).replace(".", "")
               for p in (ROOT / "src" / "plait").rglob("__init__.py")}
    on_disk |= {"plait/collectives/", "plait/adapters/"}
    for package in on_disk:
        prefix = package.rstrip("/") + "/"
        assert any(n.startswith(prefix) for n in names), f"{package} missing from the wheel"


def test_unknown_backend_lists_the_valid_ones():
    with pytest.raises(plait.ConfigError, match=r"backend='nccl'.*\['auto', 'mpi', 'horovod'\]"):
        plait.init("nccl")


@pytest.mark.parametrize(("env", "match"), [
    ({"PLAIT_BACKEND": "gloo"}, "backend='gloo'"),
    ({"PLAIT_TIMEOUT": "soon"}, "PLAIT_TIMEOUT='soon'"),
    ({"PLAIT_TIMEOUT": "-1"}, "timeout=-1.0"),
    ({"PLAIT_CHECK": "maybe"}, "PLAIT_CHECK='maybe'"),
])
def test_bad_environment_settings_name_the_variable(env, match):
    with pytest.raises(plait.ConfigError, match=match):
        Config.from_env(env)


def test_config_from_env_and_overrides():
    cfg = Config.from_env({"PLAIT_BACKEND": "mpi", "PLAIT_CHECK": "0", "PLAIT_TIMEOUT": "5"}, timeout=7)
    assert cfg == Config(backend="mpi", check=False, timeout=7.0)


def test_plait_info_reports_versions():
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "info", "--json"], capture_output=True,
                          text=True, timeout=600)
    info = json.loads(proc.stdout)
    assert info["plait"] == plait.__version__
    assert info["mpi thread level"] == "multiple"
    assert "mpi" in info["horovod built with"] and "gloo" in info["horovod built with"]
    assert info["torch"].startswith("2.") and info["keras"].startswith("3.")


def test_cli_rejects_unknown_commands():
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "launch"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown command 'launch'" in proc.stderr


def test_world_before_init_is_a_clear_error():
    """A ``ValueError``, as Horovod's ``hvd.rank()`` before ``hvd.init()`` or after
    ``hvd.shutdown()``: code written for Horovod catches it."""
    with pytest.raises(ValueError, match="plait.init") as err:
        plait.world()
    assert isinstance(err.value, plait.PlaitError)


def test_mpi_backend_starts_mpi_when_mpi4py_was_told_not_to():
    """A script that set ``mpi4py.rc.initialize = False`` (Horovod's tests do: Horovod starts
    MPI itself) gets MPI started by plait's init, with every thread allowed, and finalized."""
    code = ("import mpi4py; mpi4py.rc.initialize = False\n"
            "import numpy as np, plait\nfrom mpi4py import MPI\n"
            "assert not MPI.Is_initialized()\n"
            "comm = plait.init(backend='mpi')\n"
            "assert MPI.Query_thread() == MPI.THREAD_MULTIPLE\n"
            "print(comm.allreduce(np.ones(2), op='sum').tolist())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMPI_ALLOW_RUN_AS_ROOT": "1",
                               "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    assert proc.returncode == 0 and "[1.0, 1.0]" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.timeout(180)
def test_horovod_backend_with_process_sets_when_mpi4py_was_told_not_to():
    """The same with ``hvd.init(process_sets=[...])`` on the Horovod backend under mpirun, as
    Horovod's test_process_sets_static.py does: Horovod started MPI and finalized it when
    plait restarted it with process sets (the job aborted), and a rank that shut Horovod down
    right after init failed another rank's op still pending in its own process set."""
    code = ("import mpi4py; mpi4py.rc.initialize = False\n"
            "import torch, plait.torch as hvd\n"
            "sets = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]\n"
            "hvd.init(process_sets=sets)\n"
            "mine = hvd.allreduce(torch.ones(2) * (hvd.rank() + 1), op=hvd.Sum,\n"
            "                     process_set=sets[hvd.rank()])\n"
            "both = hvd.allreduce(torch.ones(1), op=hvd.Sum)\n"
            "print(f'rank {hvd.rank()}: {mine.tolist()} {both.tolist()}', flush=True)\n"
            "hvd.shutdown()\n")
    job = run_job("mpirun", 2, [sys.executable, "-c", code], timeout=150,
                  env={"PLAIT_BACKEND": "horovod"})
    assert job.returncode == 0, job.tail()
    assert "rank 0: [1.0, 1.0] [2.0]" in job.output and "rank 1: [2.0, 2.0] [2.0]" in job.output, job.tail()
