"""PyTorch data parallelism: a distributed ``torch.optim.Optimizer`` and broadcasts.

``distributed_optimizer`` returns an object of a subclass of the user's optimizer
class (so ``isinstance`` checks and LR schedulers keep working) that shares its
state and param groups. Per-parameter post-accumulate hooks hand each gradient
to :class:`~plait.parallel.data.GradientReducer` as backward produces it, so
fused allreduces overlap the rest of backward; ``step()`` waits only for what
is still outstanding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from plait.errors import invalid
from plait.parallel.data import DEFAULT_BUCKET_MB, GradientReducer, GradSpec
from plait.protocols import Communicator

from .torch import OPS

__all__ = ["broadcast_optimizer_state", "broadcast_parameters", "distributed_optimizer"]


class _Distributed:
    """Mixin placed before the user's optimizer class."""

    _plait_reducer: GradientReducer
    _plait_params: dict[str, torch.nn.Parameter]
    _plait_counts: dict[str, int]
    _plait_passes: int
    _plait_skip: bool
    _plait_predivide: float

    def _plait_hook(self, name: str) -> Any:
        def hook(p: torch.Tensor) -> None:
            self._plait_counts[name] += 1
            if self._plait_counts[name] == self._plait_passes and p.grad is not None:
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad  # reduced dense
                if self._plait_predivide != 1.0:
                    grad = grad / self._plait_predivide
                self._plait_reducer.ready(name, grad)
            elif self._plait_counts[name] > self._plait_passes:
                raise RuntimeError(
                    f"gradient of {name!r} was computed {self._plait_counts[name]} times before "
                    f"step(); backward_passes_per_step={self._plait_passes}: call step() (or "
                    "synchronize()) after that many backward passes, or raise it"
                )
        return hook

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce and write the results into ``.grad``."""
        params = self._plait_params

        def missing(spec: GradSpec) -> torch.Tensor:
            p = params[spec.name]
            if p.grad is None:
                return torch.zeros_like(p)
            return p.grad.to_dense() if p.grad.is_sparse else p.grad

        reduced = self._plait_reducer.finish(missing)
        for name, grad in reduced.items():
            p = params[name]
            if self._plait_predivide != 1.0:
                grad = grad * self._plait_predivide
            if p.grad is None or p.grad.is_sparse:  # a sparse gradient comes back dense
                p.grad = grad.to(p.dtype).clone()
            else:
                p.grad.copy_(grad)
        for name in self._plait_counts:
            self._plait_counts[name] = 0

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize (call ``synchronize()`` first)."""
        self._plait_skip = True
        try:
            yield
        finally:
            self._plait_skip = False

    def step(self, closure: Any = None) -> Any:
        if not self._plait_skip:
            self.synchronize()
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._plait_reducer.pending:
            raise RuntimeError(
                "zero_grad() while gradients are being reduced: call step() or synchronize() "
                "after backward_passes_per_step backward passes, before zero_grad()"
            )
        super().zero_grad(set_to_none)  # type: ignore[misc]


def distributed_optimizer(
    optimizer: torch.optim.Optimizer,
    comm: Communicator,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    *,
    compression: Any = None,
    memory: Any = None,
    backward_passes_per_step: int = 1,
    op: str = "average",
    bucket_mb: float = DEFAULT_BUCKET_MB,
    gradient_predivide_factor: float = 1.0,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over ``comm``.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        comm: the data-parallel communicator.
        named_parameters: ``model.named_parameters()``; names make collectives and
            errors readable (default: ``param.0``, ``param.1``... in group order).
        compression: a compressor (e.g. ``plait.compression.FP16()``), or None.
        memory: its error-feedback memory (e.g. ``plait.compression.Residual()``), or None.
        backward_passes_per_step: backward passes accumulated locally per step.
        op: "average" (default), "sum" or "adasum" (Horovod backend).
        bucket_mb: fusion bucket size in MiB; 0 reduces each gradient alone.
        gradient_predivide_factor: divide gradients by this before the sum and
            multiply after (Horovod's pre/post scaling for large jobs).

    Returns:
        An optimizer of a subclass of ``type(optimizer)`` sharing its state.

    Raises:
        ConfigError: for bad arguments, parameters missing from ``named_parameters``
            or duplicate names.
    """
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise invalid("backward_passes_per_step", backward_passes_per_step, "an integer >= 1")
    if not gradient_predivide_factor > 0:
        raise invalid("gradient_predivide_factor", gradient_predivide_factor, "a number > 0")
    if isinstance(optimizer, _Distributed):
        raise invalid("optimizer", type(optimizer).__name__, "an optimizer not already distributed")
    in_groups = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if named_parameters is None:
        named = [(f"param.{i}", p) for i, p in enumerate(in_groups)]
    else:
        by_id = {id(p): n for n, p in named_parameters}
        unnamed = [i for i, p in enumerate(in_groups) if id(p) not in by_id]
        if unnamed:
            raise invalid("named_parameters", f"{len(unnamed)} optimizer parameters without a name",
                          "model.named_parameters() of the model whose parameters the optimizer has")
        named = [(by_id[id(p)], p) for p in in_groups]
    specs = [GradSpec(n, tuple(p.shape), OPS.dtype_name(p)) for n, p in named]
    cls: Any = type(type(optimizer).__name__, (_Distributed, type(optimizer)), {})
    dist: Any = cls.__new__(cls)
    dist.__dict__.update(optimizer.__dict__)
    dist._plait_reducer = GradientReducer(comm, specs, op=op, bucket_mb=bucket_mb,
                                          compression=compression, memory=memory, prefix="grad")
    dist._plait_params = dict(named)
    dist._plait_counts = {n: 0 for n, _ in named}
    dist._plait_passes = backward_passes_per_step
    dist._plait_skip = False
    dist._plait_predivide = float(gradient_predivide_factor)
    if comm.size > 1:
        for n, p in named:
            p.register_post_accumulate_grad_hook(dist._plait_hook(n))
    return dist  # type: ignore[no-any-return]


def broadcast_parameters(params: Any, comm: Communicator, root: int = 0) -> None:
    """Overwrite parameters (a ``state_dict()``, ``named_parameters()`` or list of
    tensors) in place with ``root``'s values, one fused broadcast per dtype."""
    if isinstance(params, dict):
        tensors = [t for _, t in sorted(params.items())]
    else:
        tensors = [t[1] if isinstance(t, tuple) else t for t in params]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            out = comm.broadcast(flat, root=root, name=f"broadcast.params.{dtype}")
            offset = 0
            for t in group:
                t.copy_(out[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, comm: Communicator,
                              root: int = 0) -> None:
    """Make every rank's optimizer state (and hyper-parameters) equal ``root``'s."""
    state = comm.broadcast_object(optimizer.state_dict() if comm.rank == root else None, root)
    if comm.rank != root:
        optimizer.load_state_dict(state)
