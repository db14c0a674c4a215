"""A placement handed from the scheduler leader to the supervisor (issue 28): the leader only
creates the attempt record; the supervisor, watching attempts, moves the job record to it, says
where it was placed (the reason and one `placed` event), and ends the attempt of a job that was
killed while it was being placed. Each against a real nats-server and a running supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta

import pytest

from muster.services.supervisor.service import Supervisor
from muster.shared import bus, subjects
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import (
    AttemptRecord,
    JobRecord,
    JobState,
    KillOrder,
    TaskSpec,
    TaskState,
    TaskStatus,
    now,
)
from tests.conftest import stored

CONFIG = JobConfig.model_validate(
    {
        "jobName": "handoff",
        "image": "busybox",
        "taskRoles": [
            {"name": "w", "taskNumber": 2, "cpuNumber": 1, "memoryMB": 256, "gpuNumber": 0, "command": "x"}
        ],
    }
)


def job(job_id: str, **update: object) -> JobRecord:
    record = JobRecord(
        job_id=job_id, job_name=job_id, submission_id=job_id, user="u", config=CONFIG, submitted_at=now()
    )
    return record.model_copy(update=update)


def placed(job_id: str, n: int) -> AttemptRecord:
    return AttemptRecord(
        job_id=job_id,
        attempt=n,
        tasks=[TaskStatus.placed(TaskSpec(role="w", role_no=0, index=i, node=f"n{i}")) for i in range(2)],
    )


class Bus:
    """A supervisor running on the bus, its buckets, and what was published on some subjects."""

    def __init__(self, nc, buckets) -> None:  # type: ignore[no-untyped-def]
        self.nc, self.buckets = nc, buckets
        self.seen: dict[str, list[bytes]] = {}

    async def listen(self, subject: str) -> None:
        async def got(msg) -> None:  # type: ignore[no-untyped-def]
            self.seen.setdefault(subject, []).append(msg.data)

        await self.nc.subscribe(subject, cb=got)

    async def put(self, bucket: str, key: str, record: JobRecord | AttemptRecord) -> None:
        await self.buckets[bucket].put(key, record.to_bytes())

    async def record(self, bucket: str, key: str, model: type) -> JobRecord | AttemptRecord:
        return model.from_bytes((await self.buckets[bucket].get(key)).value)

    async def until(self, check: Callable[[], object], timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if await check():  # type: ignore[misc]
                    return
            except Exception:
                pass
            assert time.monotonic() < deadline, "not within the timeout"
            await asyncio.sleep(0.05)


@pytest.fixture
async def running(nats_url) -> AsyncIterator[Bus]:  # type: ignore[no-untyped-def]
    nc = await bus.connect("test", nats_url)
    js, buckets = await bus.setup(nc)
    supervisor = Supervisor(nc, js, buckets)
    stop = asyncio.Event()
    task = asyncio.create_task(supervisor.run(stop))
    try:
        yield Bus(nc, buckets)
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 15)
        await nc.close()


async def test_a_placed_attempt_moves_its_job_to_it_with_one_placed_event(running: Bus):
    b = running
    await b.listen(subjects.job_event("jh1", "placed"))
    await b.put(subjects.JOBS_BUCKET, "jh1", job("jh1"))
    await b.put(subjects.ATTEMPTS_BUCKET, "jh1.1", placed("jh1", 1))

    async def moved() -> bool:
        record = await b.record(subjects.JOBS_BUCKET, "jh1", JobRecord)
        return record.attempt == 1

    await b.until(moved)
    record = await b.record(subjects.JOBS_BUCKET, "jh1", JobRecord)
    assert record.state == JobState.WAITING and record.reason == "placed on n0, n1; starting tasks"
    # The attempt's record written again (its tasks' progress) takes nothing up twice.
    await b.put(subjects.ATTEMPTS_BUCKET, "jh1.1", placed("jh1", 1))
    await asyncio.sleep(1.5)  # the once-a-second check too
    (event,) = b.seen[subjects.job_event("jh1", "placed")]
    assert json.loads(event)["attempt"] == 1 and "n0, n1" in json.loads(event)["detail"]
    assert (await b.record(subjects.JOBS_BUCKET, "jh1", JobRecord)).attempt == 1


async def test_an_attempt_placed_for_a_job_killed_meanwhile_is_ended_and_its_tasks_told_to_stop(
    running: Bus,
):
    """The leader saw the job waiting and placed it; the kill had already ended the job. Nothing
    of the attempt may run on: it ends as stopped, and every node of it gets a kill order."""
    b = running
    for node in ("n0", "n1"):
        await b.listen(subjects.kill(node))
    await b.listen(subjects.job_event("jh2", "placed"))
    await b.put(subjects.JOBS_BUCKET, "jh2", job("jh2", state=JobState.STOPPED, reason="killed by u"))
    await b.put(subjects.ATTEMPTS_BUCKET, "jh2.1", placed("jh2", 1))

    async def ended() -> bool:
        attempt = await b.record(subjects.ATTEMPTS_BUCKET, "jh2.1", AttemptRecord)
        return attempt.ended

    await b.until(ended)
    attempt = await b.record(subjects.ATTEMPTS_BUCKET, "jh2.1", AttemptRecord)
    assert attempt.outcome == JobState.STOPPED and attempt.rule == "killed by u"

    async def told() -> bool:
        return all(b.seen.get(subjects.kill(node)) for node in ("n0", "n1"))

    await b.until(told)
    order = KillOrder.from_bytes(b.seen[subjects.kill("n0")][0])
    assert (order.job_id, order.attempt) == ("jh2", 1)
    record = await b.record(subjects.JOBS_BUCKET, "jh2", JobRecord)
    assert record.state == JobState.STOPPED and record.attempt == 0  # the ended job is left as it is
    assert not b.seen.get(subjects.job_event("jh2", "placed"))


async def test_a_retry_placed_is_taken_up_and_an_older_attempt_never_over_it(running: Bus):
    b = running
    await b.put(subjects.JOBS_BUCKET, "jh3", job("jh3", attempt=1, settled=1, reason="retrying"))
    await b.put(subjects.ATTEMPTS_BUCKET, "jh3.2", placed("jh3", 2))

    async def moved() -> bool:
        return (await b.record(subjects.JOBS_BUCKET, "jh3", JobRecord)).attempt == 2

    await b.until(moved)
    # Attempt 1 written again (a late report of it): the job stays on attempt 2.
    await b.put(subjects.ATTEMPTS_BUCKET, "jh3.1", placed("jh3", 1))
    await asyncio.sleep(1.5)
    assert (await b.record(subjects.JOBS_BUCKET, "jh3", JobRecord)).attempt == 2


@pytest.fixture
async def alone(nats_url) -> AsyncIterator[tuple[Supervisor, Bus]]:  # type: ignore[no-untyped-def]
    """A supervisor not running (its methods called one by one) and its buckets."""
    nc = await bus.connect("test", nats_url)
    js, buckets = await bus.setup(nc)
    try:
        yield Supervisor(nc, js, buckets), Bus(nc, buckets)
    finally:
        await nc.close()


async def history(b: Bus, job_id: str, kinds: tuple[str, ...]) -> list[str]:
    """The kinds of the job's events published so far, in order (its stream)."""
    out = [json.loads(m.data)["kind"] for m in await stored(b.nc.jetstream(), subjects.job_events(job_id))]
    return [k for k in out if k in kinds]


