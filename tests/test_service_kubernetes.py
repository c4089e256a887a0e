"""The kubernetes backend without a cluster: the manifests it would apply (checked against the Kubernetes
API schema with kubernetes-validate where installed), and the pod side of the contract run for real: the
bootstrap each pod starts, with the environment the manifest gives it, on this machine.

No cluster runs here: applying the manifests (``plait serve --backend kubernetes``) is tested only
where ``kubectl`` has a context (see the last test).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import ROOT, mpi_env

from plait.errors import ConfigError
from plait.service.kubernetes import INDEX_ANNOTATION, KubernetesBackend, render, resource_name
from plait.service.spec import make_spec

CODE = ROOT / "tests" / "service_jobs"
JOB = "20261125-abcd1234"
NAME = "plait-20261125-abcd1234"


def _spec(framework: str, instances: int, per_worker: int = 1) -> Any:
    return make_spec(name="digits", entry_point="torch_group.py", code_dir=str(CODE), args=["--epochs", "2"],
                     parameters={"PARALLEL_INSTANCES": str(instances), "lr": "0.1"}, framework=framework,
                     processes_per_worker=per_worker)


def _render(framework: str, instances: int, per_worker: int = 1) -> list[dict[str, Any]]:
    return render(JOB, _spec(framework, instances, per_worker), image="registry.local/plait:1",
                  code_dir=str(CODE), namespace="training")


def _container_env(job: dict[str, Any]) -> list[dict[str, Any]]:
    return list(job["spec"]["template"]["spec"]["containers"][0]["env"])


def _pod_env(job: dict[str, Any], index: int) -> dict[str, str]:
    """The environment a pod of ``job`` with this index gets (the downward API resolved)."""
    env = {}
    for item in _container_env(job):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            assert item["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{INDEX_ANNOTATION}']"
            env[item["name"]] = str(index)
    return env


@pytest.mark.parametrize("framework,instances,per_worker", [
    ("torch", 3, 1), ("tensorflow", 2, 2), ("none", 2, 1), ("torch", 1, 1), ("mpi", 2, 2), ("horovod", 3, 1),
])
def test_manifests_validate_against_the_kubernetes_schema(framework: str, instances: int,
                                                          per_worker: int) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    objects = _render(framework, instances, per_worker)
    for obj in objects:
        meta = obj["metadata"]
        assert meta["labels"]["plait.dev/job"] == JOB and meta["namespace"] == "training"
        if obj["kind"] == "MPIJob":
            continue  # a Kubeflow CRD: no schema in kubernetes-validate; checked below
        kv.validate(obj, kv.latest_version(), strict=True)
    kinds = [o["kind"] for o in objects]
    if framework in ("mpi", "horovod"):
        assert kinds == ["MPIJob"]
    else:
        assert kinds == (["Job"] if instances * per_worker == 1 else ["Service", "Job"])


def test_indexed_job_and_headless_service_give_stable_names() -> None:
    service, job = _render("torch", 3)
    assert service["metadata"]["name"] == job["metadata"]["name"] == NAME == resource_name(JOB)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    pod = job["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["subdomain"] == NAME and pod["spec"]["restartPolicy"] == "Never"
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed", 3, 3, 0)
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "plait.service.bootstrap", "--", "python", "-u",
                                    "/code/torch_group.py", "--epochs", "2"]
    env = _pod_env(job, 0)
    assert json.loads(env["PLAIT_SVC_ENDPOINTS"]) == [f"{NAME}-0.{NAME}:29500"]
    assert json.loads(env["PLAIT_PARAMETERS"]) == {"PARALLEL_INSTANCES": "3", "lr": "0.1"}


def test_mpijob_runs_mpirun_over_the_workers() -> None:
    (mpijob,) = _render("mpi", 2, 2)
    assert mpijob["apiVersion"] == "kubeflow.org/v2beta1" and mpijob["spec"]["slotsPerWorker"] == 2
    replicas = mpijob["spec"]["mpiReplicaSpecs"]
    assert replicas["Worker"]["replicas"] == 2 and replicas["Launcher"]["replicas"] == 1
    command = replicas["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["mpirun", "-np", "4"] and "--allow-run-as-root" in command
    forwarded = {command[i + 1] for i, word in enumerate(command) if word == "-x"}
    assert {"PARALLEL_INSTANCES", "PLAIT_BACKEND", "PLAIT_SVC_PER_WORKER", "PLAIT_JOB_ID"} <= forwarded
    assert command[command.index("--") + 1:][:4] == ["python", "-m", "plait.service.bootstrap", "--"]


def _run_pod(job: dict[str, Any], index: int, tmp_path: Path) -> list[dict[str, str]]:
    """Run the pod's bootstrap here with the manifest's environment; each rank prints its variables."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")
    # one write per process: the pod's ranks share the pipe (and PYTHONUNBUFFERED splits print's writes)
    show = ("import json, os; "
            f"os.write(1, (json.dumps({{k: os.environ.get(k) for k in {names!r}}}) + '\\n').encode())")
    env = {**mpi_env(), **_pod_env(job, index)}
    out = subprocess.run([sys.executable, "-m", "plait.service.bootstrap", "--", sys.executable, "-c", show],
                         env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return sorted((json.loads(line) for line in out.stdout.splitlines()), key=lambda d: int(d["RANK"] or 0))


def test_pods_form_the_torch_and_tensorflow_contracts(tmp_path: Path) -> None:
    _, torch_job = _render("torch", 2, 2)
    ranks = _run_pod(torch_job, 1, tmp_path)  # pod 1 of 2, 2 processes: ranks 2 and 3
    assert [(r["RANK"], r["LOCAL_RANK"], r["GROUP_RANK"], r["WORLD_SIZE"]) for r in ranks] == [
        ("2", "0", "1", "4"), ("3", "1", "1", "4")]
    assert {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in ranks} == {(f"{NAME}-0.{NAME}", "29500")}
    _, tf_job = _render("tensorflow", 3)
    (rank,) = _run_pod(tf_job, 2, tmp_path)
    config = json.loads(rank["TF_CONFIG"] or "{}")
    assert config["task"] == {"type": "worker", "index": 2}
    assert config["cluster"]["worker"] == [f"{NAME}-{i}.{NAME}:2222" for i in range(3)]
    (plain,) = _run_pod(_render("torch", 1)[0], 0, tmp_path)
    assert plain["RANK"] is None and plain["MASTER_ADDR"] is None  # one process: a plain run


def test_bad_input_names_the_argument() -> None:
    with pytest.raises(ConfigError, match="image"):
        render(JOB, _spec("torch", 2), image="", code_dir=str(CODE))
    with pytest.raises(ConfigError, match="namespace"):
        render(JOB, _spec("torch", 2), image="x", code_dir=str(CODE), namespace="a b")
    with pytest.raises(ConfigError, match="job_id"):
        resource_name("x" * 60)
    with pytest.raises(ConfigError, match="slots"):
        KubernetesBackend(0, "x", str(CODE))


def test_kubectl_only_with_a_configured_cluster(tmp_path: Path) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    context = subprocess.run(["kubectl", "config", "current-context"], capture_output=True, text=True,
                             timeout=30)
    if context.returncode != 0:
        with pytest.raises(ConfigError, match="no Kubernetes cluster configured"):
            KubernetesBackend(4, "x", str(CODE))
        return
    pytest.skip(f"a cluster is configured ({context.stdout.strip()}): run 'plait serve --backend kubernetes' "
                "by hand; the suite does not submit to a real cluster")
