"""Reporting from a job: a progress bar on rank 0 only, rank-prefixed logs, averaged metrics."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from .protocols import Communicator

__all__ = ["average_metrics", "log", "progress"]

T = TypeVar("T")


def progress(iterable: Iterable[T], comm: Communicator, **tqdm_kwargs: Any) -> Iterable[T]:
    """A tqdm progress bar on rank 0; the plain iterable on other ranks."""
    if comm.rank != 0:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, **tqdm_kwargs)


def log(comm: Communicator, *parts: object, root_only: bool = False) -> None:
    """Print one line prefixed with ``[rank r/size]`` (or only on rank 0)."""
    if root_only and comm.rank != 0:
        return
    sys.stdout.write(f"[rank {comm.rank}/{comm.size}] " + " ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def average_metrics(metrics: Mapping[str, float], comm: Communicator) -> dict[str, float]:
    """Average numeric metrics over all ranks (every rank must pass the same keys)."""
    keys = sorted(metrics)
    values = np.array([float(metrics[k]) for k in keys], dtype=np.float64)
    out = comm.allreduce(values, op="average", name="metrics." + ",".join(keys))
    return {k: float(v) for k, v in zip(keys, np.asarray(out))}
