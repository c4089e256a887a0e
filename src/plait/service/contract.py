"""The group contract per framework: the variables each rank of a service job gets.

Pure functions (standard library only). The service hands every rank a few
``PLAIT_SVC_*`` variables (its rank, the world layout and the endpoints it
chose); :func:`group_env` turns them into what the framework reads, through
:func:`plait.launch.context.torch_env` and :func:`~plait.launch.context.tf_config`:

* ``torch``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``GROUP_RANK`` (the worker), ``MASTER_ADDR`` (rank 0's stable host name) and
  ``MASTER_PORT``: one rank per process, several processes per worker;
* ``tensorflow``: ``TF_CONFIG`` for ``MultiWorkerMirroredStrategy``, one TF worker
  per process (every worker's ``host:port`` and this one's index);
* ``horovod`` / ``mpi``: nothing here: the ranks are started by ``mpirun``, which
  sets what Horovod and plait read;
* ``none``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` only.

A job of one process (``PARALLEL_INSTANCES=1``, one process per worker) is a
plain run: no group variables at all.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from plait.errors import invalid
from plait.launch.context import JobContext, tf_config, torch_env

__all__ = ["SVC_PREFIX", "group_env", "layout_env", "rank_context"]

#: Prefix of the variables the service sets for :mod:`plait.service.bootstrap`.
SVC_PREFIX = "PLAIT_SVC_"


def layout_env(framework: str, instances: int, per_worker: int, endpoints: Sequence[str]) -> dict[str, str]:
    """The ``PLAIT_SVC_*`` variables that describe a job's group (the same for every rank).

    Args:
        framework: the job's framework.
        instances: number of workers.
        per_worker: processes per worker.
        endpoints: ``host:port`` per rank (tensorflow), or one ``host:port`` for rank 0
            (torch), or empty.

    Returns:
        ``PLAIT_SVC_FRAMEWORK``, ``PLAIT_SVC_INSTANCES``, ``PLAIT_SVC_PER_WORKER`` and
        ``PLAIT_SVC_ENDPOINTS`` (JSON list).
    """
    return {
        f"{SVC_PREFIX}FRAMEWORK": framework,
        f"{SVC_PREFIX}INSTANCES": str(instances),
        f"{SVC_PREFIX}PER_WORKER": str(per_worker),
        f"{SVC_PREFIX}ENDPOINTS": json.dumps(list(endpoints)),
    }


def rank_context(rank: int, instances: int, per_worker: int) -> JobContext:
    """Where ``rank`` sits: worker ``rank // per_worker``, local rank ``rank % per_worker``.

    Raises:
        ConfigError: if ``rank`` is outside the job.
    """
    size = instances * per_worker
    if not 0 <= rank < size:
        raise invalid("rank", rank, f"an integer in [0, {size})")
    return JobContext(rank, size, rank % per_worker, per_worker, rank // per_worker, instances,
                      "plait-service")


def group_env(rank: int, env: Mapping[str, str]) -> dict[str, str]:
    """The framework's variables for ``rank``, from the service's ``PLAIT_SVC_*`` variables.

    Args:
        rank: this process's rank.
        env: an environment holding :func:`layout_env`'s variables.

    Returns:
        The variables to add (see the module doc); empty for a one-process job and
        for ``horovod`` / ``mpi``.

    Raises:
        ConfigError: if a variable is missing or malformed.
    """
    framework = env.get(f"{SVC_PREFIX}FRAMEWORK", "none")
    try:
        instances = int(env.get(f"{SVC_PREFIX}INSTANCES", "1"))
        per_worker = int(env.get(f"{SVC_PREFIX}PER_WORKER", "1"))
        endpoints = [str(e) for e in json.loads(env.get(f"{SVC_PREFIX}ENDPOINTS", "[]"))]
    except (ValueError, TypeError):
        raise invalid("PLAIT_SVC_* variables", {k: v for k, v in env.items() if k.startswith(SVC_PREFIX)},
                      "integers and a JSON list of 'host:port'") from None
    ctx = rank_context(rank, instances, per_worker)
    if ctx.size == 1 or framework in ("horovod", "mpi"):
        return {}
    if framework == "torch":
        if not endpoints:
            raise invalid("PLAIT_SVC_ENDPOINTS", endpoints, "rank 0's 'host:port'")
        host, _, port = endpoints[0].rpartition(":")
        return torch_env(ctx, host, int(port))
    if framework == "tensorflow":
        return {"TF_CONFIG": tf_config(endpoints, rank)}
    if framework == "none":
        return {"RANK": str(rank), "WORLD_SIZE": str(ctx.size), "LOCAL_RANK": str(ctx.local_rank)}
    raise invalid("PLAIT_SVC_FRAMEWORK", framework, "torch, tensorflow, horovod, mpi or none")
