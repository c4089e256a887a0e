"""Keeping the tensors of horovod.torch's ops referenced from C++, so that Horovod's
background thread never needs the GIL to let go of them.

In torch 2.13 a tensor that Python can see holds its Python object alive while C++
also refers to it, and lets go of that object (which takes the GIL) when the C++
references drop back to one (c10's ``intrusive_ptr``: ``decref_pyobject`` when the
count goes from 2 to 1). When Horovod 0.28 shuts down after a failure
(a peer died), its background thread empties the op queue while it holds the queue's
lock: destroying the queue's entries drops the last C++ reference to each pending
tensor and waits for the GIL. A Python thread that starts an op at that moment holds
the GIL and waits for the same lock: the process hangs for good (seen in Horovod's
elastic kill test, ~1 run in 3 under plait, whose backward hooks start ops often;
gdb: ``decref_pyobject`` under ``FinalizeTensorQueue`` against
``AddToTensorQueueMulti``). A view of each tensor, kept here until the op is over,
is one more C++ reference (torch's ``_base``), so Horovod's release is never the
last one and never takes the GIL. A view costs ~0.6 us.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["TorchKeeper"]


def _views(values: Iterable[Any]) -> list[Any]:
    """A view of every torch tensor in ``values`` (nested lists and tuples too)."""
    out: list[Any] = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.extend(_views(v))
        elif hasattr(v, "view_as") and hasattr(v, "_use_count"):
            out.append(v.view_as(v))
    return out


class TorchKeeper:
    """Views of the tensors of horovod.torch's pending ops, by handle.

    Args:
        handle_map: horovod.torch's own ``{handle: (inputs, outputs)}``
            (``horovod.torch.mpi_ops._handle_map``), where the outputs that Horovod
            made itself are found once the op has started.
    """

    def __init__(self, handle_map: dict[int, Any]) -> None:
        self._handle_map = handle_map
        self._kept: dict[int, list[Any]] = {}

    def before(self, args: Iterable[Any]) -> list[Any]:
        """Views of the tensors about to be handed to Horovod (taken before the call:
        the op can be in the queue before the call returns)."""
        return _views(args)

    def started(self, handle: int, views: list[Any]) -> None:
        """Keep ``views`` and views of the op's outputs until :meth:`done` (``handle``)."""
        views.extend(_views(self._handle_map.get(handle, ())))
        self._kept[handle] = views

    def done(self, handles: Iterable[Any]) -> None:
        """The ops of ``handles`` completed without error: Horovod lets go of a
        completed op's tensors outside its locks, where waiting for the GIL is
        harmless. (After an error, keep them until :meth:`clear`: Horovod may be
        emptying its queue.)"""
        for h in handles:
            self._kept.pop(h, None)

    def handles(self) -> list[int]:
        """The handles whose tensors are kept."""
        return list(self._kept)

    def clear(self) -> None:
        """Horovod has shut down (its background thread has ended): let go of all."""
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)
