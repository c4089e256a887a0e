"""Elastic training by restart: what changes when a job comes back with another world size.

``plait run --restarts`` may relaunch a job on fewer hosts. The script then
re-shards its data by the new rank/size and either keeps the global batch
(each rank takes a larger share) or keeps the per-rank batch and scales the
learning rate linearly, as chosen by ``PLAIT_ELASTIC_POLICY``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from plait.errors import invalid

__all__ = ["POLICIES", "ElasticPlan", "plan", "policy_from_env", "restart_count"]

#: Values of ``PLAIT_ELASTIC_POLICY``.
POLICIES = ("keep_batch", "scale_lr")


def policy_from_env(env: Mapping[str, str] | None = None) -> str:
    """The elastic policy: ``PLAIT_ELASTIC_POLICY`` or ``"keep_batch"``.

    Raises:
        ConfigError: for a value not in :data:`POLICIES`.
    """
    value = (os.environ if env is None else env).get("PLAIT_ELASTIC_POLICY", "keep_batch")
    if value not in POLICIES:
        raise invalid("PLAIT_ELASTIC_POLICY", value, f"one of {', '.join(POLICIES)}")
    return value


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times ``plait run --restarts`` relaunched this job so far (``PLAIT_RESTART``)."""
    return int((os.environ if env is None else env).get("PLAIT_RESTART", "0"))


@dataclass(frozen=True)
class ElasticPlan:
    """Per-rank batch and learning rate for the current world size.

    Attributes:
        policy: ``"keep_batch"`` or ``"scale_lr"``.
        global_batch: samples per step over all ranks.
        local_batch: samples per step on this rank (``global_batch // size`` for keep_batch).
        lr: the learning rate to use now.
    """

    policy: str
    global_batch: int
    local_batch: int
    lr: float


def plan(global_batch: int, lr: float, size: int, base_size: int, policy: str | None = None) -> ElasticPlan:
    """Batch and learning rate after a restart on ``size`` ranks of a job planned for ``base_size``.

    Args:
        global_batch: the global batch the job was configured with (at ``base_size`` ranks).
        lr: the learning rate configured for that global batch.
        size: ranks now.
        base_size: ranks the job was configured for.
        policy: ``"keep_batch"`` (global batch kept, each rank takes ``global_batch // size``;
            the global batch must divide evenly) or ``"scale_lr"`` (per-rank batch kept,
            learning rate scaled by ``size / base_size``); default from the environment.

    Returns:
        The plan.

    Raises:
        ConfigError: when sizes are not positive or the global batch does not divide.
    """
    policy = policy_from_env() if policy is None else policy
    if policy not in POLICIES:
        raise invalid("policy", policy, f"one of {', '.join(POLICIES)}")
    for name, value in (("size", size), ("base_size", base_size), ("global_batch", global_batch)):
        if value < 1:
            raise invalid(name, value, "an integer >= 1")
    if global_batch % base_size:
        raise invalid("global_batch", global_batch, f"a multiple of base_size={base_size}")
    if policy == "keep_batch":
        if global_batch % size:
            raise invalid("global_batch", global_batch,
                          f"a multiple of the new world size {size} (policy keep_batch)")
        return ElasticPlan(policy, global_batch, global_batch // size, lr)
    local = global_batch // base_size
    return ElasticPlan(policy, local * size, local, lr * size / base_size)
