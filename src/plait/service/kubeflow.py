"""Kubeflow training-operator jobs: a ``PyTorchJob`` or ``TFJob`` (``kubeflow.org/v1``) for a service job.

Pure functions (standard library only), used by :mod:`plait.service.kubernetes` when the backend is
told to use the operator (``--k8s-operator kubeflow``, or ``auto`` and the cluster serves the CRD).
The operator, not plait, then sets the group variables in each pod: ``MASTER_ADDR``, ``MASTER_PORT``,
``WORLD_SIZE`` and ``RANK`` for a ``PyTorchJob`` (one ``Master`` replica, rank 0, and
``PARALLEL_INSTANCES - 1`` ``Worker`` replicas), ``TF_CONFIG`` for a ``TFJob`` (``PARALLEL_INSTANCES``
``Worker`` replicas, ``successPolicy: AllWorkers``). So the container runs the entry point itself (no
plait bootstrap) and each replica is one process: a job with several processes per worker stays an
indexed Job. Every replica has ``restartPolicy: Never`` and the job ``runPolicy.backoffLimit: 0``
(plait's own restarts relaunch the whole job) and ``cleanPodPolicy: None`` (the service reads the pods'
logs, then deletes the job, its pods with it). Each replica's pod has the ``output`` volume the caller
gives (an ``emptyDir`` unless the service has an output PersistentVolumeClaim).

The job's state is its ``status.conditions`` (:func:`job_state`); a pod's rank is read from the
operator's labels (:func:`replica_rank`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.errors import invalid

__all__ = ["CRDS", "FRAMEWORK_KIND", "REPLICA_INDEX", "REPLICA_TYPE", "job_state", "replica_rank",
           "training_job"]

#: kind -> (group, version, plural) of the training operator's custom resources.
CRDS = {"PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs"), "TFJob": ("kubeflow.org", "v1", "tfjobs")}
#: The custom resource a framework's job becomes.
FRAMEWORK_KIND = {"torch": "PyTorchJob", "tensorflow": "TFJob"}
#: The operator's pod labels: replica type (``master``, ``worker``) and index.
REPLICA_TYPE, REPLICA_INDEX = "training.kubeflow.org/replica-type", "training.kubeflow.org/replica-index"
# the container name the operator puts its variables into, and its default port
_CONTAINER = {"PyTorchJob": ("pytorch", "pytorchjob-port", 23456),
              "TFJob": ("tensorflow", "tfjob-port", 2222)}


def training_job(kind: str, metadata: Mapping[str, Any], labels: Mapping[str, str],
                 container: Mapping[str, Any], instances: int, timeout_s: float = 0.0,
                 volume: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``PyTorchJob`` or ``TFJob`` of a job.

    Args:
        kind: ``PyTorchJob`` or ``TFJob``.
        metadata: the object's metadata (name, namespace, labels).
        labels: the pods' labels.
        container: the worker container (``image``, ``command``, ``env``, ``resources``,
            ``volumeMounts``); its name and port are set here (the operator looks for them).
        instances: replicas in all (``PARALLEL_INSTANCES``), >= 1.
        timeout_s: ``runPolicy.activeDeadlineSeconds`` (0: none).
        volume: the pods' volume named ``output`` that the container mounts (default: an ``emptyDir``).

    Returns:
        The custom object.

    Raises:
        ConfigError: on an unknown kind or fewer than one instance.
    """
    if kind not in CRDS:
        raise invalid("kind", kind, " or ".join(CRDS))
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
        raise invalid("instances", instances, "an integer >= 1")
    name, port_name, port = _CONTAINER[kind]
    body = {**container, "name": name, "ports": [{"name": port_name, "containerPort": port}]}
    output = dict(volume) if volume is not None else {"name": "output", "emptyDir": {}}

    def replicas(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "Never", "template": {
            "metadata": {"labels": dict(labels)},
            "spec": {"containers": [body], "volumes": [output]}}}

    run_policy: dict[str, Any] = {"cleanPodPolicy": "None", "backoffLimit": 0}
    if timeout_s:
        run_policy["activeDeadlineSeconds"] = max(1, int(timeout_s))
    group, version, _ = CRDS[kind]
    spec: dict[str, Any] = {"runPolicy": run_policy}
    if kind == "PyTorchJob":
        specs = {"Master": replicas(1)}
        if instances > 1:
            specs["Worker"] = replicas(instances - 1)
        spec["pytorchReplicaSpecs"] = specs
    else:
        spec["successPolicy"] = "AllWorkers"
        spec["tfReplicaSpecs"] = {"Worker": replicas(instances)}
    return {"apiVersion": f"{group}/{version}", "kind": kind, "metadata": dict(metadata), "spec": spec}


def job_state(obj: Mapping[str, Any] | None) -> tuple[str, str]:
    """The state of a training-operator job from its ``status.conditions``.

    Returns:
        ``(state, message)``: ``succeeded`` or ``failed`` (a ``Succeeded`` / ``Failed`` condition with
        status ``"True"``), ``running`` (``Running``), else ``pending`` (``Created``, no status yet);
        the message is that condition's.
    """
    status = (obj or {}).get("status") or {}
    true = {c.get("type"): str(c.get("message") or c.get("reason") or "")
            for c in status.get("conditions") or [] if isinstance(c, Mapping) and c.get("status") == "True"}
    for kind, state in (("Failed", "failed"), ("Succeeded", "succeeded"), ("Running", "running")):
        if kind in true:
            return state, true[kind]
    return "pending", ""


def replica_rank(kind: str, labels: Mapping[str, str] | None) -> int | None:
    """The rank of a pod of a training-operator job from the operator's labels (``None``: not a replica).

    A ``PyTorchJob``'s master is rank 0 and worker ``i`` rank ``i + 1``; a ``TFJob``'s worker ``i`` is
    rank ``i``.
    """
    labels = labels or {}
    role, index = str(labels.get(REPLICA_TYPE, "")).lower(), labels.get(REPLICA_INDEX)
    if index is None or not str(index).isdigit():
        return None
    if kind == "PyTorchJob":
        return {"master": 0, "worker": int(index) + 1}.get(role)
    return int(index) if role == "worker" else None
