"""Horovod's ``hvd.load_model`` for Keras 3 (``plait.keras``): load a saved model and
give it a distributed copy of its optimizer, with the saved optimizer state.

Horovod 0.28 maps every optimizer class name to a wrapping factory in
``custom_objects``; Keras 3 looks built-in optimizers up by module, not through
``custom_objects``, so here the model is loaded as saved and its optimizer is then
replaced by a distributed one built from the same config, whose variables (step
count, slots such as Adam's moments, learning rate) are copied from the loaded one.
A model saved with a plait distributed optimizer (whose class, built at run time,
names a Keras optimizer class) loads here too. Also the default TF1 session that
Horovod's Keras ``broadcast_global_variables`` runs in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras

from plait.errors import invalid

from .keras_syncbn import SyncBatchNormalization

__all__ = ["default_session", "load_model", "plain_optimizer"]


def default_session() -> Any:
    """The default ``tf.compat.v1.Session`` (where Horovod's Keras helpers run their TF1
    ops: Keras 3 has no ``backend.get_session()``), or None."""
    import tensorflow as tf

    return tf.compat.v1.get_default_session()


def plain_optimizer(optimizer: Any) -> Any:
    """``optimizer`` itself, or a plain one of the same config when it is already a
    plait distributed optimizer (so that it is not wrapped twice).

    Args:
        optimizer: a Keras 3 optimizer.

    Returns:
        An optimizer whose class is not a plait distributed one.
    """
    if not getattr(type(optimizer), "_plait_distributed", False):
        return optimizer
    base: Any = next(c for c in type(optimizer).__mro__ if not c.__dict__.get("_plait_distributed"))
    return base.from_config(optimizer.get_config())


def _objects(custom_optimizers: Sequence[Any] | None,
             custom_objects: Mapping[str, Any] | None) -> dict[str, Any]:
    objects: dict[str, Any] = {  # Keras' optimizers by name: what a model saved with a
        # plait DistributedOptimizer names (its class is built at run time)
        name: cls for name, cls in vars(keras.optimizers).items()
        if isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)}
    objects["SyncBatchNormalization"] = SyncBatchNormalization
    if custom_optimizers is not None:
        if isinstance(custom_optimizers, (str, bytes, type)):
            raise invalid("custom_optimizers", custom_optimizers,
                          "a list of keras.optimizers.Optimizer subclasses")
        for cls in custom_optimizers:
            if not (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)):
                raise invalid("custom_optimizers", custom_optimizers,
                              "keras.optimizers.Optimizer subclasses only (Keras 3)")
            objects[cls.__name__] = cls
    if custom_objects is not None:
        if not isinstance(custom_objects, Mapping):
            raise invalid("custom_objects", custom_objects, "a dict of names to classes or "
                          "functions")
        objects.update(custom_objects)
    return objects


def load_model(filepath: Any, wrap: Callable[[Any], Any],
               custom_optimizers: Sequence[Any] | None = None,
               custom_objects: Mapping[str, Any] | None = None) -> Any:
    """Load a Keras 3 model and replace its optimizer by ``wrap(optimizer)``.

    Args:
        filepath: a ``.keras`` file (anything ``keras.models.load_model`` takes).
        wrap: builds the distributed optimizer from a plain Keras optimizer.
        custom_optimizers: optimizer classes the file needs that are not Keras' own.
        custom_objects: other classes or functions the file needs, by name.

    Returns:
        The model; compiled with the distributed optimizer (holding the saved state)
        when it was saved compiled, else as loaded.

    Raises:
        ConfigError: for bad ``custom_optimizers``/``custom_objects``, or when the
            distributed optimizer's variables do not match the loaded one's.
        ValueError: Keras' errors for a file that cannot be loaded.
    """
    model = keras.models.load_model(filepath, custom_objects=_objects(custom_optimizers,
                                                                      custom_objects))
    loaded = getattr(model, "optimizer", None)
    if loaded is None:
        return model
    distributed = wrap(plain_optimizer(loaded))
    if loaded.built:
        distributed.build(model.trainable_variables)
        if [tuple(v.shape) for v in distributed.variables] != \
                [tuple(v.shape) for v in loaded.variables]:
            raise invalid("filepath", filepath, "a model whose optimizer state fits a fresh "
                          f"{type(loaded).__name__} of its config (the loaded one has "
                          f"{len(loaded.variables)} variables, a fresh one "
                          f"{len(distributed.variables)})")
        for new, old in zip(distributed.variables, loaded.variables):
            new.assign(old)
    model.optimizer = distributed
    model.train_function = None
    return model
