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
    attempts: list[dict[str, Any]] = Field(default_factory=list)


class JobEventKind(StrEnum):
    SUBMITTED = "submitted"
    ACCEPTED = "accepted"


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
