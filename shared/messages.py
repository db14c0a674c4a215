"""Every message Muster puts on the bus or in JetStream, as pydantic models.

The job config itself (`muster.shared.jobconfig.JobConfig`) travels raw on the submit subject: users
publish the JSON they wrote, with metadata in headers (see `muster.shared.subjects.Headers`).
"""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
    model_validator,
)

from muster.shared.jobconfig import MAX_ROLES, EnvName, FieldError, JobConfig, Priority
from muster.shared.shapes import (
    MAX_GANG,
    MAX_NODE_GPU_ENTRIES,
    Address,
    Attempt,
    AttemptOrNone,
    Count,
    ExitCode,
    GpuIndex,
    GpuModel,
    Grace,
    Index,
    JobId,
    Lines,
    MetricName,
    Name,
    Port,
    Reason,
    Role,
    RoleNo,
    ShortId,
    Step,
    SubmissionId,
    TaskKey,
)


def now() -> datetime:
    return datetime.now(UTC)


class Message(BaseModel):
    """A fact or a record (an event, a KV record): unknown fields are ignored, so a record or
    event written by a newer version of Muster still decodes in an older replica during a
    rolling upgrade (nothing it does not know is acted on). Every field has a shape
    (`muster.shared.shapes`), checked on decode."""

    model_config = ConfigDict(extra="ignore")

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes | None) -> Self:
        return cls.model_validate_json(data or b"")


class Command(Message):
    """An order or request that makes a service act (kill, drain, assign, exec): a payload with
    a field it does not define is refused, not taken for what it is not (any JSON object with a
    `node` field once drained a node)."""

    model_config = ConfigDict(extra="forbid")


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


MAX_ERRORS = 100  # errors (and warnings) a verdict lists; the rest are counted in a last one


def _at_most(n: int) -> Any:
    """A list of FieldErrors cut to its first `n - 1` and one that counts the rest."""

    def cut(value: Any) -> Any:
        if not isinstance(value, list) or len(value) <= n:
            return value
        rest = FieldError(path="", reason=f"... and {len(value) - n + 1} more")
        return [*value[: n - 1], rest]

    return cut


def job_id_for(user: str, submission_id: str) -> str:
    """Job ids are derived from the submitter and the submission id, so a redelivered submission
    maps to the same job, and one user's submission id never names another user's job."""
    return "j" + hashlib.sha256(f"{user}/{submission_id}".encode()).hexdigest()[:12]


class Verdict(Message):
    """The validator's answer to one submission, on `muster.events.submission.<sid>`."""

    submission_id: SubmissionId
    accepted: bool
    user: Name | Literal[""] = ""  # who submitted it (the verdict's subject names them too)
    job_id: JobId | None = None
    job_name: Name | None = None
    errors: Annotated[list[FieldError], BeforeValidator(_at_most(MAX_ERRORS))] = Field(default_factory=list)
    # An accepted config's forms OpenPAI took that are not the contract's own (a port's beginAt
    # as a string, PAI_ names in jobEnvs), each naming its field and why.
    warnings: Annotated[list[FieldError], BeforeValidator(_at_most(MAX_ERRORS))] = Field(default_factory=list)
    at: AwareDatetime = Field(default_factory=now)


WAITING_FOR_SCHEDULER = "waiting for a scheduler"  # a new job's reason, until a scheduler looks at it


