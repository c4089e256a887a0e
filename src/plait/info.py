"""``plait info``: what this installation can do (like ``horovodrun --check-build``).

Each probe runs in a subprocess, so a framework that fails to import (or MPI
that fails to initialise) is reported instead of taking this command down.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from . import __version__

__all__ = ["collect", "main"]

_PROBES = {
    "torch": "import torch; print(torch.__version__)",
    "tensorflow": "import os; os.environ['TF_CPP_MIN_LOG_LEVEL']='3'; import tensorflow as tf; "
                  "print(tf.__version__)",
    "keras": "import os; os.environ['TF_CPP_MIN_LOG_LEVEL']='3'; import keras; print(keras.__version__)",
    "mpi4py": "import mpi4py; print(mpi4py.__version__)",
    "mpi library": ("from mpi4py import MPI; "
                    "print(MPI.Get_library_version().replace(chr(0), '').splitlines()[0].strip())"),
    "mpi thread level": "from plait.collectives.mpi import thread_level; print(thread_level())",
    "mpi algorithms": "from plait.collectives.tuning import Tuning; print(Tuning.from_env().describe())",
    "cuda-aware mpi": "from mpi4py import MPI; import subprocess; out = subprocess.run("
                      "['ompi_info', '--parsable', '--all'], capture_output=True, text=True).stdout; "
                      "print('yes' if 'mpi_built_with_cuda_support:value:true' in out else 'no')",
    "horovod": "import horovod; print(horovod.__version__)",
    "horovod built with": "import os; os.environ['TF_CPP_MIN_LOG_LEVEL']='3'; "
                          "from plait.collectives.horovod import build_info; "
                          "print(', '.join(k for k, v in build_info().items() if v) or 'nothing')",
    "cuda (torch)": "import torch; print('yes' if torch.cuda.is_available() else 'no')",
}


def _probe(code: str, timeout: float) -> str:
    """The last line one probe prints, or ``not available (reason)``."""
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"not available (no answer in {timeout:g}s)"
    if proc.returncode == 0 and proc.stdout.strip():
        return proc.stdout.strip().splitlines()[-1]
    last = (proc.stderr.strip().splitlines() or ["failed"])[-1]
    return f"not available ({last})"


def collect(timeout: float = 120.0) -> dict[str, str]:
    """Probe every component, a few at a time (each probe is a process that imports a
    framework: seconds each); a failure is reported as ``not available (reason)``."""
    out = {"plait": __version__, "python": platform.python_version()}
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        found = {name: pool.submit(_probe, code, timeout) for name, code in _PROBES.items()}
        out.update({name: future.result() for name, future in found.items()})
    return out


def main(argv: Sequence[str] = ()) -> int:
    """Print the report (``--json`` for machine-readable output)."""
    info = collect()
    if "--json" in argv:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0
