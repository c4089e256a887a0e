"""Test helpers for plait and for programs built on it (standard library only).

* :class:`~plait.testing.netns.EmulatedHosts` -- several emulated hosts on one
  machine (network namespaces on a bridge) for multi-host ``mpirun`` tests.
* :mod:`plait.testing.pytest_fixtures` -- the ``emulated_hosts`` pytest fixture.

Names are imported lazily, so ``python -m plait.testing.netns`` runs cleanly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.testing.netns import EmulatedHosts, NetnsError, cleanup, unavailable_reason

__all__ = ["EmulatedHosts", "NetnsError", "cleanup", "unavailable_reason"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("plait.testing.netns"), name)
    raise AttributeError(f"module 'plait.testing' has no attribute {name!r}")
