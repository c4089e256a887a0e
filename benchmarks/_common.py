"""Shared helpers for every ``benchmarks/*.py`` (use them in new benchmarks).

Conventions (``run_all.py`` relies on them):

* ``python benchmarks/NAME.py [--quick] [--smoke] [--out BASE]`` writes ``BASE.json`` and
  ``BASE.md`` (default ``BASE = benchmarks/results/NAME``) and exits 0.
* The JSON is ``{"benchmark": NAME, "meta": {...}, "rows": [{...}, ...], ...}``;
  timed values are ``{"min": .., "median": .., "max": .., "n": ..}`` (see :func:`stats`).
* A multi-rank benchmark re-invokes itself under ``mpirun`` with ``--worker`` (see
  :func:`launch`); rank 0 of the workers writes the results.

Typical use::

    args = parse_args("what it measures")
    if not args.worker:
        raise SystemExit(launch(__file__, args))
    ... # on every rank: measure, then on rank 0:
    write_results(args.out, "NAME", rows, markdown, meta=meta(quick=args.quick))
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "BENCH_DIR", "RESULTS", "free_port", "fmt_bytes", "launch", "load_note", "machine", "md_table", "meta",
    "mpi_env", "parse_args", "stats", "time_repeats", "timed_iterations", "versions",
    "write_results",
]

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"


def parse_args(description: str, argv: Sequence[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The common command line: ``--quick``, ``--out BASE``, ``--np N`` and the hidden ``--worker``.

    Args:
        description: what the benchmark measures (shown by ``--help``).
        argv: arguments (default ``sys.argv[1:]``).
        extra: adds benchmark-specific options to the parser.

    Returns:
        The parsed arguments; ``out`` defaults to ``benchmarks/results/<script name>``.
    """
    name = Path(sys.argv[0]).stem
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    p.add_argument("--smoke", action="store_true",
                   help="the smallest run that exercises every row (for tests; implies --quick)")
    p.add_argument("--out", default=str(RESULTS / name),
                   help="output path without extension: writes OUT.json and OUT.md")
    p.add_argument("--np", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--timeout", type=float, default=0,
                   help="seconds for the whole job (default 300 with --quick, else 1800)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.quick = True
    if not args.timeout:
        args.timeout = 300 if args.quick else 1800
    if args.out.endswith(".json") or args.out.endswith(".md"):
        args.out = str(Path(args.out).with_suffix(""))
    return args


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for ranks: Open MPI as root, yielding when idle (2 shared cores)."""
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_mpi_yield_when_idle": "1", "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    })
    env.update(extra or {})
    return env


def launch(script: str, args: argparse.Namespace, worker: str = "1",
           forward: Sequence[str] = (), env: dict[str, str] | None = None) -> int:
    """Re-run ``script`` on ``args.np`` ranks under ``mpirun`` with ``--worker WORKER``.

    Args:
        script: the benchmark file (``__file__``).
        args: the parsed common arguments (``--quick`` and ``--out`` are passed on).
        worker: value of ``--worker`` (lets one benchmark run several phases).
        forward: further arguments for the workers.
        env: extra environment variables.

    Returns:
        mpirun's exit status (124 when the job ran out of ``args.timeout``).
    """
    mpirun = shutil.which("mpirun") or "mpirun"
    inner = max(30, int(args.timeout) - 10)
    cmd = [mpirun, "-np", str(args.np), "--oversubscribe", "--bind-to", "none",
           "--timeout", str(inner), sys.executable, str(Path(script).resolve()),
           "--worker", worker, "--out", args.out, *(["--quick"] if args.quick else []),
           *(["--smoke"] if getattr(args, "smoke", False) else []), *forward]
    try:
        proc = subprocess.run(cmd, env=mpi_env(env), timeout=args.timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        print(f"{Path(script).name}: job killed after {args.timeout:g}s", file=sys.stderr)
        return 124
    return proc.returncode


def launch_on_hosts(hosts: Any, script: str, args: argparse.Namespace, worker: str = "1",
                    forward: Sequence[str] = (), env: dict[str, str] | None = None) -> int:
    """:func:`launch` across emulated hosts: ``mpirun`` started on the first one.

    Args:
        hosts: a running ``plait.testing.netns.EmulatedHosts`` (its hostfile places the ranks).
        script: the benchmark file (``__file__``).
        args: the parsed common arguments.
        worker: value of ``--worker``.
        forward: further arguments for the workers.
        env: extra environment variables, passed on to every rank.

    Returns:
        mpirun's exit status.
    """
    extra = {"PYTHONPATH": str(ROOT), **(env or {})}
    full = mpi_env(extra)
    full["PATH"] = f"{hosts.bin_dir}{os.pathsep}{full['PATH']}"
    passed = ["PATH", *extra, "OMPI_MCA_mpi_yield_when_idle", "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL"]
    argv = ["mpirun", "--allow-run-as-root", "-np", str(args.np), "--hostfile", hosts.hostfile,
            *hosts.mpirun_args(), "--timeout", str(max(30, int(args.timeout) - 15)), "--bind-to", "none",
            *[a for v in passed for a in ("-x", v)],
            sys.executable, str(Path(script).resolve()), "--worker", worker, "--out", args.out,
            *(["--quick"] if args.quick else []), *(["--smoke"] if getattr(args, "smoke", False) else []),
            *forward]
    proc = hosts.exec(hosts.hosts[0], argv, timeout=args.timeout, env=full)
    sys.stdout.write(proc.stdout)
    # plait's own notes (e.g. the bucket size it tuned), which launch() shows as they come
    sys.stdout.writelines(line + "\n" for line in proc.stderr.splitlines() if line.startswith("plait:"))
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
    return int(proc.returncode)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stats(samples: Sequence[float]) -> dict[str, float]:
    """``{"min", "median", "max", "n"}`` of the samples."""
    if not samples:
        raise ValueError("stats() of no samples")
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples),
            "n": len(samples)}


def time_repeats(fn: Callable[[], Any], iters: int, repeats: int,
                 sync: Callable[[], Any] | None = None) -> list[float]:
    """Seconds per call of ``fn``: ``repeats`` samples, each the mean over ``iters`` calls.

    ``sync`` (e.g. a barrier) runs before each sample so ranks start together.
    """
    out = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out.append((time.perf_counter() - t0) / iters)
    return out


def machine() -> dict[str, Any]:
    """Cores, memory, load and OS of this machine."""
    info: dict[str, Any] = {"cores": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version(), "host": socket.gethostname()}
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info["memory_gib"] = round(pages / 2**30, 1)
    except (ValueError, OSError):
        pass
    try:
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            models = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if models:
            info["cpu"] = models[0]
    except OSError:
        pass
    return info


def meta(**extra: Any) -> dict[str, Any]:
    """What every result file records: time, machine and the given extras."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(), **extra}


def load_note() -> str:
    """``load average a b c on N cores`` (how busy the machine was)."""
    la = os.getloadavg()
    return f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} on {os.cpu_count()} cores"


