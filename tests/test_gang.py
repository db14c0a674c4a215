"""Big gangs cost their size, not its square (issue 23.2): the events of one attempt that come
together are applied in one read-modify-write of its record (the registry's rendezvous, the
supervisor's attempt record), and deciding after each event costs O(1), not a pass over the gang.
Against a real nats-server; the registry and the supervisor run in this process."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator

import pytest

from services.registry.service import Registry
from services.supervisor import policy
from services.supervisor.service import Supervisor
from shared import bus, subjects
from shared.jobconfig import JobConfig
from shared.messages import (
    AttemptRecord,
    ClusterSpec,
    Endpoint,
    EndpointReported,
    JobRecord,
    JobState,
    TaskCause,
    TaskEvent,
    TaskEventKind,
    TaskState,
    TaskStatus,
    now,
)

N = 300  # tasks in the gang: each on its own node


def config(tasks: int = N, **role: object) -> JobConfig:
    return JobConfig.model_validate(
        {
            "jobName": "big",
            "image": "x",
            "taskRoles": [
                {"name": "worker", "taskNumber": tasks, "cpuNumber": 1, "memoryMB": 1024, "gpuNumber": 0}
                | {"command": "x"}
                | role
            ],
        }
    )


def gang(tasks: int = N, job_id: str = "jbig") -> AttemptRecord:
    return AttemptRecord(
        job_id=job_id,
        attempt=1,
        tasks=[TaskStatus(role="worker", role_no=0, index=i, node=f"n{i}") for i in range(tasks)],
    )


async def writes(js, bucket: str) -> int:
    return int((await js.stream_info(f"KV_{bucket}")).state.last_seq)


@contextlib.asynccontextmanager
async def running(service) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        yield
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 15)


async def until(check, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_gangs_endpoints_are_collected_in_a_few_writes_not_one_each(nats_url):
    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        attempt = gang()
        await buckets[subjects.ATTEMPTS_BUCKET].put(attempt.key, attempt.to_bytes())
        spec = await nc.subscribe(subjects.cluster_spec(attempt.job_id, 1))
        before = await writes(js, subjects.RENDEZVOUS_BUCKET)
        # Every endpoint is in the stream before the registry reads one (a gang reporting at once).
        await asyncio.gather(
            *(
                js.publish(
                    subjects.task_event(attempt.job_id, 1, "worker", i, "endpoint", f"n{i}"),
                    EndpointReported(
                        job_id=attempt.job_id,
                        attempt=1,
                        gang_size=N,
                        endpoint=Endpoint(
                            role="worker", role_no=0, index=i, node=f"n{i}", host="10.0.0.1", port=5000 + i
                        ),
                    ).to_bytes(),
                )
                for i in range(N)
            )
        )
        async with running(Registry(nc, js, buckets)):
            published = ClusterSpec.from_bytes((await spec.next_msg(timeout=30)).data)
        assert [e.port for e in published.endpoints] == [5000 + i for i in range(N)]
        made = await writes(js, subjects.RENDEZVOUS_BUCKET) - before
        # One write per endpoint on main (300); a handful of batches here.
        assert 1 <= made <= N // 20, made
    finally:
        await nc.close()


@pytest.mark.parametrize("kind", ["running", "lost"])
async def test_a_gangs_task_events_are_recorded_in_a_few_writes_not_one_each(nats_url, kind):
    """The gang starting (N running events) or its nodes lost (N ends declared by the platform):
    the attempt record is written a handful of times, and ends the attempt exactly once."""
    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        attempt = gang()
        job = JobRecord(
            job_id=attempt.job_id,
            job_name="big",
            submission_id="s",
            user="u",
            config=config(),
            state=JobState.WAITING,
            attempt=1,
            submitted_at=now(),
        )
        await buckets[subjects.JOBS_BUCKET].put(job.job_id, job.to_bytes())
        await buckets[subjects.ATTEMPTS_BUCKET].put(attempt.key, attempt.to_bytes())
        before = await writes(js, subjects.ATTEMPTS_BUCKET)
        running_ = kind == "running"
        for i in range(N):
            ev = TaskEvent(
                job_id=attempt.job_id,
                attempt=1,
                role="worker",
                index=i,
                node=f"n{i}",
                kind=TaskEventKind.RUNNING if running_ else TaskEventKind.EXITED,
                cause=None if running_ else TaskCause.NODE_LOST,
                reason="" if running_ else f"node n{i} lost",
            )
            sender = f"n{i}" if running_ else subjects.PLATFORM
            await js.publish(
                subjects.task_event(attempt.job_id, 1, "worker", i, ev.kind, sender), ev.to_bytes()
            )
        kv = buckets[subjects.ATTEMPTS_BUCKET]

        async def all_recorded() -> bool:
            record = AttemptRecord.from_bytes((await kv.get(attempt.key)).value)
            wanted = TaskState.RUNNING if running_ else TaskState.FAILED
            return all(t.state == wanted for t in record.tasks)

        async with running(Supervisor(nc, js, buckets)):
            await until(all_recorded)
        record = AttemptRecord.from_bytes((await kv.get(attempt.key)).value)
        assert record.ended == (not running_)
        if not running_:
            assert record.failure is not None and record.failure.task == "worker.0"
        made = await writes(js, subjects.ATTEMPTS_BUCKET) - before
        assert 1 <= made <= N // 20, made  # one write per event on main (300)
    finally:
        await nc.close()


def test_events_applied_together_decide_as_when_applied_one_by_one():
    """`apply_task_events` (one tally for the batch) against `apply_task_event` per event (a
    fresh decision over the whole gang each time): the same records, event by event, over random
    gangs, rules and event orders."""
    rng = random.Random(7)
    at = now()
    for _ in range(300):
        tasks = rng.randint(1, 12)
        rules: dict[str, object] = rng.choice(
            [{}, {"minFailedTaskCount": 2}, {"minSucceededTaskCount": 2}, {"minFailedTaskCount": 3}]
        )
        cfg = config(tasks, **rules)
        if rng.random() < 0.3:
            cfg = cfg.model_copy(update={"killAllOnCompletedTaskNumber": rng.randint(1, tasks)})
        events = []
        for _ in range(rng.randint(1, 3 * tasks)):
            i = rng.randrange(tasks + 1)  # now and then a task that does not exist
            kind = rng.choice([TaskEventKind.RUNNING, TaskEventKind.EXITED])
            cause = rng.choice([TaskCause.EXITED, TaskCause.KILLED, TaskCause.NODE_LOST])
            events.append(
                TaskEvent(
                    job_id="j",
                    attempt=1,
                    role="worker",
                    index=i,
                    node=f"n{i}",
                    kind=kind,
                    cause=cause if kind == TaskEventKind.EXITED else None,
                    exit_code=rng.choice([0, 1]) if kind == TaskEventKind.EXITED else None,
                )
            )
        one_by_one = gang(tasks, "j")
        together = one_by_one.model_copy(deep=True)
        changed = [policy.apply_task_event(cfg, one_by_one, ev, at) for ev in events]
        assert policy.apply_task_events(cfg, together, events, at) == changed
        assert together == one_by_one
