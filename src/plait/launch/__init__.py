"""Launching: hostfiles, launcher command lines, ``plait run`` and the job context.

Standard library only: importing this package imports no framework and no MPI.
"""

from __future__ import annotations

from plait.launch.command import LaunchCommand, LaunchSpec, build_command
from plait.launch.context import (
    FRAMEWORKS,
    JobContext,
    context,
    export_framework_env,
    framework_env,
    tf_config,
    torch_env,
)
from plait.launch.hostfile import (
    HostfileError,
    HostSlots,
    parse_hostfile,
    parse_hostfile_text,
    parse_hosts,
    total_slots,
)

__all__ = [
    "HostSlots",
    "HostfileError",
    "JobContext",
    "LaunchCommand",
    "LaunchSpec",
    "build_command",
    "FRAMEWORKS",
    "context",
    "export_framework_env",
    "framework_env",
    "parse_hostfile",
    "parse_hostfile_text",
    "parse_hosts",
    "tf_config",
    "torch_env",
    "total_slots",
]
