"""Completion and retry policy, a pure core.

`decide`: given a job config and the states of an attempt's tasks, has the attempt ended, how,
and by which rule? `classify`: what failed it (user or platform, with the evidence).
`next_step`: after an ended attempt, does the job end or run again, and is that retry charged
to retryCount?

Rules, in the order they are checked after each task state change (OpenPAI v1 semantics):
1. killAllOnCompletedTaskNumber N > 0: N tasks succeeded -> SUCCEEDED, kill the rest.
2. A role's minFailedTaskCount (default 1): that many of its tasks failed -> FAILED, kill the rest.
3. A role's minSucceededTaskCount (default: unset): that many of its tasks succeeded ->
   SUCCEEDED, kill the rest.
4. Every task ended and no rule above fired -> SUCCEEDED (every task succeeded, or failures
   stayed below every role's threshold).
A task stopped by the platform counts as failed unless the attempt had already ended.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.jobconfig import JobConfig
from shared.messages import Failure, FailureKind, JobState, TaskState, TaskStatus

PLATFORM = "platform:"  # reasons of platform failures start with this


@dataclass(frozen=True)
class Decision:
    outcome: JobState | None  # None: the attempt goes on
    rule: str = ""
    kill_rest: bool = False


GOES_ON = Decision(outcome=None)


def decide(config: JobConfig, tasks: list[TaskStatus]) -> Decision:
    succeeded = [t for t in tasks if t.state == TaskState.SUCCEEDED]
    failed = [t for t in tasks if t.state in (TaskState.FAILED, TaskState.STOPPED)]

    n = config.killAllOnCompletedTaskNumber or 0
    if n > 0 and len(succeeded) >= n:
        return Decision(
            JobState.SUCCEEDED, f"killAllOnCompletedTaskNumber: {len(succeeded)} of {n} tasks completed", True
        )

    for role in config.taskRoles:
        threshold = role.minFailedTaskCount or 1
        count = sum(1 for t in failed if t.role == role.name)
        if count >= threshold:
            first = next(t for t in failed if t.role == role.name)
            why = f"exit code {first.exit_code}" if first.exit_code not in (None, -1) else first.reason
            return Decision(
                JobState.FAILED,
                f"minFailedTaskCount: {count} of role {role.name} failed (≥ {threshold}); "
                f"{role.name}[{first.index}]: {why}",
                True,
            )

    for role in config.taskRoles:
        threshold = role.minSucceededTaskCount
        count = sum(1 for t in succeeded if t.role == role.name)
        if threshold and count >= threshold:
            return Decision(
                JobState.SUCCEEDED, f"minSucceededTaskCount: {count} of role {role.name} succeeded", True
            )

    if all(t.state.ended for t in tasks):
        return Decision(JobState.SUCCEEDED, "all tasks ended", False)
    return GOES_ON


def task_state_for(exit_code: int | None, reason: str) -> TaskState:
    """How a task that exited is recorded: killed by the platform, succeeded or failed."""
    if reason.startswith("killed"):
        return TaskState.STOPPED
    if exit_code == 0 and not reason:
        return TaskState.SUCCEEDED
    return TaskState.FAILED


# ------------------------------------------------------------------ failures and retries


def classify(tasks: list[TaskStatus]) -> Failure | None:
    """The failure behind an attempt: its first failed task (by end time). Platform when the task
    never ran or was lost or killed by the platform (reason 'platform: ...', or stopped while its
    attempt was still going); user when its command exited non-zero or ran out of memory."""
    failed = [t for t in tasks if t.state in (TaskState.FAILED, TaskState.STOPPED)]
    if not failed:
        return None
    first = min(failed, key=lambda t: (t.ended_at is None, t.ended_at, t.role_no, t.index))
    platform = first.reason.startswith(PLATFORM) or first.state == TaskState.STOPPED
    return Failure(
        kind=FailureKind.PLATFORM if platform else FailureKind.USER,
        task=first.key,
        node=first.node,
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
