"""The one thing an algorithm needs from a framework: a model replica as flat numpy vectors.

The framework glue (``plait.adapters.torch_async``, ``plait.adapters.tf_async``)
implements :class:`Replica` over a torch optimizer's parameters or a Keras
optimizer's variables; the algorithms in this package only see float32 numpy
vectors, so each is written once for both frameworks and both backends.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Replica"]


class Replica(Protocol):
    """A model replica and its local optimizer, seen as flat float32 vectors."""

    #: number of scalar parameters.
    numel: int

    def get_params(self) -> Any:
        """A flat float32 numpy copy of the parameters."""
        ...

    def set_params(self, flat: Any) -> None:
        """Overwrite the parameters from a flat float32 numpy vector."""
        ...

    def get_grads(self) -> Any:
        """A flat float32 numpy copy of the current gradients (zeros where there is none)."""
        ...

    def set_grads(self, flat: Any) -> None:
        """Replace the current gradients by a flat float32 numpy vector."""
        ...

    def apply(self) -> None:
        """Step the local (wrapped) optimizer with the current gradients."""
        ...
