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

from muster.shared.jobconfig import FieldError
from muster.shared.messages import JobRecord
from muster.shared.settings import SettingError


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
        raise SettingError(f"{name} must be a positive integer, got {text!r}")
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


@dataclass(frozen=True, slots=True)
class Live:
    """What the validator keeps of a job record: whose job it is, how many of its tasks are
    live (0 once it is final) and whether no scheduler has looked at it yet (admission control).
    A few dozen bytes where the record is kilobytes, for every job kept through the retention
    period."""

    user: str
    tasks: int
    unseen: bool = False

    @classmethod
    def of(cls, record: JobRecord) -> Live:
        return cls(record.user, 0 if record.state.final else record.config.most_tasks, record.unseen)


@dataclass
class LiveTasks:
    """Live tasks per user, from the latest record of each job."""

    jobs: dict[str, Live] = field(default_factory=dict)  # jobs with live tasks
    users: dict[str, int] = field(default_factory=dict)

    def update(self, job_id: str, live: Live | None) -> None:
        """Take `live` as job `job_id`'s latest (None: deleted, or it does not decode)."""
        old = self.jobs.pop(job_id, None)
        if old is not None:
            self.users[old.user] -= old.tasks
            if not self.users[old.user]:
                del self.users[old.user]
        if live is not None and live.tasks:
            self.jobs[job_id] = live
            self.users[live.user] = self.users.get(live.user, 0) + live.tasks

    def of(self, user: str) -> int:
        return self.users.get(user, 0)
