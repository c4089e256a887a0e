"""Cross-rank agreement check, written once for every backend.

Before a collective, the ranks compare a 62-bit digest of their call (kind,
shape, dtype, op, root, name). :func:`verify` reduces it with MIN over
``[-d, d - 2**62]``: one tiny allreduce tells every rank whether all digests agree (the
Horovod backend); the MPI backend compares the digests that travel in its header
allgather. Only on disagreement are the full descriptions allgathered
(:func:`mismatch`), so the error names every rank's call, on every rank.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from plait.errors import MismatchError

__all__ = ["WIDTH", "Call", "agreed", "encode", "mismatch", "verify"]

#: Bytes of description each rank contributes when a mismatch is reported.
WIDTH = 256
_BOUND = 1 << 62  # digests are below it


@dataclass(frozen=True)
class Call:
    """What one rank is about to do; ranks must agree on everything but ragged dims.

    Attributes:
        kind: collective name ("allreduce", "broadcast", ...).
        shape: the local tensor's shape.
        dtype: canonical dtype name.
        op: reduction name, if any.
        root: root rank, if any.
        name: user-given tensor name, if any.
        ragged: the first dimension may differ across ranks (allgather, alltoall).
    """

    kind: str
    shape: tuple[int, ...]
    dtype: str
    op: str | None = None
    root: int | None = None
    name: str | None = None
    ragged: bool = False

    def key(self) -> str:
        """The text that must be equal on all ranks."""
        shape: tuple[object, ...] = self.shape
        if self.ragged and shape:
            shape = ("*",) + shape[1:]
        return f"{self.kind}|{shape}|{self.dtype}|{self.op}|{self.root}|{self.name}"

    def describe(self) -> str:
        """Human-readable form, for error messages."""
        parts = [] if self.dtype in ("none", "object") else [f"shape={self.shape}",
                                                              f"dtype={self.dtype}"]
        if self.op is not None:
            parts.append(f"op={self.op}")
        if self.root is not None:
            parts.append(f"root={self.root}")
        if self.name is not None:
            parts.append(f"name={self.name!r}")
        return f"{self.kind}({', '.join(parts)})"

    def digest(self) -> int:
        """A 62-bit non-negative digest of :meth:`key` (cached: calls repeat every step)."""
        return _digest(self)


@functools.lru_cache(maxsize=4096)
def _digest(call: Call) -> int:
    h = hashlib.blake2b(call.key().encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 62) - 1)


def verify(
    call: Call,
    reduce_min: Callable[[np.ndarray], np.ndarray],
    allgather_rows: Callable[[np.ndarray], np.ndarray],
    where: str,
) -> None:
    """Raise on every rank unless all ranks are making the same call.

    Args:
        call: this rank's call.
        reduce_min: allreduce with MIN of an int64 array across the group.
        allgather_rows: allgather of a uint8 array of :data:`WIDTH` bytes, giving
            one row per rank (only used when the check fails).
        where: the communicator, named in the message.

    Raises:
        MismatchError: when any rank's call differs, naming each rank's call.
    """
    if agreed(reduce_min(encode(call))):
        return
    raise mismatch(call, allgather_rows, where)


def encode(call: Call) -> np.ndarray:
    """What a rank contributes to the MIN allreduce of :func:`verify`: ``[-d, d - 2**62]``
    for the digest ``d``, both negative, so the zeros that ranks which called Horovod's
    ``join`` contribute change nothing."""
    d = call.digest()
    return np.array([-d, d - _BOUND], dtype=np.int64)


def agreed(lo: np.ndarray) -> bool:
    """Whether the MIN over every rank's :func:`encode` shows one digest (max == min)."""
    return -int(lo[0]) == int(lo[1]) + _BOUND


def mismatch(
    call: Call,
    allgather_rows: Callable[[np.ndarray], np.ndarray],
    where: str,
) -> MismatchError:
    """The error every rank raises once the ranks found that their calls differ.

    Collective: every rank of the group must call it (it allgathers the descriptions).

    Args:
        call: this rank's call.
        allgather_rows: allgather of a uint8 array of :data:`WIDTH` bytes.
        where: the communicator, named in the message.

    Returns:
        A :class:`~plait.errors.MismatchError` naming each rank's call.
    """
    row = np.zeros(WIDTH, dtype=np.uint8)
    text = call.describe().encode()[:WIDTH]
    row[: len(text)] = np.frombuffer(text, dtype=np.uint8)
    rows = np.asarray(allgather_rows(row)).reshape(-1, WIDTH)
    texts = [bytes(rows[r]).rstrip(b"\0").decode(errors="replace") for r in range(rows.shape[0])]
    lines = [f"  rank {r}: {t}" for r, t in enumerate(texts)]
    return MismatchError(
        f"ranks of {where} called different collectives (or with different arguments):\n"
        + "\n".join(lines)
    )
