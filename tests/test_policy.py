"""The completion and retry policy (services/supervisor/policy.py), a pure core: table tests for
every rule of `decide`, `task_state_for`, `classify`, `next_step` and `backoff`, then property tests
of their invariants (decide against the documented rule order; a job's life of retries)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muster.services.supervisor.policy import (
    Decision,
    Finished,
    RetryLimits,
    backoff,
    classify,
    deadline,
    decide,
    next_step,
    settle,
    should_prune,
    task_state_for,
    timed_out,
    unsettled,
)
from muster.shared.jobconfig import JobConfig, check_job
from muster.shared.lifecycle import attempt_to_place
from muster.shared.messages import (
    AttemptRecord,
    Failure,
    FailureKind,
    JobRecord,
    JobState,
    TaskCause,
    TaskState,
    TaskStatus,
)

T0 = datetime(2024, 1, 1, tzinfo=UTC)
S, F, ST = JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED
USER, PLATFORM, CONFIG = FailureKind.USER, FailureKind.PLATFORM, FailureKind.CONFIG

# One letter per task state in the table rows: P placed, R running, S succeeded, F failed, X stopped.
LETTERS = {
    "P": TaskState.PLACED,
    "R": TaskState.RUNNING,
    "S": TaskState.SUCCEEDED,
    "F": TaskState.FAILED,
    "X": TaskState.STOPPED,
}


# ------------------------------------------------------------------ builders


def role(
    name: str, n: int, min_failed: int | None = None, min_succeeded: int | None = None, command: str = "run"
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name,
        "taskNumber": n,
        "cpuNumber": 1,
        "memoryMB": 100,
        "gpuNumber": 0,
        "command": command,
    }
    if min_failed is not None:
        out["minFailedTaskCount"] = min_failed
    if min_succeeded is not None:
        out["minSucceededTaskCount"] = min_succeeded
    return out


def config(roles: list[dict[str, Any]], kill_all: int | None = None, retry: int = 0) -> JobConfig:
    """A config that passes the whole contract (check_job, cross-field bounds included)."""
    data: dict[str, Any] = {"jobName": "policy", "image": "muster/base:bookworm", "taskRoles": roles}
    data["retryCount"] = retry
    if kill_all is not None:
        data["killAllOnCompletedTaskNumber"] = kill_all
    cfg, errors = check_job(data)
    assert cfg is not None, errors
    return cfg


def task(
    role_name: str,
    index: int,
    state: TaskState,
    role_no: int = 0,
    exit_code: int | None = None,
    reason: str = "",
    ended_at: datetime | None = None,
    node: str = "n0",
    last_lines: list[str] | None = None,
    cause: TaskCause | None = None,
) -> TaskStatus:
    if cause is None and state.ended:
        cause = TaskCause.KILLED if state == TaskState.STOPPED else TaskCause.EXITED
    return TaskStatus(
        cause=cause,
        role=role_name,
        role_no=role_no,
        index=index,
        node=node,
        state=state,
        exit_code=exit_code,
        reason=reason,
        ended_at=ended_at,
        last_lines=last_lines or [],
    )


def tasks_for(cfg: JobConfig, states: dict[str, str]) -> list[TaskStatus]:
    """The attempt's tasks, in config order, with states written as letters per role."""
    out: list[TaskStatus] = []
    for role_no, r in enumerate(cfg.taskRoles):
        letters = states[r.name]
        assert len(letters) == r.taskNumber, (r.name, letters)
        for i, letter in enumerate(letters):
            state = LETTERS[letter]
            code, reason = {
                TaskState.SUCCEEDED: (0, ""),
                TaskState.FAILED: (1, ""),
                TaskState.STOPPED: (137, "killed: node drained"),
            }.get(state, (None, ""))
            ended = T0 + timedelta(seconds=len(out)) if state.ended else None
            out.append(task(r.name, i, state, role_no=role_no, exit_code=code, reason=reason, ended_at=ended))
    return out


# ------------------------------------------------------------------ decide: one row per rule

KILL = "killAllOnCompletedTaskNumber"
MINF = "minFailedTaskCount"
MINS = "minSucceededTaskCount"
ALL = "all tasks ended"
HOROVOD = [role("main", 1, min_succeeded=1, command="horovodrun ..."), role("worker", 2, command="sleep inf")]

