"""TensorFlow / Keras 3 glue for pipeline parallelism (``plait.Pipeline``).

A :class:`KerasStage` is one model chunk (consecutive Keras layers) as a
``plait.parallel.pipeline.runtime.StageExecutor``: ``forward`` records each
micro-batch on its own ``tf.GradientTape`` (or, with activation
recomputation, keeps only the input), ``backward`` asks the tape for the
gradients of the chunk's input and variables given the upstream gradient
(``output_gradients``) and adds the variable gradients to an accumulator.
:class:`KerasParams` holds this rank's variables, the accumulated gradients
and the Keras optimizer.

A model given built (a ``keras.Input`` in the Sequential, or ``model.build``)
is split as it is: every rank holds the same initial weights. A model whose
layers are not built yet (no ``keras.Input``) is built per stage: each rank
builds only its own stages' layers (:func:`materialize`, from the input shape
and the layers' output shapes), and their weights equal a serial build's,
since a Keras initializer draws its seed when the layer is constructed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from plait.parallel.pipeline.errors import PartitionError, PipelineTypeError

__all__ = ["KerasParams", "KerasStage", "is_deferred", "layer_times", "layers_of", "materialize",
           "param_counts", "seed_generators"]

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


def is_deferred(layers: Sequence[keras.layers.Layer]) -> bool:
    """Whether some layer is not built yet (each rank then builds its own stages)."""
    return not all(layer.built for layer in layers)


def materialize(layers: Sequence[keras.layers.Layer], indices: Sequence[int] | None = None,
                seed: int = 0, input_shape: Sequence[int] | None = None) -> None:
    """Build the layers ``indices`` (default: all) that are not built yet, in place.

    Each layer's input shape follows from ``input_shape`` through the earlier
    layers' ``compute_output_shape`` (which creates no weights). ``seed`` is unused:
    a Keras initializer drew its seed when its layer was constructed, so building
    the same model description on every rank gives every stage the serial weights.

    Args:
        layers: The model's layers.
        indices: The layers to build.
        seed: Unused (the torch glue's per-layer seed base).
        input_shape: The shape of one input sample, without the batch dimension.

    Raises:
        PartitionError: No ``input_shape``, or a layer cannot build on, or compute its
            output shape from, the shape it gets (naming the layer and the shape).
    """
    del seed
    if input_shape is None:
        raise PartitionError(
            "input_shape (one sample's shape, without the batch dimension) is required to build "
            "a Keras model whose layers are not built, e.g. input_shape=(784,)")
    wanted = set(range(len(layers)) if indices is None else indices)
    shape: Any = (None, *input_shape)
    for i, layer in enumerate(layers[: max(wanted) + 1] if wanted else []):
        try:
            if i in wanted and not layer.built:
                layer.build(shape)
            shape = layer.compute_output_shape(shape)
        except Exception as exc:
            raise PartitionError(
                f"model[{i}] ({layer.name}) cannot be built on input shape {tuple(shape)}: "
                f"{type(exc).__name__}: {exc}") from exc


def seed_generators(layers: Sequence[keras.layers.Layer]) -> list[Any]:
    """The ``keras.random.SeedGenerator`` of every layer (and nested layer), e.g. Dropout's."""
    out: list[Any] = []
    for layer in layers:
        flat = getattr(layer, "_flatten_layers", None)
        for sub in flat(include_self=True, recursive=True) if flat else [layer]:
            out.extend(getattr(sub, "_seed_generators", []))
    return out


def param_counts(layers: Sequence[keras.layers.Layer]) -> list[int]:
    """Number of trainable weight elements of each (built) layer.

    Raises:
        PartitionError: A layer with weights to create is not built yet.
    """
    out = []
    for i, layer in enumerate(layers):
        if not layer.built:
            raise PartitionError(
                f"model[{i}] ({layer.name}) is not built; balance='params' needs built layers: "
                f"build the model (keras.Input or model.build(input_shape)), or give balance as "
                f"a list of layer counts")
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


def _run(layers: Sequence[keras.layers.Layer], x: Any, training: bool,
         between: Callable[[Any], Any] | None = None) -> Any:
    for i, layer in enumerate(layers):
        if i and between is not None:
            x = between(x)
        x = layer(x, training=training)
    return x


def _poker(progress: Callable[[], None]) -> Callable[[Any], Any]:
    """An identity for traced code that calls ``progress()`` on the host once its input is
    computed, before anything uses it, and once its upstream gradient is, in backward:
    between two layers of a traced chunk, it lets the pipeline's messages move."""
    def host() -> np.ndarray:
        progress()
        return np.zeros((), np.int32)

    def after(t: Any) -> Any:
        with tf.control_dependencies([t]):
            done = tf.numpy_function(host, [], Tout=tf.int32, stateful=True)
        with tf.control_dependencies([done]):
            return tf.identity(t)

    @tf.custom_gradient
    def poke(x: Any) -> Any:
        return after(x), after

    return poke


class KerasStage:
    """One chunk of consecutive Keras layers on this rank.

    Args:
        layers: The chunk's layers (they keep their variables).
        first: Whether this is virtual stage 0 (its input needs no gradient).
        last: Whether this is the last virtual stage (computes the loss).
        loss_fn: ``loss_fn(y_true, y_pred) -> scalar`` (Keras order), on the last stage.
        scale: Factor applied to each micro-batch loss before backward.
        checkpoint: Recompute the chunk's forward in backward instead of
            keeping the tape; the layers' seed generators (Dropout's) are set back
            to their state before the forward, so the recompute draws the same masks.
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
        self.seeds = seed_generators(self.layers)
        self._progress: Callable[[], None] | None = None
        self._train_fn = self._traced()

    def _traced(self) -> Callable[[Any], Any]:
        """The chunk's layers as one traced function: the tape records a single call op
        (and its gradient is a traced function too) instead of every eager op."""
        between = None if self._progress is None else _poker(self._progress)
        return tf.function(lambda x: _run(self.layers, x, True, between),  # type: ignore[no-any-return]
                           reduce_retracing=True)

    @property
    def progress(self) -> Callable[[], None] | None:
        """Set by the runtime where the pipeline crosses hosts: lets messages in flight move.
        The traced chunk calls it between its layers, in forward and in backward (a host
        call each: a message posted before the chunk's compute moves during it)."""
        return self._progress

    @progress.setter
    def progress(self, fn: Callable[[], None] | None) -> None:
        self._progress = fn
        self._train_fn = self._traced()

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
            rng = self._rng()
            out = self._train_fn(x)
            if self.last:
                out = (self.loss_fn(tf.convert_to_tensor(target), out), None)  # type: ignore[misc]
            self.saved[mb] = (x, target, rng)
        else:
            tape, out = self._record(x, target)
            self.saved[mb] = (x, tape, out)
        return float(out[0]) if self.last else out

    def backward(self, mb: int, grad: Any | None) -> Any | None:
        """Backpropagate micro-batch ``mb``; return the gradient of its input."""
        saved = self.saved.pop(mb)
        x = saved[0]
        if self.checkpoint:
            keep = self._rng()
            self._set_rng(saved[2])
            tape, out = self._record(x, saved[1])
            self._set_rng(keep)
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

    def _rng(self) -> list[Any]:
        return [tf.identity(g.state.value) for g in self.seeds]

    def _set_rng(self, states: Sequence[Any]) -> None:
        for g, value in zip(self.seeds, states):
            g.state.assign(value)

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