async def test_a_task_running_before_its_placement_was_taken_up_names_the_attempt_and_tells_placed_first(
    alone: tuple[Supervisor, Bus],
):
    supervisor, b = alone
    await b.put(subjects.JOBS_BUCKET, "jh4", job("jh4"))
    attempt = placed("jh4", 1)
    await b.put(subjects.ATTEMPTS_BUCKET, attempt.key, attempt)
    await supervisor.set_running(attempt)
    record = await b.record(subjects.JOBS_BUCKET, "jh4", JobRecord)
    assert (record.state, record.attempt) == (JobState.RUNNING, 1)
    assert await history(b, "jh4", ("placed", "running")) == ["placed", "running"]


async def test_an_attempt_that_ended_before_its_placement_was_taken_up_is_settled_with_its_history(
    alone: tuple[Supervisor, Bus],
):
    """Its tasks failed before the supervisor moved the job to it (an image that is not there):
    it is settled all the same, and the history says where it was placed before it says what
    came next."""
    supervisor, b = alone
    await b.put(subjects.JOBS_BUCKET, "jh5", job("jh5"))
    attempt = placed("jh5", 1)
    failed = [t.model_copy(update={"state": TaskState.FAILED, "exit_code": 1}) for t in attempt.tasks]
    ended = attempt.model_copy(
        update={"tasks": failed, "ended_at": now(), "outcome": JobState.FAILED, "rule": "w failed"}
    )
    await b.put(subjects.ATTEMPTS_BUCKET, ended.key, ended)
    await supervisor.end_attempt(ended)
    record = await b.record(subjects.JOBS_BUCKET, "jh5", JobRecord)
    assert (record.attempt, record.settled) == (1, 1) and record.state == JobState.FAILED, record
    assert await history(b, "jh5", ("placed", "retrying", "ended")) == ["placed", "ended"]


