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

On a ``plait.Mesh(dp=, pp=, tp=)`` every tensor-parallel rank runs its own
pipeline over ``mesh.pipeline`` with its shards of the stage's layers (layers
sharded beforehand by ``plait.TensorParallel(plan, comm=mesh.tensor)``, whose
collectives run inside the stage); the gradients are averaged over
``mesh.data``. Before each step all ranks of the job gather every rank's batch
sizes (one small allgather), so a bad batch is the same error everywhere, also
on a middle stage that is given no batch, instead of a rank waiting forever.

Example (torch, 2 ranks)::

    pipe = plait.Pipeline(torch.nn.Sequential(...), stages=2, microbatches=4,
                          schedule="1f1b", loss_fn=torch.nn.CrossEntropyLoss(),
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    loss = pipe.train_step(x, y)    # same x, y on every rank (or x on the first, y on the last)

A model too large for one process is described without weights and built per
stage: each rank materialises only its own layers (torch: ``reset_parameters()``
under seed ``seed + i`` for layer ``i``; Keras: ``layer.build`` on the shape that
reaches it), and a stage that fails to build raises on every rank::

    with torch.device("meta"):
        model = torch.nn.Sequential(...)
    pipe = plait.Pipeline(model, microbatches=8, loss_fn=..., optimizer=...)
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
from .wire import spans_hosts

__all__ = ["ABSENT", "SCALAR", "Pipeline", "batch_error", "framework_of"]

#: Why a Horovod-backend pipeline may not span hosts (README, "What does not work, and why").
_HOROVOD_ACROSS_HOSTS = (
    "a pipeline on the Horovod backend whose ranks are on several hosts is not supported: its "
    "point-to-point messages go through MPI (there is none under horovodrun --gloo) from this "
    "thread while Horovod's background thread waits inside blocking MPI calls, and Open MPI's "
    "TCP transport then holds messages back for a minute or more (Open MPI 4.1.4, measured "
    "without plait by tools/mpi_threads.py). Run pipelines across hosts on the MPI "
    "backend: plait.init('mpi') under mpirun")
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


#: Row counts in the batch table of :func:`batch_error`: batch not given / without a batch dimension.
ABSENT, SCALAR = -1, -2


def _rows(x: Any) -> int:
    """Rows of a batch, ``ABSENT`` for None, ``SCALAR`` for a batch without a batch dimension."""
    if x is None:
        return ABSENT
    from plait.adapters import ops_for

    shape = ops_for(x).shape(x)
    return int(shape[0]) if shape else SCALAR


def batch_error(table: np.ndarray, microbatches: int) -> PipelineError | None:
    """The error of a step's batches over a whole job, or None when they are fine.

    Every rank of the job gathers the same table and calls this, so all ranks
    raise the same error (or none) before any activation is sent: a rank that
    is given no batch (a middle stage) still learns that another one is bad.

    Args:
        table: One row per job rank: ``(pipeline, x_rows, y_rows, needs_x, needs_y)``,
            where ``pipeline`` identifies the rank's pipeline, the row counts are
            ``ABSENT`` (-1) for a batch not given and ``SCALAR`` (-2) for one with
            no batch dimension, and ``needs_x`` / ``needs_y`` are 1 where the rank
            runs the first / last stage.
        microbatches: Micro-batches per step; every given batch must divide by it.

    Returns:
        The first problem found, by rank: a :class:`PipelineTypeError` for a
        missing batch or one without a batch dimension, a :class:`PartitionError`
        for a row count that does not split into ``microbatches`` or batches of
        one pipeline with different row counts; None when there is none.
    """
    rows_of: dict[int, dict[int, list[str]]] = {}
    for r, (pipe, x_rows, y_rows, needs_x, needs_y) in enumerate(np.asarray(table).tolist()):
        for rows, what in ((x_rows, "x"), (y_rows, "y")):
            if rows == SCALAR:
                return PipelineTypeError(
                    f"batch {what} on rank {r} must have a batch dimension, got a scalar")
            if rows == ABSENT:
                continue
            try:
                check_microbatches(rows, microbatches)
            except PartitionError as exc:
                return PartitionError(f"batch {what} with {rows} rows on rank {r}: {exc}")
            rows_of.setdefault(pipe, {}).setdefault(rows, []).append(f"{what} on rank {r}")
        if needs_x and x_rows == ABSENT:
            return PipelineTypeError(
                f"x (the input batch) is required on the first pipeline rank, got None on rank {r}")
        if needs_y and y_rows == ABSENT:
            return PipelineTypeError(
                f"y (the target batch) is required on the last pipeline rank, got None on rank {r}")
    for counts in rows_of.values():
        if len(counts) > 1:
            shown = "; ".join(f"{n} rows: {', '.join(w)}" for n, w in sorted(counts.items()))
            return PartitionError(
                f"the batches of one pipeline must have the same number of rows, got {shown}")
    return None


class Pipeline:
    """Pipeline-parallel training of a sequential torch or Keras model.

    Args:
        model: ``torch.nn.Sequential``, ``keras.Sequential``, or a list of torch
            modules / Keras layers. Every rank passes the same model. Described without
            weights (torch: built under ``torch.device("meta")``; Keras: no
            ``keras.Input``, layers not built), each rank builds only its own stages'
            layers (per-stage construction: parameters and optimizer state of 1/P of
            the model per rank); given with weights (the same initial weights on every
            rank), the pipeline references only this rank's stages' layers (drop your
            own reference to the model to free the others' memory).
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
            averaged over ``mesh.data``; with ``tp > 1`` the model's layers may be
            ``plait.TensorParallel`` layers on ``mesh.tensor``), a communicator
            (all its ranks form one pipeline), or None for ``plait.init()``.
        loss_fn: torch: ``loss_fn(output, target)``; Keras: ``loss_fn(y_true, y_pred)``;
            reduced as a mean over the micro-batch.
        optimizer: torch: ``callable(params) -> torch.optim.Optimizer``; Keras: an
            optimizer or ``callable(variables) -> optimizer``; None to step yourself.
        checkpoint: Recompute activations in backward: a bool for every stage or
            one bool per virtual stage.
        sample_input: An input batch, required by ``balance="time"``.
        seed: Base seed of per-stage construction: a model described without weights
            (torch: on the ``meta`` device; Keras: layers not built) is built by each
            rank for its own stages only, layer ``i`` initialised under seed ``seed + i``
            (``plait.adapters.torch_pipeline.materialize`` /
            ``plait.adapters.keras_pipeline.materialize`` build the same weights serially).
        input_shape: Keras layers not built: the shape of one input sample (no batch
            dimension), from which every stage's input shape follows.

    Raises:
        PipelineTypeError: An argument has the wrong type.
        PartitionError: The model cannot be split into the stages, a bad balance, or
            a stage failed to build on some rank (raised on every rank, naming it).
        PipelineError: Unknown schedule, stages different from the pipeline size,
            bad ``chunks``, ``microbatches`` not a multiple of ``stages`` for
            ``"interleaved"``.
        NotImplementedError: A pipeline on the Horovod backend whose ranks are on
            several hosts (use the MPI backend; README says why).

    All of these are raised before any communication.

    Attributes:
        stage_ids: The virtual stages this rank runs.
        balance: Layers per virtual stage; ``bounds``: their ``(start, stop)``.
        local_layers: The layers this rank holds, by virtual stage.
        deferred: Whether the model was built per stage (described without weights).
        last_stats: :class:`~.runtime.StepStats` of the latest step on this rank.
    """

    def __init__(self, model: Any, stages: int | None = None, microbatches: int = 1,
                 schedule: str = "1f1b", *, balance: Any = None, chunks: int | None = None,
                 comm: Any = None, loss_fn: Any = None, optimizer: Any = None,
                 checkpoint: bool | Sequence[bool] = False, sample_input: Any = None,
                 seed: int = 0, input_shape: Sequence[int] | None = None) -> None:
        self.framework = framework_of(model)
        glue: Any = importlib.import_module(_GLUE[self.framework])
        layers = glue.layers_of(model)
        self.pipe_comm, self.data_comm = self._comms(comm)
        if getattr(self.pipe_comm, "backend", "") == "horovod" and spans_hosts(self.pipe_comm):
            raise NotImplementedError(_HOROVOD_ACROSS_HOSTS)
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
        self.deferred = bool(glue.is_deferred(layers))
        if self.deferred:
            self._build_stages(glue, layers, seed, input_shape)
        self.local_layers = {s: layers[a:b] for s, (a, b) in enumerate(self.bounds)
                             if s in self.stage_ids}
        stage_cls = glue.TorchStage if self.framework == "torch" else glue.KerasStage
        params_cls = glue.TorchParams if self.framework == "torch" else glue.KerasParams
        self.executors = {
            s: stage_cls(self.local_layers[s], first=s == 0, last=s == self.vstages - 1,
                         loss_fn=loss_fn, scale=1.0 / microbatches, checkpoint=marks[s])
            for s in self.stage_ids}
        self.params = params_cls([self.executors[s] for s in self.stage_ids], optimizer)
        # The messages of this pipeline travel on a communicator of its own (MPI backend): a
        # step that failed half-way leaves messages behind, which no later pipeline may receive.
        wire = self.pipe_comm
        if getattr(wire, "backend", "") == "mpi":
            wire = wire.split(0, wire.rank)
        self.runtime = Runtime(wire, dict(self.executors), self.vstages, microbatches)
        self.actions = self.schedule[rank]
        self.last_stats = StepStats()
        self._reducer: Any = None

    # -- construction helpers ----------------------------------------------------------
    def _comms(self, comm: Any) -> tuple[Communicator, Communicator | None]:
        """Set ``job_comm`` (every rank of the job) and ``_pipe_id``; return (pipeline, data)."""
        if comm is None:
            from plait import runtime

            comm = runtime.init()
        if hasattr(comm, "pipeline") and hasattr(comm, "data"):  # a plait.Mesh
            # Tensor peers run the same stage on their own shards: each has its own pipeline
            # (mesh.pipeline) and its own data group (mesh.data); their collectives live
            # inside the user's TensorParallel layers on mesh.tensor.
            self.job_comm, self._pipe_id = comm.world, min(comm.group("pp"))
            return comm.pipeline, (comm.data if comm.data.size > 1 else None)
        if not all(hasattr(comm, a) for a in ("send", "recv", "rank", "size")):
            raise PipelineTypeError(
                f"comm must be a plait.Mesh, a plait Communicator or None, got {type(comm).__name__}")
        self.job_comm, self._pipe_id = comm, 0
        return comm, None

    def _build_stages(self, glue: Any, layers: list[Any], seed: int, input_shape: Any) -> None:
        """Build this rank's stages of a model described without weights; agree on the outcome.

        Raises:
            PartitionError: A stage failed to build on some rank (on every rank of the job,
                naming the stage, the rank and the reason).
        """
        mine = [i for s in self.stage_ids for i in range(*self.bounds[s])]
        problem = None
        try:
            glue.materialize(layers, mine, seed, **({} if input_shape is None
                                                    else {"input_shape": input_shape}))
        except Exception as exc:  # reported to every rank below
            stages = ", ".join(str(s) for s in self.stage_ids)
            problem = f"stage {stages} on pipeline rank {self.pipe_comm.rank}: {type(exc).__name__}: {exc}"
        everyone = self.job_comm.allgather_object(problem)
        failed = [f"rank {r} ({p})" for r, p in enumerate(everyone) if p is not None]
        if failed:
            raise PartitionError(f"building the pipeline stages failed on job {'; '.join(failed)}")

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
                # Measured on every pipeline rank 0 (tensor peers run their layers' collectives
                # together); job rank 0's costs are used everywhere, so all pipelines agree.
                costs = glue.layer_times(layers, sample) if self.pipe_comm.rank == 0 else None
                costs = self.job_comm.broadcast_object(costs, root=0)
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

    def _split(self, t: Any) -> list[Any]:
        """``t`` in ``microbatches`` equal parts (its rows were checked by :meth:`_check_batches`)."""
        from plait.adapters import ops_for

        size = check_microbatches(_rows(t), self.microbatches)
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
            PartitionError: A batch that does not split into ``microbatches``, or
                batches of one pipeline with different numbers of rows.
            PipelineTypeError: ``x`` missing on the first rank, ``y`` on the last,
                or a batch without a batch dimension.

        Every rank of the job (also a middle stage given no batch) raises the same
        error, after one small allgather of the batch sizes and before any
        activation is sent.
        """
        self._check_batches(x, y, self.microbatches, needs_y=True)
        inputs = self._split(x) if self.is_first else None
        targets = self._split(y) if self.is_last else None
        self.params.zero_grad()
        losses, self.last_stats = self.runtime.run(self.actions, inputs, targets)
        if self.data_comm is not None:
            self._average_gradients(self.data_comm)
        self.params.step()
        return self._share_loss(float(np.mean(losses)) if losses else 0.0)

    def _check_batches(self, x: Any, y: Any, microbatches: int, needs_y: bool) -> None:
        """Gather every job rank's batch sizes; raise :func:`batch_error`'s error on all ranks."""
        mine = np.array([[self._pipe_id, _rows(x), _rows(y), int(self.is_first),
                          int(self.is_last and needs_y)]], dtype=np.int64)
        table = np.asarray(self.job_comm.allgather(mine)).reshape(-1, mine.shape[1])
        error = batch_error(table, microbatches)
        if error is not None:
            raise error

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

        Raises:
            PipelineTypeError: ``x`` missing on the first rank, or without a batch
                dimension (on every rank of the job, before any activation is sent).
            PartitionError: ``x`` has no rows.
        """
        self._check_batches(x, None, 1, needs_y=False)
        return self.runtime.forward_only(x, self.stages)

    def close(self) -> None:
        """Release the runtime's sender threads."""
        self.runtime.close()

    def __repr__(self) -> str:
        return (f"Pipeline(framework={self.framework!r}, stages={self.stages}, chunks={self.chunks}, "
                f"microbatches={self.microbatches}, schedule={self.schedule_name!r}, "
                f"balance={self.balance}, rank={self.rank})")
