"""The validator's task limits as pure logic: the checks, their settings, the live-task counts."""

from __future__ import annotations

import json

import pytest

from muster.services.validator.limits import Limits, Live, LiveTasks, check
from muster.shared.messages import JobRecord, JobState, now
from tests.test_validator import config


def test_defaults_and_environment() -> None:
    assert Limits.from_env({}) == Limits(tasks_per_job=1000, tasks_per_user=10000)
    env = {"MUSTER_MAX_TASKS_PER_JOB": "64", "MUSTER_MAX_TASKS_PER_USER": " 128 "}
    assert Limits.from_env(env) == Limits(tasks_per_job=64, tasks_per_user=128)
    assert Limits.from_env({"MUSTER_MAX_TASKS_PER_JOB": ""}).tasks_per_job == 1000


@pytest.mark.parametrize("value", ["0", "-5", "many", "1.5"])
def test_a_bad_setting_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(
        ValueError, match=f"MUSTER_MAX_TASKS_PER_USER must be a positive integer, got {value!r}"
    ):
        Limits.from_env({"MUSTER_MAX_TASKS_PER_USER": value})


LIMITS = Limits(tasks_per_job=1000, tasks_per_user=10000)


def per_user(tasks: int, live: int) -> list[tuple[str, str]]:
    reason = f"{tasks} tasks would make {tasks + live} live tasks for user 'u', who has {live}; "
    return [("taskRoles", reason + "the limit is 10000 per user")]


@pytest.mark.parametrize(
    ("tasks", "live", "errors"),
    [
        (1, 0, []),
        (1000, 9000, []),
        (1001, 0, [("taskRoles", "1001 tasks; the limit is 1000 per job")]),
        (640000, 0, [("taskRoles", "640000 tasks; the limit is 1000 per job")]),
        (2, 9999, per_user(2, 9999)),
        (1, 10000, per_user(1, 10000)),
    ],
)
def test_check(tasks: int, live: int, errors: list[tuple[str, str]]) -> None:
    assert [(e.path, e.reason) for e in check(tasks, "u", live, LIMITS)] == errors


def record(job_id: str, user: str, state: JobState = JobState.WAITING, tasks: int = 2) -> JobRecord:
    cfg = json.loads(config(job_id))
    cfg["taskRoles"][0]["taskNumber"] = tasks
    return JobRecord(
        job_id=job_id,
        job_name=job_id,
        state=state,
        submission_id=job_id,
        user=user,
        config=cfg,
        submitted_at=now(),
    )


def test_live_tasks_follow_each_jobs_latest_record() -> None:
    live = LiveTasks()
    live.update("a", Live.of(record("a", "alice", tasks=3)))
    live.update("b", Live.of(record("b", "alice", JobState.RUNNING, tasks=4)))
    live.update("c", Live.of(record("c", "bob")))
    live.update("d", Live.of(record("d", "alice", JobState.SUCCEEDED, tasks=100)))
    assert (live.of("alice"), live.of("bob"), live.of("nobody")) == (7, 2, 0)
    live.update("a", Live.of(record("a", "alice", JobState.RUNNING, tasks=3)))  # seen again: no change
    assert live.of("alice") == 7
    live.update("b", Live.of(record("b", "alice", JobState.FAILED, tasks=4)))  # finished
    assert live.of("alice") == 3
    live.update("a", None)  # deleted, or no longer decodes
    live.update("c", Live.of(record("c", "bob", JobState.STOPPED)))
    assert (live.of("alice"), live.of("bob")) == (0, 0)
    assert live.users == {}  # nothing kept for users with no live tasks
