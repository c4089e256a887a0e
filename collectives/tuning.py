"""Which algorithm the MPI backend uses for a collective: pure functions of the
message size, the dtype and the host layout, overridable by environment variables.

``PLAIT_ALLREDUCE`` picks the allreduce (and reducescatter) algorithm:

* ``auto`` (default): Open MPI's own collective between ranks of one host (shared
  memory is fastest there; 8-bit integers take the ring, whose sums wrap around as
  numpy's do where Open MPI's saturate); across hosts from ``PLAIT_RING_MIN_KB`` up, plait's
  pipelined ring, or with several ranks on every host the hierarchical allreduce
  (reduce-scatter inside each host, one ring between hosts per local rank on its
  shard, allgather inside each host: every byte crosses the host link once, where a
  flat ring sends ``2 (n-1)/n`` of the tensor over each of its two host-crossing
  edges); float16/bfloat16 always take a ring (numpy reduces them; Open MPI has no
  16-bit float reduction);
* ``ring``: the flat ring; ``hierarchical``: the hierarchical allreduce where the
  layout allows it (several hosts, the same number of ranks on each), else the ring;
  ``mpi``: Open MPI's collective (16-bit floats still take the ring). Reducescatter
  takes the ring where allreduce would be hierarchical.

``PLAIT_RING_CHUNK_KB`` is the ring's pipelining grain (default 256 KiB),
``PLAIT_RING_WINDOW`` the chunks whose first step is in flight at once (default 4);
``PLAIT_RING_MIN_KB`` the smallest message that takes the ring across hosts
(default 64 KiB). ``PLAIT_ALLGATHER`` (``auto``/``ring``/``mpi``) does the same for
allgather and broadcast (a broadcast's ring is a pipelined relay from the root).

Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` (``horovodrun --hierarchical-allreduce``)
means ``hierarchical`` when ``PLAIT_ALLREDUCE`` is unset.

``PLAIT_BLOCKING`` (``auto``/``never``): with ``auto`` (default), a synchronous
collective that Open MPI moves between ranks of one host is a blocking MPI call
once the header round showed that every rank arrived (over shared memory Open
MPI's blocking collectives are faster than their nonblocking forms), bounded by a
watchdog that ends the job if a rank stops in the middle of it; ``never`` keeps
every collective nonblocking (each wait raises after the timeout).

``PLAIT_PROGRESS`` (``auto``/``always``): a collective started asynchronously (a
data-parallel bucket during backward) moves only while some thread calls into MPI.
plait's rings are driven by its progress thread, always. Open MPI's own nonblocking
collectives also move inside the rank's next MPI call, so with ``auto`` (default) the
thread drives them only across hosts or where every rank of the host has a core to
spare for it (2 ranks on 2 cores, a 4.4M-parameter MLP in 32 buckets: 25.5-26.0 ms a
step with the thread polling them, 22.9-23.3 without); ``always`` drives them everywhere.
Every rank must use the same settings (``plait run`` forwards ``PLAIT_*``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from plait.errors import invalid

__all__ = ["ALGORITHMS", "HALF", "SATURATING", "Tuning"]

#: Values of PLAIT_ALLREDUCE (PLAIT_ALLGATHER takes all but "hierarchical").
ALGORITHMS = ("auto", "ring", "hierarchical", "mpi")
#: dtypes Open MPI cannot reduce natively.
HALF = ("float16", "bfloat16")
#: dtypes whose sums Open MPI 4.1 saturates on larger messages (its AVX reduction:
#: int8 81 + 81 gives 127 from a few KiB up, -94 below), where numpy, torch, TensorFlow
#: and plait's smaller messages wrap around: these take the ring, which wraps.
SATURATING = ("int8", "uint8")


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


def _choice(env: Mapping[str, str], name: str, valid: tuple[str, ...]) -> str:
    raw = env.get(name, "") or "auto"
    if raw not in valid:
        raise invalid(name, raw, f"one of {list(valid)}")
    return raw


def _count(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise invalid(name, raw, "a whole number >= 1")
    return int(raw)


@dataclass(frozen=True)
class Tuning:
    """The MPI backend's algorithm settings (see the module doc).

    Attributes:
        allreduce: "auto", "ring", "hierarchical" or "mpi".
        allgather: "auto", "ring" or "mpi".
        chunk_bytes: the ring's pipelining grain.
        ring_min_bytes: the smallest message that takes the ring across hosts under "auto".
        window: the ring's chunks in flight at once (see :class:`~plait.collectives.ring.Ring`).
        blocking: "auto" (synchronous collectives between ranks of one host are
            blocking MPI calls under a watchdog) or "never".
        progress: "auto" or "always" (see :meth:`drives_requests`).
    """

    allreduce: str = "auto"
    allgather: str = "auto"
    chunk_bytes: int = 256 * 1024
    ring_min_bytes: int = 64 * 1024
    window: int = 4
    blocking: str = "auto"
    progress: str = "auto"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Tuning:
        """Read ``PLAIT_ALLREDUCE`` (unset: Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE=1``
        means ``hierarchical``), ``PLAIT_ALLGATHER``, ``PLAIT_RING_CHUNK_KB``,
        ``PLAIT_RING_MIN_KB``, ``PLAIT_RING_WINDOW``, ``PLAIT_BLOCKING`` and ``PLAIT_PROGRESS``.

        Raises:
            ConfigError: for a value outside what the module doc lists.
        """
        env = os.environ if env is None else env
        allreduce = _choice(env, "PLAIT_ALLREDUCE", ALGORITHMS)
        if not env.get("PLAIT_ALLREDUCE") and env.get(
                "HOROVOD_HIERARCHICAL_ALLREDUCE", "").strip().lower() in ("1", "true"):
            allreduce = "hierarchical"  # Horovod's switch (horovodrun --hierarchical-allreduce)
        return cls(allreduce,
                   _choice(env, "PLAIT_ALLGATHER", ("auto", "ring", "mpi")),
                   _kib(env, "PLAIT_RING_CHUNK_KB", 256), _kib(env, "PLAIT_RING_MIN_KB", 64),
                   _count(env, "PLAIT_RING_WINDOW", 4),
                   _choice(env, "PLAIT_BLOCKING", ("auto", "never")),
                   _choice(env, "PLAIT_PROGRESS", ("auto", "always")))

    def reduce_algorithm(self, nbytes: int, dtype: str, hosts: int, per_host: int = 1) -> str:
        """"hierarchical", "ring" or "mpi" for an allreduce of ``nbytes``.

        Args:
            nbytes: the tensor's size in bytes.
            dtype: its dtype name.
            hosts: hosts in the group.
            per_host: ranks on every host (1 when hosts run different numbers).
        """
        layered = hosts > 1 and per_host > 1
        if self.allreduce == "hierarchical":
            return "hierarchical" if layered else "ring"
        if self.allreduce == "ring":
            return "ring"
        if self.allreduce == "auto" and hosts > 1 and nbytes >= self.ring_min_bytes:
            return "hierarchical" if layered else "ring"
        return "ring" if dtype in HALF or dtype in SATURATING else "mpi"

    def gather_algorithm(self, nbytes: int, hosts: int) -> str:
        """"ring" or "mpi" for an allgather whose result has ``nbytes``."""
        if self.allgather != "auto":
            return self.allgather
        return "ring" if hosts > 1 and nbytes >= self.ring_min_bytes else "mpi"

    def blocks(self, hosts: int) -> bool:
        """Whether a synchronous collective that Open MPI moves may be a blocking call
        (after the header round) in a group spanning ``hosts`` hosts."""
        return self.blocking == "auto" and hosts == 1

    def drives_requests(self, hosts: int, cores_per_rank: float) -> bool:
        """Whether the progress thread drives Open MPI's own nonblocking collectives (it
        always drives plait's rings).

        Args:
            hosts: hosts in the group.
            cores_per_rank: this host's cores over its ranks (or the cores a rank is
                bound to, when fewer).
        """
        return self.progress == "always" or hosts > 1 or cores_per_rank >= 2

    def describe(self) -> str:
        """One line for ``plait info`` and the timeline."""
        return (f"allreduce={self.allreduce} allgather={self.allgather} "
                f"ring_chunk={self.chunk_bytes // 1024}KiB ring_min={self.ring_min_bytes // 1024}KiB "
                f"ring_window={self.window} blocking={self.blocking} progress={self.progress}")
