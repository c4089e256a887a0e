"""Horovod's elastic mode (``hvd.elastic.run``) with plait state objects (torch).

:class:`ElasticState` is Horovod's ``TorchState`` (model, optimizer and plain
attributes such as ``step``, committed in memory and restored after a worker
fails, synchronised from rank 0 when workers join) extended with plait state
objects (:class:`plait.checkpoint.Stateful`, e.g. error-feedback memories).
Run the training function under :func:`run` inside
``horovodrun --host-discovery-script ... -np N --min-np A --max-np B``.
This module imports horovod (only ``collectives/`` may).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import horovod.torch as hvd
from horovod.torch.elastic import TorchState

from plait.checkpoint.state import Stateful, as_stateful

__all__ = ["ElasticState", "run"]


class ElasticState(TorchState):  # type: ignore[misc]
    """Horovod elastic state of a torch job plus plait state objects.

    Args:
        model: the torch model.
        optimizer: its optimizer.
        state: plait state objects by name (``state_dict()``/``load_state_dict()``, or
            residual memories); committed, restored and synchronised with the rest.
        **kwargs: plain attributes (``step=0``, ``epoch=0``) as in Horovod's ``TorchState``.
    """

    def __init__(self, model: Any = None, optimizer: Any = None,
                 state: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self._plait: dict[str, Stateful] = {k: as_stateful(v, k) for k, v in (state or {}).items()}
        self._plait_saved: dict[str, Any] = {}
        super().__init__(model=model, optimizer=optimizer, **kwargs)

    def save(self) -> None:
        """Commit: remember everything in memory (Horovod calls this on ``commit()``)."""
        self._plait_saved = {k: copy.deepcopy(dict(s.state_dict())) for k, s in self._plait.items()}
        super().save()

    def restore(self) -> None:
        """Roll back to the last commit (after a worker failed)."""
        for name, saved in self._plait_saved.items():
            self._plait[name].load_state_dict(copy.deepcopy(saved))
        super().restore()

    def sync(self) -> None:
        """Make every worker (new ones too) hold rank 0's state."""
        super().sync()
        for name, obj in self._plait.items():
            obj.load_state_dict(hvd.broadcast_object(dict(obj.state_dict()), root_rank=0,
                                                     name=f"plait.elastic.{name}"))


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``hvd.elastic.run``: retry ``func(state, ...)`` across membership changes.

    Args:
        func: the training function; its first argument is an :class:`ElasticState`.

    Returns:
        The wrapped function.
    """
    wrapped: Callable[..., Any] = hvd.elastic.run(func)
    return wrapped