class JobRecord(Message):
    """The current state of a job: KV bucket `muster_jobs`, key = job id."""

    job_id: JobId
    job_name: Name
    state: JobState = JobState.WAITING
    submission_id: SubmissionId
    user: Name
    config: JobConfig
    # sha256 of the accepted config's canonical JSON (to spot a reused submission id)
    digest: Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{64})?$")] = ""
    submitted_at: AwareDatetime
    updated_at: AwareDatetime = Field(default_factory=now)
    reason: str = WAITING_FOR_SCHEDULER
    unschedulable: bool = False  # the scheduler found no node that could ever fit it
    # The current attempt's number, 0 until first placed. The scheduler creates an attempt's
    # record and the supervisor then moves the job to it (`Supervisor.adopt`): until then an
    # attempt record newer than this one is the job's current attempt (lifecycle.attempt_to_place).
    attempt: AttemptOrNone = 0
    retries: Count = 0  # retries charged to the config's retryCount (user failures, or -2 restarts)
    platform_retries: Count = 0  # retries after platform failures: not charged to retryCount
    not_before: AwareDatetime | None = None  # the next attempt waits until then (backoff)
    settled: AttemptOrNone = 0  # the last attempt whose end the supervisor has applied to this record

    @property
    def unseen(self) -> bool:
        """Accepted, and no scheduler has looked at it yet (placed it, or said why not)."""
        return self.state == JobState.WAITING and self.attempt == 0 and self.reason == WAITING_FOR_SCHEDULER


class JobEventKind(StrEnum):
    SUBMITTED = "submitted"  # written before issue 28 (the `accepted` event now opens a history)
    ACCEPTED = "accepted"
    PLACED = "placed"
    RUNNING = "running"
    RETRYING = "retrying"
    KILLED = "killed"
    PREEMPTED = "preempted"  # its running attempt was stopped to make room; it waits again, uncharged
    RESIZED = "resized"  # an elastic role grew or shrank
    ENDED = "ended"


class JobEvent(Message):
    """One fact in a job's history, on `muster.events.job.<job_id>.<kind>` (stream MUSTER_EVENTS)."""

    job_id: JobId
    job_name: Name
    kind: JobEventKind
    state: JobState
    attempt: AttemptOrNone = 0
    submission_id: SubmissionId | None = None
    user: Name | None = None
    detail: str = ""
    at: AwareDatetime = Field(default_factory=now)


# ------------------------------------------------------------------ nodes, placement, rendezvous


class GpuSharing(StrEnum):
    """How an agent lets the tasks that hold part of one GPU share it (docs/gpus.md)."""

    TIMESLICE = "timeslice"  # the same device, time-sliced by the driver: not isolated
    MPS = "mps"  # NVIDIA MPS: each task's thread percentage and pinned memory limit set from its share

    @property
    def text(self) -> str:
        """What a person is told a shared task gets."""
        return "shared, time-sliced, not isolated" if self is GpuSharing.TIMESLICE else "shared, MPS"


class GpuDevice(BaseModel):
    index: GpuIndex
    model: GpuModel
    memory_mb: Count = 0


class NodeInfo(Message):
    """A node as its agent registered it: KV bucket `muster_nodes`, key = node name. The agent
    rewrites it every heartbeat; `agent_id` changes when the agent restarts."""

    node: Name
    address: Address
    cpus: Count
    memory_mb: Count
    gpus: list[GpuDevice] = Field(default_factory=list, max_length=MAX_NODE_GPU_ENTRIES)
    runtime: ShortId
    agent_id: ShortId
    started_at: AwareDatetime = Field(default_factory=now)
    heartbeat_at: AwareDatetime = Field(default_factory=now)
    # Set by an agent stopping for a restart (SIGTERM): its tasks keep running, and the node is
    # not lost before this time even without heartbeats.
    restarting_until: AwareDatetime | None = None
    drained: bool = False  # an operator drained it: its tasks were stopped, it takes no new work
    # Where the agent serves /metrics (at `address`): Prometheus finds agents through the
    # supervisor's /sd/agents (HTTP service discovery). None: it serves none (a sim node).
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    # How its tasks that hold part of one GPU share it (--gpu-sharing).
    gpu_sharing: GpuSharing = GpuSharing.TIMESLICE


# What no node record may claim (beyond: a forged or broken record, refused).
MAX_NODE_GPUS = 64
MAX_NODE_CPUS = 4096
MAX_NODE_MEMORY_MB = 64 * 1024 * 1024  # 64 TiB
CLOCK_SKEW = timedelta(seconds=30)


