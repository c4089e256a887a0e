"""Single-process tests of the framework-free parts of plait.parallel.asyncdp."""

from __future__ import annotations

import numpy as np
import pytest

from plait.parallel.asyncdp.gossip import gossip_peers, sends_first
from plait.parallel.asyncdp.metrics import AsyncMetrics
from plait.parallel.asyncdp.ps import shard_bounds


def _exchange_completes(size: int, step: int, topology: str) -> bool:
    """Simulate one gossip exchange with rendezvous (fully blocking) sends."""
    ops = {}
    for r in range(size):
        dest, source, k = gossip_peers(r, size, step, topology)
        seq = [("send", dest), ("recv", source)]
        ops[r] = seq if sends_first(r, size, k) else seq[::-1]
    pos = dict.fromkeys(range(size), 0)
    progress = True
    while progress:
        progress = False
        for a in range(size):
            if pos[a] < 2 and ops[a][pos[a]][0] == "send":
                b = ops[a][pos[a]][1]
                if pos[b] < 2 and ops[b][pos[b]] == ("recv", a):
                    pos[a] += 1
                    pos[b] += 1
                    progress = True
    return all(p == 2 for p in pos.values())


@pytest.mark.parametrize("size", range(2, 10))
@pytest.mark.parametrize("topology", ["ring", "shift"])
def test_gossip_exchange_never_deadlocks(size, topology):
    for step in range(size):
        assert _exchange_completes(size, step, topology), (size, step, topology)


@pytest.mark.parametrize("size", range(2, 8))
def test_gossip_mixing_is_doubly_stochastic(size):
    for step in range(size):
        mix = np.zeros((size, size))
        for r in range(size):
            _, source, _ = gossip_peers(r, size, step, "shift")
            mix[r, r] += 0.5
            mix[r, source] += 0.5
        np.testing.assert_allclose(mix.sum(0), 1)
        np.testing.assert_allclose(mix.sum(1), 1)


def test_shift_topology_visits_every_peer():
    peers = {gossip_peers(0, 5, t, "shift")[0] for t in range(4)}
    assert peers == {1, 2, 3, 4}


@pytest.mark.parametrize(("numel", "servers"), [(10, 1), (10, 3), (2410, 4), (3, 3)])
def test_shard_bounds_cover_everything_once(numel, servers):
    bounds = shard_bounds(numel, servers)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_metrics_summary():
    m = AsyncMetrics(rank=1, role="worker", algorithm="ssp")
    m.staleness += [0, 2, 1]
    with m.waiting():
        pass
    s = m.summary()
    assert s["max_staleness"] == 2 and s["updates"] == 3 and s["mean_staleness"] == 1.0
    assert s["wait_seconds"] >= 0


def test_importing_plait_does_not_import_asyncdp_frameworks():
    import subprocess
    import sys

    code = ("import sys, plait, plait.parallel.asyncdp; "
            "bad = [m for m in ('torch', 'tensorflow', 'mpi4py', 'horovod') if m in sys.modules]; "
            "print(bad); raise SystemExit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