# (id, roles, killAll, task states, outcome, kill_rest, substring of rule)
DECIDE_ROWS: list[tuple[str, list[dict[str, Any]], int | None, dict[str, str], Any, bool, str]] = [
    # killAllOnCompletedTaskNumber
    ("killall-1-reached", [role("w", 3)], 1, {"w": "SRR"}, S, True, f"{KILL}: 1 of 1"),
    ("killall-2-not-reached", [role("w", 3)], 2, {"w": "SRR"}, None, False, ""),
    ("killall-2-reached", [role("w", 3)], 2, {"w": "SSR"}, S, True, f"{KILL}: 2 of 2"),
    ("killall-counts-every-role", [role("a", 2), role("b", 2)], 2, {"a": "SR", "b": "RS"}, S, True, KILL),
    ("killall-reached-as-all-end", [role("w", 3)], 3, {"w": "SSS"}, S, True, KILL),
    ("killall-0-waits-for-all", [role("w", 3)], 0, {"w": "SSR"}, None, False, ""),
    ("killall-0-all-succeeded", [role("w", 3)], 0, {"w": "SSS"}, S, False, ALL),
    ("killall-absent-waits", [role("w", 3)], None, {"w": "SSP"}, None, False, ""),
    ("killall-absent-all-succeeded", [role("w", 3)], None, {"w": "SSS"}, S, False, ALL),
    # minFailedTaskCount, default 1
    ("default-one-failure-fails", [role("w", 3)], None, {"w": "FRR"}, F, True, f"{MINF}: 1 of role w"),
    ("default-failure-names-task", [role("w", 3)], None, {"w": "RFR"}, F, True, "w[1]: exit code 1"),
    ("default-failure-last-to-end", [role("w", 3)], None, {"w": "SSF"}, F, True, MINF),
    (
        "default-failure-other-role",
        [*HOROVOD[1:], role("ps", 1)],
        None,
        {"worker": "RR", "ps": "F"},
        F,
        True,
        "role ps",
    ),
    ("minfailed-2-one-goes-on", [role("w", 3, min_failed=2)], None, {"w": "FRR"}, None, False, ""),
    (
        "minfailed-2-two-fail",
        [role("w", 3, min_failed=2)],
        None,
        {"w": "FRF"},
        F,
        True,
        "2 of role w failed (≥ 2)",
    ),
    ("minfailed-2-one-then-all-ok", [role("w", 3, min_failed=2)], None, {"w": "FSS"}, S, False, ALL),
    (
        "minfailed-per-role",
        [role("a", 2, min_failed=2), role("b", 2)],
        None,
        {"a": "FR", "b": "SR"},
        None,
        False,
        "",
    ),
    (
        "minfailed-first-role-in-order",
        [role("a", 2), role("b", 2)],
        None,
        {"a": "RF", "b": "FR"},
        F,
        True,
        "role a",
    ),
    # STOPPED counts as failed
    ("stopped-counts-as-failed", [role("w", 3)], None, {"w": "XRR"}, F, True, "w[0]: exit code 137"),
    ("stopped-plus-failed-reach-2", [role("w", 3, min_failed=2)], None, {"w": "XFR"}, F, True, "2 of role w"),
    ("stopped-below-threshold", [role("w", 2, min_failed=2)], None, {"w": "XS"}, S, False, ALL),
    # minSucceededTaskCount: the horovod corpus shape, a main role and a worker running sleep
    (
        "horovod-main-succeeded",
        HOROVOD,
        None,
        {"main": "S", "worker": "RR"},
        S,
        True,
        f"{MINS}: 1 of role main",
    ),
    ("horovod-main-running", HOROVOD, None, {"main": "R", "worker": "RR"}, None, False, ""),
    ("horovod-main-failed", HOROVOD, None, {"main": "F", "worker": "RR"}, F, True, "role main"),
    ("horovod-worker-failed", HOROVOD, None, {"main": "R", "worker": "RF"}, F, True, "role worker"),
    ("minsucceeded-2-not-reached", [role("w", 3, min_succeeded=2)], None, {"w": "SRR"}, None, False, ""),
    ("minsucceeded-2-reached", [role("w", 3, min_succeeded=2)], None, {"w": "SRS"}, S, True, f"{MINS}: 2"),
    # every task ended, failures below every threshold
    (
        "all-ended-below-thresholds",
        [role("a", 2, min_failed=2), role("b", 2, min_failed=2)],
        None,
        {"a": "FS", "b": "SF"},
        S,
        False,
        ALL,
    ),
    # still running
    ("all-placed", [role("w", 3)], None, {"w": "PPP"}, None, False, ""),
    ("some-running", [role("a", 1), role("b", 2)], None, {"a": "S", "b": "SR"}, None, False, ""),
    # rule order: killAll (1) before minFailed (2) before minSucceeded (3)
    ("order-killall-before-minfailed", [role("w", 3)], 1, {"w": "SFR"}, S, True, KILL),
    (
        "order-killall-before-minfailed-2",
        [role("a", 2), role("b", 2)],
        2,
        {"a": "SS", "b": "FF"},
        S,
        True,
        KILL,
    ),
    (
        "order-minfailed-before-minsucceeded",
        HOROVOD,
        None,
        {"main": "S", "worker": "FR"},
        F,
        True,
        "role worker",
    ),
    ("order-minfailed-before-killall-not-reached", [role("w", 3)], 2, {"w": "SFR"}, F, True, MINF),
    ("order-minsucceeded-before-all-ended", HOROVOD, None, {"main": "S", "worker": "SS"}, S, True, MINS),
]


@pytest.mark.parametrize(
    "roles,kill_all,states,outcome,kill_rest,rule",
    [row[1:] for row in DECIDE_ROWS],
    ids=[row[0] for row in DECIDE_ROWS],
)
def test_decide(
    roles: list[dict[str, Any]],
    kill_all: int | None,
    states: dict[str, str],
    outcome: JobState | None,
    kill_rest: bool,
    rule: str,
) -> None:
    cfg = config(roles, kill_all)
    d = decide(cfg, tasks_for(cfg, states))
    assert (d.outcome, d.kill_rest) == (outcome, kill_rest), d
    assert rule in d.rule, d
    if outcome is None:
        assert d == Decision(outcome=None)


