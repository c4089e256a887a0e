"""Pipeline parallelism: schedules as data, a simulator, stage partitioning.

Everything here is pure Python (no framework import): :class:`Pipeline` and the
runtime drive framework glue (``plait.adapters.torch_pipeline``,
``plait.adapters.keras_pipeline``) and a communicator's send/recv.
"""

from .api import Pipeline, framework_of
from .errors import (
    PartitionError,
    PipelineError,
    PipelineTypeError,
    ScheduleDeadlock,
    ScheduleError,
    StageFailed,
)
from .partition import (
    balance_by_cost,
    check_balance,
    check_microbatches,
    partition_sizes_to_bounds,
    stage_costs,
)
from .runtime import Runtime, StageExecutor, StepStats
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
    "Pipeline",
    "PipelineError",
    "PipelineTypeError",
    "Runtime",
    "Schedule",
    "ScheduleDeadlock",
    "ScheduleError",
    "SimResult",
    "Span",
    "StageExecutor",
    "StageFailed",
    "StepStats",
    "balance_by_cost",
    "check_balance",
    "check_microbatches",
    "format_schedule",
    "framework_of",
    "get_schedule",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "partition_sizes_to_bounds",
    "simulate",
    "stage_costs",
]