async def test_a_task_an_elastic_role_added_is_taken_up_while_the_mirror_still_lacks_it(
    alone: tuple[Supervisor, Bus],
):
    """The scheduler adds w.2 to the attempt's record, then sends its order; its running report
    can come before the supervisor's mirror has the write. It was refused as naming a task the
    attempt does not have (and failed as never started 10 minutes later): the stored record
    decides. A report for it from another node is still refused."""
    from muster.shared import consume
    from muster.shared.messages import TaskEvent, TaskEventKind

    supervisor, b = alone
    await b.put(subjects.JOBS_BUCKET, "jh9", job("jh9", state=JobState.RUNNING, attempt=1, settled=0))
    before = placed("jh9", 1)
    grown = before.model_copy(
        update={
            "tasks": [*before.tasks, TaskStatus.placed(TaskSpec(role="w", role_no=0, index=2, node="n2"))]
        }
    )
    await b.put(subjects.ATTEMPTS_BUCKET, grown.key, grown)
    supervisor.view_attempts[before.key] = before  # the mirror, a write behind

    def report(by: str) -> consume.Sent[TaskEvent]:
        event = TaskEvent(job_id="jh9", attempt=1, role="w", index=2, node="n2", kind=TaskEventKind.RUNNING)
        return consume.Sent(by, subjects.task_event("jh9", 1, "w", 2, TaskEventKind.RUNNING, by), event)

    await supervisor.apply_events(grown.key, [report("n0")])  # forged: n0 did not get w.2
    stored = await b.record(subjects.ATTEMPTS_BUCKET, grown.key, AttemptRecord)
    assert [t.state for t in stored.tasks] == [TaskState.PLACED] * 3
    await supervisor.apply_events(grown.key, [report("n2")])
    stored = await b.record(subjects.ATTEMPTS_BUCKET, grown.key, AttemptRecord)
    assert [t.state for t in stored.tasks] == [TaskState.PLACED, TaskState.PLACED, TaskState.RUNNING]


async def test_an_attempt_that_ended_while_its_job_was_never_settled_is_settled_later(
    alone: tuple[Supervisor, Bus],
):
    """Every delivery of the event that ended jh10.1 failed to settle its job (the bus away past
    the retries): the mirror drops an attempt once it and its tasks ended, so nothing looked at
    it again and the job stayed running for ever. The supervisor's minute check settles it."""
    supervisor, b = alone
    running = job("jh10", state=JobState.RUNNING, attempt=1, settled=0)
    await b.put(subjects.JOBS_BUCKET, "jh10", running)
    attempt = placed("jh10", 1)
    done = [t.model_copy(update={"state": TaskState.SUCCEEDED, "exit_code": 0}) for t in attempt.tasks]
    update = {"tasks": done, "outcome": JobState.SUCCEEDED, "rule": "all tasks ended"}
    supervisor.view_jobs["jh10"] = running  # as mirrored; the attempt is not (ended: dropped)
    # Ended just now: its event's handler is settling it (the check leaves it alone)...
    await b.put(
        subjects.ATTEMPTS_BUCKET, attempt.key, attempt.model_copy(update={**update, "ended_at": now()})
    )
    await supervisor.settle_missed()
    assert (await b.record(subjects.JOBS_BUCKET, "jh10", JobRecord)).settled == 0
    # ... ended minutes ago and still not settled: missed, settled now.
    ended = attempt.model_copy(update={**update, "ended_at": now() - timedelta(minutes=3)})
    await b.put(subjects.ATTEMPTS_BUCKET, ended.key, ended)
    await supervisor.settle_missed()
    record = await b.record(subjects.JOBS_BUCKET, "jh10", JobRecord)
    assert (record.state, record.settled) == (JobState.SUCCEEDED, 1), record
