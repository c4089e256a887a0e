"""PowerSGD (Vogels et al. 2019): a rank-``r`` approximation found by one power iteration.

A tensor is viewed as an ``n x m`` matrix ``M`` (first dimension by the rest).
With ``Q`` (``m x r``) shared by all ranks::

    P = allreduce(M Q);  P = orthonormalise(P);  Q = allreduce(M^T P);  result = P Q^T

so two small allreduces replace one of ``n * m`` elements. This is why PowerSGD
is an :class:`~plait.compression.base.Exchanger`: it runs its own collectives.
``Q`` is kept per tensor name and reused as the next step's starting point
(``warm_start``), which makes the single power iteration converge over steps.
Tensors with fewer than two dimensions, or too small to gain (``(n + m) r >=
n m``), are sent uncompressed. Use it with
:class:`~plait.compression.memory.Residual` error feedback, which then keeps
``M - P Q^T`` of the reduced factors, as the paper (and torch DDP's hook) does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.adapters import ops_for
from plait.errors import invalid
from plait.protocols import Communicator, Tensor, TensorOps

from .base import Compressor, Context, Pooled, SeedStream, compute_dtype, nbytes, prepare, restore

__all__ = ["PowerSGD"]


def _left(ops: TensorOps, p: Tensor, mat: Tensor) -> Tensor:
    """``mat^T p`` as ``(p^T mat)^T``: the big matrix is read row by row (10x faster in
    torch on the host than multiplying by its transposed view)."""
    return ops.transpose(ops.matmul(ops.transpose(p), mat))


class PowerSGD(Pooled, Compressor):
    """Low-rank compression by power iteration, with warm-started ``Q`` per tensor.

    Payload: ``[P (n*r), Q (m*r)]`` flattened, or ``[tensor]`` for tensors sent as they are.

    Args:
        rank: rank ``r`` of the approximation, >= 1.
        warm_start: reuse the last ``Q`` of each tensor (else a fresh random one each step).
        seed: seed of the random ``Q``; must be equal on every rank.

    Raises:
        ConfigError: for rank < 1 or a bad seed.
    """

    summable = True

    def __init__(self, rank: int = 1, warm_start: bool = True, seed: int = 0) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise invalid("rank", rank, "an int approximation rank >= 1")
        if seed is None:
            raise invalid("seed", seed, "an int equal on every rank (the random Q must agree)")
        self.rank = rank
        self.warm_start = bool(warm_start)
        self.seed = seed
        self._seeds = SeedStream(seed)
        #: The last Q of each tensor name (the compressor's own memory).
        self.q: dict[str, Tensor] = {}

    # -- helpers ---------------------------------------------------------------------
    def _plan(self, ctx: Context) -> tuple[int, int, int] | None:
        """``(n, m, r)`` when the tensor is worth compressing, else None."""
        if len(ctx.shape) < 2 or ctx.numel == 0:
            return None
        n = ctx.shape[0]
        m = ctx.numel // n
        r = min(self.rank, n, m)
        return (n, m, r) if (n + m) * r < n * m else None

    def _start_q(self, ops: TensorOps, name: str, m: int, r: int, like: Tensor, dtype: str) -> Tensor:
        held = self.q.get(name)
        if self.warm_start and held is not None and ops.owns(held) and ops.shape(held) == (m, r):
            return held
        return ops.cast(ops.uniform([m, r], self._seeds.next(name), like), dtype) - 0.5

    # -- single process ----------------------------------------------------------------
    def compress(self, tensor: Tensor, name: str) -> tuple[list[Tensor], Any]:
        """One local power iteration (what :meth:`exchange` does on a single rank).

        Args:
            tensor: a floating tensor.
            name: its name (keys the warm-start ``Q``).

        Returns:
            ``([P, Q], ctx)``, or ``([tensor], ctx)`` for a tensor sent as it is.

        Raises:
            PlaitTypeError: for a non-floating tensor.
        """
        ops, flat, ctx = prepare(tensor, name, self)
        plan = self._plan(ctx)
        if plan is None:
            return [ops.cast(flat, ctx.dtype)], ctx
        n, m, r = plan
        mat = ops.reshape(flat, [n, m])
        p = ops.qr(ops.matmul(mat, self._start_q(ops, name, m, r, flat, compute_dtype(ctx.dtype))))
        q = _left(ops, p, mat)
        self.q[name] = q
        return [ops.reshape(p, [-1]), ops.reshape(q, [-1])], Context(ctx.shape, ctx.dtype, plan)

    def decompress(self, payload: Sequence[Tensor], ctx: Any) -> Tensor:
        """``P Q^T`` in the original shape and dtype (or the tensor sent as it is)."""
        ops = ops_for(payload[0])
        if ctx.extra is None:
            return restore(ops, payload[0], ctx)
        n, m, r = ctx.extra
        p = ops.reshape(payload[0], [n, r])
        q = ops.reshape(payload[1], [m, r])
        pooled = getattr(ops, "matmul_pooled", None)  # a pooled buffer for torch on the CPU
        dense = (ops.matmul(p, ops.transpose(q)) if pooled is None
                 else pooled(p, ops.transpose(q), self._buffers()))
        return restore(ops, dense, ctx)

    # -- over a communicator -------------------------------------------------------------
    def exchange(
        self, comm: Communicator, tensor: Tensor, name: str, average: bool
    ) -> tuple[list[Tensor], Any, int]:
        """Reduce ``tensor`` over ``comm`` by one distributed power iteration.

        Args:
            comm: the communicator; every rank calls this together.
            tensor: this rank's (error-compensated) tensor.
            name: its name, the same on every rank.
            average: average over ranks (else sum).

        Returns:
            ``(payload, ctx, sent_bytes)`` with the reduced ``[P, Q]`` (or the reduced tensor).

        Raises:
            PlaitTypeError: for a non-floating tensor.
        """
        op = "average" if average else "sum"
        ops, flat, ctx = prepare(tensor, name, self)
        plan = self._plan(ctx)
        if plan is None:
            whole = ops.cast(flat, ctx.dtype)
            return [comm.allreduce(whole, op=op, name=name)], ctx, nbytes(whole)
        n, m, r = plan
        mat = ops.reshape(flat, [n, m])
        p = ops.matmul(mat, self._start_q(ops, name, m, r, flat, compute_dtype(ctx.dtype)))
        p = ops.qr(comm.allreduce(p, op=op, name=f"{name}.P"))
        q = comm.allreduce(_left(ops, p, mat), op=op, name=f"{name}.Q")
        self.q[name] = q
        sent = nbytes(p) + nbytes(q)
        return [ops.reshape(p, [-1]), ops.reshape(q, [-1])], Context(ctx.shape, ctx.dtype, plan), sent

    def reset(self) -> None:
        """Forget every warm-start ``Q``."""
        self.q.clear()