def node_refusal(key: str, info: NodeInfo, at: datetime | None = None) -> str | None:
    """Why a node record is not to be believed, or None: it must be stored under its own node's
    name (which only that node's agent may write), beat no later than now (give or take
    CLOCK_SKEW), and claim capacity a machine can have."""
    at = at or now()
    if key != info.node:
        return f"record {key} claims to be node {info.node}"
    if info.heartbeat_at > at + CLOCK_SKEW or info.started_at > at + CLOCK_SKEW:
        return f"heartbeat from the future ({info.heartbeat_at.isoformat()})"
    if not 1 <= info.cpus <= MAX_NODE_CPUS or not 1 <= info.memory_mb <= MAX_NODE_MEMORY_MB:
        return f"impossible capacity: {info.cpus} CPUs, {info.memory_mb} MB"
    if len(info.gpus) > MAX_NODE_GPUS or len({g.index for g in info.gpus}) != len(info.gpus):
        return f"impossible GPUs: {len(info.gpus)}, indices {sorted(g.index for g in info.gpus)[:8]}…"
    if any(g.index < 0 for g in info.gpus):
        return "impossible GPUs: a negative index"
    return None


class TaskSpec(BaseModel):
    """One task of an attempt placed on a node, with the exact GPU device indexes it owns."""

    model_config = ConfigDict(extra="forbid")  # a part of a command (Assignment)

    role: Role
    role_no: RoleNo
    index: Index
    node: Name
    gpus: list[GpuIndex] = Field(default_factory=list, max_length=MAX_NODE_GPUS)
    # Set only for a task that asks for part of one GPU (its role's fractional gpuNumber): its
    # share of `gpus[0]` in thousandths. That GPU is shared, with fractional tasks only.
    gpu_milli: int | None = Field(default=None, ge=1, lt=1000)

    @property
    def key(self) -> str:
        return f"{self.role}.{self.index}"

    @property
    def gpu_share(self) -> float:
        """The GPUs this task holds: a count, or the part of its one GPU."""
        return self.gpu_milli / 1000 if self.gpu_milli is not None else float(len(self.gpus))


class Assignment(Command):
    """Scheduler -> agent, on `muster.node.<node>.assign`: run these tasks of this attempt."""

    job_id: JobId
    attempt: Attempt
    user: Name
    config: JobConfig
    # the attempt's tasks on `node` (its peers are in the cluster spec)
    gang: list[TaskSpec] = Field(max_length=MAX_GANG)
    node: Name
    # The jobEnvs the validator kept apart as secrets (by its MUSTER_SECRET_ENV): the agent masks
    # their values in the task's output as it does its own patterns' (the two may differ).
    secret_names: list[EnvName] = Field(default_factory=list, max_length=1024)

    @property
    def mine(self) -> list[TaskSpec]:
        return [t for t in self.gang if t.node == self.node]

    @property
    def key(self) -> str:
        return attempt_key(self.job_id, self.attempt)

    @property
    def solo(self) -> bool:
        """One task, not elastic: its own endpoint is its whole cluster spec, so its agent
        builds the spec itself (no endpoint report, no rendezvous, no spec message)."""
        return self.config.total_tasks == 1 and not self.config.elastic

    def own_spec(self, endpoint: Endpoint) -> ClusterSpec | None:
        """A solo task's cluster spec, its own endpoint alone; None for a task of a bigger gang
        (the registry's spec says where its peers are)."""
        return (
            ClusterSpec(job_id=self.job_id, attempt=self.attempt, endpoints=[endpoint]) if self.solo else None
        )

    @classmethod
    def of(cls, job: JobRecord, attempt: AttemptRecord, node: str) -> Assignment:
        """The order for `node`'s part of a placed attempt (the scheduler sends it; an agent
        that adopts a task after a restart rebuilds it the same way)."""
        return cls(
            job_id=job.job_id,
            attempt=attempt.attempt,
            user=job.user,
            config=job.config,
            gang=[t.spec() for t in attempt.tasks if t.node == node],
            node=node,
        )


