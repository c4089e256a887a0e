"""Tensor-parallel Keras 3 layers (TensorFlow backend) and the Keras side of ``TensorParallel`` plans.

Same design as :mod:`plait.adapters.torch_tp`: each layer holds this rank's
slice of a dense layer's weights, made identical on every rank of the group
(broadcast from rank 0) before slicing; communication is
:mod:`plait.parallel.tensor.mappings`. Keras stores a ``Dense`` kernel as
``[in, out]`` and a ``Conv2D`` kernel as ``[kh, kw, in, out]`` (channels last).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from plait.errors import ConfigError, PlaitTypeError, invalid
from plait.parallel.tensor.mappings import (
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    scatter_to_group,
)
from plait.protocols import Communicator

__all__ = [
    "ChannelParallelConv2D",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "apply_plan",
    "owns_model",
    "vocab_parallel_cross_entropy",
]


def _part(total: int, comm: Communicator, what: str, layer: str | None) -> int:
    if total % comm.size:
        raise ConfigError(
            f"layer {layer or '<unnamed>'}: {what}={total} is not divisible by the tensor-parallel "
            f"group size {comm.size}; expected a multiple of {comm.size}"
        )
    return total // comm.size


def _from_rank0(value: Any, comm: Communicator, sync: bool) -> np.ndarray:
    a = np.array(keras.ops.convert_to_numpy(value))
    return np.asarray(comm.broadcast(a, root=0)) if sync and comm.size > 1 else a


def _shard(a: np.ndarray, comm: Communicator, axis: int) -> np.ndarray:
    return np.split(a, comm.size, axis=axis)[comm.rank].copy()


def _pair(v: Any) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _init(shape: tuple[int, ...], initializer: str) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(keras.initializers.get(initializer)(shape)))


class _Sharded(keras.layers.Layer):  # type: ignore[misc]
    """Base: owns ``comm`` and creates weights from numpy values."""

    def __init__(self, comm: Communicator, name: str | None, **kwargs: Any) -> None:
        super().__init__(name=name, **kwargs)
        self.comm = comm

    def _weight(self, name: str, value: np.ndarray) -> Any:
        w = self.add_weight(name=name, shape=value.shape, initializer="zeros", dtype=self.dtype)
        w.assign(value.astype(w.dtype))
        return w


class ColumnParallelLinear(_Sharded):
    """A ``Dense`` layer whose outputs (kernel columns) are split across the group.

    Args:
        in_features: input size.
        out_features: output size of the whole layer (divisible by the group size).
        comm: the tensor-parallel group.
        gather_output: allgather the output (else each rank keeps its output slice).
        bias: add a bias (split like the outputs).
        activation: applied elementwise to the output.
        dense: take the weights of this built ``keras.layers.Dense`` instead of fresh ones.
        sync: broadcast the dense weights from rank 0 before slicing.
        name: layer name (also used in error messages).

    Raises:
        ConfigError: when ``out_features`` is not divisible by the group size.
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator,
                 gather_output: bool = False, bias: bool = True, activation: Any = None, *,
                 dense: Any = None, sync: bool = True, name: str | None = None) -> None:
        super().__init__(comm, name)
        self.gather_output, self.out_features = gather_output, out_features
        self.activation = keras.activations.get(activation)
        self.out_per_rank = _part(out_features, comm, "out_features", name)
        kernel = dense.kernel if dense is not None else _init((in_features, out_features), "glorot_uniform")
        self.kernel = self._weight("kernel", _shard(_from_rank0(kernel, comm, sync), comm, 1))
        self.bias = None
        if bias:
            b = dense.bias if dense is not None else np.zeros(out_features, np.float32)
            self.bias = self._weight("bias", _shard(_from_rank0(b, comm, sync), comm, 0))

    def call(self, x: Any) -> Any:
        y = keras.ops.matmul(copy_to_group(tf.convert_to_tensor(x), self.comm), self.kernel)
        if self.bias is not None:
            y = y + self.bias
        y = self.activation(y)
        return gather_from_group(y, self.comm, -1) if self.gather_output else y

    def compute_output_spec(self, x: Any) -> Any:
        width = self.out_features if self.gather_output else self.out_per_rank
        return keras.KerasTensor((*x.shape[:-1], width), dtype=self.compute_dtype)