def test_decide_failure_evidence_without_exit_code() -> None:
    """A task that never ran (exit -1) is named by its reason, not by a meaningless exit code."""
    cfg = config([role("w", 2)])
    tasks = [
        task(
            "w",
            0,
            TaskState.FAILED,
            exit_code=-1,
            reason="image pull failed",
            ended_at=T0,
            cause=TaskCause.PLATFORM,
        ),
        task("w", 1, TaskState.RUNNING),
    ]
    d = decide(cfg, tasks)
    assert d.outcome == F and "w[0]: image pull failed" in d.rule


# ------------------------------------------------------------------ task_state_for

C = TaskCause
STATE_ROWS = [
    ("exit-0", C.EXITED, 0, TaskState.SUCCEEDED),
    ("exit-1", C.EXITED, 1, TaskState.FAILED),
    ("exit-2", C.EXITED, 2, TaskState.FAILED),
    ("oom-137", C.OOM, 137, TaskState.FAILED),
    ("oom-exit-0-is-not-success", C.OOM, 0, TaskState.FAILED),
    ("sigkill-137", C.EXITED, 137, TaskState.FAILED),
    ("killed-by-order", C.KILLED, 137, TaskState.STOPPED),
    ("killed-exit-0", C.KILLED, 0, TaskState.STOPPED),
    ("killed-before-start", C.KILLED, -1, TaskState.STOPPED),
    ("platform-image-pull", C.PLATFORM, -1, TaskState.FAILED),
    ("node-lost", C.NODE_LOST, None, TaskState.FAILED),
    ("platform-exit-0-is-not-success", C.PLATFORM, 0, TaskState.FAILED),
    ("config-invalid-mount", C.CONFIG, -1, TaskState.FAILED),
    ("no-exit-code", C.EXITED, None, TaskState.FAILED),
    ("no-cause-exit-0", None, 0, TaskState.SUCCEEDED),
]


@pytest.mark.parametrize("cause,exit_code,state", [r[1:] for r in STATE_ROWS], ids=[r[0] for r in STATE_ROWS])
def test_task_state_for(cause: TaskCause | None, exit_code: int | None, state: TaskState) -> None:
    assert task_state_for(cause, exit_code) == state


# ------------------------------------------------------------------ classify


def at(seconds: int) -> datetime:
    return T0 + timedelta(seconds=seconds)


def failed(index: int, code: int | None, reason: str = "", t: int | None = 0, **kw: Any) -> TaskStatus:
    return task(
        "w",
        index,
        TaskState.FAILED,
        exit_code=code,
        reason=reason,
        ended_at=None if t is None else at(t),
        **kw,
    )


def stopped(index: int, t: int | None = 0, **kw: Any) -> TaskStatus:
    return task(
        "w",
        index,
        TaskState.STOPPED,
        exit_code=137,
        reason="killed: gang teardown",
        ended_at=None if t is None else at(t),
        **kw,
    )


ok = task("w", 9, TaskState.SUCCEEDED, exit_code=0, ended_at=T0)
running = task("w", 8, TaskState.RUNNING)

# (id, tasks, expected kind or None, expected task key, expected exit code)
CLASSIFY_ROWS: list[tuple[str, list[TaskStatus], FailureKind | None, str, int | None]] = [
    ("no-tasks", [], None, "", None),
    ("none-failed", [ok, running], None, "", None),
    ("user-exit-1", [ok, failed(0, 1), running], USER, "w.0", 1),
    ("user-oom-137", [failed(0, 137, "out of memory", cause=C.OOM)], USER, "w.0", 137),
    ("user-exit-137-no-reason", [failed(0, 137)], USER, "w.0", 137),
    ("platform-node-lost", [failed(1, None, "node n1 lost", cause=C.NODE_LOST)], PLATFORM, "w.1", None),
    ("platform-image-pull", [failed(1, -1, "image pull failed", cause=C.PLATFORM)], PLATFORM, "w.1", -1),
    ("platform-could-not-start", [failed(2, -1, "could not start", cause=C.PLATFORM)], PLATFORM, "w.2", -1),
    ("config-invalid-mount", [failed(2, -1, "invalid mount", cause=C.CONFIG)], CONFIG, "w.2", -1),
    ("reason-text-is-not-read", [failed(0, 1, "platform: node n1 lost")], USER, "w.0", 1),
    ("stopped-is-platform", [stopped(3)], PLATFORM, "w.3", 137),
    ("first-by-end-user", [stopped(0, t=5), failed(1, 1, t=2)], USER, "w.1", 1),
    (
        "first-by-end-platform",
        [failed(0, 1, t=9), failed(1, -1, "node n1 lost", t=3, cause=C.NODE_LOST)],
        PLATFORM,
        "w.1",
        -1,
    ),
    ("first-by-end-stopped", [failed(0, 2, t=4), stopped(1, t=1)], PLATFORM, "w.1", 137),
    ("unknown-end-time-last", [failed(0, 1, t=None), failed(1, 2, t=7)], USER, "w.1", 2),
    ("all-unknown-end-by-index", [failed(2, 3, t=None), failed(1, 2, t=None)], USER, "w.1", 2),
    ("tie-by-index", [failed(2, 3, t=1), failed(1, 2, t=1)], USER, "w.1", 2),
]


@pytest.mark.parametrize(
    "tasks,kind,key,exit_code", [r[1:] for r in CLASSIFY_ROWS], ids=[r[0] for r in CLASSIFY_ROWS]
)
def test_classify(tasks: list[TaskStatus], kind: FailureKind | None, key: str, exit_code: int | None) -> None:
    f = classify(tasks)
    if kind is None:
        assert f is None
        return
    assert f is not None
    assert (f.kind, f.task, f.exit_code) == (kind, key, exit_code)


