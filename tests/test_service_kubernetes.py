"""The kubernetes backend without a cluster: the manifests it would create (checked against the Kubernetes
API schema with kubernetes-validate where installed), the pod side of the contract run for real (the
bootstrap each pod starts, with the environment the manifest gives it, on this machine), and the backend's
calls through the real ``kubernetes`` client against a fake API server on 127.0.0.1 (a thread here that
records every request and answers as the API server would).

No cluster runs here: submitting to a live cluster is not part of these tests.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from jobs import ROOT, mpi_env

from plait.errors import ConfigError
from plait.service import kubernetes as k8s
from plait.service.core import Service
from plait.service.kubernetes import INDEX_ANNOTATION, KubernetesBackend, render, resource_name
from plait.service.spec import make_spec
from plait.service.store import JobStore

CODE = ROOT / "tests" / "service_jobs"
JOB = "20261125-abcd1234"
NAME = "plait-20261125-abcd1234"


def _spec(framework: str, instances: int, per_worker: int = 1) -> Any:
    return make_spec(name="digits", entry_point="torch_group.py", code_dir=str(CODE), args=["--epochs", "2"],
                     parameters={"PARALLEL_INSTANCES": str(instances), "lr": "0.1"}, framework=framework,
                     processes_per_worker=per_worker)


def _render(framework: str, instances: int, per_worker: int = 1,
            output_pvc: str | None = None) -> list[dict[str, Any]]:
    return render(JOB, _spec(framework, instances, per_worker), image="registry.local/plait:1",
                  code_dir=str(CODE), namespace="training", output_pvc=output_pvc)


def _pod_templates(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Role -> pod template of a Job (``job``) or of each replica of an MPIJob, PyTorchJob or TFJob."""
    if obj["kind"] == "Job":
        return {"job": obj["spec"]["template"]}
    (replicas,) = [v for k, v in obj["spec"].items() if k.endswith("ReplicaSpecs")]
    return {role: replica["template"] for role, replica in replicas.items()}


def _validate_templates(obj: dict[str, Any]) -> None:
    """Each replica's pod template of a Kubeflow job (no schema in kubernetes-validate) validated as a
    ``PodTemplate`` of the Kubernetes API (strict)."""
    kv = pytest.importorskip("kubernetes_validate")
    for role, template in _pod_templates(obj).items():
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": f"{NAME}-{role.lower()}", "namespace": "training"},
                        "template": template}
        kv.validate(pod_template, kv.latest_version(), strict=True)


def _assert_output_volume(obj: dict[str, Any], claim: str | None, job_id: str = JOB) -> None:
    """Every pod of ``obj`` mounts the volume ``output`` at PLAIT_OUTPUT_DIR: the claim under the job id,
    else an emptyDir."""
    for template in _pod_templates(obj).values():
        (volume,) = template["spec"]["volumes"]
        if claim is None:
            assert volume == {"name": "output", "emptyDir": {}}
        else:
            assert volume == {"name": "output", "persistentVolumeClaim": {"claimName": claim}}
        for container in template["spec"]["containers"]:
            mount = {"name": "output", "mountPath": "/plait/output"}
            assert container["volumeMounts"] == [mount if claim is None else {**mount, "subPath": job_id}]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["PLAIT_OUTPUT_DIR"] == "/plait/output"


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


