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

#: Each probe answers for its names, one line each, in a process of its own; names that
#: need the same framework share its import (torch and TensorFlow take seconds each).
_PROBES: dict[tuple[str, ...], str] = {
    ("torch", "cuda (torch)"): "import torch; print(torch.__version__); "
                               "print('yes' if torch.cuda.is_available() else 'no')",
    ("tensorflow", "keras"): "import os; os.environ['TF_CPP_MIN_LOG_LEVEL']='3'; "
                             "import tensorflow as tf; print(tf.__version__); "
                             "import keras; print(keras.__version__)",
    ("mpi4py", "mpi library", "mpi thread level"): (
        "import mpi4py; print(mpi4py.__version__); from mpi4py import MPI; "
        "print(MPI.Get_library_version().replace(chr(0), '').splitlines()[0].strip()); "
        "from plait.collectives.mpi import thread_level; print(thread_level())"),
    ("mpi algorithms",): "from plait.collectives.tuning import Tuning; print(Tuning.from_env().describe())",
    ("cuda-aware mpi",): "from mpi4py import MPI; import subprocess; out = subprocess.run("
                         "['ompi_info', '--parsable', '--all'], capture_output=True, text=True).stdout; "
                         "print('yes' if 'mpi_built_with_cuda_support:value:true' in out else 'no')",
    ("horovod", "horovod built with"): (
        "import os; os.environ['TF_CPP_MIN_LOG_LEVEL']='3'; import horovod; print(horovod.__version__); "
        "from plait.collectives.horovod import build_info; "
        "print(', '.join(k for k, v in build_info().items() if v) or 'nothing')"),
}
#: The report's order.
_ORDER = ("torch", "tensorflow", "keras", "mpi4py", "mpi library", "mpi thread level",
          "mpi algorithms", "cuda-aware mpi", "horovod", "horovod built with", "cuda (torch)")


def _probe(names: tuple[str, ...], code: str, timeout: float) -> list[str]:
    """The last line a probe prints for each of its ``names``, or ``not available (reason)``
    for all of them."""
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return [f"not available (no answer in {timeout:g}s)"] * len(names)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and len(lines) >= len(names):
        return [line.strip() for line in lines[-len(names):]]
    last = (proc.stderr.strip().splitlines() or ["failed"])[-1]
    return [f"not available ({last})"] * len(names)


def collect(timeout: float = 120.0) -> dict[str, str]:
    """Probe every component, a few at a time (a probe that imports a framework takes
    seconds); a failure is reported as ``not available (reason)``."""
    out = {"plait": __version__, "python": platform.python_version()}
    found: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        futures = {names: pool.submit(_probe, names, code, timeout)
                   for names, code in _PROBES.items()}
        for names, future in futures.items():
            found.update(zip(names, future.result()))
    out.update({name: found[name] for name in _ORDER})
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