def test_classify_tie_by_role_order() -> None:
    tasks = [
        task("b", 0, TaskState.FAILED, role_no=1, exit_code=1, ended_at=T0),
        task("a", 0, TaskState.FAILED, role_no=0, exit_code=2, ended_at=T0),
    ]
    f = classify(tasks)
    assert f is not None and f.task == "a.0"


@pytest.mark.parametrize("lines,kept", [(25, 10), (10, 10), (3, 3), (0, 0)])
def test_classify_copies_evidence(lines: int, kept: int) -> None:
    output = [f"line {i}" for i in range(lines)]
    t = failed(4, 137, "out of memory", t=3, node="gpu-7", last_lines=output, cause=C.OOM)
    f = classify([ok, t])
    assert f is not None
    assert (f.node, f.exit_code, f.reason, f.task) == ("gpu-7", 137, "out of memory", "w.4")
    assert f.last_lines == output[-10:] and len(f.last_lines) == kept


# ------------------------------------------------------------------ next_step and backoff

LIM = RetryLimits(platform=3, backoff=2.0, backoff_max=60.0)


def failure(kind: FailureKind | None) -> Failure | None:
    if kind is None:
        return None
    if kind == PLATFORM:
        return Failure(kind=kind, task="w.0", node="n1", exit_code=-1, reason="platform: node n1 lost")
    if kind == CONFIG:
        return Failure(kind=kind, task="w.0", node="n1", exit_code=-1, reason="mount path must be absolute")
    return Failure(kind=kind, task="w.0", node="n1", exit_code=1)


W = JobState.WAITING
# (id, retryCount, outcome, failure kind, retries, platform_retries, state, charged, platform, delay, reason)
NEXT_ROWS: list[tuple[str, int, JobState, FailureKind | None, int, int, JobState, bool, bool, float, str]] = [
    # success
    ("success-rc0", 0, S, None, 0, 0, S, False, False, 0.0, "succeeded"),
    ("success-rc2-after-retry", 2, S, None, 1, 2, S, False, False, 0.0, "succeeded"),
    ("success-rc-1", -1, S, None, 7, 0, S, False, False, 0.0, "succeeded"),
    ("success-rc-2-restarts", -2, S, None, 0, 0, W, True, False, 0.0, "retryCount -2"),
    ("success-rc-2-restarts-again", -2, S, None, 40, 3, W, True, False, 0.0, "restart"),
    # user failures, retryCount 0 / 2 / -1 / -2 at retries 0, 1, 2
    ("user-rc0-r0", 0, F, USER, 0, 0, F, False, False, 0.0, "retryCount 0"),
    ("user-rc2-r0", 2, F, USER, 0, 0, W, True, False, 0.0, "retry 1 of 2"),
    ("user-rc2-r1", 2, F, USER, 1, 0, W, True, False, 2.0, "retry 2 of 2"),
    ("user-rc2-r2", 2, F, USER, 2, 0, F, False, False, 0.0, "all 2 retries spent"),
    ("user-rc-1-r0", -1, F, USER, 0, 0, W, True, False, 0.0, "without limit"),
    ("user-rc-1-r1", -1, F, USER, 1, 0, W, True, False, 2.0, "without limit"),
    ("user-rc-1-r2", -1, F, USER, 2, 0, W, True, False, 4.0, "without limit"),
    ("user-rc-1-r500", -1, F, USER, 500, 0, W, True, False, 60.0, "without limit"),
    ("user-rc-1-r5000-no-overflow", -1, F, USER, 5000, 0, W, True, False, 60.0, "without limit"),
    ("user-rc-2-r0", -2, F, USER, 0, 0, W, True, False, 0.0, "without limit"),
    ("user-rc-2-r1", -2, F, USER, 1, 0, W, True, False, 2.0, "without limit"),
    ("user-rc-2-r2", -2, F, USER, 2, 0, W, True, False, 4.0, "without limit"),
    ("user-evidence-in-reason", 0, F, USER, 0, 0, F, False, False, 0.0, "w.0 on n1 exited 1"),
    ("no-failure-is-user", 0, F, None, 0, 0, F, False, False, 0.0, "no task failed"),
    ("no-failure-charged", 1, F, None, 0, 0, W, True, False, 0.0, "1 of 1"),
    # platform failures: uncharged from their own budget (with backoff), then charged like user ones
    ("platform-rc0-p0", 0, F, PLATFORM, 0, 0, W, False, True, 2.0, "retry 1 of 3, not charged"),
    ("platform-rc0-p1", 0, F, PLATFORM, 0, 1, W, False, True, 4.0, "retry 2 of 3"),
    ("platform-rc0-p2", 0, F, PLATFORM, 0, 2, W, False, True, 8.0, "retry 3 of 3"),
    ("platform-rc0-budget-spent", 0, F, PLATFORM, 0, 3, F, False, False, 0.0, "retryCount 0"),
    ("platform-rc2-spent-r0", 2, F, PLATFORM, 0, 3, W, True, False, 0.0, "retry 1 of 2"),
    ("platform-rc2-spent-r1", 2, F, PLATFORM, 1, 3, W, True, False, 2.0, "retry 2 of 2"),
    ("platform-rc2-spent-r2", 2, F, PLATFORM, 2, 3, F, False, False, 0.0, "all 2 retries spent"),
    ("platform-rc2-r2-uncharged", 2, F, PLATFORM, 2, 0, W, False, True, 2.0, "not charged"),
    ("platform-rc-1-spent", -1, F, PLATFORM, 9, 3, W, True, False, 60.0, "without limit"),
    ("platform-evidence-in-reason", 0, F, PLATFORM, 0, 3, F, False, False, 0.0, "platform: node n1 lost"),
    # configuration failures end the job at once, whatever the budgets
    ("config-rc0", 0, F, CONFIG, 0, 0, F, False, False, 0.0, "configuration error"),
    ("config-rc-1", -1, F, CONFIG, 0, 0, F, False, False, 0.0, "mount path must be absolute"),
    ("config-rc-2", -2, F, CONFIG, 3, 1, F, False, False, 0.0, "not retried"),
    # any other outcome (a kill) ends the job as it is
    ("stopped-rc-2", -2, ST, None, 0, 0, ST, False, False, 0.0, "stopped"),
    ("stopped-rc2", 2, ST, USER, 0, 0, ST, False, False, 0.0, "stopped"),
]


