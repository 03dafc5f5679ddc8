import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
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
    JOB_STATE_PENDING: _ClassVar[JobState]
    JOB_STATE_PLACING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_RECOVERING: _ClassVar[JobState]
    JOB_STATE_RESCALING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_PENDING: JobState
JOB_STATE_PLACING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_RECOVERING: JobState
JOB_STATE_RESCALING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STATE_QUEUED: JobState

class Layout(_message.Message):
    __slots__ = ("dp", "tp", "pp", "cp", "ep", "zero")
    DP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    CP_FIELD_NUMBER: _ClassVar[int]
    EP_FIELD_NUMBER: _ClassVar[int]
    ZERO_FIELD_NUMBER: _ClassVar[int]
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    zero: int
    def __init__(self, dp: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., cp: _Optional[int] = ..., ep: _Optional[int] = ..., zero: _Optional[int] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "name", "state", "step", "total_steps", "loss", "layout", "world_size", "restarts", "lost_steps", "cause", "goodput", "checkpoint_uri", "target_nodes", "spec_json", "created_at", "updated_at", "priority", "queue_position", "waiting_for", "gpus", "queued_seconds", "preflight")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LOST_STEPS_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_URI_FIELD_NUMBER: _ClassVar[int]
    TARGET_NODES_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFLIGHT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    state: JobState
    step: int
    total_steps: int
    loss: float
    layout: Layout
    world_size: int
    restarts: int
    lost_steps: int
    cause: str
    goodput: float
    checkpoint_uri: str
    target_nodes: int
    spec_json: str
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    priority: int
    queue_position: int
    waiting_for: str
    gpus: int
    queued_seconds: float
    preflight: str
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., loss: _Optional[float] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., world_size: _Optional[int] = ..., restarts: _Optional[int] = ..., lost_steps: _Optional[int] = ..., cause: _Optional[str] = ..., goodput: _Optional[float] = ..., checkpoint_uri: _Optional[str] = ..., target_nodes: _Optional[int] = ..., spec_json: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., priority: _Optional[int] = ..., queue_position: _Optional[int] = ..., waiting_for: _Optional[str] = ..., gpus: _Optional[int] = ..., queued_seconds: _Optional[float] = ..., preflight: _Optional[str] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec_json", "overrides")
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    spec_json: str
    overrides: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, spec_json: _Optional[str] = ..., overrides: _Optional[_Iterable[str]] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("states", "limit", "page_size", "page_token")
    STATES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[JobState]
    limit: int
    page_size: int
    page_token: str
    def __init__(self, states: _Optional[_Iterable[_Union[JobState, str]]] = ..., limit: _Optional[int] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ScaleJobRequest(_message.Message):
    __slots__ = ("job_id", "nodes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    nodes: int
    def __init__(self, job_id: _Optional[str] = ..., nodes: _Optional[int] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "after_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_seq: int
    def __init__(self, job_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("job_id", "seq", "kind", "step", "time", "json", "state", "loss", "layout", "world_size", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    seq: int
    kind: str
    step: int
    time: _timestamp_pb2.Timestamp
    json: str
    state: JobState
    loss: float
    layout: Layout
    world_size: int
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., seq: _Optional[int] = ..., kind: _Optional[str] = ..., step: _Optional[int] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., json: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., loss: _Optional[float] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., world_size: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("job_id", "page_size", "page_token")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    page_size: int
    page_token: str
    def __init__(self, job_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class CheckpointVersion(_message.Message):
    __slots__ = ("step", "committed", "size_bytes", "layout", "world_size", "created_at", "manifest_json")
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    step: int
    committed: bool
    size_bytes: int
    layout: Layout
    world_size: int
    created_at: str
    manifest_json: str
    def __init__(self, step: _Optional[int] = ..., committed: _Optional[bool] = ..., size_bytes: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., world_size: _Optional[int] = ..., created_at: _Optional[str] = ..., manifest_json: _Optional[str] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("uri", "versions", "next_page_token")
    URI_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    uri: str
    versions: _containers.RepeatedCompositeFieldContainer[CheckpointVersion]
    next_page_token: str
    def __init__(self, uri: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[CheckpointVersion, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ProfileJobRequest(_message.Message):
    __slots__ = ("job_id", "steps")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    steps: int
    def __init__(self, job_id: _Optional[str] = ..., steps: _Optional[int] = ...) -> None: ...

class ProfileJobResponse(_message.Message):
    __slots__ = ("job_id", "request", "location", "step", "ranks")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    request: int
    location: str
    step: int
    ranks: int
    def __init__(self, job_id: _Optional[str] = ..., request: _Optional[int] = ..., location: _Optional[str] = ..., step: _Optional[int] = ..., ranks: _Optional[int] = ...) -> None: ...
