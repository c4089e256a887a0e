"""Horovod's elastic mode with plait: what the torch and the TensorFlow states share.

Horovod's ``hvd.elastic.run`` retries the training function after workers were
added or removed, resetting the library in between. plait adds three things:

* the reset also rebinds plait's world communicator (when it runs on Horovod),
  so optimizers and callbacks made from ``plait.torch`` / ``plait.keras`` keep
  working with the new ranks and sizes;
* plait state objects (:class:`plait.checkpoint.Stateful`, e.g. error-feedback
  memories) are committed, restored and synchronised with the model;
* a host change that the driver announces while the workers are in a reset is
  not lost (:class:`LateHostUpdates`).

The framework states are in :mod:`plait.collectives.horovod_elastic_torch` and
:mod:`plait.collectives.horovod_elastic_tf`; users reach them as
``plait.torch.elastic`` and ``plait.keras.elastic`` / ``plait.tensorflow.elastic``.
Elastic jobs are started by ``horovodrun --host-discovery-script ... --min-np A``
(Gloo). This module imports horovod (only ``collectives/`` may).
"""

from __future__ import annotations

import copy
import os
import queue
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from horovod.common.elastic import run_fn
from horovod.common.exceptions import HorovodInternalError

from plait.checkpoint.state import Stateful, as_stateful
from plait.elastic_relaunch import mismatched, versions
from plait.errors import ConfigError

from .timeline import span

__all__ = ["LateHostUpdates", "PlaitObjects", "check_versions", "elastic_run", "reset"]


class LateHostUpdates:
    """Mixin for Horovod elastic states: host updates announced during a reset survive it.

    Horovod's driver forms a new round from the hosts it knows when the workers are
    ready to reset, then starts new workers, and the reset waits for them. A host that
    discovery adds or removes meanwhile is announced to the coordinator, but Horovod's
    ``on_reset`` empties the announcements when the reset ends, and a worker on a host
    removed from discovery kept training until the job ended. This mixin keeps every
    announcement that arrived after the change that caused the reset was seen (the last
    ``check_host_updates``, or a worker's failure: ``restore()``), so the next
    ``commit()`` acts on it. An announcement the new round already reflects costs one
    more reset without a membership change.
    """

    _host_messages: queue.Queue[tuple[Any, Any]]  # Horovod's State's
    _last_updated_timestamp: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._plait_arrivals: list[tuple[float, Any, Any]] = []  # (monotonic, timestamp, result)
        self._plait_seen = 0.0  # when the change that the next reset answers was seen
        super().__init__(*args, **kwargs)

    def on_hosts_updated(self, timestamp: Any, update_res: Any) -> None:
        """Horovod's notification of a host change (from its notification thread)."""
        self._plait_arrivals = [*self._plait_arrivals, (time.monotonic(), timestamp, update_res)]
        super().on_hosts_updated(timestamp, update_res)  # type: ignore[misc]

    def check_host_updates(self) -> None:
        """Horovod's check on ``commit()``: raises ``HostsUpdatedInterrupt`` on a change."""
        self._plait_seen = time.monotonic()
        super().check_host_updates()  # type: ignore[misc]

    def restore(self) -> None:
        """Roll back to the last commit (after a worker failed)."""
        self._plait_seen = time.monotonic()
        super().restore()  # type: ignore[misc]

    def on_reset(self) -> None:
        """Horovod's reset callbacks, with the announcements that came during the reset kept."""
        late = [(stamp, result) for at, stamp, result in self._plait_arrivals if at >= self._plait_seen]
        self._plait_arrivals = []
        super().on_reset()  # type: ignore[misc]
        for stamp, result in late:
            self._host_messages.put((stamp, result))
        if late:  # Horovod acts only on newer timestamps (whole seconds): same second as the last
            self._last_updated_timestamp = min(self._last_updated_timestamp, min(s for s, _ in late) - 1)


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
