"""A peer dies while this rank keeps starting ops: the next op raises Horovod's
``HorovodInternalError`` (what ``hvd.elastic.run`` catches to reset), never a hang.

Run by ``tests/test_jobs.py`` under ``horovodrun --gloo`` (2 ranks) with
``PLAIT_BACKEND=horovod``. Rank 0 leaves (exit 0, so the launcher does not end the
job) while rank 1 starts ops as fast as it can, ops rank 0 never joins, so they are
still pending when Horovod's background thread sees the dead peer and empties its
queue. With torch 2.13 that emptying used to wait for the GIL while holding the
queue's lock, and rank 1's next op held the GIL and waited for that lock: rank 1
hung for good (Horovod's elastic kill test hung ~1 run in 3). See
``plait.collectives.horovod_keep``.
"""

from __future__ import annotations

import os
import time

import torch
from horovod.common.exceptions import HorovodInternalError

import plait.torch as hvd
from plait import runtime

SPIN_S = 60.0  # far more than Horovod needs to notice (a few ms); a hang ends the job's timeout


def test_ops_started_while_a_peer_dies_raise() -> None:
    hvd.init()
    world = runtime.world()
    assert world.backend == "horovod", "run with PLAIT_BACKEND=horovod"
    assert hvd.size() == 2
    world.barrier()
    if hvd.rank() == 0:
        time.sleep(0.3)  # rank 1 is starting ops by now
        os._exit(0)
    started = 0
    deadline = time.monotonic() + SPIN_S
    error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            world.allreduce_async(torch.ones(8), name=f"spin{started}")
        except Exception as exc:  # noqa: BLE001 (asserted below)
            error = exc
            break
        started += 1
    assert started > 0
    # caught by plait's class (a script's `except hvd.HorovodInternalError`) and by
    # Horovod's own (what Horovod's hvd.elastic.run catches to reset)
    assert isinstance(error, hvd.HorovodInternalError), repr(error)
    assert isinstance(error, HorovodInternalError), repr(error)
