"""The kubernetes backend's cluster-aware parts, without a cluster: the capacity read from the nodes'
allocatable resources, Kubeflow PyTorchJob/TFJob submission (discovery, create, status from the
conditions, delete), and live pod logs, all through the real ``kubernetes`` client against the fake API
server of ``test_service_kubernetes`` (which records every request).

The Kubeflow custom resources have no schema in kubernetes-validate: their pod templates are validated
as ``PodTemplate`` objects of the Kubernetes API, and the CR fields the operator reads are checked
one by one. No cluster runs here: submitting to a live cluster is not part of these tests.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from test_service_kubernetes import (
    CODE,
    JOB,
    NAME,
    FakeAPI,
    _assert_output_volume,
    _backend,
    _pod,
    _spec,
    _validate_templates,
    _wait,
    fake_api,
)

from plait.errors import ConfigError
from plait.service import kubecapacity
from plait.service.core import Service
from plait.service.kubeflow import REPLICA_INDEX, REPLICA_TYPE, job_state, replica_rank
from plait.service.kubernetes import render
from plait.service.spec import CapacityError
from plait.service.store import JobStore

Api = tuple[FakeAPI, str]


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Api]:
    """The fake API server of ``test_service_kubernetes`` and a kubeconfig for it (context ``fake``)."""
    yield from fake_api(tmp_path, monkeypatch)
PYTORCHJOBS = "/apis/kubeflow.org/v1/namespaces/training/pytorchjobs"
TFJOBS = "/apis/kubeflow.org/v1/namespaces/training/tfjobs"


def _node(name: str, allocatable: dict[str, str], *, ready: bool = True, unschedulable: bool = False,
          taint: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"unschedulable": unschedulable}
    if taint:
        spec["taints"] = [{"key": "node-role.kubernetes.io/control-plane", "effect": taint}]
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": spec,
            "status": {"allocatable": allocatable, "capacity": allocatable,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


NODES = [
    _node("a", {"cpu": "4", "memory": "16Gi", "pods": "110"}),
    _node("b", {"cpu": "3800m", "memory": "8Gi", "pods": "2"}),  # 3 CPUs but 2 pods
    _node("gpu", {"cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "2"}),
    _node("cordoned", {"cpu": "8", "pods": "110"}, unschedulable=True),
    _node("down", {"cpu": "8", "pods": "110"}, ready=False),
    _node("control", {"cpu": "8", "pods": "110"}, taint="NoSchedule"),
]


# -- capacity from the cluster ---------------------------------------------------------------------------

def test_capacity_is_read_from_the_nodes(api: Api) -> None:
    server, kubeconfig = api
    server.nodes = NODES
    backend = _backend(kubeconfig, slots=None)  # type: ignore[arg-type]
    assert backend.capacity == 4 + 2 + 16 and backend.free_slots() == 22
    assert server.calls() == [("GET", "/api/v1/nodes")]  # and every namespace's pods
    assert _backend(kubeconfig, slots=None, slot=("nvidia.com/gpu", "1")).capacity == 2  # type: ignore[arg-type]
    assert _backend(kubeconfig, slots=None, slot="cpu=500m").capacity == 8 + 2 + 32  # type: ignore[arg-type]
    requests = len(server.requests)
    assert _backend(kubeconfig, slots=3).capacity == 3 and len(server.requests) == requests  # given: not read

    # re-read when due: a node added; a failed reading keeps the last capacity
    server.nodes = [*NODES, _node("c", {"cpu": "2", "pods": "110"})]
    assert backend.refresh_capacity() == 22  # within capacity_refresh_s
    assert backend.refresh_capacity(force=True) == 24 and backend.capacity == 24
    server.nodes = [*NODES, _node("c", {"cpu": "3", "pods": "110"})]
    backend.capacity_refresh_s = 0.0
    assert backend.capacity == 25  # what a submitted job is checked against: re-read when due
    server.fail[("GET", "/api/v1/nodes")] = (403, "Forbidden")
    assert backend.refresh_capacity(force=True) == 25 and backend.free_slots() == 25
    server.nodes = [NODES[3], NODES[4]]
    del server.fail[("GET", "/api/v1/nodes")]
    with pytest.raises(ConfigError, match="hold no process asking for cpu=1.*--slots"):
        _backend(kubeconfig, slots=None)  # type: ignore[arg-type]
    server.fail[("GET", "/api/v1/nodes")] = (403, "Forbidden")
    with pytest.raises(ConfigError, match="listing nodes failed.*RBAC"):
        _backend(kubeconfig, slots=None)  # type: ignore[arg-type]


def _other(node: str | None, cpu: str, phase: str = "Running",
           labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Another workload's pod asking for ``cpu``."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"other-{node}-{cpu}", "namespace": "team", "labels": labels or {}},
            "spec": {"nodeName": node, "containers": [
                {"name": "c", "image": "x", "resources": {"requests": {"cpu": cpu}}}]},
            "status": {"phase": phase}}


def test_other_workloads_pods_take_slots_and_jobs_wait_for_them(api: Api) -> None:
    server, kubeconfig = api
    server.nodes = NODES
    server.others = [_other("a", "2500m"), _other("b", "100m"), _other("gpu", "16"),
                     _other("a", "4", phase="Succeeded"), _other(None, "8"),  # ended; not bound
                     _other("a", "4", labels={"plait.dev/job": "j"})]  # plait's own: the service's slots
    backend = _backend(kubeconfig, slots=None)  # type: ignore[arg-type]
    # a: 4 - 2.5 CPUs -> 1; b: 3.7 CPUs but 2 - 1 pods -> 1; gpu: none left
    assert backend.capacity == 22 and backend.free_slots() == 2
    assert backend.allocate(_spec("torch", 3)) is None  # waits (the job is not larger than the cluster)
    assert backend.allocate(_spec("torch", 2)) is not None and backend.free_slots() == 0
    server.others = []
    assert backend.refresh_capacity(force=True) == 22 and backend.free_slots() == 20
    server.fail[("GET", "/api/v1/pods")] = (403, "Forbidden")  # no RBAC for every namespace's pods
    assert backend.refresh_capacity(force=True) == 22 and backend.free_slots() == 20


def test_capacity_arithmetic_and_bad_input() -> None:
    q = kubecapacity.parse_quantity
    assert (q("3800m"), q("2"), q("1Ki"), q("1e3"), q(4)) == (Decimal("3.8"), 2, 1024, 1000, 4)
    assert [kubecapacity.scale_quantity(v, n) for v, n in (("500m", 3), ("1", 2), ("250m", 4))] == [
        "1500m", "2", "1"]
    assert kubecapacity.parse_slot("nvidia.com/gpu=1") == ("nvidia.com/gpu", "1")
    for bad in ("cpu", "cpu=0", "cpu=lots", "=1", "bad name=1"):
        with pytest.raises(ConfigError, match="slot_resource"):
            kubecapacity.parse_slot(bad)
    with pytest.raises(ConfigError, match="quantity"):
        q("12 cores")
    with pytest.raises(ConfigError, match="slot_resource"):
        _ = render(JOB, _spec("torch", 2), image="x", code_dir=str(CODE), slot=("cpu", "-1"))
    with pytest.raises(ConfigError, match="operator"):
        render(JOB, _spec("torch", 2), image="x", code_dir=str(CODE), operator="auto")


def test_gpu_slots_are_requested_and_limited() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    service, job = render(JOB, _spec("torch", 2, 2), image="x", code_dir=str(CODE),
                          slot=("nvidia.com/gpu", "1"))
    resources = job["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "2", "nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}}
    for obj in (service, job):
        kv.validate(obj, kv.latest_version(), strict=True)
    (_, half) = render(JOB, _spec("torch", 3), image="x", code_dir=str(CODE), slot=("cpu", "500m"))
    assert half["spec"]["template"]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "500m"}}


def test_a_job_larger_than_the_cluster_is_resource_exhausted(api: Api, tmp_path: Path) -> None:
    """``plait serve --backend kubernetes`` without ``--slots``: the capacity is the nodes'; a job above it
    is refused with RESOURCE_EXHAUSTED through the real gRPC server and client, nothing queued."""
    server, kubeconfig = api
    server.nodes = NODES
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    serve = [sys.executable, "-m", "plait.cli", "serve", "--backend", "kubernetes", "--image", "img",
             "--code-dir", str(tmp_path / "code"), "--kubeconfig", kubeconfig, "--context", "fake",
             "--listen", "127.0.0.1:0", "--work-dir", str(tmp_path / "work")]
    refused = subprocess.run([*serve, "--k8s-operator", "kubeflow"], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "training operator" in refused.stderr, refused.stderr
    proc = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "backend kubernetes, 22 slots" in line, line
        address = line.split("listening on ")[1].split()[0]
        jobs = [sys.executable, "-m", "plait.cli", "jobs", "--server", address]
        submit = subprocess.run([*jobs, "submit", "--name", "big", "--framework", "torch",
                                 "--instances", "23", "train.py"], capture_output=True, text=True, timeout=60)
        assert submit.returncode == 1 and "RESOURCE_EXHAUSTED" in submit.stderr, submit.stderr
        assert "capacity of 22 slots" in submit.stderr
        listed = subprocess.run([*jobs, "list"], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and "big" not in listed.stdout, listed.stdout
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# -- Kubeflow PyTorchJob / TFJob -----------------------------------------------------------------------------

def _kubeflow(framework: str, instances: int, per_worker: int = 1,
             output_pvc: str | None = None) -> list[dict[str, Any]]:
    return render(JOB, _spec(framework, instances, per_worker), image="registry.local/plait:1",
                  code_dir=str(CODE), namespace="training", operator="kubeflow", output_pvc=output_pvc)


def test_pytorchjob_manifest() -> None:
    (job,) = _kubeflow("torch", 3)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["metadata"]["name"] == NAME and job["metadata"]["labels"]["plait.dev/job"] == JOB
    assert job["spec"]["runPolicy"] == {"cleanPodPolicy": "None", "backoffLimit": 0}
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {r: (s["replicas"], s["restartPolicy"]) for r, s in replicas.items()} == {
        "Master": (1, "Never"), "Worker": (2, "Never")}
    for spec in replicas.values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # where the operator puts MASTER_ADDR, RANK...
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
        assert container["command"] == ["python", "-u", "/code/torch_group.py", "--epochs", "2"]
        names = {e["name"] for e in container["env"]}
        assert {"PLAIT_JOB_ID", "PARALLEL_INSTANCES", "PLAIT_PARAMETERS"} <= names
        assert not names & {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG"}
        assert spec["template"]["metadata"]["labels"]["plait.dev/job"] == JOB
    _validate_templates(job)
    _assert_output_volume(job, None)


def test_tfjob_manifest_and_what_stays_an_indexed_job() -> None:
    (job,) = _kubeflow("tensorflow", 2)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    assert job["spec"]["successPolicy"] == "AllWorkers"
    (worker,) = job["spec"]["tfReplicaSpecs"].values()
    assert list(job["spec"]["tfReplicaSpecs"]) == ["Worker"] and worker["replicas"] == 2
    (container,) = worker["template"]["spec"]["containers"]
    assert container["name"] == "tensorflow" and container["ports"][0]["containerPort"] == 2222
    _validate_templates(job)
    timed = render(JOB, dataclasses.replace(_spec("torch", 2), timeout_s=90.0), image="x", code_dir=str(CODE),
                   operator="kubeflow")
    assert timed[0]["spec"]["runPolicy"]["activeDeadlineSeconds"] == 90
    # several processes per pod, one process, MPI: not what the operator's CRDs express
    assert [o["kind"] for o in _kubeflow("torch", 2, 2)] == ["Service", "Job"]
    assert [o["kind"] for o in _kubeflow("tensorflow", 1)] == ["Job"]
    assert [o["kind"] for o in _kubeflow("mpi", 2)] == ["MPIJob"]
    assert [o["kind"] for o in _kubeflow("none", 2)] == ["Service", "Job"]


@pytest.mark.parametrize("framework,kind", [("torch", "PyTorchJob"), ("tensorflow", "TFJob")])
def test_kubeflow_replicas_mount_the_output_pvc(framework: str, kind: str) -> None:
    """With ``output_pvc`` every replica's pod mounts the claim under the job id (still a valid pod
    template); the rest of the object is as without it."""
    (job,) = _kubeflow(framework, 3, output_pvc="plait-output")
    assert job["kind"] == kind
    _validate_templates(job)
    _assert_output_volume(job, "plait-output")
    (plain,) = _kubeflow(framework, 3)
    _assert_output_volume(plain, None)
    for obj in (job, plain):
        for replica in obj["spec"][f"{'pytorch' if kind == 'PyTorchJob' else 'tf'}ReplicaSpecs"].values():
            pod = replica["template"]["spec"]
            pod["volumes"], pod["containers"][0]["volumeMounts"] = [], []
    assert job == plain


def test_conditions_and_replica_ranks() -> None:
    def cond(*pairs: tuple[str, str]) -> dict[str, Any]:
        return {"status": {"conditions": [{"type": t, "status": s, "message": f"{t} msg"} for t, s in pairs]}}

    assert job_state(None) == ("pending", "") and job_state({}) == ("pending", "")
    assert job_state(cond(("Created", "True"))) == ("pending", "")
    assert job_state(cond(("Created", "True"), ("Running", "True"))) == ("running", "Running msg")
    assert job_state(cond(("Running", "False"), ("Succeeded", "True"))) == ("succeeded", "Succeeded msg")
    assert job_state(cond(("Running", "False"), ("Failed", "True"))) == ("failed", "Failed msg")
    assert replica_rank("PyTorchJob", {REPLICA_TYPE: "master", REPLICA_INDEX: "0"}) == 0
    assert replica_rank("PyTorchJob", {REPLICA_TYPE: "worker", REPLICA_INDEX: "1"}) == 2
    assert replica_rank("TFJob", {REPLICA_TYPE: "worker", REPLICA_INDEX: "1"}) == 1
    assert replica_rank("TFJob", {REPLICA_TYPE: "ps", REPLICA_INDEX: "0"}) is None
    assert replica_rank("TFJob", {}) is None


def _replica(job: str, role: str, index: int, phase: str, code: int | None = None) -> dict[str, Any]:
    pod = _pod(None, phase, code, job=job, container="pytorch" if role == "master" else "tensorflow",
               labels={REPLICA_TYPE: role, REPLICA_INDEX: str(index)})
    pod["metadata"]["name"] = f"plait-{job}-{role}-{index}"
    return pod


def _set_conditions(server: FakeAPI, path: str, *types: str) -> None:
    with server.lock:
        server.objects[path]["status"] = {"conditions": [
            {"type": t, "status": "True", "reason": f"Job{t}", "message": f"job is {t.lower()}"}
            for t in types]}


def test_pytorchjob_through_the_api(api: Api, tmp_path: Path) -> None:
    server, kubeconfig = api
    server.resources = {"kubeflow.org/v1": ["pytorchjobs", "tfjobs", "xgboostjobs"]}
    backend = _backend(kubeconfig, operator="auto")
    assert backend.kinds == {"PyTorchJob", "TFJob"}
    assert server.calls() == [("GET", "/apis/kubeflow.org/v1")] * 2  # discovery, once per kind
    server.requests.clear()
    launched = backend.launch(JOB, _spec("torch", 3), [], {}, str(tmp_path), [])
    (post,) = [r for r in server.requests if r["method"] == "POST"]
    assert post["path"] == PYTORCHJOBS and post["body"] == _kubeflow("torch", 3)[0]
    path = f"{PYTORCHJOBS}/{NAME}"
    assert not launched.poll()  # no status yet
    assert ("GET", path) in server.calls("GET")
    _set_conditions(server, path, "Created", "Running")
    server.pods = [_replica(JOB, "master", 0, "Running"), _replica(JOB, "worker", 1, "Succeeded", 0)]
    assert not launched.poll() and launched.exit_codes(final=False) == {2: 0}
    server.pods[0] = _replica(JOB, "master", 0, "Succeeded", 0)
    server.logs = {p["metadata"]["name"]: f"{p['metadata']['name']} done\n" for p in server.pods}
    _set_conditions(server, path, "Created", "Succeeded")
    assert launched.poll() and launched.exit_codes() == {0: 0, 1: 0, 2: 0}
    assert (tmp_path / "rank-0.log").read_text() == f"plait-{JOB}-master-0 done\n"
    assert (tmp_path / "rank-2.log").read_text() == f"plait-{JOB}-worker-1 done\n"
    (delete,) = [r for r in server.requests if r["method"] == "DELETE"]
    assert delete["path"] == path and delete["query"]["propagationPolicy"] == ["Background"]
    assert path not in server.objects


def test_a_failed_tfjob_and_one_deleted_from_outside(api: Api, tmp_path: Path) -> None:
    server, kubeconfig = api
    server.resources = {"kubeflow.org/v1": ["tfjobs"]}
    backend = _backend(kubeconfig, operator="kubeflow")
    assert backend.kinds == {"TFJob"}
    assert [o["kind"] for o in backend.objects(JOB, _spec("torch", 2))] == ["Service", "Job"]  # not served
    launched = backend.launch(JOB, _spec("tensorflow", 2), [], {}, str(tmp_path), [])
    path = f"{TFJOBS}/{NAME}"
    assert path in server.objects
    server.pods = [_replica(JOB, "worker", 0, "Running"), _replica(JOB, "worker", 1, "Failed", 3)]
    _set_conditions(server, path, "Created", "Running")
    assert not launched.poll() and launched.failed_rank() == (1, 3)
    _set_conditions(server, path, "Created", "Failed")
    assert launched.poll() and launched.exit_codes() == {0: -1, 1: 3}
    assert launched.message == "TFJob failed: job is failed"
    assert [r["path"] for r in server.requests if r["method"] == "DELETE"] == [path]

    server.requests.clear()
    server.pods = []
    again = backend.launch(JOB, _spec("tensorflow", 2), [], {}, str(tmp_path), [])
    assert not again.poll()  # created, no status
    server.objects.clear()  # kubectl delete tfjob
    assert again.poll() and again.exit_codes() == {0: -1, 1: -1}


def test_adoption_finds_the_object_the_job_was_made_with(api: Api, tmp_path: Path) -> None:
    """A service restarted with another --k8s-operator still watches (and deletes) what the job is."""
    server, kubeconfig = api
    server.resources = {"kubeflow.org/v1": ["pytorchjobs"]}
    _backend(kubeconfig, operator="kubeflow").launch(JOB, _spec("torch", 2), [], {}, str(tmp_path), [])
    path = f"{PYTORCHJOBS}/{NAME}"
    assert path in server.objects
    restarted = _backend(kubeconfig)  # operator pods now
    adopted = restarted.adopt(JOB, _spec("torch", 2), [], str(tmp_path))
    assert adopted.operator_kind == "PyTorchJob"
    _set_conditions(server, path, "Created", "Succeeded")
    assert adopted.poll() and adopted.exit_codes() == {0: 0, 1: 0}
    assert ("DELETE", path) in server.calls("DELETE") and path not in server.objects
    # and the other way round: made as an indexed Job, adopted by a kubeflow service
    _backend(kubeconfig).launch(JOB, _spec("torch", 2), [], {}, str(tmp_path), [])
    other = _backend(kubeconfig, operator="kubeflow").adopt(JOB, _spec("torch", 2), [], str(tmp_path))
    assert other.operator_kind is None and [o["kind"] for o in other.objects] == ["Service", "Job"]
    server.fail[("GET", path)] = (500, "InternalError")  # cannot tell: as this service would make it
    assert _backend(kubeconfig, operator="kubeflow").adopt(JOB, _spec("torch", 2), [],
                                                           str(tmp_path)).operator_kind == "PyTorchJob"


def test_kubeflow_needs_the_crds_and_auto_falls_back(api: Api) -> None:
    server, kubeconfig = api
    with pytest.raises(ConfigError, match="operator='kubeflow'.*training operator"):
        _backend(kubeconfig, operator="kubeflow")
    assert _backend(kubeconfig, operator="auto").kinds == set()
    assert _backend(kubeconfig).kinds == set() and server.calls() == [("GET", "/apis/kubeflow.org/v1")] * 4
    with pytest.raises(ConfigError, match="operator"):
        _backend(kubeconfig, operator="crd")
    with pytest.raises(ConfigError, match="slot_resource"):
        _backend(kubeconfig, slot="gpu")


def test_service_runs_and_cancels_pytorchjobs(api: Api, tmp_path: Path) -> None:
    server, kubeconfig = api
    server.resources = {"kubeflow.org/v1": ["pytorchjobs"]}
    store = JobStore(str(tmp_path / "jobs.db"))
    service = Service(store, _backend(kubeconfig, slots=4, operator="auto"), str(CODE), str(tmp_path / "w"))
    service.start()
    try:
        request = {"name": "digits", "entry_point": "torch_group.py", "framework": "torch"}
        with pytest.raises(CapacityError):
            service.submit(**request, parameters={"PARALLEL_INSTANCES": "5"})
        job = service.submit(**request, parameters={"PARALLEL_INSTANCES": "2"})
        path = f"{PYTORCHJOBS}/plait-{job.id}"
        _wait(lambda: path in server.objects and service.status(job.id).state == "running")
        _set_conditions(server, path, "Created", "Succeeded")
        _wait(lambda: service.status(job.id).final)
        done = service.status(job.id)
        assert (done.state, done.exit_codes) == ("succeeded", {0: 0, 1: 0})
        assert path not in server.objects

        failing = service.submit(**request, parameters={"PARALLEL_INSTANCES": "2"})
        failing_path = f"{PYTORCHJOBS}/plait-{failing.id}"
        _wait(lambda: failing_path in server.objects and service.status(failing.id).state == "running")
        _set_conditions(server, failing_path, "Created", "Failed")
        _wait(lambda: service.status(failing.id).final)
        failed = service.status(failing.id)
        assert failed.state == "failed" and "PyTorchJob failed: job is failed" in failed.message, failed

        other = service.submit(**request, parameters={"PARALLEL_INSTANCES": "3"})
        other_path = f"{PYTORCHJOBS}/plait-{other.id}"
        _wait(lambda: other_path in server.objects and service.status(other.id).state == "running")
        _set_conditions(server, other_path, "Created", "Running")
        assert service.cancel(other.id).state == "cancelled"
        assert other_path not in server.objects
        assert ("DELETE", other_path) in server.calls("DELETE")
    finally:
        service.stop()
        store.close()


def test_manifest_printer_takes_the_operator_and_the_slot() -> None:
    out = subprocess.run([sys.executable, "-m", "plait.service.kubernetes", "--name", "n", "--framework",
                          "tensorflow", "--instances", "2", "--image", "img", "--code-dir", str(CODE),
                          "--operator", "kubeflow", "--slot-resource", "nvidia.com/gpu=1",
                          "--output-pvc", "plait-output", "torch_group.py"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (obj,) = json.loads(out.stdout)["items"]
    container = obj["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert obj["kind"] == "TFJob" and container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    _assert_output_volume(obj, "plait-output", "example-job")


# -- live logs -------------------------------------------------------------------------------------------

def test_stream_log_follows_the_pod_of_the_rank(api: Api, tmp_path: Path) -> None:
    server, kubeconfig = api
    backend = _backend(kubeconfig)
    spec = _spec("torch", 2, 2)
    server.pods = [_pod(0, "Running"), _pod(1, "Running")]
    pod1 = server.pods[1]["metadata"]["name"]
    server.follow = {pod1: ["epoch 1\n", "epoch 2\n", "done\n"]}
    chunks = list(backend.stream_log(JOB, spec, 3, True, lambda: False))  # rank 3: pod 1
    assert b"".join(chunks) == b"epoch 1\nepoch 2\ndone\n" and len(chunks) >= 2  # as written, not at once
    (request,) = [r for r in server.requests if r["path"].endswith("/log")]
    assert request["path"] == f"/api/v1/namespaces/training/pods/{pod1}/log"
    assert request["query"]["follow"] == ["true"]
    server.logs = {server.pods[0]["metadata"]["name"]: "so far\n"}
    assert b"".join(backend.stream_log(JOB, spec, 1, False, lambda: False)) == b"so far\n"  # no follow

    # no pod yet, then a container not started (400): waited for until the job ends
    server.pods, server.requests[:] = [], []
    tries = iter(range(100))
    assert list(backend.stream_log(JOB, spec, 0, True, lambda: next(tries) >= 3)) == []
    assert len([r for r in server.requests if r["path"].endswith("/pods")]) == 3
    # an MPIJob's ranks: the launcher's log
    server.pods = [_pod(None, "Running", container="launcher")]
    server.follow = {server.pods[0]["metadata"]["name"]: ["mpirun output\n"]}
    assert b"".join(backend.stream_log(JOB, _spec("mpi", 2), 1, True, lambda: False)) == b"mpirun output\n"


def test_logs_rpc_streams_from_the_pod_then_the_saved_log(api: Api, tmp_path: Path) -> None:
    """``Logs(follow)`` through the real gRPC server and client: the pod's live log while the job runs, then
    what the log saved at the end holds beyond it (the stream was cut before the last line here)."""
    grpc = pytest.importorskip("grpc")
    from plait.service import training_pb2 as pb
    from plait.service import training_pb2_grpc as pb_grpc
    from plait.service.server import make_server

    server, kubeconfig = api
    store = JobStore(str(tmp_path / "jobs.db"))
    service = Service(store, _backend(kubeconfig, slots=4), str(CODE), str(tmp_path / "w"))
    service.start()
    rpc, port = make_server(service, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.TrainingStub(channel)
        job = service.submit(name="digits", entry_point="torch_group.py", framework="torch",
                             parameters={"PARALLEL_INSTANCES": "2"})
        _wait(lambda: service.status(job.id).state == "running")
        server.pods = [_pod(i, "Running", job=job.id) for i in range(2)]  # after the launch
        name = server.pods[1]["metadata"]["name"]
        server.follow = {name: ["step 1\n", "step 2\n"]}
        server.logs = {name: "step 1\nstep 2\nstep 3\n"}
        stream = stub.Logs(pb.LogsRequest(job_id=job.id, rank=1, follow=True), timeout=30)
        first = next(stream)
        assert first.data == b"step 1\n" and first.rank == 1  # live, while the job runs
        server.pods = [_pod(i, "Succeeded", 0, job=job.id) for i in range(2)]
        rest = b"".join(c.data for c in stream)
        assert first.data + rest == b"step 1\nstep 2\nstep 3\n"
        assert service.status(job.id).state == "succeeded"
        again = b"".join(c.data for c in stub.Logs(pb.LogsRequest(job_id=job.id, rank=1), timeout=30))
        assert again == b"step 1\nstep 2\nstep 3\n"  # ended: the saved log
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Logs(pb.LogsRequest(job_id=job.id, rank=2), timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        channel.close()
        rpc.stop(0)
        service.stop()
        store.close()
