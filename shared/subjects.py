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
    Question,
    Rendezvous,
    TaskEvent,
    Verdict,
)

# Commands. A user's requests carry the user's name as the last token: with authentication on,
# the server lets an identity publish only under its own name, so the token is who sent it.
SUBMIT_PREFIX = "muster.job.submit"
KILL_PREFIX = "muster.job.kill"
SUBMIT = SUBMIT_PREFIX + ".*"
KILL = KILL_PREFIX + ".*"
NODE_COMMANDS_PREFIX = "muster.node"
API_PREFIX = "muster.api"
ALL = "_all"  # the gateway's every-job view: only admins may ask (user names never start with "_")


def submit(user: str) -> str:
    return f"{SUBMIT_PREFIX}.{user}"


def kill_request(user: str) -> str:
    return f"{KILL_PREFIX}.{user}"


def requester(subject: str) -> str:
    """The identity a request subject names (its last token)."""
    return subject.rsplit(".", 1)[-1]


def api(user: str, verb: str) -> str:
    """A question to the gateway, asked as `user` (ALL: as an admin, about every job)."""
    return f"{API_PREFIX}.{user}.{verb}"


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


def verdict(user: str, submission_id: str) -> str:
    return f"{EVENTS_PREFIX}.submission.{user}.{submission_id}"


def job_event(job_id: str, kind: JobEventKind | str) -> str:
    return f"{EVENTS_PREFIX}.job.{job_id}.{kind}"


def job_events(job_id: str) -> str:
    """Wildcard over one job's whole history."""
    return f"{EVENTS_PREFIX}.job.{job_id}.>"


# A task event's last token is the node that sent it (an agent may publish only its own), or
# PLATFORM when the supervisor declares a task ended for a node that cannot (lost, never came).
PLATFORM = "_platform"


def task_event(
    job_id: str, attempt: int | str, role: str, index: int | str, kind: str, node: str = "*"
) -> str:
    return f"{EVENTS_PREFIX}.task.{job_id}.{attempt}.{role}.{index}.{kind}.{node}"


ENDPOINTS = task_event("*", "*", "*", "*", "endpoint")
TASK_STATES = [task_event("*", "*", "*", "*", "running"), task_event("*", "*", "*", "*", "exited")]


def sender(subject: str) -> str:
    """The node (or PLATFORM) a task event came from: its last token."""
    return subject.rsplit(".", 1)[-1]


def cluster_spec(job_id: str, attempt: int | str) -> str:
    return f"{EVENTS_PREFIX}.attempt.{job_id}.{attempt}.spec"


def node_event(node: str, kind: str) -> str:
    return f"{EVENTS_PREFIX}.node.{node}.{kind}"


# Task output, one subject per task, kept in the MUSTER_LOGS stream.
LOGS_PREFIX = "muster.logs"


def task_logs(
    job_id: str, attempt: int | str = "*", role: str = "*", index: int | str = "*", node: str = "*"
) -> str:
    """One task's output lines; the last token is the node that sent them."""
    return f"{LOGS_PREFIX}.{job_id}.{attempt}.{role}.{index}.{node}"


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


def name_key(user: str, job_name: str) -> str:
    """A job name's claim in JOB_NAMES_BUCKET: names are unique per user, as in OpenPAI."""
    return f"{user}.{job_name}"


SECRETS_BUCKET = "muster_secrets"  # jobEnvs values whose names look secret, kept out of job records
LEASES_BUCKET = "muster_leases"
SCHEDULER_LEASE = "scheduler"


class Headers:
    """Headers on a submission. Only the payload (the job config) is required."""

    SUBMISSION_ID = "Muster-Submission-Id"
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
        address=SUBMIT_PREFIX + ".{user}",
        parameters=("user",),
        message=JobConfig,
        action="receive",
        description=(
            "Submit a job as {user}: the payload is the job config (JSON, UTF-8, at most 1 MiB). With "
            "authentication on, only identity {user} may publish here, and the job is {user}'s whatever "
            f"the payload or headers say. Optional header: {Headers.SUBMISSION_ID} (else the stream "
            "sequence). "
            "Captured by stream MUSTER_SUBMISSIONS (work queue) and validated by any validator replica."
        ),
    ),
    "jobKill": Channel(
        address=KILL_PREFIX + ".{user}",
        parameters=("user",),
        message=KillRequest,
        action="receive",
        description=(
            "Stop one of {user}'s jobs (an admin may send as anyone): every task gets SIGTERM, then "
            "SIGKILL after the grace; the job becomes "
            "STOPPED and is not retried. Captured by stream MUSTER_SUBMISSIONS."
        ),
    ),
    "submissionVerdict": Channel(
        address=EVENTS_PREFIX + ".submission.{user}.{submissionId}",
        parameters=("user", "submissionId"),
        message=Verdict,
        action="send",
        description="The verdict on one submission: accepted with a job id, or every error found.",
    ),
    "gatewayQuestion": Channel(
        address=API_PREFIX + ".{user}.{verb}",
        parameters=("user", "verb"),
        message=Question,
        action="receive",
        description=(
            "A question to the gateway, asked as {user} (only identity {user} may publish here; "
            "_all: an admin, about every job), answered by request/reply with JSON: jobs (the asker's "
            "jobs), job (one, with its attempts), verdict (of a submission), logs (a page of output "
            "lines after a stream sequence), events (a page of the job's history), ping. Another "
            "user's job is answered as no such job."
        ),
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
        address=EVENTS_PREFIX + ".task.{jobId}.{attempt}.{role}.{index}.endpoint.{node}",
        parameters=("jobId", "attempt", "role", "index", "node"),
        message=EndpointReported,
        action="send",
        description="An agent reserved this task's ports: its address, before the task starts.",
    ),
    "taskState": Channel(
        address=EVENTS_PREFIX + ".task.{jobId}.{attempt}.{role}.{index}.{taskEvent}.{node}",
        parameters=("jobId", "attempt", "role", "index", "taskEvent", "node"),
        message=TaskEvent,
        action="send",
        description=(
            "A task started running, or exited (exit code, last lines of output), from {node}: the node "
            "it was placed on (only that node's agent may publish it), or _platform (the supervisor)."
        ),
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
