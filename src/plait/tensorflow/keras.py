"""``import plait.tensorflow.keras as hvd``, as Horovod's ``import horovod.tensorflow.keras
as hvd``: this name is :mod:`plait.keras` itself (the same module object, so the two
imports share one state), not a copy."""

from __future__ import annotations

import sys

import plait.keras

sys.modules[__name__] = plait.keras
