"""Error feedback (DESIGN.md section 2): what compression dropped is added back later.

The order on every step is compensate -> compress -> update -> send:
``c = memory.compensate(g, name)``, ``payload, ctx = compressor.compress(c, name)``,
``memory.update(c, name, compressor, payload, ctx)``. Memories are keyed by the
tensor's name, so one memory serves every gradient of a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

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

    def compensate(self, tensor: Tensor, name: str) -> Tensor:
        """Return ``beta * residual[name] + gamma * tensor`` (just the scaled tensor the first time)."""
        out = tensor if self.gamma == 1.0 else tensor * self.gamma
        held = self.residuals.get(name)
        if held is None:
            return out
        return out + (held if self.beta == 1.0 else held * self.beta)

    def update(
        self, tensor: Tensor, name: str, compressor: Compressor, payload: Sequence[Tensor], ctx: Any
    ) -> None:
        """Store ``tensor - compressor.decompress(payload, ctx)`` for ``name``."""
        own = getattr(compressor, "residual", None)  # a cheaper way to the same difference
        if own is not None:
            self.residuals[name] = own(tensor, payload, ctx)
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
        self.residuals[name] = tensor - decoded

    def reset(self) -> None:
        """Forget every residual (e.g. after loading a checkpoint)."""
        self.residuals.clear()

    def __repr__(self) -> str:
        return f"Residual(beta={self.beta}, gamma={self.gamma})"
