"""The helper of Horovod's ``horovod.tensorflow.util`` that scripts and Horovod's tests call:
``hvd.util._executing_eagerly()``."""

from __future__ import annotations

from plait.tensorflow import _executing_eagerly

__all__ = ["_executing_eagerly"]
