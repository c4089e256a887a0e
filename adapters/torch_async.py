"""PyTorch glue of asynchronous data parallelism (``plait.parallel.asyncdp``).

:class:`TorchReplica` shows a torch optimizer's parameters to the framework-free
algorithms as flat float32 numpy vectors; :class:`AsyncOptimizer` wraps the
optimizer so a training loop keeps calling ``step()`` / ``zero_grad()``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from plait.errors import invalid
from plait.parallel.asyncdp.base import AsyncAlgorithm
from plait.parallel.asyncdp.metrics import AsyncMetrics

__all__ = ["AsyncOptimizer", "TorchReplica", "async_optimizer"]


class TorchReplica:
    """The parameters of a torch optimizer (every param group) as one flat vector.

    Args:
        optimizer: the local ``torch.optim.Optimizer``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.numel = int(sum(p.numel() for p in self.params))

    def get_params(self) -> np.ndarray:
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in self.params])
        return flat.numpy().copy()

    def set_params(self, flat: np.ndarray) -> None:
        src = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(src[offset : offset + n].view_as(p).to(p.dtype))
                offset += n

    def get_grads(self) -> np.ndarray:
        parts = [(p.grad.detach().reshape(-1).float().cpu() if p.grad is not None
                  else torch.zeros(p.numel())) for p in self.params]
        return torch.cat(parts).numpy().copy()

    def set_grads(self, flat: np.ndarray) -> None:
        src = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32))
        offset = 0
        for p in self.params:
            n = p.numel()
            g = src[offset : offset + n].view_as(p).to(p.dtype).clone()
            p.grad = g
            offset += n

    def apply(self) -> None:
        self.optimizer.step()


class AsyncOptimizer:
    """A torch optimizer driven by an asynchronous algorithm.

    ``step()`` runs one step of the algorithm on the gradients of the last
    backward pass; other attributes (``zero_grad``, ``param_groups``,
    ``state_dict``...) are the wrapped optimizer's.

    Args:
        optimizer: the local ``torch.optim.Optimizer``.
        algorithm: a set-up-able :class:`~plait.parallel.asyncdp.AsyncAlgorithm`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, algorithm: AsyncAlgorithm) -> None:
        self.optimizer = optimizer
        self.algorithm = algorithm
        self.replica = TorchReplica(optimizer)
        algorithm.setup(self.replica)

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def is_server(self) -> bool:
        """True on parameter-server ranks (call :meth:`serve` there, not :meth:`step`)."""
        return self.algorithm.is_server

    @property
    def async_algorithm(self) -> AsyncAlgorithm:
        """The algorithm (what ``plait.Checkpoint`` saves and restores)."""
        return self.algorithm

    @property
    def metrics(self) -> AsyncMetrics:
        """This rank's metrics."""
        return self.algorithm.metrics

    def step(self, closure: Any = None) -> Any:
        """One step of the algorithm (``closure``, if given, is evaluated first for the loss)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.algorithm.step(self.replica)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def serve(self, checkpoint: Any = None, model: torch.nn.Module | None = None) -> None:
        """Parameter-server ranks: serve until every worker finished.

        Args:
            checkpoint: a ``plait.Checkpoint``: the servers write a consistent snapshot
                whenever the workers reach a multiple of its ``every``.
            model: this rank's model (needed with ``checkpoint``).

        Raises:
            ConfigError: for a checkpoint without the model.
        """
        snapshot = None
        if checkpoint is not None:
            if not isinstance(model, torch.nn.Module):
                raise invalid("model", model, "the torch.nn.Module being trained (with checkpoint=)")
            snapshot = checkpoint.snapshot(model, self)
        self.algorithm.serve(self.replica, snapshot)

    def synchronize(self) -> None:
        """Collective: finish and leave one identical model on every rank."""
        self.algorithm.synchronize(self.replica)

    def gather_metrics(self) -> list[dict[str, Any]]:
        """Collective: every rank's metrics summary."""
        return self.algorithm.gather_metrics()


def async_optimizer(optimizer: Any, algorithm: AsyncAlgorithm) -> AsyncOptimizer:
    """Wrap ``optimizer`` (collective: sets the algorithm up, equalising parameters).

    Raises:
        ConfigError: when ``optimizer`` is not a torch optimizer.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise invalid("optimizer", type(optimizer).__name__, "a torch.optim.Optimizer")
    return AsyncOptimizer(optimizer, algorithm)
