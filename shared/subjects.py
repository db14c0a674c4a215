"""Every NATS subject, JetStream stream, consumer and KV bucket Muster uses, defined once.

Facts read `muster.events.<entity>...` (past tense, kept in the MUSTER_EVENTS stream);
commands read `muster.<entity>.<verb>`. The catalogue of channels (which message each carries),
that `proto/asyncapi.yaml` is generated from, is `muster.shared.proto.CHANNELS`: importing subjects
costs no model, so the CLI starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from muster.shared.messages import JobEventKind

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


# An MPI job's launcher starting a daemon in a peer task: agent to agent, on core NATS (never
# kept). The last token is the sending agent's node (it may publish only its own).
EXEC_PREFIX = "muster.exec"


def exec_request(target: str, sender: str = "*") -> str:
    """To node `target`'s agent: run a command in one of its tasks (or stop one it runs)."""
    return f"{EXEC_PREFIX}.req.{target}.{sender}"


def exec_reply(caller: str, sender: str = "*") -> str:
    """Back to node `caller`'s agent: a command's output, liveness and exit code."""
    return f"{EXEC_PREFIX}.out.{caller}.{sender}"


# Liveness, on core NATS (never kept): each agent beats on its own node's subject every
# heartbeat; the scheduler and the supervisor listen. The last token is the node, which only its
# own agent may publish, so a beat names who sent it. `alive` asks a node's agent directly: the
# supervisor's check on a node whose beats are late (see services/supervisor/service.py).
BEAT_PREFIX = "muster.beat"
ALIVE_PREFIX = "muster.alive"


def beat(node: str = "*") -> str:
    return f"{BEAT_PREFIX}.{node}"


def alive(node: str = "*") -> str:
    return f"{ALIVE_PREFIX}.{node}"


# The scheduler leader's waiting queue (messages.QueueOrder), on core NATS (never kept): only the
# scheduler may publish it; every gateway replica listens (each keeps the latest).
QUEUE = "muster.queue"

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


def attempt_members(job_id: str, attempt: int | str) -> str:
    """An elastic attempt's gang changed (a task removed, or ended while the role goes on): the
    registry publishes its next spec. No payload is believed: it only names what to look at."""
    return f"{EVENTS_PREFIX}.attempt.{job_id}.{attempt}.members"


def node_event(node: str, kind: str) -> str:
    return f"{EVENTS_PREFIX}.node.{node}.{kind}"


# Task output, one subject per task, kept in the MUSTER_LOGS stream.
LOGS_PREFIX = "muster.logs"


def task_logs(
    job_id: str, attempt: int | str = "*", role: str = "*", index: int | str = "*", node: str = "*"
) -> str:
    """One task's output lines; the last token is the node that sent them."""
    return f"{LOGS_PREFIX}.{job_id}.{attempt}.{role}.{index}.{node}"


# Training metrics a task printed (shared/trainmetrics.py), one subject per task, in batches,
# kept in the MUSTER_METRICS stream.
METRICS_PREFIX = "muster.metrics"


def task_metrics(
    job_id: str, attempt: int | str = "*", role: str = "*", index: int | str = "*", node: str = "*"
) -> str:
    """One task's metric batches; the last token is the node that sent them."""
    return f"{METRICS_PREFIX}.{job_id}.{attempt}.{role}.{index}.{node}"


# JetStream
SUBMISSIONS_STREAM = "MUSTER_SUBMISSIONS"
EVENTS_STREAM = "MUSTER_EVENTS"
COMMANDS_STREAM = "MUSTER_COMMANDS"
LOGS_STREAM = "MUSTER_LOGS"
METRICS_STREAM = "MUSTER_METRICS"
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


def endpoint_key(job_id: str, attempt: int, task: str) -> str:
    """Where the registry stores one task's endpoint (`task`: "<role>.<index>") in
    RENDEZVOUS_BUCKET, beside its attempt's record (key `<job_id>.<attempt>`)."""
    return f"{job_id}.{attempt}.{task}"


def endpoint_keys(job_id: str, attempt: int) -> str:
    """The KV key filter of every endpoint stored for an attempt."""
    return f"{job_id}.{attempt}.*.*"


def name_key(user: str, job_name: str) -> str:
    """A job name's claim in JOB_NAMES_BUCKET: names are unique per user, as in OpenPAI."""
    return f"{user}.{job_name}"


VCS_BUCKET = "muster_vcs"  # virtual clusters, as the operator configured them (key: the VC's name)
DATASETS_BUCKET = "muster_datasets"  # datasets jobs may mount (`data`), as operators defined them
SECRETS_BUCKET = "muster_secrets"  # jobEnvs values whose names look secret, kept out of job records
LEASES_BUCKET = "muster_leases"
SCHEDULER_LEASE = "scheduler"
LEASE_TTL = 4.0  # seconds a leader's lease lives without renewal
# Every bucket Muster keeps, with its (history, ttl): made by shared/bus.py, named in every
# identity's rights by shared/auth.py (here, below both, so neither imports the other).
BUCKETS: dict[str, tuple[int, float]] = {
    JOBS_BUCKET: (5, 0),
    JOB_NAMES_BUCKET: (1, 0),
    NODES_BUCKET: (1, 0),
    ATTEMPTS_BUCKET: (5, 0),
    RENDEZVOUS_BUCKET: (1, 0),
    SECRETS_BUCKET: (1, 0),
    VCS_BUCKET: (5, 0),
    DATASETS_BUCKET: (5, 0),
    LEASES_BUCKET: (1, LEASE_TTL),
}


class Headers:
    """Headers on a submission. Only the payload (the job config) is required."""

    SUBMISSION_ID = "Muster-Submission-Id"
    MSG_ID = "Nats-Msg-Id"  # JetStream de-duplication


# Submission ids become subject tokens and KV keys.
SUBMISSION_ID_RE = r"^[A-Za-z0-9_-]{1,64}$"
