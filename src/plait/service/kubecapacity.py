"""How many worker processes a Kubernetes cluster can hold, from its nodes' allocatable resources.

Pure functions (standard library only) over the ``V1Node`` objects the official client's
``CoreV1Api.list_node`` returns (any object with the same attributes will do). A node counts when
it is schedulable (not ``spec.unschedulable``), ``Ready`` and has no ``NoSchedule``/``NoExecute``
taint; it holds ``min(allocatable[RESOURCE] // PER_PROCESS, allocatable pods)`` processes, where
``RESOURCE=PER_PROCESS`` is what each process asks for (default ``cpu=1``, the CPU request of the
manifests; ``nvidia.com/gpu=1`` for one GPU per process). This is the node's whole allocatable
capacity: what other workloads already requested is not subtracted, so a job admitted here may still
wait for the Kubernetes scheduler.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from decimal import Decimal, InvalidOperation
from typing import Any

from plait.errors import invalid

__all__ = ["DEFAULT_SLOT", "cluster_slots", "node_slots", "parse_quantity", "parse_slot", "scale_quantity"]

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


def node_slots(node: Any, resource: str = DEFAULT_SLOT[0], per_process: str = DEFAULT_SLOT[1]) -> int:
    """Processes one node can hold: 0 if it is not schedulable and ready, else
    ``min(allocatable[resource] // per_process, allocatable pods)`` (a node without the resource: 0).

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
    return max(0, min(int(have // each), pods))


def cluster_slots(nodes: Iterable[Any], resource: str = DEFAULT_SLOT[0],
                  per_process: str = DEFAULT_SLOT[1]) -> int:
    """The sum of :func:`node_slots` over ``nodes`` (what the service may admit at most)."""
    return sum(node_slots(n, resource, per_process) for n in nodes)
