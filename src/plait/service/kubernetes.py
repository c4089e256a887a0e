"""The ``kubernetes`` backend: the manifests of a job, and ``kubectl`` to run them (standard library only).

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

:func:`render` is pure; :class:`KubernetesBackend` applies, watches and deletes
the objects with ``kubectl`` (only where a context is configured).

Command line (prints the manifests as a JSON ``List`` that ``kubectl apply -f -`` reads)::

    python -m plait.service.kubernetes --name NAME --framework torch --instances 3 \\
        --image IMAGE [--code-dir .] [--image-code-dir /code] [-p KEY=VALUE]... ENTRY_POINT [ARGS...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plait.errors import ConfigError, invalid
from plait.launch.command import LaunchSpec, mpirun_argv
from plait.service.contract import layout_env
from plait.service.spec import INSTANCES_KEY, JobSpec, make_spec

__all__ = [
    "INDEX_ANNOTATION",
    "KubernetesBackend",
    "TF_PORT",
    "TORCH_PORT",
    "main",
    "render",
    "resource_name",
]

#: Port of rank 0's torch rendezvous (MASTER_PORT).
TORCH_PORT = 29500
#: First TensorFlow worker port in a pod (one per process).
TF_PORT = 2222
#: The pod annotation holding its index in an indexed Job.
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
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


@dataclass
class KubeLaunched:
    """A job applied to the cluster; watched through ``kubectl get pods``.

    Attributes:
        backend: the backend (its kubectl).
        job_id: the job.
        world_size: ranks.
        per_worker: processes per pod.
        job_dir: where pod logs are saved once the job ends.
    """

    backend: KubernetesBackend
    job_id: str
    world_size: int
    per_worker: int
    job_dir: str
    pgids: list[int] = field(default_factory=list)
    _codes: dict[int, int] = field(default_factory=dict)
    _ended: bool = False

    def _pods(self) -> list[dict[str, Any]]:
        out = self.backend.kubectl("get", "pods", "-l", f"{_LABEL}={self.job_id}", "-o", "json")
        return list(json.loads(out).get("items", []))

    def poll(self) -> bool:
        """Whether every pod has ended (a failed pod ends the Job: backoffLimit 0)."""
        pods = self._pods()
        codes: dict[int, int] = {}
        running = False
        for pod in pods:
            index = pod["metadata"].get("annotations", {}).get(INDEX_ANNOTATION)
            for status in pod.get("status", {}).get("containerStatuses", []):
                done = status.get("state", {}).get("terminated")
                if done is None:
                    running = True
                elif index is not None:
                    for local in range(self.per_worker):
                        codes[int(index) * self.per_worker + local] = int(done.get("exitCode", -1))
        self._codes = codes
        self._ended = bool(pods) and not running and (
            len(codes) == self.world_size or any(c != 0 for c in codes.values()))
        if self._ended:
            self._save_logs(pods)
            self.backend.delete(self.job_id)  # clean up on completion
        return self._ended

    def _save_logs(self, pods: Sequence[dict[str, Any]]) -> None:
        for pod in pods:
            index = pod["metadata"].get("annotations", {}).get(INDEX_ANNOTATION)
            if index is None:
                continue
            try:
                text = self.backend.kubectl("logs", pod["metadata"]["name"])
            except ConfigError:
                continue
            with open(os.path.join(self.job_dir, f"rank-{int(index) * self.per_worker}.log"), "w") as f:
                f.write(text)

    def failed_rank(self) -> tuple[int, int] | None:
        """The first rank known to have failed."""
        return next(((r, c) for r, c in sorted(self._codes.items()) if c != 0), None)

    def exit_codes(self, final: bool = True) -> dict[int, int]:
        """Exit status per rank (a pod's status for each of its ranks; -1: unknown)."""
        codes = dict(self._codes)
        if final:
            for rank in range(self.world_size):
                codes.setdefault(rank, -1)
        return codes

    def launcher_code(self) -> int | None:
        """No launcher process on Kubernetes."""
        return None

    def kill(self) -> None:
        """Delete the job's objects (their pods go with them)."""
        self.backend.delete(self.job_id)


class KubernetesBackend:
    """Jobs as Kubernetes objects, through ``kubectl`` (its current context and credentials).

    Args:
        slots: process slots the service may use in the cluster (its capacity).
        image: the container image.
        code_dir: the service's code directory; ``image_code_dir``: the same in the image.
        namespace: where the objects go.
        kubectl: the kubectl command.

    Raises:
        ConfigError: if kubectl has no current context (no cluster configured).
    """

    name = "kubernetes"

    def __init__(self, slots: int, image: str, code_dir: str, image_code_dir: str = "/code",
                 namespace: str = "default", kubectl: str = "kubectl") -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise invalid("slots", slots, "an integer >= 1 (the processes this service may run)")
        self.capacity, self.image, self.code_dir = slots, image, code_dir
        self.image_code_dir, self.namespace, self._kubectl = image_code_dir, namespace, kubectl
        self._used = 0
        self._lock = threading.Lock()
        try:
            self.kubectl("config", "current-context", namespaced=False)
        except ConfigError as exc:
            raise ConfigError(f"no Kubernetes cluster configured for the kubernetes backend ({exc}); "
                              "set one with 'kubectl config use-context NAME'") from None

    def kubectl(self, *args: str, stdin: str | None = None, namespaced: bool = True) -> str:
        """Run kubectl and return its output.

        Raises:
            ConfigError: if it fails (its message included).
        """
        argv = [self._kubectl, *(["-n", self.namespace] if namespaced else []), *args]
        try:
            proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ConfigError(f"kubectl failed: {exc}") from None
        if proc.returncode != 0:
            raise ConfigError(f"{' '.join(argv[:4])}... failed: {proc.stderr.strip()}")
        return proc.stdout

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

    def launch(self, job_id: str, spec: JobSpec, workers: Sequence[str], job_env: Mapping[str, str],
               job_dir: str, endpoints: Sequence[str]) -> KubeLaunched:
        """Apply the job's manifests (``kubectl apply -f -``)."""
        objects = render(job_id, spec, image=self.image, code_dir=self.code_dir,
                         image_code_dir=self.image_code_dir, namespace=self.namespace)
        self.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                           "items": objects}))
        return KubeLaunched(self, job_id, spec.world_size, spec.processes_per_worker, job_dir)

    def adopt(self, job_id: str, spec: JobSpec, pgids: Sequence[int], job_dir: str) -> KubeLaunched:
        """Watch a job applied before the service restarted."""
        return KubeLaunched(self, job_id, spec.world_size, spec.processes_per_worker, job_dir)

    def delete(self, job_id: str) -> None:
        """Delete every object of a job (clean-up on cancel and on completion)."""
        self.kubectl("delete", "service,job.batch,mpijob.kubeflow.org", "-l", f"{_LABEL}={job_id}",
                     "--ignore-not-found", "--wait=false", "--cascade=background")


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
