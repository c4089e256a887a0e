"""``make bench``: run every ``benchmarks/*.py`` and write ``benchmarks/REPORT.md``.

Each benchmark runs alone (``python benchmarks/NAME.py [--quick]``) and writes
``benchmarks/results/NAME.json`` and ``NAME.md``; a missing or failing one is
reported with a line and the others still run. The report has the machine
(cores, memory, load before and after), the versions (``plait info --json``),
each benchmark's tables (which state min/median/max over repeats), a summary of
plait's ratios to its peers, and PNG plots where the data exists: allreduce
bus bandwidth vs size, step time per compressor, pipeline bubble vs micro-batches.

Run: ``python benchmarks/run_all.py [--quick] [--only a,b] [--report PATH] [--results DIR]
[--report-only]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import BENCH_DIR, RESULTS, machine, mpi_env

#: what `make bench` is expected to run (others found in benchmarks/ run too)
EXPECTED = ["allreduce", "collectives", "link", "dp_step", "dp_overhead", "compression", "async_dp",
            "pipeline", "tensor"]
NOT_BENCHMARKS = {"run_all", "_common"}


def discover() -> list[str]:
    """Benchmarks present in ``benchmarks/``: the expected ones first, then any others."""
    found = sorted(p.stem for p in BENCH_DIR.glob("*.py")
                   if p.stem not in NOT_BENCHMARKS and not p.stem.startswith("_"))
    return [n for n in EXPECTED if n in found] + [n for n in found if n not in EXPECTED]


def run_one(name: str, quick: bool, timeout: float) -> dict[str, Any]:
    """Run one benchmark; returns its status, seconds and the output's tail."""
    cmd = [sys.executable, str(BENCH_DIR / f"{name}.py"), "--out", str(RESULTS / name),
           *(["--quick"] if quick else [])]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=BENCH_DIR.parent, env=mpi_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout,
                              start_new_session=True)
        rc, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        rc = 124
        out = (exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes)
               else exc.stdout or "") + f"\n[killed after {timeout:g}s]"
    secs = time.monotonic() - t0
    status = "ok" if rc == 0 else f"failed (exit status {rc})"
    print(f"   {status} in {secs:.0f} s", flush=True)
    if rc != 0:
        print("\n".join(out.splitlines()[-15:]), flush=True)
    return {"name": name, "status": status, "seconds": secs, "tail": out.splitlines()[-15:]}


def plait_info() -> dict[str, str]:
    """``plait info --json`` (versions of everything), or an error entry."""
    try:
        proc = subprocess.run([sys.executable, "-m", "plait.cli", "info", "--json"],
                              capture_output=True, text=True, timeout=300)
        return dict(json.loads(proc.stdout))
    except (subprocess.SubprocessError, json.JSONDecodeError, OSError) as exc:
        return {"plait info": f"failed: {exc}"}


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError):
        return None


def _median(v: Any) -> float | None:
    if isinstance(v, dict):
        v = v.get("median")
    return float(v) if isinstance(v, (int, float)) else None


# -- plots ------------------------------------------------------------------------------------
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(plt: Any, fig: Any, ax: Any, out: Path, xlabel: str, ylabel: str, title: str,
            legend: int = 8, ylog: bool = False) -> Path:
    """Label a log2-x plot, save it to ``out`` and close it."""
    ax.set_xscale("log", base=2)
    if ylog:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=legend)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_bandwidth(data: dict[str, Any], out: Path) -> Path | None:
    """Allreduce bus bandwidth vs message size, one line per implementation."""
    rows = data.get("rows", [])
    impls = list(dict.fromkeys(r["impl"] for r in rows if "busbw_GBps" in r))
    if not impls:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl in impls:
        pts = sorted((r["bytes"], r["busbw_GBps"]) for r in rows if r.get("impl") == impl)
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1]["median"] for p in pts], marker="o", label=impl)
        ax.fill_between(xs, [p[1]["min"] for p in pts], [p[1]["max"] for p in pts], alpha=0.12)
    return _finish(plt, fig, ax, out, "message size (bytes)", "bus bandwidth (GB/s), median; band: min–max",
                   f"Allreduce on {data.get('meta', {}).get('np', 2)} ranks", legend=8, ylog=True)


def plot_link(data: dict[str, Any], out: Path) -> Path | None:
    """Allreduce's fraction of the link rate vs message size, one line per implementation
    and run (the other collectives are in the tables)."""
    rows = [r for r in data.get("rows", [])
            if "link_fraction" in r and r.get("kind", "allreduce") == "allreduce"]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for key in dict.fromkeys((r["impl"], r["rate"], r["np"]) for r in rows):
        pts = sorted((r["bytes"], r["link_fraction"]) for r in rows
                     if (r["impl"], r["rate"], r["np"]) == key)
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1]["median"] for p in pts], marker="o",
                label=f"{key[0]} ({key[1]}, {key[2]} ranks)")
    return _finish(plt, fig, ax, out, "message size (bytes, float32)", "fraction of the link rate (median)",
                   "Allreduce across 2 emulated hosts", legend=7)


