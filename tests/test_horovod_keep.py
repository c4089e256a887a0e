"""The tensors of horovod.torch's pending ops stay referenced from C++ by plait, so that
Horovod's release of them is never the last C++ reference (which would take the GIL).
The hang this prevents is reproduced for real in ``tests/parallel/job_hvd_peer_death.py``."""

from __future__ import annotations

import torch
from plait.collectives.horovod_keep import TorchKeeper


def test_kept_views_hold_a_cpp_reference_until_done() -> None:
    a, b, out = torch.ones(3), torch.zeros(2), torch.empty(3)
    handle_map: dict[int, object] = {}
    keeper = TorchKeeper(handle_map)
    views = keeper.before([a, [b], 7, "name"])
    assert (a._use_count(), b._use_count(), out._use_count()) == (2, 2, 1)
    handle_map[5] = ((a,), (out,))  # what horovod.torch records once the op started
    keeper.started(5, views)
    del views
    assert (a._use_count(), b._use_count(), out._use_count()) == (3, 2, 2)
    assert keeper.handles() == [5] and len(keeper) == 1
    keeper.done([5, 9])  # 9: never kept
    assert (a._use_count(), b._use_count(), out._use_count()) == (1, 1, 1)
    assert len(keeper) == 0


def test_ops_that_failed_stay_kept_until_cleared() -> None:
    t = torch.ones(4)
    keeper = TorchKeeper({})
    keeper.started(1, keeper.before([t]))
    keeper.started(2, keeper.before([t]))
    keeper.done([1])
    assert t._use_count() == 2 and keeper.handles() == [2]
    keeper.clear()
    assert t._use_count() == 1 and keeper.handles() == []
