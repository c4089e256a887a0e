"""The small protocol plait state objects follow to be checkpointed.

An object is checkpointable when it has ``state_dict()`` returning a plain
mapping (string keys; values tensors, numbers, strings, bools, None, or lists and
mappings of those) and ``load_state_dict(mapping)``. Error-feedback memories
(:class:`plait.compression.Residual`, whose state is its ``.residuals``) are
wrapped by :func:`as_stateful`.

A state object whose value differs from rank to rank (an error-feedback memory
holds this rank's residuals) says so with a true ``per_rank`` attribute:
:class:`plait.Checkpoint` then saves every rank's copy (see :func:`is_per_rank`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from plait.errors import PlaitTypeError

__all__ = ["ResidualState", "Stateful", "as_stateful", "is_per_rank"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (plain data and tensors only)."""

    def state_dict(self) -> Mapping[str, Any]:
        """Return the state as a mapping of plain values and tensors."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the state with ``state`` (as returned by :meth:`state_dict`)."""
        ...


class ResidualState:
    """:class:`Stateful` view of an error-feedback memory keeping ``.residuals`` (name -> tensor).

    Args:
        memory: e.g. a :class:`plait.compression.Residual`.
    """

    #: residuals are this rank's own: every rank's copy is checkpointed.
    per_rank = True

    def __init__(self, memory: Any) -> None:
        self.memory = memory

    def state_dict(self) -> dict[str, Any]:
        """Copies of the residuals, keyed by tensor name (the memory updates its tensors
        in place, so a kept state must not share them)."""
        return {"residuals": {k: _snapshot(v) for k, v in self.memory.residuals.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the memory's residuals."""
        self.memory.residuals.clear()
        self.memory.residuals.update(state["residuals"])


def _snapshot(tensor: Any) -> Any:
    """A copy of a mutable tensor (torch, numpy); TensorFlow's tensors are immutable."""
    if isinstance(tensor, np.ndarray):
        return tensor.copy()
    clone = getattr(tensor, "clone", None)
    return clone() if callable(clone) else tensor


def is_per_rank(obj: Any) -> bool:
    """True when ``obj`` (a :class:`Stateful`) holds state that differs per rank.

    Args:
        obj: a state object.

    Returns:
        Its ``per_rank`` attribute, ``False`` when it has none.
    """
    return bool(getattr(obj, "per_rank", False))


def as_stateful(obj: Any, name: str = "state") -> Stateful:
    """Return ``obj`` if it is :class:`Stateful`, a :class:`ResidualState` for a residual memory.

    Args:
        obj: the object to checkpoint.
        name: its key, for the error message.

    Returns:
        A :class:`Stateful`.

    Raises:
        PlaitTypeError: when ``obj`` has neither ``state_dict``/``load_state_dict`` nor ``.residuals``.
    """
    if isinstance(obj, Stateful):
        return obj
    if isinstance(getattr(obj, "residuals", None), dict):
        return ResidualState(obj)
    raise PlaitTypeError(
        f"invalid state[{name!r}]={obj!r}: expected an object with state_dict()/load_state_dict() "
        "or an error-feedback memory with .residuals (plait.compression.Residual)"
    )
