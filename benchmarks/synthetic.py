"""Horovod-style synthetic PyTorch benchmark: images per second of data-parallel training.

Modelled on Horovod's ``examples/pytorch/pytorch_synthetic_benchmark.py``: fixed
synthetic data, SGD, ``--num-warmup-batches`` untimed steps, then ``--num-iters``
timed iterations of ``--num-batches-per-iter`` steps; img/s per iteration on rank 0,
reported as the mean with a 95% confidence interval (and, like Horovod, the total
over ranks). torchvision is not needed: the models are defined here.

* ``resnet``: a small ResNet (basic blocks, widths 64-512, batch norm) on 3x32x32
  images, 10 classes, 6.1M parameters in 44 tensors;
* ``transformer``: 2 pre-norm transformer encoder blocks (d=256, 4 heads, MLP 1024)
  over 32 tokens of a 16384-word embedding (dense gradients), mean-pooled into 10
  classes, 5.8M parameters in 28 tensors (a "sample" counts as an image).

At batch 32 one step of either takes about 105 ms on one core of this machine.

Backends (``--backend``, comma-separated; each one is a separate job of this same
script, like a user's script, launched one after the other and repeated
``--rounds`` times interleaved so that every backend sees the same load):

* ``plait-mpi`` / ``plait-horovod``: ``import plait.torch as hvd`` with
  ``hvd.init(backend="mpi"|"horovod")`` and ``hvd.DistributedOptimizer``;
* ``horovod``: ``import horovod.torch as hvd`` (real Horovod, MPI controller under
  ``mpirun``; ``--horovodrun`` launches it with ``horovodrun`` instead);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on gloo.

``--fp16-allreduce`` (or ``--compression fp16|bf16|topk|powersgd``) compresses
gradients where the backend has that compressor (DDP: its comm hooks; Horovod:
fp16 only); a backend without it is left out of the table with a note.

Each rank computes with one thread (2 ranks share 2 cores here). The report gives
plait's ratio to real Horovod and to DDP, measured in the same run.

``--framework tensorflow`` (or ``synthetic_tf.py``) runs the same models in Keras 3
on ``plait-mpi``, ``plait-horovod``, ``horovod`` and ``tf-mwms``
(``MultiWorkerMirroredStrategy``), see ``synthetic_tf.py``.

Run: ``python benchmarks/synthetic.py [--quick] [--model resnet,transformer] [--backend ...]
[--rate 1gbit]`` (``--rate``: across 2 emulated hosts on a link of that rate, as root);
one backend by hand: ``mpirun -np 2 python benchmarks/synthetic.py --worker plait-mpi``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    free_port,
    launch,
    launch_on_hosts,
    load_note,
    md_table,
    meta,
    mpi_env,
    parse_args,
    timed_iterations,
    versions,
    write_results,
)
from synthetic_tf import BACKENDS as TF_BACKENDS
from synthetic_tf import PEERS as TF_PEERS

BACKENDS = ("plait-mpi", "plait-horovod", "horovod", "ddp")
MODELS = ("resnet", "transformer")
COMPRESSIONS = ("none", "fp16", "bf16", "topk", "powersgd")
#: compressors each backend offers (the others are left out)
SUPPORTED = {"plait-mpi": set(COMPRESSIONS), "plait-horovod": set(COMPRESSIONS),
             "horovod": {"none", "fp16"}, "ddp": {"none", "fp16", "bf16", "powersgd"}}
PEERS = ("horovod", "ddp")
FRAMEWORKS = ("torch", "tensorflow")
#: per framework: its backends, the compressors each offers, its peers
SETS = {"torch": (BACKENDS, SUPPORTED, PEERS),
        "tensorflow": (TF_BACKENDS, {"plait-mpi": {"none", "fp16"}, "plait-horovod": {"none", "fp16"},
                                     "horovod": {"none", "fp16"}, "tf-mwms": {"none"}}, TF_PEERS)}
CLASSES = 10
SEQ = 32
VOCAB = 16384


# -- models --------------------------------------------------------------------------------------
def build_model(kind: str, width: int = 64) -> Any:
    """The benchmark's model (``resnet`` or ``transformer``), seeded identically on every rank."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.short: nn.Module = nn.Identity()
            if stride != 1 or cin != cout:
                self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                           nn.BatchNorm2d(cout))

        def forward(self, x: Any) -> Any:
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(y)) + self.short(x))

    class ResNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = width
            self.stem = nn.Sequential(nn.Conv2d(3, w, 3, 2, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
            plan = [(w, w, 1), (w, 2 * w, 2), (2 * w, 4 * w, 2), (4 * w, 4 * w, 1),
                    (4 * w, 8 * w, 2)]
            self.blocks = nn.Sequential(*[Block(a, b, s) for a, b, s in plan])
            self.fc = nn.Linear(8 * w, CLASSES)

        def forward(self, x: Any) -> Any:
            return self.fc(self.blocks(self.stem(x)).mean((2, 3)))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = 4 * width
            self.embed = nn.Embedding(VOCAB, d)
            self.pos = nn.Parameter(torch.zeros(SEQ, d))
            layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True,
                                               norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(d, CLASSES)

        def forward(self, x: Any) -> Any:
            return self.head(self.encoder(self.embed(x) + self.pos).mean(1))

    if kind == "resnet":
        return ResNet()
    if kind == "transformer":
        return Transformer()
    raise ValueError(f"invalid model={kind!r}: expected one of {list(MODELS)}")


def synthetic_batch(kind: str, batch: int) -> tuple[Any, Any]:
    """Fixed random inputs and labels for ``kind``."""
    import torch

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(batch, 3, 32, 32, generator=g) if kind == "resnet"
         else torch.randint(0, VOCAB, (batch, SEQ), generator=g))
    return x, torch.randint(0, CLASSES, (batch,), generator=g)


# -- one job: one backend, every model -----------------------------------------------------------
class _Setup:
    """The backend's library, rank and size, and how to wrap a model and optimizer."""

    def __init__(self, backend: str, compression: str) -> None:
        import torch

        self.backend, self.compression, self.torch = backend, compression, torch
        if backend.startswith("plait-"):
            import plait.torch as hvd

            hvd.init(backend=backend.split("-", 1)[1])
            self.hvd: Any = hvd
        elif backend == "horovod":
            import horovod.torch as hvd

            hvd.init()
            self.hvd = hvd
        else:
            import torch.distributed as dist

            rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
            port = os.environ.get("SYNTH_PORT", "29500")
            master = os.environ.get("SYNTH_MASTER", "127.0.0.1")
            dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank,
                                    world_size=size)
            self.hvd = None
        self.rank = self.hvd.rank() if self.hvd else torch.distributed.get_rank()
        self.size = self.hvd.size() if self.hvd else torch.distributed.get_world_size()

    def wrap(self, model: Any) -> tuple[Any, Any]:
        torch = self.torch
        opt = torch.optim.SGD(model.parameters(), lr=0.01 * self.size, momentum=0.9)
        if self.hvd is None:
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            self._ddp_hook(ddp)
            return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01 * self.size, momentum=0.9)
        kwargs: dict[str, Any] = {"named_parameters": model.named_parameters()}
        if self.compression in ("fp16", "bf16"):
            kwargs["compression"] = getattr(self.hvd.Compression, self.compression)
        elif self.compression == "topk":
            from plait.compression import Residual, TopK

            kwargs.update(compression=TopK(0.01), memory=Residual())
        elif self.compression == "powersgd":
            from plait.compression import PowerSGD, Residual

            kwargs.update(compression=PowerSGD(rank=4), memory=Residual())
        opt = self.hvd.DistributedOptimizer(opt, **kwargs)
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.hvd.broadcast_optimizer_state(opt, root_rank=0)
        return model, opt

    def _ddp_hook(self, ddp: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.compression == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif self.compression == "bf16":
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif self.compression == "powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def close(self) -> None:
        if self.hvd is None:
            self.torch.distributed.destroy_process_group()


def run_model(setup: _Setup, kind: str, args: Any) -> dict[str, Any]:
    """Warm up, then time ``num_iters`` iterations; img/s of each iteration on this rank."""
    import torch.nn.functional as F

    model = build_model(kind)
    params = sum(p.numel() for p in model.parameters())
    model, opt = setup.wrap(model)
    x, y = synthetic_batch(kind, args.batch_size)

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return {"params": params, **timed_iterations(step, args, setup.rank == 0 and not args.out)}


def worker(args: Any) -> int:
    """One job of ``args.worker`` (a backend) on every rank; rank 0 writes the part file."""
    if args.framework == "tensorflow":
        from synthetic_tf import worker_results

        results, rank, size = worker_results(args.worker, args.models, args)
        close: Any = None
    else:
        import torch

        torch.set_num_threads(1)
        setup = _Setup(args.worker, args.compression)
        results = {kind: run_model(setup, kind, args) for kind in args.models}
        rank, size, close = setup.rank, setup.size, setup.close
    if rank == 0:
        for kind, res in results.items():
            mean, half = confidence(res["img_secs"])
            print(f"{args.worker} {kind}: img/sec per CPU {mean:.1f} +-{half:.1f}; total on "
                  f"{size} ranks {size * mean:.1f} +-{size * half:.1f}", flush=True)
        if args.out:
            part = Path(f"{args.out}.{args.worker}.part.json")
            part.parent.mkdir(parents=True, exist_ok=True)
            prev = json.loads(part.read_text()) if part.exists() else {"rounds": []}
            prev["rounds"].append(results)
            prev.update(np=size, versions=versions())
            part.write_text(json.dumps(prev))
    if close is not None:
        close()
    return 0


# -- statistics and report -----------------------------------------------------------------------
def confidence(samples: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (Student's t)."""
    n = len(samples)
    mean = statistics.fmean(samples)
    if n < 2:
        return mean, 0.0
    t = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
    return mean, t.get(n - 1, 1.96 + 2.4 / (n - 1)) * statistics.stdev(samples) / math.sqrt(n)


def rows_of(parts: dict[str, dict[str, Any]], args: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Table rows (one per model and backend) and ratio rows (plait vs each peer)."""
    rows, ratios = [], []
    for kind in args.models:
        mean: dict[str, float] = {}
        for backend, part in parts.items():
            samples = [x for rnd in part["rounds"] for x in rnd[kind]["img_secs"]]
            cpu = [x for rnd in part["rounds"] for x in rnd[kind]["cpu_ms"]]
            m, half = confidence(samples)
            mean[backend] = m
            size = part["np"]
            rows.append({"framework": args.framework, "model": kind, "backend": backend,
                         "compression": args.compression,
                         "params": part["rounds"][0][kind]["params"], "np": size,
                         "img_per_s": m, "ci95": half, "total_img_per_s": size * m,
                         "step_ms": 1e3 * args.batch_size / m, "cpu_ms": statistics.median(cpu),
                         "n": len(samples)})
        for backend in parts:
            if not backend.startswith("plait-"):
                continue
            for peer in SETS[args.framework][2]:
                if peer in mean:
                    ratios.append({"framework": args.framework, "model": kind,
                                   "backend": backend, "peer": peer,
                                   "compression": args.compression, "ratio": mean[backend] / mean[peer]})
    return rows, ratios


def markdown(rows: list[dict[str, Any]], ratios: list[dict[str, Any]], m: dict[str, Any],
             skipped: list[str]) -> str:
    out = [f"## Synthetic benchmark ({m.get('framework', 'torch')}), {m['np']} ranks, "
           f"batch {m['batch_size']} per rank, "
           f"compression {m['compression']}, {m.get('link', 'shared memory (one host)')}\n\n",
           f"{m['machine'].get('cores')} cores; load before {m['load_before']}, after "
           f"{m['load_after']}. img/s per rank: mean and 95% confidence interval over "
           f"{m['num_iters']} iterations x {m['rounds']} rounds of {m['num_batches_per_iter']} "
           f"steps each (after {m['num_warmup_batches']} warm-up steps), rank 0's clock. CPU ms/step: "
           "rank 0's process CPU time (all its threads) per step, median over iterations (less "
           "sensitive to other load than img/s).\n\n"]
    table = [[r["model"], f"{r['params'] / 1e6:.2f}M", r["backend"],
              f"{r['img_per_s']:.1f} ± {r['ci95']:.1f}", f"{r['total_img_per_s']:.1f}",
              f"{r['step_ms']:.1f}", f"{r['cpu_ms']:.1f}"] for r in rows]
    out.append(md_table(["model", "params", "backend", "img/s per rank", "total img/s", "step ms",
                         "CPU ms/step"], table))
    if ratios:
        peers = "DDP" if m.get("framework", "torch") == "torch" else "MultiWorkerMirroredStrategy"
        out.append(f"\n### plait vs real Horovod and {peers} (mean img/s; >= 1.0 means plait is as "
                   "fast)\n\n")
        out.append(md_table(["model", "plait", "peer", "ratio"],
                            [[r["model"], r["backend"], r["peer"], f"{r['ratio']:.2f}x"]
                             for r in ratios]))
    if skipped:
        out.append("\n" + "".join(f"- {s}\n" for s in skipped))
    return "".join(out)


# -- driver --------------------------------------------------------------------------------------
def _launch_horovodrun(args: Any, forward: list[str]) -> int:
    hr = shutil.which("horovodrun") or str(Path(sys.executable).parent / "horovodrun")
    cmd = [hr, "-np", str(args.np), sys.executable, str(Path(__file__).resolve()), "--worker",
           "horovod", "--out", args.out, *forward]
    try:
        return subprocess.run(cmd, env=mpi_env({"SYNTH_DRIVER": "1"}), timeout=args.timeout,
                              start_new_session=True).returncode
    except subprocess.TimeoutExpired:
        return 124


def _extra(p: Any) -> None:
    p.add_argument("--model", default=",".join(MODELS), help="comma-separated: resnet, transformer")
    p.add_argument("--framework", default="torch", help=f"one of {list(FRAMEWORKS)}")
    p.add_argument("--backend", default="",
                   help=f"comma-separated (default: all of the framework's), torch: {list(BACKENDS)}, "
                        f"tensorflow: {list(TF_BACKENDS)}")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    p.add_argument("--num-warmup-batches", type=int, default=20,
                   help="untimed steps (20 cover plait's bucket-size tuning; every backend gets them)")
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2, help="jobs per backend, interleaved")
    p.add_argument("--fp16-allreduce", action="store_true", help="same as --compression fp16")
    p.add_argument("--compression", default="none", help=f"one of {list(COMPRESSIONS)}")
    p.add_argument("--horovodrun", action="store_true", help="launch real Horovod with horovodrun")
    p.add_argument("--rate", default="",
                   help="run across 2 emulated hosts joined by a link of this tc rate (e.g. 1gbit; "
                        "needs root), --np / 2 ranks on each")


def _launch_hosts(hosts: Any, args: Any, backend: str, forward: list[str]) -> int:
    """One job of ``backend`` across the emulated ``hosts``, started from the first one."""
    return launch_on_hosts(hosts, __file__, args, backend, forward, env={
        "SYNTH_DRIVER": "1", "SYNTH_PORT": "29631", "SYNTH_MASTER": hosts.address(hosts.hosts[0]),
        "GLOO_SOCKET_IFNAME": "eth0"})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv, _extra)
    if args.fp16_allreduce:
        args.compression = "fp16"
    args.models = [m.strip() for m in args.model.split(",") if m.strip()]
    if args.framework not in FRAMEWORKS:
        print(f"synthetic: invalid --framework {args.framework!r}: expected one of {list(FRAMEWORKS)}",
              file=sys.stderr)
        return 2
    valid_backends, supported, _ = SETS[args.framework]
    backends = [b.strip() for b in (args.backend or ",".join(valid_backends)).split(",") if b.strip()]
    for name, values, valid in (("model", args.models, MODELS),
                                ("backend", backends, valid_backends),
                                ("compression", [args.compression], COMPRESSIONS)):
        bad = [v for v in values if v not in valid]
        if bad or not values:
            print(f"synthetic: invalid --{name} {bad or values}: expected from {list(valid)}",
                  file=sys.stderr)
            return 2
    if args.smoke:
        args.batch_size, args.num_warmup_batches, args.num_batches_per_iter = 4, 1, 1
        args.num_iters, args.rounds = 2, 1
    elif args.quick:
        args.num_batches_per_iter, args.num_iters = 5, 5
    if args.worker:
        if not os.environ.get("SYNTH_DRIVER"):
            args.out = ""  # run by hand: print, write nothing
        return worker(args)
    skipped = [f"{b}: no {args.compression} compression" for b in backends
               if args.compression not in supported[b]]
    backends = [b for b in backends if args.compression in supported[b]]
    forward = ["--framework", args.framework, "--model", ",".join(args.models),
               "--batch-size", str(args.batch_size),
               "--num-warmup-batches", str(args.num_warmup_batches), "--num-batches-per-iter",
               str(args.num_batches_per_iter), "--num-iters", str(args.num_iters),
               "--compression", args.compression]
    for b in backends:
        Path(f"{args.out}.{b}.part.json").unlink(missing_ok=True)
    load_before = load_note()
    with contextlib.ExitStack() as stack:
        hosts = None
        if args.rate:
            from plait.testing.netns import EmulatedHosts

            if args.np % 2:
                print(f"synthetic: --rate needs an even --np (ranks on 2 hosts), got {args.np}",
                      file=sys.stderr)
                return 2
            hosts = stack.enter_context(EmulatedHosts(2, subnet="10.78.0", rate=args.rate,
                                                      slots=args.np // 2))
        for rnd in range(args.rounds):
            for b in backends:
                where = f" across 2 hosts at {args.rate}" if args.rate else ""
                print(f"synthetic: round {rnd + 1}/{args.rounds}: {b} on {args.np} ranks{where} "
                      f"({load_note()})", flush=True)
                if hosts is not None:
                    rc = _launch_hosts(hosts, args, b, forward)
                elif b == "horovod" and args.horovodrun:
                    rc = _launch_horovodrun(args, forward)
                else:
                    rc = launch(__file__, args, worker=b, forward=forward,
                                env={"SYNTH_PORT": str(free_port()), "SYNTH_DRIVER": "1"})
                if rc != 0:
                    print(f"synthetic: the {b} job failed (exit status {rc})", file=sys.stderr)
                    return rc or 1
    parts = {}
    for b in backends:
        part = Path(f"{args.out}.{b}.part.json")
        parts[b] = json.loads(part.read_text())
        part.unlink()
    rows, ratios = rows_of(parts, args)
    vers: dict[str, str] = {}
    for p in parts.values():
        vers.update(p["versions"])
    m = meta(quick=args.quick, smoke=args.smoke, np=args.np, batch_size=args.batch_size,
             num_warmup_batches=args.num_warmup_batches, num_batches_per_iter=args.num_batches_per_iter,
             num_iters=args.num_iters, rounds=args.rounds, compression=args.compression,
             framework=args.framework,
             link=f"2 emulated hosts at {args.rate}" if args.rate else "shared memory (one host)",
             load_before=load_before, load_after=load_note(), versions=vers)
    name = "synthetic" if args.framework == "torch" else "synthetic_tf"  # the script's stem
    write_results(args.out, name, rows, markdown(rows, ratios, m, skipped), m, ratios=ratios,
                  skipped=skipped)
    print(markdown(rows, ratios, m, skipped))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
