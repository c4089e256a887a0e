"""horovodrun's rendezvous store is emptied before plait starts Horovod again in a static
job, against Horovod's own rendezvous server (what ``horovodrun --gloo`` runs).

The stale keys it removes made one run in three of the 4 hosts x 2 slots collectives
job in ``tests/test_multihost.py`` abort with Gloo's ``Connect timeout`` at its first
``split``."""

from __future__ import annotations

import http.client
from collections.abc import Iterator

import pytest
from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http.http_server import RendezvousServer
from plait.collectives.horovod_rendezvous import clear, scopes, static_store

from plait.errors import PlaitError

HOSTS = "a:2,b:2"
MEMBERS = [("a", 0), ("a", 1), ("b", 0), ("b", 1)]  # (host, local rank) of ranks 0..3


@pytest.fixture
def port() -> Iterator[int]:
    server = RendezvousServer()
    port = server.start()
    server.init(get_host_assignments(parse_hosts(HOSTS), 4))
    yield port
    server.stop()


def _call(port: int, method: str, path: str, body: bytes | None = None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def _rendezvous(port: int, order: list[tuple[int, str]]) -> None:
    """What Horovod's Gloo contexts do: every rank puts its key in each of its scopes,
    then says it is done with them (DELETE), in ``order`` of (rank, scope)."""
    for rank, scope in order:
        # the rank's rank in the scope: global rank, local rank, or host (cross rank)
        key = {"global": rank, "local": MEMBERS[rank][1], "cross": rank // 2}[scope.split("_")[0]]
        assert _call(port, "PUT", f"/{scope}/{key}", b"address") == 200
    for rank, scope in order:
        assert _call(port, "DELETE", f"/{scope}/{rank}") == 200


def _kept(port: int) -> dict[str, list[int]]:
    return {s: [i for i in range(n) if _call(port, "GET", f"/{s}/{i}") == 200]
            for s, n in scopes(MEMBERS).items()}


def test_scopes_are_those_of_horovods_gloo_contexts() -> None:
    assert scopes(MEMBERS) == {"global": 4, "local_a": 2, "local_b": 2, "cross_0": 2, "cross_1": 2}


def test_the_server_keeps_stale_keys_and_clear_empties_them(port: int) -> None:
    # rank by rank, each through its three scopes (Horovod's order): local_a completes
    # before the last ranks are done with 'global', and resets its count
    order = [(r, s) for r in range(4)
             for s in ("global", f"local_{MEMBERS[r][0]}", f"cross_{MEMBERS[r][1]}")]
    _rendezvous(port, order)
    assert _kept(port)["global"] == [0, 1, 2, 3]  # what the next init would read
    clear("127.0.0.1", port, scopes(MEMBERS))
    assert _kept(port) == {s: [] for s in scopes(MEMBERS)}
    _rendezvous(port, order)  # a later rendezvous still works as before
    clear("127.0.0.1", port, scopes(MEMBERS))
    assert _kept(port) == {s: [] for s in scopes(MEMBERS)}


def test_an_empty_store_takes_no_delete(port: int) -> None:
    clear("127.0.0.1", port, scopes(MEMBERS))
    assert _kept(port) == {s: [] for s in scopes(MEMBERS)}


def test_an_unreachable_store_is_a_plait_error(port: int) -> None:
    with pytest.raises(PlaitError, match="cannot reach horovodrun's rendezvous store"):
        clear("127.0.0.1", 1, {"global": 2}, timeout=2)


def test_only_a_static_horovodrun_gloo_job_has_a_store_to_empty() -> None:
    env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "6000"}
    assert static_store(env) == ("10.0.0.1", 6000)
    assert static_store({**env, "HOROVOD_ELASTIC": "1"}) is None  # the driver empties it
    assert static_store({}) is None  # mpirun, or one process
