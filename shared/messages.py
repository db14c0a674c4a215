"""Every message Muster puts on the bus or in JetStream, as pydantic models.

The job config itself (`shared.jobconfig.JobConfig`) travels raw on the submit subject: users
publish the JSON they wrote, with metadata in headers (see `shared.subjects.Headers`).
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shared.jobconfig import FieldError, JobConfig


def now() -> datetime:
    return datetime.now(UTC)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Any:
        return cls.model_validate_json(data)


class JobState(StrEnum):
    """OpenPAI's job states."""

    WAITING = "WAITING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def final(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


def job_id_for(submission_id: str) -> str:
    """Job ids are derived from the submission id, so a redelivered submission maps to the same job."""
    return "j" + hashlib.sha256(submission_id.encode()).hexdigest()[:12]


class Verdict(Message):
    """The validator's answer to one submission, on `muster.events.submission.<sid>`."""

    submission_id: str
    accepted: bool
    job_id: str | None = None
    job_name: str | None = None
    errors: list[FieldError] = Field(default_factory=list)
    at: datetime = Field(default_factory=now)


class JobRecord(Message):
    """The current state of a job: KV bucket `muster_jobs`, key = job id."""

    job_id: str
    job_name: str
    state: JobState = JobState.WAITING
    submission_id: str
    user: str
    config: JobConfig
    submitted_at: datetime
    updated_at: datetime = Field(default_factory=now)
    reason: str = "waiting for a scheduler"
    attempt: int = 0  # the current attempt's number; 0 until first placed
    retries: int = 0  # retries charged to the config's retryCount (user failures, or -2 restarts)
    platform_retries: int = 0  # retries after platform failures: not charged to retryCount
    not_before: datetime | None = None  # the next attempt waits until then (backoff)
    settled: int = 0  # the last attempt whose end the supervisor has applied to this record


class JobEventKind(StrEnum):
    SUBMITTED = "submitted"
    ACCEPTED = "accepted"
    PLACED = "placed"
    RUNNING = "running"
    RETRYING = "retrying"
    KILLED = "killed"
    ENDED = "ended"


class JobEvent(Message):
    """One fact in a job's history, on `muster.events.job.<job_id>.<kind>` (stream MUSTER_EVENTS)."""

    job_id: str
    job_name: str
    kind: JobEventKind
    state: JobState
    attempt: int = 0
    submission_id: str | None = None
    user: str | None = None
    detail: str = ""
    at: datetime = Field(default_factory=now)


# ------------------------------------------------------------------ nodes, placement, rendezvous


class GpuDevice(BaseModel):
    index: int
    model: str
    memory_mb: int = 0


class NodeInfo(Message):
    """A node as its agent registered it: KV bucket `muster_nodes`, key = node name. The agent
    rewrites it every heartbeat; `agent_id` changes when the agent restarts."""

    node: str
    address: str
    cpus: int
    memory_mb: int
    gpus: list[GpuDevice] = Field(default_factory=list)
    runtime: str
    agent_id: str
    started_at: datetime = Field(default_factory=now)
    heartbeat_at: datetime = Field(default_factory=now)


class TaskSpec(BaseModel):
    """One task of an attempt placed on a node, with the exact GPU device indexes it owns."""

    role: str
    role_no: int
    index: int
    node: str
    gpus: list[int] = Field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.role}.{self.index}"


class Assignment(Message):
    """Scheduler -> agent, on `muster.node.<node>.assign`: run these tasks of this attempt."""

    job_id: str
    attempt: int
    user: str
    config: JobConfig
    gang: list[TaskSpec]  # every task of the attempt, on every node
    node: str

    @property
    def mine(self) -> list[TaskSpec]:
        return [t for t in self.gang if t.node == self.node]


class Endpoint(BaseModel):
    """Where one task can be reached: its node's address, its default port, its portList ports."""

    role: str
    role_no: int
    index: int
    node: str
    host: str
    port: int
    ports: dict[str, list[int]] = Field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class EndpointReported(Message):
    """Agent -> registry, on `muster.events.task.<job>.<attempt>.<role>.<index>.endpoint`."""

    job_id: str
    attempt: int
    gang_size: int
    endpoint: Endpoint


class ClusterSpec(Message):
    """Registry -> agents, once per attempt, on `muster.events.attempt.<job>.<attempt>.spec`:
    every endpoint of the gang, ordered by role (config order) then index."""

    job_id: str
    attempt: int
    endpoints: list[Endpoint]


class TaskEventKind(StrEnum):
    RUNNING = "running"
    EXITED = "exited"


class TaskEvent(Message):
    """Agent -> everyone, on `muster.events.task.<job>.<attempt>.<role>.<index>.<kind>`."""

    job_id: str
    attempt: int
    role: str
    index: int
    node: str
    kind: TaskEventKind
    exit_code: int | None = None
    reason: str = ""
    last_lines: list[str] = Field(default_factory=list)
    at: datetime = Field(default_factory=now)


class TaskState(StrEnum):
    PLACED = "PLACED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"  # killed by the platform (kill order, gang teardown)

    @property
    def ended(self) -> bool:
        return self in (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.STOPPED)


class TaskStatus(BaseModel):
    role: str
    role_no: int
    index: int
    node: str
    gpus: list[int] = Field(default_factory=list)
    state: TaskState = TaskState.PLACED
    host: str | None = None
    port: int | None = None
    exit_code: int | None = None
    reason: str = ""
    last_lines: list[str] = Field(default_factory=list)
    started_at: datetime | None = None
    ended_at: datetime | None = None

    @property
    def key(self) -> str:
        return f"{self.role}.{self.index}"


class FailureKind(StrEnum):
    USER = "user"  # the command exited non-zero, or ran out of memory
    PLATFORM = "platform"  # node lost, image pull failed, could not start, killed by the platform


class Failure(BaseModel):
    """What failed an attempt, and the evidence: the first failed task's node, exit code, output."""

    kind: FailureKind
    task: str
    node: str
    exit_code: int | None = None
    reason: str = ""
    last_lines: list[str] = Field(default_factory=list)


class AttemptRecord(Message):
    """One attempt of a job: KV bucket `muster_attempts`, key `<job_id>.<attempt>`. Created by the
    scheduler when it places the gang (the key's creation is the fence against placing it twice);
    task states are then kept by the supervisor."""

    job_id: str
    attempt: int
    tasks: list[TaskStatus]
    placed_at: datetime = Field(default_factory=now)
    ended_at: datetime | None = None
    outcome: JobState | None = None
    rule: str = ""  # which rule ended it
    failure: Failure | None = None  # why it failed, with the evidence
    charged: bool | None = None  # whether a retry after it was charged to retryCount

    @property
    def key(self) -> str:
        return f"{self.job_id}.{self.attempt}"

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    def task(self, role: str, index: int) -> TaskStatus:
        return next(t for t in self.tasks if t.role == role and t.index == index)


class KillOrder(Message):
    """Supervisor/CLI -> agent, on `muster.node.<node>.kill`: stop every task of this attempt
    (SIGTERM, then SIGKILL after `grace` seconds)."""

    job_id: str
    attempt: int
    reason: str
    grace: float = 10.0


class KillRequest(Message):
    """A user's request to stop a job, on `muster.job.kill` (stream MUSTER_SUBMISSIONS)."""

    job_id: str
    user: str = "anonymous"
    grace: float = 10.0
    at: datetime = Field(default_factory=now)