_TIME_KEYS = ("step_ms", "step_s", "time_ms", "time_s", "seconds", "step_time_s", "step_time_ms")


def plot_compressors(data: dict[str, Any], out: Path) -> Path | None:
    """Step time per compressor (bars; any other text columns label the groups)."""
    rows = [r for r in data.get("rows", []) if "compressor" in r]
    key = next((k for k in _TIME_KEYS if any(_median(r.get(k)) is not None for r in rows)), None)
    if not rows or key is None:
        return None
    plt = _pyplot()
    labels, values = [], []
    for r in rows:
        v = _median(r.get(key))
        if v is None:
            continue
        extra = [str(r[k]) for k in sorted(r) if k != "compressor" and isinstance(r[k], str)]
        labels.append(" ".join([str(r["compressor"]), *extra]))
        values.append(v)
    fig, ax = plt.subplots(figsize=(8, max(3, 0.35 * len(values) + 1)))
    ax.barh(range(len(values)), values)
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"{key} (median)")
    ax.set_title("Step time per compressor")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_bubble(data: dict[str, Any], out: Path) -> Path | None:
    """Pipeline bubble fraction vs micro-batches, per schedule (measured and theory)."""
    rows = [r for r in data.get("rows", []) if "microbatches" in r]
    measured = next((k for k in ("bubble_measured", "bubble") if any(k in r for r in rows)), None)
    if not rows or measured is None:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    schedules = list(dict.fromkeys(str(r.get("schedule", "pipeline")) for r in rows))
    for i, s in enumerate(schedules):
        pts = sorted((r["microbatches"], r) for r in rows if str(r.get("schedule", "pipeline")) == s)
        xs = [p[0] for p in pts]
        color = f"C{i}"
        ax.plot(xs, [_median(p[1].get(measured)) for p in pts], marker="o", color=color,
                label=f"{s} measured")
        if all("bubble_theory" in p[1] for p in pts):
            ax.plot(xs, [p[1]["bubble_theory"] for p in pts], linestyle="--", color=color,
                    label=f"{s} theory")
    return _finish(plt, fig, ax, out, "micro-batches", "bubble fraction",
                   "Pipeline bubble vs micro-batches", legend=8)


# -- report -----------------------------------------------------------------------------------
def _summary() -> list[str]:
    lines = []
    ar = _load("allreduce")
    if ar:
        for r in ar.get("ratios", []):
            if r.get("raw") in ("mpi4py", "horovod") and r["bytes"] >= 2**20:
                lines.append(f"- allreduce {r['bytes'] / 2**20:g} MiB: {r['impl']} / {r['raw']} = "
                             f"{r['time_ratio']:.2f}x (target <= 1.05x)")
        small = [r for r in ar.get("ratios", []) if r.get("raw") in ("mpi4py", "horovod")
                 and r["bytes"] <= 1024]
        for r in small:
            lines.append(f"- allreduce {r['bytes']} B: {r['impl']} overhead vs {r['raw']} = "
                         f"{r['overhead_us']:+.0f} µs (target <= 20 µs)")
    coll = _load("collectives")
    if coll:
        for r in coll.get("rows", []):
            if r["kind"] != "allreduce" and r["bytes"] <= 4096:
                lines.append(f"- {r['kind']} {r['bytes']} B on one host: plait-mpi overhead vs "
                             f"mpi4py = {r['added_us']:+.0f} µs (target <= 20 µs)")
    link = _load("link")
    if link:
        for r in link.get("rows", []):
            if r["impl"] == "plait-mpi" and r["bytes"] >= 2**20:
                lines.append(f"- link {r['rate']}, {r['np']} ranks, {r.get('kind', 'allreduce')} "
                             f"{r['bytes'] / 2**20:g} MiB: "
                             f"plait-mpi at {r['link_fraction']['median']:.2f} of the link rate "
                             "(target >= 0.95)")
    dp = _load("dp_step")
    if dp:
        for r in dp.get("ratios", []):
            lines.append(f"- {r['framework']} {r['model']}: {r['impl']} = {r['ratio']:.2f}x the "
                         f"fastest peer ({r['fastest_peer']}) (target >= 1.0x)")
    return lines


def _demote(md: str) -> str:
    return re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", md, flags=re.M)


