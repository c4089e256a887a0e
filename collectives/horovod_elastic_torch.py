"""Horovod's elastic mode for PyTorch with plait (``plait.torch.elastic``).

``import plait.torch as hvd`` scripts use Horovod's spelling unchanged:
``state = hvd.elastic.TorchState(model, optimizer, epoch=0)`` and
``@hvd.elastic.run``. The state also carries plait state objects (``state=``),
and the reset between membership changes rebinds plait's world communicator.
This module imports horovod (only ``collectives/`` may).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from typing import Any

import horovod.torch as hvd
from horovod.torch.elastic import ElasticSampler
from horovod.torch.elastic import TorchState as _HorovodTorchState

from .horovod_elastic import LateHostUpdates, PlaitObjects, check_versions, elastic_run

__all__ = ["ElasticSampler", "TorchState", "run"]


class TorchState(LateHostUpdates, _HorovodTorchState):  # type: ignore[misc]
    """Horovod elastic state of a torch job plus plait state objects.

    Model, optimizer and plain attributes (``epoch=0``, ``batch=0``) are committed
    in memory, restored after a worker fails and synchronised from rank 0 when
    workers join, as in Horovod's ``TorchState``.

    Args:
        model: the torch model.
        optimizer: its optimizer (a plait or Horovod ``DistributedOptimizer`` too).
        state: plait state objects by name (``state_dict()``/``load_state_dict()``, or
            residual memories); committed, restored and synchronised with the rest.
        **kwargs: plain attributes, exposed as attributes of the state.
    """

    def __init__(self, model: Any = None, optimizer: Any = None,
                 state: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self._plait = PlaitObjects(state)
        super().__init__(model=model, optimizer=optimizer, **kwargs)

    def save(self) -> None:
        """Commit: remember everything in memory (Horovod calls this on ``commit()``)."""
        self._plait.save()
        super().save()

    def restore(self) -> None:
        """Roll back to the last commit (after a worker failed).

        Horovod's optimizer handler loads its saved state dict itself, and torch's
        ``load_state_dict`` keeps tensors of the right dtype and device as given: the
        optimizer's buffers would then be the commit's own, and the steps after this
        restore would change the commit (a second restore before the next commit would
        not roll back). Each restore here loads a copy.
        """
        self._plait.restore()
        kept = {name: h._saved_optimizer_state for name, h in self._handlers.items()
                if hasattr(h, "_saved_optimizer_state")}
        for name, saved in kept.items():
            self._handlers[name]._saved_optimizer_state = copy.deepcopy(saved)
        try:
            super().restore()
        finally:
            for name, saved in kept.items():
                self._handlers[name]._saved_optimizer_state = saved

    def sync(self) -> None:
        """Make every worker (new ones too) hold rank 0's state, once every worker was
        found to run the job's versions (see :func:`check_versions`).

        Horovod's optimizer handler gives an optimizer without state (a new worker's; any
        worker's SGD without momentum) one step with zero gradients first, meant to be
        local: with its own optimizer it calls the wrapped class's ``step()``. A plait
        optimizer's ``step()`` would synchronize, a collective that only the workers
        without state reach (the others wait in the broadcast: a hang), so it runs in
        ``skip_synchronize()`` here.
        """
        check_versions(lambda obj: hvd.allgather_object(obj, name="plait.elastic.versions"),
                       int(hvd.rank()))
        with contextlib.ExitStack() as local:
            for handler in self._handlers.values():
                skip = getattr(handler.value, "skip_synchronize", None)
                if callable(skip):
                    local.enter_context(skip())
            super().sync()
        self._plait.sync(lambda obj, name: hvd.broadcast_object(obj, root_rank=0, name=name))


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``hvd.elastic.run``: retry ``func(state, ...)`` across membership changes.

    Args:
        func: the training function; its first argument is a :class:`TorchState`.

    Returns:
        The wrapped function.
    """
    return elastic_run(func, hvd, "torch")