class RowParallelLinear(_Sharded):
    """A ``Dense`` layer whose inputs (kernel rows) are split; partial outputs are summed.

    Args:
        in_features: input size of the whole layer (divisible by the group size).
        out_features: output size.
        comm: the tensor-parallel group.
        input_is_parallel: the input is already this rank's slice; else it is split on entry.
        bias: add a bias (replicated, added once after the sum).
        activation: applied after the sum and the bias.
        dense: take the weights of this built ``keras.layers.Dense`` instead of fresh ones.
        sync: broadcast the dense weights from rank 0 before slicing.
        name: layer name (also used in error messages).

    Raises:
        ConfigError: when ``in_features`` is not divisible by the group size.
    """

    def __init__(self, in_features: int, out_features: int, comm: Communicator,
                 input_is_parallel: bool = True, bias: bool = True, activation: Any = None, *,
                 dense: Any = None, sync: bool = True, name: str | None = None) -> None:
        super().__init__(comm, name)
        self.input_is_parallel, self.out_features = input_is_parallel, out_features
        self.activation = keras.activations.get(activation)
        self.in_per_rank = _part(in_features, comm, "in_features", name)
        kernel = dense.kernel if dense is not None else _init((in_features, out_features), "glorot_uniform")
        self.kernel = self._weight("kernel", _shard(_from_rank0(kernel, comm, sync), comm, 0))
        self.bias = None
        if bias:
            b = dense.bias if dense is not None else np.zeros(out_features, np.float32)
            self.bias = self._weight("bias", _from_rank0(b, comm, sync))

    def call(self, x: Any) -> Any:
        x = tf.convert_to_tensor(x)
        if not self.input_is_parallel:
            x = scatter_to_group(x, self.comm, -1)
        y = reduce_from_group(tf.convert_to_tensor(keras.ops.matmul(x, self.kernel)), self.comm)
        if self.bias is not None:
            y = y + self.bias
        return self.activation(y)

    def compute_output_spec(self, x: Any) -> Any:
        return keras.KerasTensor((*x.shape[:-1], self.out_features), dtype=self.compute_dtype)


class VocabParallelEmbedding(_Sharded):
    """An embedding table whose rows (the vocabulary) are split across the group.

    Args:
        num_embeddings: vocabulary size (divisible by the group size).
        embedding_dim: vector size.
        comm: the tensor-parallel group.
        dense: take the table of this built ``keras.layers.Embedding`` instead of a fresh one.
        sync: broadcast the dense table from rank 0 before slicing.
        name: layer name (also used in error messages).

    Raises:
        ConfigError: when ``num_embeddings`` is not divisible by the group size.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Communicator, *,
                 dense: Any = None, sync: bool = True, name: str | None = None) -> None:
        super().__init__(comm, name)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_rank = _part(num_embeddings, comm, "num_embeddings", name)
        self.start = comm.rank * self.per_rank
        table = dense.embeddings if dense is not None else _init((num_embeddings, embedding_dim),
                                                                 "uniform")
        self.embeddings = self._weight("embeddings", _shard(_from_rank0(table, comm, sync), comm, 0))

    def call(self, ids: Any) -> Any:
        ids = tf.cast(tf.convert_to_tensor(ids), tf.int64)
        outside = tf.logical_or(ids < self.start, ids >= self.start + self.per_rank)
        local = tf.where(outside, tf.zeros_like(ids), ids - self.start)
        out = tf.gather(tf.convert_to_tensor(self.embeddings), local)
        out = tf.where(outside[..., None], tf.zeros_like(out), out)
        return reduce_from_group(out, self.comm)

    def compute_output_spec(self, ids: Any) -> Any:
        return keras.KerasTensor((*ids.shape, self.embedding_dim), dtype=self.compute_dtype)


def vocab_parallel_cross_entropy(logits_shard: Any, target: Any, comm: Communicator,
                                 reduction: str = "mean") -> Any:
    """Cross-entropy of logits whose last (vocabulary) axis is split across the group.

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
    logits = tf.convert_to_tensor(logits_shard)
    target = tf.cast(tf.convert_to_tensor(target), tf.int64)
    part = int(logits.shape[-1])
    start = comm.rank * part
    row_max = tf.stop_gradient(tf.reduce_max(logits, axis=-1))
    if comm.size > 1:
        row_max = tf.stop_gradient(comm.allreduce(row_max, op="max"))
    shifted = logits - row_max[..., None]
    sum_exp = reduce_from_group(tf.reduce_sum(tf.exp(shifted), axis=-1), comm)
    outside = tf.logical_or(target < start, target >= start + part)
    local = tf.where(outside, tf.zeros_like(target), target - start)
    picked = tf.gather(shifted, local, batch_dims=len(target.shape))
    picked = tf.where(outside, tf.zeros_like(picked), picked)
    loss = tf.math.log(sum_exp) - reduce_from_group(picked, comm)
    if reduction == "mean":
        return tf.reduce_mean(loss)
    return tf.reduce_sum(loss) if reduction == "sum" else loss


