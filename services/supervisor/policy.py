"""Completion policy, a pure core: given a job config and the states of an attempt's tasks,
has the attempt ended, how, and by which rule?

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
from shared.messages import JobState, TaskState, TaskStatus


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
