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
import os
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from plait.collectives.pool import BufferPool

from plait.errors import invalid
from plait.parallel.data import Bucket, GradientReducer, GradSpec
from plait.protocols import Communicator

from .torch import OPS, pooled_empty
from .torch_adasum import AdasumDelta

__all__ = ["broadcast_optimizer_state", "broadcast_parameters", "distributed_optimizer",
           "initialize_optimizer_state"]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``, in elements."""
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= max(d, 1)
    return tuple(reversed(strides))


class _Distributed:
    """Mixin placed before the user's optimizer class."""

    _plait_reducer: GradientReducer
    _plait_params: dict[str, torch.nn.Parameter]
    _plait_strides: dict[str, tuple[int, ...]]
    _plait_counts: dict[str, int]
    _plait_zeros: dict[str, int]
    _plait_passes: int
    _plait_generation: int
    _plait_skip: bool
    _plait_synchronized: bool
    _plait_predivide: float
    _plait_pool: BufferPool
    _plait_sparse: dict[str, int]
    _plait_sparse_as_dense: bool
    _plait_gathered: dict[str, tuple[int, Any]]
    _plait_apart: dict[str, int]

    @property
    def _parameter_names(self) -> dict[torch.nn.Parameter, str]:
        """Horovod's ``{parameter: name}`` of the parameters this optimizer reduces."""
        return {p: n for n, p in self._plait_params.items()}

    def _plait_hook(self, name: str) -> Any:
        counts, passes, predivide = self._plait_counts, self._plait_passes, self._plait_predivide
        ready, comm = self._plait_reducer.ready, self._plait_reducer.comm
        sparse = self._plait_sparse
        gather = not self._plait_sparse_as_dense and self._plait_reducer.op in ("average", "sum")

        def hook(p: torch.Tensor) -> None:
            generation = getattr(comm, "generation", 0)
            if generation != self._plait_generation:
                # an elastic reset interrupted a step: its gradients are computed again
                self._plait_generation = generation
                counts.update(self._plait_zeros)
            n = counts[name] + 1
            counts[name] = n
            if n == passes:
                grad = p.grad
                if grad is None:
                    return
                if grad.is_sparse and gather:  # allgathered, as Horovod's default
                    self._plait_gather(name, grad)
                    return
                if grad.is_sparse:  # reduced dense, handed back sparse (see synchronize)
                    sparse[name] = grad.sparse_dim()
                    grad = grad.to_dense()
                if predivide != 1.0:
                    grad = grad / predivide
                ready(name, grad)
            elif n > passes:
                raise RuntimeError(
                    f"gradient of {name!r} was computed {n} times before "
                    f"step(); backward_passes_per_step={passes}: call step() (or "
                    "synchronize()) after that many backward passes, or raise it"
                )
        return hook

    def _plait_gather(self, name: str, grad: torch.Tensor) -> None:
        """Start the allgather of a sparse gradient's rows (Horovod's ``sparse_as_dense=False``,
        its default): each rank sends the rows it touched, not the whole dense tensor. The
        first time, the reducer still has a place for it: it reduces zeros there for this
        step, and from the next step on it plans its buckets without it."""
        from .torch_sparse import start_sparse_allreduce

        reducer = self._plait_reducer
        self._plait_gathered[name] = (getattr(reducer.comm, "generation", 0), start_sparse_allreduce(
            reducer.comm, grad, f"grad.sparse.{name}", reducer.op))
        if name not in self._plait_apart:
            reducer.ready(name, torch.zeros_like(self._plait_params[name]))

    def _plait_sparse_grad(self, name: str) -> torch.Tensor:
        """This rank's sparse gradient of ``name``, allgathered apart: ``.grad`` (made sparse
        if it is dense), or no rows when there is none (this rank still takes part)."""
        p, dims = self._plait_params[name], self._plait_apart[name]
        if p.grad is None:
            return torch.sparse_coo_tensor(torch.empty((dims, 0), dtype=torch.int64),
                                           p.new_empty((0,) + tuple(p.shape[dims:])), p.shape)
        return p.grad if p.grad.is_sparse else p.grad.to_sparse(dims)

    def _plait_zero_grad(self, spec: GradSpec) -> torch.Tensor:
        """A zero gradient (what this rank contributes to the others' steps once joined)."""
        return torch.zeros_like(self._plait_params[spec.name])

    def _plait_fuse(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's gradients copied into one flat buffer. On the CPU it comes from a
        pool (no step faults in fresh pages; a buffer something still refers to is not
        reused). A bucket of one gradient is that gradient, in its own shape: it is reduced
        (or cast) out of place, so it needs no copy (a 1 MiB gradient: ~30 us a bucket), nor
        a flat view (~5 us a bucket, in a step)."""
        specs = bucket.specs
        if len(specs) == 1:
            return bucket.grads[specs[0].name]  # type: ignore[no-any-return]
        grads = [bucket.grads[s.name].reshape(-1) for s in specs]
        numel = sum(s.numel for s in specs)
        first = grads[0]
        if first.device.type == "cpu":
            buf = pooled_empty(self._plait_pool, numel, first.dtype)
        else:
            buf = torch.empty(numel, dtype=first.dtype, device=first.device)
        torch.cat(grads, out=buf)
        return buf

    def synchronize(self) -> None:
        """Wait for every gradient's allreduce and write the results into ``.grad``.

        Without compression, or with plait's own compressors and memories, ``.grad``
        becomes a view of the bucket's reduced tensor (no copy) where the dtype and device
        allow it. A sparse gradient (an ``Embedding(sparse=True)``'s) is reduced dense and
        comes back sparse, with as many sparse dimensions, as Horovod's
        ``sparse_as_dense=True`` does: ``torch.optim.SparseAdam`` takes only those. By
        default (``sparse_as_dense=False``) its rows are allgathered instead, as Horovod
        does: ``.grad`` becomes the uncoalesced sum (or average) of every rank's rows.
        """
        params, sparse = self._plait_params, self._plait_sparse
        gathered = self._plait_gathered
        generation = getattr(self._plait_reducer.comm, "generation", 0)
        for name, (started, _) in list(gathered.items()):
            if started != generation:  # an elastic reset interrupted the step: again
                del gathered[name]
        for name in self._plait_apart:
            if name not in gathered:
                self._plait_gather(name, self._plait_sparse_grad(name))

        def missing(spec: GradSpec) -> torch.Tensor:
            p = params[spec.name]
            if p.grad is None:
                return torch.zeros_like(p)
            if p.grad.is_sparse:
                sparse[spec.name] = p.grad.sparse_dim()
                return p.grad.to_dense()
            return p.grad

        scale, strides = self._plait_predivide, self._plait_strides
        fresh = self._plait_reducer.fresh
        # torch.no_grad() only around copies: making views of a result that requires no
        # grad records nothing, and entering it cost ~20 us of a step
        for specs, fused in self._plait_reducer.finish_buckets(missing):
            if isinstance(fused, list):  # one grouped allreduce: the gradients themselves
                for spec, grad in zip(specs, fused):
                    params[spec.name].grad = grad * scale if scale != 1.0 else grad
                continue
            if scale != 1.0:
                fused = fused * scale
            first = params[specs[0].name]
            # a plain allreduce's result, or plait's decompression, is a new tensor (never
            # the fused buffer), and a pooled one is not reused while .grad views it; one
            # bucket, one dtype and device (get_device: an int, -1 on the CPU)
            if (fresh and fused.dtype == first.dtype and fused.get_device() == first.get_device()
                    and fused.is_contiguous()):
                if len(specs) == 1 and fused.shape == specs[0].shape:
                    first.grad = fused  # one gradient, reduced in its own shape (see _plait_fuse)
                    continue
                # each .grad a view at its offset, by one kind of call for every bucket:
                # the first call of each operation in a step costs ~20 us here (README)
                at = fused.storage_offset()
                for spec in specs:
                    params[spec.name].grad = fused.as_strided(spec.shape, strides[spec.name], at)
                    at += spec.numel
                continue
            ps = [params[spec.name] for spec in specs]
            if len(specs) == 1:  # its own shape, or flat
                parts = [fused]
            else:
                parts = list(fused.reshape(-1).split_with_sizes([s.numel for s in specs]))
            with torch.no_grad():
                for p, part, spec in zip(ps, parts, specs):
                    grad = part.reshape(spec.shape)
                    if p.grad is None or p.grad.is_sparse or p.grad.dtype != grad.dtype:
                        p.grad = grad.to(p.dtype).clone()  # a sparse gradient comes back dense
                    else:
                        p.grad.copy_(grad)
        for name, dims in sparse.items():
            p = params[name]
            if p.grad is not None and not p.grad.is_sparse:
                p.grad = p.grad.to_sparse(dims)
        sparse.clear()
        if gathered:
            new: dict[str, int] = {}
            for name, (_, handle) in gathered.items():
                reduced = params[name].grad = handle.wait()
                if name not in self._plait_apart:
                    new[name] = reduced.sparse_dim()
            gathered.clear()
            if new:  # every rank alike: the same parameters have sparse gradients
                self._plait_apart.update(new)
                self._plait_reducer.exclude(new)
        self._plait_counts.update(self._plait_zeros)
        self._plait_synchronized = True  # as in Horovod, not after a failure (an elastic reset)

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
            if self._plait_synchronized:  # Horovod warns here too
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(): step() synchronizes "
                              "again; call it inside optimizer.skip_synchronize()", stacklevel=2)
            self.synchronize()
        self._plait_synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._plait_reducer.pending or self._plait_gathered:
            raise RuntimeError(
                "zero_grad() while gradients are being reduced: call step() or synchronize() "
                "after backward_passes_per_step backward passes, before zero_grad()"
            )
        super().zero_grad(set_to_none)  # type: ignore[misc]


class _Local(_Distributed):
    """The optimizer of a rank outside its process set, as in Horovod: no hooks, no
    collective; ``step()`` applies this rank's own gradients."""

    def synchronize(self) -> None:
        """Nothing to wait for: the gradients stay this rank's own."""
        self._plait_synchronized = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        super(_Distributed, self).zero_grad(set_to_none)  # type: ignore[misc]


def distributed_optimizer(
    optimizer: torch.optim.Optimizer,
    comm: Communicator | None,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    *,
    compression: Any = None,
    memory: Any = None,
    backward_passes_per_step: int = 1,
    op: str = "average",
    bucket_mb: float | None = None,
    gradient_predivide_factor: float = 1.0,
    sparse_as_dense: bool = False,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over ``comm``.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        comm: the data-parallel communicator; None on a rank outside it (Horovod's
            ``process_set=`` a rank is not in): that rank steps on its own gradients.
        named_parameters: ``model.named_parameters()``; names make collectives and
            errors readable (default: ``param.0``, ``param.1``... in group order).
        compression: a compressor (e.g. ``plait.compression.FP16()``), or None.
        memory: its error-feedback memory (e.g. ``plait.compression.Residual()``), or None.
        backward_passes_per_step: backward passes accumulated locally per step.
        op: "average" (default), "sum" or "adasum" (Horovod's Adasum).
        bucket_mb: fusion bucket size in MiB; 0 reduces each gradient alone; None
            (default): tuned in the first steps (``PLAIT_BUCKET_MB`` fixes it, see
            :mod:`plait.parallel.autotune`).
        gradient_predivide_factor: divide gradients by this before the sum and
            multiply after (Horovod's pre/post scaling for large jobs).
        sparse_as_dense: reduce sparse gradients (``Embedding(sparse=True)``'s) dense and
            hand them back sparse; by default (as Horovod) their rows are allgathered,
            with op "average" or "sum" (another op reduces them dense).

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
    base = _Distributed if comm is not None else _Local
    cls: Any = type(type(optimizer).__name__, (base, type(optimizer)), {})
    dist: Any = cls.__new__(cls)
    dist.__dict__.update(optimizer.__dict__)
    dist._plait_skip = False
    dist._plait_synchronized = False  # synchronize() ran since the last step()
    dist._plait_params = dict(named)
    dist._plait_sparse = {}  # names of the gradients that were sparse: their sparse dims
    dist._plait_sparse_as_dense = bool(sparse_as_dense)
    dist._plait_gathered = {}  # sparse gradients allgathered this step: (generation, handle)
    dist._plait_apart = {}  # sparse gradients the reducer no longer holds: their sparse dims
    if comm is None:
        return dist  # type: ignore[no-any-return]
    dist._plait_pool = BufferPool()
    dist._plait_reducer = GradientReducer(comm, specs, op=op, bucket_mb=bucket_mb,
                                          compression=compression, memory=memory, prefix="grad",
                                          fuse=dist._plait_fuse, check_once=True,
                                          zeros=dist._plait_zero_grad, group=True)
    dist._plait_strides = {spec.name: _contiguous_strides(spec.shape) for spec in specs}
    dist._plait_counts = {n: 0 for n, _ in named}
    dist._plait_zeros = dict(dist._plait_counts)
    dist._plait_passes = backward_passes_per_step
    dist._plait_predivide = float(gradient_predivide_factor)
    dist._plait_generation = getattr(comm, "generation", 0)
    if comm.size > 1 or os.environ.get("HOROVOD_ELASTIC") == "1":  # Horovod's condition: a
        # worker alone at first gets hooks too, for when others join
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


def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's state initialisation before a broadcast: an optimizer without state
    takes one local step with zero gradients (no allreduce), so that its state exists.

    Every parameter that requires a gradient is left with a zero ``.grad`` (sparse for
    ``SparseAdam``); weight decay applies in that step, as in Horovod. An optimizer
    that has state is left alone.
    """
    if optimizer.state_dict()["state"]:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()
    if isinstance(optimizer, AdasumDelta):  # Horovod steps its Adasum optimizer's base class
        super(AdasumDelta, optimizer).step()  # type: ignore[misc]
        return
    skip = optimizer.skip_synchronize() if isinstance(optimizer, _Distributed) else None
    with skip if skip is not None else contextlib.nullcontext():
        optimizer.step()