def timed_iterations(step: Callable[[], Any], args: Any, verbose: bool) -> dict[str, list[float]]:
    """Horovod's synthetic-benchmark timing: ``args.num_warmup_batches`` untimed calls of
    ``step``, then ``args.num_iters`` iterations of ``args.num_batches_per_iter`` calls.

    Returns:
        ``img_secs`` (``args.batch_size`` images a call, per iteration) and ``cpu_ms``
        (this process's CPU time per call, per iteration); ``verbose`` prints each.
    """
    for _ in range(args.num_warmup_batches):
        step()
    img_secs, cpu_ms = [], []
    for i in range(args.num_iters):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(args.num_batches_per_iter):
            step()
        img_secs.append(args.batch_size * args.num_batches_per_iter / (time.perf_counter() - t0))
        cpu_ms.append(1e3 * (time.process_time() - c0) / args.num_batches_per_iter)
        if verbose:
            print(f"Iter #{i}: {img_secs[-1]:.1f} img/sec per CPU ({cpu_ms[-1]:.1f} CPU ms/step)",
                  flush=True)
    return {"img_secs": img_secs, "cpu_ms": cpu_ms}


def versions() -> dict[str, str]:
    """Versions of what this process already imported (safe inside an MPI job, unlike
    ``plait info``, whose probes are separate processes)."""
    out = {"python": platform.python_version()}
    for mod in ("plait", "numpy", "torch", "tensorflow", "keras", "mpi4py", "horovod"):
        m = sys.modules.get(mod)
        if m is not None and getattr(m, "__version__", None):
            out[mod] = str(m.__version__)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        out["mpi library"] = mpi.Get_library_version().replace("\x00", "").splitlines()[0].strip()
    return out


def fmt_bytes(n: float) -> str:
    """``4 B``, ``64 KiB``, ``16 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:g}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_results(out: str, name: str, rows: list[dict[str, Any]], markdown: str,
                  meta: dict[str, Any], **extra: Any) -> tuple[Path, Path]:
    """Write ``out.json`` (``{"benchmark", "meta", "rows", **extra}``) and ``out.md``.

    Returns:
        The two paths.
    """
    base = Path(out)
    base.parent.mkdir(parents=True, exist_ok=True)
    js, md = base.with_suffix(".json"), base.with_suffix(".md")
    payload = {"benchmark": name, "meta": meta, "rows": rows, **extra}
    tmp = js.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    tmp.replace(js)
    md.write_text(markdown)
    print(f"wrote {js} and {md}")
    return js, md
