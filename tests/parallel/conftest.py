"""Fixtures for tests that run on every rank of a job (tests/parallel/job_*.py).

``comm`` is parametrized over the backends this launch can use, ``fw`` over
frameworks, so one test body covers backend x framework. Frameworks and MPI are
imported lazily: the outer (single-process) pytest also loads this file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

FRAMEWORKS = ("numpy", "torch", "tensorflow", "tf.function")


def backends() -> list[str]:
    """Backends usable under this launcher (no MPI world under horovodrun --gloo)."""
    forced = os.environ.get("PLAIT_TEST_BACKENDS")
    if forced:
        return forced.split(",")
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return ["mpi", "horovod"]
    return ["horovod"]


_COMMS: dict[str, Any] = {}


def make_comm(backend: str) -> Any:
    """One world communicator per backend for the whole rank (both may coexist)."""
    if backend not in _COMMS:
        if backend == "mpi":
            from mpi4py import MPI
            from plait.collectives.mpi import MPICommunicator

            _COMMS[backend] = MPICommunicator(MPI.COMM_WORLD.Dup(), timeout=60)
        else:
            from plait.collectives.horovod import HorovodCommunicator

            _COMMS[backend] = HorovodCommunicator(
                os.environ.get("PLAIT_TEST_HOROVOD_FRAMEWORK", "torch"), timeout=60)
    return _COMMS[backend]


def _across_hosts() -> bool:
    """Whether this rank's job spans several hosts (Open MPI then talks TCP between them)."""
    size = os.environ.get("OMPI_COMM_WORLD_SIZE")
    return size is not None and os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") != size


@pytest.hookimpl(trylast=True)  # after pytest groups the items by their session parameters
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Across hosts, every test on the MPI backend runs before the first one on Horovod.

    Once Horovod is started its background thread blocks in MPI calls, and beside it
    Open MPI's TCP transport holds plait's messages back for a minute or more (README,
    "What does not work"; ``tools/mpi_threads.py``). Pytest's own grouping interleaves
    the backends across files and frameworks: a late rank's barrier on the MPI backend,
    run after the Horovod tests of the same processes, once stalled past its 60 s.
    """
    if _across_hosts():
        items.sort(key=lambda item: getattr(item, "callspec", None) is not None
                   and item.callspec.params.get("comm") == "horovod")


@pytest.fixture(params=backends(), scope="session")
def comm(request: pytest.FixtureRequest) -> Any:
    return make_comm(request.param)


class Framework:
    """Converts numpy test data to a framework's tensors and back."""

    def __init__(self, name: str) -> None:
        self.name = name

    def tensor(self, a: np.ndarray, dtype: str | None = None) -> Any:
        dtype = dtype or str(a.dtype)
        if self.name == "numpy":
            if dtype == "bfloat16":
                import ml_dtypes

                return a.astype(ml_dtypes.bfloat16)
            return a.astype(dtype)
        if self.name == "torch":
            import torch
            from plait.adapters.torch import torch_dtype

            return torch.from_numpy(np.asarray(a, dtype=np.float64 if dtype == "bfloat16"
                                               else dtype).copy()).to(torch_dtype(dtype))
        import tensorflow as tf
        from plait.adapters.tensorflow import tf_dtype

        return tf.cast(tf.convert_to_tensor(a), tf_dtype(dtype))

    def numpy(self, t: Any) -> np.ndarray:
        if self.name == "torch":
            import torch

            if t.dtype == torch.bfloat16:
                t = t.float()
            return t.numpy()
        if self.name in ("tensorflow", "tf.function"):
            import tensorflow as tf

            if t.dtype == tf.bfloat16:
                t = tf.cast(t, tf.float32)
            return np.asarray(t.numpy())
        a = np.asarray(t)
        return a.astype(np.float32) if a.dtype.name == "bfloat16" else a

    def run(self, fn: Callable[..., Any], *tensors: Any) -> Any:
        """Call ``fn`` eagerly, or inside ``tf.function`` for the graph flavour."""
        if self.name != "tf.function":
            return fn(*tensors)
        import tensorflow as tf

        return tf.function(fn)(*tensors)


@pytest.fixture(params=FRAMEWORKS, scope="session")
def fw(request: pytest.FixtureRequest) -> Framework:
    """Every framework, TensorFlow both eagerly and inside ``tf.function``."""
    return Framework(request.param)


@pytest.fixture(params=FRAMEWORKS[:3], scope="session")
def efw(request: pytest.FixtureRequest) -> Framework:
    """Frameworks for eager-only operations (async handles, point-to-point)."""
    return Framework(request.param)
