"""Which algorithm the MPI backend uses for a collective: pure functions of the
message size, the dtype and the host layout, overridable by environment variables.

``PLAIT_ALLREDUCE`` picks the allreduce (and reducescatter) algorithm:

* ``auto`` (default): Open MPI's own collective between ranks of one host (shared
  memory is fastest there), plait's pipelined ring across hosts from
  ``PLAIT_RING_MIN_KB`` up, and the ring for float16/bfloat16 on any layout
  (numpy reduces them; Open MPI has no 16-bit float reduction);
* ``ring``: plait's ring whenever a message is larger than the agreement check's
  payload slot; ``mpi``: Open MPI's collective (16-bit floats still take the ring).

``PLAIT_RING_CHUNK_KB`` is the ring's pipelining grain (default 256 KiB),
``PLAIT_RING_WINDOW`` the chunks whose first step is in flight at once (default 8);
``PLAIT_RING_MIN_KB`` the smallest message that takes the ring across hosts
(default 64 KiB). ``PLAIT_ALLGATHER`` (``auto``/``ring``/``mpi``) does the same for
allgather. Every rank must use the same settings (``plait run`` forwards ``PLAIT_*``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from plait.errors import invalid

__all__ = ["ALGORITHMS", "HALF", "Tuning"]

#: Values of PLAIT_ALLREDUCE / PLAIT_ALLGATHER.
ALGORITHMS = ("auto", "ring", "mpi")
#: dtypes Open MPI cannot reduce natively.
HALF = ("float16", "bfloat16")


def _kib(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default * 1024
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise invalid(name, raw, "a whole number of KiB >= 1")
    return value * 1024


def _choice(env: Mapping[str, str], name: str) -> str:
    raw = env.get(name, "") or "auto"
    if raw not in ALGORITHMS:
        raise invalid(name, raw, f"one of {list(ALGORITHMS)}")
    return raw


@dataclass(frozen=True)
class Tuning:
    """The MPI backend's algorithm settings (see the module doc).

    Attributes:
        allreduce: "auto", "ring" or "mpi".
        allgather: "auto", "ring" or "mpi".
        chunk_bytes: the ring's pipelining grain.
        ring_min_bytes: the smallest message that takes the ring across hosts under "auto".
        window: the ring's chunks in flight at once (see :class:`~plait.collectives.ring.Ring`).
    """

    allreduce: str = "auto"
    allgather: str = "auto"
    chunk_bytes: int = 256 * 1024
    ring_min_bytes: int = 64 * 1024
    window: int = 8

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Tuning:
        """Read ``PLAIT_ALLREDUCE``, ``PLAIT_ALLGATHER``, ``PLAIT_RING_CHUNK_KB``,
        ``PLAIT_RING_MIN_KB`` and ``PLAIT_RING_WINDOW``.

        Raises:
            ConfigError: for a value outside what the module doc lists.
        """
        env = os.environ if env is None else env
        return cls(_choice(env, "PLAIT_ALLREDUCE"), _choice(env, "PLAIT_ALLGATHER"),
                   _kib(env, "PLAIT_RING_CHUNK_KB", 256), _kib(env, "PLAIT_RING_MIN_KB", 64),
                   _kib(env, "PLAIT_RING_WINDOW", 8) // 1024)

    def reduce_algorithm(self, nbytes: int, dtype: str, hosts: int) -> str:
        """"ring" or "mpi" for an allreduce/reducescatter of ``nbytes`` over ``hosts`` hosts."""
        if dtype in HALF or self.allreduce == "ring":
            return "ring"
        if self.allreduce == "mpi":
            return "mpi"
        return "ring" if hosts > 1 and nbytes >= self.ring_min_bytes else "mpi"

    def gather_algorithm(self, nbytes: int, hosts: int) -> str:
        """"ring" or "mpi" for an allgather whose result has ``nbytes``."""
        if self.allgather != "auto":
            return self.allgather
        return "ring" if hosts > 1 and nbytes >= self.ring_min_bytes else "mpi"

    def describe(self) -> str:
        """One line for ``plait info`` and the timeline."""
        return (f"allreduce={self.allreduce} allgather={self.allgather} "
                f"ring_chunk={self.chunk_bytes // 1024}KiB ring_min={self.ring_min_bytes // 1024}KiB "
                f"ring_window={self.window}")
