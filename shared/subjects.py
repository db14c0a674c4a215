"""Every NATS subject, JetStream stream, consumer and KV bucket Muster uses, defined once.

Facts read `muster.events.<entity>...` (past tense, kept in the MUSTER_EVENTS stream);
commands read `muster.<entity>.<verb>`. `CHANNELS` is the catalogue `proto/asyncapi.yaml` is
generated from.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from shared.jobconfig import JobConfig
from shared.messages import (
    Assignment,
    AttemptRecord,
    ClusterSpec,
    DrainOrder,
    EndpointReported,
    JobEvent,
    JobEventKind,
    JobRecord,
    KillOrder,
    KillRequest,
    NodeInfo,
    Rendezvous,
    TaskEvent,
    Verdict,
)

# Commands
SUBMIT = "muster.job.submit"
KILL = "muster.job.kill"
NODE_COMMANDS_PREFIX = "muster.node"


def assign(node: str) -> str:
    return f"{NODE_COMMANDS_PREFIX}.{node}.assign"


def kill(node: str) -> str:
    return f"{NODE_COMMANDS_PREFIX}.{node}.kill"


def drain(node: str) -> str:
    return f"{NODE_COMMANDS_PREFIX}.{node}.drain"


def node_commands(node: str) -> str:
    return f"{NODE_COMMANDS_PREFIX}.{node}.>"


# Facts
EVENTS_PREFIX = "muster.events"


def verdict(submission_id: str) -> str:
    return f"{EVENTS_PREFIX}.submission.{submission_id}"


def job_event(job_id: str, kind: JobEventKind | str) -> str:
    return f"{EVENTS_PREFIX}.job.{job_id}.{kind}"


def job_events(job_id: str) -> str:
    """Wildcard over one job's whole history."""
    return f"{EVENTS_PREFIX}.job.{job_id}.>"


def task_event(job_id: str, attempt: int, role: str, index: int, kind: str) -> str:
    return f"{EVENTS_PREFIX}.task.{job_id}.{attempt}.{role}.{index}.{kind}"


ENDPOINTS = f"{EVENTS_PREFIX}.task.*.*.*.*.endpoint"
TASK_STATES = [f"{EVENTS_PREFIX}.task.*.*.*.*.running", f"{EVENTS_PREFIX}.task.*.*.*.*.exited"]


def cluster_spec(job_id: str, attempt: int) -> str:
    return f"{EVENTS_PREFIX}.attempt.{job_id}.{attempt}.spec"


def node_event(node: str, kind: str) -> str:
    return f"{EVENTS_PREFIX}.node.{node}.{kind}"


# Task output, one subject per task, kept in the MUSTER_LOGS stream.
LOGS_PREFIX = "muster.logs"


def task_logs(job_id: str, attempt: int | str = "*", role: str = "*", index: int | str = "*") -> str:
    return f"{LOGS_PREFIX}.{job_id}.{attempt}.{role}.{index}"


# JetStream
SUBMISSIONS_STREAM = "MUSTER_SUBMISSIONS"
EVENTS_STREAM = "MUSTER_EVENTS"
COMMANDS_STREAM = "MUSTER_COMMANDS"
LOGS_STREAM = "MUSTER_LOGS"
VALIDATOR_CONSUMER = "validator"
REGISTRY_CONSUMER = "registry"
SUPERVISOR_CONSUMER = "supervisor"
SUPERVISOR_KILL_CONSUMER = "supervisor-kill"


def agent_consumer(node: str) -> str:
    return f"agent-{node}"


JOBS_BUCKET = "muster_jobs"
JOB_NAMES_BUCKET = "muster_job_names"
NODES_BUCKET = "muster_nodes"
ATTEMPTS_BUCKET = "muster_attempts"
RENDEZVOUS_BUCKET = "muster_rendezvous"
LEASES_BUCKET = "muster_leases"
SCHEDULER_LEASE = "scheduler"


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
    "jobKill": Channel(
        address=KILL,
        parameters=(),
        message=KillRequest,
        action="receive",
        description=(
            "Stop a job: every task gets SIGTERM, then SIGKILL after the grace; the job becomes "
            "STOPPED and is not retried. Captured by stream MUSTER_SUBMISSIONS."
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
    "nodeAssign": Channel(
        address=NODE_COMMANDS_PREFIX + ".{node}.assign",
        parameters=("node",),
        message=Assignment,
        action="send",
        description="Scheduler to the node's agent: run these tasks of an attempt (stream MUSTER_COMMANDS).",
    ),
    "nodeKill": Channel(
        address=NODE_COMMANDS_PREFIX + ".{node}.kill",
        parameters=("node",),
        message=KillOrder,
        action="send",
        description="Stop every task of an attempt on this node: SIGTERM, then SIGKILL after the grace.",
    ),
    "nodeDrain": Channel(
        address=NODE_COMMANDS_PREFIX + ".{node}.drain",
        parameters=("node",),
        message=DrainOrder,
        action="send",
        description=(
            "An operator drains a node: every task on it is stopped (and retried elsewhere), and the node "
            "takes no new work until undone or its agent restarts (stream MUSTER_COMMANDS)."
        ),
    ),
    "taskEndpoint": Channel(
        address=EVENTS_PREFIX + ".task.{jobId}.{attempt}.{role}.{index}.endpoint",
        parameters=("jobId", "attempt", "role", "index"),
        message=EndpointReported,
        action="send",
        description="An agent reserved this task's ports: its address, before the task starts.",
    ),
    "taskState": Channel(
        address=EVENTS_PREFIX + ".task.{jobId}.{attempt}.{role}.{index}.{taskEvent}",
        parameters=("jobId", "attempt", "role", "index", "taskEvent"),
        message=TaskEvent,
        action="send",
        description="A task started running, or exited (exit code, last lines of output).",
    ),
    "clusterSpec": Channel(
        address=EVENTS_PREFIX + ".attempt.{jobId}.{attempt}.spec",
        parameters=("jobId", "attempt"),
        message=ClusterSpec,
        action="send",
        description="Every endpoint of an attempt's gang, published once when all are in (the barrier).",
    ),
    "nodeRecord": Channel(
        address="$KV." + NODES_BUCKET + ".{node}",
        parameters=("node",),
        message=NodeInfo,
        action="send",
        description="A node's inventory and last heartbeat (JetStream KV bucket muster_nodes).",
    ),
    "attemptRecord": Channel(
        address="$KV." + ATTEMPTS_BUCKET + ".{jobId}.{attempt}",
        parameters=("jobId", "attempt"),
        message=AttemptRecord,
        action="send",
        description="An attempt: its placement and every task's state (JetStream KV bucket muster_attempts).",
    ),
    "rendezvousRecord": Channel(
        address="$KV." + RENDEZVOUS_BUCKET + ".{jobId}.{attempt}",
        parameters=("jobId", "attempt"),
        message=Rendezvous,
        action="send",
        description="The endpoints collected so far for an attempt (JetStream KV bucket muster_rendezvous).",
    ),
    "jobRecord": Channel(
        address="$KV." + JOBS_BUCKET + ".{jobId}",
        parameters=("jobId",),
        message=JobRecord,
        action="send",
        description="The current record of a job (JetStream KV bucket muster_jobs).",
    ),
}
