"""Horovod's ``join`` on the MPI backend: what a joined rank learns from the header.

A rank that called ``join()`` keeps answering the other ranks' collective headers
(:meth:`~plait.collectives.mpi.MPICommunicator._header`) until every rank joined.
Each header row says, besides the call's digest, what *role* the rank plays:

- :data:`OTHER`: a collective a joined rank cannot take part in (allgather,
  broadcast, ...): the ranks that did not join raise, the joined ones wait on;
- :data:`SMALL`: an allreduce whose whole tensor travels in the header (a joined
  rank's row carries zeros: nothing more to do);
- :data:`ALLREDUCE`: a larger allreduce, whose payload describes the data phase
  (:func:`describe`), which a joined rank then runs with zeros (:func:`zeros`);
- :data:`JOINED`: this rank has joined (its ``number`` is 1 in its first round);
- :data:`STEP`: a gradient reducer's step, whose buckets move on a private
  communicator without headers; ``number`` names the reducer, whose step a joined
  rank runs with zero gradients.

As in Horovod, joined ranks contribute zeros, and an average divides by the whole
group's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ALLREDUCE", "JOINED", "OTHER", "SMALL", "STEP", "Reduction", "describe", "read", "zeros"]

OTHER, SMALL, ALLREDUCE, JOINED, STEP = 0, 1, 2, 3, 4

_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "uint16",
           "int32", "int64", "bool")
_NUMPY = {"bfloat16": np.uint16, "bool": np.bool_}  # bfloat16 buffers hold bit patterns
_OPS = ("sum", "average", "min", "max", "product")
_ALGORITHMS = ("mpi", "ring", "hierarchical")


@dataclass(frozen=True)
class Reduction:
    """The data phase of an allreduce, as the ranks that did not join run it.

    Attributes:
        dtype: plait dtype name.
        size: elements.
        op: reduction name.
        algorithm: "mpi", "ring" or "hierarchical".
        blocking: a blocking ``MPI_Allreduce`` (which only matches a blocking call).
    """

    dtype: str
    size: int
    op: str
    algorithm: str
    blocking: bool


def describe(r: Reduction) -> np.ndarray:
    """The header payload (bytes) describing ``r``."""
    return np.array([_DTYPES.index(r.dtype), r.size, _OPS.index(r.op),
                     _ALGORITHMS.index(r.algorithm), int(r.blocking)], dtype=np.int64).view(np.uint8)


def read(payload: np.ndarray) -> Reduction:
    """The inverse of :func:`describe` (``payload``: at least 40 bytes)."""
    d, size, op, algorithm, blocking = np.ascontiguousarray(payload[:40]).view(np.int64)
    return Reduction(_DTYPES[int(d)], int(size), _OPS[int(op)], _ALGORITHMS[int(algorithm)],
                     bool(blocking))


def zeros(r: Reduction) -> np.ndarray:
    """A joined rank's contribution to ``r``: a flat buffer of zeros."""
    return np.zeros(r.size, dtype=_NUMPY.get(r.dtype, r.dtype))