class Endpoint(BaseModel):
    """Where one task can be reached: its node's address, its default port, its portList ports."""

    role: Role
    role_no: RoleNo
    index: Index
    node: Name
    host: Address
    port: Port
    # portList label -> its ports (at most 32 labels of at most 100 ports, as the config allows)
    ports: dict[Role, Annotated[list[Port], Field(max_length=100)]] = Field(
        default_factory=dict, max_length=32
    )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def of(cls, spec: TaskSpec, host: str, ports: list[int], port_list: list[Any]) -> Endpoint:
        """A task's endpoint from the ports reserved for it, in the order they are taken: its
        default port, then each `portList` entry's ports in config order (so an adopted task's
        named ports are rebuilt from the list kept on its container)."""
        named: dict[str, list[int]] = {}
        rest = ports[1:]
        for p in port_list:
            named[p.label], rest = rest[: p.portNumber], rest[p.portNumber :]
        return cls(
            role=spec.role,
            role_no=spec.role_no,
            index=spec.index,
            node=spec.node,
            host=host,
            port=ports[0] if ports else 0,
            ports=named,
        )


class EndpointReported(Message):
    """Agent -> registry, on `muster.events.task.<job>.<attempt>.<role>.<index>.endpoint`."""

    job_id: JobId
    attempt: Attempt
    gang_size: Annotated[int, Field(ge=1, le=MAX_GANG)]
    endpoint: Endpoint


class ClusterSpec(Message):
    """Registry -> agents, on `muster.events.attempt.<job>.<attempt>.spec`: every endpoint of the
    gang, ordered by role (config order) then index. Once per attempt, or for an elastic one once
    per membership (`version` 1, 2, ...: the last one is the gang now)."""

    job_id: JobId
    attempt: Attempt
    endpoints: list[Endpoint] = Field(max_length=MAX_GANG)
    version: Count = 1

    def has(self, key: str) -> bool:
        return any(f"{e.role}.{e.index}" == key for e in self.endpoints)


class Rendezvous(Message):
    """What the registry has collected for one attempt: KV bucket `muster_rendezvous`, key
    `<job_id>.<attempt>`. Each endpoint is stored under its own key
    (`subjects.endpoint_key`, `<job_id>.<attempt>.<role>.<index>`); this record says which are
    in, a bit per task (`collected`), and what was last published. So a write of it costs a bit
    per task of the gang, not its endpoints, however few endpoints each write adds."""

    job_id: JobId
    attempt: Attempt
    gang_size: Count
    # Hex bitmap: bit i set = the endpoint of the attempt record's tasks[i] is stored.
    collected: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]*$")] = ""
    published: bool = False
    version: Count = 0  # the last spec published (elastic attempts publish one per membership)
    membership: Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{32})?$")] = ""  # its tasks' digest
    # Only in records an older registry wrote (every endpoint in the record): moved to their
    # own keys by the next write.
    endpoints: dict[TaskKey, Endpoint] = Field(default_factory=dict)

    @property
    def bits(self) -> int:
        return int(self.collected, 16) if self.collected else 0


def membership(tasks: list[str]) -> str:
    """A digest of a spec's tasks ("<role>.<index>", sorted): whether a gang changed."""
    return hashlib.sha256("\n".join(tasks).encode()).hexdigest()[:32]


class TaskEventKind(StrEnum):
    RUNNING = "running"
    EXITED = "exited"


class TaskCause(StrEnum):
    """Why a task ended. The supervisor's policy reads this, never the reason text."""

    EXITED = "exited"  # the command ended by itself: the exit code says how
    OOM = "oom"  # the kernel killed it for memory (a user failure)
    KILLED = "killed"  # stopped on purpose: kill order, gang teardown, obsolete attempt
    NODE_LOST = "node_lost"  # its node stopped heartbeating; it may not have ended cleanly
    PLATFORM = "platform"  # transient: could not start now, lost track, pull timeout, daemon restart
    CONFIG = "config"  # will recur on any node: invalid mount, bad image reference, impossible limits


