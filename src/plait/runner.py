"""Horovod's ``horovod.runner`` (``from plait.runner import run``): :func:`plait.run`."""

from __future__ import annotations

from plait.launch.call import run

__all__ = ["run"]
