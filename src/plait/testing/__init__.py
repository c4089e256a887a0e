"""Test helpers for plait and for programs built on it (standard library only).

* :class:`~plait.testing.netns.EmulatedHosts` -- several emulated hosts on one
  machine (network namespaces on a bridge) for multi-host ``mpirun`` tests.
"""

from __future__ import annotations

from plait.testing.netns import EmulatedHosts, NetnsError, cleanup, unavailable_reason

__all__ = ["EmulatedHosts", "NetnsError", "cleanup", "unavailable_reason"]
