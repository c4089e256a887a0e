"""The contracts between plait's layers, each declared once (DESIGN.md section 2).

* :class:`Handle` -- an operation in flight.
* :class:`Communicator` -- collectives and point-to-point over one group of ranks,
  implemented by ``plait.collectives.mpi`` and ``plait.collectives.horovod``.
* :class:`TensorOps` -- one framework's bridge to host buffers, implemented by
  ``plait.adapters.numpy``, ``plait.adapters.torch`` and ``plait.adapters.tensorflow``.

``Tensor`` is deliberately ``Any``: a numpy array, a ``torch.Tensor`` or a
``tf.Tensor``/``tf.Variable``; the adapter that owns it is found at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["REDUCE_OPS", "Communicator", "Handle", "Tensor", "TensorOps"]

Tensor = Any

#: Reduction names every backend accepts ("adasum" only where the backend has it).
REDUCE_OPS = ("sum", "average", "min", "max", "product")


@runtime_checkable
class Handle(Protocol):
    """An asynchronous operation; ``wait()`` returns its result."""

    def wait(self) -> Any:
        """Block until the operation finished and return its result."""
        ...

    def done(self) -> bool:
        """Return True when ``wait()`` would not block."""
        ...


@runtime_checkable
class Communicator(Protocol):
    """Collectives over a fixed group of ranks.

    Every operation takes tensors of any supported framework and returns a new
    tensor of the same framework, dtype and device. ``op`` is one of
    :data:`REDUCE_OPS`; ``name`` identifies the call across ranks (it appears in
    mismatch errors and in the timeline).
    """

    backend: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def allreduce_async(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Handle: ...
    def allreduce(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Tensor: ...
    def grouped_allreduce(
        self, tensors: Sequence[Tensor], op: str = "average", name: str | None = None
    ) -> list[Tensor]: ...
    def allgather_async(self, tensor: Tensor, name: str | None = None) -> Handle: ...
    def allgather(self, tensor: Tensor, name: str | None = None) -> Tensor: ...
    def broadcast_async(self, tensor: Tensor, root: int = 0, name: str | None = None) -> Handle: ...
    def broadcast(self, tensor: Tensor, root: int = 0, name: str | None = None) -> Tensor: ...
    def alltoall(
        self, tensor: Tensor, splits: Sequence[int] | None = None, name: str | None = None
    ) -> tuple[Tensor, list[int]]: ...
    def reducescatter(self, tensor: Tensor, op: str = "average", name: str | None = None) -> Tensor: ...
    def barrier(self) -> None: ...
    def join(self, device: int = -1) -> int: ...
    def send(self, tensor: Tensor, dest: int, tag: int = 0) -> None: ...
    def recv(self, like: Tensor, source: int, tag: int = 0) -> Tensor: ...
    def split(self, color: int, key: int = 0) -> Communicator: ...
    def broadcast_object(self, obj: Any, root: int = 0) -> Any: ...
    def allgather_object(self, obj: Any) -> list[Any]: ...


@runtime_checkable
class TensorOps(Protocol):
    """One framework's tensors seen from plait: host buffers, dtypes and math.

    The bridge methods move data to and from numpy without copying where the
    framework allows it. The math methods are the few array operations that
    compressors and parallel layers need, so those are written once.
    """

    framework: str

    # -- bridge -------------------------------------------------------------
    def owns(self, x: Any) -> bool: ...
    def dtype_name(self, x: Tensor) -> str: ...
    def shape(self, x: Tensor) -> tuple[int, ...]: ...
    def is_symbolic(self, x: Tensor) -> bool: ...
    def to_numpy(self, x: Tensor) -> Any: ...
    def from_numpy(self, a: Any, like: Tensor) -> Tensor: ...
    def host_call(
        self, fn: Callable[..., Any], inputs: Sequence[Tensor], like: Tensor, same_shape: bool = True
    ) -> Tensor:
        """Run ``fn`` on numpy values of ``inputs`` (inside a graph: as a host op)."""
        ...

    # -- math ---------------------------------------------------------------
    def cast(self, x: Tensor, dtype: str) -> Tensor: ...
    def reshape(self, x: Tensor, shape: Sequence[int]) -> Tensor: ...
    def zeros(self, shape: Sequence[int], dtype: str, like: Tensor) -> Tensor: ...
    def abs(self, x: Tensor) -> Tensor: ...
    def sign(self, x: Tensor) -> Tensor: ...
    def norm(self, x: Tensor) -> Tensor: ...
    def topk(self, x: Tensor, k: int, magnitude: bool = False) -> tuple[Tensor, Tensor]:
        """The ``k`` largest elements of flattened ``x`` and their int64 positions, in no
        particular order; with ``magnitude``, the ``k`` of largest ``|x|`` (the values
        are ``x``'s own), without a full-size ``|x|`` where the framework can avoid it."""
        ...

    def gather(self, x: Tensor, indices: Tensor) -> Tensor: ...
    def scatter(self, indices: Tensor, values: Tensor, size: int) -> Tensor: ...
    def zero_at(self, x: Tensor, indices: Tensor, inplace: bool = False) -> Tensor:
        """``x`` flattened, with the elements at ``indices`` (int64) set to zero: a copy,
        or with ``inplace`` written into ``x`` where the framework's tensors are mutable
        (torch, numpy; a contiguous ``x``) or where the caller made ``x`` itself and
        nobody else sees it (an eager TensorFlow host tensor)."""
        ...

    def add_into(self, acc: Tensor, x: Tensor, a: float = 1.0, b: float = 1.0,
                 own: bool = False) -> Tensor:
        """``a * acc + b * x``, written into ``acc`` where the framework's tensors are
        mutable (torch, numpy), so no new memory is touched (a new 40 MiB tensor costs
        ~20 ms of page faults here). TensorFlow returns a new tensor, or with ``own`` (the
        caller made ``acc`` itself and nobody else sees it) writes into an eager host
        ``acc`` of float32/float64 that shares no memory with ``x``."""
        ...

    def matmul(self, a: Tensor, b: Tensor) -> Tensor: ...
    def qr(self, x: Tensor) -> Tensor: ...
    def concat(self, xs: Sequence[Tensor], axis: int = 0) -> Tensor: ...
    def split(self, x: Tensor, sizes: Sequence[int], axis: int = 0) -> list[Tensor]: ...

    # -- math for compressors (plait.compression) -----------------------------
    def uniform(self, shape: Sequence[int], seed: int, like: Tensor) -> Tensor:
        """float32 values uniform in [0, 1): a fixed function of ``seed``, on ``like``'s device."""
        ...

    def random_round(self, x: Tensor, scale: Any, seed: int, code: str) -> Tensor:
        """Stochastic quantisation codes of flat ``x`` as ``code`` integers:
        ``sign(x) * floor(|x| * scale + u)``, ``u`` uniform in [0, 1) and a fixed function
        of ``seed`` (``scale``: a number or 1-element tensor; computed in ``x``'s dtype).
        On the host it runs in chunks, so no full-size temporary is touched."""
        ...

    def floor(self, x: Tensor) -> Tensor: ...
    def sum(self, x: Tensor) -> Tensor:
        """Sum of all elements, as a 0-d tensor."""
        ...

    def amax(self, x: Tensor) -> Tensor:
        """Largest element, as a 0-d tensor."""
        ...

    def clamp_min(self, x: Tensor, value: float) -> Tensor: ...
    def transpose(self, x: Tensor) -> Tensor:
        """Transpose of a 2-d tensor."""
        ...

    def nonzero(self, x: Tensor) -> Tensor:
        """int64 positions of the true (non-zero) elements of flattened ``x``."""
        ...

    def packbits(self, bits: Tensor) -> Tensor:
        """Pack a flat bool tensor into uint8, 8 per byte, first element in the top bit."""
        ...

    def unpackbits(self, packed: Tensor, count: int) -> Tensor:
        """Inverse of :meth:`packbits`: the first ``count`` bits as a flat bool tensor."""
        ...

    def decode_bits(self, packed: Tensor, count: int, one: Any, zero: Any, dtype: str) -> Tensor:
        """The first ``count`` bits of ``packed`` (see :meth:`packbits`) as a flat
        ``dtype`` tensor: ``one`` where a bit is set, ``zero`` elsewhere (numbers or
        1-element tensors), in one pass through a 256-row table."""
        ...