class TaskEvent(Message):
    """Agent -> everyone, on `muster.events.task.<job>.<attempt>.<role>.<index>.<kind>`."""

    job_id: JobId
    attempt: Attempt
    role: Role
    index: Index
    node: Name
    kind: TaskEventKind
    cause: TaskCause | None = None  # set when kind is EXITED
    exit_code: ExitCode | None = None
    # Set on RUNNING for a task holding part of a GPU: how its agent shares that GPU.
    gpu_sharing: GpuSharing | None = None
    reason: Reason = ""  # cut to shapes.REASON characters
    last_lines: Lines = Field(default_factory=list)  # the last shapes.LINES, each cut to shapes.LINE
    at: AwareDatetime = Field(default_factory=now)


class MetricPoint(BaseModel):
    """One value of a training metric a task printed: when the agent read it, the step printed
    on the same line (if any), the metric's name and its value."""

    t: AwareDatetime
    step: Step | None = None
    name: MetricName
    value: float = Field(allow_inf_nan=False)


class MetricBatch(Message):
    """Agent -> MUSTER_METRICS, on `muster.metrics.<job>.<attempt>.<role>.<index>.<node>`: the
    metric points one task printed since the last batch (oldest first; `dropped`: points thinned
    out because it printed faster than kept), the latest point of every metric so far, and when
    it last printed anything (hang detection's clock)."""

    job_id: JobId
    attempt: Attempt
    role: Role
    index: Index
    node: Name
    points: list[MetricPoint] = Field(default_factory=list, max_length=4000)
    latest: list[MetricPoint] = Field(default_factory=list, max_length=64)
    dropped: Count = 0
    last_output_at: AwareDatetime | None = None
    at: AwareDatetime = Field(default_factory=now)


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
    role: Role
    role_no: RoleNo
    index: Index
    node: Name
    gpus: list[GpuIndex] = Field(default_factory=list, max_length=MAX_NODE_GPUS)
    # A task holding part of one GPU: its share of gpus[0] in thousandths (TaskSpec.gpu_milli),
    # and, once it runs, how its node shares that GPU (its agent's RUNNING report).
    gpu_milli: int | None = Field(default=None, ge=1, lt=1000)
    gpu_sharing: GpuSharing | None = None
    state: TaskState = TaskState.PLACED
    # An elastic role's task: when it joined a running attempt (else the attempt's placed_at),
    # and whether the scheduler removed it (shrinking the role): it holds its node until its
    # agent reports it stopped, but is no longer part of the gang.
    placed_at: AwareDatetime | None = None
    removed: bool = False
    host: Address | None = None
    port: Port | None = None
    cause: TaskCause | None = None
    exit_code: ExitCode | None = None
    reason: str = ""  # (free text in records: see muster.shared.shapes)
    last_lines: list[str] = Field(default_factory=list)
    started_at: AwareDatetime | None = None
    ended_at: AwareDatetime | None = None

    @property
    def key(self) -> str:
        return f"{self.role}.{self.index}"

    def spec(self) -> TaskSpec:
        return TaskSpec(
            role=self.role,
            role_no=self.role_no,
            index=self.index,
            node=self.node,
            gpus=self.gpus,
            gpu_milli=self.gpu_milli,
        )

    @classmethod
    def placed(cls, spec: TaskSpec, **more: Any) -> TaskStatus:
        """A task just placed where `spec` says."""
        return cls(
            role=spec.role,
            role_no=spec.role_no,
            index=spec.index,
            node=spec.node,
            gpus=spec.gpus,
            gpu_milli=spec.gpu_milli,
            **more,
        )


class FailureKind(StrEnum):
    USER = "user"  # the command exited non-zero, or ran out of memory
    PLATFORM = "platform"  # node lost, image pull failed, could not start, killed by the platform
    CONFIG = "config"  # the job cannot start anywhere as configured: not retried