class ChannelParallelConv2D(_Sharded):
    """A channels-last ``Conv2D`` whose output channels are split across the group.

    Args:
        in_channels: input channels.
        filters: output channels of the whole layer (divisible by the group size).
        kernel_size: an int or a pair.
        comm: the tensor-parallel group.
        strides: an int or a pair.
        padding: "valid" or "same".
        bias: add a bias (split like the channels).
        gather_output: allgather the channels (else each rank keeps its channel slice).
        activation: applied elementwise to the output.
        dense: take the weights of this built ``keras.layers.Conv2D`` instead of fresh ones.
        sync: broadcast the dense weights from rank 0 before slicing.
        name: layer name (also used in error messages).

    Raises:
        ConfigError: when ``filters`` is not divisible by the group size.
        NotImplementedError: for channels-first data, dilation or grouped convolution.
    """

    def __init__(self, in_channels: int, filters: int, kernel_size: Any, comm: Communicator,
                 strides: Any = 1, padding: str = "valid", bias: bool = True,
                 gather_output: bool = True, activation: Any = None, *, dense: Any = None,
                 sync: bool = True, name: str | None = None) -> None:
        super().__init__(comm, name)
        if dense is not None and (dense.data_format != "channels_last" or dense.groups != 1
                                  or tuple(dense.dilation_rate) != (1, 1)):
            raise NotImplementedError(
                f"layer {name or '<unnamed>'}: ChannelParallelConv2D supports channels_last, "
                "groups=1 and dilation 1 only")
        self.kernel_size, self.strides, self.padding = _pair(kernel_size), _pair(strides), padding.upper()
        self.filters, self.gather_output = filters, gather_output
        self.activation = keras.activations.get(activation)
        self.per_rank = _part(filters, comm, "filters", name)
        kernel = dense.kernel if dense is not None else _init((*self.kernel_size, in_channels, filters),
                                                              "glorot_uniform")
        self.kernel = self._weight("kernel", _shard(_from_rank0(kernel, comm, sync), comm, 3))
        self.bias = None
        if bias:
            b = dense.bias if dense is not None else np.zeros(filters, np.float32)
            self.bias = self._weight("bias", _shard(_from_rank0(b, comm, sync), comm, 0))

    def call(self, x: Any) -> Any:
        x = copy_to_group(tf.convert_to_tensor(x), self.comm)
        y = tf.nn.conv2d(x, tf.convert_to_tensor(self.kernel), strides=self.strides,
                         padding=self.padding)
        if self.bias is not None:
            y = y + self.bias
        y = self.activation(y)
        return gather_from_group(y, self.comm, -1) if self.gather_output else y

    def compute_output_spec(self, x: Any) -> Any:
        out: list[int | None] = []
        for size, k, s in zip(x.shape[1:3], self.kernel_size, self.strides, strict=True):
            if size is None:
                out.append(None)
            elif self.padding == "SAME":
                out.append(-(-size // s))
            else:
                out.append((size - k) // s + 1)
        width = self.filters if self.gather_output else self.per_rank
        return keras.KerasTensor((x.shape[0], *out, width), dtype=self.compute_dtype)


# -- plans ------------------------------------------------------------------------------------
def owns_model(model: Any) -> bool:
    """Whether ``model`` is a Keras model."""
    return isinstance(model, keras.Model)


def _convert(name: str, layer: Any, style: Any, comm: Communicator) -> Any:
    L = keras.layers
    expected = {"colwise": L.Dense, "rowwise": L.Dense, "vocab": L.Embedding, "channels": L.Conv2D}
    want = expected[style.kind]
    if type(layer) is not want:
        raise PlaitTypeError(
            f"layer {name!r} is a {type(layer).__module__}.{type(layer).__qualname__}: "
            f"{type(style).__name__}() applies to keras.layers.{want.__name__} only")
    if style.kind in ("colwise", "rowwise"):
        n_in, n_out = (int(d) for d in layer.kernel.shape)
        if style.kind == "colwise":
            return ColumnParallelLinear(n_in, n_out, comm, style.gather_output, layer.use_bias,
                                        layer.activation, dense=layer, sync=False, name=name)
        return RowParallelLinear(n_in, n_out, comm, style.input_is_parallel, layer.use_bias,
                                 layer.activation, dense=layer, sync=False, name=name)
    if style.kind == "vocab":
        if layer.mask_zero:
            raise NotImplementedError(f"layer {name!r}: VocabParallelEmbedding does not support mask_zero")
        return VocabParallelEmbedding(layer.input_dim, layer.output_dim, comm, dense=layer,
                                      sync=False, name=name)
    return ChannelParallelConv2D(int(layer.kernel.shape[2]), layer.filters, layer.kernel_size, comm,
                                 layer.strides, layer.padding, layer.use_bias, style.gather_output,
                                 layer.activation, dense=layer, sync=False, name=name)


def apply_plan(model: Any, plan: Mapping[str, Any], comm: Communicator) -> Any:
    """Broadcast ``model`` from rank 0, then rebuild it with each planned layer sharded.

    Keras cannot swap a layer inside a built model, so the model is cloned with
    ``keras.models.clone_model`` and every layer that is not in the plan is
    shared (the same object, the same weights) with the original.

    Args:
        model: a built Keras Sequential or functional model (compile it after this call).
        plan: layer name to a ``plait.parallel.tensor.plan.Style``.
        comm: the tensor-parallel group.

    Returns:
        The sharded model.

    Raises:
        ConfigError: a planned name is not a layer, or a dimension is not divisible.
        PlaitTypeError: a planned layer has a type its style cannot split.
        NotImplementedError: for a subclassed model (no layer graph to rebuild).
    """
    if not isinstance(model, keras.Sequential) and not getattr(model, "_is_graph_network", False) \
            and type(model).__name__ != "Functional":
        raise NotImplementedError(
            f"TensorParallel can rebuild Keras Sequential and functional models, not a subclassed "
            f"{type(model).__qualname__}; use plait.adapters.keras_tp layers in it directly")
    layers = {layer.name: layer for layer in model.layers}
    for name in plan:
        if name not in layers:
            raise invalid("plan", name, f"names of layers of the model, such as {list(layers)[:12]}")
    if comm.size > 1:
        for w in model.weights:
            w.assign(np.asarray(comm.broadcast(np.array(keras.ops.convert_to_numpy(w)), root=0)))
    built = {name: _convert(name, layers[name], style, comm) for name, style in plan.items()}
    return keras.models.clone_model(model, clone_function=lambda layer: built.get(layer.name, layer))
