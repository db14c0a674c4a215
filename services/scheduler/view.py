"""The scheduler's view, kept up to date from records as they change: a pure core (records in,
no I/O). It holds the records the KV watchers mirror (nodes, jobs, attempts) and, derived from
them change by change rather than rebuilt each cycle:
- the schedulable nodes with what their placed tasks use, indexed for placement
  (`placement.Cluster`), and the same nodes as if empty (`placement.Capacity`);
- the jobs waiting, in queue order (submission time, then job id);
- the attempts that failed for platform reasons, from which nodes to avoid are worked out.

Each `*_changed` says whether the change could change a plan: a heartbeat that only moves the
clock, a reason the scheduler wrote itself, or a task event that frees nothing wakes nothing.
A node whose placed tasks do not add up (more GPUs or CPUs held than it has: records that
disagree) is kept out of placement and named in `inconsistent` until they do."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import structlog
from pydantic import AwareDatetime, BaseModel, ConfigDict

from muster.services.scheduler import attained, placement, quota
from muster.services.scheduler.avoid import AVOID_WINDOW
from muster.shared.jobconfig import WHOLE_GPU, JobConfig, rank
from muster.shared.lifecycle import attempt_to_place
from muster.shared.liveness import Beats
from muster.shared.messages import (
    WAITING_FOR_SCHEDULER,
    AttemptRecord,
    FailureKind,
    JobRecord,
    JobState,
    NodeInfo,
    attempt_key,
)
from muster.shared.shapes import AttemptOrNone, JobId

log = structlog.get_logger(service="scheduler")


@dataclass(frozen=True)
class Use:
    """What one placed, not yet ended task holds on its node."""

    node: str
    cpus: int
    memory_mb: int
    gpus: tuple[int, ...]
    milli: int = WHOLE_GPU  # its share of its one GPU, for a task that shares one


@dataclass(slots=True)
class Job:
    """What the scheduler keeps of a job record: what placing it and its reasons read. A decoded
    `JobRecord` holds about 1.7 KB beyond its config (a dict and a set of fields per instance,
    its digest, ids and times); this holds about a quarter of that, for every job in the queue."""

    job_id: str
    job_name: str
    user: str
    config: JobConfig
    state: JobState
    attempt: int
    settled: int
    not_before: datetime | None
    submitted_at: datetime
    reason: str
    unschedulable: bool

    @classmethod
    def of(cls, r: JobRecord) -> Job:
        return cls(
            r.job_id,
            r.job_name,
            r.user,
            r.config,
            r.state,
            r.attempt,
            r.settled,
            r.not_before,
            r.submitted_at,
            r.reason,
            r.unschedulable,
        )

    def refresh(self, data: bytes) -> Job:
        """This job as a newer write of its record says (`Store.mirror`'s refresh): only what
        changes is decoded; ValueError for bytes that are not a record of this job."""
        head = JobHead.model_validate_json(data)
        if head.job_id != self.job_id:
            raise ValueError(f"a record of {head.job_id} under {self.job_id}")
        return Job(
            self.job_id,
            self.job_name,
            self.user,
            self.config,
            head.state,
            head.attempt,
            head.settled,
            head.not_before,
            self.submitted_at,
            head.reason,
            head.unschedulable,
        )


class JobHead(BaseModel):
    """What changes in a job record once it is created: all `Job.refresh` decodes of a write to
    a job the scheduler holds already (its config, a third of a record's decode, never changes)."""

    model_config = ConfigDict(extra="ignore")

    job_id: JobId
    state: JobState
    attempt: AttemptOrNone = 0
    settled: AttemptOrNone = 0
    not_before: AwareDatetime | None = None
    reason: str = WAITING_FOR_SCHEDULER
    unschedulable: bool = False


def job_of(key: str) -> str:
    """The job id of an attempt key (`<job_id>.<attempt>`)."""
    return key.rsplit(".", 1)[0]


class View:
    def __init__(self, node_timeout: float) -> None:
        self.node_timeout = timedelta(seconds=node_timeout)
        # The records, as the watchers mirror them (the service writes its own changes in too).
        self.nodes: dict[str, NodeInfo] = {}
        self.jobs: dict[str, Job] = {}  # mirrored with keep=Job.of
        self.attempts: dict[str, AttemptRecord] = {}
        # Derived.
        self.cluster = placement.Cluster()
        self.capacity = placement.Capacity()
        self.inconsistent: dict[str, str] = {}  # node -> why its tasks do not add up
        self.failed: dict[str, AttemptRecord] = {}  # attempts ended by a platform failure, recent
        self._shape: dict[str, tuple[Any, ...]] = {}  # schedulable node -> its capacity
        self._held: dict[str, dict[str, Use]] = {}  # attempt key -> task key -> use
        self._on: dict[str, dict[tuple[str, str], Use]] = {}  # node -> (attempt, task) -> use
        self._attempts_of: dict[str, set[str]] = {}  # job id -> its attempt keys
        # attempt key -> (GPUs its tasks hold, placed, ended or None), in seconds: what it has run
        self._runs: dict[str, tuple[float, float, float | None]] = {}
        self._known: set[str] = set()  # job ids with a record
        self._waiting: list[tuple[datetime, str]] = []  # (submitted_at, job id), sorted
        self._queued: dict[str, tuple[datetime, str]] = {}  # job id -> its entry in _waiting
        self._policy: dict[str, tuple[Any, ...]] = {}  # waiting job -> what attempt_to_place reads
        self._due: list[tuple[datetime, str]] = []  # heap: (not_before, job id) of backoffs
        # Each node's last sign of life (its record's heartbeat_at, or a beat heard on the bus),
        # and which have gone quiet (shared/liveness.py).
        self.beats = Beats(node_timeout)
        self.ranked: set[str] = set()  # jobs not ended whose priority is not normal
        self.elastic: set[str] = set()  # attempts not ended with elastic roles
        self.stopping: set[str] = set()  # attempts ended or preempted whose tasks still hold

    # -------------------------------------------------------- nodes

    def _schedulable(self, info: NodeInfo | None, at: datetime) -> bool:
        return (
            info is not None
            and self.beats.alive(info.node, at)
            and info.restarting_until is None
            and not info.drained
        )

    def node_changed(self, name: str, at: datetime) -> bool:
        info = self.nodes.get(name)
        if info is not None:
            self.beats.saw(name, info.heartbeat_at)
        else:
            self.beats.forget(name)  # pruned: nothing kept of it
        if info is None or not self._schedulable(info, at):
            return self._drop(name)
        shape = (info.cpus, info.memory_mb, tuple((d.index, d.model) for d in info.gpus))
        if self._shape.get(name) == shape:
            return False  # a heartbeat: nothing a plan reads has changed
        self._shape[name] = shape
        self.capacity.add(placement.NodeState.from_info(info))
        self._rebuild(name)
        return True

    def node_beat(self, name: str, at: datetime) -> bool:
        """A beat heard from `name` at `at`: whether it brought a quiet node back (a plan may
        change). A beat of a node already schedulable costs a dict write."""
        if not self.beats.saw(name, at) or name not in self.nodes:
            return False
        return self.node_changed(name, at)

    def _heard(self, name: str, at: datetime) -> bool:
        """Whether `name` beat within half the node timeout: its agent is up, so what its tasks
        did (a task's end) is on its way, not held until the agent comes back."""
        last = self.beats.last.get(name)
        return last is not None and at - last <= self.node_timeout / 2

    def last_beat(self, name: str) -> datetime | None:
        """The node's last sign of life: its last beat, or its record's heartbeat_at."""
        return self.beats.last.get(name)

    def _drop(self, name: str) -> bool:
        if name not in self._shape:
            return False
        del self._shape[name]
        self.cluster.remove(name)
        self.capacity.remove(name)
        self.inconsistent.pop(name, None)
        return True

    def _rebuild(self, name: str) -> None:
        """The node as its record declares it, less what its placed tasks hold."""
        state = placement.NodeState.from_info(self.nodes[name])
        try:
            for use in self._on.get(name, {}).values():
                state.use(use.cpus, use.memory_mb, use.gpus, use.milli)
        except ValueError as exc:
            # Never place on top of a view that does not add up: say so loudly, keep it out.
            if self.inconsistent.get(name) != str(exc):
                log.error("scheduler.inconsistent_view", node=name, error=str(exc))
            self.inconsistent[name] = str(exc)
            self.cluster.remove(name)
            return
        self.inconsistent.pop(name, None)
        self.cluster.add(state)

    def expire(self, at: datetime) -> bool:
        """Time passed: nodes whose heartbeat is now too old leave; backoffs that end wake a plan.
        Costs what has expired since the last call, not a pass over the nodes (it runs before
        every cycle)."""
        changed = False
        for name in self.beats.quiet(at):
            changed |= self._drop(name)
        while self._due and self._due[0][0] <= at:
            _, job_id = heapq.heappop(self._due)
            changed |= job_id in self._queued
        return changed

    # -------------------------------------------------------- attempts

    def attempt_changed(self, key: str) -> bool:
        record = self.attempts.get(key)
        job_id = record.job_id if record is not None else job_of(key)
        if record is not None:
            self._attempts_of.setdefault(job_id, set()).add(key)
            gpus = sum(t.gpu_milli / WHOLE_GPU if t.gpu_milli else len(t.gpus) for t in record.tasks)
            ended = record.ended_at.timestamp() if record.ended_at is not None else None
            self._runs[key] = (gpus, record.placed_at.timestamp(), ended)
        else:
            held = self._attempts_of.get(job_id)
            if held is not None:
                held.discard(key)
                if not held:  # its job's last attempt pruned: nothing kept of it
                    del self._attempts_of[job_id]
            self._runs.pop(key, None)
        if record is not None and record.elastic and not record.ended:
            self.elastic.add(key)
        else:
            self.elastic.discard(key)
        if record is not None and record.failure and record.failure.kind == FailureKind.PLATFORM:
            self.failed[key] = record
        else:
            self.failed.pop(key, None)
        freed = self._hold(key, record)
        if record is not None:
            self._slim_past(job_id)
        # A waiting job's next attempt may go once its current one has ended with all its tasks.
        ended = record is None or record.ended or all(t.state.ended for t in record.tasks)
        return freed or (job_id in self._queued and ended)

    def _slim_past(self, job_id: str) -> None:
        """Hold a job's past attempts without their tasks: a settled attempt (ended, every task
        ended) that is not the job's newest is read for its number alone, what it ran being in
        `_runs` and a platform failure in `failed`. A job retried, preempted or called back again
        and again kept each attempt whole, its tasks' last lines with them, until a week after it
        ended (a 2,000-task gang: MBs per attempt)."""
        keys = self._attempts_of.get(job_id, ())
        if len(keys) < 2:
            return
        newest = max(a.attempt for k in keys if (a := self.attempts.get(k)) is not None)
        for k in keys:
            a = self.attempts.get(k)
            if (
                a is not None
                and a.attempt < newest
                and a.tasks
                and a.ended
                and all(t.state.ended for t in a.tasks)
            ):
                self.attempts[k] = a.model_copy(update={"tasks": []})

    def _hold(self, key: str, record: AttemptRecord | None) -> bool:
        """Bring what the attempt's live tasks hold up to date; whether a schedulable node's
        free resources changed."""
        job = self.jobs.get(record.job_id) if record is not None else None
        new: dict[str, Use] = {}
        if record is not None and job is not None:
            roles = job.config.taskRoles
            for t in record.tasks:
                if not t.state.ended and 0 <= t.role_no < len(roles):
                    role = roles[t.role_no]
                    new[t.key] = Use(t.node, role.cpuNumber, role.memoryMB, tuple(t.gpus), role.gpu_milli)
        old = self._held.pop(key, {})
        if new:
            self._held[key] = new
        if new and record is not None and (record.ended or record.preempted_by is not None):
            self.stopping.add(key)
        else:
            self.stopping.discard(key)
        touched: dict[str, tuple[list[Use], list[Use]]] = {}  # node -> (uses freed, uses taken)
        for task, use in old.items():
            if new.get(task) != use:
                self._on[use.node].pop((key, task), None)
                touched.setdefault(use.node, ([], []))[0].append(use)
        for task, use in new.items():
            if old.get(task) != use:
                self._on.setdefault(use.node, {})[(key, task)] = use
                touched.setdefault(use.node, ([], []))[1].append(use)
        moved = False
        for node, (freed, taken) in touched.items():
            if not self._on.get(node):
                self._on.pop(node, None)
            if node in self._shape:
                self._account(node, freed, taken)
                moved = True
        return moved

    def _account(self, name: str, freed: list[Use], taken: list[Use]) -> None:
        """Give back and take what changed on a schedulable node, through the index. A node kept
        out (its tasks did not add up) or a change that does not add up is rebuilt from its
        record and all its tasks instead (`_rebuild` says why it does not add up)."""
        if name not in self.cluster.nodes:
            self._rebuild(name)
            return
        try:
            for use in freed:
                self.cluster.give(name, use.cpus, use.memory_mb, use.gpus, use.milli)
            for use in taken:
                self.cluster.take(name, use.cpus, use.memory_mb, use.gpus, use.milli)
        except ValueError:
            self._rebuild(name)

    def avoid_candidates(self, at: datetime) -> Iterable[AttemptRecord]:
        """The recent platform failures (older ones are forgotten), for `nodes_to_avoid`."""
        since = at - timedelta(seconds=AVOID_WINDOW)
        for key in [k for k, a in self.failed.items() if a.ended_at is not None and a.ended_at < since]:
            del self.failed[key]
        return self.failed.values()

    # -------------------------------------------------------- jobs

    def job_changed(self, job_id: str) -> bool:
        job = self.jobs.get(job_id)
        changed = False
        if job is not None and not job.state.final and job.config.priority != "normal":
            self.ranked.add(job_id)
        else:
            self.ranked.discard(job_id)
        if (job is not None) != (job_id in self._known):
            # A job's record arrived (or went): what its attempts hold can be counted now.
            if job is None:
                self._known.discard(job_id)
            else:
                self._known.add(job_id)
            for key in list(self._attempts_of.get(job_id, ())):
                changed |= self._hold(key, self.attempts.get(key))
        if job is None or job.state != JobState.WAITING:
            return self._unqueue(job_id) or changed
        entry = (job.submitted_at, job_id)
        if self._queued.get(job_id) != entry:
            self._unqueue(job_id)
            self._queued[job_id] = entry
            bisect.insort(self._waiting, entry)
            changed = True
        policy = (job.attempt, job.settled, job.not_before)
        if self._policy.get(job_id) != policy:
            self._policy[job_id] = policy
            if job.not_before is not None:
                heapq.heappush(self._due, (job.not_before, job_id))
            changed = True
        return changed

    def _unqueue(self, job_id: str) -> bool:
        entry = self._queued.pop(job_id, None)
        self._policy.pop(job_id, None)
        if entry is None:
            return False
        i = bisect.bisect_left(self._waiting, entry)
        if i < len(self._waiting) and self._waiting[i] == entry:
            del self._waiting[i]
        return True

    def queue(self, at: datetime) -> list[tuple[Job, int]]:
        """Jobs to place now, in queue order, with the number of the attempt to place (the
        supervisor policy's rule)."""
        out = []
        for _, job_id in self._waiting:
            job = self.jobs[job_id]
            current = self.current(job)
            n = attempt_to_place(job, self.attempts.get(attempt_key(job_id, current)), at, current)
            if n is not None:
                out.append((job, n))
        return out

    def current(self, job: Job) -> int:
        """The job's current attempt (0: none yet): the one its record names, or a newer one
        with an attempt record, until the supervisor moves the job to it."""
        keys = self._attempts_of.get(job.job_id, ())
        return max([job.attempt, *(a.attempt for k in keys if (a := self.attempts.get(k)) is not None)])

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # -------------------------------------------------------- least attained service (attained.py)

    def service(self, job_id: str, at: float) -> attained.Service:
        """What the job's attempts have run until `at` (seconds since the epoch), from their
        records: a new leader reads the same."""
        gpu_s = ran = longest = 0.0
        for key in self._attempts_of.get(job_id, ()):
            run = self._runs.get(key)
            if run is None:
                continue
            gpus, placed, ended = run
            wall = max(0.0, (at if ended is None else ended) - placed)
            gpu_s += gpus * wall
            ran += wall
            longest = max(longest, wall)
        return attained.Service(gpu_s, ran, longest)

    def seen(self, at: float, most: int) -> list[attained.Seen]:
        """The newest `most` jobs with a record, as the FIFO shadow replays them: those not ended,
        and ended ones that ran (one cancelled while it waited would have left FIFO's queue then,
        not blocked it until it fitted)."""
        jobs = (j for j in self.jobs.values() if not j.state.final or self._attempts_of.get(j.job_id))
        newest = heapq.nlargest(most, jobs, key=lambda j: (j.submitted_at, j.job_id))
        return [
            attained.Seen(
                j.job_id,
                j.submitted_at.timestamp(),
                self.service(j.job_id, at).run_s(j.config.resumable),
                j.config.smallest(),
            )
            for j in newest
        ]

    # -------------------------------------------------------- sharing (services/scheduler/quota.py)

    def model_of(self, node: str, index: int) -> str | None:
        info = self.nodes.get(node)
        return next((d.model for d in info.gpus if d.index == index), None) if info else None

    def running(self, at: datetime) -> list[quota.Running]:
        """Every attempt with live tasks, as preemption and quotas see it. An attempt already
        being stopped (preempted) still holds what it holds, but is no one's victim again."""
        out = []
        for key, uses in self._held.items():
            record = self.attempts.get(key)
            job = self.jobs.get(record.job_id) if record is not None else None
            if record is None or job is None:
                continue
            live = [t for t in record.tasks if t.key in uses]
            tasks = [t.spec() for t in live if t.node in self.cluster.nodes]
            lost = sum(
                max(0.0, (at - (t.started_at or record.placed_at)).total_seconds()) * max(1, len(t.gpus))
                for t in live
            )
            out.append(
                quota.Running(
                    job_id=job.job_id,
                    key=key,
                    vc=job.config.virtualCluster,
                    user=job.user,
                    rank=rank(job.config.priority),
                    config=job.config,
                    tasks=tasks,
                    use=quota.held(job.config, (t.spec() for t in live), self.model_of),
                    borrowed=record.borrowed,
                    lost=lost,
                    stopping=record.preempted_by is not None or record.ended,
                    preempted_by=record.preempted_by,
                    finished=record.finished_work or any(not self._heard(t.node, at) for t in live),
                    ends_soon=(end := record.deadline(job.config.maxRunTimeSec)) is not None
                    and end <= at + timedelta(seconds=quota.PREEMPT_GRACE),
                )
            )
        return out
