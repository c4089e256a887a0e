"""Tensor-parallel plans: which layer of an existing model becomes which parallel layer.

``TensorParallel({"fc1": Colwise(), "fc2": Rowwise()}, comm=tp).apply(model)``
first broadcasts the model's weights from rank 0 of ``comm`` (so every rank
shards the same dense weights), then replaces each named layer by its parallel
counterpart holding this rank's slice of those weights. The framework work is
done by ``plait.adapters.torch_tp`` (``torch.nn.Module``: named submodules,
replaced in place) or ``plait.adapters.keras_tp`` (Keras Sequential/functional
model: layers by name, returned as a rebuilt model sharing every other layer).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from plait.errors import PlaitTypeError, invalid
from plait.protocols import Communicator

__all__ = ["ChannelSplit", "Colwise", "Rowwise", "Style", "TensorParallel", "VocabParallel"]


@dataclass(frozen=True)
class Style:
    """How one layer is split; subclasses name the kind."""

    kind = "style"


@dataclass(frozen=True)
class Colwise(Style):
    """Split a linear layer's outputs across ranks (column parallel).

    Args:
        gather_output: allgather the output so every rank sees the whole of it.
    """

    gather_output: bool = False
    kind = "colwise"


@dataclass(frozen=True)
class Rowwise(Style):
    """Split a linear layer's inputs across ranks (row parallel); the output is summed.

    Args:
        input_is_parallel: the input arrives already split (from a ``Colwise`` layer);
            otherwise each rank takes its slice of the replicated input.
    """

    input_is_parallel: bool = True
    kind = "rowwise"


@dataclass(frozen=True)
class VocabParallel(Style):
    """Split an embedding table's rows (the vocabulary) across ranks."""

    kind = "vocab"


@dataclass(frozen=True)
class ChannelSplit(Style):
    """Split a convolution's output channels across ranks.

    Args:
        gather_output: allgather the channels so every rank sees the whole output.
    """

    gather_output: bool = True
    kind = "channels"


_ADAPTERS = (("torch", "plait.adapters.torch_tp"), ("keras", "plait.adapters.keras_tp"))


def _adapter_for(model: Any) -> Any:
    for top, path in _ADAPTERS:
        if top in sys.modules:
            module = importlib.import_module(path)
            if module.owns_model(model):
                return module
    raise PlaitTypeError(
        f"TensorParallel cannot shard a {type(model).__module__}.{type(model).__qualname__}: "
        "expected a torch.nn.Module or a Keras Sequential/functional model"
    )


class TensorParallel:
    """A tensor-parallel plan for an existing model.

    Args:
        plan: layer name (dotted torch submodule path, or Keras layer name) to a
            :class:`Style` (``Colwise()``, ``Rowwise()``, ``VocabParallel()``,
            ``ChannelSplit()``).
        comm: the tensor-parallel group (e.g. ``Mesh(...).tensor``); default
            ``plait.world()``.

    Raises:
        ConfigError: for an empty plan or a value that is not a :class:`Style`.
    """

    def __init__(self, plan: Mapping[str, Style], comm: Communicator | None = None) -> None:
        if not isinstance(plan, Mapping) or not plan:
            raise invalid("plan", plan, "a non-empty mapping of layer name to Colwise()/Rowwise()/...")
        for name, style in plan.items():
            if not isinstance(name, str) or not isinstance(style, Style) or type(style) is Style:
                raise invalid(f"plan[{name!r}]", style,
                              "Colwise(), Rowwise(), VocabParallel() or ChannelSplit()")
        self.plan = dict(plan)
        self._comm = comm

    @property
    def comm(self) -> Communicator:
        """The tensor-parallel group."""
        if self._comm is None:
            from plait import runtime

            self._comm = runtime.world()
        return self._comm

    def apply(self, model: Any) -> Any:
        """Broadcast ``model``'s weights from rank 0, then shard the planned layers.

        Args:
            model: a ``torch.nn.Module`` or a Keras Sequential/functional model.

        Returns:
            The sharded model: the same torch module (changed in place), or for
            Keras a rebuilt model sharing every layer that is not in the plan.

        Raises:
            ConfigError: a planned layer is missing, or a split dimension is not
                divisible by the group size (the message names the layer).
            PlaitTypeError: the model, or a planned layer, has a type that cannot be split.
        """
        adapter = _adapter_for(model)
        return adapter.apply_plan(model, self.plan, self.comm)

    def __repr__(self) -> str:
        return f"TensorParallel({self.plan!r}, comm size={self.comm.size})"