def write_report(path: Path, runs: list[dict[str, Any]], before: dict[str, Any],
                 info: dict[str, str], quick: bool) -> None:
    after = machine()
    plots = []
    for name, fn, png in (("allreduce", plot_bandwidth, "allreduce_busbw.png"),
                          ("link", plot_link, "link_fraction.png"),
                          ("compression", plot_compressors, "compression_step_time.png"),
                          ("pipeline", plot_bubble, "pipeline_bubble.png")):
        data = _load(name)
        made = fn(data, RESULTS / png) if data else None
        if made is not None:
            plots.append((name, made))
    rel = os.path.relpath(RESULTS, path.parent)
    out = [f"# plait benchmark report{' (quick)' if quick else ''}\n",
           f"Written {time.strftime('%Y-%m-%d %H:%M:%S %Z')} by `benchmarks/run_all.py"
           f"{' --quick' if quick else ''}` (`make bench`).\n",
           "\n## Machine\n",
           f"- {before.get('cores')} cores ({before.get('cpu', '?')}), "
           f"{before.get('memory_gib', '?')} GiB memory, {before.get('platform', '')}\n",
           (f"- load average before: {before.get('loadavg')}, after: {after.get('loadavg')} "
            if runs else f"- load average now: {after.get('loadavg')} (each table notes the load "
            "during its own run) ")
           + "(other jobs share this machine; see the noise in each table)\n",
           "\n## Versions (`plait info --json`)\n\n"]
    out += [f"- {k}: {v}\n" for k, v in info.items()]
    out.append("\n## Runs\n\n")
    for r in runs:
        out.append(f"- {r['name']}: {r['status']}" + (f", {r['seconds']:.0f} s" if "seconds" in r
                                                      else "") + "\n")
    summary = _summary()
    if summary:
        out.append("\n## plait vs its peers (medians)\n\n" + "\n".join(summary) + "\n")
    out.append("\n## Noise\n\nEvery timed value is reported as median (min–max) over repeats; "
               "each benchmark's section says how many. Wide ranges mean the machine was busy.\n")
    if plots:
        out.append("\n## Plots\n\n")
        out += [f"![{n}]({rel}/{p.name})\n\n" for n, p in plots]
    ran = {r["name"] for r in runs}
    earlier = [n for n in EXPECTED + discover() if n not in ran and (RESULTS / f"{n}.md").exists()]
    for n in dict.fromkeys(earlier):
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime((RESULTS / f"{n}.md").stat().st_mtime))
        runs.append({"name": n, "status": "ok", "note": f"not run by this invocation; results "
                     f"written {when}"})
    for r in runs:
        md = RESULTS / f"{r['name']}.md"
        if r.get("note"):
            out.append(f"\n## {r['name']}\n\n_{r['note']}._\n\n" + _demote(md.read_text()) + "\n")
            continue
        if r["status"] == "ok" and md.exists():
            out.append(f"\n## {r['name']}\n\n" + _demote(md.read_text()) + "\n")
        elif r["status"] != "ok" and not r["status"].startswith("skipped"):
            out.append(f"\n## {r['name']}\n\n{r['status']}; last lines:\n\n```\n"
                       + "\n".join(r.get("tail", [])) + "\n```\n")
    path.write_text("".join(out).replace("\x00", ""))  # MPI's version string ends in a NUL
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    global RESULTS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    p.add_argument("--only", default="", help="comma-separated benchmark names")
    p.add_argument("--report", default=str(BENCH_DIR / "REPORT.md"), help="report path")
    p.add_argument("--timeout", type=float, default=0,
                   help="seconds per benchmark (default 600 with --quick, else 3600)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild the report and plots from the results folder")
    p.add_argument("--results", default=str(RESULTS),
                   help="folder of the NAME.json/NAME.md results and the plots (default "
                        "benchmarks/results)")
    args = p.parse_args(argv)
    RESULTS = Path(args.results).resolve()
    if args.report_only:
        write_report(Path(args.report), [], machine(), plait_info(), args.quick)
        return 0
    timeout = args.timeout or (600 if args.quick else 3600)
    present = discover()
    wanted = [n.strip() for n in args.only.split(",") if n.strip()] or EXPECTED + [
        n for n in present if n not in EXPECTED]
    before = machine()
    runs = []
    for name in wanted:
        if name not in present:
            print(f"== {name}: skipped (benchmarks/{name}.py does not exist yet)", flush=True)
            runs.append({"name": name, "status": f"skipped: benchmarks/{name}.py does not exist"})
            continue
        runs.append(run_one(name, args.quick, timeout))
    info = plait_info()
    write_report(Path(args.report), runs, before, info, args.quick)
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
