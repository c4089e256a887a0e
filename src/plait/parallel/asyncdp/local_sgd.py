"""Local SGD (periodic model averaging), with an optional synchronous warm-up (post-local SGD)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from plait.compression import compressed_allreduce
from plait.errors import invalid
from plait.protocols import Communicator

from .base import AsyncAlgorithm, load_memory, memory_state
from .replica import Replica

__all__ = ["LocalSGD"]


class LocalSGD(AsyncAlgorithm):
    """Each rank steps on its own gradients; parameters are averaged every ``period`` steps.

    For the first ``warmup_steps`` steps gradients are averaged every step
    (synchronous training; post-local SGD). With ``period=1`` and plain SGD this is
    synchronous training. With a compressor, what is averaged is the change of the
    parameters since the last average (compressed, with error feedback if a memory
    is given), so sparsifiers and quantizers stay meaningful.

    Args:
        comm: the data-parallel communicator.
        period: steps between averages (H >= 1).
        warmup_steps: synchronous steps first (>= 0).
        compression: a compressor from ``plait.compression`` or None.
        memory: its error-feedback memory or None.

    Raises:
        ConfigError: for a bad period or warm-up.
    """

    name = "local_sgd"

    def __init__(self, comm: Communicator, period: int = 4, warmup_steps: int = 0,
                 compression: Any = None, memory: Any = None) -> None:
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise invalid("period", period, "an int >= 1 (steps between parameter averages)")
        if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 0:
            raise invalid("warmup_steps", warmup_steps, "an int >= 0")
        super().__init__(comm)
        self.period, self.warmup = period, warmup_steps
        self.compression, self.memory = compression, memory
        self._anchor: np.ndarray | None = None
        self._since = 0

    def _start(self, replica: Replica) -> None:
        self._anchor = replica.get_params()

    def step(self, replica: Replica) -> None:
        """Local step; average every ``period`` steps (every step during warm-up)."""
        t = self.metrics.steps
        if t < self.warmup:
            with self.metrics.waiting():
                g = self.comm.allreduce(replica.get_grads(), "average", name="asyncdp.local_sgd.warmup")
            replica.set_grads(np.asarray(g, dtype=np.float32))
            replica.apply()
            self.metrics.messages += 1
            self.metrics.steps += 1
            self._anchor = replica.get_params()
            return
        replica.apply()
        self.metrics.steps += 1
        self._since += 1
        if self._since >= self.period:
            self._average_now(replica)

    def _average_now(self, replica: Replica) -> None:
        params = replica.get_params()
        with self.metrics.waiting():
            if self.compression is None and self.memory is None:
                avg = np.asarray(self.comm.allreduce(params, "average", name="asyncdp.local_sgd"),
                                 dtype=np.float32)
            else:
                anchor = params if self._anchor is None else self._anchor
                delta = compressed_allreduce(self.comm, params - anchor, "asyncdp.local_sgd.delta",
                                             self.compression, self.memory, True)
                avg = anchor + np.asarray(delta, dtype=np.float32)
        replica.set_params(avg)
        self._anchor = avg
        self.metrics.staleness.append(self._since - 1)
        self.metrics.messages += 1
        self._since = 0

    def _finish(self, replica: Replica) -> None:
        self._since = 0

    def _state(self) -> dict[str, Any]:
        """Steps since the last average, the last average (the same on every rank) and this
        rank's error-feedback residuals."""
        return {"since": self._since, "anchor": self._anchor, "memory": memory_state(self.memory)}

    def _load(self, state: Mapping[str, Any], own: bool) -> None:
        super()._load(state, own)
        self._since = int(state["since"])
        if state.get("anchor") is not None:
            self._anchor = np.asarray(state["anchor"], dtype=np.float32).copy()
        load_memory(self.memory, state.get("memory"), own)

    def describe(self) -> dict[str, Any]:
        return {"algorithm": self.name, "period": self.period, "warmup_steps": self.warmup,
                "compression": repr(self.compression) if self.compression is not None else None}
