"""The ``kubernetes`` backend: the manifests of a job, and the official ``kubernetes`` client to run them.

A job of the ``torch``, ``tensorflow`` or ``none`` framework is an *indexed* Job
(one pod per worker, ``completions = parallelism = PARALLEL_INSTANCES``,
``restartPolicy: Never``, ``backoffLimit: 0`` so that one failed pod fails the
job) plus a headless Service whose name is the pods' ``subdomain``: pod ``i``
is reachable as ``JOB-i.SERVICE``, a stable DNS name, so ``MASTER_ADDR`` is
``JOB-0.SERVICE`` and ``TF_CONFIG`` lists ``JOB-i.SERVICE:PORT``. The pod's index
(``batch.kubernetes.io/job-completion-index``) reaches
:mod:`plait.service.bootstrap` as ``JOB_COMPLETION_INDEX``; with several
processes per worker it starts one process per rank in the pod. ``horovod`` and
``mpi`` jobs are a Kubeflow ``MPIJob`` (``kubeflow.org/v2beta1``; the MPI
operator must be installed): a launcher pod runs ``mpirun`` (the argv built by
:func:`plait.launch.command.mpirun_argv`) over the worker pods. Every object is
labelled ``plait.dev/job=JOB_ID``.

:func:`render` is pure (standard library only). :class:`KubernetesBackend` creates
the objects (``create_namespaced_service``, ``create_namespaced_job``,
``create_namespaced_custom_object``), reads the job's state from its pods
(``list_namespaced_pod`` with the label selector), saves the pods' logs
(``read_namespaced_pod_log``) and deletes the objects with
``propagationPolicy: Background`` on cancel and on completion. The ``kubernetes``
package is imported only when a backend is made (:class:`Cluster`), so
``import plait`` and the service core do not need it.

Command line (prints the manifests as a JSON ``List`` that ``kubectl apply -f -`` reads)::

    python -m plait.service.kubernetes --name NAME --framework torch --instances 3 \\
        --image IMAGE [--code-dir .] [--image-code-dir /code] [-p KEY=VALUE]... ENTRY_POINT [ARGS...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plait.errors import ConfigError, invalid
from plait.launch.command import LaunchSpec, mpirun_argv
from plait.service.bootstrap import log_path
from plait.service.contract import layout_env
from plait.service.spec import INSTANCES_KEY, JobSpec, make_spec

__all__ = [
    "INDEX_ANNOTATION",
    "Cluster",
    "KubeLaunched",
    "KubernetesBackend",
    "TF_PORT",
    "TORCH_PORT",
    "main",
    "pod_exit",
    "render",
    "resource_name",
]

#: Port of rank 0's torch rendezvous (MASTER_PORT).
TORCH_PORT = 29500
#: First TensorFlow worker port in a pod (one per process).
TF_PORT = 2222
#: The pod annotation holding its index in an indexed Job.
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
#: The MPIJob custom resource (Kubeflow's MPI operator).
MPI_GROUP, MPI_VERSION, MPI_PLURAL = "kubeflow.org", "v2beta1", "mpijobs"
#: Seconds a launch waits for a previous attempt's pods to be gone.
LEFTOVER_WAIT_S = 120.0
_LABEL = "plait.dev/job"
_OUTPUT = "/plait/output"


def resource_name(job_id: str) -> str:
    """The name of a job's Kubernetes objects: ``plait-`` and the id, a DNS-1035 label.

    Raises:
        ConfigError: if the id cannot make one (a pod's host name ``NAME-INDEX`` must stay <= 63).
    """
    name = "plait-" + re.sub(r"[^a-z0-9-]", "-", job_id.lower()).strip("-")
    if len(name) > 52 or not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name):
        raise invalid("job_id", job_id, "an id giving a DNS-1035 name of at most 52 characters")
    return name


def _env(values: Mapping[str, str]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in sorted(values.items())]


def _pod_argv(spec: JobSpec, code_dir: str, image_code_dir: str, python: str) -> list[str]:
    rel = os.path.relpath(spec.entry_point, os.path.realpath(code_dir))
    path = f"{image_code_dir.rstrip('/')}/{rel}"
    return [python, "-u", path, *spec.args] if path.endswith(".py") else [path, *spec.args]


def render(
    job_id: str,
    spec: JobSpec,
    *,
    image: str,
    code_dir: str,
    image_code_dir: str = "/code",
    namespace: str = "default",
    python: str = "python",
    cpu_per_process: str = "1",
) -> list[dict[str, Any]]:
    """The objects that run ``spec`` on Kubernetes.

    Args:
        job_id: the job's id (names and labels the objects).
        spec: the validated job; its entry point lies in ``code_dir`` on the service's host.
        image: the container image (plait and the job's code installed).
        code_dir: the service's code directory.
        image_code_dir: where that directory's content is in the image.
        namespace: the namespace of every object.
        python: the interpreter in the image.
        cpu_per_process: CPU request per process.

    Returns:
        ``[Service, Job]`` (``torch``, ``tensorflow``, ``none``; a one-process job is the
        ``Job`` alone) or ``[MPIJob]`` (``horovod``, ``mpi``).

    Raises:
        ConfigError: on an empty image or namespace.
    """
    for argument, value in (("image", image), ("namespace", namespace)):
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            raise invalid(argument, value, "a non-empty name without spaces")
    name = resource_name(job_id)
    labels = {_LABEL: job_id, "plait.dev/name": spec.name, "app.kubernetes.io/managed-by": "plait"}
    meta = {"name": name, "namespace": namespace, "labels": labels}
    argv = _pod_argv(spec, code_dir, image_code_dir, python)
    base = {
        "PLAIT_JOB_ID": job_id, "PLAIT_JOB_NAME": spec.name, "PLAIT_DATASET": spec.dataset,
        "PLAIT_PARAMETERS": json.dumps(spec.parameters, sort_keys=True), INSTANCES_KEY: str(spec.instances),
        "PLAIT_OUTPUT_DIR": _OUTPUT, "PYTHONUNBUFFERED": "1",
    }
    cpu = f"{spec.processes_per_worker * float(cpu_per_process):g}"
    output = {"name": "output", "mountPath": _OUTPUT}
    if spec.framework in ("horovod", "mpi") and spec.world_size > 1:
        return [_mpijob(spec, meta, labels, image, argv, base, cpu, output, python)]
    per = spec.processes_per_worker
    if spec.framework == "torch":
        endpoints = [f"{name}-0.{name}:{TORCH_PORT}"]
    elif spec.framework == "tensorflow":
        endpoints = [f"{name}-{w}.{name}:{TF_PORT + p}" for w in range(spec.instances) for p in range(per)]
    else:
        endpoints = []
    env = _env({**base, **layout_env(spec.framework, spec.instances, per, endpoints)})
    env.append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {
        "fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}})
    ports = [{"name": f"tf{p}", "containerPort": TF_PORT + p} for p in range(per)]
    ports.append({"name": "torch", "containerPort": TORCH_PORT})
    container = {
        "name": "worker", "image": image,
        "command": [python, "-m", "plait.service.bootstrap", "--", *argv],
        "env": env, "ports": ports, "resources": {"requests": {"cpu": cpu}},
        "volumeMounts": [output],
    }
    job_spec: dict[str, Any] = {
        "completions": spec.instances, "parallelism": spec.instances, "completionMode": "Indexed",
        "backoffLimit": 0,
        "template": {"metadata": {"labels": labels}, "spec": {
            "subdomain": name, "restartPolicy": "Never", "containers": [container],
            "volumes": [{"name": "output", "emptyDir": {}}],
        }},
    }
    if spec.timeout_s:
        job_spec["activeDeadlineSeconds"] = max(1, int(spec.timeout_s))
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec}
    if spec.world_size == 1:
        return [job]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {
        "clusterIP": "None", "selector": {_LABEL: job_id}, "publishNotReadyAddresses": True,
        "ports": [{"name": "torch", "port": TORCH_PORT, "targetPort": TORCH_PORT}],
    }}
    return [service, job]


def _mpijob(spec: JobSpec, meta: dict[str, Any], labels: dict[str, str], image: str, argv: list[str],
            base: Mapping[str, str], cpu: str, output: dict[str, str], python: str) -> dict[str, Any]:
    env = {**base, **layout_env(spec.framework, spec.instances, spec.processes_per_worker, [])}
    launch = LaunchSpec(command=(python, "-m", "plait.service.bootstrap", "--", *argv), np=spec.world_size,
                        backend="horovod" if spec.framework == "horovod" else "mpi",
                        env_vars=tuple(k for k in sorted(env) if not k.startswith(("PLAIT_", "HOROVOD_"))))
    mpirun = mpirun_argv(launch, {**env, "PLAIT_BACKEND": launch.backend}, is_root=True)
    pod_env = _env({**env, "PLAIT_BACKEND": launch.backend})

    def template(role: str, command: list[str] | None) -> dict[str, Any]:
        container: dict[str, Any] = {"name": role, "image": image, "env": pod_env, "volumeMounts": [output]}
        if command is not None:
            container["command"] = command
        else:
            container["resources"] = {"requests": {"cpu": cpu}}
        return {"metadata": {"labels": labels}, "spec": {
            "restartPolicy": "Never", "containers": [container],
            "volumes": [{"name": "output", "emptyDir": {}}]}}

    return {
        "apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": meta,
        "spec": {
            "slotsPerWorker": spec.processes_per_worker, "mpiImplementation": "OpenMPI",
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": 0},
            "mpiReplicaSpecs": {
                "Launcher": {"replicas": 1, "restartPolicy": "Never",
                             "template": template("launcher", mpirun)},
                "Worker": {"replicas": spec.instances, "restartPolicy": "Never",
                           "template": template("worker", None)},
            },
        },
    }


def _message(exc: BaseException) -> str:
    """The reason an API call failed: the ``Status`` message the API server sent, else the exception."""
    status = getattr(exc, "status", None)
    if isinstance(exc, ValueError) and not isinstance(status, int):
        return f"the client refused the request or the answer ({type(exc).__name__}: {exc})"
    if not isinstance(status, int) or status == 0:
        return f"cannot reach the Kubernetes API ({type(exc).__name__}: {exc})"
    text = str(getattr(exc, "body", "") or "")
    try:
        detail = json.loads(text).get("message") or text
    except (ValueError, AttributeError):
        detail = text
    hint = {403: " (the service's user or service account lacks RBAC permission for it)",
            401: " (the credentials of the kubeconfig or service account were refused)"}.get(status, "")
    return f"HTTP {status} {getattr(exc, 'reason', '') or ''}: {str(detail).strip()[:500]}{hint}"


class Cluster:
    """The API calls the backend makes, through the official ``kubernetes`` client (imported here only).

    Args:
        namespace: the namespace of every call.
        context: the kubeconfig context (default: its current context).
        kubeconfig: the kubeconfig file(s) (default: ``$KUBECONFIG``, else ``~/.kube/config``).
        request_timeout: seconds per API request.

    The configuration is the pod's service account when ``KUBERNETES_SERVICE_HOST`` is set and
    neither ``context`` nor ``kubeconfig`` is given (the service runs in the cluster), else the kubeconfig.

    Raises:
        ConfigError: if no cluster is configured, or the ``kubernetes`` package is not installed.
    """

    def __init__(self, namespace: str, context: str | None = None, kubeconfig: str | None = None,
                 request_timeout: float = 30.0) -> None:
        try:
            from kubernetes import client, config
            from kubernetes.client.exceptions import ApiException
            from urllib3.exceptions import HTTPError
        except ImportError as exc:
            raise ConfigError(f"the kubernetes backend needs the 'kubernetes' package ({exc}); "
                              "install it with: pip install 'plait[service]'") from None
        self.namespace, self.timeout = namespace, request_timeout
        self.errors: tuple[type[BaseException], ...] = (ApiException, HTTPError, OSError, ValueError)
        configuration = client.Configuration()
        try:
            if os.environ.get("KUBERNETES_SERVICE_HOST") and context is None and kubeconfig is None:
                config.load_incluster_config(client_configuration=configuration)
            else:
                config.load_kube_config(config_file=kubeconfig or os.environ.get("KUBECONFIG") or None,
                                        context=context, client_configuration=configuration,
                                        persist_config=False)
        except (config.ConfigException, OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"no Kubernetes cluster configured for the kubernetes backend ({exc}); "
                              "set one with 'kubectl config use-context NAME' (or give a kubeconfig or "
                              "context, or run the service in a pod)") from None
        self.host = str(configuration.host)
        api = client.ApiClient(configuration)
        self.core = client.CoreV1Api(api)
        self.batch = client.BatchV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def _call(self, action: str, what: str, fn: Any, *args: Any, missing_ok: bool = False,
              **kwargs: Any) -> Any:
        try:
            return fn(*args, _request_timeout=self.timeout, **kwargs)
        except self.errors as exc:
            if missing_ok and getattr(exc, "status", None) == 404:
                return None
            hint = ""
            if what.startswith("MPIJob") and getattr(exc, "status", None) == 404:
                hint = " (is the Kubeflow MPI operator, CRD mpijobs.kubeflow.org, installed?)"
            raise ConfigError(f"{action} {what} failed at {self.host}: {_message(exc)}{hint}") from None

    def create(self, obj: Mapping[str, Any]) -> None:
        """Create one object of :func:`render` (a Service, Job or MPIJob) in its namespace.

        Raises:
            ConfigError: naming the object, if the API refuses it (exists already, forbidden, invalid).
        """
        kind, name = obj["kind"], obj["metadata"]["name"]
        ns = obj["metadata"].get("namespace", self.namespace)
        what = f"{kind} {ns}/{name}"
        if kind == "Service":
            self._call("creating", what, self.core.create_namespaced_service, ns, obj)
        elif kind == "Job":
            self._call("creating", what, self.batch.create_namespaced_job, ns, obj)
        elif kind == "MPIJob":
            self._call("creating", what, self.custom.create_namespaced_custom_object,
                       MPI_GROUP, MPI_VERSION, ns, MPI_PLURAL, obj)
        else:
            raise invalid("kind", kind, "Service, Job or MPIJob")

    def delete(self, obj: Mapping[str, Any]) -> None:
        """Delete one object, its pods in the background (``propagationPolicy: Background``); gone is fine.

        Raises:
            ConfigError: naming the object, if the API refuses.
        """
        kind, name = obj["kind"], obj["metadata"]["name"]
        ns = obj["metadata"].get("namespace", self.namespace)
        what = f"{kind} {ns}/{name}"
        # the answer (a Status, or the object being deleted) is not needed: not deserialized
        options: dict[str, Any] = {"propagation_policy": "Background", "missing_ok": True,
                                   "_preload_content": False}
        if kind == "Service":
            answer = self._call("deleting", what, self.core.delete_namespaced_service, name, ns, **options)
        elif kind == "Job":
            answer = self._call("deleting", what, self.batch.delete_namespaced_job, name, ns, **options)
        elif kind == "MPIJob":
            answer = self._call("deleting", what, self.custom.delete_namespaced_custom_object, MPI_GROUP,
                                MPI_VERSION, ns, MPI_PLURAL, name, **options)
        else:
            raise invalid("kind", kind, "Service, Job or MPIJob")
        if answer is not None:
            answer.drain_conn()  # read it, so that the connection is reused
            answer.release_conn()

    def pods(self, job_id: str) -> list[Any]:
        """The pods labelled ``plait.dev/job=JOB_ID`` (``V1Pod`` objects)."""
        pods = self._call("listing", f"pods {self.namespace}/{_LABEL}={job_id}",
                          self.core.list_namespaced_pod, self.namespace, label_selector=f"{_LABEL}={job_id}")
        return list(pods.items or [])

    def log(self, pod: str) -> str:
        """A pod's log (its first container)."""
        return str(self._call("reading the log of", f"pod {self.namespace}/{pod}",
                              self.core.read_namespaced_pod_log, pod, self.namespace))


def _pod_index(pod: Any) -> int | None:
    """A pod's index in its indexed Job (its annotation, else its label)."""
    meta = pod.metadata
    for values in (meta.annotations, meta.labels):
        if values and values.get(INDEX_ANNOTATION) is not None:
            return int(values[INDEX_ANNOTATION])
    return None


def _is_launcher(pod: Any) -> bool:
    """Whether a pod is an MPIJob's launcher (the operator's role label, or our container name)."""
    labels = pod.metadata.labels or {}
    if labels.get("training.kubeflow.org/job-role") == "launcher":
        return True
    containers = pod.spec.containers if pod.spec is not None else []
    return bool(containers) and containers[0].name == "launcher"


def pod_exit(pod: Any) -> int | None:
    """A pod's exit status from its phase and containers; ``None`` while it may still run.

    ``Succeeded``: 0; ``Failed``: its first container's non-zero exit code, else -1 (no code: evicted,
    deadline); ``Pending``, ``Running``, ``Unknown``: ``None`` unless every container has terminated.
    """
    status = pod.status
    if status is None:
        return None
    statuses = list(status.container_statuses or [])
    codes = [int(s.state.terminated.exit_code) for s in statuses
             if s.state is not None and s.state.terminated is not None]
    if status.phase not in ("Succeeded", "Failed") and not (statuses and len(codes) == len(statuses)):
        return None
    bad = [c for c in codes if c != 0]
    if bad:
        return bad[0]
    return -1 if status.phase == "Failed" else 0


@dataclass
class KubeLaunched:
    """A job's objects created in the cluster; watched through its pods (``plait.dev/job=JOB_ID``).

    An indexed Job's pod ``i`` holds ranks ``i*per_worker ...``: each gets the pod's exit status. An
    MPIJob's outcome is its launcher pod's: when it exits 0 (``mpirun`` exits 0 only if every rank did)
    every rank is 0, otherwise the ranks' statuses are unknown and :meth:`launcher_code` has it.

    Attributes:
        backend: the backend (its cluster and poll interval).
        job_id: the job.
        objects: the objects created (what clean-up deletes).
        world_size: ranks.
        per_worker: processes per pod.
        job_dir: where the pods' logs are saved when the job ends (``rank-N.log``).
    """

    backend: KubernetesBackend
    job_id: str
    objects: list[dict[str, Any]]
    world_size: int
    per_worker: int
    job_dir: str
    pgids: list[int] = field(default_factory=list)
    _codes: dict[int, int] = field(default_factory=dict)
    _launcher: int | None = None
    _ended: bool = False
    _seen: bool = False
    _last: float = float("-inf")
    _failing_since: float | None = None

    @property
    def mpi(self) -> bool:
        """Whether the job is an MPIJob."""
        return any(o["kind"] == "MPIJob" for o in self.objects)

    def poll(self) -> bool:
        """Whether the job has ended (asks the API at most every ``backend.poll_s`` seconds).

        An indexed Job ends when every pod has ended, or one failed and none still runs (``backoffLimit:
        0``: one failed pod fails the Job); an MPIJob when its launcher pod has ended. Then the pods' logs
        are saved and the objects deleted. Pods seen before and now all gone (deleted from outside), or the
        API failing for ``backend.api_grace_s`` seconds in a row, end the job with unknown statuses (-1).
        """
        now = time.monotonic()
        if self._ended or now - self._last < self.backend.poll_s:
            return self._ended
        self._last = now
        try:
            pods = self.backend.cluster.pods(self.job_id)
        except ConfigError as exc:
            if self._failing_since is None:
                self._failing_since = now
            if now - self._failing_since < self.backend.api_grace_s:
                return False
            print(f"plait serve: job {self.job_id}: {exc}; given up after "
                  f"{self.backend.api_grace_s:g} s", flush=True)
            self._ended = True
            self._cleanup([])
            return True
        self._failing_since = None
        if self.mpi:
            self._poll_mpijob(pods)
        else:
            self._poll_job(pods)
        if self._seen and not pods:
            self._ended = True  # the pods were deleted from outside: the statuses not seen are unknown
        self._seen = self._seen or bool(pods)
        if self._ended:
            self._cleanup(pods)
        return self._ended

    def _poll_job(self, pods: Sequence[Any]) -> None:
        codes = self._codes  # an ended pod stays ended, even once it is gone
        running = False
        for pod in pods:
            index, code = _pod_index(pod), pod_exit(pod)
            if code is None:
                running = True
            elif index is not None:
                for local in range(self.per_worker):
                    codes[index * self.per_worker + local] = code
        self._ended = bool(pods) and not running and (
            len(codes) == self.world_size or any(c != 0 for c in codes.values()))

    def _poll_mpijob(self, pods: Sequence[Any]) -> None:
        for pod in pods:
            if _is_launcher(pod) and (code := pod_exit(pod)) is not None:
                self._launcher, self._ended = code, True
                self._codes = {r: 0 for r in range(self.world_size)} if code == 0 else {}

    def _cleanup(self, pods: Sequence[Any]) -> None:
        """Save the pods' logs, then delete the objects (on completion and on cancel)."""
        self._save_logs(pods)
        self.backend.delete_objects(self.objects)

    def _save_logs(self, pods: Sequence[Any]) -> None:
        for pod in pods:
            if self.mpi:
                if not _is_launcher(pod):
                    continue
                rank = 0  # mpirun forwards every rank's output to the launcher's log
            else:
                index = _pod_index(pod)
                if index is None:
                    continue
                rank = index * self.per_worker
            try:
                text = self.backend.cluster.log(pod.metadata.name)
            except ConfigError:
                continue  # a pod that never started has no log
            with open(log_path(self.job_dir, rank), "w") as f:
                f.write(text)

    def failed_rank(self) -> tuple[int, int] | None:
        """The first rank known to have failed."""
        return next(((r, c) for r, c in sorted(self._codes.items()) if c != 0), None)

    def exit_codes(self, final: bool = True) -> dict[int, int]:
        """Exit status per rank (a pod's status for each of its ranks; -1: unknown)."""
        codes = dict(self._codes)
        if final and not (self.mpi and self._launcher not in (None, 0)):
            for rank in range(self.world_size):
                codes.setdefault(rank, -1)
        return codes

    def launcher_code(self) -> int | None:
        """An MPIJob's launcher pod's exit status (``None`` for an indexed Job or while it runs)."""
        return self._launcher

    def kill(self) -> None:
        """Save the pods' logs and delete the job's objects (their pods go with them)."""
        try:
            pods = self.backend.cluster.pods(self.job_id)
        except ConfigError:
            pods = []
        self._cleanup(pods)


class KubernetesBackend:
    """Jobs as Kubernetes objects, through the official ``kubernetes`` client (see :class:`Cluster`).

    Args:
        slots: process slots the service may use in the cluster (its capacity).
        image: the container image.
        code_dir: the service's code directory; ``image_code_dir``: the same in the image.
        namespace: where the objects go.
        context: the kubeconfig context (default: the current one).
        kubeconfig: the kubeconfig file (default: ``$KUBECONFIG``, else ``~/.kube/config``).
        poll_s: seconds between two pod listings of a job.
        api_grace_s: seconds the API may fail in a row before a job is given up (ended, statuses -1).

    Raises:
        ConfigError: if no cluster is configured (or the ``kubernetes`` package is missing).
    """

    name = "kubernetes"

    def __init__(self, slots: int, image: str, code_dir: str, image_code_dir: str = "/code",
                 namespace: str = "default", *, context: str | None = None, kubeconfig: str | None = None,
                 poll_s: float = 2.0, api_grace_s: float = 120.0) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise invalid("slots", slots, "an integer >= 1 (the processes this service may run)")
        self.capacity, self.image, self.code_dir = slots, image, code_dir
        self.image_code_dir, self.namespace = image_code_dir, namespace
        self.poll_s, self.api_grace_s = poll_s, api_grace_s
        self._used = 0
        self._lock = threading.Lock()
        self.cluster = Cluster(namespace, context=context, kubeconfig=kubeconfig)

    def free_slots(self) -> int:
        """Slots not taken by this service's running jobs."""
        with self._lock:
            return self.capacity - self._used

    def allocate(self, spec: JobSpec) -> list[str] | None:
        """Take ``spec``'s slots; the workers are its pods' stable names."""
        with self._lock:
            if self._used + spec.world_size > self.capacity:
                return None
            self._used += spec.world_size
        return [f"pod {i}" for i in range(spec.instances)]

    def reserve(self, workers: Sequence[str], per_worker: int) -> None:
        """Take an adopted job's slots."""
        with self._lock:
            self._used += len(workers) * per_worker

    def release(self, workers: Sequence[str], per_worker: int, ports: Sequence[int] = ()) -> None:
        """Give back a finished job's slots."""
        with self._lock:
            self._used -= len(workers) * per_worker

    def endpoints(self, spec: JobSpec, workers: Sequence[str]) -> list[str]:
        """None chosen here: the manifests name stable DNS names and fixed ports."""
        return []

    def objects(self, job_id: str, spec: JobSpec) -> list[dict[str, Any]]:
        """The job's manifests (:func:`render` with this backend's settings)."""
        return render(job_id, spec, image=self.image, code_dir=self.code_dir,
                      image_code_dir=self.image_code_dir, namespace=self.namespace)

    def launch(self, job_id: str, spec: JobSpec, workers: Sequence[str], job_env: Mapping[str, str],
               job_dir: str, endpoints: Sequence[str]) -> KubeLaunched:
        """Create the job's objects, in :func:`render`'s order.

        A previous attempt's pods (a restart) are waited for until gone (up to ``LEFTOVER_WAIT_S``) so
        that its statuses are not read as this attempt's. If one object is refused, those already
        created are deleted.

        Raises:
            ConfigError: naming the object the API refused.
        """
        objects = self.objects(job_id, spec)
        deadline = time.monotonic() + LEFTOVER_WAIT_S
        while self.cluster.pods(job_id):
            if time.monotonic() > deadline:
                raise ConfigError(f"pods labelled {_LABEL}={job_id} from a previous attempt are still there "
                                  f"after {LEFTOVER_WAIT_S:g} s")
            time.sleep(min(1.0, max(self.poll_s, 0.05)))
        created: list[dict[str, Any]] = []
        try:
            for obj in objects:
                self.cluster.create(obj)
                created.append(obj)
        except ConfigError:
            self.delete_objects(created)
            raise
        return KubeLaunched(self, job_id, objects, spec.world_size, spec.processes_per_worker, job_dir)

    def adopt(self, job_id: str, spec: JobSpec, pgids: Sequence[int], job_dir: str) -> KubeLaunched:
        """Watch a job created before the service restarted."""
        return KubeLaunched(self, job_id, self.objects(job_id, spec), spec.world_size,
                            spec.processes_per_worker, job_dir)

    def delete_objects(self, objects: Sequence[Mapping[str, Any]]) -> None:
        """Delete the objects, the job last (best effort: a failure is reported, the others still go)."""
        for obj in reversed(objects):
            try:
                self.cluster.delete(obj)
            except ConfigError as exc:
                print(f"plait serve: clean-up: {exc}", flush=True)

    def delete(self, job_id: str, spec: JobSpec) -> None:
        """Delete every object of a job (clean-up on cancel and on completion)."""
        self.delete_objects(self.objects(job_id, spec))


def main(argv: Sequence[str] | None = None) -> int:
    """Print the manifests of a job (see the module doc); exit 2 on bad input."""
    p = argparse.ArgumentParser(prog="python -m plait.service.kubernetes",
                                description="Print the Kubernetes manifests of a plait service job.")
    p.add_argument("--name", required=True)
    p.add_argument("--framework", required=True)
    p.add_argument("--instances", default="1")
    p.add_argument("--processes-per-worker", type=int, default=1)
    p.add_argument("--image", required=True)
    p.add_argument("--code-dir", default=".")
    p.add_argument("--image-code-dir", default="/code")
    p.add_argument("--namespace", default="default")
    p.add_argument("--job-id", default="example-job")
    p.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("entry_point")
    p.add_argument("args", nargs=argparse.REMAINDER)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    extra = args.args[1:] if args.args[:1] == ["--"] else args.args
    try:
        params = dict(item.partition("=")[::2] for item in args.param)
        spec = make_spec(name=args.name, entry_point=args.entry_point, code_dir=args.code_dir,
                         args=extra,
                         parameters={**params, INSTANCES_KEY: args.instances}, framework=args.framework,
                         processes_per_worker=args.processes_per_worker)
        objects = render(args.job_id, spec, image=args.image, code_dir=args.code_dir,
                         image_code_dir=args.image_code_dir, namespace=args.namespace)
    except ConfigError as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
