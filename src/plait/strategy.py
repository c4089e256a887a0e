"""The one object a user configures for data parallelism: :class:`DataParallel`.

It owns the settings (backend, compression, mode) and turns a framework object
into its distributed form: a torch optimizer into a distributed optimizer, a
Keras optimizer into one whose ``apply`` averages, a ``tf.GradientTape`` into a
distributed tape. The framework code lives in ``plait.adapters``.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import runtime
from .compression import NoneCompressor, WireStats, check_settings
from .errors import invalid
from .parallel.data import DEFAULT_BUCKET_MB
from .protocols import Communicator

__all__ = ["MODES", "DataParallel"]

#: Data-parallel modes.
MODES = ("sync", "async")


def _framework_of(obj: Any) -> str:
    top = type(obj).__module__.split(".", 1)[0]
    if top == "torch" or any(c.__module__.startswith("torch") for c in type(obj).__mro__):
        return "torch"
    if top in ("keras", "tensorflow", "tf_keras") or any(
            c.__module__.startswith(("keras", "tensorflow")) for c in type(obj).__mro__):
        return "tensorflow"
    raise invalid("object", type(obj).__name__,
                  "a torch optimizer/module, a Keras 3 optimizer/model or a tf.GradientTape")


class DataParallel:
    """Synchronous (or asynchronous) data parallelism over MPI or Horovod.

    Args:
        backend: "mpi", "horovod" or "auto" (used when ``comm`` is not given).
        compression: a compressor (``plait.compression``), one of
            ``plait.compression.COMPRESSOR_NAMES`` ("none", "fp16", "bf16") or None.
        memory: its error-feedback memory (e.g. ``plait.compression.Residual()`` or
            "residual"), or None; it needs a lossy ``compression``.
        mode: "sync" (allreduce every step) or "async" (see ``plait.parallel.asyncdp``).
        op: "average" (default) or "sum" (or "adasum", Horovod's Adasum).
        bucket_mb: fusion bucket size in MiB; None (default): tuned in the first steps
            for torch (:mod:`plait.parallel.autotune`), 25 MiB for TensorFlow/Keras.
        backward_passes_per_step: local backward passes accumulated per step (torch, and
            Keras optimizers: every Nth ``apply`` reduces and applies the sum).
        comm: an existing communicator (e.g. the data axis of a :class:`Mesh`).
        **mode_options: options of the async algorithm.

    Attributes:
        wire_stats: a :class:`~plait.compression.WireStats` counting the bytes the
            synchronous gradient reductions hand to the communicator (``sent``) next to
            their uncompressed size (``raw``), compressed or not: ``wire_stats.last_step``
            is the last optimizer step's traffic, ``wire_stats.ratio`` the achieved
            compression ratio. Every optimizer step closes a step. Reductions inside
            ``tf.function`` (``model.fit`` without ``run_eagerly``) are not counted. The
            compressor given counts into it (if it already counted into a WireStats of
            its own, ``wire_stats`` is that one).

    Raises:
        ConfigError: for an unknown mode, a bad option, an unknown compressor or
            memory name, or a memory without a lossy compressor.
        PlaitTypeError: for a ``compression`` or ``memory`` of the wrong type.
    """

    def __init__(self, backend: str | None = None, *, compression: Any = None, memory: Any = None,
                 mode: str = "sync", op: str = "average", bucket_mb: float | None = None,
                 backward_passes_per_step: int = 1, comm: Communicator | None = None,
                 **mode_options: Any) -> None:
        if mode not in MODES:
            raise invalid("mode", mode, f"one of {list(MODES)}")
        if mode == "sync" and mode_options:
            raise invalid("options", sorted(mode_options), "no extra options with mode='sync'")
        self.backend, self.mode, self.op = backend, mode, op
        self.compression, self.memory = compression, memory
        self.wire_stats = WireStats()
        self._plain = NoneCompressor().count_into(self.wire_stats)  # counts uncompressed traffic
        self._settings()
        self.bucket_mb, self.passes = bucket_mb, backward_passes_per_step
        self.mode_options = mode_options
        self._comm = comm

    @property
    def comm(self) -> Communicator:
        """The data-parallel communicator (``plait.init(backend)`` on first use)."""
        if self._comm is None:
            self._comm = runtime.init(self.backend)
        return self._comm

    @property
    def _tf_bucket_mb(self) -> float:
        """TensorFlow's bucket size (it is not tuned)."""
        return DEFAULT_BUCKET_MB if self.bucket_mb is None else self.bucket_mb

    def _async(self) -> Any:
        return importlib.import_module("plait.parallel.asyncdp")

    def _settings(self) -> tuple[Any, Any]:
        """Validate ``compression``/``memory`` (again: they may have been reassigned).

        Returns:
            The compressor to hand to the reducers, counting into ``wire_stats`` (a
            :class:`NoneCompressor` for no compression), and the memory.
        """
        self.compression, self.memory = check_settings(self.compression, self.memory)
        wire = self.compression if self.compression is not None else self._plain
        if wire.stats is None:
            wire.count_into(self.wire_stats)
        self.wire_stats = wire.stats
        return wire, self.memory

    def optimizer(self, optimizer: Any, named_parameters: Any = None) -> Any:
        """The distributed form of a torch or Keras 3 optimizer.

        Args:
            optimizer: a ``torch.optim.Optimizer`` or a ``keras.optimizers.Optimizer``.
            named_parameters: ``model.named_parameters()`` (torch; names the collectives).

        Returns:
            The distributed optimizer (synchronous, or that of the async algorithm).

        Raises:
            ConfigError: for a bad ``compression``/``memory`` setting or optimizer.
            PlaitTypeError: for a ``compression``/``memory`` of the wrong type.
        """
        compression, memory = self._settings()
        if self.mode == "async":
            return self._async().wrap_optimizer(self, optimizer, named_parameters)
        if _framework_of(optimizer) == "torch":
            from plait.adapters.torch_optim import distributed_optimizer

            return distributed_optimizer(
                optimizer, self.comm, named_parameters, compression=compression,
                memory=memory, backward_passes_per_step=self.passes, op=self.op,
                bucket_mb=self.bucket_mb)
        from plait.adapters.tf_optim import distributed_keras_optimizer

        return distributed_keras_optimizer(optimizer, self.comm, op=self.op,
                                           compression=compression, memory=memory,
                                           bucket_mb=self._tf_bucket_mb,
                                           backward_passes_per_step=self.passes)

    def tape(self, tape: Any) -> Any:
        """A ``tf.GradientTape`` whose ``gradient()`` averages across ranks.

        Args:
            tape: the ``tf.GradientTape`` that records the forward pass.

        Returns:
            A distributed gradient tape.

        Raises:
            ConfigError: with ``mode="async"`` (the asynchronous algorithms step through
                :meth:`optimizer`; a tape would silently average synchronously), or for a
                bad ``compression``/``memory`` setting.
        """
        if self.mode == "async":
            raise invalid("mode", self.mode,
                          "'sync' for DataParallel.tape(); with mode='async' use a plain "
                          "tf.GradientTape and dp.optimizer(keras_optimizer).apply_gradients(...)")
        compression, memory = self._settings()
        from plait.adapters.tf_optim import DistributedGradientTape

        return DistributedGradientTape(tape, self.comm, op=self.op, compression=compression,
                                       memory=memory, bucket_mb=self._tf_bucket_mb)

    def broadcast(self, model: Any, optimizer: Any = None, root: int = 0) -> None:
        """Make every rank's model (and optimizer state) equal ``root``'s."""
        if _framework_of(model) == "torch":
            from plait.adapters.torch_optim import broadcast_optimizer_state, broadcast_parameters

            broadcast_parameters(model.state_dict(), self.comm, root)
            if optimizer is not None:
                broadcast_optimizer_state(optimizer, self.comm, root)
            return
        from plait.adapters.tf_optim import broadcast_variables

        variables = list(model.variables) if hasattr(model, "variables") else list(model)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            variables += list(optimizer.variables)
        broadcast_variables(variables, self.comm, root)

    def callbacks(self, root: int = 0) -> list[Any]:
        """Keras callbacks: broadcast at the start of training, average metrics per epoch."""
        from plait.adapters.keras_callbacks import (
            BroadcastGlobalVariablesCallback,
            MetricAverageCallback,
        )

        return [BroadcastGlobalVariablesCallback(root, self.comm), MetricAverageCallback(self.comm)]
