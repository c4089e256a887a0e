"""Error feedback (DESIGN.md section 2): what compression dropped is added back later.

The order on every step is compensate -> compress -> update -> send:
``c = memory.compensate(g, name)``, ``payload, ctx = compressor.compress(c, name)``,
``memory.update(c, name, compressor, payload, ctx)``. Memories are keyed by the
tensor's name, so one memory serves every gradient of a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

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

        The residual is left as it is (see :meth:`compensate_in_place`)."""
        out = tensor if self.gamma == 1.0 else tensor * self.gamma
        held = self.residuals.get(name)
        if held is None:
            return out
        return out + (held if self.beta == 1.0 else held * self.beta)

    def compensate_in_place(self, tensor: Tensor, name: str) -> Tensor:
        """:meth:`compensate`, the sum written into the residual's own memory where the
        framework allows it (torch, numpy; a residual of ``tensor``'s dtype and shape):
        the residual is then used up, and the following :meth:`update` stores the new
        one in the same memory, so no step touches new memory (a new 40 MiB tensor costs
        ~20 ms of page faults here). :func:`~plait.compression.compressed_allreduce`
        calls this one, right before it compresses and updates.
        """
        held = self.residuals.get(name)
        ops = ops_for(tensor)
        if held is None or (ops_for(held) is not ops or ops.dtype_name(held) != ops.dtype_name(tensor)
                            or ops.shape(held) != ops.shape(tensor)):  # e.g. restored as numpy
            return self.compensate(tensor, name)
        del self.residuals[name]
        out = ops.add_into(held, tensor, self.beta, self.gamma, own=True)
        self._mine[name] = out
        return out

    def update(
        self, tensor: Tensor, name: str, compressor: Compressor, payload: Sequence[Tensor], ctx: Any
    ) -> None:
        """Store ``tensor - compressor.decompress(payload, ctx)`` for ``name``.

        Written into ``tensor`` when it is the memory's own (see :meth:`compensate_in_place`) and the
        payload, which is sent after this update, does not share its memory (a lossless
        compressor may send ``tensor`` itself).
        """
        mine = self._mine.pop(name, None) is tensor and not _shares(tensor, payload)
        own = getattr(compressor, "residual", None)  # a cheaper way to the same difference
        if own is not None:
            self.residuals[name] = own(tensor, payload, ctx, inplace=mine)
        else:
            self._difference(tensor, name, compressor.decompress(payload, ctx), mine)

    def update_decoded(self, tensor: Tensor, name: str, decoded: Tensor) -> None:
        """Store ``tensor - decoded`` for ``name``, where ``decoded`` is the decompressed payload
        (:func:`~plait.compression.compressed_allreduce` calls this when it decoded the payload anyway,
        after the exchange).

        Args:
            tensor: the compensated tensor that was compressed.
            name: its name.
            decoded: what the receivers decode.
        """
        self._difference(tensor, name, decoded, self._mine.pop(name, None) is tensor)

    def _difference(self, tensor: Tensor, name: str, decoded: Tensor, mine: bool) -> None:
        """Store ``tensor - decoded``: into ``tensor`` when it is ``mine`` and ``decoded``
        (returned to the caller, or about to be) is not a view of it."""
        if mine and not _shares(tensor, [decoded]):
            self.residuals[name] = ops_for(tensor).add_into(tensor, decoded, 1.0, -1.0, own=True)
        else:
            self.residuals[name] = tensor - decoded

    def reset(self) -> None:
        """Forget every residual (e.g. after loading a checkpoint)."""
        self.residuals.clear()
        self._mine.clear()

    def __repr__(self) -> str:
        return f"Residual(beta={self.beta}, gamma={self.gamma})"


def _shares(tensor: Tensor, others: Sequence[Tensor]) -> bool:
    """Whether any of ``others`` may share ``tensor``'s memory (torch: the same storage;
    numpy: overlapping buffers; anything else cannot be written in place anyway)."""
    storage = getattr(tensor, "untyped_storage", None)
    if callable(storage):
        ptr = storage().data_ptr()
        return any(callable(getattr(o, "untyped_storage", None)) and o.untyped_storage().data_ptr() == ptr
                   for o in others)
    if isinstance(tensor, np.ndarray):
        return any(isinstance(o, np.ndarray) and np.may_share_memory(tensor, o) for o in others)
    return False
