"""Horovod's ``sparse_allreduce_async`` for ``plait.torch``: a sparse COO tensor is
reduced by allgathering its indices and values (ragged: each rank its own number of
non-zeros), so the result is an uncoalesced sparse tensor whose dense form is the sum
(or average) of every rank's tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from plait._face import _claim, _named, scale
from plait._process_sets import communicator
from plait.errors import MismatchError, PlaitTypeError, invalid
from plait.protocols import Communicator, Handle

__all__ = ["SparseHandle", "sparse_allreduce_async", "start_sparse_allreduce"]

_OPS = ("average", "sum")


class SparseHandle:
    """The pending result of :func:`sparse_allreduce_async`.

    ``hvd.synchronize(handle)``, ``handle.wait()`` and, as Horovod returns a function,
    ``handle()`` all give the reduced sparse tensor (waiting again returns it again).
    """

    def __init__(self, like: torch.Tensor, sizes: Handle, indices: Handle, values: Handle,
                 divisor: int) -> None:
        self._like, self._sizes, self._indices, self._values = like, sizes, indices, values
        self._divisor = divisor
        self._result: torch.Tensor | None = None

    def done(self) -> bool:
        """Whether :meth:`wait` would return at once."""
        return self._result is not None or all(h.done() for h in (self._sizes, self._indices,
                                                                  self._values))

    def wait(self) -> torch.Tensor:
        """Wait for the allgathers and build the reduced sparse tensor.

        Returns:
            A sparse COO tensor of the input's size (uncoalesced, as Horovod's).

        Raises:
            MismatchError: on every rank, when the ranks' tensors differ in size.
        """
        if self._result is None:
            sizes = self._sizes.wait()
            values = self._values.wait()
            indices = self._indices.wait()
            if not bool((sizes == sizes[:1]).all()):
                raise MismatchError("sparse_allreduce_async: the ranks' sparse tensors differ in "
                                    f"size: {[tuple(r) for r in sizes.tolist()]} (rank order)")
            if self._divisor != 1:
                values = scale(values, 1.0 / self._divisor)
            # checked: a rank whose tensor is larger would give out-of-range indices
            self._result = torch.sparse_coo_tensor(indices.t(), values, self._like.size(),
                                                   dtype=self._like.dtype, check_invariants=True)
        return self._result

    __call__ = wait


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: str = "average",
                           process_set: Any = None) -> SparseHandle:
    """Start Horovod's sparse allreduce of a sparse COO tensor.

    Args:
        tensor: a ``torch.sparse_coo`` tensor of the same size and dtype on every rank
            (coalesced or not; its number of non-zeros may differ between ranks).
        name: Horovod's name; the allgathers are ``{name}.indices`` / ``{name}.values``.
        op: ``Average`` (values divided by the group size; integers truncated toward
            zero, as plait scales integers) or ``Sum``.
        process_set: a ``ProcessSet`` (or plait sub-communicator); default all ranks.

    Returns:
        A :class:`SparseHandle`.

    Raises:
        TypeError: when ``tensor`` is not a sparse COO tensor.
        ValueError: for another ``op`` (Horovod's allgather would silently sum), or a
            ``name`` still in flight.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise PlaitTypeError(f"invalid tensor={type(tensor).__name__}"
                             f"{'' if not isinstance(tensor, torch.Tensor) else f' ({tensor.layout})'}"
                             ": expected a sparse COO torch tensor (tensor.to_sparse())")
    if op not in _OPS:
        raise invalid("op", op, "Average or Sum (a sparse tensor is reduced by allgather)")
    _claim(name, "sparse_allreduce")
    handle = start_sparse_allreduce(communicator(process_set)[0], tensor, name, op)
    handle._indices = _named(handle._indices, name, "sparse_allreduce")
    return handle


def start_sparse_allreduce(comm: Communicator, tensor: torch.Tensor, name: str | None,
                           op: str) -> SparseHandle:
    """Start the three allgathers of a sparse COO ``tensor`` (its size, values and
    indices) on ``comm``; no argument checks (:func:`sparse_allreduce_async` makes them).

    Args:
        comm: the communicator.
        tensor: a sparse COO tensor.
        name: the allgathers' name prefix, or None.
        op: "average" or "sum".

    Returns:
        A :class:`SparseHandle`.
    """
    indices = tensor._indices().t().contiguous()
    values = tensor._values().contiguous()
    shape = torch.tensor([list(tensor.shape)], dtype=torch.int64)
    sizes_handle = comm.allgather_async(shape, None if name is None else f"{name}.size")
    values_handle = comm.allgather_async(values, None if name is None else f"{name}.values")
    indices_handle = comm.allgather_async(indices, None if name is None else f"{name}.indices")
    return SparseHandle(tensor, sizes_handle, indices_handle, values_handle,
                        comm.size if op == "average" else 1)
