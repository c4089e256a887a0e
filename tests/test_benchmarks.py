"""The benchmark harnesses run and write every row (correctness, not speed)."""

from __future__ import annotations

import json
import subprocess
import sys

from jobs import ROOT, mpi_env

BENCH = ROOT / "benchmarks"


def _run(script: str, out, *args: str, timeout: float = 600) -> dict:
    proc = subprocess.run([sys.executable, str(BENCH / script), "--smoke", "--out", str(out), *args],
                          cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".md").read_text().startswith("## ")
    return data


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
