"""Horovod's elastic mode with plait: what the torch and the TensorFlow states share.

Horovod's ``hvd.elastic.run`` retries the training function after workers were
added or removed, resetting the library in between. plait adds two things:

* the reset also rebinds plait's world communicator (when it runs on Horovod),
  so optimizers and callbacks made from ``plait.torch`` / ``plait.keras`` keep
  working with the new ranks and sizes;
* plait state objects (:class:`plait.checkpoint.Stateful`, e.g. error-feedback
  memories) are committed, restored and synchronised with the model.

The framework states are in :mod:`plait.collectives.horovod_elastic_torch` and
:mod:`plait.collectives.horovod_elastic_tf`; users reach them as
``plait.torch.elastic`` and ``plait.keras.elastic`` / ``plait.tensorflow.elastic``.
Elastic jobs are started by ``horovodrun --host-discovery-script ... --min-np A``
(Gloo). This module imports horovod (only ``collectives/`` may).
"""

from __future__ import annotations

import copy
import os
import socket
from collections.abc import Callable, Mapping
from typing import Any

from horovod.common.elastic import run_fn
from horovod.common.exceptions import HorovodInternalError

from plait.checkpoint.state import Stateful, as_stateful
from plait.elastic_relaunch import mismatched, versions
from plait.errors import ConfigError

from .timeline import span

__all__ = ["PlaitObjects", "check_versions", "elastic_run", "reset"]


class PlaitObjects:
    """plait state objects kept in step with a Horovod elastic state.

    Args:
        state: plait state objects by name (``state_dict()``/``load_state_dict()``,
            or residual memories), or None.
    """

    def __init__(self, state: Mapping[str, Any] | None) -> None:
        self.objects: dict[str, Stateful] = {k: as_stateful(v, k) for k, v in (state or {}).items()}
        self._saved: dict[str, Any] = {}

    def save(self) -> None:
        """Remember every object's state in memory (on ``commit()``)."""
        self._saved = {k: copy.deepcopy(dict(s.state_dict())) for k, s in self.objects.items()}

    def restore(self) -> None:
        """Roll every object back to the last :meth:`save`."""
        for name, saved in self._saved.items():
            self.objects[name].load_state_dict(copy.deepcopy(saved))

    def sync(self, broadcast_object: Callable[[Any, str], Any]) -> None:
        """Give every worker rank 0's objects.

        Args:
            broadcast_object: ``(obj, name) -> rank 0's obj``, the framework's Horovod call.
        """
        for name, obj in self.objects.items():
            obj.load_state_dict(broadcast_object(dict(obj.state_dict()), f"plait.elastic.{name}"))


def check_versions(allgather_object: Callable[[Any], Any], rank: int) -> None:
    """Before each sync (at the start and after every membership change), check that
    every worker runs the plait, torch, TensorFlow and Keras versions most workers run.

    A worker that runs others leaves the job: it raises :class:`ConfigError` (its process
    ends, and Horovod's elastic driver leaves its host out of the next round). The others
    raise ``HorovodInternalError``, so ``hvd.elastic.run`` restores the last commit and
    goes on without it.

    Args:
        allgather_object: gathers one object from every worker, by rank (Horovod's
            ``allgather_object``, or plait's world's where the state syncs through it).
        rank: this worker's rank.

    Raises:
        ConfigError: on a worker whose versions differ from most workers'.
        HorovodInternalError: on the other workers, when some worker's versions differ.
    """
    every = list(allgather_object(versions()))
    common, odd = mismatched(every)
    if not odd:
        return
    host = os.environ.get("HOROVOD_HOSTNAME", socket.gethostname())
    if rank in odd:
        raise ConfigError(f"this worker (rank {rank}, host {host}) runs {every[rank]}, the elastic job "
                          f"runs {common}: it leaves the job (install the job's versions here)")
    raise HorovodInternalError(
        f"ranks {odd} run other versions than the elastic job ({common}): "
        f"{', '.join(f'rank {r}: {every[r]}' for r in odd)}; the others go on without them")


def reset(hvd: Any, framework: str) -> None:
    """Horovod's elastic reset (shut down, initialise again), rebinding plait's world.

    Args:
        hvd: ``horovod.torch`` or ``horovod.tensorflow``.
        framework: "torch" or "tensorflow", the library ``hvd`` is.
    """
    from plait import runtime

    world = runtime.world() if runtime.is_initialized() else None
    ours = world is not None and world.backend == "horovod" and getattr(world, "framework", None) == framework
    with span("elastic reset", cat="elastic", **_membership(hvd, "old")) as mark:
        if ours:
            world.reset()  # type: ignore[union-attr]
        else:
            hvd.shutdown()
            hvd.init()
        mark.args.update(_membership(hvd, "new"))


def _membership(hvd: Any, when: str) -> dict[str, int]:
    """``{when_size, when_rank}`` for the timeline (nothing where Horovod cannot say)."""
    try:
        return {f"{when}_size": int(hvd.size()), f"{when}_rank": int(hvd.rank())}
    except (ValueError, RuntimeError):
        return {}


def elastic_run(func: Callable[..., Any], hvd: Any, framework: str) -> Callable[..., Any]:
    """Horovod's ``run_fn`` with :func:`reset` as the reset.

    Args:
        func: the training function; its first argument is the elastic state.
        hvd: ``horovod.torch`` or ``horovod.tensorflow``.
        framework: "torch" or "tensorflow".

    Returns:
        The wrapped function: it syncs the state, runs ``func`` and, after workers were
        added or removed (or one failed), resets, restores or syncs, and runs it again.
    """
    wrapped: Callable[..., Any] = run_fn(func, lambda: reset(hvd, framework))
    return wrapped