@pytest.mark.parametrize("output_pvc", [None, "plait-output.v1"])
@pytest.mark.parametrize("framework,instances,per_worker", [
    ("torch", 3, 1), ("tensorflow", 2, 2), ("none", 2, 1), ("torch", 1, 1), ("mpi", 2, 2), ("horovod", 3, 1),
])
def test_manifests_validate_against_the_kubernetes_schema(framework: str, instances: int, per_worker: int,
                                                          output_pvc: str | None) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    objects = _render(framework, instances, per_worker, output_pvc)
    for obj in objects:
        meta = obj["metadata"]
        assert meta["labels"]["plait.dev/job"] == JOB and meta["namespace"] == "training"
        if obj["kind"] == "MPIJob":  # a Kubeflow CRD: its Launcher and Worker pod templates
            _validate_templates(obj)
        else:
            kv.validate(obj, kv.latest_version(), strict=True)
        if obj["kind"] != "Service":
            _assert_output_volume(obj, output_pvc)
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
    with pytest.raises(ConfigError, match="job_id.*subPath"):  # the claim's subdirectory: one path component
        render("a/../b", _spec("torch", 2), image="x", code_dir=str(CODE), output_pvc="out")


@pytest.mark.parametrize("claim", ["Outputs", "out_put", "-out", "out.", "a..b", "a b", "", "x" * 254])
def test_a_bad_output_pvc_is_refused(claim: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Not a DNS-1123 subdomain: refused by render, by the backend before any cluster is asked, and by
    ``plait serve`` (exit 2), naming the option, the value and what is valid."""
    from plait.service.server import main as serve

    words = [f"invalid output_pvc={claim!r}", "--k8s-output-pvc", "DNS-1123 subdomain"]
    with pytest.raises(ConfigError) as info:
        _render("torch", 2, 1, claim)
    assert all(w in str(info.value) for w in words), info.value
    with pytest.raises(ConfigError, match="output_pvc"):
        KubernetesBackend(4, "x", str(CODE), kubeconfig="/nonexistent", output_pvc=claim)
    assert serve(["--backend", "kubernetes", "--image", "img", "--code-dir", str(CODE),
                  "--kubeconfig", "/nonexistent", f"--k8s-output-pvc={claim}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plait serve: error: ") and all(w in err for w in words), err


# -- the backend's API calls, through the real client, against a fake API server --------------------------

TOKEN = "test-token-123"


class FakeAPI(ThreadingHTTPServer):
    """A stand-in for the Kubernetes API server: records every request and answers with plausible JSON.

    ``pods``: the items of every PodList it returns; ``logs``: pod name -> log text; ``fail``: (method,
    path) -> (HTTP status, reason) answered with a ``Status`` instead; ``nodes``: the items of the
    NodeList; ``others``: other workloads' pods, listed with ``pods`` for every namespace;
    ``resources``: ``GROUP/VERSION`` -> the plurals its discovery document lists (others: 404);
    ``objects``: path -> custom object (kept from its POST, dropped by its DELETE; a test sets its
    ``status``); ``follow``: pod name -> log chunks sent one by one to a ``follow=true`` log request.
    """

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict[str, Any]] = []
        self.pods: list[dict[str, Any]] = []
        self.logs: dict[str, str] = {}
        self.fail: dict[tuple[str, str], tuple[int, str]] = {}
        self.nodes: list[dict[str, Any]] = []
        self.others: list[dict[str, Any]] = []
        self.resources: dict[str, list[str]] = {}
        self.objects: dict[str, dict[str, Any]] = {}
        self.follow: dict[str, list[str]] = {}
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def calls(self, method: str | None = None) -> list[tuple[str, str]]:
        """(method, path) of the requests so far, but the pod listings and the progress reads
        (the tail of rank 0's log)."""
        with self.lock:
            return [(r["method"], r["path"]) for r in self.requests
                    if (method is None or r["method"] == method) and not r["path"].endswith("/pods")
                    and "tailLines" not in r["query"]]


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class _Handler(BaseHTTPRequestHandler):
    server: FakeAPI

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        record = {"method": self.command, "path": url.path, "query": parse_qs(url.query),
                  "body": json.loads(raw) if raw else None, "auth": self.headers.get("Authorization")}
        with self.server.lock:
            self.server.requests.append(record)
            failure = self.server.fail.get((self.command, url.path))
            pods, logs = list(self.server.pods), dict(self.server.logs)
        name = url.path.rstrip("/").split("/")[-1]
        if failure is not None:
            code, reason = failure
            self._send(code, _status(code, reason, f"{reason}: refused by the fake API for {name}"))
        elif self.command == "POST":
            body = dict(record["body"])
            body["metadata"] = {**body["metadata"], "uid": f"uid-{len(self.server.requests)}",
                                "resourceVersion": "1", "creationTimestamp": "2026-01-01T00:00:00Z"}
            if url.path.startswith("/apis/kubeflow.org/"):
                with self.server.lock:
                    self.server.objects[f"{url.path}/{body['metadata']['name']}"] = body
            self._send(201, body)
        elif url.path in self.server.objects and self.command == "GET":
            with self.server.lock:
                self._send(200, self.server.objects[url.path])
        elif self.command == "DELETE" and url.path.startswith("/apis/kubeflow.org/"):
            with self.server.lock:
                self.server.objects.pop(url.path, None)
            self._send(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                             "details": {"name": name}})
        elif self.command == "DELETE" and "/services/" in url.path:  # the Service, being deleted
            self._send(200, {"kind": "Service", "apiVersion": "v1", "metadata": {
                "name": name, "deletionTimestamp": "2026-01-01T00:00:01Z"}, "spec": {"clusterIP": "None"}})
        elif self.command == "DELETE":
            self._send(200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                             "details": {"name": name}})
        elif self.command == "GET" and url.path == "/api/v1/pods":  # every namespace's
            self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"},
                             "items": pods + list(self.server.others)})
        elif self.command == "GET" and url.path.endswith("/pods"):
            key, _, value = record["query"].get("labelSelector", ["="])[0].partition("=")
            items = [p for p in pods if p["metadata"]["labels"].get(key) == value]
            self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"},
                             "items": items})
        elif self.command == "GET" and url.path == "/api/v1/nodes":
            self._send(200, {"kind": "NodeList", "apiVersion": "v1", "metadata": {},
                             "items": self.server.nodes})
        elif self.command == "GET" and url.path.startswith("/apis/") and url.path.count("/") == 3:
            group_version = url.path[len("/apis/"):]
            if group_version not in self.server.resources:
                self._send(404, _status(404, "NotFound", "the server could not find the requested resource"))
            else:
                resources = [{"name": plural, "singularName": plural[:-1], "namespaced": True, "kind": plural,
                              "verbs": ["create", "delete", "get", "list"]}
                             for plural in self.server.resources[group_version]]
                self._send(200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
                                 "resources": resources})
        elif url.path.endswith("/log") and record["query"].get("follow") == ["true"]:
            self._stream(self.server.follow.get(url.path.split("/")[-2], []))
        elif self.command == "GET" and url.path.endswith("/log"):
            pod = url.path.split("/")[-2]
            if pod in logs:
                self._send(200, logs[pod], "text/plain")
            else:
                self._send(400, _status(400, "BadRequest", f"container in pod {pod} is waiting to start"))
        else:
            self._send(404, _status(404, "NotFound", f"{url.path} not found"))

    def _stream(self, chunks: list[str]) -> None:
        """A followed log: no length, the chunks written one at a time with a pause, then the end (HTTP/1.0:
        the connection closes)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(chunk.encode())
            self.wfile.flush()
            time.sleep(0.05)
        self.close_connection = True

    do_GET = do_POST = do_DELETE = _handle  # noqa: N815


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeAPI, str]]:
    """The fake API server and a kubeconfig for it (context ``fake``; the current context is broken)."""
    yield from fake_api(tmp_path, monkeypatch)


def fake_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeAPI, str]]:
    """The body of the ``api`` fixture (other test files make their fixture of it)."""
    pytest.importorskip("kubernetes")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    server = FakeAPI()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "elsewhere",
        "clusters": [{"name": "fake", "cluster": {"server": server.url}},
                     {"name": "nowhere", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "tester", "user": {"token": TOKEN}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester"}},
                     {"name": "elsewhere", "context": {"cluster": "nowhere", "user": "tester"}}],
    }))
    yield server, str(kubeconfig)
    server.shutdown()
    server.server_close()


def _backend(kubeconfig: str, slots: int = 8, **kw: Any) -> KubernetesBackend:
    return KubernetesBackend(slots, "registry.local/plait:1", str(CODE), namespace="training",
                             context="fake", kubeconfig=kubeconfig, poll_s=0.0, **kw)


def _pod(index: int | None, phase: str, code: int | None = None, *, job: str = JOB,
         container: str = "worker", labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod as the API server lists it: ``code`` None and phase Running: a running container."""
    name = f"{resource_name(job)}-{index}-x7k2p" if index is not None else f"{resource_name(job)}-{container}"
    meta: dict[str, Any] = {"name": name, "namespace": "training",
                            "labels": {"plait.dev/job": job, **(labels or {})}}
    if index is not None:
        meta["annotations"] = {INDEX_ANNOTATION: str(index)}
        meta["labels"][INDEX_ANNOTATION] = str(index)
    state: dict[str, Any] = {"running": {}}
    if phase == "Pending":
        state = {"waiting": {"reason": "ContainerCreating"}}
    if code is not None:
        state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}}
    status: dict[str, Any] = {"phase": phase}
    if not (phase == "Failed" and code is None):  # a pod killed before it ran has no container status
        status["containerStatuses"] = [{"name": container, "image": "registry.local/plait:1", "imageID": "",
                                        "ready": phase == "Running", "restartCount": 0, "state": state}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
            "spec": {"containers": [{"name": container, "image": "registry.local/plait:1"}]},
            "status": status}


