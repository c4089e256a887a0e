"""``import plait.tensorflow.keras as hvd``, as Horovod's ``import horovod.tensorflow.keras
as hvd``: this name is :mod:`plait.keras` itself (the same module object, so the two
imports share one state), not a copy; so are its submodules ``callbacks`` and
``elastic`` (``from plait.tensorflow.keras.callbacks import MetricAverageCallback``)."""

from __future__ import annotations

import sys

import plait.keras
import plait.keras.elastic

for _sub in ("callbacks", "elastic"):
    sys.modules[f"{__name__}.{_sub}"] = sys.modules[f"plait.keras.{_sub}"]
sys.modules[__name__] = plait.keras
