"""Framework adapters: the only modules that import torch or tensorflow.

:func:`ops_for` finds the :class:`~plait.protocols.TensorOps` that owns a tensor
by the module of its type, so asking never imports a framework that the caller
has not already imported.
"""

from __future__ import annotations

import importlib
from typing import Any

from plait.errors import PlaitTypeError
from plait.protocols import TensorOps

__all__ = ["DTYPES", "adapter", "ops_for"]

#: Canonical dtype names every adapter maps to and from.
DTYPES = (
    "float16", "bfloat16", "float32", "float64",
    "int8", "uint8", "int16", "uint16", "int32", "int64", "bool",
)

_MODULES = {
    "numpy": "plait.adapters.numpy",
    "torch": "plait.adapters.torch",
    "tensorflow": "plait.adapters.tensorflow",
    "keras": "plait.adapters.tensorflow",
    "tf_keras": "plait.adapters.tensorflow",
    "ml_dtypes": "plait.adapters.numpy",
}
#: tensor type -> its adapter, filled on first use (every collective asks; importing the
#: module again each time cost a few microseconds per call)
_OWNERS: dict[type, TensorOps] = {}
_FRAMEWORKS = {"numpy": "plait.adapters.numpy", "torch": "plait.adapters.torch",
               "tensorflow": "plait.adapters.tensorflow"}


def adapter(framework: str) -> TensorOps:
    """Return the adapter of a framework by name.

    Args:
        framework: "numpy", "torch" or "tensorflow".

    Returns:
        That framework's :class:`TensorOps` (importing the framework).

    Raises:
        ConfigError: for an unknown framework name.
    """
    from plait.errors import invalid

    if framework not in _FRAMEWORKS:
        raise invalid("framework", framework, f"one of {sorted(_FRAMEWORKS)}")
    module: Any = importlib.import_module(_FRAMEWORKS[framework])
    ops: TensorOps = module.OPS
    return ops


def ops_for(x: Any) -> TensorOps:
    """Return the adapter that owns tensor ``x``.

    Args:
        x: a numpy array, torch tensor, TensorFlow tensor or variable, or Keras variable.

    Returns:
        The owning :class:`TensorOps`.

    Raises:
        PlaitTypeError: when ``x`` belongs to no supported framework.
    """
    kind = type(x)
    known = _OWNERS.get(kind)
    if known is not None:
        return known
    top = kind.__module__.split(".", 1)[0]
    path = _MODULES.get(top)
    if path is None:
        raise PlaitTypeError(
            f"unsupported tensor type {type(x).__module__}.{type(x).__qualname__}: "
            "expected a numpy array, a torch.Tensor, a tf.Tensor/tf.Variable or a Keras variable"
        )
    module: Any = importlib.import_module(path)
    ops: TensorOps = module.OPS
    _OWNERS[kind] = ops
    return ops
