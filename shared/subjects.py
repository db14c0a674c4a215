"""Every NATS subject, JetStream stream, consumer and KV bucket Muster uses, defined once.

Facts read `muster.events.<entity>...` (past tense, kept in the MUSTER_EVENTS stream);
commands read `muster.<entity>.<verb>`. `CHANNELS` is the catalogue `proto/asyncapi.yaml` is
generated from.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from shared.jobconfig import JobConfig
from shared.messages import JobEvent, JobEventKind, JobRecord, Verdict

# Commands
SUBMIT = "muster.job.submit"

# Facts
EVENTS_PREFIX = "muster.events"


def verdict(submission_id: str) -> str:
    return f"{EVENTS_PREFIX}.submission.{submission_id}"


def job_event(job_id: str, kind: JobEventKind | str) -> str:
    return f"{EVENTS_PREFIX}.job.{job_id}.{kind}"


def job_events(job_id: str) -> str:
    """Wildcard over one job's whole history."""
    return f"{EVENTS_PREFIX}.job.{job_id}.>"


# JetStream
SUBMISSIONS_STREAM = "MUSTER_SUBMISSIONS"
EVENTS_STREAM = "MUSTER_EVENTS"
VALIDATOR_CONSUMER = "validator"
JOBS_BUCKET = "muster_jobs"
JOB_NAMES_BUCKET = "muster_job_names"


class Headers:
    """Headers on a submission. Only the payload (the job config) is required."""

    SUBMISSION_ID = "Muster-Submission-Id"
    USER = "Muster-User"
    MSG_ID = "Nats-Msg-Id"  # JetStream de-duplication


# Submission ids become subject tokens and KV keys.
SUBMISSION_ID_RE = r"^[A-Za-z0-9_-]{1,64}$"


@dataclass(frozen=True)
class Channel:
    address: str
    parameters: tuple[str, ...]
    message: type[BaseModel]
    action: str  # what a Muster service does on it: "receive" or "send"
    description: str


CHANNELS: dict[str, Channel] = {
    "jobSubmit": Channel(
        address=SUBMIT,
        parameters=(),
        message=JobConfig,
        action="receive",
        description=(
            "Submit a job: the payload is the job config (JSON, UTF-8, at most 1 MiB). Optional headers: "
            f"{Headers.SUBMISSION_ID} (else the stream sequence is used), {Headers.USER}. "
            "Captured by stream MUSTER_SUBMISSIONS (work queue) and validated by any validator replica."
        ),
    ),
    "submissionVerdict": Channel(
        address=EVENTS_PREFIX + ".submission.{submissionId}",
        parameters=("submissionId",),
        message=Verdict,
        action="send",
        description="The verdict on one submission: accepted with a job id, or every error found.",
    ),
    "jobEvent": Channel(
        address=EVENTS_PREFIX + ".job.{jobId}.{kind}",
        parameters=("jobId", "kind"),
        message=JobEvent,
        action="send",
        description="One fact in a job's history (stream MUSTER_EVENTS).",
    ),
    "jobRecord": Channel(
        address="$KV." + JOBS_BUCKET + ".{jobId}",
        parameters=("jobId",),
        message=JobRecord,
        action="send",
        description="The current record of a job (JetStream KV bucket muster_jobs).",
    ),
}
