"""TensorFlow / Keras 3 data parallelism: gradient tape, Keras optimizer, broadcasts.

Keras 3 variables are not ``tf.Variable`` (Horovod 0.28 fails on them, and its
Keras optimizer silently skips averaging under ``model.fit``); everything here
goes through :func:`~plait.adapters.tensorflow.unwrap` and the communicator,
and works eagerly and inside ``tf.function`` on both backends.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from plait.errors import invalid
from plait.parallel.data import DEFAULT_BUCKET_MB, GradientReducer, GradSpec
from plait.protocols import Communicator

from .tensorflow import OPS, unwrap
from .tf_collectives import group_size, sparse_allreduce

__all__ = [
    "DistributedGradientTape", "broadcast_variables", "distributed_keras_optimizer",
    "local_layer_variables", "reduce_gradients",
]


def _name(v: Any, i: int) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", None) or f"var.{i}") + f"#{i}"


def reduce_gradients(grads: Sequence[Any], variables: Sequence[Any], comm: Communicator, *,
                     op: str = "average", compression: Any = None, memory: Any = None,
                     bucket_mb: float = DEFAULT_BUCKET_MB,
                     gradient_predivide_factor: float = 1.0,
                     sparse_as_dense: bool = True) -> list[Any]:
    """Average (or sum) gradients across ``comm``, fused into buckets.

    A ``None`` gradient is reduced as zeros (another rank may have one). A
    ``tf.IndexedSlices`` (an embedding's gradient) is made dense, or, with
    ``sparse_as_dense=False``, reduced as Horovod reduces it: its values and indices
    allgathered (the values divided for an average), and it comes back as a
    ``tf.IndexedSlices`` (summing duplicate indices is left to the optimizer). That
    needs no error-feedback ``memory`` and no predivide factor (else: dense).

    Args:
        grads: one gradient (or None) per variable.
        variables: the variables (tf or Keras 3), same order and number on every rank.
        comm: the data-parallel communicator.
        op: "average" (default) or "sum".
        compression: a compressor, or None.
        memory: its error-feedback memory, or None.
        bucket_mb: fusion bucket size in MiB (0: one gradient per allreduce).
        gradient_predivide_factor: divide by this before the reduction and multiply
            after (Horovod's split of the averaging).
        sparse_as_dense: reduce ``tf.IndexedSlices`` dense (default) or allgathered.

    Returns:
        The reduced gradients, in the order of ``variables``.
    """
    if comm.size == 1 and (tf.executing_eagerly() or os.environ.get("HOROVOD_ELASTIC") != "1"):
        # (a graph traced by the one worker of a Horovod elastic job reduces, as Horovod's
        # does: it goes on running once workers joined, whose graphs reduce)
        return list(grads)
    f = float(gradient_predivide_factor)
    sparse: dict[int, Any] = {}
    if not sparse_as_dense and memory is None and f == 1.0 and op in ("sum", "average"):
        # allgathered: for a 16384 x 256 embedding and 1024 tokens a step, 1 MiB a rank
        # instead of a 16 MiB allreduce (and its densifying)
        sparse = {i: g for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)}
        if sparse:
            kept = [i for i in range(len(grads)) if i not in sparse]
            reduced = reduce_gradients([grads[i] for i in kept], [variables[i] for i in kept],
                                       comm, op=op, compression=compression,
                                       bucket_mb=bucket_mb) if kept else []
            full: list[Any] = [None] * len(grads)
            for i, g in zip(kept, reduced):
                full[i] = g
            for i, g in sparse.items():
                full[i] = sparse_allreduce(comm, g, op, name=f"tfgrad.sparse.{i}")
            return full
    specs, dense = [], []
    for i, (g, v) in enumerate(zip(grads, variables)):
        value = unwrap(v)
        g = dense_gradient(g, value)
        specs.append(GradSpec(_name(v, i), tuple(value.shape), OPS.dtype_name(value)))
        dense.append(g if f == 1.0 else g / f)
    if not tf.executing_eagerly() and comm.backend == "mpi" and compression is None \
            and memory is None:  # host ops: start every bucket, then wait
        from .tf_overlap import overlapped_reduce

        out_list = overlapped_reduce(comm, specs, dense, op, bucket_mb)
        return out_list if f == 1.0 else [g * f for g in out_list]
    reducer = GradientReducer(comm, specs, op=op, bucket_mb=bucket_mb, compression=compression,
                              memory=memory, prefix="tfgrad")
    for spec, g in zip(specs, dense):
        reducer.ready(spec.name, g)
    out = reducer.finish(lambda spec: None)
    return [out[s.name] if f == 1.0 else out[s.name] * f for s in specs]


def dense_gradient(grad: Any, value: Any) -> Any:
    """``grad`` as a dense tensor: zeros for None, ``tf.IndexedSlices`` densified.

    Args:
        grad: a gradient, ``tf.IndexedSlices`` or None.
        value: the variable's value (gives the zeros their shape and dtype).

    Returns:
        A dense tensor shaped like ``value``.
    """
    if grad is None:
        return tf.zeros_like(value)
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape`` so that ``gradient()`` returns averaged gradients.

    Sources registered with :meth:`register_local_source` (Horovod's worker-local
    variables, e.g. by ``PartialDistributedGradientTape``) keep their local gradient,
    divided by the number of ranks when ``scale_local_gradients`` is True (Horovod's
    default, so that it matches the averaged ones' scale).

    Args:
        tape: the tape that recorded the forward pass.
        comm: the data-parallel communicator.
        op: "average" (default) or "sum".
        compression: a compressor, or None.
        memory: its error-feedback memory, or None.
        bucket_mb: fusion bucket size in MiB.
        gradient_predivide_factor: divide before the reduction, multiply after.
        scale_local_gradients: divide local sources' gradients by the number of ranks.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients dense; by default they
            are allgathered and stay ``tf.IndexedSlices``, as Horovod's tape does (see
            :func:`reduce_gradients`).

    Raises:
        ConfigError: when ``tape`` is not a ``tf.GradientTape`` or the factor is not > 0.
    """

    def __init__(self, tape: tf.GradientTape, comm: Communicator, *, op: str = "average",
                 compression: Any = None, memory: Any = None,
                 bucket_mb: float = DEFAULT_BUCKET_MB,
                 gradient_predivide_factor: float = 1.0,
                 scale_local_gradients: bool = True, sparse_as_dense: bool = False) -> None:
        if not isinstance(tape, tf.GradientTape):
            raise invalid("gradtape", type(tape).__name__, "a tf.GradientTape")
        _check_predivide(gradient_predivide_factor)
        self._tape, self._comm = tape, comm
        self._kw = {"op": op, "compression": compression, "memory": memory, "bucket_mb": bucket_mb,
                    "gradient_predivide_factor": gradient_predivide_factor,
                    "sparse_as_dense": bool(sparse_as_dense)}
        self._scale_local = bool(scale_local_gradients)
        self._local: set[Any] = set()

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local (not reduced across ranks), as Horovod's
        ``register_local_source``.

        Args:
            source: a ``tf.Variable`` or Keras 3 variable.
        """
        self._local.add(_key(source))

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, **kw: Any) -> Any:
        """Gradients of ``target`` w.r.t. ``sources``, averaged over ranks (local sources:
        this rank's own, scaled as the tape was told).

        ``use_generic_names`` (Horovod's keyword) is accepted and has no effect.
        """
        kw.pop("use_generic_names", None)
        flat = tf.nest.flatten(sources)
        grads = list(self._tape.gradient(target, [unwrap(s) for s in flat], output_gradients,
                                         **kw))
        shared = [i for i, s in enumerate(flat) if _key(s) not in self._local]
        reduced = reduce_gradients([grads[i] for i in shared], [flat[i] for i in shared],
                                   self._comm, **self._kw)
        out = list(grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        for i in set(range(len(out))).difference(shared):  # local sources only
            out[i] = _scaled_local(grads[i], self._comm) if self._scale_local else grads[i]
        return tf.nest.pack_sequence_as(sources, out)

    def get_local_and_global_gradients(self, target: Any, sources: Any,
                                       output_gradients: Any = None,
                                       use_generic_names: bool = False
                                       ) -> tuple[list[Any], list[Any]]:
        """Horovod's split of :meth:`gradient`: ``(local, global)`` lists of
        ``(source, gradient)`` pairs, each in the order of ``sources``.

        Args:
            target: the value to differentiate.
            sources: the variables (a flat list).
            output_gradients: upstream gradients of ``target``, or None.
            use_generic_names: no effect.

        Returns:
            The pairs of the registered local sources, and those of the others.
        """
        flat = tf.nest.flatten(sources)
        grads = tf.nest.flatten(self.gradient(target, flat, output_gradients))
        local = [(s, g) for s, g in zip(flat, grads) if _key(s) in self._local]
        return local, [(s, g) for s, g in zip(flat, grads) if _key(s) not in self._local]


def local_layer_variables(local_layers: Any) -> list[Any]:
    """The trainable variables of ``PartialDistributedGradientTape``'s ``local_layers``.

    Args:
        local_layers: None, a Keras layer, or an iterable of Keras layers.

    Returns:
        Their trainable weights, layer by layer.

    Raises:
        ConfigError: when ``local_layers`` (or one of its items) is not a Keras layer.
    """
    import keras

    if local_layers is None:
        return []
    layers = [local_layers] if isinstance(local_layers, keras.layers.Layer) else local_layers
    try:
        layers = list(layers)
    except TypeError:
        raise invalid("local_layers", local_layers, "a keras.layers.Layer or a list of them, "
                      "or None") from None
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise invalid("local_layers", local_layers, "keras.layers.Layer items only (got a "
                          f"{type(layer).__name__})")
    return [v for layer in layers for v in layer.trainable_weights]


def _key(source: Any) -> Any:
    """A hashable identity of a variable, the same for a Keras 3 variable and its value."""
    value = unwrap(source)
    return value.ref() if hasattr(value, "ref") else id(value)


def _scaled_local(grad: Any, comm: Communicator | int) -> Any:
    """A local gradient divided by the size of ``comm`` (or by an int; None and a size
    of 1: unchanged). In a Horovod elastic job's graph the size is read when the graph
    runs (:func:`~plait.adapters.tf_collectives.group_size`)."""
    if grad is None:
        return grad
    size = comm if isinstance(comm, int) else group_size(comm, grad.dtype)
    if isinstance(size, int) and size == 1:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / size, grad.indices, grad.dense_shape)
    return grad / size


def broadcast_variables(variables: Sequence[Any], comm: Communicator, root: int = 0) -> None:
    """Assign ``root``'s values to ``variables`` (tf or Keras 3) on every rank, one
    fused broadcast per dtype."""
    by_dtype: dict[str, list[Any]] = {}
    for v in variables:
        by_dtype.setdefault(OPS.dtype_name(v), []).append(v)
    for dtype in sorted(by_dtype):
        group = by_dtype[dtype]
        flat = tf.concat([tf.reshape(unwrap(v), [-1]) for v in group], axis=0)
        out = comm.broadcast(flat, root=root, name=f"broadcast.vars.{dtype}")
        sizes = [int(tf.size(unwrap(v))) for v in group]
        for v, part in zip(group, tf.split(out, sizes)):
            v.assign(tf.reshape(part, unwrap(v).shape))


def _check_predivide(factor: Any) -> None:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise invalid("gradient_predivide_factor", factor, "a number > 0")


def distributed_keras_optimizer(optimizer: Any, comm: Communicator | None, *, op: str = "average",
                                compression: Any = None, memory: Any = None,
                                bucket_mb: float = DEFAULT_BUCKET_MB,
                                backward_passes_per_step: int = 1,
                                average_aggregated_gradients: bool = False,
                                gradient_predivide_factor: float = 1.0,
                                scale_local_gradients: bool = True,
                                sparse_as_dense: bool = False) -> Any:
    """A copy of a Keras 3 optimizer whose ``apply`` averages gradients first.

    Works with ``model.fit`` (which calls ``optimizer.apply`` inside a ``tf.function``)
    and with custom loops calling ``apply_gradients``, eagerly or in ``tf.function``;
    the result is an instance of a subclass of the optimizer's class, built from its
    config.

    With ``backward_passes_per_step`` N > 1 (Horovod's gradient accumulation), each
    call adds the local gradients to accumulators (optimizer variables, so they are
    broadcast and checkpointed with the rest); every Nth call reduces the sums across
    ranks and applies them, the other calls apply nothing. As in Horovod the applied
    gradient is the sum of the N passes (averaged over ranks), or its mean with
    ``average_aggregated_gradients=True``. ``optimizer.iterations`` counts applied
    updates (as with Keras 3's own ``gradient_accumulation_steps``; Horovod's Keras 2
    helper counted every pass), so Adam's bias correction and learning-rate schedules
    see the same step numbers as one process training on the N-times larger batch.
    An epoch whose batch count is not a multiple of N carries its last passes over
    into the next epoch, as in Horovod.

    Variables passed to its ``register_local_var`` (Horovod's worker-local variables,
    e.g. by ``PartialDistributedOptimizer``) keep this rank's gradient, divided by the
    number of ranks with ``scale_local_gradients``. Its ``_compute_gradients(loss,
    var_list, grad_loss=None, tape=None)`` returns the reduced ``(gradient, variable)``
    pairs, as Horovod's Keras optimizer's does, and ``apply_gradients`` of those pairs
    does not reduce them again.

    Args:
        optimizer: a Keras 3 optimizer (not yet used).
        comm: the data-parallel communicator; None: apply this rank's own gradients
            (Horovod's optimizer on a rank outside its process set).
        op: "average" (default) or "sum".
        compression: a compressor, or None.
        memory: its error-feedback memory, or None.
        bucket_mb: fusion bucket size in MiB (0: one gradient per allreduce).
        backward_passes_per_step: local passes accumulated per reduction and update.
        average_aggregated_gradients: divide the accumulated sum by the number of passes.
        gradient_predivide_factor: divide before the reduction, multiply after.
        scale_local_gradients: divide local variables' gradients by the number of ranks.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients (an embedding's) dense; by
            default their rows are allgathered, as Horovod's optimizer does (see
            :func:`reduce_gradients`; accumulated passes are dense).

    Returns:
        The distributed optimizer.

    Raises:
        ConfigError: when ``optimizer`` is not a Keras 3 optimizer, or for a bad number
            of passes or factor.
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise invalid("optimizer", type(optimizer).__name__, "a keras.optimizers.Optimizer (Keras 3)")
    passes = backward_passes_per_step
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise invalid("backward_passes_per_step", passes, "an integer >= 1")
    _check_predivide(gradient_predivide_factor)
    base = type(optimizer)
    kw = {"op": op, "compression": compression, "memory": memory, "bucket_mb": bucket_mb,
          "gradient_predivide_factor": gradient_predivide_factor,
          "sparse_as_dense": sparse_as_dense}

    def reduce(self: Any, grads: list[Any], variables: list[Any]) -> list[Any]:
        if comm is None:
            return grads
        local = getattr(self, "_plait_local_vars", ())  # none in a copy made by from_config
        shared = [i for i, v in enumerate(variables) if _key(v) not in local]
        if len(shared) == len(variables):
            return reduce_gradients(grads, variables, comm, **kw)
        out = list(grads)
        if shared:
            reduced = reduce_gradients([grads[i] for i in shared], [variables[i] for i in shared],
                                       comm, **kw)
            for i, g in zip(shared, reduced):
                out[i] = g
        if scale_local_gradients:
            out = [g if _key(v) not in local else _scaled_local(g, comm)
                   for g, v in zip(out, variables)]
        return out

    def register_local_var(self: Any, var: Any) -> None:
        """Keep ``var``'s gradient on this rank (Horovod's ``register_local_var``)."""
        if not hasattr(self, "_plait_local_vars"):
            self._plait_local_vars = set()
        self._plait_local_vars.add(_key(var))

    def compute_reduced(self: Any, loss: Any, var_list: Any, grad_loss: Any = None,
                        tape: Any = None) -> list[tuple[Any, Any]]:
        """Horovod's ``_compute_gradients``: the reduced ``(gradient, variable)`` pairs
        of ``loss`` (a tensor recorded by ``tape``, or a callable) for ``var_list`` (nested
        lists flattened, as Keras 2 did). ``apply_gradients`` of these very gradients
        does not reduce them again (Horovod's reduces only here). With
        ``backward_passes_per_step`` > 1 they are this rank's own: ``apply`` adds them up
        and reduces every Nth pass."""
        variables = tf.nest.flatten(var_list() if callable(var_list) else var_list)
        if callable(loss):
            tape = tape if tape is not None else tf.GradientTape()
            with tape:
                tape.watch([unwrap(v) for v in variables])
                loss = loss()
        elif tape is None:
            raise invalid("tape", None, "the tf.GradientTape that recorded `loss` (or a callable loss)")
        grads = list(tape.gradient(loss, variables, grad_loss))
        if passes > 1:
            return list(zip(grads, variables))
        reduced = reduce(self, grads, variables)
        self._plait_reduced = tuple(reduced)  # see apply
        return list(zip(reduced, variables))

    def get_gradients(self: Any, loss: Any, params: Any) -> list[Any]:
        """Horovod's ``get_gradients``, for an optimizer class that has one (Keras 3's
        have none): its gradients, reduced; ``apply_gradients`` of these very gradients
        does not reduce them again. With ``backward_passes_per_step`` > 1 they are this
        rank's own (``apply`` adds them up and reduces every Nth pass)."""
        grads = list(base.get_gradients(self, loss, params))
        if passes > 1:
            return grads
        reduced = reduce(self, grads, tf.nest.flatten(params))
        self._plait_reduced = tuple(reduced)  # see apply
        return reduced

    def build(self: Any, variables: Any) -> None:
        base.build(self, variables)
        if passes > 1:
            self._plait_accumulators = [
                self.add_variable_from_reference(v, name="plait_accumulator") for v in variables]
            self._plait_passes = self.add_variable((), initializer="zeros", dtype="int64",
                                                   name="plait_passes")

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        variables = trainable_variables
        if variables is None:
            variables = self._trainable_variables
        variables, grads = list(variables), list(grads)
        if passes == 1:
            done = getattr(self, "_plait_reduced", ())
            self._plait_reduced = ()
            if len(done) == len(grads) and all(g is d for g, d in zip(grads, done)):
                return base.apply(self, grads, trainable_variables)  # _compute_gradients' own
            return base.apply(self, reduce(self, grads, variables), trainable_variables)
        if not self.built:
            self.build(variables)
        accumulators = [self._plait_accumulators[self._get_variable_index(v)] for v in variables]
        for acc, g, v in zip(accumulators, grads, variables):
            acc.assign_add(dense_gradient(g, unwrap(v)))
        self._plait_passes.assign_add(1)

        def update() -> None:
            summed = [tf.convert_to_tensor(unwrap(acc)) for acc in accumulators]
            reduced = reduce(self, summed, variables)
            if average_aggregated_gradients:
                reduced = [g / passes for g in reduced]
            base.apply(self, reduced, variables)
            for acc in accumulators:
                acc.assign(tf.zeros_like(unwrap(acc)))
            self._plait_passes.assign(0)

        tf.cond(tf.equal(unwrap(self._plait_passes), passes), update, lambda: None)
        return None

    members = {"apply": apply, "build": build, "register_local_var": register_local_var,
               "_compute_gradients": compute_reduced, "_plait_distributed": True}
    if hasattr(base, "get_gradients"):
        members["get_gradients"] = get_gradients
    cls: Any = type(base.__name__, (base,), members)
    return cls.from_config(optimizer.get_config())
