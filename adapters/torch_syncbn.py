"""Horovod's ``SyncBatchNorm`` for ``plait.torch``: batch normalization whose batch
statistics are those of the global batch (every rank's rows together).

Training forward: each rank computes its row count, per-channel mean and sum of
squared deviations; one allgather combines them (Chan's parallel formula: exact for
unequal counts) into the global mean and biased variance, which normalize the local
rows and update the running statistics (unbiased variance over the global count).
Backward: the per-channel sums of the upstream gradient and of the gradient times the
centred input are summed over the ranks in one allreduce, which gives each rank the
exact gradient of its rows. The weight and bias gradients stay local, as in Horovod
(the data-parallel optimizer averages them). Eval mode with running statistics is
local batch norm. Unlike Horovod 0.28, CPU tensors work (Horovod raises
``ValueError`` for them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's usual alias
from torch.nn.modules.batchnorm import _BatchNorm

from plait._process_sets import communicator
from plait.errors import invalid
from plait.protocols import Communicator

__all__ = ["SyncBatchNorm"]


def _channels(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Per-channel ``t`` shaped to broadcast over ``x`` (N, C, ...)."""
    return t.reshape((1, -1) + (1,) * (x.dim() - 2))


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _SyncBatchNormFunction(torch.autograd.Function):
    """Global-batch normalization with an explicit, collective backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                factor: float, comm: Communicator) -> torch.Tensor:
        dims = [0] + list(range(2, x.dim()))
        xa = x.detach().to(_acc_dtype(x))
        n = xa.numel() // xa.shape[1]
        if n:
            mean = xa.mean(dims)
            m2 = ((xa - _channels(xa, mean)) ** 2).sum(dims)
        else:
            mean = m2 = xa.new_zeros(xa.shape[1])
        row = torch.cat([mean.new_tensor([float(n)]), mean, m2]).to(torch.float64).unsqueeze(0)
        rows = comm.allgather(row, "sync_batch_norm.stats")
        counts, means, m2s = rows[:, 0], rows[:, 1 : 1 + mean.numel()], rows[:, 1 + mean.numel():]
        total = float(counts.sum())
        if total <= 1:
            raise invalid("input", tuple(x.shape), "more than 1 value per channel over all ranks "
                          f"when training (the global batch has {int(total)})")
        g_mean = (counts[:, None] * means).sum(0) / total
        g_m2 = m2s.sum(0) + (counts[:, None] * (means - g_mean) ** 2).sum(0)
        g_var = g_m2 / total
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - factor).add_(g_mean.to(running_mean.dtype), alpha=factor)
            unbiased = g_m2 / (total - 1)
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        mean_c = g_mean.to(xa.dtype)
        invstd = torch.rsqrt(g_var.to(xa.dtype) + eps)
        xmu = xa - _channels(xa, mean_c)
        y = xmu * _channels(xa, invstd)
        if weight is not None:
            y = y * _channels(xa, weight.detach().to(xa.dtype))
        if bias is not None:
            y = y + _channels(xa, bias.detach().to(xa.dtype))
        ctx.save_for_backward(x, weight, mean_c, invstd)
        ctx.comm, ctx.total = comm, total
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean_c, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        dims = [0] + list(range(2, x.dim()))
        xa = x.to(mean_c.dtype)
        g = grad_output.to(mean_c.dtype)
        xmu = xa - _channels(xa, mean_c)
        sum_dy = g.sum(dims)
        sum_dy_xmu = (g * xmu).sum(dims)
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None and need_weight \
            else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None and need_bias else None
        grad_input = None
        if need_input:
            sums = ctx.comm.allreduce(torch.cat([sum_dy, sum_dy_xmu]), "sum", "sync_batch_norm.grads")
            c = sum_dy.numel()
            mean_dy, mean_dy_xmu = sums[:c] / ctx.total, sums[c:] / ctx.total
            scale = invstd if weight is None else invstd * weight.detach().to(invstd.dtype)
            grad_input = ((g - _channels(xa, mean_dy) - xmu * _channels(xa, invstd ** 2 * mean_dy_xmu))
                          * _channels(xa, scale)).to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Horovod's ``hvd.SyncBatchNorm``: batch norm over the global batch of all ranks.

    Same parameters, buffers and ``state_dict`` as ``torch.nn.BatchNorm1d/2d/3d`` (any
    input of at least 2 dimensions, channels second). Every rank of ``process_set``
    must call it in the same mode and order.

    Args:
        num_features: number of channels ``C`` of an ``(N, C, ...)`` input.
        eps: added to the variance for numerical stability.
        momentum: running-statistics factor (None: cumulative average).
        affine: learnable weight and bias.
        track_running_stats: keep running statistics (and use them in eval mode).
        process_set: plait extension: a ``ProcessSet`` (or plait sub-communicator) whose
            ranks share the statistics (default: all ranks).
        device: torch's factory argument.
        dtype: torch's factory argument.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *, process_set: Any = None,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise invalid("input", f"a {input.dim()}-D tensor", "a tensor of at least 2 dimensions "
                          "(N, C, ...)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` with the global batch statistics (training, or no running
        statistics) or the running statistics (eval).

        Args:
            input: an ``(N, C, ...)`` tensor; N may differ between ranks (and be 0).

        Returns:
            The normalized tensor.

        Raises:
            ValueError: for an input of fewer than 2 dimensions, or a global batch of at
                most one value per channel in training.
        """
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise invalid("input", f"shape {tuple(input.shape)}",
                          f"{self.num_features} channels in dimension 1")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        comm = communicator(self.process_set)[0]
        if comm.size == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                True, factor, self.eps)
        update = self.training and self.track_running_stats
        out: torch.Tensor = _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean if update else None,
            self.running_var if update else None, self.eps, factor, comm)
        return out