@pytest.mark.parametrize(
    "rc,outcome,kind,retries,platform_retries,state,charged,platform,delay,reason",
    [r[1:] for r in NEXT_ROWS],
    ids=[r[0] for r in NEXT_ROWS],
)
def test_next_step(
    rc: int,
    outcome: JobState,
    kind: FailureKind | None,
    retries: int,
    platform_retries: int,
    state: JobState,
    charged: bool,
    platform: bool,
    delay: float,
    reason: str,
) -> None:
    cfg = config([role("w", 2)], retry=rc)
    step = next_step(cfg, outcome, failure(kind), retries, platform_retries, LIM)
    assert (step.state, step.charged, step.platform, step.delay) == (state, charged, platform, delay), step
    assert reason in step.reason, step


def test_next_step_platform_budget_zero_charges_at_once() -> None:
    cfg = config([role("w", 1)], retry=1)
    limits = RetryLimits(platform=0)
    step = next_step(cfg, F, failure(PLATFORM), 0, 0, limits)
    assert (step.state, step.charged, step.platform) == (W, True, False)
    assert next_step(cfg, F, failure(PLATFORM), 1, 0, limits).state == F


def test_next_step_default_limits() -> None:
    cfg = config([role("w", 1)])
    step = next_step(cfg, F, failure(PLATFORM), 0, 9)
    assert (step.state, step.platform) == (W, True)
    assert next_step(cfg, F, failure(PLATFORM), 0, 10).state == F


BACKOFF_ROWS = [
    (RetryLimits(backoff=1.0, backoff_max=60.0), [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]),
    (RetryLimits(backoff=1.5, backoff_max=10.0), [0.0, 1.5, 3.0, 6.0, 10.0, 10.0]),
    (RetryLimits(backoff=0.0, backoff_max=60.0), [0.0, 0.0, 0.0]),
    (RetryLimits(backoff=5.0, backoff_max=5.0), [0.0, 5.0, 5.0, 5.0]),
]


@pytest.mark.parametrize("limits,delays", BACKOFF_ROWS)
def test_backoff(limits: RetryLimits, delays: list[float]) -> None:
    assert [backoff(n, limits) for n in range(len(delays))] == delays
    assert backoff(-1, limits) == 0.0
    # Far past 2**1024: an unlimited retryCount must not overflow (it raised OverflowError at n=1025).
    for n in (1024, 1025, 1026, 10_000, 10**9):
        assert backoff(n, limits) == (limits.backoff_max if limits.backoff else 0.0)


def test_restart_forever_job_outlives_a_thousand_retries() -> None:
    """retryCount -2: a job restarted after every attempt keeps getting a next step, however long
    it lives (the charged count grows without limit)."""
    cfg = config([role("w", 1)], retry=-2)
    for retries in range(0, 3000, 7):
        for outcome, kind in ((S, None), (F, USER), (F, PLATFORM)):
            step = next_step(cfg, outcome, failure(kind), retries, LIM.platform, LIM)
            assert step.state == W and step.charged and 0.0 <= step.delay <= LIM.backoff_max


# ------------------------------------------------------------------ property: decide

STATES = st.sampled_from(list(TaskState))


@st.composite
def attempts(draw: Any) -> tuple[JobConfig, list[TaskStatus]]:
    """A valid config (1-3 roles of 1-4 tasks, thresholds within bounds) and an attempt's tasks in
    random states."""
    roles = []
    for i in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 4))
        min_failed = draw(st.none() | st.integers(1, n))
        min_succeeded = draw(st.none() | st.integers(1, n))
        roles.append(role(f"r{i}", n, min_failed, min_succeeded))
    total = sum(r["taskNumber"] for r in roles)
    kill_all = draw(st.none() | st.integers(0, total))
    cfg = config(roles, kill_all)
    tasks = []
    for role_no, r in enumerate(cfg.taskRoles):
        for i in range(r.taskNumber):
            state = draw(STATES)
            code = {TaskState.SUCCEEDED: 0, TaskState.FAILED: 1, TaskState.STOPPED: 137}.get(state)
            ended = at(draw(st.integers(0, 100))) if state.ended else None
            tasks.append(task(r.name, i, state, role_no=role_no, exit_code=code, ended_at=ended))
    return cfg, draw(st.permutations(tasks))


