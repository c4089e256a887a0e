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
:func:`plait.launch.command.mpirun_argv`) over the worker pods. With
``operator="kubeflow"`` a ``torch`` or ``tensorflow`` job of several workers and one
process per worker is a Kubeflow ``PyTorchJob`` or ``TFJob`` instead
(:mod:`plait.service.kubeflow`; the training operator sets the group variables), its
state read from the object's ``status.conditions``. Every object is labelled
``plait.dev/job=JOB_ID``.

Every pod mounts the job's output directory (``PLAIT_OUTPUT_DIR``, ``/plait/output``: rank 0's model,
checkpoints) from the volume ``output``: an ``emptyDir``, deleted with the pods, or, with
``output_pvc=CLAIM`` (``plait serve --k8s-output-pvc CLAIM``), that existing PersistentVolumeClaim with
``subPath: JOB_ID``, so that the outputs outlive the pods and a restarted attempt finds its checkpoints.

The capacity is the configured slot count, or, without one, what the cluster's
nodes can hold (:mod:`plait.service.kubecapacity`, from ``list_node``; re-read at most
every ``capacity_refresh_s`` seconds).

:func:`render` is pure (standard library only). :class:`KubernetesBackend` creates
the objects (``create_namespaced_service``, ``create_namespaced_job``,
``create_namespaced_custom_object``), reads the job's state from its pods
(``list_namespaced_pod`` with the label selector), saves the pods' logs
(``read_namespaced_pod_log``) and deletes the objects with
``propagationPolicy: Background`` on cancel and on completion. The ``kubernetes``
package is imported only when a backend is made (:class:`~plait.service.kubeapi.Cluster`), so
``import plait`` and the service core do not need it. A created job is followed by
:class:`~plait.service.kubewatch.KubeLaunched`.

