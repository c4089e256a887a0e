"""How many worker processes a Kubernetes cluster can hold, from its nodes' allocatable resources.

Pure functions (standard library only) over the ``V1Node`` objects the official client's
``CoreV1Api.list_node`` returns (any object with the same attributes will do). A node counts when
it is schedulable (not ``spec.unschedulable``), ``Ready`` and has no ``NoSchedule``/``NoExecute``
taint; it holds ``min(allocatable[RESOURCE] // PER_PROCESS, allocatable pods)`` processes, where
``RESOURCE=PER_PROCESS`` is what each process asks for (default ``cpu=1``, the CPU request of the
manifests; ``nvidia.com/gpu=1`` for one GPU per process). What other workloads' pods on a node
request (``V1Pod`` objects from ``list_pod_for_all_namespaces``, not yet ended, not plait's own) is
subtracted first, resource and pod count both (:func:`requested`); plait's own pods are the service's
own slots. Other workloads started later can still make a job wait for the Kubernetes scheduler.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from decimal import Decimal, InvalidOperation
from typing import Any

from plait.errors import invalid

__all__ = ["DEFAULT_SLOT", "OWN_LABEL", "cluster_slots", "node_slots", "parse_quantity", "parse_slot",
           "requested", "scale_quantity"]

#: The label plait's own pods carry (their slots are the service's, not another workload's).
OWN_LABEL = "plait.dev/job"

#: What one process asks for unless configured otherwise.
DEFAULT_SLOT = ("cpu", "1")
_SUFFIX = {"": Decimal(1), "m": Decimal("0.001"),
           **{s: Decimal(10) ** (3 * i) for i, s in enumerate("kMGTPE", 1)},
           **{s + "i": Decimal(2) ** (10 * i) for i, s in enumerate("KMGTPE", 1)}}
_QUANTITY = re.compile(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?\Z")
_RESOURCE = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")


def parse_quantity(value: object, name: str = "quantity") -> Decimal:
    """A Kubernetes resource quantity (``"3800m"``, ``"16"``, ``"64Gi"``, ``"1e3"``) as a number.

    Args:
        value: the quantity (a string, or an int).
        name: the argument named in the error.

    Returns:
        Its value (``"3800m"`` -> ``Decimal("3.8")``).

    Raises:
        ConfigError: if it is not a quantity.
    """
    text = str(value).strip() if isinstance(value, (str, int)) and not isinstance(value, bool) else ""
    match = _QUANTITY.match(text)
    if not match:
        raise invalid(name, value, "a Kubernetes quantity such as '2', '500m', '64Gi'")
    try:
        return Decimal(match.group(1)) * _SUFFIX[match.group(2) or ""]
    except InvalidOperation:
        raise invalid(name, value, "a Kubernetes quantity such as '2', '500m', '64Gi'") from None


def parse_slot(text: str) -> tuple[str, str]:
    """``RESOURCE=PER_PROCESS`` (``cpu=1``, ``cpu=500m``, ``nvidia.com/gpu=1``) checked.

    Returns:
        ``(resource, quantity)``.

    Raises:
        ConfigError: naming ``slot_resource`` if the resource name or the quantity (> 0) is bad.
    """
    resource, sep, amount = str(text).partition("=")
    if not sep or not _RESOURCE.match(resource.strip()) or parse_quantity(amount, "slot_resource") <= 0:
        raise invalid("slot_resource", text, "RESOURCE=QUANTITY per process, e.g. cpu=1, cpu=500m, "
                      "nvidia.com/gpu=1 (a quantity > 0)")
    return resource.strip(), amount.strip()


def scale_quantity(quantity: str, times: int) -> str:
    """``quantity`` times ``times`` as a quantity (``"500m"`` x 3 -> ``"1500m"``, ``"1"`` x 2 -> ``"2"``)."""
    value = parse_quantity(quantity) * times
    if value == value.to_integral_value():
        return str(int(value))
    return f"{int((value * 1000).to_integral_value())}m"


def _ready(node: Any) -> bool:
    spec, status = node.spec, node.status
    if status is None or (spec is not None and spec.unschedulable):
        return False
    if spec is not None and any(t.effect in ("NoSchedule", "NoExecute") for t in spec.taints or []):
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


def requested(pods: Iterable[Any], resource: str) -> dict[str, tuple[Decimal, int]]:
    """What other workloads hold on each node: node name -> (``resource`` requested, pods).

    Counts pods bound to a node, not ended (phase other than Succeeded/Failed) and without
    :data:`OWN_LABEL`; a pod's request is the sum of its containers' requests (a request that
    is not a quantity counts as 0).

    Args:
        pods: ``V1Pod`` objects (any namespace).
        resource: the resource a process asks for.

    Returns:
        The requests by node name (nodes without such pods are absent).
    """
    used: dict[str, tuple[Decimal, int]] = {}
    for pod in pods:
        node = getattr(pod.spec, "node_name", None) if pod.spec is not None else None
        phase = getattr(pod.status, "phase", None) if pod.status is not None else None
        labels = (pod.metadata.labels or {}) if pod.metadata is not None else {}
        if not node or phase in ("Succeeded", "Failed") or OWN_LABEL in labels:
            continue
        amount = Decimal(0)
        for container in pod.spec.containers or []:
            wants = (container.resources.requests or {}) if container.resources is not None else {}
            try:
                amount += parse_quantity(wants.get(resource, "0"))
            except ValueError:
                continue
        have, count = used.get(node, (Decimal(0), 0))
        used[node] = (have + amount, count + 1)
    return used


def node_slots(node: Any, resource: str = DEFAULT_SLOT[0], per_process: str = DEFAULT_SLOT[1],
               used: tuple[Decimal, int] = (Decimal(0), 0)) -> int:
    """Processes one node can hold: 0 if it is not schedulable and ready, else
    ``min((allocatable[resource] - used) // per_process, allocatable pods - used pods)`` (a node
    without the resource: 0).

    Args:
        node: a ``V1Node``.
        resource: the resource a process asks for.
        per_process: how much of it (a quantity > 0).
        used: what other workloads hold there, (resource, pods) (see :func:`requested`).

    Raises:
        ConfigError: if ``per_process`` is not a quantity > 0.
    """
    each = parse_quantity(per_process, "per_process")
    if each <= 0:
        raise invalid("per_process", per_process, "a quantity > 0")
    if not _ready(node):
        return 0
    allocatable = node.status.allocatable or {}
    try:
        have = parse_quantity(allocatable.get(resource, "0"))
        pods = int(parse_quantity(allocatable.get("pods", "110")))
    except ValueError:
        return 0  # a value the node reports that is not a quantity: count nothing there
    return max(0, min(int((have - used[0]) // each), pods - used[1]))


def cluster_slots(nodes: Iterable[Any], resource: str = DEFAULT_SLOT[0],
                  per_process: str = DEFAULT_SLOT[1], pods: Iterable[Any] = ()) -> int:
    """The sum of :func:`node_slots` over ``nodes`` (what the service may admit at most), less
    what other workloads' ``pods`` request on each node."""
    used = requested(pods, resource)
    return sum(node_slots(n, resource, per_process, used.get(n.metadata.name, (Decimal(0), 0)))
               for n in nodes)