class Failure(BaseModel):
    """What failed an attempt, and the evidence: the first failed task's node, exit code, output."""

    kind: FailureKind
    task: TaskKey
    node: Name
    cause: TaskCause | None = None
    exit_code: ExitCode | None = None
    reason: str = ""
    last_lines: list[str] = Field(default_factory=list)


def attempt_key(job_id: str, attempt: int) -> str:
    """The key of an attempt record (bucket `muster_attempts`) and of its rendezvous."""
    return f"{job_id}.{attempt}"


class AttemptRecord(Message):
    """One attempt of a job: KV bucket `muster_attempts`, key `<job_id>.<attempt>`. Created by the
    scheduler when it places the gang (the key's creation is the fence against placing it twice);
    the supervisor then moves the job record to it, and keeps its task states."""

    job_id: JobId
    attempt: Attempt
    tasks: list[TaskStatus] = Field(max_length=MAX_GANG)
    placed_at: AwareDatetime = Field(default_factory=now)
    ended_at: AwareDatetime | None = None
    outcome: JobState | None = None
    rule: str = ""  # which rule ended it
    failure: Failure | None = None  # why it failed, with the evidence
    charged: bool | None = None  # whether a retry after it was charged to retryCount
    borrowed: bool = False  # placed beyond its virtual cluster's quota: reclaimed first
    elastic: list[Role] = Field(default_factory=list, max_length=MAX_ROLES)  # roles that grow and shrink
    resized_at: AwareDatetime | None = None  # the last time an elastic role grew or shrank
    preempted_by: JobId | None = None  # the job it was stopped for (then not charged, re-queued)

    @property
    def key(self) -> str:
        return attempt_key(self.job_id, self.attempt)

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    @property
    def finished_work(self) -> bool:
        """Whether a task of it has ended and was not removed (an elastic role's shrink):
        stopping the attempt now would run that task again, so it is never stopped for another
        job (lending, preemption)."""
        return any(t.state.ended and not t.removed for t in self.tasks)

    def deadline(self, limit_s: int | None) -> datetime | None:
        """When it runs past a time limit of `limit_s` seconds (the job's maxRunTimeSec): that
        long after its first task started. None without a limit, before any task started, or
        once it ended."""
        if limit_s is None or self.ended:
            return None
        started = [t.started_at for t in self.tasks if t.started_at is not None]
        return min(started) + timedelta(seconds=limit_s) if started else None

    def members(self) -> list[TaskStatus]:
        """The gang now: every task of a fixed role; an elastic role's tasks not ended or removed."""
        return [t for t in self.tasks if t.role not in self.elastic or not (t.state.ended or t.removed)]

    def counts(self) -> dict[str, int]:
        """Each role's number of members (`JobConfig.sized` takes it)."""
        out: dict[str, int] = {}
        for t in self.members():
            out[t.role] = out.get(t.role, 0) + 1
        return out

    def task(self, role: str, index: int) -> TaskStatus:
        return next(t for t in self.tasks if t.role == role and t.index == index)


class KillOrder(Command):
    """Supervisor/CLI -> agent, on `muster.node.<node>.kill`: stop every task of this attempt
    (SIGTERM, then SIGKILL after `grace` seconds)."""

    job_id: JobId
    attempt: Attempt
    reason: Reason
    grace: Grace = 10.0
    # only these ("<role>.<index>"); empty: every one
    tasks: list[TaskKey] = Field(default_factory=list, max_length=MAX_GANG)

    @property
    def key(self) -> str:
        return attempt_key(self.job_id, self.attempt)


class MembersChanged(Message):
    """Scheduler/supervisor -> registry, on `muster.events.attempt.<job>.<attempt>.members`: an
    elastic attempt's gang changed without a new endpoint. It carries nothing the registry
    believes: the registry reads the attempt record the subject names."""


class DrainOrder(Command):
    """Operator -> agent, on `muster.node.<node>.drain`: stop every task on the node on purpose
    (they end as stopped by the platform, so their jobs are retried elsewhere, uncharged) and
    take no new work until `undo` or the agent restarts."""

    node: Name  # the agent of another node refuses it
    undo: bool = False
    grace: Grace = 10.0
    by: Name = "operator"
    at: AwareDatetime = Field(default_factory=now)

    @property
    def key(self) -> str:
        return f"drain.{self.node}"


