"""Tensor-parallel PyTorch layers (Megatron style) and the torch side of ``TensorParallel`` plans.

Every layer holds this rank's slice of a dense layer's weights: the dense
weights are made identical on all ranks of the group (broadcast from rank 0),
then sliced, so a sharded model computes what the dense one computes. The
communication is :mod:`plait.parallel.tensor.mappings` (conjugate collective
pairs with autograd).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import ConfigError, PlaitTypeError, invalid
from plait.parallel.tensor.mappings import (
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    scatter_to_group,
)
from plait.parallel.tensor.sequence import heads_to_seq, seq_to_heads
from plait.protocols import Communicator

__all__ = [
    "ChannelParallelConv2d",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "apply_plan",
    "owns_model",
    "ulysses_attention",
    "vocab_parallel_cross_entropy",
]


def _part(total: int, comm: Communicator, what: str, layer: str) -> int:
    if total % comm.size:
        raise ConfigError(
            f"layer {layer or '<unnamed>'}: {what}={total} is not divisible by the tensor-parallel "
            f"group size {comm.size}; expected a multiple of {comm.size}"
        )
    return total // comm.size


def _from_rank0(t: torch.Tensor | None, comm: Communicator, sync: bool) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach()
    if sync and comm.size > 1:
        t = comm.broadcast(t.clone(), root=0).to(t.device)
    return t


def _slice(t: torch.Tensor, comm: Communicator, dim: int) -> nn.Parameter:
    part = t.shape[dim] // comm.size
    return nn.Parameter(t.narrow(dim, comm.rank * part, part).clone().contiguous())


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A``'s rows (the outputs) split across the group.

    Args:
        in_features: input size.
        out_features: output size of the whole layer (divisible by the group size).
        comm: the tensor-parallel group.
        gather_output: allgather the output (else each rank keeps its output slice).
        bias: add a bias (split like the outputs).
        dense: take the weights of this ``nn.Linear`` instead of a fresh one.
        sync: broadcast the dense weights from rank 0 before slicing.
        name: layer name used in error messages.

    Raises:
        ConfigError: when ``out_features`` is not divisible by the group size.
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator,
                 gather_output: bool = False, bias: bool = True, *, dense: nn.Linear | None = None,
                 sync: bool = True, name: str = "") -> None:
        super().__init__()
        self.comm, self.gather_output = comm, gather_output
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = _part(out_features, comm, "out_features", name)
        dense = dense if dense is not None else nn.Linear(in_features, out_features, bias=bias)
        weight = _from_rank0(dense.weight, comm, sync)
        b = _from_rank0(dense.bias, comm, sync)
        self.weight = _slice(weight, comm, 0)  # type: ignore[arg-type]
        self.bias = _slice(b, comm, 0) if b is not None else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, comm: Communicator, gather_output: bool = False,
                   sync: bool = True, name: str = "") -> ColumnParallelLinear:
        """This rank's column shard of an existing ``nn.Linear``."""
        return cls(linear.in_features, linear.out_features, comm, gather_output,
                   linear.bias is not None, dense=linear, sync=sync, name=name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_group(x, self.comm), self.weight, self.bias)
        return gather_from_group(y, self.comm, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} ({self.out_per_rank} here), "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A``'s columns (the inputs) split; partial outputs are summed.

    Args:
        in_features: input size of the whole layer (divisible by the group size).
        out_features: output size.
        comm: the tensor-parallel group.
        input_is_parallel: the input is already this rank's slice (e.g. from a
            column-parallel layer); else the replicated input is split on entry.
        bias: add a bias (replicated, added once after the sum).
        dense: take the weights of this ``nn.Linear`` instead of a fresh one.
        sync: broadcast the dense weights from rank 0 before slicing.
        name: layer name used in error messages.

    Raises:
        ConfigError: when ``in_features`` is not divisible by the group size.
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator,
                 input_is_parallel: bool = True, bias: bool = True, *, dense: nn.Linear | None = None,
                 sync: bool = True, name: str = "") -> None:
        super().__init__()
        self.comm, self.input_is_parallel = comm, input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _part(in_features, comm, "in_features", name)
        dense = dense if dense is not None else nn.Linear(in_features, out_features, bias=bias)
        weight = _from_rank0(dense.weight, comm, sync)
        b = _from_rank0(dense.bias, comm, sync)
        self.weight = _slice(weight, comm, 1)  # type: ignore[arg-type]
        self.bias = nn.Parameter(b.clone()) if b is not None else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, comm: Communicator, input_is_parallel: bool = True,
                   sync: bool = True, name: str = "") -> RowParallelLinear:
        """This rank's row shard of an existing ``nn.Linear``."""
        return cls(linear.in_features, linear.out_features, comm, input_is_parallel,
                   linear.bias is not None, dense=linear, sync=sync, name=name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_group(x, self.comm, -1)
        y = reduce_from_group(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} ({self.in_per_rank} here), out={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split across the group.

    Each rank looks up the ids in its range, zeros the others, and the group sums.

    Args:
        num_embeddings: vocabulary size (divisible by the group size).
        embedding_dim: vector size.
        comm: the tensor-parallel group.
        dense: take the table of this ``nn.Embedding`` instead of a fresh one.
        sync: broadcast the dense table from rank 0 before slicing.
        name: layer name used in error messages.

    Raises:
        ConfigError: when ``num_embeddings`` is not divisible by the group size.
        NotImplementedError: for a dense embedding with ``padding_idx``, ``max_norm`` or sparse gradients.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Communicator, *,
                 dense: nn.Embedding | None = None, sync: bool = True, name: str = "") -> None:
        super().__init__()
        if dense is not None and (dense.padding_idx is not None or dense.max_norm is not None
                                  or dense.sparse):
            raise NotImplementedError(
                f"layer {name or '<unnamed>'}: VocabParallelEmbedding supports no padding_idx, "
                "max_norm or sparse gradients")
        self.comm, self.num_embeddings, self.embedding_dim = comm, num_embeddings, embedding_dim
        self.per_rank = _part(num_embeddings, comm, "num_embeddings", name)
        self.start = comm.rank * self.per_rank
        dense = dense if dense is not None else nn.Embedding(num_embeddings, embedding_dim)
        self.weight = _slice(_from_rank0(dense.weight, comm, sync), comm, 0)  # type: ignore[arg-type]

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, comm: Communicator, sync: bool = True,
                   name: str = "") -> VocabParallelEmbedding:
        """This rank's vocabulary shard of an existing ``nn.Embedding``."""
        return cls(embedding.num_embeddings, embedding.embedding_dim, comm, dense=embedding,
                   sync=sync, name=name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.per_rank)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(out, self.comm)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} ({self.per_rank} here, from {self.start}), "
                f"{self.embedding_dim}")


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor,
                                 comm: Communicator, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits whose last (vocabulary) axis is split across the group.

    The whole logits are never gathered: the group reduces the row maximum, the
    sum of exponentials and the target's logit, each a vector per row.

    Args:
        logits_shard: this rank's ``[..., vocab / size]`` slice of the logits (in rank order).
        target: class indices into the whole vocabulary, shape ``[...]``.
        comm: the tensor-parallel group.
        reduction: "mean", "sum" or "none".

    Returns:
        The loss (same value on every rank), differentiable w.r.t. ``logits_shard``.

    Raises:
        ConfigError: for an unknown reduction.
    """
    if reduction not in ("mean", "sum", "none"):
        raise invalid("reduction", reduction, "'mean', 'sum' or 'none'")
    part = logits_shard.shape[-1]
    start = comm.rank * part
    row_max = logits_shard.detach().amax(-1)
    if comm.size > 1:
        row_max = comm.allreduce(row_max, op="max")
    shifted = logits_shard - row_max.unsqueeze(-1)
    sum_exp = reduce_from_group(shifted.exp().sum(-1), comm)
    outside = (target < start) | (target >= start + part)
    local = (target - start).masked_fill(outside, 0)
    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    loss = sum_exp.log() - reduce_from_group(picked, comm)
    if reduction == "mean":
        return loss.mean()
    return loss.sum() if reduction == "sum" else loss


class ChannelParallelConv2d(nn.Module):
    """A 2-d convolution (NCHW) whose output channels are split across the group.

    Args:
        in_channels: input channels.
        out_channels: output channels of the whole layer (divisible by the group size).
        kernel_size, stride, padding, dilation: as ``nn.Conv2d``.
        comm: the tensor-parallel group.
        bias: add a bias (split like the channels).
        gather_output: allgather the channels (else each rank keeps its channel slice).
        dense: take the weights of this ``nn.Conv2d`` instead of a fresh one.
        sync: broadcast the dense weights from rank 0 before slicing.
        name: layer name used in error messages.

    Raises:
        ConfigError: when ``out_channels`` is not divisible by the group size.
        NotImplementedError: for a grouped convolution or a padding mode other than zeros.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, comm: Communicator,
                 stride: Any = 1, padding: Any = 0, dilation: Any = 1, bias: bool = True,
                 gather_output: bool = True, *, dense: nn.Conv2d | None = None, sync: bool = True,
                 name: str = "") -> None:
        super().__init__()
        if dense is None:
            dense = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation,
                              bias=bias)
        if dense.groups != 1 or dense.padding_mode != "zeros":
            raise NotImplementedError(
                f"layer {name or '<unnamed>'}: ChannelParallelConv2d supports groups=1 and "
                f"padding_mode='zeros', not groups={dense.groups}, padding_mode={dense.padding_mode!r}")
        self.comm, self.gather_output = comm, gather_output
        self.out_channels = out_channels
        self.per_rank = _part(out_channels, comm, "out_channels", name)
        self.stride, self.padding, self.dilation = dense.stride, dense.padding, dense.dilation
        self.weight = _slice(_from_rank0(dense.weight, comm, sync), comm, 0)  # type: ignore[arg-type]
        b = _from_rank0(dense.bias, comm, sync)
        self.bias = _slice(b, comm, 0) if b is not None else None

    @classmethod
    def from_dense(cls, conv: nn.Conv2d, comm: Communicator, gather_output: bool = True,
                   sync: bool = True, name: str = "") -> ChannelParallelConv2d:
        """This rank's output-channel shard of an existing ``nn.Conv2d``."""
        return cls(conv.in_channels, conv.out_channels, conv.kernel_size, comm, conv.stride,
                   conv.padding, conv.dilation, conv.bias is not None, gather_output, dense=conv,
                   sync=sync, name=name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(copy_to_group(x, self.comm), self.weight, self.bias, self.stride,
                     self.padding, self.dilation)
        return gather_from_group(y, self.comm, 1) if self.gather_output else y


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                      causal: bool = False) -> torch.Tensor:
    """Attention over a sequence split across the group (Ulysses: all-to-all to a head split).

    Args:
        q, k, v: this rank's ``[batch, seq / size, heads, head_dim]`` slices (rank order along
            the sequence); ``heads`` divisible by the group size.
        comm: the sequence-parallel group.
        causal: mask future positions (of the whole sequence).

    Returns:
        This rank's ``[batch, seq / size, heads, head_dim]`` slice of the attention output,
        equal to full attention over the whole sequence.
    """
    q, k, v = (seq_to_heads(t, comm).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return heads_to_seq(out.transpose(1, 2).contiguous(), comm)


# -- plans ------------------------------------------------------------------------------------
def owns_model(model: Any) -> bool:
    """Whether ``model`` is a ``torch.nn.Module``."""
    return isinstance(model, nn.Module)


def _convert(name: str, layer: nn.Module, style: Any, comm: Communicator) -> nn.Module:
    kinds: dict[str, tuple[type[nn.Module], Any]] = {
        "colwise": (nn.Linear, lambda: ColumnParallelLinear.from_dense(
            layer, comm, style.gather_output, sync=False, name=name)),  # type: ignore[arg-type]
        "rowwise": (nn.Linear, lambda: RowParallelLinear.from_dense(
            layer, comm, style.input_is_parallel, sync=False, name=name)),  # type: ignore[arg-type]
        "vocab": (nn.Embedding, lambda: VocabParallelEmbedding.from_dense(
            layer, comm, sync=False, name=name)),  # type: ignore[arg-type]
        "channels": (nn.Conv2d, lambda: ChannelParallelConv2d.from_dense(
            layer, comm, style.gather_output, sync=False, name=name)),  # type: ignore[arg-type]
    }
    expected, build = kinds[style.kind]
    if type(layer) is not expected:
        raise PlaitTypeError(
            f"layer {name!r} is a {type(layer).__module__}.{type(layer).__qualname__}: "
            f"{type(style).__name__}() applies to torch.nn.{expected.__name__} only")
    module: nn.Module = build()
    return module


def apply_plan(model: nn.Module, plan: Mapping[str, Any], comm: Communicator) -> nn.Module:
    """Broadcast ``model`` from rank 0, then replace each planned submodule by its shard, in place.

    Args:
        model: the dense model (create its optimizer after this call).
        plan: dotted submodule name to a ``plait.parallel.tensor.plan.Style``.
        comm: the tensor-parallel group.

    Returns:
        ``model`` itself.

    Raises:
        ConfigError: a planned name is not a submodule, or a dimension is not divisible.
        PlaitTypeError: a planned submodule has a type its style cannot split.
    """
    modules = dict(model.named_modules())
    for name in plan:
        if name not in modules or name == "":
            names = [n for n in modules if n][:12]
            raise invalid("plan", name, f"names of submodules of the model, such as {names}")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if comm.size > 1:
                t.copy_(comm.broadcast(t.detach().clone(), root=0))
    built = {name: _convert(name, modules[name], style, comm) for name, style in plan.items()}
    for name, new in built.items():
        parent_name, _, attr = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, attr, new)
    return model