def test_launch_creates_the_service_and_the_job_as_rendered(api: tuple[FakeAPI, str], tmp_path: Path) -> None:
    server, kubeconfig = api
    backend = _backend(kubeconfig)
    spec = _spec("torch", 3)
    launched = backend.launch(JOB, spec, ["pod 0", "pod 1", "pod 2"], {}, str(tmp_path), [])
    service, job = _render("torch", 3)
    listing, *created = server.requests
    assert listing["method"] == "GET" and listing["path"] == "/api/v1/namespaces/training/pods"
    assert listing["query"]["labelSelector"] == [f"plait.dev/job={JOB}"]  # a previous attempt's pods?
    assert [(r["method"], r["path"]) for r in created] == [
        ("POST", "/api/v1/namespaces/training/services"), ("POST", "/apis/batch/v1/namespaces/training/jobs")]
    assert created[0]["body"] == service and created[1]["body"] == job
    assert {r["auth"] for r in server.requests} == {f"Bearer {TOKEN}"}  # context "fake", not the current one
    assert launched.objects == [service, job] and launched.pgids == []


def test_outputs_on_the_claim_outlive_the_clean_up(api: tuple[FakeAPI, str], tmp_path: Path) -> None:
    """With ``output_pvc`` the pods mount the claim under the job id; the clean-up at the end deletes the
    Job and the Service (their pods with them) but never the claim, so the artifact stays on it."""
    server, kubeconfig = api
    backend = _backend(kubeconfig, output_pvc="plait-output")
    launched = backend.launch(JOB, _spec("torch", 2), [], {}, str(tmp_path), [])
    posts = [r["body"] for r in server.requests if r["method"] == "POST"]
    assert posts == _render("torch", 2, 1, "plait-output")
    _assert_output_volume(posts[1], "plait-output")
    other = "20261126-00ff00ff"
    (mpijob,) = backend.objects(other, _spec("mpi", 2))
    _assert_output_volume(mpijob, "plait-output", other)  # another job: its own subPath
    server.pods = [_pod(0, "Succeeded", 0), _pod(1, "Succeeded", 0)]
    assert launched.poll() and launched.exit_codes() == {0: 0, 1: 0}
    assert [p.split("/")[-2] for m, p in server.calls("DELETE")] == ["jobs", "services"]
    assert not any("persistentvolumeclaims" in r["path"] for r in server.requests)