class KillRequest(Command):
    """A user's request to stop a job, on `muster.job.kill.<user>` (stream MUSTER_SUBMISSIONS)."""

    job_id: JobId
    user: Name = "anonymous"
    grace: Grace = 10.0
    at: AwareDatetime = Field(default_factory=now)


MAX_USERS = 10_000  # names a virtual cluster or dataset record may list


class Quota(BaseModel):
    """What a virtual cluster is guaranteed: GPUs per model (a model it does not name: none),
    CPUs and memory (None: not limited by this VC's quota)."""

    model_config = ConfigDict(extra="forbid")

    gpus: dict[
        Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")], Annotated[int, Field(ge=0)]
    ] = Field(default_factory=dict)
    cpus: int | None = Field(default=None, ge=0)
    memory_mb: int | None = Field(default=None, ge=0)


class VirtualCluster(Message):
    """A virtual cluster as the operator configured it: KV bucket `muster_vcs`, key = its name
    (`muster admin vc set`). A job names its VC (`virtualCluster`, OpenPAI's field). `default`
    exists without a record: every user may use it, and its quota is what the configured VCs
    leave of the cluster."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")]
    quota: Quota = Field(default_factory=Quota)
    # who may submit to it; "*": everyone
    users: list[Name | Literal["*"]] = Field(default_factory=lambda: ["*"], max_length=MAX_USERS)
    max_priority: Priority = "high"  # the highest priority its jobs may ask for
    borrow: bool = True  # its jobs may run on idle capacity beyond the quota (reclaimed first)

    def admits(self, user: str) -> bool:
        return "*" in self.users or user in self.users


def vc_refusal(key: str, vc: VirtualCluster) -> str | None:
    """A VC record is believed only under its own name (the key is the name a job gives)."""
    return None if vc.name == key else f"stored under {key!r} but names {vc.name!r}"


DATASET_VOLUME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"  # a Docker named volume


class Dataset(Message):
    """A dataset jobs may mount (`"data": ["<name>:/path"]`) as an operator defined it: KV
    bucket `muster_datasets`, key = its name (`muster admin dataset set`). `source` is a host
    directory (absolute; on each node it must lie under that agent's data roots) or a Docker
    named volume. Mounted read-only unless the job asks `:rw` and `writable` allows it."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")]
    source: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    writable: bool = False
    # who may mount it; "*": everyone
    users: list[Name | Literal["*"]] = Field(default_factory=lambda: ["*"], max_length=MAX_USERS)
    description: Annotated[str, StringConstraints(max_length=500)] = ""

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if v.startswith("/"):
            if "\x00" in v or ".." in v.split("/") or v.rstrip("/") == "":
                raise ValueError("a host directory must be absolute, without '..', and not '/'")
            return v
        if not re.fullmatch(DATASET_VOLUME_RE, v):
            raise ValueError("must be an absolute host directory or a Docker volume name")
        return v

    @property
    def volume(self) -> bool:
        """Whether `source` names a Docker volume (else it is a host directory)."""
        return not self.source.startswith("/")

    def admits(self, user: str) -> bool:
        return "*" in self.users or user in self.users


def dataset_refusal(key: str, ds: Dataset) -> str | None:
    """A dataset record is believed only under its own name (the key is the name a job gives)."""
    return None if ds.name == key else f"stored under {key!r} but names {ds.name!r}"


