"""Emptying horovodrun's Gloo rendezvous store before Horovod starts again in a static job.

Under ``horovodrun --gloo`` every rank's Horovod meets its peers through the launcher's
HTTP key-value store: each Gloo context (``global``, ``local_<host>``,
``cross_<local rank>``) has a *scope* in which rank ``i`` puts its address under key
``i``, then reads its peers' keys. The server empties a scope once all of its ranks
said they are done (an HTTP DELETE each), but it then forgets every scope's count, not
only that one's, so in a job of several hosts some scopes keep their keys for ever.
An elastic driver empties the store at every new round; a static job never does.

plait starts Horovod again once in a static job (``split`` needs dynamic process
sets, see :mod:`plait.collectives.horovod`). With the old keys still there, a rank
that starts before its peers reads their *old* addresses, tries their closed ports
until Gloo's timeout and aborts (seen on 4 hosts x 2 slots, ~1 run in 3: ``Connect
timeout`` in ``connectFullMesh`` of the ``global`` scope). :func:`clear` empties the
scopes first, the server's own way: more DELETEs, until their counts come round.
"""

from __future__ import annotations

import http.client
from collections.abc import Mapping, Sequence

from plait.errors import PlaitError

__all__ = ["clear", "scopes", "static_store"]


def static_store(env: Mapping[str, str]) -> tuple[str, int] | None:
    """Address and port of the rendezvous store of a static ``horovodrun --gloo`` job.

    Args:
        env: the process environment.

    Returns:
        ``(address, port)``, or None without one (an MPI launcher, a single
        process) and in an elastic job (whose driver empties the store itself).
    """
    addr, port = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port or env.get("HOROVOD_ELASTIC") == "1":
        return None
    return addr, int(port)


def scopes(members: Sequence[tuple[str, int]]) -> dict[str, int]:
    """The store's scopes of Horovod's Gloo contexts, with their number of ranks.

    Args:
        members: each rank's ``(HOROVOD_HOSTNAME, HOROVOD_LOCAL_RANK)``, by rank.

    Returns:
        ``{scope: size}``: ``global``, ``local_<host>`` and ``cross_<local rank>``.
    """
    out = {"global": len(members)}
    for host, local_rank in members:
        for scope in (f"local_{host}", f"cross_{local_rank}"):
            out[scope] = out.get(scope, 0) + 1
    return out


def _request(addr: str, port: int, method: str, path: str, timeout: float) -> int:
    conn = http.client.HTTPConnection(addr, port, timeout=timeout)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def _has_keys(addr: str, port: int, scope: str, size: int, timeout: float) -> bool:
    return any(_request(addr, port, "GET", f"/{scope}/{i}", timeout) == 200 for i in range(size))


def clear(addr: str, port: int, sizes: Mapping[str, int], timeout: float = 10.0) -> None:
    """Empty the given scopes of the store; only one process may call it at a time.

    Each DELETE counts one more rank done with a scope; at the scope's size the server
    empties it (and resets every count), so at most ``size`` DELETEs empty a scope.

    Args:
        addr: the store's address.
        port: its port.
        sizes: ``{scope: number of ranks}`` (see :func:`scopes`).
        timeout: seconds for each HTTP request.

    Raises:
        PlaitError: when the store cannot be reached or a scope keeps its keys.
    """
    try:
        for scope, size in sizes.items():
            for _ in range(size + 1):
                if not _has_keys(addr, port, scope, size, timeout):
                    break
                _request(addr, port, "DELETE", f"/{scope}/plait", timeout)
            else:
                raise PlaitError(f"horovodrun's rendezvous store at {addr}:{port} kept the keys "
                                 f"of scope {scope!r} after {size + 1} DELETEs")
    except OSError as exc:
        raise PlaitError(f"cannot reach horovodrun's rendezvous store at {addr}:{port} "
                         f"to empty it before Horovod starts again: {exc}") from exc