def reference(cfg: JobConfig, tasks: list[TaskStatus]) -> tuple[JobState | None, str]:
    """The module docstring's rules, in its order, written out independently: (outcome, rule)."""

    def count(r: str, *states: TaskState) -> int:
        return sum(1 for t in tasks if t.role == r and t.state in states)

    succeeded = sum(1 for t in tasks if t.state == TaskState.SUCCEEDED)
    n = cfg.killAllOnCompletedTaskNumber or 0
    if n > 0 and succeeded >= n:
        return S, KILL
    for r in cfg.taskRoles:
        if count(r.name, TaskState.FAILED, TaskState.STOPPED) >= (r.minFailedTaskCount or 1):
            return F, f"{MINF}: {count(r.name, TaskState.FAILED, TaskState.STOPPED)} of role {r.name} "
    for r in cfg.taskRoles:
        if (
            r.minSucceededTaskCount is not None
            and count(r.name, TaskState.SUCCEEDED) >= r.minSucceededTaskCount
        ):
            return S, f"{MINS}: {count(r.name, TaskState.SUCCEEDED)} of role {r.name} "
    if all(t.state.ended for t in tasks):
        return S, ALL
    return None, ""


@settings(max_examples=300, deadline=None)
@given(attempts())
def test_decide_invariants(attempt: tuple[JobConfig, list[TaskStatus]]) -> None:
    cfg, tasks = attempt
    d = decide(cfg, tasks)
    succeeded = sum(1 for t in tasks if t.state == TaskState.SUCCEEDED)
    n = cfg.killAllOnCompletedTaskNumber or 0
    kill_all_fired = n > 0 and succeeded >= n
    over = [
        r.name
        for r in cfg.taskRoles
        if sum(1 for t in tasks if t.role == r.name and t.state in (TaskState.FAILED, TaskState.STOPPED))
        >= (r.minFailedTaskCount or 1)
    ]
    alive = [t for t in tasks if not t.state.ended]

    # Never SUCCEEDED while a role's failures reach its threshold, unless killAll fired first (rule 1
    # precedes rule 2; minSucceeded, rule 3, comes after minFailed so it can never override it).
    if d.outcome == S and over:
        assert kill_all_fired and d.rule.startswith(KILL), (d, over)
    if d.rule.startswith(MINS):
        assert not over and not kill_all_fired
    # FAILED only when some role reached its threshold (and killAll had not fired); then classify
    # names a failure.
    if d.outcome == F:
        assert over and not kill_all_fired and d.rule.startswith(MINF)
        assert any(f"role {name} " in d.rule for name in over)
        assert classify(tasks) is not None
    # Going on only while some task has not ended, and with nothing to kill.
    if d.outcome is None:
        assert alive and not d.kill_rest and d.rule == ""
        assert not kill_all_fired and not over
    # The rest is killed only when tasks remain alive or a rule other than "all tasks ended" fired.
    if d.kill_rest:
        assert alive or d.rule != ALL
    if d.rule == ALL:
        assert not alive and not d.kill_rest and d.outcome == S
    if not alive:
        assert d.outcome is not None
    # And the whole decision is the documented rule order, written out independently.
    outcome, rule = reference(cfg, tasks)
    assert d.outcome == outcome and d.rule.startswith(rule), (d, outcome, rule)
    assert d.kill_rest == (outcome is not None and rule != ALL)


# ------------------------------------------------------------------ property: a job's life

OUTCOMES = st.sampled_from(["success", "user", "platform"])


@settings(max_examples=300, deadline=None)
@given(
    rc=st.sampled_from([-2, -1, 0, 1, 2, 3, 5]),
    platform_limit=st.integers(0, 4),
    base=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    cap=st.sampled_from([1.0, 10.0, 60.0]),
    data=st.data(),
)
def test_job_life(rc: int, platform_limit: int, base: float, cap: float, data: st.DataObject) -> None:
    """Feed random attempt outcomes through next_step, keeping the counters as the supervisor does,
    until the job ends or 50 attempts ran."""
    cfg = config([role("w", 2)], retry=rc)
    limits = RetryLimits(platform=platform_limit, backoff=base, backoff_max=cap)
    retries = platform_retries = 0
    final: JobState | None = None
    attempt = 0
    while attempt < 50 and final is None:
        attempt += 1
        what = data.draw(OUTCOMES)
        if what == "success":
            outcome, fail = S, None
        else:
            outcome, fail = F, failure(USER if what == "user" else PLATFORM)
        step = next_step(cfg, outcome, fail, retries, platform_retries, limits)

        assert not (step.charged and step.platform)
        assert 0.0 <= step.delay <= max(cap, 0.0)
        if what == "success" and rc != -2:
            assert step.state == S and not step.charged
        if rc == -2:
            assert step.state == W
        if rc == -1:
            assert step.state != F
        if step.state == F:
            assert rc >= 0 and retries == rc
            assert what == "user" or platform_retries == platform_limit
        if what == "platform" and platform_retries < platform_limit:
            assert step.platform and not step.charged

        if step.state == W:
            retries += 1 if step.charged else 0
            platform_retries += 1 if step.platform else 0
        else:
            final = step.state
        if rc >= 0:
            assert retries <= rc
        assert platform_retries <= platform_limit
        assert retries + platform_retries == attempt - (0 if final is None else 1)

    if rc >= 0:
        assert final is not None and attempt <= rc + platform_limit + 1
    if rc == -2:
        assert final is None
    if rc == -1:
        assert final in (None, S)


