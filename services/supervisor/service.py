"""The supervisor: follows task states and enforces the job's completion policy.

It consumes task events (running, exited) through one durable consumer shared by all
replicas, records each task's state on its attempt (KV `muster_attempts`), moves the job to
RUNNING, and when `policy.decide` says the attempt has ended: marks it ended, sends kill orders
for the tasks still alive, and moves the job to its final state. Every write is a
read-modify-write with the revision read; replaying an event changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
from datetime import timedelta

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, NoKeysError
from nats.js.kv import KeyValue
from prometheus_client import Counter

from services.supervisor.policy import NextStep, RetryLimits, classify, decide, next_step, task_state_for
from shared import bus, subjects
from shared.messages import (
    AttemptRecord,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    KillOrder,
    KillRequest,
    NodeInfo,
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
        self,
        nc: NATS,
        js: JetStreamContext,
        buckets: dict[str, KeyValue],
        kill_grace: float = 10.0,
        limits: RetryLimits | None = None,
    ):
        self.nc, self.js, self.kill_grace = nc, js, kill_grace
        self.limits = limits or RetryLimits(
            platform=int(os.environ.get("MUSTER_PLATFORM_RETRIES", "10")),
            backoff=float(os.environ.get("MUSTER_RETRY_BACKOFF", "1")),
        )
        self.jobs = buckets[subjects.JOBS_BUCKET]
        self.attempts = buckets[subjects.ATTEMPTS_BUCKET]
        self.nodes = buckets[subjects.NODES_BUCKET]
        self.node_timeout = bus.node_timeout()

    @classmethod
    async def build(cls, nc: NATS) -> Supervisor:
        js, buckets = await bus.ensure_jetstream(nc)
        return cls(nc, js, buckets)

    async def run(self, stop: asyncio.Event) -> None:
        events = await bus.durable(
            self.js,
            "",
            subjects.SUPERVISOR_CONSUMER,
            subjects.EVENTS_STREAM,
            filter_subjects=subjects.TASK_STATES,
        )
        kills = await bus.durable(
            self.js, subjects.KILL, subjects.SUPERVISOR_KILL_CONSUMER, subjects.SUBMISSIONS_STREAM
        )
        await asyncio.gather(
            bus.consume(events, bus.acked(self.handle, log), stop, log),
            bus.consume(kills, bus.acked(self.handle_kill, log), stop, log, 16),
            self.watch_nodes(stop),
        )

    async def handle(self, msg: Msg) -> None:
        await self.on_task_event(TaskEvent.from_bytes(msg.data))

    async def on_task_event(self, ev: TaskEvent) -> None:
        key = f"{ev.job_id}.{ev.attempt}"
        try:
            job = JobRecord.from_bytes((await self.jobs.get(ev.job_id)).value)
        except KeyNotFoundError:
            log.warning("supervisor.unknown_job", job_id=ev.job_id)
            return

        def record(attempt: AttemptRecord) -> AttemptRecord | None:
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
                    if decision.outcome == JobState.FAILED:
                        attempt.failure = classify(attempt.tasks)
            return attempt

        try:
            attempt = await bus.cas_update(self.attempts, key, AttemptRecord.from_bytes, record)
            if attempt is None:  # a replayed event: nothing new, but finish what may be unfinished
                attempt = AttemptRecord.from_bytes((await self.attempts.get(key)).value)
        except KeyNotFoundError:
            log.warning("supervisor.unknown_attempt", attempt=key)
            return
        if ev.kind == TaskEventKind.RUNNING and not attempt.ended:
            await self.set_running(ev.job_id, ev.attempt)
        if attempt.ended:
            await self.end_attempt(attempt)

    # ------------------------------------------------------------ kill

    async def handle_kill(self, msg: Msg) -> None:
        await self.kill_job(KillRequest.from_bytes(msg.data))

    async def kill_job(self, req: KillRequest) -> None:
        """The job becomes STOPPED (not retried), its current attempt ends, its tasks are told to
        stop: SIGTERM, then SIGKILL after the grace. A job already ended is left as it is."""
        reason = f"killed by {req.user}"

        def stop_job(job: JobRecord) -> JobRecord | None:
            if job.state.final:
                return None
            return job.model_copy(
                update={
                    "state": JobState.STOPPED,
                    "reason": reason,
                    "settled": job.attempt,
                    "updated_at": now(),
                }
            )

        try:
            job = await bus.cas_update(self.jobs, req.job_id, JobRecord.from_bytes, stop_job)
        except KeyNotFoundError:
            log.warning("supervisor.kill_unknown_job", job_id=req.job_id)
            return
        if job is None:
            return
        if job.attempt:

            def end(a: AttemptRecord) -> AttemptRecord | None:
                if a.ended:
                    return None
                return a.model_copy(update={"ended_at": now(), "outcome": JobState.STOPPED, "rule": reason})

            with contextlib.suppress(KeyNotFoundError):
                await bus.cas_update(
                    self.attempts, f"{job.job_id}.{job.attempt}", AttemptRecord.from_bytes, end
                )
                attempt = AttemptRecord.from_bytes(
                    (await self.attempts.get(f"{job.job_id}.{job.attempt}")).value
                )
                await self.kill_rest(attempt, grace=req.grace)
        JOBS_ENDED.labels(JobState.STOPPED).inc()
        await self.event(job, JobEventKind.KILLED, reason)

    # ------------------------------------------------------------ node loss

    async def watch_nodes(self, stop: asyncio.Event) -> None:
        """Every second: a node whose heartbeat is older than `node_timeout` is lost. Each of its
        tasks in a live attempt is reported as exited with a platform failure, which ends (and
        retries) the attempt through the same path as any other exit."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            try:
                await self.check_nodes()
            except Exception as exc:
                log.warning("supervisor.node_check_failed", error=str(exc) or type(exc).__name__)

    async def check_nodes(self) -> None:
        try:
            names = await self.nodes.keys()
        except NoKeysError:
            return
        # Lost, and recently: a node silent for long was handled when it went silent, and gets
        # no new work since, so its attempts need not be scanned every second forever.
        cutoff = now() - timedelta(seconds=self.node_timeout)
        forgotten = cutoff - timedelta(seconds=3 * self.node_timeout + 10)
        lost: dict[str, NodeInfo] = {}
        for name in names:
            with contextlib.suppress(KeyNotFoundError):
                info = NodeInfo.from_bytes((await self.nodes.get(name)).value)
                if forgotten <= info.heartbeat_at < cutoff:
                    lost[name] = info
        if not lost:
            return
        try:
            keys = await self.attempts.keys()
        except NoKeysError:
            return
        for key in keys:
            try:
                attempt = AttemptRecord.from_bytes((await self.attempts.get(key)).value)
            except KeyNotFoundError:
                continue
            if attempt.ended:
                continue
            for task in attempt.tasks:
                if task.node in lost and not task.state.ended:
                    silent = (now() - lost[task.node].heartbeat_at).total_seconds()
                    await self.js.publish(
                        subjects.task_event(attempt.job_id, attempt.attempt, task.role, task.index, "exited"),
                        TaskEvent(
                            job_id=attempt.job_id,
                            attempt=attempt.attempt,
                            role=task.role,
                            index=task.index,
                            node=task.node,
                            kind=TaskEventKind.EXITED,
                            reason=f"platform: node {task.node} lost (no heartbeat for {silent:.0f}s)",
                        ).to_bytes(),
                        headers={Headers.MSG_ID: f"lost:{attempt.key}.{task.key}"},
                    )
                    log.warning("supervisor.task_lost", attempt=attempt.key, task=task.key, node=task.node)

    # ------------------------------------------------------------ shared

    async def kill_rest(self, attempt: AttemptRecord, grace: float | None = None) -> None:
        nodes = sorted({t.node for t in attempt.tasks if not t.state.ended})
        order = KillOrder(
            job_id=attempt.job_id,
            attempt=attempt.attempt,
            reason=attempt.rule,
            grace=self.kill_grace if grace is None else grace,
        )
        for node in nodes:
            await self.js.publish(
                subjects.kill(node),
                order.to_bytes(),
                headers={Headers.MSG_ID: f"kill:{attempt.key}:{node}"},
            )

    async def set_running(self, job_id: str, attempt: int) -> None:
        def change(job: JobRecord) -> JobRecord | None:
            if job.attempt != attempt or job.state != JobState.WAITING or job.settled >= attempt:
                return None
            return job.model_copy(
                update={"state": JobState.RUNNING, "reason": "running", "updated_at": now()}
            )

        job = await bus.cas_update(self.jobs, job_id, JobRecord.from_bytes, change)
        if job is not None:
            await self.event(job, JobEventKind.RUNNING, "running")

    async def end_attempt(self, attempt: AttemptRecord) -> None:
        """Apply an ended attempt to its job: kill what is left of the gang, then end the job or
        make it wait for its next attempt. Idempotent: `JobRecord.settled` records it was done."""
        await self.kill_rest(attempt)
        steps: list[NextStep] = []

        def change(job: JobRecord) -> JobRecord | None:
            steps.clear()
            if job.attempt != attempt.attempt or job.settled >= attempt.attempt or job.state.final:
                return None
            assert attempt.outcome is not None
            step = next_step(
                job.config, attempt.outcome, attempt.failure, job.retries, job.platform_retries, self.limits
            )
            if step.state == JobState.SUCCEEDED:
                step = NextStep(step.state, attempt.rule)  # which rule ended it
            steps.append(step)
            update: dict = {
                "state": step.state,
                "reason": step.reason,
                "settled": attempt.attempt,
                "updated_at": now(),
            }
            if step.state == JobState.WAITING:
                update["retries"] = job.retries + (1 if step.charged else 0)
                update["platform_retries"] = job.platform_retries + (1 if step.platform else 0)
                update["not_before"] = now() + timedelta(seconds=step.delay)
            return job.model_copy(update=update)

        job = await bus.cas_update(self.jobs, attempt.job_id, JobRecord.from_bytes, change)
        if job is None:
            return
        step = steps[0]
        if step.state == JobState.WAITING:
            with contextlib.suppress(KeyNotFoundError):
                await bus.cas_update(
                    self.attempts,
                    attempt.key,
                    AttemptRecord.from_bytes,
                    lambda a: a.model_copy(update={"charged": step.charged}) if a.charged is None else None,
                )
            await self.event(job, JobEventKind.RETRYING, step.reason)
        else:
            JOBS_ENDED.labels(step.state).inc()
            await self.event(job, JobEventKind.ENDED, step.reason)

    async def event(self, job: JobRecord, kind: JobEventKind, detail: str) -> None:
        await self.js.publish(
            subjects.job_event(job.job_id, kind),
            JobEvent(
                job_id=job.job_id,
                job_name=job.job_name,
                kind=kind,
                state=job.state,
                attempt=job.attempt,
                detail=detail,
            ).to_bytes(),
            headers={Headers.MSG_ID: f"{job.job_id}:{job.attempt}:{kind}"},
        )
        log.info(
            "supervisor.job_state", job_id=job.job_id, attempt=job.attempt, state=job.state, reason=detail
        )
