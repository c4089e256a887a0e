"""pytest fixtures for emulated hosts.

Use from a test module (``from plait.testing.pytest_fixtures import emulated_hosts``)
or for a whole suite with ``pytest_plugins = ["plait.testing.pytest_fixtures"]``
in ``conftest.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from plait.testing.netns import EmulatedHosts, unavailable_reason

__all__ = ["emulated_hosts"]


@pytest.fixture
def emulated_hosts() -> Iterator[Callable[..., EmulatedHosts]]:
    """A factory ``make(n, **kwargs) -> EmulatedHosts`` whose hosts are up until the test ends.

    Skips the test where namespaces cannot be made (not root, no ``ip``); every
    instance made is torn down afterwards, whatever the test did.

    Returns:
        The factory; its keyword arguments are those of :class:`EmulatedHosts`.
    """
    made: list[EmulatedHosts] = []

    def make(n: int, **kwargs: Any) -> EmulatedHosts:
        reason = unavailable_reason(need_tc=kwargs.get("rate") is not None)
        if reason is not None:
            pytest.skip(reason)
        hosts = EmulatedHosts(n, **kwargs)
        made.append(hosts)
        hosts.up()
        return hosts

    try:
        yield make
    finally:
        for hosts in reversed(made):
            hosts.down()
