from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    QUEUED: _ClassVar[JobState]
    LAUNCHING: _ClassVar[JobState]
    RUNNING: _ClassVar[JobState]
    SUCCEEDED: _ClassVar[JobState]
    FAILED: _ClassVar[JobState]
    CANCELLED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
QUEUED: JobState
LAUNCHING: JobState
RUNNING: JobState
SUCCEEDED: JobState
FAILED: JobState
CANCELLED: JobState

class TrainRequest(_message.Message):
    __slots__ = ("name", "entry_point", "args", "dataset", "parameters", "framework", "processes_per_worker", "timeout_s", "restarts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENTRY_POINT_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_PER_WORKER_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    entry_point: str
    args: _containers.RepeatedScalarFieldContainer[str]
    dataset: str
    parameters: _struct_pb2.Struct
    framework: str
    processes_per_worker: int
    timeout_s: float
    restarts: int
    def __init__(self, name: _Optional[str] = ..., entry_point: _Optional[str] = ..., args: _Optional[_Iterable[str]] = ..., dataset: _Optional[str] = ..., parameters: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., framework: _Optional[str] = ..., processes_per_worker: _Optional[int] = ..., timeout_s: _Optional[float] = ..., restarts: _Optional[int] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("job_id", "state")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("states",)
    STATES_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[JobState]
    def __init__(self, states: _Optional[_Iterable[_Union[JobState, str]]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobStatus]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobStatus, _Mapping]]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class LogsRequest(_message.Message):
    __slots__ = ("job_id", "rank", "follow")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    follow: bool
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("rank", "data")
    RANK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    rank: int
    data: bytes
    def __init__(self, rank: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class RankExit(_message.Message):
    __slots__ = ("rank", "exit_code")
    RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    exit_code: int
    def __init__(self, rank: _Optional[int] = ..., exit_code: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("step", "epoch", "loss", "metrics", "updated_at")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    step: int
    epoch: int
    loss: float
    metrics: _containers.ScalarMap[str, float]
    updated_at: float
    def __init__(self, step: _Optional[int] = ..., epoch: _Optional[int] = ..., loss: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., updated_at: _Optional[float] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_id", "name", "state", "framework", "instances", "processes_per_worker", "created_at", "started_at", "finished_at", "exit_codes", "progress", "message", "artifact", "workers", "entry_point", "dataset", "parameters", "attempts", "restarts")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_PER_WORKER_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODES_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_POINT_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    state: JobState
    framework: str
    instances: int
    processes_per_worker: int
    created_at: float
    started_at: float
    finished_at: float
    exit_codes: _containers.RepeatedCompositeFieldContainer[RankExit]
    progress: Progress
    message: str
    artifact: str
    workers: _containers.RepeatedScalarFieldContainer[str]
    entry_point: str
    dataset: str
    parameters: _struct_pb2.Struct
    attempts: int
    restarts: int
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., framework: _Optional[str] = ..., instances: _Optional[int] = ..., processes_per_worker: _Optional[int] = ..., created_at: _Optional[float] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., exit_codes: _Optional[_Iterable[_Union[RankExit, _Mapping]]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., message: _Optional[str] = ..., artifact: _Optional[str] = ..., workers: _Optional[_Iterable[str]] = ..., entry_point: _Optional[str] = ..., dataset: _Optional[str] = ..., parameters: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., attempts: _Optional[int] = ..., restarts: _Optional[int] = ...) -> None: ...
