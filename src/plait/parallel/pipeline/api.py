"""``plait.Pipeline``: pipeline-parallel training of a sequential model.

The model (a ``torch.nn.Sequential``, a Keras ``Sequential``, or a list of
layers of either) is split into consecutive chunks; pipeline rank ``r`` keeps
the chunks of virtual stages ``r, r + P, ...`` and nothing else. Each
:meth:`Pipeline.train_step` splits the batch into micro-batches, runs the
schedule's actions through one framework-free runtime
(:mod:`.runtime`), averages the stage's gradients over its data-parallel group
when built on a :class:`plait.Mesh`, steps the optimizer and returns the loss
on every rank. The framework glue is picked by the model's type
(``plait.adapters.torch_pipeline`` or ``plait.adapters.keras_pipeline``).

Example (torch, 2 ranks)::

    pipe = plait.Pipeline(torch.nn.Sequential(...), stages=2, microbatches=4,
                          schedule="1f1b", loss_fn=torch.nn.CrossEntropyLoss(),
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    loss = pipe.train_step(x, y)    # same x, y on every rank (or x on the first, y on the last)
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from plait.protocols import Communicator

from .errors import PartitionError, PipelineError, PipelineTypeError
from .partition import balance_by_cost, check_balance, check_microbatches, partition_sizes_to_bounds
from .runtime import Runtime, StepStats, check_tags
from .schedule import SCHEDULES, get_schedule

__all__ = ["Pipeline", "framework_of"]

_GLUE = {"torch": "plait.adapters.torch_pipeline", "keras": "plait.adapters.keras_pipeline"}


def framework_of(model: Any) -> str:
    """``"torch"`` or ``"keras"``, from the module of the model's (or first layer's) type.

    Raises:
        PipelineTypeError: Neither framework owns the model.
    """
    probe = model
    if isinstance(model, (list, tuple)) and model:
        probe = model[0]
    top = type(probe).__module__.split(".", 1)[0]
    if top == "torch":
        return "torch"
    if top in ("keras", "tf_keras", "tensorflow"):
        return "keras"
    raise PipelineTypeError(
        f"model must be a torch.nn.Sequential, a keras.Sequential or a list of torch modules / "
        f"keras layers, got {type(model).__module__}.{type(model).__qualname__}")


def _even(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def _rows(x: Any) -> int:
    if x is None:
        return -1
    from plait.adapters import ops_for

    shape = ops_for(x).shape(x)
    if not shape:
        raise PipelineTypeError(f"batches must have a batch dimension, got a scalar {x!r}")
    return int(shape[0])


class Pipeline:
    """Pipeline-parallel training of a sequential torch or Keras model.

    Args:
        model: ``torch.nn.Sequential``, ``keras.Sequential`` (built), or a list of
            torch modules / Keras layers. Every rank passes the same model (same
            initial weights); the pipeline references only this rank's stages' layers
            (drop your own reference to the model to free the others' memory).
        stages: Pipeline ranks ``P`` (default: all ranks of the pipeline communicator).
        microbatches: Micro-batches per step ``M``; the batch must divide by it.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"``.
        balance: How layers are split into the ``V = P * chunks`` virtual stages:
            None (equal layer counts, earlier stages take the remainder), a list
            of ``V`` layer counts, ``"params"`` (balance trainable parameter
            counts) or ``"time"`` (balance forward+backward time per layer,
            measured on pipeline rank 0 on ``sample_input`` and broadcast).
        chunks: Model chunks per rank for ``"interleaved"`` (default 2); must be
            1 (the default) otherwise.
        comm: A :class:`plait.Mesh` (pipeline over ``mesh.pipeline``, gradients
            averaged over ``mesh.data``), a communicator (all its ranks form one
            pipeline), or None for ``plait.world()``/``plait.init()``.
        loss_fn: torch: ``loss_fn(output, target)``; Keras: ``loss_fn(y_true, y_pred)``;
            reduced as a mean over the micro-batch.
        optimizer: torch: ``callable(params) -> torch.optim.Optimizer``; Keras: an
            optimizer or ``callable(variables) -> optimizer``; None to step yourself.
        checkpoint: Recompute activations in backward: a bool for every stage or
            one bool per virtual stage.
        sample_input: An input batch, required by ``balance="time"``.

    Raises:
        PipelineTypeError: An argument has the wrong type.
        PartitionError: The model cannot be split into the stages, a bad balance.
        PipelineError: Unknown schedule, stages different from the pipeline size,
            bad ``chunks``, ``microbatches`` not a multiple of ``stages`` for
            ``"interleaved"``.

    All of these are raised before any communication.

    Attributes:
        stage_ids: The virtual stages this rank runs.
        balance: Layers per virtual stage; ``bounds``: their ``(start, stop)``.
        local_layers: The layers this rank holds, by virtual stage.
        last_stats: :class:`~.runtime.StepStats` of the latest step on this rank.
    """

    def __init__(self, model: Any, stages: int | None = None, microbatches: int = 1,
                 schedule: str = "1f1b", *, balance: Any = None, chunks: int | None = None,
                 comm: Any = None, loss_fn: Any = None, optimizer: Any = None,
                 checkpoint: bool | Sequence[bool] = False, sample_input: Any = None) -> None:
        self.framework = framework_of(model)
        glue: Any = importlib.import_module(_GLUE[self.framework])
        layers = glue.layers_of(model)
        self.pipe_comm, self.data_comm = self._comms(comm)
        size = self.pipe_comm.size
        p = size if stages is None else stages
        if isinstance(p, bool) or not isinstance(p, int):
            raise PipelineTypeError(f"stages must be an integer, got {stages!r}")
        if p != size:
            raise PipelineError(
                f"stages must equal the number of pipeline ranks ({size}), got stages={p}; "
                f"launch {p} ranks (or a Mesh with pp={p})")
        if not isinstance(schedule, str) or schedule.strip().lower() not in SCHEDULES:
            raise PipelineError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        self.schedule_name = schedule.strip().lower()
        v = chunks if chunks is not None else (2 if self.schedule_name == "interleaved" else 1)
        # Validates microbatches, chunks and (for interleaved) M % P == 0.
        self.schedule = get_schedule(self.schedule_name, p, microbatches, v)
        self.stages, self.chunks, self.microbatches = p, v, microbatches
        self.vstages = p * v
        check_tags(self.vstages, microbatches)
        if len(layers) < self.vstages:
            raise PartitionError(
                f"model has {len(layers)} layers, fewer than the {self.vstages} (virtual) stages "
                f"requested (stages={p} x chunks={v}); use fewer stages or chunks")
        if loss_fn is None:
            raise PipelineTypeError("loss_fn is required: the last stage computes the loss")
        marks = self._checkpoint(checkpoint)
        self.balance = self._balance(balance, layers, glue, sample_input)
        self.bounds = partition_sizes_to_bounds(self.balance)
        rank = self.pipe_comm.rank
        self.stage_ids = [c * p + rank for c in range(v)]
        self.local_layers = {s: layers[a:b] for s, (a, b) in enumerate(self.bounds)
                             if s in self.stage_ids}
        stage_cls = glue.TorchStage if self.framework == "torch" else glue.KerasStage
        params_cls = glue.TorchParams if self.framework == "torch" else glue.KerasParams
        self.executors = {
            s: stage_cls(self.local_layers[s], first=s == 0, last=s == self.vstages - 1,
                         loss_fn=loss_fn, scale=1.0 / microbatches, checkpoint=marks[s])
            for s in self.stage_ids}
        self.params = params_cls([self.executors[s] for s in self.stage_ids], optimizer)
        self.runtime = Runtime(self.pipe_comm, dict(self.executors), self.vstages, microbatches)
        self.actions = self.schedule[rank]
        self.last_stats = StepStats()
        self._reducer: Any = None

    # -- construction helpers ----------------------------------------------------------
    @staticmethod
    def _comms(comm: Any) -> tuple[Communicator, Communicator | None]:
        if comm is None:
            from plait import runtime

            return runtime.init(), None
        if hasattr(comm, "pipeline") and hasattr(comm, "data"):  # a plait.Mesh
            if comm.shape.tp != 1:
                raise NotImplementedError(
                    "Pipeline on a Mesh with tp > 1 is not supported yet; use tp=1")
            return comm.pipeline, (comm.data if comm.data.size > 1 else None)
        if not all(hasattr(comm, a) for a in ("send", "recv", "rank", "size")):
            raise PipelineTypeError(
                f"comm must be a plait.Mesh, a plait Communicator or None, got {type(comm).__name__}")
        return comm, None

    def _checkpoint(self, checkpoint: Any) -> list[bool]:
        if isinstance(checkpoint, bool):
            return [checkpoint] * self.vstages
        if (isinstance(checkpoint, Sequence) and len(checkpoint) == self.vstages
                and all(isinstance(c, bool) for c in checkpoint)):
            return list(checkpoint)
        raise PipelineTypeError(
            f"checkpoint must be a bool or a list of {self.vstages} bools (one per virtual "
            f"stage), got {checkpoint!r}")

    def _balance(self, balance: Any, layers: list[Any], glue: Any, sample: Any) -> list[int]:
        n, k = len(layers), self.vstages
        if balance is None:
            return _even(n, k)
        if isinstance(balance, str):
            if balance == "params":
                return balance_by_cost([float(c) for c in glue.param_counts(layers)], k)
            if balance == "time":
                if sample is None:
                    raise PipelineTypeError(
                        "balance='time' needs sample_input=<an input batch> to time each layer")
                costs = glue.layer_times(layers, sample) if self.pipe_comm.rank == 0 else None
                costs = self.pipe_comm.broadcast_object(costs, root=0)
                return balance_by_cost(costs, k)
            raise PartitionError(
                f"balance must be None, a list of {k} layer counts, 'params' or 'time', got {balance!r}")
        return check_balance(balance, n, k)

    # -- training ----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank's position in the pipeline (0 .. stages - 1)."""
        return self.pipe_comm.rank

    @property
    def is_first(self) -> bool:
        """Whether this rank runs virtual stage 0 (needs the input)."""
        return 0 in self.executors

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last virtual stage (needs the target, computes the loss)."""
        return self.vstages - 1 in self.executors

    def parameters(self) -> list[Any]:
        """This rank's trainable parameters (torch) or variables (Keras)."""
        return self.params.parameters()

    def _split(self, t: Any, what: str) -> list[Any]:
        from plait.adapters import ops_for

        rows = _rows(t)
        size = check_microbatches(rows, self.microbatches) if rows > 0 else 0
        if rows <= 0:
            raise PartitionError(f"{what} must have at least one row, got shape {ops_for(t).shape(t)}")
        return ops_for(t).split(t, [size] * self.microbatches)

    def train_step(self, x: Any = None, y: Any = None) -> float:
        """One optimizer step on a batch, through the pipeline.

        Args:
            x: The input batch; required on the rank running stage 0, used
                elsewhere only to check its size.
            y: The target batch; required on the rank running the last stage.

        Returns:
            The batch's mean loss, on every rank (averaged over the
            data-parallel group on a Mesh: the loss of the global batch).

        Raises:
            PartitionError: A batch that does not split into ``microbatches``
                (raised before any communication on every rank given the batch).
            PipelineTypeError: ``x`` missing on the first rank or ``y`` on the last.
        """
        for t, what in ((x, "x"), (y, "y")):
            if t is not None:
                rows = _rows(t)
                try:
                    check_microbatches(rows, self.microbatches)
                except PartitionError as exc:
                    raise PartitionError(f"batch {what} with {rows} rows: {exc}") from None
        if self.is_first and x is None:
            raise PipelineTypeError("x (the input batch) is required on the first pipeline rank")
        if self.is_last and y is None:
            raise PipelineTypeError("y (the target batch) is required on the last pipeline rank")
        inputs = self._split(x, "x") if self.is_first else None
        targets = self._split(y, "y") if self.is_last else None
        self.params.zero_grad()
        losses, self.last_stats = self.runtime.run(self.actions, inputs, targets)
        if self.data_comm is not None:
            self._average_gradients(self.data_comm)
        self.params.step()
        return self._share_loss(float(np.mean(losses)) if losses else 0.0)

    def _average_gradients(self, data: Communicator) -> None:
        from plait.adapters import ops_for
        from plait.parallel.data import GradientReducer, GradSpec

        grads = self.params.gradients()
        if self._reducer is None:
            specs = []
            for i, g in enumerate(grads):
                ops = ops_for(g)
                specs.append(GradSpec(f"pp{self.rank}.{i}", tuple(ops.shape(g)), ops.dtype_name(g)))
            self._reducer = (GradientReducer(data, specs, op="average",
                                             prefix=f"pipegrad{self.rank}"), specs)
        reducer, specs = self._reducer
        for spec, g in zip(specs, grads):
            reducer.ready(spec.name, g)
        out = reducer.finish(lambda spec: None)
        self.params.set_gradients([out[s.name] for s in specs])

    def _share_loss(self, loss: float) -> float:
        value = np.array([loss], dtype=np.float64)
        value = self.pipe_comm.broadcast(value, root=(self.vstages - 1) % self.stages)
        if self.data_comm is not None:
            value = self.data_comm.allreduce(value, op="average")
        return float(np.asarray(value).reshape(-1)[0])

    def predict(self, x: Any = None) -> Any:
        """Evaluation-mode forward of a whole batch through the pipeline (no micro-batching).

        Args:
            x: The input batch (required on the first pipeline rank).

        Returns:
            The model output (the framework's tensor) on the last pipeline
            rank, None on the others.
        """
        if self.is_first and x is None:
            raise PipelineTypeError("x (the input batch) is required on the first pipeline rank")
        return self.runtime.forward_only(x, self.stages)

    def close(self) -> None:
        """Release the runtime's sender threads."""
        self.runtime.close()

    def __repr__(self) -> str:
        return (f"Pipeline(framework={self.framework!r}, stages={self.stages}, chunks={self.chunks}, "
                f"microbatches={self.microbatches}, schedule={self.schedule_name!r}, "
                f"balance={self.balance}, rank={self.rank})")
