"""Gradient compression across two emulated hosts joined by a 1 Gbit/s link.

Per compressor: step time, bytes on the wire (plait's ``WireStats`` and the
interface's ``tx_bytes`` counter) and final digits accuracy of a
communication-bound MLP (64 -> 4096 -> 2560 -> 10, 10.8M parameters) trained
with ``plait.adapters.torch_optim.distributed_optimizer`` over the MPI backend,
next to uncompressed training and next to torch DDP (gloo) with its fp16 and
PowerSGD communication hooks on the same link.

The benchmark makes the two hosts itself (``plait.testing.netns.EmulatedHosts``
with ``tc tbf`` at 1 Gbit/s; needs root) and removes them at the end; mpirun
starts one rank per host from inside the first one. Targets (reported, not
asserted): top-k 1% with error feedback and PowerSGD rank 4 each >= 4x faster
per step than uncompressed, accuracy within 1 point.

    python benchmarks/compression.py [--quick|--smoke] [--out BASE] [--rate 1gbit] [--steps N]
                                     [--batch N] [--sizes W,...] [--only ROWS]
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, load_note, md_table, meta, mpi_env, parse_args, versions, write_results  # noqa: E402

SIZES = (64, 4096, 2560, 10)
BATCH = 64  # per rank (default of --batch)
TRAIN = 1437  # training samples of digits' 1797 (the rest: the test set)
LR, MOMENTUM = 0.02, 0.9
SUBNET = "10.79.0"
TX = "/sys/class/net/eth0/statistics/tx_bytes"

#: name -> (compressor expression, error feedback); built on every rank.
PLAIT = {
    "none": ("NoneCompressor()", False),
    "fp16": ("FP16()", False),
    "bf16": ("BF16()", False),
    "topk 1% + EF": ("TopK(0.01)", True),
    "randomk 1% + EF": ("RandomK(0.01, seed=1, unbiased=False)", True),
    "threshold 1e-3 + EF": ("Threshold(1e-3)", True),
    "qsgd 127": ("QSGD(127, seed=10 + RANK)", False),
    "terngrad": ("TernGrad(seed=20 + RANK)", False),
    "signsgd": ("SignSGD()", False),
    "efsignsgd + EF": ("EFSignSGD()", True),
    "onebit + EF": ("OneBit()", True),
    "powersgd r4 + EF": ("PowerSGD(rank=4)", True),
}
QUICK = ("none", "topk 1% + EF", "powersgd r4 + EF")
DDP = ("ddp none", "ddp fp16 hook", "ddp powersgd r4 hook")
#: the same model and data in Keras 3 (TensorFlow): gradients and update in ``tf.function``\ s,
#: the reduction eagerly between them; "(tf.function)" rows put the whole step in one
#: ``tf.function`` (as ``model.fit`` does; a lossy compressor runs in a host op there).
KERAS = {
    "keras none": ("NoneCompressor()", False),
    "keras none (tf.function)": ("NoneCompressor()", False),
    "keras fp16": ("FP16()", False),
    "keras fp16 (tf.function)": ("FP16()", False),
    "keras topk 1% + EF": ("TopK(0.01)", True),
    "keras topk 1% + EF (tf.function)": ("TopK(0.01)", True),
    "keras powersgd r4 + EF": ("PowerSGD(rank=4)", True),
    "keras powersgd r4 + EF (tf.function)": ("PowerSGD(rank=4)", True),
}


def _sizes(text: str) -> tuple[int, ...]:
    """The layer widths of ``--sizes``.

    Raises:
        ValueError: naming the value and what is valid.
    """
    try:
        sizes = tuple(int(w) for w in text.split(","))
    except ValueError:
        sizes = ()
    if len(sizes) < 2 or sizes[0] != SIZES[0] or sizes[-1] != SIZES[-1] or min(sizes) < 1:
        raise ValueError(f"--sizes {text!r} is invalid: it takes comma-separated layer widths, "
                         f"{SIZES[0]} first and {SIZES[-1]} last (digits' features and classes), "
                         "e.g. 64,1536,1536,10")
    return sizes


# -- on every rank ----------------------------------------------------------------------------------
def _tx() -> int:
    try:
        return int(Path(TX).read_text())
    except OSError:
        return -1


def _model(sizes: tuple[int, ...]) -> Any:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _data() -> tuple[Any, Any, Any, Any]:
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(x))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order])
    return x[:TRAIN], y[:TRAIN], x[TRAIN:], y[TRAIN:]


def _timed(batch: Callable[[Any], Any], step: Callable[[Any], None], n: int, rank: int, size: int,
           steps: int, warmup: int, accuracy: Callable[[], float], per_rank: int) -> dict[str, Any]:
    """Run ``step(batch(rows))`` ``steps`` times, ``rows`` this rank's ``per_rank`` samples of
    the epoch's shuffled order of ``n``; time (``step`` only) and count bytes for the steps
    after ``warmup``, then take ``accuracy()``."""
    import numpy as np

    per_epoch = n // (per_rank * size)
    times, tx0 = [], 0
    for i in range(steps):
        if i == warmup:
            tx0 = _tx()
        perm = np.random.default_rng(10 + i // per_epoch).permutation(n)
        s = i % per_epoch
        prepared = batch(perm[s * per_rank * size : (s + 1) * per_rank * size][rank::size])
        t0 = time.perf_counter()
        step(prepared)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    tx = _tx() - tx0 if tx0 >= 0 else -1
    return {"step_s": float(np.median(times)), "step_s_min": float(min(times)),
            "tx_bytes_per_step": tx / len(times) if tx >= 0 else None, "accuracy": accuracy(),
            "timed_steps": len(times)}


def _train(model: Any, opt: Any, rank: int, size: int, steps: int, warmup: int,
           per_rank: int) -> dict[str, Any]:
    """Train ``steps`` steps of ``per_rank`` samples a rank; time and count bytes for the
    steps after ``warmup``."""
    import torch

    x, y, xt, yt = _data()
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(rows: Any) -> None:
        loss_fn(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()

    def accuracy() -> float:
        with torch.no_grad():
            return float((model(xt).argmax(1) == yt).float().mean()) * 100

    return _timed(torch.from_numpy, step, len(x), rank, size, steps, warmup, accuracy, per_rank)


def _keras_train(comm: Any, compressor: Any, memory: Any, steps: int, warmup: int,
                 graph: bool, stats: Any, per_rank: int, sizes: tuple[int, ...]) -> dict[str, Any]:
    """:func:`_train` in Keras 3: the same layers, data order and SGD. With ``graph`` the
    whole step is one ``tf.function`` (``DistributedGradientTape`` inside; ``stats`` gets
    one step closed per call, as the eager reducer closes them); otherwise the gradients
    and the update are each a ``tf.function`` and ``reduce_gradients`` runs eagerly
    between them."""
    import keras
    import numpy as np
    import tensorflow as tf
    from plait.adapters.tf_optim import DistributedGradientTape, reduce_gradients

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((sizes[0],)),
                              *[keras.layers.Dense(b, activation="relu") for b in sizes[1:-1]],
                              keras.layers.Dense(sizes[-1])])
    opt = keras.optimizers.SGD(LR, momentum=MOMENTUM)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables

    @tf.function
    def whole(x: Any, y: Any) -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = DistributedGradientTape(tape, comm, compression=compressor,
                                        memory=memory).gradient(loss, variables)
        opt.apply(grads, variables)

    @tf.function
    def gradients(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, variables)

    @tf.function
    def apply(grads: Any) -> None:
        opt.apply(grads, variables)

    def step(x: Any, y: Any) -> None:
        apply(reduce_gradients(gradients(x, y), variables, comm, compression=compressor,
                               memory=memory))

    x, y, xt, yt = (t.numpy() for t in _data())
    def whole_step(x: Any, y: Any) -> None:
        whole(x, y)
        stats.end_step()

    return _timed(lambda rows: (tf.constant(x[rows]), tf.constant(y[rows])),
                  lambda xy: (whole_step if graph else step)(*xy), len(x), comm.rank, comm.size, steps,
                  warmup, lambda: float((np.argmax(model(xt).numpy(), 1) == yt).mean()) * 100, per_rank)


def _keras_rows(comm: Any, names: tuple[str, ...], steps: int, warmup: int,
                rows: list[dict[str, Any]], per_rank: int, sizes: tuple[int, ...]) -> None:
    """The Keras rows (TensorFlow imported only when one is asked for; one thread per rank,
    as torch has)."""
    if not names:
        return
    import tensorflow as tf

    import plait.compression as pc

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    for name in names:
        expr, ef = KERAS[name]
        compressor = eval(expr, vars(pc))  # noqa: S307 -- our own table
        stats = pc.WireStats()
        compressor.count_into(stats)
        row = _keras_train(comm, compressor, pc.Residual() if ef else None, steps, warmup,
                           graph="tf.function" in name, stats=stats, per_rank=per_rank,
                           sizes=sizes)
        # WireStats count eager collectives and the host ops of lossy compressors in graphs
        counted = "tf.function" not in name or ef
        row.update(name=name, kind="plait keras", compressor=expr,
                   wire_bytes_per_step=stats.last_step.sent if counted else None,
                   raw_bytes_per_step=stats.last_step.raw if counted else None)
        _report(comm, row, rows)


def _alone(comm: Any, steps: int, warmup: int, per_rank: int,
           sizes: tuple[int, ...]) -> dict[str, float]:
    """The uncompressed step's two parts apart, the slowest rank's seconds: forward, backward
    and the SGD step without communication (``compute_s``), and one allreduce of all the
    gradients at once with nothing else running, float32 and float16 (``allreduce_float32_s``,
    ``allreduce_float16_s``; median of 3 after one unmeasured)."""
    import numpy as np
    import torch

    model = _model(sizes)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    out = {"compute_s": _train(model, opt, comm.rank, comm.size, steps, warmup, per_rank)["step_s"]}
    n = sum(p.numel() for p in model.parameters())
    for dtype in ("float32", "float16"):
        flat = torch.zeros(n, dtype=getattr(torch, dtype))
        times = []
        for _ in range(4):
            comm.barrier()
            t0 = time.perf_counter()
            comm.allreduce(flat, name=f"alone.{dtype}")
            times.append(time.perf_counter() - t0)
        out[f"allreduce_{dtype}_s"] = float(np.median(times[1:]))
    everyone = comm.allgather_object(out)
    return {k: max(e[k] for e in everyone) for k in out}


def _worker(args: Any) -> None:
    import torch
    from mpi4py import MPI
    from plait.adapters.torch_optim import distributed_optimizer
    from plait.collectives.mpi import MPICommunicator

    import plait.compression as pc

    torch.set_num_threads(1)
    comm = MPICommunicator(MPI.COMM_WORLD.Dup(), timeout=600)
    steps, warmup = (8, 2) if args.quick else (45, 3)
    if args.steps:
        steps, warmup = max(args.steps, 3), 2
    names = QUICK if args.quick else tuple(PLAIT)
    if args.only:
        names = tuple(n for n in PLAIT if n == "none" or n in args.only.split(","))  # none: the baseline
    sizes = _sizes(args.sizes)
    alone = _alone(comm, steps, warmup, args.batch, sizes)
    if comm.rank == 0:
        print(f"alone: compute {alone['compute_s'] * 1e3:.1f} ms, allreduce of all gradients "
              f"{alone['allreduce_float32_s'] * 1e3:.1f} ms (float16 "
              f"{alone['allreduce_float16_s'] * 1e3:.1f} ms)", flush=True)
    rows: list[dict[str, Any]] = []
    for name in names:
        expr, ef = PLAIT[name]
        compressor = eval(expr.replace("RANK", str(comm.rank)), vars(pc))  # noqa: S307 -- our own table
        stats = pc.WireStats()
        compressor.count_into(stats)
        model = _model(sizes)
        opt = distributed_optimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), comm,
                                    model.named_parameters(), compression=compressor,
                                    memory=pc.Residual() if ef else None)
        row = _train(model, opt, comm.rank, comm.size, steps, warmup, args.batch)
        # the optimizer's gradient reducer closes one WireStats step per optimizer step
        row.update(name=name, kind="plait", compressor=expr.replace("RANK", "rank"),
                   wire_bytes_per_step=stats.last_step.sent, raw_bytes_per_step=stats.last_step.raw)
        _report(comm, row, rows)
    keras_rows = () if args.quick else tuple(KERAS)
    if args.only:
        keras_rows = tuple(n for n in KERAS if n in args.only.split(","))
    _keras_rows(comm, keras_rows, steps, warmup, rows, args.batch, sizes)
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['PLAIT_BENCH_MASTER']}:29631",
                            rank=comm.rank, world_size=comm.size)
    ddp_rows = DDP if not args.quick else DDP[::2]
    if args.only:
        ddp_rows = tuple(n for n in DDP if n in args.only.split(","))
    for name in ddp_rows:
        model = _model(sizes)
        # torch's PowerSGD hook over gloo with several buckets mixes up the buckets' collectives
        # (a size-mismatch abort or a hang, torch 2.13): one bucket for the whole model.
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=max(64, 8 * sum(p.numel() for p in model.parameters()) / 2**20)
            if "powersgd" in name else 25)
        if name == "ddp fp16 hook":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name.startswith("ddp powersgd"):
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
        row = _train(ddp, opt, comm.rank, comm.size, steps, warmup, args.batch)
        row.update(name=name, kind="torch DDP (gloo)", compressor=name[4:], wire_bytes_per_step=None,
                   raw_bytes_per_step=None)
        _report(comm, row, rows)
    dist.destroy_process_group()
    if comm.rank == 0:
        _write(args, rows, steps, warmup, comm.size, alone, sizes)


def _report(comm: Any, row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Keep rank 0's row, with the slowest rank's step time and both ranks' tx bytes."""
    everyone = comm.allgather_object(row)
    row["step_s_slowest_rank"] = max(r["step_s"] for r in everyone)
    row["tx_bytes_per_step_by_rank"] = [r["tx_bytes_per_step"] for r in everyone]
    rows.append(row)
    if comm.rank == 0:
        print(f"{row['name']:24s} {row['step_s'] * 1e3:8.1f} ms/step  acc {row['accuracy']:.1f}%",
              flush=True)