def test_horovod_and_mpi_jobs_are_an_mpijob(api: tuple[FakeAPI, str], tmp_path: Path) -> None:
    server, kubeconfig = api
    backend = _backend(kubeconfig)
    for framework in ("mpi", "horovod"):
        server.requests.clear()
        backend.launch(JOB, _spec(framework, 2, 2), ["pod 0", "pod 1"], {}, str(tmp_path), [])
        (mpijob,) = _render(framework, 2, 2)
        (post,) = [r for r in server.requests if r["method"] == "POST"]
        assert post["path"] == "/apis/kubeflow.org/v2beta1/namespaces/training/mpijobs"
        assert post["body"] == mpijob


def test_status_maps_pod_phases_to_per_rank_exit_codes(api: tuple[FakeAPI, str], tmp_path: Path) -> None:
    server, kubeconfig = api
    launched = _backend(kubeconfig).launch(JOB, _spec("torch", 3, 2), [], {}, str(tmp_path), [])
    assert not launched.poll()  # no pod yet
    server.pods = [_pod(0, "Pending"), _pod(1, "Running"), _pod(2, "Running")]
    assert not launched.poll() and launched.exit_codes(final=False) == {} and launched.failed_rank() is None
    server.pods = [_pod(0, "Succeeded", 0), _pod(1, "Failed", 3), _pod(2, "Running")]
    assert not launched.poll()  # pod 2 still runs (the Job controller is about to stop it)
    assert launched.failed_rank() == (2, 3)
    assert launched.exit_codes(final=False) == {0: 0, 1: 0, 2: 3, 3: 3}
    assert server.calls("DELETE") == []
    server.pods[2] = _pod(2, "Failed")  # killed by the Job controller: no container status
    server.logs = {server.pods[0]["metadata"]["name"]: "rank 0 says hi\n",
                   server.pods[1]["metadata"]["name"]: "Traceback ...\nexit 3\n"}
    assert launched.poll()
    assert launched.exit_codes() == {0: 0, 1: 0, 2: 3, 3: 3, 4: -1, 5: -1}
    assert launched.launcher_code() is None
    # clean-up on completion: the pods' logs, then the objects, with background propagation
    assert (tmp_path / "rank-0.log").read_text() == "rank 0 says hi\n"
    assert (tmp_path / "rank-2.log").read_text().endswith("exit 3\n")
    assert not (tmp_path / "rank-4.log").exists()  # pod 2 never ran: its log request got 400
    logs = [p for m, p in server.calls("GET")]
    assert logs == [f"/api/v1/namespaces/training/pods/{p['metadata']['name']}/log" for p in server.pods]
    deletes = [r for r in server.requests if r["method"] == "DELETE"]
    assert [r["path"] for r in deletes] == [f"/apis/batch/v1/namespaces/training/jobs/{NAME}",
                                            f"/api/v1/namespaces/training/services/{NAME}"]
    assert all(r["query"]["propagationPolicy"] == ["Background"] for r in deletes)
    requests = len(server.requests)
    assert launched.poll() and len(server.requests) == requests  # ended: no more calls


