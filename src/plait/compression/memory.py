"""Error feedback (DESIGN.md section 2): what compression dropped is added back later.

The order on every step is compensate -> compress -> update -> send:
``c = memory.compensate(g, name)``, ``payload, ctx = compressor.compress(c, name)``,
``memory.update(c, name, compressor, payload, ctx)``. Memories are keyed by the
tensor's name, so one memory serves every gradient of a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from plait.adapters import ops_for
from plait.errors import invalid
from plait.protocols import Tensor

from .base import Compressor

__all__ = ["Memory", "NoMemory", "Residual"]


@runtime_checkable
class Memory(Protocol):
    """Per-tensor error-feedback state."""

    def compensate(self, tensor: Tensor, name: str) -> Tensor:
        """Return ``tensor`` with what was held back for ``name`` added in.

        Args:
            tensor: this step's tensor.
            name: its name (the key of the state).

        Returns:
            The tensor to compress.
        """
        ...

    def update(
        self, tensor: Tensor, name: str, compressor: Compressor, payload: Sequence[Tensor], ctx: Any
    ) -> None:
        """Remember what compressing ``tensor`` lost.

        Args:
            tensor: the compensated tensor that was compressed.
            name: its name.
            compressor: the compressor that produced ``payload``.
            payload: what was (or, for an exchanging compressor, what came back) sent.
            ctx: the compressor's context for ``payload``.
        """
        ...


class NoMemory:
    """No error feedback: compensate is the identity, update forgets."""

    def compensate(self, tensor: Tensor, name: str) -> Tensor:
        """Return ``tensor`` unchanged."""
        return tensor

    def update(
        self, tensor: Tensor, name: str, compressor: Compressor, payload: Sequence[Tensor], ctx: Any
    ) -> None:
        """Do nothing."""
        return None

    def __repr__(self) -> str:
        return "NoMemory()"


class Residual:
    """Classic error feedback: keep ``compensated - decompress(compress(compensated))``.

    ``compensate`` returns ``beta * residual + gamma * tensor`` (``beta = gamma = 1``
    is plain error feedback; a ``beta`` below 1 lets old errors decay).

    Args:
        beta: weight of the stored residual, in [0, 1].
        gamma: weight of the new tensor, > 0.

    Raises:
        ConfigError: for weights out of range.
    """

    def __init__(self, beta: float = 1.0, gamma: float = 1.0) -> None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta <= 1:
            raise invalid("beta", beta, "a residual weight in [0, 1]")
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma > 0:
            raise invalid("gamma", gamma, "a positive weight of the new tensor")
        self.beta = float(beta)
        self.gamma = float(gamma)
        self.residuals: dict[str, Tensor] = {}
        #: compensated tensors written into a residual's own memory, by name, until their update
        self._mine: dict[str, Tensor] = {}

    def compensate(self, tensor: Tensor, name: str) -> Tensor:
        """Return ``beta * residual[name] + gamma * tensor`` (just the scaled tensor the first time).

        The sum is written into the residual's own memory where the framework allows it
        (torch, numpy): the residual is then used up, and the following :meth:`update`
        stores the new one in the same memory. No step touches new memory that way.
        """
        held = self.residuals.pop(name, None)
        if held is None:
            return tensor if self.gamma == 1.0 else tensor * self.gamma
        out = ops_for(held).add_into(held, tensor, self.beta, self.gamma)
        self._mine[name] = out
        return out

    def update(
        self, tensor: Tensor, name: str, compressor: Compressor, payload: Sequence[Tensor], ctx: Any
    ) -> None:
        """Store ``tensor - compressor.decompress(payload, ctx)`` for ``name``."""
        own = getattr(compressor, "residual", None)  # a cheaper way to the same difference
        if own is not None:
            self.residuals[name] = own(tensor, payload, ctx, inplace=self._mine.pop(name, None) is tensor)
        else:
            self.update_decoded(tensor, name, compressor.decompress(payload, ctx))

    def update_decoded(self, tensor: Tensor, name: str, decoded: Tensor) -> None:
        """Store ``tensor - decoded`` for ``name``, where ``decoded`` is the decompressed payload
        (:func:`~plait.compression.compressed_allreduce` calls this when it decoded the payload anyway).

        Args:
            tensor: the compensated tensor that was compressed.
            name: its name.
            decoded: what the receivers decode.
        """
        if self._mine.pop(name, None) is tensor:  # our memory: write the difference into it
            self.residuals[name] = ops_for(tensor).add_into(tensor, decoded, 1.0, -1.0)
        else:
            self.residuals[name] = tensor - decoded

    def reset(self) -> None:
        """Forget every residual (e.g. after loading a checkpoint)."""
        self.residuals.clear()
        self._mine.clear()

    def __repr__(self) -> str:
        return f"Residual(beta={self.beta}, gamma={self.gamma})"