Command line (prints the manifests as a JSON ``List`` that ``kubectl apply -f -`` reads)::

    python -m plait.service.kubernetes --name NAME --framework torch --instances 3 \\
        --image IMAGE [--code-dir .] [--image-code-dir /code] [--operator pods|kubeflow] \\
        [--slot-resource cpu=1] [--output-pvc CLAIM] [-p KEY=VALUE]... ENTRY_POINT [ARGS...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from plait.errors import ConfigError, invalid
from plait.launch.command import LaunchSpec, mpirun_argv
from plait.service.contract import layout_env
from plait.service.kubeapi import LABEL as _LABEL
from plait.service.kubeapi import MPI_GROUP, MPI_PLURAL, MPI_VERSION, Cluster
from plait.service.kubecapacity import DEFAULT_SLOT, cluster_slots, parse_slot, scale_quantity
from plait.service.kubeflow import CRDS, FRAMEWORK_KIND, replica_rank, training_job
from plait.service.kubewatch import INDEX_ANNOTATION, KubeLaunched, is_launcher, pod_exit, pod_index
from plait.service.spec import INSTANCES_KEY, JobSpec, make_spec

__all__ = [
    "INDEX_ANNOTATION",
    "MPI_GROUP",
    "MPI_PLURAL",
    "MPI_VERSION",
    "OPERATORS",
    "Cluster",
    "KubeLaunched",
    "KubernetesBackend",
    "TF_PORT",
    "TORCH_PORT",
    "check_output_pvc",
    "main",
    "pod_exit",
    "render",
    "resource_name",
    "uses_operator",
]

#: Port of rank 0's torch rendezvous (MASTER_PORT).
TORCH_PORT = 29500
#: First TensorFlow worker port in a pod (one per process).
TF_PORT = 2222
#: How torch/tensorflow jobs are submitted: ``pods`` (an indexed Job and a Service), ``kubeflow`` (a
#: PyTorchJob/TFJob; the CRDs must be served), ``auto`` (kubeflow where the cluster serves the CRD).
OPERATORS = ("pods", "kubeflow", "auto")
#: Seconds a launch waits for a previous attempt's pods to be gone.
LEFTOVER_WAIT_S = 120.0
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


def check_output_pvc(claim: str | None) -> str | None:
    """Check the name of the PersistentVolumeClaim that holds the jobs' outputs.

    Args:
        claim: the claim's name, or ``None`` (no claim: an ``emptyDir``).

    Returns:
        ``claim``.

    Raises:
        ConfigError: naming ``output_pvc`` (``--k8s-output-pvc``) if it is not a DNS-1123 subdomain.
    """
    label = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
    if claim is not None and (not isinstance(claim, str) or len(claim) > 253
                              or not re.fullmatch(rf"{label}(\.{label})*", claim)):
        raise invalid("output_pvc", claim, "the name of an existing PersistentVolumeClaim in the jobs' "
                      "namespace (--k8s-output-pvc): a DNS-1123 subdomain of at most 253 lowercase "
                      "letters, digits, '-' and '.', starting and ending with a letter or digit")
    return claim


def _output_volume(job_id: str, claim: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """The pods' ``output`` volume and the containers' mount of it at :data:`_OUTPUT`.

    Args:
        job_id: the job (the claim's subdirectory).
        claim: a PersistentVolumeClaim (mounted with ``subPath: JOB_ID``), or ``None`` (an ``emptyDir``).

    Returns:
        ``(volume, volumeMount)``.

    Raises:
        ConfigError: on a bad claim name, or a job id that is not one safe path component.
    """
    mount = {"name": "output", "mountPath": _OUTPUT}
    if check_output_pvc(claim) is None:
        return {"name": "output", "emptyDir": {}}, mount
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", job_id):
        raise invalid("job_id", job_id, "letters, digits, '.', '_' and '-' (the output claim's subPath)")
    return {"name": "output", "persistentVolumeClaim": {"claimName": claim}}, {**mount, "subPath": job_id}


def _env(values: Mapping[str, str]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in sorted(values.items())]


def _pod_argv(spec: JobSpec, code_dir: str, image_code_dir: str, python: str) -> list[str]:
    rel = os.path.relpath(spec.entry_point, os.path.realpath(code_dir))
    path = f"{image_code_dir.rstrip('/')}/{rel}"
    return [python, "-u", path, *spec.args] if path.endswith(".py") else [path, *spec.args]


def _resources(per_worker: int, slot: tuple[str, str]) -> dict[str, Any]:
    """A pod's resources: 1 CPU per process requested, and the slot resource if it is another one
    (requested and limited: extended resources such as ``nvidia.com/gpu`` need a limit)."""
    resource, amount = slot
    if resource == "cpu":
        return {"requests": {"cpu": scale_quantity(amount, per_worker)}}
    total = scale_quantity(amount, per_worker)
    return {"requests": {"cpu": str(per_worker), resource: total}, "limits": {resource: total}}


def uses_operator(spec: JobSpec, operator: str) -> str | None:
    """The Kubeflow kind a job becomes under ``operator`` (``None``: an indexed Job or an MPIJob).

    Only ``torch`` and ``tensorflow`` jobs of several workers with one process each, and only with
    ``operator="kubeflow"`` (``auto`` is resolved by the backend).

    Raises:
        ConfigError: on an operator other than ``pods`` or ``kubeflow``.
    """
    if operator not in ("pods", "kubeflow"):
        raise invalid("operator", operator, "pods or kubeflow")
    if operator == "pods" or spec.processes_per_worker != 1 or spec.instances < 2:
        return None
    return FRAMEWORK_KIND.get(spec.framework)


def render(
    job_id: str,
    spec: JobSpec,
    *,
    image: str,
    code_dir: str,
    image_code_dir: str = "/code",
    namespace: str = "default",
    python: str = "python",
    slot: tuple[str, str] = DEFAULT_SLOT,
    operator: str = "pods",
    output_pvc: str | None = None,
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
        slot: ``(resource, quantity)`` each process asks for (default ``("cpu", "1")``).
        operator: ``pods`` or ``kubeflow`` (see :func:`uses_operator`).
        output_pvc: an existing PersistentVolumeClaim every pod mounts at ``PLAIT_OUTPUT_DIR`` with
            ``subPath: JOB_ID`` (``None``: an ``emptyDir``, deleted with the pods).

    Returns:
        ``[Service, Job]`` (``torch``, ``tensorflow``, ``none``; a one-process job is the
        ``Job`` alone), ``[MPIJob]`` (``horovod``, ``mpi``), or ``[PyTorchJob]`` / ``[TFJob]``.

    Raises:
        ConfigError: on an empty image or namespace, a bad slot, operator or output claim name.
    """
    for argument, value in (("image", image), ("namespace", namespace)):
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            raise invalid(argument, value, "a non-empty name without spaces")
    slot = parse_slot(f"{slot[0]}={slot[1]}")
    name = resource_name(job_id)
    labels = {_LABEL: job_id, "plait.dev/name": spec.name, "app.kubernetes.io/managed-by": "plait"}
    meta = {"name": name, "namespace": namespace, "labels": labels}
    argv = _pod_argv(spec, code_dir, image_code_dir, python)
    base = {
        "PLAIT_JOB_ID": job_id, "PLAIT_JOB_NAME": spec.name, "PLAIT_DATASET": spec.dataset,
        "PLAIT_PARAMETERS": json.dumps(spec.parameters, sort_keys=True), INSTANCES_KEY: str(spec.instances),
        "PLAIT_OUTPUT_DIR": _OUTPUT, "PYTHONUNBUFFERED": "1",
        "PLAIT_PROGRESS_FILE": "-",  # reports go to rank 0's log, which the service reads
    }
    resources = _resources(spec.processes_per_worker, slot)
    volume, output = _output_volume(job_id, output_pvc)
    if spec.framework in ("horovod", "mpi") and spec.world_size > 1:
        return [_mpijob(spec, meta, labels, image, argv, base, resources, (volume, output), python)]
    kind = uses_operator(spec, operator)
    if kind is not None:  # the operator sets the group variables; the entry point runs as is
        container = {"image": image, "command": argv, "env": _env(base), "resources": resources,
                     "volumeMounts": [output]}
        return [training_job(kind, meta, labels, container, spec.instances, spec.timeout_s, volume)]
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
        "env": env, "ports": ports, "resources": resources,
        "volumeMounts": [output],
    }
    job_spec: dict[str, Any] = {
        "completions": spec.instances, "parallelism": spec.instances, "completionMode": "Indexed",
        "backoffLimit": 0,
        "template": {"metadata": {"labels": labels}, "spec": {
            "subdomain": name, "restartPolicy": "Never", "containers": [container],
            "volumes": [volume],
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
            base: Mapping[str, str], resources: dict[str, Any],
            output: tuple[dict[str, Any], dict[str, str]], python: str) -> dict[str, Any]:
    """The ``MPIJob`` of a ``horovod`` or ``mpi`` job; ``output``: ``(volume, volumeMount)`` of every pod."""
    volume, mount = output
    env = {**base, **layout_env(spec.framework, spec.instances, spec.processes_per_worker, [])}
    launch = LaunchSpec(command=(python, "-m", "plait.service.bootstrap", "--", *argv), np=spec.world_size,
                        backend="horovod" if spec.framework == "horovod" else "mpi",
                        env_vars=tuple(k for k in sorted(env) if not k.startswith(("PLAIT_", "HOROVOD_"))))
    mpirun = mpirun_argv(launch, {**env, "PLAIT_BACKEND": launch.backend}, is_root=True)
    pod_env = _env({**env, "PLAIT_BACKEND": launch.backend})

    def template(role: str, command: list[str] | None) -> dict[str, Any]:
        container: dict[str, Any] = {"name": role, "image": image, "env": pod_env, "volumeMounts": [mount]}
        if command is not None:
            container["command"] = command
        else:
            container["resources"] = resources
        return {"metadata": {"labels": labels}, "spec": {
            "restartPolicy": "Never", "containers": [container], "volumes": [volume]}}

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



class KubernetesBackend:
    """Jobs as Kubernetes objects, through the official ``kubernetes`` client (see :class:`Cluster`).

    Args:
        slots: process slots the service may use in the cluster (its capacity); ``None``: what the
            cluster's schedulable, ready nodes can hold (:func:`~plait.service.kubecapacity.cluster_slots`
            of ``list_node``, re-read at most every ``capacity_refresh_s`` seconds).
        image: the container image.
        code_dir: the service's code directory; ``image_code_dir``: the same in the image.
        namespace: where the objects go.
        context: the kubeconfig context (default: the current one).
        kubeconfig: the kubeconfig file (default: ``$KUBECONFIG``, else ``~/.kube/config``).
        poll_s: seconds between two pod listings of a job.
        api_grace_s: seconds the API may fail in a row before a job is given up (ended, statuses -1).
        slot: ``(resource, quantity)`` or ``"RESOURCE=QUANTITY"`` one process asks for (the pods'
            requests, and the unit of the cluster's capacity): default ``("cpu", "1")``.
        operator: one of :data:`OPERATORS`: ``pods`` (default), ``kubeflow`` (PyTorchJob/TFJob; their
            CRDs must be served), ``auto`` (each where its CRD is served, found once at start).
        capacity_refresh_s: seconds between two readings of the nodes (``slots=None`` only).
        output_pvc: an existing PersistentVolumeClaim in ``namespace`` that every pod mounts at
            ``PLAIT_OUTPUT_DIR``, under the job id (``None``: an ``emptyDir``; see :func:`render`).

    Raises:
        ConfigError: if no cluster is configured (or the ``kubernetes`` package is missing), on a bad
            argument, if ``operator="kubeflow"`` and the cluster serves neither CRD, or if ``slots`` is
            ``None`` and the nodes cannot be listed or hold no process.
    """

    name = "kubernetes"

    def __init__(self, slots: int | None, image: str, code_dir: str, image_code_dir: str = "/code",
                 namespace: str = "default", *, context: str | None = None, kubeconfig: str | None = None,
                 poll_s: float = 2.0, api_grace_s: float = 120.0, slot: tuple[str, str] | str = DEFAULT_SLOT,
                 operator: str = "pods", capacity_refresh_s: float = 60.0,
                 output_pvc: str | None = None) -> None:
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
            raise invalid("slots", slots, "an integer >= 1 (the processes this service may run), or None "
                          "(read from the cluster's nodes)")
        if operator not in OPERATORS:
            raise invalid("operator", operator, f"one of {', '.join(OPERATORS)}")
        self.output_pvc = check_output_pvc(output_pvc)
        self.slot = parse_slot(slot if isinstance(slot, str) else "=".join(map(str, slot)))
        self.image, self.code_dir = image, code_dir
        self.image_code_dir, self.namespace = image_code_dir, namespace
        self.poll_s, self.api_grace_s = poll_s, api_grace_s
        self.fixed_slots, self.capacity_refresh_s = slots, capacity_refresh_s
        self._used = 0
        self._lock = threading.Lock()
        self._made: dict[str, list[dict[str, Any]]] = {}  # job id -> the objects made (or adopted)
        self.cluster = Cluster(namespace, context=context, kubeconfig=kubeconfig)
        self.kinds = self._operator_kinds(operator)
        self._read_at = time.monotonic()
        self._others = 0  # slots other workloads' pods hold now (read with the nodes)
        self._said_pods = False
        self._capacity, self._others = (slots, 0) if slots is not None else self._cluster_capacity()

    def _operator_kinds(self, operator: str) -> frozenset[str]:
        """The Kubeflow kinds jobs become (``kubeflow``: those served, at least one; ``auto``: those
        served, none if discovery fails)."""
        if operator == "pods":
            return frozenset()
        try:
            served = frozenset(kind for kind in CRDS if self.cluster.serves(kind))
        except ConfigError as exc:
            if operator == "kubeflow":
                raise
            print(f"plait serve: kubernetes: {exc}; jobs run as indexed Jobs", flush=True)
            return frozenset()
        if operator == "kubeflow" and not served:
            raise invalid("operator", operator, "pods or auto: the cluster serves neither pytorchjobs nor "
                          "tfjobs of kubeflow.org/v1 (install the Kubeflow training operator)")
        return served

    def _cluster_capacity(self) -> tuple[int, int]:
        """(slots of the schedulable, ready nodes; of those, slots other workloads' pods hold)."""
        resource, amount = self.slot
        nodes = self.cluster.nodes()
        slots = cluster_slots(nodes, resource, amount)
        if slots < 1:
            raise ConfigError(f"the cluster's schedulable, ready nodes hold no process asking for "
                              f"{resource}={amount} (give the capacity with --slots N, or another "
                              f"--slot-resource)")
        try:
            free = cluster_slots(nodes, resource, amount, self.cluster.all_pods())
        except ConfigError as exc:
            if not self._said_pods:  # e.g. no RBAC to list pods in every namespace
                print(f"plait serve: kubernetes capacity: {exc}; other workloads' pods are not "
                      "counted", flush=True)
                self._said_pods = True
            free = slots
        return slots, slots - free

    def refresh_capacity(self, force: bool = False) -> int:
        """Re-read the capacity from the nodes (``slots=None`` only; at most every ``capacity_refresh_s``
        unless ``force``). A failed reading keeps the last capacity (reported on stdout).

        Returns:
            The capacity.
        """
        now = time.monotonic()
        if self.fixed_slots is not None or (not force and now - self._read_at < self.capacity_refresh_s):
            return self._capacity
        self._read_at = now
        try:
            capacity, others = self._cluster_capacity()
        except ConfigError as exc:
            print(f"plait serve: kubernetes capacity: {exc}; keeping {self._capacity} slots", flush=True)
            return self._capacity
        with self._lock:
            self._capacity, self._others = capacity, others
        return capacity

    @property
    def capacity(self) -> int:
        """The process slots in all (what a job may need at most); re-read from the nodes when due."""
        return self.refresh_capacity()

    def free_slots(self) -> int:
        """Slots neither this service's running jobs nor other workloads' pods take."""
        with self._lock:
            return max(0, self._capacity - self._others - self._used)

    def allocate(self, spec: JobSpec) -> list[str] | None:
        """Take ``spec``'s slots (the capacity re-read first when due, also when a job is submitted);
        the workers are its pods' names."""
        self.refresh_capacity()
        with self._lock:
            if self._used + self._others + spec.world_size > self._capacity:
                return None  # queued: other workloads may end
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

    def objects(self, job_id: str, spec: JobSpec, operator: str | None = None) -> list[dict[str, Any]]:
        """The job's manifests (:func:`render` with this backend's settings; ``operator``: ``pods`` or
        ``kubeflow`` instead of this backend's choice for the job's framework)."""
        if operator is None:
            operator = "kubeflow" if FRAMEWORK_KIND.get(spec.framework) in self.kinds else "pods"
        return render(job_id, spec, image=self.image, code_dir=self.code_dir,
                      image_code_dir=self.image_code_dir, namespace=self.namespace, slot=self.slot,
                      operator=operator, output_pvc=self.output_pvc)

    def forget(self, job_id: str) -> None:
        """Drop what was kept about a job's objects (its handle calls it once they are deleted)."""
        self._made.pop(job_id, None)

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
        self._made[job_id] = objects
        return KubeLaunched(self, job_id, objects, spec.world_size, spec.processes_per_worker, job_dir)

    def adopt(self, job_id: str, spec: JobSpec, pgids: Sequence[int], job_dir: str) -> KubeLaunched:
        """Watch a job created before the service restarted.

        A job that could be a PyTorchJob/TFJob is watched as one if that object exists, whatever this
        service's ``operator`` (the previous one may have been started with another); if the API cannot
        say, as this service would have made it.
        """
        objects = self.objects(job_id, spec)
        if uses_operator(spec, "kubeflow") is not None:
            custom = self.objects(job_id, spec, "kubeflow")
            try:
                found = self.cluster.get_custom(custom[0]) is not None
                objects = custom if found else self.objects(job_id, spec, "pods")
            except ConfigError as exc:
                print(f"plait serve: adopting job {job_id}: {exc}; watched as {objects[-1]['kind']}",
                      flush=True)
        self._made[job_id] = objects
        return KubeLaunched(self, job_id, objects, spec.world_size, spec.processes_per_worker, job_dir)

    def _rank_pod(self, job_id: str, spec: JobSpec, rank: int) -> str | None:
        """The name of the pod whose log holds ``rank``'s output (``None``: none listed yet)."""
        kind = self._made.get(job_id, self.objects(job_id, spec))[0]["kind"]
        for pod in self.cluster.pods(job_id):
            if kind == "MPIJob":
                found = is_launcher(pod)
            elif kind in CRDS:
                found = replica_rank(kind, pod.metadata.labels) == rank
            else:
                found = pod_index(pod) == rank // spec.processes_per_worker
            if found:
                return str(pod.metadata.name)
        return None

    def stream_log(self, job_id: str, spec: JobSpec, rank: int, follow: bool,
                   stop: Callable[[], bool]) -> Iterator[bytes]:
        """The live log of the pod that runs ``rank`` (``read_namespaced_pod_log``, ``follow=true`` with
        ``follow``): pod ``rank // processes_per_worker`` of an indexed Job (its processes share it), the
        replica of that rank of a PyTorchJob/TFJob, the launcher of an MPIJob (``mpirun`` forwards every
        rank's output there).

        Args:
            job_id: the job.
            spec: its spec.
            rank: the rank.
            follow: stream until the container ends; else what the log holds now.
            stop: called between tries: ``True`` once the job has ended (then nothing more is tried).

        Returns:
            The log's chunks. With ``follow``, a pod not listed yet or a container not started yet is
            waited for (``poll_s``) until ``stop()``; a stream cut by the API ends the iterator (the log
            saved when the job ends has the rest).
        """
        while not stop():
            sent = False
            try:
                pod = self._rank_pod(job_id, spec, rank)
                if pod is not None:
                    for chunk in self.cluster.follow_log(pod, follow):
                        sent = True
                        yield chunk
                    return
            except ConfigError:
                if sent:
                    return
            if not follow:
                return
            time.sleep(max(self.poll_s, 0.05))

    def delete_objects(self, objects: Sequence[Mapping[str, Any]]) -> None:
        """Delete the objects, the job last (best effort: a failure is reported, the others still go)."""
        for obj in reversed(objects):
            try:
                self.cluster.delete(obj)
            except ConfigError as exc:
                print(f"plait serve: clean-up: {exc}", flush=True)

    def delete(self, job_id: str, spec: JobSpec) -> None:
        """Delete every object of a job (those it was made or adopted with, else this backend's choice)."""
        self.delete_objects(self._made.get(job_id) or self.objects(job_id, spec))


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
    p.add_argument("--operator", choices=("pods", "kubeflow"), default="pods")
    p.add_argument("--slot-resource", default="cpu=1", metavar="RESOURCE=QUANTITY")
    p.add_argument("--output-pvc", metavar="CLAIM")
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
                         image_code_dir=args.image_code_dir, namespace=args.namespace,
                         slot=parse_slot(args.slot_resource), operator=args.operator,
                         output_pvc=args.output_pvc)
    except ConfigError as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
