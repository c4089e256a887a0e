"""Errors raised by the pure pipeline-parallel modules.

Every error is a :class:`ValueError` (bad argument values, impossible
schedules) so callers can catch bad input uniformly; wrong argument *types*
raise :class:`PipelineTypeError`, which is both a :class:`PipelineError` and a
:class:`TypeError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .schedule import Action

__all__ = [
    "PartitionError",
    "PipelineError",
    "PipelineTypeError",
    "ScheduleDeadlock",
    "ScheduleError",
    "StageFailed",
]


class PipelineError(ValueError):
    """Base class of every pipeline-parallel error (a :class:`ValueError`)."""


class PipelineTypeError(PipelineError, TypeError):
    """An argument has the wrong type (also a :class:`TypeError`)."""


class PartitionError(PipelineError):
    """A model cannot be split into the requested stages or micro-batches."""


class StageFailed(PipelineError):
    """A stage raised during a step (on this rank, or on another pipeline rank, which
    told this one): the message names the action, the rank and the error.

    Attributes:
        remote: True when another pipeline rank failed and told this one.
    """

    def __init__(self, message: str, remote: bool = False) -> None:
        super().__init__(message)
        self.remote = remote


class ScheduleError(PipelineError):
    """A schedule is malformed: an action is missing, duplicated or out of order."""


class ScheduleDeadlock(ScheduleError):
    """Every unfinished rank is blocked waiting for a message that never comes.

    Attributes:
        stuck: For each blocked rank, the index into that rank's action list
            and the action it is blocked on.
    """

    def __init__(self, message: str, stuck: dict[int, tuple[int, Action]]) -> None:
        super().__init__(message)
        self.stuck = stuck