def test_succeeded_pods_succeed_and_the_poll_interval_limits_calls(api: tuple[FakeAPI, str],
                                                                     tmp_path: Path) -> None:
    server, kubeconfig = api
    backend = _backend(kubeconfig)
    launched = backend.launch(JOB, _spec("tensorflow", 2), [], {}, str(tmp_path), [])
    server.pods = [_pod(1, "Succeeded", 0), _pod(0, "Running")]
    backend.poll_s = 3600.0
    listings = len(server.requests)
    assert not launched.poll() and len(server.requests) == listings + 2  # the pods; rank 0's progress
    server.pods[1] = _pod(0, "Succeeded", 0)
    assert not launched.poll() and len(server.requests) == listings + 2  # within poll_s: the last answer
    backend.poll_s = 0.0
    assert launched.poll() and launched.exit_codes() == {0: 0, 1: 0}


def test_progress_reports_come_from_rank_zeros_log(api: tuple[FakeAPI, str], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod's rank 0 prints its ``plait.progress.report`` (``PLAIT_PROGRESS_FILE=-``); each poll
    appends the reports not seen yet to the job's progress file, which the service reads."""
    from plait.progress import report

    server, kubeconfig = api
    backend = _backend(kubeconfig)
    job = render(JOB, _spec("torch", 2), image="x", code_dir=str(CODE))
    env = {e["name"]: e.get("value") for o in job if o["kind"] == "Job"
           for e in o["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PLAIT_PROGRESS_FILE"] == "-"
    monkeypatch.setenv("PLAIT_PROGRESS_FILE", "-")
    lines = []
    for step in (1, 2):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert report(step=step, loss=1.0 / step)
        lines.append(out.getvalue())
    monkeypatch.setenv("RANK", "1")
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert not report(step=3) and out.getvalue() == ""  # not rank 0
    launched = backend.launch(JOB, _spec("torch", 2), [], {}, str(tmp_path), [])
    backend.poll_s = 0.0
    server.pods = [_pod(0, "Running"), _pod(1, "Running")]
    server.logs = {server.pods[0]["metadata"]["name"]: "hello\n" + lines[0]}
    assert not launched.poll()
    server.logs = {server.pods[0]["metadata"]["name"]: "hello\n" + lines[0] + "epoch done\n" + lines[1]}
    assert not launched.poll()
    got = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [(g["step"], g["loss"]) for g in got] == [(1, 1.0), (2, 0.5)]  # each once


def test_mpijob_status_is_its_launcher_pod(api: tuple[FakeAPI, str], tmp_path: Path) -> None:
    server, kubeconfig = api
    backend = _backend(kubeconfig)
    role = {"training.kubeflow.org/job-role": "launcher"}
    for code, expected in ((0, {0: 0, 1: 0, 2: 0, 3: 0}), (1, {})):
        launched = backend.launch(JOB, _spec("mpi", 2, 2), [], {}, str(tmp_path), [])
        server.pods = [_pod(None, "Running", container="worker", labels={}),
                       _pod(None, "Running", container="launcher", labels=role)]
        assert not launched.poll()
        server.pods = [_pod(None, "Failed" if code else "Succeeded", code, container="launcher", labels=role)]
        server.logs = {server.pods[0]["metadata"]["name"]: f"mpirun exited {code}\n"}
        assert launched.poll()
        assert launched.launcher_code() == code and launched.exit_codes() == expected
        assert (tmp_path / "rank-0.log").read_text() == f"mpirun exited {code}\n"
        (delete,) = [r for r in server.requests if r["method"] == "DELETE"]
        assert delete["path"] == f"/apis/kubeflow.org/v2beta1/namespaces/training/mpijobs/{NAME}"
        assert delete["query"]["propagationPolicy"] == ["Background"]
        server.requests.clear()
        server.pods = []


def _wait(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_service_runs_and_cancels_jobs_through_the_api(api: tuple[FakeAPI, str], tmp_path: Path) -> None:
    """The service core over the backend: a job that succeeds, and one cancelled while it runs."""
    server, kubeconfig = api
    store = JobStore(str(tmp_path / "jobs.db"))
    service = Service(store, _backend(kubeconfig, slots=4), str(CODE), str(tmp_path / "work"))
    service.start()
    try:
        request = {"name": "digits", "entry_point": "torch_group.py", "framework": "torch"}
        job = service.submit(**request, parameters={"PARALLEL_INSTANCES": "2"})
        _wait(lambda: service.status(job.id).state == "running")
        posts = [r for r in server.requests if r["method"] == "POST"]
        assert [r["body"]["kind"] for r in posts] == ["Service", "Job"]
        assert all(r["body"]["metadata"]["labels"]["plait.dev/job"] == job.id for r in posts)
        assert service.backend.free_slots() == 2
        server.pods = [_pod(i, "Succeeded", 0, job=job.id) for i in range(2)]
        _wait(lambda: service.status(job.id).final)
        done = service.status(job.id)
        assert (done.state, done.exit_codes) == ("succeeded", {0: 0, 1: 0})
        assert len([r for r in server.requests if r["method"] == "DELETE"]) == 2
        assert service.backend.free_slots() == 4

        server.requests.clear()
        other = service.submit(**request, parameters={"PARALLEL_INSTANCES": "3"})
        _wait(lambda: len([r for r in server.requests if r["method"] == "POST"]) == 2)
        server.pods = [_pod(i, "Running", job=other.id) for i in range(3)]
        _wait(lambda: service.status(other.id).state == "running")
        cancelled = service.cancel(other.id)
        assert cancelled.state == "cancelled"
        deletes = [r for r in server.requests if r["method"] == "DELETE"]
        assert [r["path"].split("/")[-2:] for r in deletes] == [
            ["jobs", resource_name(other.id)], ["services", resource_name(other.id)]]
        assert all(r["query"]["propagationPolicy"] == ["Background"] for r in deletes)
    finally:
        service.stop()
        store.close()


@pytest.mark.parametrize("failing,code,reason,words", [
    ("/apis/batch/v1/namespaces/training/jobs", 409, "AlreadyExists",
     ["creating Job training/" + NAME, "409"]),
    ("/api/v1/namespaces/training/services", 403, "Forbidden", ["creating Service training/" + NAME, "RBAC"]),
    ("/apis/kubeflow.org/v2beta1/namespaces/training/mpijobs", 404, "NotFound", ["MPIJob", "MPI operator"]),
])
def test_an_api_error_names_the_object(api: tuple[FakeAPI, str], tmp_path: Path, failing: str, code: int,
                                       reason: str, words: list[str]) -> None:
    server, kubeconfig = api
    server.fail[("POST", failing)] = (code, reason)
    framework = "mpi" if "mpijobs" in failing else "torch"
    with pytest.raises(ConfigError) as info:
        _backend(kubeconfig).launch(JOB, _spec(framework, 2), [], {}, str(tmp_path), [])
    message = str(info.value)
    assert all(w in message for w in words) and "refused by the fake API" in message, message
    if code == 409:  # the Service created before the Job is deleted again
        assert server.calls() == [("POST", "/api/v1/namespaces/training/services"), ("POST", failing),
                                  ("DELETE", f"/api/v1/namespaces/training/services/{NAME}")]


def test_an_unreachable_api_ends_the_job_after_the_grace(api: tuple[FakeAPI, str], tmp_path: Path) -> None:
    server, kubeconfig = api
    backend = _backend(kubeconfig, api_grace_s=3600.0)
    launched = backend.launch(JOB, _spec("torch", 2), [], {}, str(tmp_path), [])
    server.fail[("GET", "/api/v1/namespaces/training/pods")] = (500, "InternalError")
    assert not launched.poll()  # a passing failure is waited out
    backend.api_grace_s = 0.0
    assert launched.poll() and launched.exit_codes() == {0: -1, 1: -1}
    assert len(server.calls("DELETE")) == 2


def test_pods_deleted_from_outside_end_the_job(api: tuple[FakeAPI, str], tmp_path: Path) -> None:
    server, kubeconfig = api
    launched = _backend(kubeconfig).launch(JOB, _spec("torch", 2), [], {}, str(tmp_path), [])
    server.pods = [_pod(0, "Succeeded", 0), _pod(1, "Running")]
    assert not launched.poll()
    server.pods = []  # e.g. kubectl delete job: the pods are gone, no status was seen for pod 1
    assert launched.poll() and launched.exit_codes() == {0: 0, 1: -1}


def test_adopted_jobs_and_leftover_pods(api: tuple[FakeAPI, str], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    server, kubeconfig = api
    backend = _backend(kubeconfig)
    server.pods = [_pod(0, "Succeeded", 0), _pod(1, "Running")]
    monkeypatch.setattr(k8s, "LEFTOVER_WAIT_S", 0.2)
    with pytest.raises(ConfigError, match="previous attempt"):  # a relaunch waits for the old pods to go
        backend.launch(JOB, _spec("torch", 2), [], {}, str(tmp_path), [])
    assert server.calls("POST") == []
    adopted = backend.adopt(JOB, _spec("torch", 2), [], str(tmp_path))  # after a service restart
    assert not adopted.poll() and adopted.exit_codes(final=False) == {0: 0}
    server.pods[1] = _pod(1, "Succeeded", 0)
    assert adopted.poll() and adopted.exit_codes() == {0: 0, 1: 0}
    assert len(server.calls("DELETE")) == 2
    backend.delete(JOB, _spec("torch", 2))  # gone already: 404 is fine
    server.fail[("DELETE", f"/apis/batch/v1/namespaces/training/jobs/{NAME}")] = (404, "NotFound")
    backend.delete(JOB, _spec("torch", 2))


def test_no_cluster_configured_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("kubernetes")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="no Kubernetes cluster configured"):
        KubernetesBackend(4, "x", str(CODE), kubeconfig=str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text(json.dumps({"apiVersion": "v1", "kind": "Config", "clusters": [], "contexts": [],
                                 "users": []}))
    with pytest.raises(ConfigError, match="no Kubernetes cluster configured"):
        KubernetesBackend(4, "x", str(CODE), kubeconfig=str(empty))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # in a pod, but without a service account
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(ConfigError, match="no Kubernetes cluster configured"):
        KubernetesBackend(4, "x", str(CODE))


def test_import_plait_service_does_not_import_kubernetes() -> None:
    code = ("import sys, plait, plait.service.core, plait.service.kubernetes, plait.service.server; "
            "print('kubernetes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_serve_takes_the_kubeconfig_and_the_context(api: tuple[FakeAPI, str], tmp_path: Path) -> None:
    """``plait serve --kubeconfig F --context C`` reaches the cluster of that context (the file's
    current context is unreachable): a submitted job is POSTed to the fake API server, its pods mounting
    the claim of ``--k8s-output-pvc`` under the job id."""
    server, kubeconfig = api
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text("print('hi')\n")
    serve = [sys.executable, "-m", "plait.cli", "serve", "--backend", "kubernetes", "--image", "img",
             "--code-dir", str(tmp_path / "code"), "--kubeconfig", kubeconfig, "--slots", "2",
             "--listen", "127.0.0.1:0", "--work-dir", str(tmp_path / "work")]
    wrong = subprocess.run([*serve, "--context", "nope"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "nope" in wrong.stderr, wrong.stderr
    proc = subprocess.Popen([*serve, "--context", "fake", "--k8s-output-pvc", "team-outputs"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line and "backend kubernetes, 2 slots" in line, line
        address = line.split("listening on ")[1].split()[0]
        submit = subprocess.run([sys.executable, "-m", "plait.cli", "jobs", "--server", address,
                                 "submit", "--name", "k", "--framework", "torch", "--instances", "2",
                                 "train.py"], capture_output=True, text=True, timeout=60)
        assert submit.returncode == 0, submit.stderr
        _wait(lambda: any(r["method"] == "POST" and r["path"].endswith("/jobs")
                          for r in server.requests))
        (job,) = [r["body"] for r in server.requests if r["method"] == "POST" and r["path"].endswith("/jobs")]
        _assert_output_volume(job, "team-outputs", job["metadata"]["labels"]["plait.dev/job"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
