"""Horovod's elastic torch API on the MPI backend (``plait.torch.elastic`` there).

``hvd.elastic.TorchState(model, optimizer, epoch=0)`` and ``@hvd.elastic.run`` as in
Horovod; membership changes are relaunches by ``plait run --elastic`` (see
:mod:`plait.elastic_relaunch`). Commits are in memory and, for a relaunch, on disk.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from plait.elastic_relaunch import HostsUpdatedInterrupt, ObjectState, State, run

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]


class TorchState(State):
    """A torch model, its optimizer and plain attributes, committed together.

    Args:
        model: a ``torch.nn.Module`` (or None).
        optimizer: a ``torch.optim.Optimizer``, plait's ``DistributedOptimizer`` too (or None).
        **kwargs: plain attributes (``epoch=0``, ``batch=0``), exposed as attributes, and
            ``state=``: plait state objects by name (see :class:`~plait.elastic_relaunch.State`).
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None,
                 **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        super().__init__(**kwargs)

    def snapshot(self) -> dict[str, Any]:
        """Model and optimizer state dicts (copied to the host) and the attributes."""
        snap = super().snapshot()
        if self.model is not None:
            snap["model"] = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        if self.optimizer is not None:
            snap["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        return snap

    def load_snapshot(self, snap: dict[str, Any]) -> None:
        """Load model and optimizer state and the attributes from a snapshot."""
        super().load_snapshot(snap)
        if self.model is not None and "model" in snap:
            self.model.load_state_dict(snap["model"])
        if self.optimizer is not None and "optimizer" in snap:
            self.optimizer.load_state_dict(snap["optimizer"])
