"""Data-parallel training steps per second on 2 ranks: plait next to its peers.

Two models: ``mlp`` (784-2048-1536-10, about 4.8M parameters) and ``cnn`` (two
3x3 conv layers on 32x32x3 images, then a dense layer), batch 32 per rank, SGD,
synthetic data. Every implementation of a framework runs in the same job,
interleaved repeat by repeat:

* PyTorch (one job): ``single`` (one process, no communication; the other rank
  idles), ``plait-mpi``, ``plait-horovod`` (plait's distributed optimizer over
  each backend), ``horovod`` (``horovod.torch.DistributedOptimizer``), ``ddp-gloo``
  (``torch.nn.parallel.DistributedDataParallel`` on gloo).
* TensorFlow (a second job; models of plain ``tf.Variable`` s, every step a
  ``tf.function``): ``single``, ``plait-mpi``, ``plait-horovod`` (plait's
  ``DistributedGradientTape``), ``horovod`` (``horovod.tensorflow.DistributedGradientTape``),
  ``tf-mwms`` (``tf.distribute.MultiWorkerMirroredStrategy``, ring all-reduce over
  gRPC on localhost).

Each rank uses one compute thread (2 ranks share 2 cores). Reported: steps/s,
min/median/max over repeats (each the slowest rank's mean over some steps), and
plait's ratio to the fastest peer.

Run: ``python benchmarks/dp_step.py [--quick] [--out BASE]``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import free_port, launch, load_note, md_table, meta, parse_args, stats, versions, write_results

BATCH = 32
MLP = (784, 2048, 1536, 10)
PEERS = {"torch": ["horovod", "ddp-gloo"], "tensorflow": ["horovod", "tf-mwms"]}
PLAIT = ["plait-mpi", "plait-horovod"]
#: consecutive warm-up steps of every implementation before the timed, interleaved repeats
WARMUP_STEPS = 20  # past the bucket-size tuning (4 sizes x 4 steps, and one)


def _plan(args: Any) -> tuple[int, int, list[str]]:
    """(repeats, steps per sample, models)."""
    if args.smoke:
        return 2, 1, ["mlp", "cnn"]
    return (3, 3, ["mlp", "cnn"]) if args.quick else (7, 10, ["mlp", "cnn"])


def _measure(world: Any, impls: dict[str, Callable[[], None]], args: Any,
             only_rank0: tuple[str, ...] = ("single",)) -> dict[str, list[float]]:
    """Seconds per step of every implementation (slowest rank), interleaved over repeats."""
    import numpy as np
    from mpi4py import MPI

    repeats, steps, _ = _plan(args)
    # warm up (graph tracing, buffers, connections) with consecutive steps: plait's bucket
    # autotuning (4 sizes x 4 steps) times whole steps, which the interleaved repeats below
    # would stretch by the other implementations' time
    warmup = 2 if args.smoke else WARMUP_STEPS
    for name, fn in impls.items():
        if name not in only_rank0 or world.rank == 0:
            for _ in range(warmup):
                fn()
        world.Barrier()
    samples = np.zeros((len(impls), repeats))
    for r in range(repeats):
        for i, (name, fn) in enumerate(impls.items()):
            world.Barrier()
            t0 = MPI.Wtime()
            if name not in only_rank0 or world.rank == 0:
                for _ in range(steps):
                    fn()
            samples[i, r] = (MPI.Wtime() - t0) / steps
    slowest = np.empty_like(samples)
    world.Allreduce(samples, slowest, MPI.MAX)
    return {name: [float(x) for x in slowest[i]] for i, name in enumerate(impls)}


# -- PyTorch -------------------------------------------------------------------------------------
def _torch_model(kind: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "mlp":
        layers: list[Any] = []
        for a, b in zip(MLP[:-1], MLP[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1])
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 8 * 8, 10))


def torch_worker(args: Any) -> dict[str, Any]:
    """Every PyTorch implementation, both models; results on rank 0."""
    import horovod.torch as hvd
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from mpi4py import MPI
    from plait.adapters.torch_optim import distributed_optimizer
    from plait.collectives.horovod import HorovodCommunicator
    from plait.collectives.mpi import MPICommunicator

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comms = {"plait-mpi": MPICommunicator(world.Dup()), "plait-horovod": HorovodCommunicator("torch")}
    port = world.bcast(free_port() if world.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.rank,
                            world_size=world.size)
    out: dict[str, Any] = {}
    for kind in _plan(args)[2]:
        g = torch.Generator().manual_seed(world.rank)
        shape = (BATCH, MLP[0]) if kind == "mlp" else (BATCH, 3, 32, 32)
        x, y = torch.randn(*shape, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
        impls: dict[str, Callable[[], None]] = {}

        def stepper(model: Any, opt: Any, x: Any = x, y: Any = y) -> Callable[[], None]:
            def step() -> None:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            return step

        for name in ["single", *PLAIT, "horovod", "ddp-gloo"]:
            model = _torch_model(kind)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            if name in comms:
                opt = distributed_optimizer(opt, comms[name], model.named_parameters())
            elif name == "horovod":
                opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            elif name == "ddp-gloo":
                model = torch.nn.parallel.DistributedDataParallel(model)
                opt = torch.optim.SGD(model.parameters(), lr=0.01)
            impls[name] = stepper(model, opt)
        params = sum(p.numel() for p in _torch_model(kind).parameters())
        out[kind] = {"params": params, "seconds": _measure(world, impls, args)}
        if world.rank == 0:
            print(f"  torch {kind} done", flush=True)
    dist.destroy_process_group()
    return out


# -- TensorFlow ----------------------------------------------------------------------------------
def _tf_model(kind: str) -> Any:
    """A model of plain tf.Variables (Horovod's tape fails on Keras 3 variables)."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)

    def var(shape: tuple[int, ...], fan_in: int) -> Any:
        return tf.Variable((rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32))

    class Model(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            if kind == "mlp":
                self.w = [var((a, b), a) for a, b in zip(MLP[:-1], MLP[1:])]
                self.b = [tf.Variable(tf.zeros([b])) for b in MLP[1:]]
            else:
                self.w = [var((3, 3, 3, 32), 27), var((3, 3, 32, 64), 288), var((64 * 8 * 8, 10), 4096)]
                self.b = [tf.Variable(tf.zeros([n])) for n in (32, 64, 10)]

        def __call__(self, x: Any) -> Any:
            if kind == "mlp":
                for i, (w, b) in enumerate(zip(self.w, self.b)):
                    x = tf.matmul(x, w) + b
                    if i < len(self.w) - 1:
                        x = tf.nn.relu(x)
                return x
            for w, b in zip(self.w[:2], self.b[:2]):
                x = tf.nn.max_pool2d(tf.nn.relu(tf.nn.conv2d(x, w, 1, "SAME") + b), 2, 2, "VALID")
            return tf.matmul(tf.reshape(x, [tf.shape(x)[0], -1]), self.w[2]) + self.b[2]

    return Model()


def tf_worker(args: Any) -> dict[str, Any]:
    """Every TensorFlow implementation, both models; results on rank 0."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    ports = world.allgather(free_port())
    from plait.launch.context import tf_config

    os.environ["TF_CONFIG"] = tf_config([f"127.0.0.1:{p}" for p in ports], world.rank)
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    comm_opts = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm_opts)
    import horovod.tensorflow as hvd
    from plait.adapters.tf_optim import DistributedGradientTape
    from plait.collectives.horovod import HorovodCommunicator
    from plait.collectives.mpi import MPICommunicator

    comms = {"plait-mpi": MPICommunicator(world.Dup()),
             "plait-horovod": HorovodCommunicator("tensorflow")}
    lr = 0.01
    out: dict[str, Any] = {}
    for kind in _plan(args)[2]:
        g = tf.random.Generator.from_seed(world.rank)
        shape = [BATCH, MLP[0]] if kind == "mlp" else [BATCH, 32, 32, 3]
        x = g.normal(shape)
        y = g.uniform([BATCH], 0, 10, dtype=tf.int64)

        def loss_of(model: Any, x: Any = x, y: Any = y) -> Any:
            logits = model(x)
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

        def stepper(model: Any, how: str, loss_of: Any = loss_of) -> Callable[[], None]:
            variables = list(model.w) + list(model.b)
            comm = comms.get(how)

            @tf.function
            def step() -> None:
                with tf.GradientTape() as tape:
                    loss = loss_of(model)
                if how == "horovod":
                    tape = hvd.DistributedGradientTape(tape)
                elif comm is not None:
                    tape = DistributedGradientTape(tape, comm)
                grads = tape.gradient(loss, variables)
                for v, gr in zip(variables, grads):
                    v.assign_sub(lr * gr)
            return step

        impls = {name: stepper(_tf_model(kind), name) for name in ["single", *PLAIT, "horovod"]}
        impls["tf-mwms"] = _mwms_stepper(strategy, kind, loss_of, lr)
        model = _tf_model(kind)
        params = int(sum(int(tf.size(v)) for v in list(model.w) + list(model.b)))
        out[kind] = {"params": params, "seconds": _measure(world, impls, args)}
        if world.rank == 0:
            print(f"  tensorflow {kind} done", flush=True)
    return out


def _mwms_stepper(strategy: Any, kind: str, loss_of: Callable[[Any], Any], lr: float) -> Any:
    import tensorflow as tf

    with strategy.scope():
        model = _tf_model(kind)
    variables = list(model.w) + list(model.b)

    def apply(distribution: Any, grads: Any) -> None:
        for v, gr in zip(variables, grads):
            distribution.extended.update(v, lambda var, gg: var.assign_sub(lr * gg), args=(gr,))

    def replica_step() -> None:
        with tf.GradientTape() as tape:
            loss = loss_of(model)
        grads = tape.gradient(loss, variables)
        ctx = tf.distribute.get_replica_context()
        grads = ctx.all_reduce(tf.distribute.ReduceOp.MEAN, grads)
        ctx.merge_call(apply, args=(grads,))

    @tf.function
    def step() -> None:
        strategy.run(replica_step)
    return step


# -- report --------------------------------------------------------------------------------------
def _rows(framework: str, results: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows, ratios = [], []
    for kind, res in results.items():
        med = {}
        for name, secs in res["seconds"].items():
            sps = stats([1.0 / s for s in secs])
            med[name] = sps["median"]
            rows.append({"framework": framework, "model": kind, "params": res["params"],
                         "impl": name, "steps_per_s": sps,
                         "step_ms": stats([s * 1e3 for s in secs])})
        fastest = max(PEERS[framework], key=lambda p: med[p])
        for name in PLAIT:
            ratios.append({"framework": framework, "model": kind, "impl": name,
                           "fastest_peer": fastest, "ratio": med[name] / med[fastest],
                           "vs_single": med[name] / med["single"]})
    return rows, ratios


def _markdown(rows: list[dict[str, Any]], ratios: list[dict[str, Any]], m: dict[str, Any]) -> str:
    out = [f"## Data-parallel step, {m['np']} ranks (batch {BATCH} per rank)\n",
           f"{m['machine'].get('cores')} cores, {m['load_note']}; steps/s median (min–max) over "
           f"{m['repeats']} repeats of {m['steps']} steps, the slowest rank's. `single` is one "
           "process on one rank's batch (no communication).\n\n"]
    header = ["framework", "model", "params", "impl", "steps/s", "step ms"]
    table = []
    for r in rows:
        s, t = r["steps_per_s"], r["step_ms"]
        table.append([r["framework"], r["model"], f"{r['params'] / 1e6:.2f}M", r["impl"],
                      f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})",
                      f"{t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f})"])
    out.append(md_table(header, table))
    out.append("\n### plait vs the fastest peer (median steps/s; >= 1.0 means plait is as fast)\n\n")
    out.append(md_table(["framework", "model", "plait", "fastest peer", "ratio", "vs single"],
                        [[r["framework"], r["model"], r["impl"], r["fastest_peer"],
                          f"{r['ratio']:.2f}x", f"{r['vs_single']:.2f}x"] for r in ratios]))
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    def extra(p: Any) -> None:
        p.add_argument("--frameworks", default="torch,tensorflow",
                       help="comma-separated: torch, tensorflow")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    if args.worker:
        fn = torch_worker if args.worker == "torch" else tf_worker
        res = fn(args)
        if int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == 0:
            part = Path(f"{args.out}.{args.worker}.part.json")
            part.parent.mkdir(parents=True, exist_ok=True)
            part.write_text(json.dumps({"results": res, "versions": versions(),
                                        "np": int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))}))
        return 0
    rows: list[dict[str, Any]] = []
    ratios: list[dict[str, Any]] = []
    vers: dict[str, str] = {}
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    for fw in frameworks:
        if fw not in PEERS:
            print(f"dp_step: unknown framework {fw!r}: expected torch or tensorflow", file=sys.stderr)
            return 2
    for fw in frameworks:
        print(f"dp_step: {fw} on {args.np} ranks{' (quick)' if args.quick else ''}", flush=True)
        rc = launch(__file__, args, worker=fw, forward=["--frameworks", fw])
        part = Path(f"{args.out}.{fw}.part.json")
        if rc != 0 or not part.exists():
            print(f"dp_step: the {fw} job failed (exit status {rc})", file=sys.stderr)
            return rc or 1
        data = json.loads(part.read_text())
        part.unlink()
        r, q = _rows(fw, data["results"])
        rows += r
        ratios += q
        vers.update(data["versions"])
    repeats, steps, _ = _plan(args)
    m = meta(quick=args.quick, smoke=args.smoke, np=args.np, repeats=repeats, steps=steps,
             batch_per_rank=BATCH,
             versions=vers, load_note=load_note())
    write_results(args.out, "dp_step", rows, _markdown(rows, ratios, m), m, ratios=ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
