"""One rank of :func:`plait.run`: ``python -m plait.launch.call_rank WORKDIR`` loads the
function and its arguments from ``WORKDIR``, calls it, and writes what it returned (or the
traceback of what it raised) for the caller to collect.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from plait.errors import ConfigError
from plait.launch.call import CALL, result_path

__all__ = ["main"]

#: The environment variables that give a rank its rank (Open MPI, Horovod's launcher, PMI).
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "PMI_RANK")


def _rank() -> int:
    for name in _RANK_VARS:
        if name in os.environ:
            return int(os.environ[name])
    raise ConfigError(f"plait.launch.call_rank runs under a launcher: none of {list(_RANK_VARS)} is set")


def main(argv: Sequence[str] | None = None) -> int:
    """One rank: call the function in ``WORKDIR`` and write its result (or its error).

    Args:
        argv: ``[WORKDIR]`` (default: ``sys.argv[1:]``).

    Returns:
        0 when the function returned, 1 when it raised or its result cannot be pickled.
    """
    workdir = Path((sys.argv[1:] if argv is None else argv)[0])
    rank = _rank()
    func, args, kwargs = pickle.loads((workdir / CALL).read_bytes())
    try:
        data = pickle.dumps(("ok", func(*args, **kwargs)))
        status = 0
    except BaseException as exc:  # reported to the caller, whatever it is
        data = pickle.dumps(("error", "".join(traceback.format_exception(exc))))
        status = 1
    path = result_path(workdir, rank)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return status


if __name__ == "__main__":
    sys.exit(main())