# ------------------------------------------------------------------ attempt_to_place


def job_at(attempt: int, settled: int = 0, state: JobState = JobState.WAITING, wait: float = 0) -> JobRecord:
    return JobRecord(
        job_id="j1",
        job_name="policy",
        submission_id="s1",
        user="u",
        config=config([role("w", 2)]),
        submitted_at=T0,
        state=state,
        attempt=attempt,
        settled=settled,
        not_before=T0 + timedelta(seconds=wait) if wait else None,
    )


def attempt_of(n: int, letters: str, ended: bool) -> AttemptRecord:
    cfg = config([role("w", 2)])
    return AttemptRecord(
        job_id="j1", attempt=n, tasks=tasks_for(cfg, {"w": letters}), ended_at=T0 if ended else None
    )


# (id, job, current attempt record, seconds after T0, attempt to place)
PLACE_ROWS: list[tuple[str, JobRecord, AttemptRecord | None, float, int | None]] = [
    ("never-placed", job_at(0), None, 0, 1),
    ("moved-but-never-written", job_at(2, settled=1), None, 0, 2),
    ("running", job_at(1), attempt_of(1, "RR", False), 0, None),
    ("ended-not-settled", job_at(1), attempt_of(1, "FS", True), 0, None),
    ("settled-task-still-running", job_at(1, settled=1), attempt_of(1, "FR", True), 0, None),
    ("settled-task-never-reported", job_at(1, settled=1), attempt_of(1, "FP", True), 0, None),
    ("settled-all-ended", job_at(1, settled=1), attempt_of(1, "FX", True), 0, 2),
    ("backoff-not-passed", job_at(1, settled=1, wait=5), attempt_of(1, "FF", True), 4, None),
    ("backoff-passed", job_at(1, settled=1, wait=5), attempt_of(1, "FF", True), 5, 2),
    ("final-job", job_at(1, settled=1, state=JobState.FAILED), attempt_of(1, "FF", True), 0, None),
    ("running-job", job_at(1, state=JobState.RUNNING), attempt_of(1, "RR", False), 0, None),
]


@pytest.mark.parametrize("job,current,after,n", [r[1:] for r in PLACE_ROWS], ids=[r[0] for r in PLACE_ROWS])
def test_attempt_to_place(job: JobRecord, current: AttemptRecord | None, after: float, n: int | None) -> None:
    assert attempt_to_place(job, current, T0 + timedelta(seconds=after)) == n


# The leader creates the attempt record and nothing more; until the supervisor moves the job to
# it, only the attempt says it was placed (`latest`: the newest attempt with a record).
# (id, job, the latest attempt's record, seconds after T0, attempt to place)
PLACED_ROWS: list[tuple[str, JobRecord, AttemptRecord, float, int | None]] = [
    ("placed-not-taken-up", job_at(0), attempt_of(1, "PP", False), 0, None),
    ("running-not-taken-up", job_at(0), attempt_of(1, "RR", False), 0, None),
    ("ended-not-taken-up", job_at(0), attempt_of(1, "FF", True), 0, None),
    ("retry-placed-not-taken-up", job_at(1, settled=1), attempt_of(2, "PP", False), 0, None),
    ("retry-ended-and-settled", job_at(2, settled=2), attempt_of(2, "FF", True), 0, 3),
]


@pytest.mark.parametrize("job,latest,after,n", [r[1:] for r in PLACED_ROWS], ids=[r[0] for r in PLACED_ROWS])
def test_an_attempt_placed_before_its_job_names_it_is_not_placed_again(
    job: JobRecord, latest: AttemptRecord, after: float, n: int | None
) -> None:
    at = T0 + timedelta(seconds=after)
    assert attempt_to_place(job, latest, at, latest.attempt) == n
    if latest.attempt > job.attempt:  # the job record alone would have that attempt placed again
        named = attempt_of(job.attempt, "FF", True) if job.attempt else None
        assert attempt_to_place(job, named, at) == latest.attempt


def test_an_attempt_that_ended_before_its_job_named_it_is_settled_and_named() -> None:
    limits = RetryLimits(platform=10, backoff=1.0)
    failed = attempt_of(2, "FF", True).model_copy(update={"outcome": JobState.FAILED, "rule": "w failed"})
    settled = settle(job_at(1, settled=1), failed, limits, T0)
    assert settled is not None
    job, _ = settled
    assert (job.attempt, job.settled) == (2, 2)
    assert settle(job, failed, limits, T0) is None  # once
    # An attempt before the one the job names is never settled over it.
    assert settle(job_at(3, settled=2), failed, limits, T0) is None


# ------------------------------------------------------------------ what the supervisor holds


@pytest.mark.parametrize(
    "letters,ended,held",
    [("RR", False, True), ("FS", True, False), ("FR", True, True), ("FP", True, True), ("SS", False, True)],
)
def test_an_attempt_is_held_until_it_and_all_its_tasks_have_ended(
    letters: str, ended: bool, held: bool
) -> None:
    """A settled attempt leaves the supervisor's view (a late event reads the stored record);
    one whose task may still run stays, so a lost node still ends that task."""
    a = attempt_of(1, letters, ended)
    assert (unsettled(a) is a) is held and (unsettled(a) is None) is not held


