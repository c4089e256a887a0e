"""Pipeline, tensor and mesh parallelism for plait.

This package imports no framework and no communication library: schedules,
partitioning and mesh rank arithmetic are pure Python, and the runtimes that
execute them do so through the adapter and communicator protocols.
"""

__all__: list[str] = []
