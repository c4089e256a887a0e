"""Asynchronous data parallelism: fast ranks keep going instead of waiting for the slowest.

Algorithms (``plait.DataParallel(mode="async", algorithm=..., **options)``):

* ``"parameter_server"`` (alias ``"ps"``; options ``servers=1``, ``staleness=None``):
  server ranks ``0 .. servers-1`` hold shards of the parameters and apply each
  worker's push as it arrives. Server ranks call ``optimizer.serve()`` instead of
  training; it returns when every worker called ``synchronize()``.
* ``"ssp"`` (``staleness=1``): stale-synchronous parallel; ``staleness=0`` is synchronous.
* ``"local_sgd"`` (``period=4``, ``warmup_steps=0``): periodic model averaging.
* ``"delayed"``: gradient averaging applied one step late, overlapping the next step.
* ``"gossip"`` (``topology="ring"|"shift"``): pairwise averaging with one neighbour per step.

Every rank calls ``optimizer.synchronize()`` once at the end (collective): it
finishes pending work and leaves one identical model on every rank, for
evaluation and saving. ``optimizer.metrics`` holds this rank's
:class:`AsyncMetrics`; ``optimizer.gather_metrics()`` (collective) every rank's.

``local_sgd`` and ``delayed`` use collectives only (any backend, any launcher;
the DataParallel ``compression``/``memory`` apply to them). ``parameter_server``,
``ssp`` and ``gossip`` need point-to-point messages (MPI backend, or the Horovod
backend under mpirun); ``parameter_server`` and ``ssp`` allow ranks to stop after
different numbers of steps, the collective algorithms do not (ranks that call
different collectives get a MismatchError).

Checkpoints: ``plait.Checkpoint`` saves every rank's algorithm state
(:meth:`AsyncAlgorithm.state_dict`, taken at the same step on every rank after
draining what is in flight) with its replica; parameter servers instead write
consistent snapshots from ``optimizer.serve(checkpoint=ckpt, model=model)``.

This package is framework-free: algorithms see the model as flat float32 numpy
vectors through :class:`Replica`; ``plait.adapters.torch_async`` and
``plait.adapters.tf_async`` implement it.
"""

from __future__ import annotations

import importlib
from typing import Any

from plait.errors import invalid
from plait.protocols import Communicator

from .base import AsyncAlgorithm, require_point_to_point
from .delayed import DelayedAveraging
from .gossip import Gossip
from .local_sgd import LocalSGD
from .metrics import AsyncMetrics
from .ps import ParameterServer
from .replica import Replica
from .ssp import StaleSynchronous

__all__ = ["ALGORITHMS", "AsyncAlgorithm", "AsyncMetrics", "DelayedAveraging", "Gossip", "LocalSGD",
           "ParameterServer", "Replica", "StaleSynchronous", "make_algorithm",
           "require_point_to_point", "wrap_optimizer"]

#: algorithm name -> class.
ALGORITHMS: dict[str, type[AsyncAlgorithm]] = {
    "parameter_server": ParameterServer, "ps": ParameterServer, "ssp": StaleSynchronous,
    "local_sgd": LocalSGD, "delayed": DelayedAveraging, "gossip": Gossip,
}
_COMPRESSIBLE = (LocalSGD, DelayedAveraging)


def make_algorithm(comm: Communicator, algorithm: str = "local_sgd", compression: Any = None,
                   memory: Any = None, **options: Any) -> AsyncAlgorithm:
    """Build an algorithm by name.

    Args:
        comm: the data-parallel communicator.
        algorithm: one of :data:`ALGORITHMS`.
        compression: a compressor (only ``local_sgd`` and ``delayed``).
        memory: its error-feedback memory.
        **options: the algorithm's options (see the module docstring).

    Returns:
        The algorithm (not yet set up).

    Raises:
        ConfigError: for an unknown algorithm, an unknown option or compression
            with an algorithm that does not support it.
    """
    if algorithm not in ALGORITHMS:
        raise invalid("algorithm", algorithm, f"one of {sorted(ALGORITHMS)}")
    cls = ALGORITHMS[algorithm]
    if (compression is not None or memory is not None) and not issubclass(cls, _COMPRESSIBLE):
        raise invalid("compression", compression,
                      f"None with algorithm={algorithm!r}; compression combines with 'local_sgd' "
                      "and 'delayed'")
    if issubclass(cls, _COMPRESSIBLE):
        options = {**options, "compression": compression, "memory": memory}
    try:
        return cls(comm, **options)
    except TypeError as exc:
        import inspect

        valid = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "comm")]
        raise invalid("options", sorted(options), f"options of {algorithm!r} among {valid}") from exc


def wrap_optimizer(strategy: Any, optimizer: Any, named_parameters: Any = None) -> Any:
    """The asynchronous form of a torch or Keras 3 optimizer (``DataParallel.optimizer``).

    Args:
        strategy: the ``plait.DataParallel`` (its ``comm``, ``compression``,
            ``memory`` and ``mode_options``: ``algorithm`` plus that algorithm's options).
        optimizer: a ``torch.optim.Optimizer`` or a ``keras.optimizers.Optimizer``.
        named_parameters: unused (parameters come from the optimizer); accepted for symmetry.

    Returns:
        A torch ``AsyncOptimizer`` or a Keras optimizer subclass, with ``serve()``,
        ``synchronize()``, ``metrics``, ``is_server`` and ``gather_metrics()``.

    Raises:
        ConfigError: for a bad algorithm or option, or an unsupported optimizer.
    """
    options = dict(strategy.mode_options)
    name = options.pop("algorithm", "local_sgd")
    algo = make_algorithm(strategy.comm, name, strategy.compression, strategy.memory, **options)
    top = type(optimizer).__module__.split(".", 1)[0]
    if top == "torch":
        module = importlib.import_module("plait.adapters.torch_async")
    elif top in ("keras", "tensorflow"):
        module = importlib.import_module("plait.adapters.tf_async")
    else:
        raise invalid("optimizer", type(optimizer).__name__,
                      "a torch.optim.Optimizer or a keras.optimizers.Optimizer")
    return module.async_optimizer(optimizer, algo)
