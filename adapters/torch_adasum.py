"""Horovod's Adasum optimizer for PyTorch: each rank steps locally, the ranks combine the deltas.

With ``op=Adasum`` (and more than one rank) Horovod's ``DistributedOptimizer`` does not
reduce gradients: as each parameter's gradient is ready, it runs the wrapped optimizer's
step on that parameter alone, on this rank's own gradient, and combines the resulting
*change* of the parameter (its delta) across ranks with Adasum; ``step()`` then sets each
parameter to where it started plus the combined delta. Momentum, weight decay and
Adam's moments therefore see each rank's own gradients (they stay per rank), which is
what Adasum's scaling assumes. :func:`adasum_optimizer` does the same over a plait
communicator (plait's own Adasum on the MPI backend, Horovod's on the Horovod backend).

The deltas start inside backward in the order the gradients become ready, which is the
same on every rank for the same model; parameters without a gradient hook that fired are
started in ``step()`` in parameter order, so the collectives come in one order everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from plait.errors import invalid
from plait.protocols import Communicator

__all__ = ["AdasumDelta", "adasum_optimizer"]


class AdasumDelta:
    """Mixin placed before the user's optimizer class (Horovod's ``_DistributedAdasumOptimizer``)."""

    _plait_comm: Communicator
    _plait_named: list[tuple[str, torch.nn.Parameter]]
    _plait_names: dict[int, str]
    _plait_start: dict[int, torch.Tensor]
    _plait_delay: dict[int, int]
    _plait_passes: int
    _plait_handles: dict[int, tuple[Any, Any]]
    _plait_compression: Any

    def _plait_hook(self, p: torch.nn.Parameter) -> Any:
        def hook(_: torch.Tensor) -> None:
            key = id(p)
            if self._plait_delay[key] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")
            self._plait_delay[key] -= 1
            started = self._plait_delta(p) if self._plait_delay[key] == 0 else (None, None)
            self._plait_handles[key] = started
        return hook

    def _plait_delta(self, p: torch.nn.Parameter) -> tuple[Any, Any]:
        """Step the wrapped optimizer on ``p`` alone, turn ``p`` into its delta and start
        the delta's Adasum allreduce. Returns ``(handle, compression context)``."""
        start = self._plait_start[id(p)]
        groups = self.param_groups  # type: ignore[attr-defined]
        stashed = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [p] if any(p is q for q in g["params"]) else []
            with torch.no_grad():
                start.copy_(p)
                super().step()  # type: ignore[misc]
                p.sub_(start)
        finally:
            for g, params in zip(groups, stashed):
                g["params"] = params
        name = f"delta.{self._plait_names[id(p)]}"
        payload, ctx = p.detach(), None
        if self._plait_compression is not None:
            parts, ctx = self._plait_compression.compress(payload, name)
            payload = parts[0]
        return self._plait_comm.allreduce_async(payload, op="adasum", name=name), ctx

    def synchronize(self) -> None:
        """Nothing to do: the deltas are combined in ``step()`` (as in Horovod)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Refused, as in Horovod.

        Raises:
            AssertionError: always (Horovod's error).
        """
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover - a generator for contextmanager

    def step(self, closure: Any = None) -> Any:
        """Start the deltas not started yet, then set each parameter to its start plus the
        combined delta.

        Args:
            closure: re-evaluates the model and returns the loss (called first).

        Returns:
            The closure's loss, or None.
        """
        loss = closure() if closure is not None else None
        handles = self._plait_handles
        for _, p in self._plait_named:  # no hook fired: parameter order, the same on every rank
            if id(p) not in handles:
                handles[id(p)] = self._plait_delta(p)
        params = {id(p): p for _, p in self._plait_named}
        for key, (handle, ctx) in list(handles.items()):
            if handle is None:  # step() before backward_passes_per_step passes
                handle, ctx = self._plait_delta(params[key])
            delta = handle.wait()
            if ctx is not None:
                delta = self._plait_compression.decompress([delta], ctx)
            start = self._plait_start[key]
            with torch.no_grad():
                start.add_(delta.to(start.dtype).view_as(start))
                params[key].copy_(start)
            self._plait_delay[key] = self._plait_passes
        handles.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (torch's ``zero_grad``).

        Raises:
            AssertionError: deltas started by backward are still waiting for ``step()``
                (Horovod's error).
        """
        if self._plait_handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as "
                                 "it can cause a race condition.")
        super().zero_grad(set_to_none)  # type: ignore[misc]


def adasum_optimizer(optimizer: torch.optim.Optimizer, comm: Communicator,
                     named: Sequence[tuple[str, torch.nn.Parameter]], *, compression: Any = None,
                     backward_passes_per_step: int = 1) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` as Horovod's Adasum ``DistributedOptimizer`` does.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        comm: the communicator whose ranks combine their deltas (more than one rank).
        named: ``(name, parameter)`` of every parameter of the optimizer that requires a
            gradient, in the optimizer's order.
        compression: a compressor applied to each delta whose payload is one tensor that
            Adasum may combine (a Horovod-style one, or plait's fp16/bf16 casts), or None.
        backward_passes_per_step: backward passes whose gradients accumulate in ``.grad``
            before the local step.

    Returns:
        An optimizer of a subclass of ``type(optimizer)`` sharing its state and param groups.

    Raises:
        ConfigError: ``backward_passes_per_step`` is not an integer >= 1.
    """
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise invalid("backward_passes_per_step", backward_passes_per_step, "an integer >= 1")
    cls: Any = type(type(optimizer).__name__, (AdasumDelta, type(optimizer)), {})
    dist: Any = cls.__new__(cls)
    dist.__dict__.update(optimizer.__dict__)
    dist._plait_comm = comm
    dist._plait_named = list(named)
    dist._plait_names = {id(p): n for n, p in named}
    dist._plait_start = {id(p): torch.zeros_like(p, requires_grad=False) for _, p in named}
    dist._plait_passes = backward_passes_per_step
    dist._plait_delay = {id(p): backward_passes_per_step for _, p in named}
    dist._plait_handles = {}
    dist._plait_compression = compression
    for _, p in named:
        p.grad = torch.zeros_like(p)  # as Horovod's: every gradient starts at zero
        p.register_post_accumulate_grad_hook(dist._plait_hook(p))
    return dist  # type: ignore[no-any-return]
