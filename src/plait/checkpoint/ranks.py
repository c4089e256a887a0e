"""Moving checkpoint files between ranks: one byte blob per rank, gathered and scattered.

A checkpoint holds rank 0's files under their own names and, when state differs
per rank (error-feedback memories, asynchronous replicas), each other rank's files
under ``rankNNNNN.<name>``. Files travel as one uint8 array per rank
(:func:`pack`): an 8-byte header length, a JSON header, then the file bodies.
Nothing is pickled.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from .atomic import CheckpointError

__all__ = ["gather_to_root", "merge_ranks", "pack", "rank_prefix", "scatter_from_root", "split_ranks",
           "unpack"]

_RANKED = re.compile(r"rank(\d{5,})\.(.+)\Z")


def pack(header: Mapping[str, Any], files: Mapping[str, bytes]) -> np.ndarray:
    """One uint8 array holding ``header`` (JSON) and ``files``.

    Args:
        header: JSON-serialisable description travelling with the files.
        files: file name -> content.

    Returns:
        The packed bytes.
    """
    head = json.dumps({**header, "files": [[k, len(v)] for k, v in files.items()]}).encode()
    data = len(head).to_bytes(8, "little") + head + b"".join(files.values())
    return np.frombuffer(data, dtype=np.uint8).copy()


def unpack(buf: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Inverse of :func:`pack`.

    Args:
        buf: the packed array (or anything ``np.asarray`` turns into uint8 bytes).

    Returns:
        ``(header, files)``.

    Raises:
        CheckpointError: when the bytes are not a packed blob.
    """
    data = np.asarray(buf, dtype=np.uint8).tobytes()
    try:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        files, offset = {}, 8 + n
        for name, size in header.pop("files"):
            files[str(name)] = data[offset : offset + size]
            offset += int(size)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint data received from another rank is garbled ({exc})") from exc
    if offset != len(data):
        raise CheckpointError(f"checkpoint data received from another rank has {len(data)} bytes, "
                              f"its header describes {offset}")
    return header, files


def rank_prefix(rank: int) -> str:
    """The file-name prefix of ``rank``'s files inside a checkpoint (``rank00003.``)."""
    return f"rank{rank:05d}."


def merge_ranks(own: Mapping[str, bytes], others: Mapping[int, Mapping[str, bytes]]) -> dict[str, bytes]:
    """Rank 0's files under their names plus every other rank's under its prefix.

    Args:
        own: rank 0's files.
        others: rank -> that rank's files (ranks >= 1).

    Returns:
        The files of one checkpoint.
    """
    files = dict(own)
    for rank, theirs in sorted(others.items()):
        files.update({rank_prefix(rank) + name: data for name, data in theirs.items()})
    return files


def split_ranks(files: Mapping[str, bytes]) -> tuple[dict[str, bytes], dict[int, dict[str, bytes]]]:
    """Inverse of :func:`merge_ranks`: ``(rank 0's files, {rank: files})``."""
    top: dict[str, bytes] = {}
    ranked: dict[int, dict[str, bytes]] = {}
    for name, data in files.items():
        m = _RANKED.match(name)
        if m:
            ranked.setdefault(int(m.group(1)), {})[m.group(2)] = data
        else:
            top[name] = data
    return top, ranked


def gather_to_root(comm: Any, blob: np.ndarray, name: str) -> list[np.ndarray] | None:
    """Every rank's ``blob`` on rank 0 (one alltoall); ``None`` on the other ranks.

    Every rank also sends one byte to itself so that no rank sends or receives an
    empty tensor (some backends refuse those).

    Args:
        comm: the communicator.
        blob: this rank's uint8 array (non-empty).
        name: the collective's name.

    Returns:
        On rank 0, the blobs in rank order.
    """
    size, rank = int(comm.size), int(comm.rank)
    splits = [0] * size
    splits[0] = int(blob.size)
    send = blob
    if rank != 0:
        splits[rank] = 1
        send = np.concatenate([blob, np.zeros(1, np.uint8)])
    out, got = comm.alltoall(send, splits, name=name)
    out = np.asarray(out, dtype=np.uint8)
    if rank != 0:
        return None
    bounds = np.concatenate([[0], np.cumsum(got)]).astype(np.int64)
    return [out[bounds[r] : bounds[r + 1]] for r in range(size)]


def scatter_from_root(comm: Any, blobs: list[np.ndarray] | None, name: str) -> np.ndarray:
    """Rank ``r`` gets ``blobs[r]`` from rank 0 (one alltoall).

    Args:
        comm: the communicator.
        blobs: on rank 0, one non-empty uint8 array per rank; ignored elsewhere.
        name: the collective's name.

    Returns:
        This rank's blob.
    """
    size, rank = int(comm.size), int(comm.rank)
    if rank == 0:
        if blobs is None or len(blobs) != size:
            raise CheckpointError(f"rank 0 has {0 if blobs is None else len(blobs)} blobs for {size} ranks")
        send = np.concatenate(blobs)
        splits = [int(b.size) for b in blobs]
    else:
        send, splits = np.zeros(1, np.uint8), [0] * size
        splits[rank] = 1
    out, got = comm.alltoall(send, splits, name=name)
    return np.asarray(out, dtype=np.uint8)[: int(got[0])]
