"""Completion and retry policy, a pure core.

`decide`: given a job config and the states of an attempt's tasks, has the attempt ended, how,
and by which rule? `classify`: what failed it (user, platform or configuration, with the
evidence; read from each task's typed cause). `next_step`: after an ended attempt, does the job
end or run again, and is that retry charged to retryCount? (Whether the scheduler may place the
job's next attempt now, `attempt_to_place`, is shared/lifecycle.py: both services read it.)

Rules, in the order they are checked after each task state change (OpenPAI v1 semantics):
1. killAllOnCompletedTaskNumber N > 0: N tasks succeeded -> SUCCEEDED, kill the rest.
2. A role's minFailedTaskCount (default 1): that many of its tasks failed -> FAILED, kill the rest.
3. A role's minSucceededTaskCount (default: unset): that many of its tasks succeeded ->
   SUCCEEDED, kill the rest. An MPI job (`extras.mpi`, shared/mpi.py): its launcher task
   succeeded -> SUCCEEDED, kill the rest (the workers only host ranks, they never end by
   themselves).
4. Every task ended and no rule above fired -> SUCCEEDED (every task succeeded, or failures
   stayed below every role's threshold).
And on the clock (`timed_out`): an attempt still running maxRunTimeSec after its first task
started -> FAILED as the user's, kill the rest.
A task stopped by the platform counts as failed unless the attempt had already ended.

An elastic role (minTaskNumber/maxTaskNumber) is not one fixed gang: a task the scheduler removed
(shrinking it) does not count at all, and its failed tasks fail the attempt only once fewer than
minTaskNumber of its tasks are running or succeeded (rule 2); until then the scheduler replaces
them (EDL's fault tolerance).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import NamedTuple

from muster.shared import mpi, subjects
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import (
    AttemptRecord,
    Failure,
    FailureKind,
    JobRecord,
    JobState,
    NodeInfo,
    TaskCause,
    TaskEvent,
    TaskEventKind,
    TaskState,
    TaskStatus,
)


@dataclass(frozen=True)
class Decision:
    outcome: JobState | None  # None: the attempt goes on
    rule: str = ""
    kill_rest: bool = False


GOES_ON = Decision(outcome=None)


def decide(config: JobConfig, tasks: list[TaskStatus]) -> Decision:
    return Tally(config, tasks).decide()


FAILED_STATES = (TaskState.FAILED, TaskState.STOPPED)


class Tally:
    """What `decide` reads of an attempt's tasks, counted once (O(tasks)) and then kept up to date
    task by task (`change`, O(1)), so that deciding after each of a gang's N events costs O(N)
    in all, not O(N) each."""

    def __init__(self, config: JobConfig, tasks: list[TaskStatus]) -> None:
        self.config, self.tasks = config, tasks
        self.shape = mpi.shape(config)
        self.succeeded: dict[str, int] = {}  # per role
        self.failed: dict[str, list[int]] = {}  # per role: positions in `tasks` of failed ones
        self.going: dict[str, int] = {}  # per role: neither failed nor stopped
        self.ended = self.counted = self.launchers = 0
        for i, t in enumerate(tasks):
            self._count(t, i, 1)

    def _count(self, t: TaskStatus, i: int, sign: int) -> None:
        if t.removed:
            return
        self.counted += sign
        if t.state.ended:
            self.ended += sign
        if t.state == TaskState.SUCCEEDED:
            self.succeeded[t.role] = self.succeeded.get(t.role, 0) + sign
            if self.shape is not None and self.shape.is_launcher(t.role, t.index):
                self.launchers += sign
        if t.state in FAILED_STATES:
            positions = self.failed.setdefault(t.role, [])
            if sign > 0:
                positions.append(i)
            else:
                positions.remove(i)
        else:
            self.going[t.role] = self.going.get(t.role, 0) + sign

    def change(self, i: int, update: dict[str, object]) -> None:
        """Replace task `i` by a copy with `update` (fields), keeping the counts. The task given
        is not changed (it may be a shared, cached record's)."""
        self._count(self.tasks[i], i, -1)
        self.tasks[i] = self.tasks[i].model_copy(update=update)
        self._count(self.tasks[i], i, 1)

    def decide(self) -> Decision:
        config = self.config
        n = config.killAllOnCompletedTaskNumber or 0
        done = sum(self.succeeded.values())
        if n > 0 and done >= n:
            return Decision(
                JobState.SUCCEEDED, f"killAllOnCompletedTaskNumber: {done} of {n} tasks completed", True
            )

        for role in config.taskRoles:
            threshold = role.minFailedTaskCount or 1
            failed = self.failed.get(role.name, [])
            if role.elastic and role.minTaskNumber and self.going.get(role.name, 0) >= role.minTaskNumber:
                continue  # enough left: the attempt goes on, the scheduler replaces what failed
            if len(failed) >= threshold:
                first = self.tasks[min(failed)]
                why = f"exit code {first.exit_code}" if first.exit_code not in (None, -1) else first.reason
                left = role.minTaskNumber
                rule = (
                    f"minTaskNumber: {len(failed)} of role {role.name} failed, fewer than {left} left"
                    if role.elastic
                    else f"minFailedTaskCount: {len(failed)} of role {role.name} failed (≥ {threshold})"
                )
                return Decision(JobState.FAILED, f"{rule}; {role.name}[{first.index}]: {why}", True)

        if self.shape is not None and self.launchers:
            return Decision(JobState.SUCCEEDED, f"MPI launcher {self.shape.launcher}[0] succeeded", True)

        for role in config.taskRoles:
            wanted = role.minSucceededTaskCount
            count = self.succeeded.get(role.name, 0)
            if wanted and count >= wanted:
                return Decision(
                    JobState.SUCCEEDED, f"minSucceededTaskCount: {count} of role {role.name} succeeded", True
                )

        if self.ended == self.counted:
            return Decision(JobState.SUCCEEDED, "all tasks ended", False)
        return GOES_ON


def task_state_for(cause: TaskCause | None, exit_code: int | None) -> TaskState:
    """How a task that exited is recorded: stopped by the platform, succeeded or failed."""
    if cause == TaskCause.KILLED:
        return TaskState.STOPPED
    if cause in (None, TaskCause.EXITED) and exit_code == 0:
        return TaskState.SUCCEEDED
    return TaskState.FAILED


# ------------------------------------------------------------------ failures and retries


FAILURE_KIND = {
    TaskCause.EXITED: FailureKind.USER,
    TaskCause.OOM: FailureKind.USER,
    TaskCause.CONFIG: FailureKind.CONFIG,
    TaskCause.KILLED: FailureKind.PLATFORM,
    TaskCause.NODE_LOST: FailureKind.PLATFORM,
    TaskCause.PLATFORM: FailureKind.PLATFORM,
}


def classify(tasks: list[TaskStatus]) -> Failure | None:
    """The failure behind an attempt: its first failed task (by end time), a user failure when
    its command exited non-zero or ran out of memory, a configuration failure when it can start
    nowhere as configured, a platform failure when it was lost, could not start, or was stopped
    by the platform while its attempt was still going."""
    failed = [t for t in tasks if t.state in (TaskState.FAILED, TaskState.STOPPED)]
    if not failed:
        return None
    first = min(failed, key=lambda t: (t.ended_at is None, t.ended_at, t.role_no, t.index))
    return Failure(
        kind=FAILURE_KIND.get(first.cause or TaskCause.EXITED, FailureKind.USER),
        task=first.key,
        node=first.node,
        cause=first.cause,
        exit_code=first.exit_code,
        reason=first.reason,
        last_lines=first.last_lines[-10:],
    )


@dataclass(frozen=True)
class RetryLimits:
    platform: int = 10  # platform failures retried without charging retryCount
    backoff: float = 1.0  # seconds before the second retry; doubles after each
    backoff_max: float = 60.0


@dataclass(frozen=True)
class NextStep:
    state: JobState  # WAITING: run another attempt; else the job's final state
    reason: str
    charged: bool = False  # the retry spends one of retryCount
    platform: bool = False  # the retry is a platform retry
    delay: float = 0.0  # seconds before the next attempt may be placed


def backoff(n: int, limits: RetryLimits) -> float:
    """Delay before retry number n+1 (n retries already made): 0, then base, 2·base, ... capped."""
    # The exponent is capped so an unlimited retryCount (-1, -2) never overflows a float.
    return 0.0 if n <= 0 else min(limits.backoff_max, limits.backoff * 2.0 ** min(n - 1, 1023))


def next_step(
    config: JobConfig,
    outcome: JobState,
    failure: Failure | None,
    retries: int,
    platform_retries: int,
    limits: RetryLimits = RetryLimits(),
) -> NextStep:
    """retryCount N >= 0: at most N retries of failed attempts; -1: retry failures without limit;
    -2: always restart, even after success, until killed. Platform failures are retried first
    from their own budget (`limits.platform`), uncharged, with backoff."""
    rc = config.retryCount
    if outcome == JobState.SUCCEEDED:
        if rc == -2:
            return NextStep(JobState.WAITING, "restarting: retryCount -2 restarts until killed", charged=True)
        return NextStep(JobState.SUCCEEDED, "succeeded")
    if outcome != JobState.FAILED:
        return NextStep(outcome, str(outcome).lower())
    what = _describe(failure)
    if failure is not None and failure.kind == FailureKind.CONFIG:
        return NextStep(
            JobState.FAILED, f"configuration error ({what}); it would fail on any node, not retried"
        )
    if failure is not None and failure.kind == FailureKind.PLATFORM and platform_retries < limits.platform:
        return NextStep(
            JobState.WAITING,
            f"platform failure ({what}); retry {platform_retries + 1} of {limits.platform}, "
            "not charged to retryCount",
            platform=True,
            delay=backoff(platform_retries + 1, limits),
        )
    if rc in (-1, -2) or retries < rc:
        budget = "without limit" if rc < 0 else f"{retries + 1} of {rc}"
        return NextStep(
            JobState.WAITING,
            f"failed ({what}); retry {budget}",
            charged=True,
            delay=backoff(retries, limits),
        )
    spent = "retryCount 0" if rc == 0 else f"all {rc} retries spent"
    return NextStep(JobState.FAILED, f"failed ({what}); {spent}")


def _describe(failure: Failure | None) -> str:
    if failure is None:
        return "no task failed"
    if failure.exit_code not in (None, -1) and not failure.reason:
        return f"{failure.task} on {failure.node} exited {failure.exit_code}"
    return f"{failure.task} on {failure.node}: {failure.reason or f'exit {failure.exit_code}'}"


# ------------------------------------------------------------------ applying facts to records


def event_refusal(
    ev: TaskEvent,
    subject: str,
    sender: str,
    attempt: AttemptRecord,
    tasks: dict[str, TaskStatus] | None = None,
) -> str | None:
    """Why a task event may not be applied, or None: it must name the task its subject names,
    and come from the node that task was placed on (or from the platform, PLATFORM, which only
    the supervisor may send as) — so no identity can end, or start, another node's task.
    `tasks`: the attempt's tasks by key, when the caller has them (no pass over the gang)."""
    expected = subjects.task_event(ev.job_id, ev.attempt, ev.role, ev.index, ev.kind, sender)
    if subject != expected:
        return f"payload does not match its subject (expected {expected})"
    if tasks is None:
        tasks = {t.key: t for t in attempt.tasks}
    task = tasks.get(f"{ev.role}.{ev.index}")
    if task is None:
        return f"attempt {attempt.key} has no task {ev.role}.{ev.index}"
    if sender != subjects.PLATFORM and sender != task.node:
        return f"sent by node {sender}, but {ev.role}.{ev.index} was placed on {task.node}"
    return None


def apply_task_event(config: JobConfig, attempt: AttemptRecord, ev: TaskEvent, at: datetime) -> bool:
    """Record a task's start or end on its attempt (in place: its fields and its list of tasks,
    where a changed task is a new TaskStatus, never the one given) and end the attempt when
    `decide` says so. Returns whether anything changed: a replayed or late event changes nothing."""
    return apply_task_events(config, attempt, [ev], at)[0]


def apply_task_events(
    config: JobConfig, attempt: AttemptRecord, events: list[TaskEvent], at: datetime
) -> list[bool]:
    """`apply_task_event` for each of `events` in turn (the events of one attempt that came
    together), deciding after each as if alone, in O(tasks + events) for all of them. Returns,
    for each event, whether it changed anything."""
    position = {(t.role, t.index): i for i, t in enumerate(attempt.tasks)}
    tally: Tally | None = None
    out = []
    for ev in events:
        i = position.get((ev.role, ev.index))
        task = attempt.tasks[i] if i is not None else None
        update: dict[str, object]
        if task is None:
            update = {}
        elif ev.kind == TaskEventKind.RUNNING:
            update = (
                {"state": TaskState.RUNNING, "started_at": ev.at} if task.state == TaskState.PLACED else {}
            )
            if update and ev.gpu_sharing is not None:  # how its node shares its GPU: shown with it
                update["gpu_sharing"] = ev.gpu_sharing
        elif task.state.ended:
            update = {}
        else:
            update = {
                "state": task_state_for(ev.cause, ev.exit_code),
                "cause": ev.cause,
                "exit_code": ev.exit_code,
                "reason": ev.reason,
                "last_lines": ev.last_lines,
                "ended_at": ev.at,
            }
        out.append(bool(update))
        if not update:
            continue
        assert i is not None
        if attempt.ended:  # the decision is made: the tally is not needed any more
            attempt.tasks[i] = attempt.tasks[i].model_copy(update=update)
            continue
        if tally is None:
            tally = Tally(config, attempt.tasks)
        tally.change(i, update)
        decision = tally.decide()
        if decision.outcome is not None:
            attempt.ended_at, attempt.outcome, attempt.rule = at, decision.outcome, decision.rule
            if decision.outcome == JobState.FAILED:
                attempt.failure = classify(attempt.tasks)
    if attempt.preempted_by is not None and any(out):
        own = own_end(config, attempt)
        if own is not None:  # it had ended of itself: not a preemption's to retry
            attempt.outcome, attempt.rule, attempt.preempted_by = own.outcome, own.rule, None
            attempt.failure = classify(attempt.tasks) if own.outcome == JobState.FAILED else None
    return out


def own_end(config: JobConfig, attempt: AttemptRecord) -> Decision | None:
    """What a preempted attempt's tasks decided of themselves, or None (it was stopped while it
    went on). The preemption is written on the stored record, which a task's end may not have
    reached yet (its report on its way, the supervisor restarting): a gang whose task had
    succeeded (a one-task job: the job's success) was made to wait and run again, and one that
    had failed was retried once more than its retryCount. Counted: tasks that ended, and not
    stopped, no later than the preemption; the others are taken as going on."""
    stopped_at = attempt.ended_at
    assert stopped_at is not None
    going = {"state": TaskState.RUNNING}
    tasks = [
        t.model_copy(update=going)
        if t.state.ended and (t.state == TaskState.STOPPED or t.ended_at is None or t.ended_at > stopped_at)
        else t
        for t in attempt.tasks
    ]
    decision = decide(config, tasks)
    return decision if decision.outcome is not None else None


def deadline(config: JobConfig, attempt: AttemptRecord) -> datetime | None:
    """When the attempt runs past the job's maxRunTimeSec: that long after its first task
    started. None without a limit, before any task started (the start timeout watches that),
    or once it ended."""
    return attempt.deadline(config.maxRunTimeSec)


def timed_out(config: JobConfig, attempt: AttemptRecord, at: datetime) -> AttemptRecord | None:
    """The attempt ended as FAILED at `at` because it ran past maxRunTimeSec (a user failure:
    retryCount decides whether it runs again), or None when it has not (no limit, not yet,
    ended already). The failure names the task that started first."""
    due = deadline(config, attempt)
    if due is None or at < due:
        return None
    first = min((t for t in attempt.tasks if t.started_at is not None), key=lambda t: t.started_at or at)
    why = f"ran past maxRunTimeSec ({config.maxRunTimeSec} s since {first.key} started)"
    failure = Failure(
        kind=FailureKind.USER, task=first.key, node=first.node, cause=TaskCause.KILLED, reason=why
    )
    return attempt.model_copy(
        update={"ended_at": at, "outcome": JobState.FAILED, "rule": why, "failure": failure}
    )


def settle(
    job: JobRecord, attempt: AttemptRecord, limits: RetryLimits, at: datetime
) -> tuple[JobRecord, NextStep] | None:
    """Apply an ended attempt to its job: the job's next record and the step taken, or None when
    there is nothing to do (an attempt before the job's current one, settled already, job
    final). An attempt after the one the job names is its new current one (it ended before the
    supervisor took its placement up: `Supervisor.adopt`)."""
    if job.attempt > attempt.attempt or job.settled >= attempt.attempt or job.state.final:
        return None
    assert attempt.outcome is not None
    if attempt.preempted_by is not None:  # stopped to make room: back in the queue, uncharged
        step = NextStep(JobState.WAITING, f"{attempt.rule}; waiting again (not charged to retryCount)")
    else:
        step = next_step(
            job.config, attempt.outcome, attempt.failure, job.retries, job.platform_retries, limits
        )
    if step.state == JobState.SUCCEEDED:
        step = NextStep(step.state, attempt.rule)  # which rule ended it
    update: dict[str, object] = {
        "state": step.state,
        "reason": step.reason,
        "attempt": attempt.attempt,
        "settled": attempt.attempt,
    }
    if step.state == JobState.WAITING:
        update["retries"] = job.retries + (1 if step.charged else 0)
        update["platform_retries"] = job.platform_retries + (1 if step.platform else 0)
        update["not_before"] = at + timedelta(seconds=step.delay)
    update["updated_at"] = at
    return job.model_copy(update=update), step


def lost_nodes(
    nodes: Iterable[NodeInfo], at: datetime, timeout: float, seen: Mapping[str, datetime] | None = None
) -> dict[str, NodeInfo]:
    """Nodes whose agent has been silent for longer than `timeout` seconds (its record's
    heartbeat_at, or `seen`: a later sign of life, a beat heard on the bus), or, when it said it
    was restarting, past the restart grace it announced."""
    cutoff = at - timedelta(seconds=timeout)
    seen = seen or {}
    return {
        n.node: n
        for n in nodes
        if max(n.heartbeat_at, seen.get(n.node, n.heartbeat_at)) < cutoff
        and (n.restarting_until is None or n.restarting_until < at)
    }


class Finished(NamedTuple):
    """What the supervisor holds of a finished job: what pruning it takes."""

    job_id: str
    user: str
    job_name: str
    attempt: int
    state: JobState
    updated_at: datetime

    @classmethod
    def held(cls, job: JobRecord) -> JobRecord | Finished:
        """A live job whole; a finished one as this."""
        if not job.state.final:
            return job
        return cls(job.job_id, job.user, job.job_name, job.attempt, job.state, job.updated_at)


def unsettled(attempt: AttemptRecord) -> AttemptRecord | None:
    """An attempt still to be watched: not ended, or with a task not yet ended (a node's loss
    still ends it); None once it is settled."""
    return None if attempt.ended and all(t.state.ended for t in attempt.tasks) else attempt


def should_prune(job: JobRecord | Finished, at: datetime, retention: float) -> bool:
    """A finished job's records are kept for `retention` seconds after it ended, then deleted."""
    return job.state.final and job.updated_at < at - timedelta(seconds=retention)
