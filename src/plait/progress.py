"""Reporting from a job: a progress bar on rank 0 only, rank-prefixed logs, averaged metrics,
and :func:`report`, the progress hook the training service reads."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import numpy as np

from .protocols import Communicator

__all__ = ["PROGRESS_FILE_ENV", "PROGRESS_LINE", "average_metrics", "log", "progress", "report"]

#: The variable naming the file :func:`report` appends to (set by ``plait serve`` on rank 0);
#: ``-`` writes each report to stdout instead, after :data:`PROGRESS_LINE` (Kubernetes pods,
#: whose log the service reads).
PROGRESS_FILE_ENV = "PLAIT_PROGRESS_FILE"
#: What starts a progress report written to stdout.
PROGRESS_LINE = "plait-progress: "
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")

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


def report(step: int | None = None, epoch: int | None = None, loss: float | None = None,
           artifact: str | None = None, **metrics: float) -> bool:
    """Report training progress to the service that runs this job (a no-op elsewhere).

    ``plait serve`` sets ``PLAIT_PROGRESS_FILE`` on rank 0 only, so every rank can call
    this (in Kubernetes pods it is ``-``: the report goes to stdout, which the service
    reads from rank 0's pod); the job's status then shows the last step, epoch, loss and metrics, and
    ``artifact`` (the saved model's path) once rank 0 reports it.

    Args:
        step: global step.
        epoch: epoch.
        loss: current loss.
        artifact: path or URI of the model rank 0 saved.
        **metrics: other numbers (accuracy=0.97, ...).

    Returns:
        Whether a report was written.
    """
    path = os.environ.get(PROGRESS_FILE_ENV)
    if not path:
        return False
    entry: dict[str, object] = {"time": time.time(), "metrics": {k: float(v) for k, v in metrics.items()}}
    if step is not None:
        entry["step"] = int(step)
    if epoch is not None:
        entry["epoch"] = int(epoch)
    if loss is not None:
        entry["loss"] = float(loss)
    if artifact is not None:
        entry["artifact"] = str(artifact)
    if path == "-":
        if any(os.environ.get(v, "0") != "0" for v in _RANK_VARS):
            return False  # a launcher that gives every rank the variable: rank 0 reports
        sys.stdout.write(PROGRESS_LINE + json.dumps(entry) + "\n")
        sys.stdout.flush()
        return True
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
    return True