def _overlap(rows: list[dict[str, Any]], alone: dict[str, float]) -> str:
    """How far the uncompressed and fp16 steps are from overlapping compute and communication
    fully: step / max(compute, allreduce) (the goal: <= 1.1)."""
    lines = []
    for name, dtype in (("none", "float32"), ("fp16", "float16"), ("ddp none", "float32")):
        r = next((r for r in rows if r["name"] == name), None)
        if r is None:
            continue
        bound = max(alone["compute_s"], alone[f"allreduce_{dtype}_s"])
        r["overlap"] = r["step_s"] / bound
        lines.append(f"- {name}: {r['step_s'] * 1e3:.0f} ms a step = {r['overlap']:.2f}x "
                     f"max(compute, allreduce {dtype}) = {bound * 1e3:.0f} ms")
    return ("\nOverlap: the step's parts apart, the slowest rank's: forward + backward + SGD step "
            f"without communication {alone['compute_s'] * 1e3:.0f} ms; one plait allreduce of all "
            f"the gradients at once {alone['allreduce_float32_s'] * 1e3:.0f} ms (float16: "
            f"{alone['allreduce_float16_s'] * 1e3:.0f} ms). Goal: step <= 1.1x the larger.\n\n"
            + "\n".join(lines) + "\n")


def _write(args: Any, rows: list[dict[str, Any]], steps: int, warmup: int, size: int,
           alone: dict[str, float], sizes: tuple[int, ...]) -> None:
    base = {r["kind"]: r for r in rows if r["name"] in ("none", "ddp none", "keras none")}
    table = []
    for r in rows:
        ref = base.get(r["kind"], base.get("plait"))
        r["speedup_vs_uncompressed"] = ref["step_s"] / r["step_s"] if ref else None
        r["accuracy_delta"] = r["accuracy"] - ref["accuracy"] if ref else None
        wire = r["wire_bytes_per_step"]
        table.append([r["kind"], r["name"], f"{r['step_s'] * 1e3:.0f}",
                      f"{r['speedup_vs_uncompressed']:.2f}x",
                      "-" if wire is None else f"{wire / 2**20:.3f}",
                      "-" if wire is None else f"{r['raw_bytes_per_step'] / max(wire, 1):.0f}x",
                      "-" if r["tx_bytes_per_step"] is None else f"{r['tx_bytes_per_step'] / 2**20:.3f}",
                      f"{r['accuracy']:.1f}", f"{r['accuracy_delta']:+.1f}"])
    params = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
    by = {r["name"]: r for r in rows}
    targets = []
    plain = [r for r in rows if r["compressor"] in ("NoneCompressor()", "none")]
    fastest = min(plain, key=lambda r: r["step_s"]) if plain else None
    for name in ("topk 1% + EF", "powersgd r4 + EF", "keras topk 1% + EF", "keras powersgd r4 + EF"):
        if name in by:
            r = by[name]
            ok = r["speedup_vs_uncompressed"] >= 4 and abs(r["accuracy_delta"]) <= 1
            peer = "" if fastest is None else (
                f", {fastest['step_s'] / r['step_s']:.2f}x the fastest uncompressed row "
                f"({fastest['name']}, {fastest['step_s'] * 1e3:.0f} ms)")
            targets.append(f"- {name}: {r['speedup_vs_uncompressed']:.2f}x faster per step than its "
                           f"own uncompressed row{peer}, accuracy {r['accuracy_delta']:+.1f} points "
                           f"-> target (>= 4x, within 1 point) {'met' if ok else 'NOT met'}")
    md = (f"# Gradient compression over a {args.rate} link (2 emulated hosts)\n\n"
          f"MLP {' -> '.join(map(str, sizes))} ({params / 1e6:.1f}M parameters, "
          f"{params * 4 / 2**20:.1f} MiB of float32 gradients), digits, batch {args.batch} per rank, "
          f"{size} ranks (one per host), SGD lr {LR} momentum {MOMENTUM}, {steps} steps "
          f"(median step time over the last {steps - warmup}). plait rows: MPI backend, "
          "`distributed_optimizer(compression=, memory=)`; plait keras rows: the same layers in Keras 3, "
          "the gradients and the SGD update each a `tf.function`, `reduce_gradients(compression=, "
          "memory=)` eagerly between them, or (tf.function) the whole step with "
          "`DistributedGradientTape` in one (a lossy compressor in a host op); wire MiB = "
          "WireStats bytes this rank handed to collectives; tx MiB = rank 0's eth0 tx_bytes per "
          "step (all traffic, both phases of "
          f"a ring allreduce). {load_note()}.\n\n"
          + md_table(["backend", "compression", "ms/step", "speedup", "wire MiB/step", "ratio",
                      "tx MiB/step", "accuracy %", "vs uncompressed"], table)
          + "\n" + "\n".join(targets) + "\n" + _overlap(rows, alone))
    write_results(args.out, "compression", rows, md,
                  meta=meta(quick=args.quick, rate=args.rate, batch=args.batch, params=params,
                            sizes=list(sizes), steps=steps,
                            warmup=warmup, versions=versions(), alone=alone))


