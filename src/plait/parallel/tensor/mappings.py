"""Conjugate collective pairs for tensor parallelism, written once over a communicator.

Each mapping is a differentiable function whose forward and backward passes are
two different (conjugate) collectives over the tensor-parallel group:

===================  =====================  =====================
mapping              forward                backward
===================  =====================  =====================
copy_to_group        identity               allreduce (sum)
reduce_from_group    allreduce (sum)        identity
scatter_to_group     keep my slice of dim   allgather along dim
gather_from_group    allgather along dim    keep my slice of dim
===================  =====================  =====================

The collectives go through :class:`~plait.protocols.Communicator` and the array
work through :class:`~plait.protocols.TensorOps`; only the autograd glue is per
framework (``collective_function`` of ``plait.adapters.torch`` or
``plait.adapters.tensorflow``). On a group of one every mapping is the identity
and communicates nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from plait.adapters import ops_for
from plait.errors import ConfigError
from plait.protocols import Communicator, Tensor

__all__ = [
    "autograd_for",
    "copy_to_group",
    "gather_along",
    "gather_from_group",
    "reduce_from_group",
    "scatter_to_group",
    "split_along",
]

Glue = Callable[[Callable[[Any], Any], Callable[[Any], Any]], Callable[[Any], Any]]
_GLUE = {"torch": "plait.adapters.torch", "tensorflow": "plait.adapters.tensorflow"}


def autograd_for(framework: str) -> Glue:
    """Return the ``collective_function(forward, backward)`` autograd glue of a framework.

    Args:
        framework: ``"torch"`` or ``"tensorflow"`` (``TensorOps.framework``).

    Returns:
        That adapter's ``collective_function``.

    Raises:
        NotImplementedError: for a framework without autograd (numpy).
    """
    if framework not in _GLUE:
        raise NotImplementedError(
            f"tensor-parallel mappings need autograd; framework {framework!r} has none "
            f"(supported: {sorted(_GLUE)})"
        )
    module: Any = importlib.import_module(_GLUE[framework])
    glue: Glue = module.collective_function
    return glue


def _axis(ndim: int, dim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ConfigError(f"invalid dim={dim}: expected an axis of a {ndim}-d tensor")
    return dim % ndim


def split_along(x: Tensor, comm: Communicator, dim: int = -1) -> Tensor:
    """Return this rank's equal slice of ``x`` along ``dim`` (no communication).

    Args:
        x: a tensor whose ``dim`` is divisible by ``comm.size``.
        comm: the tensor-parallel group.
        dim: the axis to split.

    Returns:
        Slice number ``comm.rank`` of ``comm.size`` equal slices.

    Raises:
        ConfigError: when the axis length is not divisible by the group size.
    """
    if comm.size == 1:
        return x
    ops = ops_for(x)
    shape = ops.shape(x)
    axis = _axis(len(shape), dim)
    if shape[axis] < 0 or shape[axis] % comm.size:
        raise ConfigError(
            f"invalid tensor dim {dim} of length {shape[axis]}: expected a multiple of the "
            f"tensor-parallel group size {comm.size}"
        )
    part = shape[axis] // comm.size
    return ops.split(x, [part] * comm.size, axis=axis)[comm.rank]


def gather_along(x: Tensor, comm: Communicator, dim: int = -1) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (in rank order).

    The communicator gathers along the first axis; for another axis the
    gathered block is cut back into the ranks' pieces and concatenated along
    ``dim``.

    Args:
        x: a tensor of the same shape on every rank.
        comm: the tensor-parallel group.
        dim: the axis to concatenate along.

    Returns:
        The gathered tensor, ``comm.size`` times longer along ``dim``.
    """
    if comm.size == 1:
        return x
    ops = ops_for(x)
    shape = ops.shape(x)
    axis = _axis(len(shape), dim)
    gathered = comm.allgather(x)
    if axis == 0:
        return gathered
    blocks = ops.reshape(gathered, [comm.size, *shape])
    pieces = [ops.reshape(p, list(shape)) for p in ops.split(blocks, [1] * comm.size, axis=0)]
    return ops.concat(pieces, axis=axis)


def _sum(comm: Communicator) -> Callable[[Any], Any]:
    return lambda t: comm.allreduce(t, op="sum")


def _apply(x: Tensor, forward: Callable[[Any], Any], backward: Callable[[Any], Any]) -> Tensor:
    return autograd_for(ops_for(x).framework)(forward, backward)(x)


def _identity(t: Any) -> Any:
    return t


def copy_to_group(x: Tensor, comm: Communicator) -> Tensor:
    """Enter a tensor-parallel region: identity forward, allreduce-sum of the gradient backward.

    Args:
        x: the (replicated) input of column-parallel work.
        comm: the tensor-parallel group.

    Returns:
        ``x``, differentiably.
    """
    if comm.size == 1:
        return x
    return _apply(x, _identity, _sum(comm))


def reduce_from_group(x: Tensor, comm: Communicator) -> Tensor:
    """Leave a tensor-parallel region: allreduce-sum forward, identity backward.

    Args:
        x: this rank's partial sum.
        comm: the tensor-parallel group.

    Returns:
        The sum over the group, differentiably.
    """
    if comm.size == 1:
        return x
    return _apply(x, _sum(comm), _identity)


def scatter_to_group(x: Tensor, comm: Communicator, dim: int = -1) -> Tensor:
    """Keep this rank's slice along ``dim`` forward; allgather the gradient backward.

    Args:
        x: the replicated tensor.
        comm: the tensor-parallel group.
        dim: the axis to split (its length divisible by the group size).

    Returns:
        This rank's slice, differentiably.

    Raises:
        ConfigError: when the axis is not divisible by the group size.
    """
    if comm.size == 1:
        return x
    return _apply(x, lambda t: split_along(t, comm, dim), lambda g: gather_along(g, comm, dim))


def gather_from_group(x: Tensor, comm: Communicator, dim: int = -1) -> Tensor:
    """Allgather along ``dim`` forward; keep this rank's slice of the gradient backward.

    Args:
        x: this rank's slice.
        comm: the tensor-parallel group.
        dim: the axis to concatenate along.

    Returns:
        The concatenation over the group, differentiably.
    """
    if comm.size == 1:
        return x
    return _apply(x, lambda t: gather_along(t, comm, dim), lambda g: split_along(g, comm, dim))
