"""How much one job and one user may ask for, so that no valid config can swamp the control plane
(every task is a record, a placement, a container and a rendezvous entry).

Two limits, from the environment: tasks per job (MUSTER_MAX_TASKS_PER_JOB, default 1000) and live
(not yet finished) tasks per user across all their jobs (MUSTER_MAX_TASKS_PER_USER, default
10000). `check` is pure; `LiveTasks` keeps each user's live-task count from job records as they
change (the validator feeds it from a watcher on the jobs bucket), so a submission costs no scan.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.jobconfig import FieldError
from shared.messages import JobRecord


@dataclass(frozen=True)
class Limits:
    tasks_per_job: int = 1000
    tasks_per_user: int = 10000

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Limits:
        return cls(
            tasks_per_job=_positive(env, "MUSTER_MAX_TASKS_PER_JOB", cls.tasks_per_job),
            tasks_per_user=_positive(env, "MUSTER_MAX_TASKS_PER_USER", cls.tasks_per_user),
        )


def _positive(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "")
    if not text.strip():
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {text!r}")
    return value


def check(tasks: int, user: str, live: int, limits: Limits) -> list[FieldError]:
    """The errors of a job of `tasks` tasks from `user`, who has `live` live tasks already."""
    if tasks > limits.tasks_per_job:
        return [
            FieldError(path="taskRoles", reason=f"{tasks} tasks; the limit is {limits.tasks_per_job} per job")
        ]
    if live + tasks > limits.tasks_per_user:
        reason = (
            f"{tasks} tasks would make {live + tasks} live tasks for user {user!r}, who has {live}; "
            f"the limit is {limits.tasks_per_user} per user"
        )
        return [FieldError(path="taskRoles", reason=reason)]
    return []


@dataclass
class LiveTasks:
    """Live tasks per user, from the latest record of each job."""

    jobs: dict[str, tuple[str, int]] = field(default_factory=dict)  # job id -> (user, live tasks)
    users: dict[str, int] = field(default_factory=dict)

    def update(self, job_id: str, record: JobRecord | None) -> None:
        """Take `record` as job `job_id`'s latest (None: deleted, or it does not decode)."""
        old = self.jobs.pop(job_id, None)
        if old is not None:
            user, n = old
            self.users[user] -= n
            if not self.users[user]:
                del self.users[user]
        if record is not None and not record.state.final:
            n = record.config.total_tasks
            self.jobs[job_id] = (record.user, n)
            self.users[record.user] = self.users.get(record.user, 0) + n

    def of(self, user: str) -> int:
        return self.users.get(user, 0)