# -- outside: the link and the job ------------------------------------------------------------------
def _outer(args: Any) -> int:
    from plait.testing.netns import EmulatedHosts, unavailable_reason

    why = unavailable_reason(need_tc=True)
    if why:
        print(f"compression benchmark: {why}", file=sys.stderr)
        return 1
    with EmulatedHosts(2, subnet=SUBNET, rate=args.rate) as hosts:
        # one BLAS thread per rank, as torch and TensorFlow get one each: the ranks share 2
        # cores unbound, and numpy's OpenBLAS (a lossy compressor's host op in a TensorFlow
        # graph) would spin 2 threads each (PowerSGD in one tf.function: 356 -> 104 ms a step)
        env = mpi_env({"PYTHONPATH": str(ROOT), "PLAIT_BENCH_MASTER": hosts.address(hosts.hosts[0]),
                       "OPENBLAS_NUM_THREADS": "1"})
        env["PATH"] = f"{hosts.bin_dir}:{env['PATH']}"
        inner = max(30, int(args.timeout) - 15)
        argv = ["mpirun", "--allow-run-as-root", "-np", "2", "--hostfile", hosts.hostfile,
                *hosts.mpirun_args(), "--timeout", str(inner), "--bind-to", "none",
                *[a for v in ("PATH", "PYTHONPATH", "PLAIT_BENCH_MASTER", "OPENBLAS_NUM_THREADS",
                              "OMPI_MCA_mpi_yield_when_idle",
                              "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL", "GLOO_SOCKET_IFNAME")
                  for a in ("-x", v)],
                sys.executable, str(Path(__file__).resolve()), "--worker", "1", "--out", args.out,
                "--rate", args.rate, "--steps", str(args.steps), "--batch", str(args.batch),
                "--sizes", args.sizes,
                *(["--quick"] if args.quick else []),
                *(["--only", args.only] if args.only else [])]
        env["GLOO_SOCKET_IFNAME"] = "eth0"
        proc = hosts.exec(hosts.hosts[0], argv, timeout=args.timeout, env=env, cwd=str(ROOT))
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr[-4000:])
        return proc.returncode


