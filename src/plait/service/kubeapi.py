"""The Kubernetes API calls of the ``kubernetes`` backend, through the official ``kubernetes`` client.

:class:`Cluster` is the only place that imports the ``kubernetes`` package (when it is made), so
``import plait`` and the service core do not need it. Every failed call is a
:class:`~plait.errors.ConfigError` naming the action, the object and the API server's reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from plait.errors import ConfigError, invalid
from plait.service.kubeflow import CRDS

__all__ = ["CUSTOM_KINDS", "Cluster", "FOLLOW_IDLE_S", "LABEL", "MPI_GROUP", "MPI_PLURAL", "MPI_VERSION"]

#: The label every object of a job carries: ``plait.dev/job=JOB_ID``.
LABEL = "plait.dev/job"
#: The MPIJob custom resource (Kubeflow's MPI operator).
MPI_GROUP, MPI_VERSION, MPI_PLURAL = "kubeflow.org", "v2beta1", "mpijobs"
#: kind -> (group, version, plural) of the custom resources the backend creates.
CUSTOM_KINDS = {"MPIJob": (MPI_GROUP, MPI_VERSION, MPI_PLURAL), **CRDS}
#: Seconds a followed log may stay silent before the stream is given up (the caller may follow again).
FOLLOW_IDLE_S = 3600.0
_OPERATOR_HINT = {"MPIJob": "the Kubeflow MPI operator, CRD mpijobs.kubeflow.org",
                  "PyTorchJob": "the Kubeflow training operator, CRD pytorchjobs.kubeflow.org",
                  "TFJob": "the Kubeflow training operator, CRD tfjobs.kubeflow.org"}


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
            kwargs.setdefault("_request_timeout", self.timeout)
            return fn(*args, **kwargs)
        except self.errors as exc:
            if missing_ok and getattr(exc, "status", None) == 404:
                return None
            hint = ""
            operator = _OPERATOR_HINT.get(what.split(" ")[0])
            if operator and getattr(exc, "status", None) == 404:
                hint = f" (is {operator}, installed?)"
            raise ConfigError(f"{action} {what} failed at {self.host}: {_message(exc)}{hint}") from None

    def create(self, obj: Mapping[str, Any]) -> None:
        """Create one object of :func:`~plait.service.kubernetes.render` in its namespace (a Service, a
        Job, or a custom object of :data:`CUSTOM_KINDS`).

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
        elif kind in CUSTOM_KINDS:
            group, version, plural = CUSTOM_KINDS[kind]
            self._call("creating", what, self.custom.create_namespaced_custom_object,
                       group, version, ns, plural, obj)
        else:
            raise invalid("kind", kind, f"Service, Job or one of {', '.join(CUSTOM_KINDS)}")

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
        elif kind in CUSTOM_KINDS:
            group, version, plural = CUSTOM_KINDS[kind]
            answer = self._call("deleting", what, self.custom.delete_namespaced_custom_object, group,
                                version, ns, plural, name, **options)
        else:
            raise invalid("kind", kind, f"Service, Job or one of {', '.join(CUSTOM_KINDS)}")
        if answer is not None:
            answer.drain_conn()  # read it, so that the connection is reused
            answer.release_conn()

    def get_custom(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """The custom object ``obj`` names as the API server has it now (``None``: it does not exist).

        Raises:
            ConfigError: naming the object, if the API refuses.
        """
        kind, name = obj["kind"], obj["metadata"]["name"]
        ns = obj["metadata"].get("namespace", self.namespace)
        if kind not in CUSTOM_KINDS:
            raise invalid("kind", kind, f"one of {', '.join(CUSTOM_KINDS)}")
        group, version, plural = CUSTOM_KINDS[kind]
        answer = self._call("reading", f"{kind} {ns}/{name}", self.custom.get_namespaced_custom_object,
                            group, version, ns, plural, name, missing_ok=True)
        return dict(answer) if isinstance(answer, Mapping) else None

    def serves(self, kind: str) -> bool:
        """Whether the API server serves the custom resource ``kind`` (its CRD is installed), from the
        discovery document ``/apis/GROUP/VERSION`` (readable without cluster-wide RBAC).

        Raises:
            ConfigError: if the API cannot be asked (a 404 is an answer: not served).
        """
        if kind not in CUSTOM_KINDS:
            raise invalid("kind", kind, f"one of {', '.join(CUSTOM_KINDS)}")
        group, version, plural = CUSTOM_KINDS[kind]
        answer = self._call("discovering", f"resources of {group}/{version}",
                            self.custom.get_api_resources, group, version, missing_ok=True)
        return answer is not None and any(r.name == plural for r in answer.resources or [])

    def nodes(self) -> list[Any]:
        """The cluster's nodes (``V1Node`` objects; listing them needs a ClusterRole with ``nodes: list``).

        Raises:
            ConfigError: if the API refuses.
        """
        return list(self._call("listing", "nodes", self.core.list_node).items or [])

    def all_pods(self) -> list[Any]:
        """Every namespace's pods (``V1Pod``; needs a ClusterRole with ``pods: list``).

        Raises:
            ConfigError: if the API refuses.
        """
        return list(self._call("listing", "pods in every namespace",
                               self.core.list_pod_for_all_namespaces).items or [])

    def pods(self, job_id: str) -> list[Any]:
        """The pods labelled ``plait.dev/job=JOB_ID`` (``V1Pod`` objects)."""
        pods = self._call("listing", f"pods {self.namespace}/{LABEL}={job_id}",
                          self.core.list_namespaced_pod, self.namespace, label_selector=f"{LABEL}={job_id}")
        return list(pods.items or [])

    def log(self, pod: str, tail: int | None = None) -> str:
        """A pod's log (its first container); with ``tail``, its last ``tail`` lines."""
        extra: dict[str, Any] = {} if tail is None else {"tail_lines": tail}
        return str(self._call("reading the log of", f"pod {self.namespace}/{pod}",
                              self.core.read_namespaced_pod_log, pod, self.namespace, **extra))

    def follow_log(self, pod: str, follow: bool = True) -> Iterator[bytes]:
        """A pod's log (its first container) in chunks: with ``follow``, as it is written, until the
        container ends (``follow=true``); without, what it holds now.

        Raises:
            ConfigError: if the API refuses (e.g. the container has not started yet), also mid-stream.
        """
        answer = self._call("following the log of", f"pod {self.namespace}/{pod}",
                            self.core.read_namespaced_pod_log, pod, self.namespace, follow=follow,
                            _preload_content=False, _request_timeout=(self.timeout, FOLLOW_IDLE_S))
        try:
            while data := answer.read1(1 << 14, decode_content=True):  # what has come, not 16 KiB
                yield data
        except self.errors as exc:
            raise ConfigError(f"following the log of pod {self.namespace}/{pod} failed at {self.host}: "
                              f"{_message(exc)}") from None
        finally:
            answer.release_conn()