@pytest.mark.parametrize("state", list(JobState))
def test_a_finished_job_is_held_as_what_pruning_it_takes(state: JobState) -> None:
    job = job_at(3, state=state).model_copy(update={"updated_at": T0})
    held = Finished.held(job)
    if not state.final:
        assert held is job
        return
    assert held == Finished("j1", "u", "policy", 3, state, T0)
    assert not should_prune(held, T0 + timedelta(seconds=10), 10)
    assert should_prune(held, T0 + timedelta(seconds=11), 10)
    assert should_prune(job, T0 + timedelta(seconds=11), 10)  # the same verdict as on the record


# ------------------------------------------------------------------ maxRunTimeSec


def test_an_attempt_runs_past_its_time_limit_counted_from_its_first_task_start() -> None:
    """No limit, or no task started yet (the start timeout watches that): no deadline. With one,
    the deadline is the limit after the first task started; at it, the attempt fails as the
    user's (retryCount decides what follows), naming the limit and that task."""
    a = attempt_of(1, "RR", False)
    late = a.tasks[1].model_copy(update={"started_at": T0 + timedelta(seconds=5)})
    early = a.tasks[0].model_copy(update={"started_at": T0 + timedelta(seconds=2)})
    a = a.model_copy(update={"tasks": [early, late]})
    plain = config([role("w", 2)])
    limited = plain.model_copy(update={"maxRunTimeSec": 60})
    assert deadline(plain, a) is None and timed_out(plain, a, T0 + timedelta(days=9)) is None
    assert deadline(limited, attempt_of(1, "PP", False)) is None
    assert deadline(limited, a) == T0 + timedelta(seconds=62)
    assert timed_out(limited, a, T0 + timedelta(seconds=61.9)) is None
    ended = timed_out(limited, a, T0 + timedelta(seconds=62))
    assert ended is not None and ended.outcome == F and ended.ended_at == T0 + timedelta(seconds=62)
    assert ended.failure is not None and (ended.failure.kind, ended.failure.task) == (USER, early.key)
    assert ended.rule == f"ran past maxRunTimeSec (60 s since {early.key} started)"
    assert timed_out(limited, ended, T0 + timedelta(days=9)) is None  # ended: decided once
    assert next_step(limited, F, ended.failure, 0, 0).state == F  # retryCount 0: the job fails
    retried = limited.model_copy(update={"retryCount": 1})
    assert next_step(retried, F, ended.failure, 0, 0).charged  # a retry, charged like any failure


# ------------------------------------------------------------------ a preemption and an end on its way


@pytest.mark.parametrize(
    "first,second,outcome,state",
    [
        # (task w.0's end, w.1's end; seconds after the preemption, cause, exit code)
        ((-1, TaskCause.EXITED, 0), (-1, TaskCause.EXITED, 0), S, JobState.SUCCEEDED),  # both had ended
        ((-1, TaskCause.EXITED, 1), (5, TaskCause.KILLED, 137), F, JobState.FAILED),  # retryCount 0
        ((-1, TaskCause.EXITED, 0), (5, TaskCause.KILLED, 137), ST, JobState.WAITING),  # one of two
        ((5, TaskCause.KILLED, 143), (5, TaskCause.KILLED, 143), ST, JobState.WAITING),  # stopped
        ((2, TaskCause.EXITED, 0), (5, TaskCause.KILLED, 137), ST, JobState.WAITING),  # after it
    ],
)
def test_an_end_on_its_way_when_a_gang_was_preempted_decides_the_attempt(
    first: tuple[float, TaskCause, int],
    second: tuple[float, TaskCause, int],
    outcome: JobState,
    state: JobState,
) -> None:
    """The scheduler ends a victim's stored record as preempted when no task of it has ended
    there, but a task's end may be on its way (its report queued, the supervisor restarting):
    a job whose tasks had all succeeded was made to wait and ran again from the start, and one
    that had failed was retried past its retryCount. The ends that came decide it when they
    were the tasks' own, before the preemption."""
    from muster.services.supervisor.policy import apply_task_events
    from muster.shared.messages import TaskEvent, TaskEventKind

    cfg = config([role("w", 2)])
    running = [task("w", i, TaskState.RUNNING) for i in range(2)]
    preempted = AttemptRecord(
        job_id="j1", attempt=1, tasks=running, ended_at=T0, outcome=ST, rule="for j2", preempted_by="j2"
    )
    events = [
        TaskEvent(
            job_id="j1",
            attempt=1,
            role="w",
            index=i,
            node="n0",
            kind=TaskEventKind.EXITED,
            cause=cause,
            exit_code=code,
            at=T0 + timedelta(seconds=after),
        )
        for i, (after, cause, code) in enumerate((first, second))
    ]
    a = preempted.model_copy(update={"tasks": list(running)})
    assert apply_task_events(cfg, a, events, T0 + timedelta(seconds=6)) == [True, True]
    assert a.outcome == outcome and (a.preempted_by is None) is (outcome != ST)
    assert a.ended_at == T0  # when it ended stays
    settled = settle(job_at(1).model_copy(update={"config": cfg}), a, RetryLimits(), T0)
    assert settled is not None
    job, step = settled
    assert job.state == state
    if state == JobState.WAITING:  # preempted: back in the queue, uncharged
        assert not step.charged and "not charged" in step.reason
