"""TensorFlow / Keras 3 glue for pipeline parallelism (``plait.Pipeline``).

A :class:`KerasStage` is one model chunk (consecutive Keras layers) as a
``plait.parallel.pipeline.runtime.StageExecutor``: ``forward`` records each
micro-batch on its own ``tf.GradientTape`` (or, with activation
recomputation, keeps only the input), ``backward`` asks the tape for the
gradients of the chunk's input and variables given the upstream gradient
(``output_gradients``) and adds the variable gradients to an accumulator.
:class:`KerasParams` holds this rank's variables, the accumulated gradients
and the Keras optimizer.

Layers must be built (a ``keras.Input`` in the Sequential, or
``model.build``) before the model is split, so that every rank holds the
same initial weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from plait.parallel.pipeline.errors import PartitionError, PipelineTypeError

__all__ = ["KerasParams", "KerasStage", "layer_times", "layers_of", "param_counts"]

framework = "tensorflow"


def layers_of(model: Any) -> list[keras.layers.Layer]:
    """The layers of a Keras ``Sequential`` or a list of Keras layers, in order.

    Raises:
        PipelineTypeError: ``model`` is neither, or an entry is not a layer.
        PartitionError: The model has no layer.
    """
    if isinstance(model, keras.Sequential):
        layers = list(model.layers)
    elif isinstance(model, (list, tuple)):
        layers = list(model)
    else:
        raise PipelineTypeError(
            f"model must be a keras.Sequential or a list of keras layers, got "
            f"{type(model).__module__}.{type(model).__qualname__}")
    for i, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer):
            raise PipelineTypeError(f"model[{i}] must be a keras layer, got {type(layer).__name__}")
    if not layers:
        raise PartitionError("model must have at least one layer, got an empty model")
    return layers


def param_counts(layers: Sequence[keras.layers.Layer]) -> list[int]:
    """Number of trainable weight elements of each (built) layer.

    Raises:
        PartitionError: A layer with weights to create is not built yet.
    """
    out = []
    for i, layer in enumerate(layers):
        if not layer.built:
            raise PartitionError(
                f"model[{i}] ({layer.name}) is not built; build the model (keras.Input or "
                f"model.build(input_shape)) before splitting it into pipeline stages")
        out.append(sum(int(tf.size(v.value)) for v in layer.trainable_variables))
    return out


def layer_times(layers: Sequence[keras.layers.Layer], sample: Any, repeats: int = 3) -> list[float]:
    """Measured forward + backward seconds of each layer on ``sample`` (best of ``repeats``)."""
    x = tf.convert_to_tensor(sample)
    times = []
    for layer in layers:
        best = float("inf")
        out = x
        for _ in range(repeats):
            start = time.perf_counter()
            with tf.GradientTape() as tape:
                tape.watch(x)
                out = layer(x, training=True)
            sources = [x] + list(layer.trainable_variables)
            tape.gradient(out, sources, output_gradients=tf.ones_like(out))
            best = min(best, time.perf_counter() - start)
        times.append(best)
        x = tf.stop_gradient(out)
    return times


def _run(layers: Sequence[keras.layers.Layer], x: Any, training: bool) -> Any:
    for layer in layers:
        x = layer(x, training=training)
    return x


class KerasStage:
    """One chunk of consecutive Keras layers on this rank.

    Args:
        layers: The chunk's layers (they keep their variables).
        first: Whether this is virtual stage 0 (its input needs no gradient).
        last: Whether this is the last virtual stage (computes the loss).
        loss_fn: ``loss_fn(y_true, y_pred) -> scalar`` (Keras order), on the last stage.
        scale: Factor applied to each micro-batch loss before backward.
        checkpoint: Recompute the chunk's forward in backward instead of
            keeping the tape (layers drawing random numbers draw new ones).
    """

    def __init__(self, layers: Sequence[keras.layers.Layer], *, first: bool, last: bool,
                 loss_fn: Callable[[Any, Any], Any] | None, scale: float,
                 checkpoint: bool = False) -> None:
        self.layers = list(layers)
        self.first, self.last, self.loss_fn = first, last, loss_fn
        self.scale, self.checkpoint = scale, checkpoint
        self.variables = [v for layer in self.layers for v in layer.trainable_variables]
        self.acc: list[Any] = [None] * len(self.variables)
        self.saved: dict[int, tuple[Any, ...]] = {}
        # The chunk's layers as one traced function: the tape records a single call op
        # (and its gradient is a traced function too) instead of every eager op.
        self._train_fn = tf.function(lambda x: _run(self.layers, x, True), reduce_retracing=True)

    def _record(self, x: Any, target: Any) -> tuple[Any, Any]:
        tape = tf.GradientTape()
        with tape:
            if not self.first:
                tape.watch(x)
            out = self._train_fn(x)
            if self.last:
                if self.loss_fn is None:
                    raise PipelineTypeError("loss_fn is required on the last stage, got None")
                loss = self.loss_fn(tf.convert_to_tensor(target), out)
                out = (loss, loss * self.scale)
        return tape, out

    def forward(self, mb: int, x: Any, target: Any | None = None) -> Any:
        """Run micro-batch ``mb``; return the output, or the loss on the last stage."""
        x = tf.convert_to_tensor(x)
        if self.checkpoint:
            out = self._train_fn(x)
            if self.last:
                out = (self.loss_fn(tf.convert_to_tensor(target), out), None)  # type: ignore[misc]
            self.saved[mb] = (x, target)
        else:
            tape, out = self._record(x, target)
            self.saved[mb] = (x, tape, out)
        return float(out[0]) if self.last else out

    def backward(self, mb: int, grad: Any | None) -> Any | None:
        """Backpropagate micro-batch ``mb``; return the gradient of its input."""
        saved = self.saved.pop(mb)
        x = saved[0]
        if self.checkpoint:
            tape, out = self._record(x, saved[1])
        else:
            tape, out = saved[1], saved[2]
        sources = ([] if self.first else [x]) + self.variables
        if self.last:
            grads = tape.gradient(out[1], sources)
        else:
            grads = tape.gradient(out, sources, output_gradients=tf.convert_to_tensor(grad))
        gin = None if self.first else grads[0]
        for i, g in enumerate(grads[0 if self.first else 1:]):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                g = tf.convert_to_tensor(g)
            self.acc[i] = g if self.acc[i] is None else self.acc[i] + g
        return gin

    def infer(self, x: Any) -> Any:
        """Inference-mode forward without a tape."""
        return _run(self.layers, tf.convert_to_tensor(x), False)


class KerasParams:
    """The variables of this rank's chunks, their accumulated gradients and optimizer.

    Args:
        stages: This rank's :class:`KerasStage` objects.
        optimizer: A Keras optimizer, a callable ``variables -> optimizer``, or
            None to apply gradients yourself.

    Raises:
        PipelineTypeError: ``optimizer`` is none of these.
    """

    def __init__(self, stages: Sequence[KerasStage], optimizer: Any) -> None:
        self.stages = list(stages)
        self.variables = [v for st in self.stages for v in st.variables]
        if optimizer is None or isinstance(optimizer, keras.optimizers.Optimizer):
            self.optimizer = optimizer
        elif callable(optimizer):
            self.optimizer = optimizer(self.variables)
        else:
            raise PipelineTypeError(
                f"optimizer must be a keras optimizer, a callable variables -> optimizer, or None, "
                f"got {type(optimizer).__name__}")

    def parameters(self) -> list[Any]:
        """This rank's trainable variables."""
        return list(self.variables)

    def gradients(self) -> list[Any]:
        """Accumulated gradient of each variable (zeros where none)."""
        out = []
        for st in self.stages:
            for v, g in zip(st.variables, st.acc):
                out.append(tf.zeros_like(v.value) if g is None else g)
        return out

    def set_gradients(self, grads: Sequence[Any]) -> None:
        """Replace the accumulated gradients (e.g. by their data-parallel average)."""
        it = iter(grads)
        for st in self.stages:
            st.acc = [tf.reshape(tf.cast(tf.convert_to_tensor(next(it)), v.dtype), v.shape)
                      for v in st.variables]

    def zero_grad(self) -> None:
        """Forget accumulated gradients."""
        for st in self.stages:
            st.acc = [None] * len(st.variables)

    def step(self) -> None:
        """Apply the optimizer to the accumulated gradients (no-op without one)."""
        if self.optimizer is not None and self.variables:
            self.optimizer.apply_gradients(zip(self.gradients(), self.variables))