def main() -> int:
    def extra(p: Any) -> None:
        p.add_argument("--rate", default="1gbit", help="tc rate of each host's link (default 1gbit)")
        p.add_argument("--steps", type=int, default=0,
                       help="training steps per row (default 45, 8 with --quick; 2 are warm-up)")
        p.add_argument("--batch", type=int, default=BATCH,
                       help=f"samples per rank and step (default {BATCH}; fewer make a step more "
                            "bandwidth-bound)")
        p.add_argument("--sizes", default=",".join(map(str, SIZES)),
                       help="the MLP's layer widths, comma-separated, 64 first (digits' features) "
                            f"and 10 last (default {','.join(map(str, SIZES))})")
        p.add_argument("--only", default="",
                       help="comma-separated rows to run besides none (names as in the table, DDP rows too)")

    args = parse_args((__doc__ or "").splitlines()[0], extra=extra)
    if not 1 <= args.batch <= TRAIN // 2:
        print(f"compression benchmark: --batch {args.batch} is invalid: it takes 1 to {TRAIN // 2} "
              f"samples per rank (2 ranks share {TRAIN} training samples)", file=sys.stderr)
        return 2
    try:
        _sizes(args.sizes)
    except ValueError as e:
        print(f"compression benchmark: {e}", file=sys.stderr)
        return 2
    if args.smoke and not args.steps:
        args.steps = 3  # every --quick row, one timed step each
    if args.worker:
        _worker(args)
        return 0
    return _outer(args)


if __name__ == "__main__":
    raise SystemExit(main())
