"""Every ``benchmarks/*.py`` runs in its smallest mode (``--smoke``, which implies ``--quick``)
and writes every row and column; ``run_all.py --report-only`` builds a report from them.
Correctness of the harnesses, not speed. Outputs go to temporary folders, never to
``benchmarks/results`` or ``benchmarks/REPORT.md``.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from jobs import ROOT, mpi_env

from plait.testing.netns import unavailable_reason

BENCH = ROOT / "benchmarks"
#: each benchmark's table header (its markdown must contain it)
HEADERS = {
    "compression": "| backend | compression | ms/step | speedup | wire MiB/step | ratio | tx MiB/step "
                   "| accuracy % | vs uncompressed |",
    "async_dp": "| mode | samples/s | x sync | steps (fast, slow) | accuracy % | Δ acc | max staleness |",
    "pipeline": "| schedule | M | step ms | samples/s | vs naive M=1 | bubble measured | bubble theory "
                "| bubble sim | peak live | peak live sim | compute / send / wait ms per rank |",
    "tensor": "| variant | ranks | params/rank | step (median, s) | step min-max (s) | comm/rank/step "
              "| analytic |",
    "synthetic": "| model | params | backend | img/s per rank | total img/s | step ms | CPU ms/step |",
    "synthetic_tf": "| model | params | backend | img/s per rank | total img/s | step ms | CPU ms/step |",
    "collectives": "| collective | size | plait-mpi | mpi4py | added µs | time ratio |",
    "dp_overhead": "| model | params / tensors | impl | step ms | wrapper ms | share of the step "
                   "| timers ms |",
}


def _module(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def _run(script: str, out: Path, *args: str, timeout: float = 600) -> dict[str, Any]:
    began = time.monotonic()
    proc = subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--out", str(out), *args],
                          cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    print(f"\n[benchmarks] {script} --smoke: {time.monotonic() - began:.0f}s")
    assert proc.returncode == 0, proc.stdout[-6000:]
    data: dict[str, Any] = json.loads(out.with_suffix(".json").read_text())
    md = out.with_suffix(".md").read_text()
    assert md.startswith("#"), md[:200]
    name = Path(script).stem
    if name in HEADERS:
        assert HEADERS[name] in md, md
        # one table line per row, each with as many cells as the header (the table is the
        # header's run of "|" lines; other tables may follow)
        cells = HEADERS[name].count("|")
        table = md[md.index(HEADERS[name]):].split("\n\n", 1)[0]
        lines = [line for line in table.splitlines() if line.startswith("|") and line.count("|") == cells]
        assert len(lines) == 2 + len(data["rows"]), md  # header, separator, rows
    assert data["benchmark"] == name and data["meta"]["quick"] is True
    return data


def _snapshot() -> dict[Path, int]:
    """benchmarks/REPORT.md and benchmarks/results/*: path -> modification time."""
    paths = [BENCH / "REPORT.md", *(BENCH / "results").glob("*")]
    return {p: p.stat().st_mtime_ns for p in paths if p.exists()}


def _has_stats(value: dict[str, Any], n: int | None = None) -> None:
    assert 0 < value["min"] <= value["median"] <= value["max"], value
    assert n is None or value["n"] == n, value


def test_allreduce_benchmark_has_every_row(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import allreduce
    finally:
        sys.path.remove(str(BENCH))
    data = _run("allreduce.py", tmp_path / "ar")
    got = {(r["impl"], r["bytes"]) for r in data["rows"]}
    assert got == {(i, s) for i in allreduce.IMPLS for s in allreduce.SMOKE_SIZES}
    for r in data["rows"]:
        lat = r["latency_us"]
        assert 0 < lat["min"] <= lat["median"] <= lat["max"] and lat["n"] == 2
    ratio_rows = {(r["impl"], r["raw"], r["bytes"]) for r in data["ratios"]}
    assert ("plait-mpi", "mpi4py", 4) in ratio_rows
    assert ("plait-mpi", "plait-mpi-nocheck", 4) in ratio_rows  # the agreement check's cost
    assert data["meta"]["np"] == 2 and data["meta"]["machine"]["cores"] >= 1


def test_collectives_benchmark_has_every_row(tmp_path: Path) -> None:
    """Every collective on one host, plait-mpi next to raw mpi4py, with its spread."""
    collectives = _module("collectives")
    data = _run("collectives.py", tmp_path / "coll")
    got = {(r["kind"], r["bytes"]) for r in data["rows"]}
    assert got == {(k, s) for k in collectives.KINDS for s in collectives.SMOKE_SIZES}
    for r in data["rows"]:
        for impl in collectives.IMPLS:
            _has_stats(r["latency_us"][impl], 2)
        assert r["time_ratio"] > 0
    assert data["meta"]["np"] == 2


def test_link_benchmark_has_every_row(tmp_path: Path) -> None:
    """The emulated-link benchmark: every implementation's row, with its spread."""
    link = _module("link")
    data = _run("link.py", tmp_path / "link")
    got = {(r["kind"], r["impl"], r["bytes"], r["rate"], r["np"]) for r in data["rows"]}
    assert got == {(k, i, s, "1gbit", 2) for k in link.SMOKE_KINDS for i in link.IMPLS
                   for s in link.SMOKE_SIZES if k == "allreduce" or not i.endswith("fp16")}
    for r in data["rows"]:
        _has_stats(r["ms"], 2)
        _has_stats(r["link_fraction"], 2)
    assert "fraction of the link rate" in (tmp_path / "link.md").read_text()


def test_dp_step_benchmark_has_every_row(tmp_path):
    data = _run("dp_step.py", tmp_path / "dp")
    got = {(r["framework"], r["model"], r["impl"]) for r in data["rows"]}
    torch_impls = {"single", "plait-mpi", "plait-horovod", "horovod", "ddp-gloo"}
    tf_impls = {"single", "plait-mpi", "plait-horovod", "horovod", "tf-mwms"}
    assert got == ({("torch", m, i) for m in ("mlp", "cnn") for i in torch_impls}
                   | {("tensorflow", m, i) for m in ("mlp", "cnn") for i in tf_impls})
    for r in data["rows"]:
        assert r["steps_per_s"]["median"] > 0
        if r["model"] == "mlp":
            assert 4e6 < r["params"] < 6e6
    assert {(r["framework"], r["impl"]) for r in data["ratios"]} == {
        (f, i) for f in ("torch", "tensorflow") for i in ("plait-mpi", "plait-horovod")}


def test_dp_overhead_benchmark_has_every_row(tmp_path: Path) -> None:
    """The wrapper's own time: both models, both backends and real Horovod's optimizer, a
    share of a step that was timed."""
    data = _run("dp_overhead.py", tmp_path / "dpo")
    assert {(r["model"], r["impl"]) for r in data["rows"]} == {
        (m, i) for m in ("mlp", "deep") for i in ("plait-mpi", "plait-horovod", "horovod")}
    for r in data["rows"]:
        _has_stats(r["step_ms"], 2)
        _has_stats(r["wrapper_ms"], 2)
        assert 0 < r["share"] < 1 and r["timers_ms"] > 0, r
    assert {r["tensors"] for r in data["rows"]} == {6, 34}


def test_synthetic_benchmark_has_every_row(tmp_path: Path) -> None:
    """The Horovod-style synthetic benchmark: one job of the same script per backend."""
    synthetic = _module("synthetic")
    data = _run("synthetic.py", tmp_path / "syn")
    got = {(r["model"], r["backend"]) for r in data["rows"]}
    assert got == {(m, b) for m in synthetic.MODELS for b in synthetic.BACKENDS}
    for r in data["rows"]:
        assert r["img_per_s"] > 0 and r["ci95"] >= 0 and r["n"] == 2 and r["np"] == 2
        assert r["cpu_ms"] > 0
        assert 5e6 < r["params"] < 1e7
    assert {(r["model"], r["backend"], r["peer"]) for r in data["ratios"]} == {
        (m, b, p) for m in synthetic.MODELS for b in ("plait-mpi", "plait-horovod")
        for p in synthetic.PEERS}


def test_synthetic_tensorflow_benchmark_has_its_rows(tmp_path: Path) -> None:
    """The Keras half (``synthetic_tf.py``, Horovod's TF2 synthetic benchmark), here for the
    transformer (an embedding: its gradient is allgathered) on plait-mpi and
    MultiWorkerMirroredStrategy, one job each."""
    data = _run("synthetic_tf.py", tmp_path / "syn_tf", "--model", "transformer", "--backend",
                "plait-mpi,tf-mwms")
    assert [(r["framework"], r["model"], r["backend"]) for r in data["rows"]] == [
        ("tensorflow", "transformer", "plait-mpi"), ("tensorflow", "transformer", "tf-mwms")]
    for r in data["rows"]:
        assert r["img_per_s"] > 0 and r["n"] == 2 and r["np"] == 2 and r["cpu_ms"] > 0
        assert 5e6 < r["params"] < 1e7
    assert [(r["backend"], r["peer"]) for r in data["ratios"]] == [("plait-mpi", "tf-mwms")]
    assert data["meta"]["framework"] == "tensorflow"


@pytest.mark.skipif(unavailable_reason(need_tc=True) is not None,
                    reason=str(unavailable_reason(need_tc=True)))
def test_compression_benchmark_has_every_row(tmp_path: Path) -> None:
    """Two emulated hosts at 1 Gbit/s (root: network namespaces and tc)."""
    compression = _module("compression")
    data = _run("compression.py", tmp_path / "cmp")
    rows = data["rows"]
    assert [r["name"] for r in rows] == [*compression.QUICK, *compression.DDP[::2]]
    assert data["meta"]["steps"] == 3 and data["meta"]["warmup"] == 2
    for r in rows:
        assert r["step_s"] > 0 and r["timed_steps"] == 1 and 0 <= r["accuracy"] <= 100
        assert r["speedup_vs_uncompressed"] > 0 and r["accuracy_delta"] is not None
        assert len(r["tx_bytes_per_step_by_rank"]) == 2
        # the gradients cross the emulated link (eth0's counter): for plait rows at least
        # about what the compressor handed to the collectives
        assert r["tx_bytes_per_step"] > 10_000, r
        if r["kind"] == "plait":
            assert 0 < r["wire_bytes_per_step"] <= r["raw_bytes_per_step"]
            assert r["tx_bytes_per_step"] >= r["wire_bytes_per_step"] / 2, r
    by = {r["name"]: r for r in rows}
    assert by["none"]["wire_bytes_per_step"] == by["none"]["raw_bytes_per_step"]
    assert by["topk 1% + EF"]["wire_bytes_per_step"] < by["none"]["wire_bytes_per_step"] / 20


def test_async_dp_benchmark_has_every_row(tmp_path: Path) -> None:
    async_dp = _module("async_dp")
    data = _run("async_dp.py", tmp_path / "adp")
    rows = data["rows"]
    assert [r["mode"] for r in rows] == list(async_dp.MODES)
    assert data["meta"]["seconds"] == 0.5
    for r in rows:
        assert r["throughput"] > 0 and r["wall_s"] >= 0.5 and 0 <= r["accuracy"] <= 100
        assert len(r["steps_per_worker"]) == 2 and min(r["steps_per_worker"]) > 0
        assert (r["metrics"] is None) == (r["mode"] == "sync")
    assert rows[0]["speedup_vs_sync"] == 1.0


def test_elastic_recovery_benchmark_has_every_row(tmp_path: Path) -> None:
    recovery = _module("elastic_recovery")
    data = _run("elastic_recovery.py", tmp_path / "er")
    rows = data["rows"]
    assert [r["backend"] for r in rows] == list(recovery.BACKENDS)
    for r in rows:  # the survivor went on alone after the kill and finished
        assert r["rc"] == 0 and r["recovery_s"] > 0 and r["step_ms"] > 0, r
        assert r["size_after"] == 1 and r["finished"] is True, r


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One ``pipeline.py --smoke`` run for the two tests that read it: (results dir, data)."""
    results = tmp_path_factory.mktemp("results")
    return results, _run("pipeline.py", results / "pipeline")


def test_pipeline_benchmark_has_every_row(pipeline_results: tuple[Path, dict[str, Any]]) -> None:
    data = pipeline_results[1]
    got = {(r["schedule"], r["microbatches"]) for r in data["rows"]}
    # --smoke: M in (1, 4); interleaved (2 chunks per rank) needs M a multiple of the 2 stages
    assert got == {("gpipe", 1), ("gpipe", 4), ("1f1b", 1), ("1f1b", 4), ("interleaved", 4)}
    for r in data["rows"]:
        _has_stats(r["step_s"], 1)
        assert r["stages"] == 2 and r["samples_per_s"] > 0
        assert 0 <= r["bubble_theory"] < 1 and r["bubble_theory"] == pytest.approx(r["bubble_simulated"])
        assert 1 <= r["peak_live_measured"] and r["peak_live_measured"] == r["peak_live_simulated"]
    # the runtime alone (sleeping stages), with its floors: the same schedule without compute
    assert {(r["schedule"], r["microbatches"]) for r in data["sleeping"]} == got - {("gpipe", 1),
                                                                                  ("1f1b", 1)}
    for r in data["sleeping"]:
        assert r["no_compute_s"] > 0 and r["no_compute_raw_mpi_s"] > 0
        assert 0 <= r["bubble_raw_mpi"] < 1  # the same sleeping stages with raw mpi4py
    # one message received after each length of compute, raw and through plait
    assert [c["compute_s"] for c in data["cold_receive"]] == [1e-4, 1e-3, 6e-3, 12.5e-3]
    assert all(c["raw_s"] > 0 and c["plait_s"] > 0 for c in data["cold_receive"])


def test_tensor_benchmark_has_every_row(tmp_path: Path) -> None:
    data = _run("tensor.py", tmp_path / "tp")
    dense, tp = data["rows"]
    assert (dense["variant"], tp["variant"]) == ("dense", "tp=2")
    _has_stats(dense["step_s"], 2)
    _has_stats(tp["step_s"], 2)
    # the sharded model holds about half the parameters per rank; traffic is as analysed
    assert tp["param_bytes_per_rank"] < 0.75 * dense["param_bytes_per_rank"]
    assert tp["comm_bytes_per_step"] == tp["analytic_bytes_per_step"] > 0


def test_run_all_report_only_writes_a_report_elsewhere(
        tmp_path: Path, pipeline_results: tuple[Path, dict[str, Any]]) -> None:
    """``run_all.py --report-only --results DIR --report PATH`` on results made here (the
    pipeline's, which has a plot): the report names the machine, versions, the section and
    the plot, and nothing under benchmarks/ changes."""
    results = pipeline_results[0]
    before = _snapshot()
    report = tmp_path / "REPORT.md"
    began = time.monotonic()
    proc = subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--report-only", "--results",
                           str(results), "--report", str(report)], cwd=ROOT, env=mpi_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    print(f"\n[benchmarks] run_all.py --report-only: {time.monotonic() - began:.0f}s")
    assert proc.returncode == 0, proc.stdout[-4000:]
    text = report.read_text()
    for heading in ("# plait benchmark report", "## Machine", "## Versions", "## Noise", "## Plots",
                    "## pipeline"):
        assert heading in text, text
    assert HEADERS["pipeline"] in text, text
    assert (results / "pipeline_bubble.png").stat().st_size > 0
    link = os.path.relpath(results / "pipeline_bubble.png", report.parent)
    assert f"]({link})" in text, text  # relative to the report
    for name in ("allreduce", "dp_step", "compression", "async_dp", "tensor"):
        assert f"## {name}\n" not in text  # only what the results folder holds
    assert _snapshot() == before
