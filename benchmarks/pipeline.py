"""Pipeline-parallel benchmark: measured bubble, throughput and live activations per schedule.

``python benchmarks/pipeline.py [--quick|--smoke] [--np 2] [--rate R] [--out BASE]`` launches
``mpirun -np NP`` of itself (``--worker``, see ``_common.py``). Each worker builds
the same torch MLP, splits it into ``NP`` stages and, for every schedule and number
of micro-batches ``M``, times a few ``train_step`` calls on a fixed batch:

* measured bubble fraction: ``1 - sum(busy) / (P * makespan)``, busy being each
  rank's forward + backward seconds (the runtime's per-stage timers) and the
  makespan the slowest rank's step time (steps start after a barrier);
* theoretical bubble: ``(P - 1) / (M + P - 1)`` for GPipe and 1F1B,
  ``(P - 1) / (v * M + P - 1)`` for interleaved 1F1B with ``v`` chunks, and
  the pure simulator's value (forward 1, backward 2) next to it;
* throughput (samples/s) and its ratio to the naive model-parallel split
  (GPipe with ``M = 1``, the same batch);
* peak live micro-batch activations on any rank, measured by the runtime,
  next to the simulator's;
* per-stage construction: first of all, each rank builds its stages of a bigger
  MLP described on torch's meta device (8 x Linear(2048), Adam) and reports its
  peak RSS next to its own and the whole model's state (parameters, gradients,
  Adam moments): ``--np 1, 2, 4`` show the per-rank share fall as 1/P.

With ``--rate 1gbit`` (root; an even ``--np``) the job runs on 2 emulated hosts joined by
a link of that rate (network namespaces, ``plait.testing.netns``), the first half of the
pipeline ranks on one, the rest on the other, so activations and gradients between the two
halves cross the link; the per-rank compute / send / wait columns show where the time goes.

Results go to ``BASE.json`` and ``BASE.md`` (default ``benchmarks/results/pipeline``).
Numbers are reported, never asserted.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import launch, launch_on_hosts, load_note, md_table, meta, parse_args, versions, write_results  # noqa: E402


def theory(schedule: str, p: int, m: int, v: int) -> float:
    """Closed-form bubble fraction of a schedule."""
    return (p - 1) / ((v if schedule == "interleaved" else 1) * m + p - 1)


def memory(world: Any, width: int, blocks: int) -> dict[str, Any]:
    """Peak RSS per rank of a pipeline built per stage (model described on ``meta``), with Adam.

    Measured first in the worker, so the process's high-water mark is this pipeline's:
    ``base`` is the RSS after imports, ``peak`` after one training step, ``state`` the
    parameter + gradient + Adam bytes of this rank's stages (whole model: x P).
    """
    import resource

    import torch

    from plait.parallel.pipeline import Pipeline

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.device("meta"):
        mods: list[torch.nn.Module] = []
        for _ in range(blocks):
            mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
        mods.append(torch.nn.Linear(width, 10))
    pipe = Pipeline(torch.nn.Sequential(*mods), microbatches=4, schedule="1f1b", comm=world,
                    balance="params", loss_fn=torch.nn.CrossEntropyLoss(),
                    optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-4))
    del mods
    x, y = torch.randn(64, width), torch.randint(0, 10, (64,))
    pipe.train_step(x, y)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    state = 4 * 4 * sum(p.numel() for p in pipe.parameters())  # fp32 param, grad, Adam m and v
    whole = 4 * 4 * sum(width * width + width for _ in range(blocks)) + 4 * 4 * (width * 10 + 10)
    pipe.close()
    return {"rank": world.rank, "base": base, "peak": peak, "state": state, "whole_state": whole}


class _Sleep:
    """A stage whose forward and backward sleep (no CPU): the runtime's own cost shows alone.
    A sleep of over 1 ms is cut into up to 4 "layers", between which the stage lets messages
    move (``progress``, set by the runtime), as the torch stages do between their layers."""

    def __init__(self, f: float, shape: tuple[int, int], first: bool, last: bool) -> None:
        import numpy as np

        self.f, self.first, self.last = f, first, last
        self.out = np.zeros(shape, np.float32)  # sent for every micro-batch, never changed
        self.progress: Any = None

    def _compute(self, seconds: float) -> None:
        if seconds <= 0:  # the floors: no compute at all
            return
        layers = max(1, min(4, int(seconds / 1e-3)))
        for i in range(layers):
            if i and self.progress is not None:
                self.progress()
            time.sleep(seconds / layers)

    def forward(self, mb: int, x: Any, target: Any = None) -> Any:
        self._compute(self.f)
        return 0.0 if self.last else self.out

    def backward(self, mb: int, grad: Any) -> Any:
        self._compute(2 * self.f)
        return None if self.first else self.out

    def infer(self, x: Any) -> Any:
        return x


def raw_step(comm: Any, actions: Any, shape: tuple[int, int], f: float = 0.0) -> tuple[float, float]:
    """One step of ``actions`` sent with raw mpi4py: each message posted when its action comes
    (receives polled with ``Test``), the sends waited for at the end. With ``f`` > 0 each
    forward sleeps ``f`` and each backward ``2 f`` seconds, cut into layers as :class:`_Sleep`'s
    (the sends in flight tested between them): the same sleeping stages without plait, the
    bubble any runtime would start from on this machine.

    Returns:
        (seconds of the step, seconds spent in the sleeps).
    """
    import numpy as np
    from mpi4py import MPI

    payload, sends, busy = np.zeros(shape, np.float32), [], 0.0
    comm.Barrier()
    start = time.perf_counter()
    for a in actions:
        kind = a.kind.value
        if kind in ("send_act", "send_grad"):
            tag = (a.stage * 2 + (kind == "send_grad")) * 1024 + a.microbatch  # < 32767 (MPI)
            sends.append(comm.Isend(payload, dest=a.peer, tag=tag))
        elif kind in ("recv_act", "recv_grad"):
            src = a.stage - 1 if kind == "recv_act" else a.stage + 1
            tag = (src * 2 + (kind == "recv_grad")) * 1024 + a.microbatch
            req = comm.Irecv(np.empty(shape, np.float32), source=a.peer, tag=tag)
            while not req.Test():
                pass
        elif f > 0:
            seconds = f if kind == "forward" else 2 * f
            layers = max(1, min(4, int(seconds / 1e-3)))
            began = time.perf_counter()
            for i in range(layers):
                if i:
                    MPI.Request.Testall(sends)
                time.sleep(seconds / layers)
            busy += time.perf_counter() - began
    MPI.Request.Waitall(sends)
    return time.perf_counter() - start, busy


def raw_bubble(comm: Any, actions: Any, shape: tuple[int, int], f: float,
               steps: int) -> tuple[float, float]:
    """Median bubble (as the runtime's: 1 - sum(busy) / (P x makespan)) and median makespan
    (the slowest rank's step seconds) of :func:`raw_step` with stages that sleep ``f`` per
    forward, over ``steps`` steps after one warm-up."""
    p, bubbles, spans = comm.Get_size(), [], []
    for it in range(steps + 1):
        wall, busy = raw_step(comm, actions, shape, f)
        everyone = comm.allgather((wall, busy))
        if it:
            spans.append(max(w for w, _ in everyone))
            bubbles.append(1 - sum(b for _, b in everyone) / (p * spans[-1]))
    return statistics.median(bubbles), statistics.median(spans)


def tight_sleeps() -> None:
    """Make this thread's sleeps end on time: Linux lets a sleep overshoot by the thread's
    timer slack (50 µs by default, ~0.1 ms measured per sleep on this VM); set it to 1 ns
    (``prctl(PR_SET_TIMERSLACK)``), so the sleeping stages stand for compute of their length.
    Nothing happens where prctl is missing."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK = 29
    except (AttributeError, OSError):
        pass


def floors(rt: Any, actions: Any, inputs: Any, m: int, shape: tuple[int, int],
           steps: int) -> tuple[float, float]:
    """Median step seconds (slowest rank) of ``actions`` with no compute: through the runtime
    ``rt`` (its stages' sleeps set to 0) and with raw mpi4py (:func:`raw_step`)."""
    comm, ours, raw = rt.comm, [], []
    saved = {s: ex.f for s, ex in rt.executors.items()}
    for ex in rt.executors.values():
        ex.f = 0.0
    for _ in range(4 * steps + 2):
        comm.barrier()
        start = time.perf_counter()
        rt.run(actions, inputs, [0] * m)
        ours.append(time.perf_counter() - start)
        raw.append(raw_step(comm.comm, actions, shape)[0])
    for s, f in saved.items():
        rt.executors[s].f = f
    slowest = comm.allgather_object((statistics.median(ours[2:]), statistics.median(raw[2:])))
    return max(x[0] for x in slowest), max(x[1] for x in slowest)


def _spin(seconds: float) -> None:
    """Keep the CPU busy (in Python, as a stage's compute would) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def cold_receive(world: Any, computes: list[float], reps: int) -> list[dict[str, Any]]:
    """Median seconds rank 0 takes to receive a 32 KiB message that rank 1 sent while rank 0
    computed (spun) ``c`` seconds, for each ``c`` of ``computes``: with raw mpi4py
    (``Irecv`` + ``Wait``) and through plait's communicator (``recv_async`` + ``wait``, as
    the pipeline runtime receives), each into a new buffer. What one message costs on the
    critical path after a stage's compute; only ranks 0 and 1 take part."""
    import numpy as np

    comm = world.split(0, world.rank)
    raw, r = comm.comm, world.rank
    payload, like = np.ones(8192, np.float32), np.empty(8192, np.float32)
    rows = []
    for c in computes:
        took: dict[str, list[float]] = {"raw": [], "plait": []}
        for it in range(2 * reps):
            way = "raw" if it % 2 else "plait"
            comm.barrier()
            if r == 1:
                req = raw.Isend(payload, 0, 7)
                _spin(c + 5e-4)
                req.Wait()
            elif r == 0:
                _spin(c)  # the message arrives meanwhile
                start = time.perf_counter()
                if way == "raw":  # into a new buffer, as the runtime's (it keeps them)
                    raw.Irecv(np.empty_like(like), 1, 7).Wait()
                else:
                    comm.recv_async(like, 1, 7).wait()
                took[way].append(time.perf_counter() - start)
        if r == 0:
            rows.append({"compute_s": c, "raw_s": statistics.median(took["raw"]),
                         "plait_s": statistics.median(took["plait"])})
    return rows


def sleeping(world: Any, grid: list[int], steps: int, total: float) -> list[dict[str, Any]]:
    """Bubble of the runtime driving stages that sleep: forward + backward of the whole batch
    sleep ``total`` seconds on every rank. The bubble is measured like the model's, from the
    runtime's timers (a sleep's overshoot, ~0.1 ms here, counts as compute), so what it shows
    beyond theory is the runtime's and the messages' cost and the wake-up latency, whatever CPU
    the compute would get."""
    import numpy as np

    from plait.parallel.pipeline import Runtime, get_schedule

    p, r = world.size, world.rank
    comm = world.split(0, r)
    rows = []
    for schedule in ("gpipe", "1f1b", "interleaved"):
        v = 2 if schedule == "interleaved" else 1
        for m in grid:
            if m < 2 or (v > 1 and m % p):
                continue
            vs, f = p * v, total / 3 / m / v
            shape = (max(1, 512 // m), 512)
            rt = Runtime(comm, {s: _Sleep(f, shape, s == 0, s == vs - 1) for s in range(r, vs, p)},
                         vs, m)
            actions = get_schedule(schedule, p, m, v)[r]
            inputs = [np.zeros(shape, np.float32)] * m
            samples = []
            for it in range(steps + 1):
                comm.barrier()
                _, st = rt.run(actions, inputs, [0] * m)
                everyone = comm.allgather_object((st.wall, st.busy, st.send, st.wait))
                if it:
                    samples.append((1 - sum(e[1] for e in everyone) / (p * max(e[0] for e in everyone)),
                                    everyone))
            ours, raw = floors(rt, actions, inputs, m, shape, steps)
            raw_b, raw_span = raw_bubble(comm.comm, actions, shape, f, steps)
            rt.close()
            bubble, everyone = sorted(samples, key=lambda b: b[0])[len(samples) // 2]
            rows.append({"schedule": schedule, "microbatches": m, "total_s": total,
                         "step_s": max(e[0] for e in everyone), "bubble_measured": bubble,
                         "bubble_theory": theory(schedule, p, m, v),
                         "no_compute_s": ours, "no_compute_raw_mpi_s": raw,
                         "bubble_raw_mpi": raw_b,
                         "makespan_s": statistics.median(max(e[0] for e in ev) for _, ev in samples),
                         "makespan_raw_mpi_s": raw_span,
                         "makespan_ideal_s": total / (1 - theory(schedule, p, m, v)),
                         "per_rank": [{"compute_s": e[1], "send_s": e[2], "wait_s": e[3],
                                       "other_s": e[0] - e[1] - e[2] - e[3]} for e in everyone]})
    return rows


def worker(args: Any) -> None:
    import torch

    import plait
    from plait.parallel.pipeline import Pipeline, get_schedule, simulate

    torch.set_num_threads(1)
    tight_sleeps()
    world = plait.init("mpi")
    p = world.size
    mem = world.allgather_object(memory(world, 512 if args.smoke else 2048, 2 if args.smoke else 8))
    width, layers, batch, steps = (512, 8, 512, 3) if args.quick else (1024, 8, 512, 5)
    grid = [1, 4, 8, 16, 32] if args.quick else [1, 2, 4, 8, 16, 32]
    if args.smoke:
        width, layers, batch, steps, grid = 32, 4, 16, 1, [1, 4]
    rng = torch.Generator().manual_seed(0)
    x = torch.randn(batch, width, generator=rng)
    y = torch.randint(0, 10, (batch,), generator=rng)
    rows = []
    for schedule in ("gpipe", "1f1b", "interleaved"):
        v = 2 if schedule == "interleaved" else 1
        for m in grid:
            if schedule == "interleaved" and m % p:
                continue
            torch.manual_seed(0)
            mods: list[torch.nn.Module] = []
            for _ in range(layers):
                mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
            mods.append(torch.nn.Linear(width, 10))
            pipe = Pipeline(torch.nn.Sequential(*mods), microbatches=m, schedule=schedule, comm=world,
                            balance="params", loss_fn=torch.nn.CrossEntropyLoss(),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
            pipe.train_step(x, y)  # warm-up
            walls, bubbles, peaks, split = [], [], [], []
            for _ in range(steps):
                world.barrier()
                start = time.perf_counter()
                pipe.train_step(x, y)
                wall = time.perf_counter() - start
                st = pipe.last_stats
                everyone = world.allgather_object((st.wall, st.busy, st.peak_live, st.send, st.wait))
                makespan = max(e[0] for e in everyone)
                bubbles.append(1 - sum(e[1] for e in everyone) / (p * makespan))
                peaks.append(max(e[2] for e in everyone))
                split.append([(e[1], e[3], e[4]) for e in everyone])
                walls.append(max(world.allgather_object(wall)))
            pipe.close()
            sim = simulate(get_schedule(schedule, p, m, v))
            rows.append({
                "schedule": schedule, "stages": p, "chunks": v, "microbatches": m,
                "batch": batch, "step_s": {"min": min(walls), "median": statistics.median(walls),
                                           "max": max(walls), "n": len(walls)},
                "samples_per_s": batch / statistics.median(walls),
                "bubble_measured": statistics.median(bubbles),
                "bubble_theory": theory(schedule, p, m, v),
                "bubble_simulated": sim.bubble_fraction,
                "peak_live_measured": max(peaks),
                "peak_live_simulated": max(sim.peak_activations),
                # per rank: median seconds of compute, posting sends, waiting for messages
                "per_rank": [{k: statistics.median(step[r][i] for step in split)
                              for i, k in enumerate(("compute_s", "send_s", "wait_s"))}
                             for r in range(p)],
            })
    # a short step (the messages' cost shows) and one of 0.6 s (6-19 ms of compute per
    # micro-batch at M=32, closer to what a model that needs a pipeline computes)
    sleep_rows = [row for total in ([0.006] if args.smoke else [0.06, 0.6])
                  for row in sleeping(world, grid, steps, total)]
    cold = cold_receive(world, [1e-4, 1e-3, 6e-3, 12.5e-3], 3 if args.smoke else 40)
    naive = next(r for r in rows if r["schedule"] == "gpipe" and r["microbatches"] == 1)
    for r in rows:
        r["speedup_vs_naive"] = r["samples_per_s"] / naive["samples_per_s"]
    if world.rank == 0:
        write(rows, args, width, layers, mem, sleep_rows, cold)


def write(rows: list[dict[str, Any]], args: Any, width: int, layers: int,
          mem: list[dict[str, Any]], sleep_rows: list[dict[str, Any]],
          cold: list[dict[str, Any]]) -> None:
    """Rank 0: the JSON and markdown results."""
    p, batch = rows[0]["stages"], rows[0]["batch"]
    mib = 2.0 ** 20
    mem_table = md_table(
        ["rank", "RSS after imports MiB", "peak RSS MiB", "peak - imports MiB", "own state MiB",
         "whole model state MiB"],
        [[m["rank"], f"{m['base'] / mib:.0f}", f"{m['peak'] / mib:.0f}",
          f"{(m['peak'] - m['base']) / mib:.0f}", f"{m['state'] / mib:.0f}",
          f"{m['whole_state'] / mib:.0f}"] for m in mem])
    table = md_table(
        ["schedule", "M", "step ms", "samples/s", "vs naive M=1", "bubble measured", "bubble theory",
         "bubble sim", "peak live", "peak live sim", "compute / send / wait ms per rank"],
        [[r["schedule"], r["microbatches"], f"{1e3 * r['step_s']['median']:.1f}",
          f"{r['samples_per_s']:.0f}", f"{r['speedup_vs_naive']:.2f}x", f"{r['bubble_measured']:.3f}",
          f"{r['bubble_theory']:.3f}", f"{r['bubble_simulated']:.3f}", r["peak_live_measured"],
          r["peak_live_simulated"],
          "; ".join(f"{1e3 * q['compute_s']:.0f} / {1e3 * q['send_s']:.1f} / {1e3 * q['wait_s']:.0f}"
                    for q in r["per_rank"])] for r in rows])
    sleep_table = md_table(
        ["compute ms", "schedule", "M", "step ms", "bubble measured", "bubble theory", "measured / theory",
         "raw mpi4py / theory", "makespan ms: runtime / raw mpi4py / ideal", "theory's idle ms",
         "no compute ms: runtime / raw mpi4py",
         "compute / send / wait / other ms per rank"],
        [[f"{1e3 * r['total_s']:.0f}", r["schedule"], r["microbatches"], f"{1e3 * r['step_s']:.1f}",
          f"{r['bubble_measured']:.3f}",
          f"{r['bubble_theory']:.3f}", f"{r['bubble_measured'] / r['bubble_theory']:.2f}",
          f"{r['bubble_raw_mpi'] / r['bubble_theory']:.2f}",
          f"{1e3 * r['makespan_s']:.1f} / {1e3 * r['makespan_raw_mpi_s']:.1f} / "
          f"{1e3 * r['makespan_ideal_s']:.1f}", f"{1e3 * idle(r):.2f}",
          f"{1e3 * r['no_compute_s']:.2f} / {1e3 * r['no_compute_raw_mpi_s']:.2f}",
          "; ".join(f"{1e3 * q['compute_s']:.1f} / {1e3 * q['send_s']:.1f} / {1e3 * q['wait_s']:.1f} / "
                    f"{1e3 * q['other_s']:.1f}" for q in r["per_rank"])] for r in sleep_rows])
    cold_table = md_table(["compute before the receive ms", "raw mpi4py µs", "plait µs"],
                          [[f"{1e3 * c['compute_s']:g}", f"{1e6 * c['raw_s']:.1f}",
                            f"{1e6 * c['plait_s']:.1f}"] for c in cold])
    markdown = (
        f"# Pipeline parallelism\n\ntorch MLP ({layers} x Linear({width}) + Tanh), P={p} ranks"
        f"{where(args, p)}, batch {batch}{' (quick)' if args.quick else ''}; {load_note()}. "
        f"Bubble measured = 1 - sum(busy) / (P x makespan) from the runtime's per-stage timers; theory "
        f"(P-1)/(vM+P-1); sim = the pure simulator (forward 1, backward 2). Peak live = most "
        f"micro-batch activations alive on one rank.\n\n{table}\n\n"
        f"## Per-stage construction: memory per rank\n\nThe model described once on torch's meta "
        f"device, each rank materialising only its stages (Adam: parameter, gradient and two "
        f"moments, 16 bytes per parameter), one training step; peak RSS from getrusage.\n\n"
        f"{mem_table}\n\n## The runtime alone: stages that sleep\n\nThe same schedules driving stages "
        f"whose forward and backward sleep (compute ms: forward + backward per rank and step, "
        f"split over the micro-batches; activations of the same "
        f"shapes travel; the ranks' timer slack is set to 1 ns so that a sleep ends on time). The "
        f"bubble is measured as above, from the runtime's timers (a sleep's overshoot, about 30 µs "
        f"on this VM with that slack, 0.1 ms without, counts as compute); beyond theory it is the "
        f"runtime's and the messages' cost plus the wake-up latency, whatever CPU the compute would "
        f"get. "
        f"Other = the runtime's own bookkeeping (posting receives, reaping sends). Theory's idle = the "
        f"time each rank idles per step in theory; no compute = the same schedule with stages that "
        f"return at once, through the runtime and with raw mpi4py (each message posted when its "
        f"action comes, receives polled): what the messages alone cost a step. Within 1.15x of "
        f"theory, a step may spend 0.15 x theory's idle on them. Raw mpi4py / theory: the same "
        f"sleeping stages and schedule without plait (raw mpi4py messages as in no compute, the "
        f"sleeps timed as compute): the bubble this machine gives any runtime. Each side's busy is "
        f"what it timed as compute (raw mpi4py's includes testing its sends between a stage's "
        f"layers), so the makespans (median of the slowest rank's step) compare the two on the same "
        f"clock: ideal = compute / (1 - theory's bubble).\n\n{sleep_table}\n\n"
        f"## One message after a stage's compute\n\nRank 0 receives a 32 KiB message that rank 1 "
        f"sent while rank 0 computed (spun in Python) for the given time: median µs from posting "
        f"the receive to its end, raw mpi4py (`Irecv` + `Wait`) and plait's communicator "
        f"(`recv_async` + `wait`, as the runtime receives), each into a new buffer, "
        f"alternating.\n\n{cold_table}")
    write_results(args.out, "pipeline", rows, markdown,
                  meta=meta(quick=args.quick, width=width, blocks=layers, model="torch MLP",
                            link=where(args, p).strip(" ,") or "shared memory (one host)",
                            versions=versions(), memory=mem), sleeping=sleep_rows,
                  cold_receive=cold)


def idle(row: dict[str, Any]) -> float:
    """Seconds each rank idles per step in theory: the bubble fraction of a step whose
    ranks compute ``total_s`` each (``b / (1 - b)`` of it)."""
    b = row["bubble_theory"]
    return float(row["total_s"] * b / (1 - b))


def where(args: Any, ranks: int) -> str:
    """``, on 2 emulated hosts at RATE (N ranks each)`` for a run across hosts, else ``""``."""
    if not args.rate:
        return ""
    each = ranks // 2
    return f", on 2 emulated hosts at {args.rate} ({each} rank{'s' if each > 1 else ''} each)"


def options(p: Any) -> None:
    """The benchmark's own option: ``--rate``."""
    p.add_argument("--rate", default="",
                   help="run across 2 emulated hosts joined by a link of this tc rate (e.g. 1gbit; "
                        "needs root and an even --np): pipeline rank r runs on host r // (np/2)")


def main(ns: Any) -> int:
    """Launch the workers, on this host or across 2 emulated hosts (``--rate``)."""
    if not ns.rate:
        return launch(__file__, ns)
    if ns.np % 2:
        print(f"pipeline: --rate needs an even --np (ranks on 2 hosts), got {ns.np}", file=sys.stderr)
        return 2
    from plait.testing.netns import EmulatedHosts

    with EmulatedHosts(2, subnet="10.79.0", rate=ns.rate, slots=ns.np // 2, clean_env=False) as hosts:
        return launch_on_hosts(hosts, __file__, ns, forward=["--rate", ns.rate])


if __name__ == "__main__":
    ns = parse_args(__doc__.splitlines()[0], extra=options)
    if not ns.worker:
        code = main(ns)
        if code == 0:
            print(Path(ns.out).with_suffix(".md").read_text())
        raise SystemExit(code)
    worker(ns)
