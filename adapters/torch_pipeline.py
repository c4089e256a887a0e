"""PyTorch glue for pipeline parallelism (``plait.Pipeline``).

A :class:`TorchStage` is one model chunk (a run of consecutive layers) as a
``plait.parallel.pipeline.runtime.StageExecutor``: ``forward`` keeps the
autograd graph of each micro-batch (or, with activation recomputation, only
its input and the RNG state), ``backward`` runs ``torch.autograd.backward``
with the upstream gradient, so parameter gradients accumulate in ``.grad``
over the micro-batches of a step. :class:`TorchParams` holds the parameters
of this rank's chunks and their optimizer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from plait.parallel.pipeline.errors import PartitionError, PipelineTypeError

__all__ = ["TorchParams", "TorchStage", "is_deferred", "layer_times", "layers_of", "materialize",
           "param_counts"]

framework = "torch"


def layers_of(model: Any) -> list[torch.nn.Module]:
    """The layers of a ``torch.nn.Sequential`` or a list of modules, in order.

    Raises:
        PipelineTypeError: ``model`` is neither, or an entry is not a module.
    """
    if isinstance(model, torch.nn.Sequential):
        layers = list(model.children())
    elif isinstance(model, (list, tuple, torch.nn.ModuleList)):
        layers = list(model)
    else:
        raise PipelineTypeError(
            f"model must be a torch.nn.Sequential or a list of torch.nn.Module, got "
            f"{type(model).__module__}.{type(model).__qualname__}")
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.nn.Module):
            raise PipelineTypeError(f"model[{i}] must be a torch.nn.Module, got {type(layer).__name__}")
    if not layers:
        raise PartitionError("model must have at least one layer, got an empty model")
    return layers


def param_counts(layers: Sequence[torch.nn.Module]) -> list[int]:
    """Number of trainable parameter elements of each layer."""
    return [sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in layers]


def is_deferred(layers: Sequence[torch.nn.Module]) -> bool:
    """Whether the model was described on the ``meta`` device (each rank builds its own stages)."""
    return any(t.is_meta for layer in layers for t in (*layer.parameters(), *layer.buffers()))


def _reset(module: torch.nn.Module, where: str) -> None:
    for name, sub in module.named_modules():
        own = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        if not own:
            continue
        reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
        if reset is None:
            raise PartitionError(
                f"{where}: submodule {name or '(the layer)'} ({type(sub).__name__}) has parameters "
                f"on the meta device but no reset_parameters() to initialise them; give it one "
                f"or build the model on the cpu")
        reset()


def materialize(layers: Sequence[torch.nn.Module], indices: Sequence[int] | None = None,
                seed: int = 0, input_shape: Any = None) -> None:
    """Give layers described on the ``meta`` device real (cpu) storage and initial values, in place.

    Layer ``i`` is initialised by the ``reset_parameters()`` of its submodules under
    ``torch.manual_seed(seed + i)`` (the caller's RNG state is kept), so a rank that
    materialises only its own stages' layers holds the same weights as a serial model
    materialised whole: ``materialize(model)`` builds that serial reference.

    Args:
        layers: The model's layers (a ``Sequential``'s children), some on ``meta``.
        indices: The layers to materialise (default: all).
        seed: Base seed of the per-layer initialisation.
        input_shape: Unused (torch layers know their shapes when described).

    Raises:
        PartitionError: A submodule with parameters has no ``reset_parameters``.
    """
    del input_shape
    layers = list(layers.children()) if isinstance(layers, torch.nn.Sequential) else list(layers)
    for i in range(len(layers)) if indices is None else indices:
        layer = layers[i]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + i)
            layer.to_empty(device="cpu")
            _reset(layer, f"model[{i}] ({type(layer).__name__})")


def layer_times(layers: Sequence[torch.nn.Module], sample: Any, repeats: int = 3) -> list[float]:
    """Measured forward + backward seconds of each layer on ``sample`` (best of ``repeats``).

    Gradients produced while measuring are discarded.

    Raises:
        PartitionError: The model is on the ``meta`` device (nothing to time).
    """
    if is_deferred(layers):
        raise PartitionError("balance='time' needs a model with real weights, got one on the meta "
                             "device; use balance='params' or a list of layer counts")
    x = torch.as_tensor(sample)
    times = []
    for layer in layers:
        best = float("inf")
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            best = min(best, time.perf_counter() - start)
        times.append(best)
        x = out.detach()
    for layer in layers:
        for p in layer.parameters():
            p.grad = None
    return times


def _tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.from_numpy(np.asarray(x))


class TorchStage:
    """One chunk of consecutive layers of a torch model on this rank.

    Args:
        layers: The chunk's modules (they keep their parameters).
        first: Whether this is virtual stage 0 (its input needs no gradient).
        last: Whether this is the last virtual stage (computes the loss).
        loss_fn: ``loss_fn(output, target) -> scalar``, on the last stage.
        scale: Factor applied to each micro-batch loss before backward
            (``1 / microbatches``: the step's loss is the mean over micro-batches).
        checkpoint: Recompute the chunk's forward in backward instead of
            keeping its activations (the CPU RNG state is replayed).
    """

    def __init__(self, layers: Sequence[torch.nn.Module], *, first: bool, last: bool,
                 loss_fn: Callable[[Any, Any], Any] | None, scale: float,
                 checkpoint: bool = False) -> None:
        self.module = torch.nn.Sequential(*layers)
        self.first, self.last, self.loss_fn = first, last, loss_fn
        self.scale, self.checkpoint = scale, checkpoint
        self.saved: dict[int, tuple[Any, ...]] = {}
        #: Set by the runtime: lets messages in flight move; called between layers, in
        #: forward and (through hooks on the layers' outputs) in backward.
        self.progress: Callable[[], None] | None = None

    def _input(self, x: Any) -> torch.Tensor:
        t = _tensor(x)
        if self.first or not t.is_floating_point():
            return t
        return t.detach().requires_grad_(True)

    def _poke(self, grad: torch.Tensor) -> None:
        """A gradient hook between two layers: let messages move, keep ``grad``."""
        if self.progress is not None:
            self.progress()

    def _run(self, x: torch.Tensor, target: Any) -> torch.Tensor:
        if self.progress is None:
            out = self.module(x)
        else:
            out = x
            for i, layer in enumerate(self.module):
                if i:
                    self.progress()
                    if isinstance(out, torch.Tensor) and out.requires_grad:
                        out.register_hook(self._poke)
                out = layer(out)
        if self.last:
            if self.loss_fn is None:
                raise PipelineTypeError("loss_fn is required on the last stage, got None")
            out = self.loss_fn(out, _tensor(target))
        return out

    def forward(self, mb: int, x: Any, target: Any | None = None) -> Any:
        """Run micro-batch ``mb``; return the output (detached), or the loss on the last stage."""
        inp = self._input(x)
        if self.checkpoint:
            rng = torch.get_rng_state()
            with torch.no_grad():
                out = self._run(inp, target)
            self.saved[mb] = (inp, target, rng)
        else:
            out = self._run(inp, target)
            self.saved[mb] = (inp, out)
        return out.item() if self.last else out.detach()

    def backward(self, mb: int, grad: Any | None) -> Any | None:
        """Backpropagate micro-batch ``mb``; return the gradient of its input."""
        saved = self.saved.pop(mb)
        inp = saved[0]
        if self.checkpoint:
            _, target, rng = saved
            keep = torch.get_rng_state()
            torch.set_rng_state(rng)
            with torch.enable_grad():
                out = self._run(inp, target)
            torch.set_rng_state(keep)
        else:
            out = saved[1]
        if self.last:
            (out * self.scale).backward()
        else:
            out.backward(_tensor(grad))
        return None if self.first or inp.grad is None else inp.grad

    def infer(self, x: Any) -> Any:
        """Evaluation-mode forward without autograd."""
        was = self.module.training
        self.module.eval()
        with torch.no_grad():
            out = self.module(_tensor(x))
        self.module.train(was)
        return out


class TorchParams:
    """The parameters of this rank's chunks and their optimizer.

    Args:
        stages: This rank's :class:`TorchStage` objects.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer`` (a factory,
            since only this rank's parameters may be given to it), or None to
            step yourself with :meth:`parameters`.

    Raises:
        PipelineTypeError: ``optimizer`` is an optimizer instance or not callable.
    """

    def __init__(self, stages: Sequence[TorchStage], optimizer: Any) -> None:
        seen: set[int] = set()
        self.params: list[torch.nn.Parameter] = []
        for st in stages:
            for p in st.module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self.params.append(p)
        if isinstance(optimizer, torch.optim.Optimizer):
            raise PipelineTypeError(
                "optimizer must be a factory such as lambda params: torch.optim.SGD(params, lr=0.1), "
                "since each rank may only optimise its stage's parameters; got an optimizer instance")
        if optimizer is not None and not callable(optimizer):
            raise PipelineTypeError(
                f"optimizer must be a callable params -> torch.optim.Optimizer or None, "
                f"got {type(optimizer).__name__}")
        self.optimizer = optimizer(self.params) if optimizer is not None and self.params else None

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's trainable parameters."""
        return list(self.params)

    def gradients(self) -> list[torch.Tensor]:
        """Accumulated gradient of each parameter (zeros where none)."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def set_gradients(self, grads: Sequence[Any]) -> None:
        """Replace the accumulated gradients (e.g. by their data-parallel average)."""
        for p, g in zip(self.params, grads):
            p.grad = _tensor(g).to(p.dtype).reshape(p.shape)

    def zero_grad(self) -> None:
        """Forget accumulated gradients."""
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """Apply the optimizer (no-op without one)."""
        if self.optimizer is not None:
            self.optimizer.step()
