"""Task limits enforced by the live validator: per job, and live tasks per user across jobs."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from muster.services.validator.service import Validator
from muster.shared import bus, client, subjects
from muster.shared.messages import JobRecord, JobState, now
from tests.test_validator import config, validator


@pytest.fixture
async def nc(nats_url: str):
    conn = await bus.connect("test", nats_url)
    yield conn
    await conn.close()


def largest_valid_job() -> bytes:
    """64 roles of 10,000 tasks: every field within its own bounds, 640,000 tasks in all."""
    job = json.loads(config("huge"))
    role = job["taskRoles"][0]
    job["taskRoles"] = [dict(role, name=f"r{i}", taskNumber=10_000) for i in range(64)]
    return json.dumps(job).encode()


async def test_a_valid_job_with_640000_tasks_is_rejected_naming_the_limit(nats_url, nc):
    async with validator(nats_url):
        _, verdict = await client.submit(nc, largest_valid_job(), timeout=30)
        _, small = await client.submit(nc, config("small"), timeout=30)
    assert verdict is not None and not verdict.accepted
    assert [(e.path, e.reason) for e in verdict.errors] == [
        ("taskRoles", "640000 tasks; the limit is 1000 per job")
    ]
    assert small is not None and small.accepted


async def submit_as(nc, user: str, name: str):
    _, verdict = await client.submit(nc, config(name), user=user, timeout=30)
    assert verdict is not None, f"no verdict for {name}"
    return verdict


async def test_live_tasks_per_user_are_limited_across_jobs(nc, monkeypatch):
    monkeypatch.setenv("MUSTER_MAX_TASKS_PER_USER", "7")
    js, buckets = await bus.ensure_jetstream(nc)
    jobs = buckets[subjects.JOBS_BUCKET]
    # Before the validator starts: one live job of carol's (2 tasks), one finished (not counted),
    # and a record that does not decode (skipped, never fatal).
    for sid, state in (("old-live", JobState.RUNNING), ("old-done", JobState.SUCCEEDED)):
        cfg = json.loads(config(sid))
        record = JobRecord(
            job_id=f"j{sid}", job_name=sid, state=state, submission_id=sid, user="carol",
            config=cfg, submitted_at=now(),
        )  # fmt: skip
        await jobs.put(record.job_id, record.to_bytes())
    await jobs.put("jgarbage", b"not a job record")

    v = Validator(nc, js, buckets)
    stop = asyncio.Event()
    task = asyncio.create_task(v.run(stop))
    try:
        first = await submit_as(nc, "carol", "c1")  # 2 + 2 live
        second = await submit_as(nc, "carol", "c2")  # 6
        third = await submit_as(nc, "carol", "c3")  # 8 > 7
        other = await submit_as(nc, "dave", "d1")
        assert (first.accepted, second.accepted, third.accepted, other.accepted) == (True, True, False, True)
        assert [(e.path, e.reason) for e in third.errors] == [
            (
                "taskRoles",
                "2 tasks would make 8 live tasks for user 'carol', who has 6; the limit is 7 per user",
            )
        ]
        # Once one of carol's jobs is finished, its tasks no longer count.
        entry = await jobs.get(first.job_id)
        done = JobRecord.from_bytes(entry.value).model_copy(update={"state": JobState.FAILED})
        await jobs.update(first.job_id, done.to_bytes(), last=entry.revision)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while v.live.of("carol") != 4 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert (await submit_as(nc, "carol", "c4")).accepted
        assert not task.done()
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)


async def test_a_redelivered_submission_is_not_counted_twice(nc, monkeypatch):
    monkeypatch.setenv("MUSTER_MAX_TASKS_PER_USER", "2")
    js, buckets = await bus.ensure_jetstream(nc)
    v = Validator(nc, js, buckets)
    first = await v.judge("once", "erin", config("e1"), now())
    again = await v.judge("once", "erin", config("e1"), now())
    # Its 2 tasks are the user's whole allowance: counted once, the redelivery is the same job.
    assert first.accepted and again.accepted and again.job_id == first.job_id


async def test_concurrent_submissions_never_overshoot_a_users_limit(nc, monkeypatch):
    """Submissions are judged concurrently (their round trips overlap); a user's live tasks are
    still counted exactly: 20 jobs of 2 tasks at once against a limit of 10 accept 5."""
    monkeypatch.setenv("MUSTER_MAX_TASKS_PER_USER", "10")
    js, buckets = await bus.ensure_jetstream(nc)
    v = Validator(nc, js, buckets)
    stop = asyncio.Event()
    task = asyncio.create_task(v.run(stop))
    try:
        verdicts = await asyncio.gather(*(submit_as(nc, "frank", f"f{i}") for i in range(20)))
        accepted = [x for x in verdicts if x.accepted]
        assert len(accepted) == 5
        assert all("the limit is 10 per user" in x.errors[0].reason for x in verdicts if not x.accepted)
        assert v.live.of("frank") == 10
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)
