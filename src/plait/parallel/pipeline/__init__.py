"""Pipeline parallelism: schedules as data, a simulator, stage partitioning.

Everything here is pure Python; the runtime that executes a schedule with a
framework adapter and a communicator builds on these pieces.
"""

from .errors import (
    PartitionError,
    PipelineError,
    PipelineTypeError,
    ScheduleDeadlock,
    ScheduleError,
)
from .partition import (
    balance_by_cost,
    check_balance,
    check_microbatches,
    partition_sizes_to_bounds,
    stage_costs,
)
from .schedule import (
    SCHEDULES,
    Action,
    ActionKind,
    Schedule,
    format_schedule,
    get_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
)
from .simulate import SimResult, Span, simulate

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "PartitionError",
    "PipelineError",
    "PipelineTypeError",
    "Schedule",
    "ScheduleDeadlock",
    "ScheduleError",
    "SimResult",
    "Span",
    "balance_by_cost",
    "check_balance",
    "check_microbatches",
    "format_schedule",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "partition_sizes_to_bounds",
    "simulate",
    "stage_costs",
]
