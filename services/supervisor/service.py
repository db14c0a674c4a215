"""The supervisor: follows task states and enforces the job's completion policy.

It consumes task events (running, exited) through one durable consumer shared by all
replicas, records each task's state on its attempt (KV `muster_attempts`), moves the job to
RUNNING, and when `policy.decide` says the attempt has ended: marks it ended, sends kill orders
for the tasks still alive, and moves the job to its final state. Every write is a
read-modify-write with the revision read; replaying an event changes nothing."""

from __future__ import annotations

import asyncio
import contextlib

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter

from services.supervisor.policy import decide, task_state_for
from shared import bus, subjects
from shared.messages import (
    AttemptRecord,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    KillOrder,
    TaskEvent,
    TaskEventKind,
    TaskState,
    now,
)
from shared.subjects import Headers

log = structlog.get_logger(service="supervisor")
JOBS_ENDED = Counter("muster_jobs_ended_total", "Jobs that reached a final state", ["state"])


class Supervisor:
    def __init__(
        self, nc: NATS, js: JetStreamContext, buckets: dict[str, KeyValue], kill_grace: float = 10.0
    ):
        self.nc, self.js, self.kill_grace = nc, js, kill_grace
        self.jobs = buckets[subjects.JOBS_BUCKET]
        self.attempts = buckets[subjects.ATTEMPTS_BUCKET]

    @classmethod
    async def build(cls, nc: NATS) -> Supervisor:
        js, buckets = await bus.ensure_jetstream(nc)
        return cls(nc, js, buckets)

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.js.pull_subscribe(
            "",
            durable=subjects.SUPERVISOR_CONSUMER,
            stream=subjects.EVENTS_STREAM,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=30,
                max_deliver=-1,
                filter_subjects=subjects.TASK_STATES,
            ),
        )
        while not stop.is_set():
            try:
                msgs = await sub.fetch(64, timeout=1)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except Exception as exc:
                log.warning("supervisor.fetch_failed", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await self.handle(msg)

    async def handle(self, msg: Msg) -> None:
        try:
            await self.on_task_event(TaskEvent.from_bytes(msg.data))
            await msg.ack()
        except Exception:
            log.error("supervisor.failed", subject=msg.subject, exc_info=True)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1)

    async def on_task_event(self, ev: TaskEvent) -> None:
        key = f"{ev.job_id}.{ev.attempt}"
        try:
            job = JobRecord.from_bytes((await self.jobs.get(ev.job_id)).value)
        except KeyNotFoundError:
            log.warning("supervisor.unknown_job", job_id=ev.job_id)
            return
        ended: list[AttemptRecord] = []

        def record(attempt: AttemptRecord) -> AttemptRecord | None:
            ended.clear()
            task = attempt.task(ev.role, ev.index)
            if ev.kind == TaskEventKind.RUNNING:
                if task.state != TaskState.PLACED:
                    return None
                task.state, task.started_at = TaskState.RUNNING, ev.at
            else:
                if task.state.ended:
                    return None
                task.state = task_state_for(ev.exit_code, ev.reason)
                task.exit_code, task.reason, task.last_lines, task.ended_at = (
                    ev.exit_code,
                    ev.reason,
                    ev.last_lines,
                    ev.at,
                )
            if not attempt.ended:
                decision = decide(job.config, attempt.tasks)
                if decision.outcome is not None:
                    attempt.ended_at, attempt.outcome, attempt.rule = now(), decision.outcome, decision.rule
                    ended.append(attempt)
            return attempt

        try:
            attempt = await bus.cas_update(self.attempts, key, AttemptRecord.from_bytes, record)
        except KeyNotFoundError:
            log.warning("supervisor.unknown_attempt", attempt=key)
            return
        if ev.kind == TaskEventKind.RUNNING and attempt is not None:
            await self.set_job(ev.job_id, ev.attempt, JobState.RUNNING, "running", JobEventKind.RUNNING)
        if ended:
            done = ended[0]
            await self.kill_rest(done)
            assert done.outcome is not None
            await self.set_job(done.job_id, done.attempt, done.outcome, done.rule, JobEventKind.ENDED)

    async def kill_rest(self, attempt: AttemptRecord) -> None:
        nodes = sorted({t.node for t in attempt.tasks if not t.state.ended})
        order = KillOrder(
            job_id=attempt.job_id, attempt=attempt.attempt, reason=attempt.rule, grace=self.kill_grace
        )
        for node in nodes:
            await self.js.publish(
                subjects.kill(node),
                order.to_bytes(),
                headers={Headers.MSG_ID: f"kill:{attempt.key}:{node}"},
            )

    async def set_job(
        self, job_id: str, attempt: int, state: JobState, reason: str, kind: JobEventKind
    ) -> None:
        def change(job: JobRecord) -> JobRecord | None:
            if job.attempt != attempt or job.state.final or job.state == state:
                return None
            return job.model_copy(update={"state": state, "reason": reason, "updated_at": now()})

        job = await bus.cas_update(self.jobs, job_id, JobRecord.from_bytes, change)
        if job is None:
            return
        if state.final:
            JOBS_ENDED.labels(state).inc()
            # The name is free again for a new job (the validator checks the holder's state).
        await self.js.publish(
            subjects.job_event(job_id, kind),
            JobEvent(
                job_id=job_id, job_name=job.job_name, kind=kind, state=state, attempt=attempt, detail=reason
            ).to_bytes(),
            headers={Headers.MSG_ID: f"{job_id}:{attempt}:{kind}"},
        )
        log.info("supervisor.job_state", job_id=job_id, attempt=attempt, state=state, reason=reason)