class Question(Message):
    """A user's question to the gateway, on `muster.api.<user>.<verb>` (request/reply): which
    fields matter depends on the verb (jobs: state, user, vc, name, since, until, cursor, limit,
    changed_since; job: ref; verdict: sid; logs: job_id, attempt, task, after, limit; nodes:
    cursor, limit). The answer is JSON: the
    result, or {"error", "code"}."""

    model_config = ConfigDict(extra="forbid")

    ref: str | None = Field(default=None, max_length=128)  # a job id or name
    sid: str | None = Field(default=None, max_length=64)  # a submission id
    job_id: str | None = Field(default=None, max_length=128)
    attempt: int | None = Field(default=None, ge=1)
    task: str | None = Field(default=None, max_length=140)  # ROLE or ROLE.INDEX
    # A MUSTER_LOGS (MUSTER_METRICS for metrics) stream sequence: the server's are below 2**63.
    after: int = Field(default=0, ge=0, lt=2**63)
    limit: int = Field(default=1000, ge=1, le=10000)  # jobs: default 100, at most 1000 a page
    # jobs: which ones (every one given must hold), and where the last page ended (its `next`).
    state: list[JobState] | None = Field(default=None, min_length=1, max_length=len(JobState))
    user: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
    vc: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
    name: str | None = Field(default=None, min_length=1, max_length=128)  # part of the job's name
    since: AwareDatetime | None = None  # submitted at or after
    until: AwareDatetime | None = None  # submitted before
    cursor: str | None = Field(default=None, max_length=160, pattern=r"^\d{1,19}\.[-/_=.a-zA-Z0-9]{1,128}$")
    # jobs: instead of a page, the jobs whose record the gateway saw written at or after this
    # time (pass back the last answer's `now`), most recently changed first.
    changed_since: AwareDatetime | None = None

    @model_validator(mode="after")
    def _span(self) -> Self:
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ValueError(
                f"since ({self.since.isoformat()}) must be before until ({self.until.isoformat()})"
            )
        return self


QUEUE_SHOWN = 2000  # job ids a QueueOrder names at most: the head of the queue


class QueueOrder(Message):
    """The scheduler leader's waiting queue, on core NATS `muster.queue` (never kept): after each
    cycle that changed it, and at least every few seconds while it leads. `jobs`: the first
    QUEUE_SHOWN waiting jobs in the order the cycle considered them (sharing order with virtual
    clusters, else by priority and then least-attained order), those it placed left out; `total`: every job
    still waiting after the cycle. Jobs held back by a quota their VC may not exceed, or in a
    retry's backoff, are counted in `total` but have no place in `jobs` (their reason says why)."""

    at: AwareDatetime
    total: Count
    jobs: list[JobId] = Field(default_factory=list, max_length=QUEUE_SHOWN)


EXEC_SESSION_RE = r"^[A-Za-z0-9_-]{1,64}$"
MAX_EXEC_COMMAND = 64 * 1024  # characters of an orted command line
MAX_EXEC_CHUNK = 32 * 1024  # characters of output in one ExecReply


class ExecRequest(Command):
    """An agent asks a peer's agent (`muster.exec.req.<peer>.<sender>`) to run `command` in task
    role.index of an MPI attempt, for that attempt's launcher on the sending node (`open`), or to
    stop what it runs for `session` (`cancel`). The peer checks it all against its own tasks and
    the attempt's cluster spec: the subject's sender must be the launcher's node."""

    kind: Literal["open", "cancel"]
    session: Annotated[str, StringConstraints(pattern=EXEC_SESSION_RE)]
    job_id: JobId | Literal[""] = ""  # (a cancel names only the session)
    attempt: AttemptOrNone = 0
    role: Role | Literal[""] = ""
    index: Index = 0
    command: str = Field(default="", max_length=MAX_EXEC_COMMAND)


class ExecReply(Message):
    """What a peer's agent says of a session (`muster.exec.out.<caller>.<peer>`): `started`, a
    chunk of output (`out`), `alive` (every few seconds while it runs), `exit` with the exit
    code, or `error` when it was refused or could not start (the reason in `error`)."""

    kind: Literal["started", "out", "alive", "exit", "error"]
    session: Annotated[str, StringConstraints(pattern=EXEC_SESSION_RE)]
    data: str = Field(default="", max_length=MAX_EXEC_CHUNK)
    code: ExitCode = 0
    error: str = Field(default="", max_length=1024)
