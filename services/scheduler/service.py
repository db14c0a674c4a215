"""The scheduler service: one active leader places waiting jobs as gangs; standbys wait.

Leadership is a lease in the KV bucket `muster_leases` (its entries expire LEASE_TTL seconds
after their last write): the leader renews it every second and stops placing the moment a
renewal fails; the renewal runs in a task of its own and a plan is bounded (the backfill window),
so a large queue never costs the lease. A standby creates the key once it has expired. The leader's
view (nodes, jobs, attempts) is kept by KV watchers (records that do not decode are skipped and
counted), so a new leader rebuilds it from the bus, and every placement is fenced: the attempt
record `<job>.<n>` is created only if absent, so no attempt is placed twice.

The view is incremental (`view.View`): allocations follow the attempt records change by change,
nodes join and leave the placement index as their records do, and only a change a plan could
see wakes a cycle. A cycle plans the waiting queue with the indexed core (`Cluster.plan`, a
bounded backfill window behind the head) and commits its placements and reasons concurrently,
so the bus's round trips overlap. When a job may be placed is the supervisor policy's
`attempt_to_place`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge, Histogram

from services.scheduler import placement
from services.scheduler.avoid import nodes_to_avoid, plan_around
from services.scheduler.view import Job, View
from shared import bus, subjects
from shared.jobconfig import REDACTED, with_secrets
from shared.messages import (
    Assignment,
    AttemptRecord,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    NodeInfo,
    TaskSpec,
    TaskState,
    TaskStatus,
    node_refusal,
    now,
)
from shared.store import Store
from shared.subjects import Headers

log = structlog.get_logger(service="scheduler")
PLACED = Counter("muster_scheduler_placements_total", "Attempts placed")
PENDING = Gauge("muster_scheduler_pending_jobs", "Jobs waiting for resources")
LEADER = Gauge("muster_scheduler_leader", "1 while this replica is the active scheduler")
CYCLE_SECONDS = Histogram(
    "muster_scheduler_plan_seconds",
    "Time to plan the waiting queue, once per cycle",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
RENEW_EVERY = 1.0  # seconds between lease renewals, whatever a cycle is doing
# Jobs behind the head that one plan tries at most (Slurm's bf_max_job_test); later ones wait.
BACKFILL_WINDOW = int(os.environ.get("MUSTER_BACKFILL_WINDOW", "500"))
IN_FLIGHT = 128  # commits and reason writes of one cycle in flight at once


class Scheduler:
    def __init__(
        self, nc: NATS, js: JetStreamContext, buckets: dict[str, KeyValue], node_timeout: float | None = None
    ):
        self.nc, self.js = nc, js
        self.node_timeout = bus.node_timeout() if node_timeout is None else node_timeout
        self.kv_nodes = Store(buckets[subjects.NODES_BUCKET], NodeInfo, check=node_refusal)
        self.kv_jobs = Store(buckets[subjects.JOBS_BUCKET], JobRecord)
        self.kv_attempts = Store(buckets[subjects.ATTEMPTS_BUCKET], AttemptRecord)
        self.secrets = buckets[subjects.SECRETS_BUCKET]
        self.leases = buckets[subjects.LEASES_BUCKET]
        self.identity = uuid.uuid4().hex[:12]
        self.view = View(self.node_timeout)
        self.nodes, self.jobs, self.attempts = self.view.nodes, self.view.jobs, self.view.attempts
        self.wake = asyncio.Event()
        self.synced = {name: asyncio.Event() for name in ("nodes", "jobs", "attempts")}

    @classmethod
    async def build(cls, nc: NATS) -> Scheduler:
        js, buckets = await bus.setup(nc)
        return cls(nc, js, buckets)

    # ------------------------------------------------------------ leadership

    async def run(self, stop: asyncio.Event) -> None:
        def node(key: str) -> None:
            if self.view.node_changed(key, now()):
                self.wake.set()

        def job(key: str) -> None:
            if self.view.job_changed(key):
                self.wake.set()

        def attempt(key: str) -> None:
            if self.view.attempt_changed(key):
                self.wake.set()

        watchers = [
            asyncio.create_task(self.kv_nodes.mirror(self.nodes, self.synced["nodes"], node)),
            asyncio.create_task(self.kv_jobs.mirror(self.jobs, self.synced["jobs"], job, Job.of)),
            asyncio.create_task(self.kv_attempts.mirror(self.attempts, self.synced["attempts"], attempt)),
        ]
        try:
            while not stop.is_set():
                revision = await self._acquire()
                if revision is None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 1.0)
                    continue
                log.info("scheduler.leader", identity=self.identity)
                LEADER.set(1)
                try:
                    await self._lead(stop, revision)
                finally:
                    LEADER.set(0)
        finally:
            for w in watchers:
                w.cancel()
            with contextlib.suppress(Exception):
                await self.leases.delete(subjects.SCHEDULER_LEASE)  # hand over at once

    async def _acquire(self) -> int | None:
        try:
            return await self.leases.create(subjects.SCHEDULER_LEASE, self.identity.encode())
        except KeyWrongLastSequenceError:
            return None
        except Exception as exc:
            log.warning("scheduler.lease_error", error=str(exc) or type(exc).__name__)
            return None

    async def _renew(self, revision: int, lost: asyncio.Event) -> None:
        """Renew the lease every second in a task of its own, so no cycle can delay it; set
        `lost` the moment a renewal fails."""
        while True:
            await asyncio.sleep(RENEW_EVERY)
            try:
                revision = await self.leases.update(
                    subjects.SCHEDULER_LEASE, self.identity.encode(), last=revision
                )
            except Exception as exc:
                log.warning("scheduler.lease_lost", error=str(exc) or type(exc).__name__)
                lost.set()
                return

    async def _lead(self, stop: asyncio.Event, revision: int) -> None:
        lost = asyncio.Event()
        renewing = asyncio.create_task(self._renew(revision, lost))
        try:
            synced = asyncio.gather(*(e.wait() for e in self.synced.values()))
            await asyncio.wait_for(synced, 30)
            await self._finish_interrupted_commits()
            self.wake.set()  # the first cycle of a new leader plans whatever waits
            while not stop.is_set() and not lost.is_set():
                if self.view.expire(now()):
                    self.wake.set()
                if self.wake.is_set():
                    self.wake.clear()
                    try:
                        await self.cycle(lost)
                    except Exception:
                        log.error("scheduler.cycle_failed", exc_info=True)
                        self.wake.set()  # try again after the wait below, not in a tight loop
                waits = [asyncio.ensure_future(e.wait()) for e in (self.wake, stop, lost)]
                await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
        finally:
            renewing.cancel()

    # ------------------------------------------------------------ one cycle

    async def cycle(self, lost: asyncio.Event | None = None) -> None:
        at = now()
        waiting = self.view.queue(at)
        PENDING.set(self.view.waiting)
        if not waiting:
            return
        queue = [placement.PendingJob(j.job_id, j.config) for j, _ in waiting]
        avoid = nodes_to_avoid(self.view.avoid_candidates(at), at)
        plan = plan_around(self.view.cluster, self.view.capacity, queue, avoid, BACKFILL_WINDOW)
        CYCLE_SECONDS.observe((now() - at).total_seconds())
        # Commits and reasons go out together, at most IN_FLIGHT at a time: their round trips
        # overlap instead of adding up.
        gate = asyncio.Semaphore(IN_FLIGHT)
        # With no node registered at all, the cluster is starting, not too small.
        registered = bool(self.view.capacity.cluster.nodes)

        async def one(job: Job, n: int) -> None:
            async with gate:
                if lost is not None and lost.is_set():
                    return  # no longer the leader: place nothing more
                if job.job_id in plan.placements:
                    await self.commit(job, n, plan.placements[job.job_id])
                elif job.job_id in plan.pending:
                    reason = plan.pending[job.job_id]
                    unschedulable = job.job_id in plan.unschedulable and registered
                    if (job.reason, job.unschedulable) != (reason, unschedulable):
                        await self.set_reason(job.job_id, job.attempt, reason, unschedulable)

        results = await asyncio.gather(*(one(job, n) for job, n in waiting), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            log.warning("scheduler.commit_errors", count=len(failures), first=repr(failures[0])[:300])
            self.wake.set()

    async def commit(self, job: Job, n: int, tasks: list[TaskSpec]) -> None:
        """Place attempt n. The job record is moved to attempt n first (the fence: a job killed or
        placed by another leader meanwhile is left alone), then the attempt record is created
        (or an earlier leader's is reused), then the agents get their orders."""
        nodes = sorted({t.node for t in tasks})
        reason = f"placed on {', '.join(nodes)}; starting tasks"
        fenced: list[bool] = []

        def change(current: JobRecord) -> JobRecord | None:
            fenced.clear()
            if current.state != JobState.WAITING or current.attempt not in (n - 1, n):
                return None
            fenced.append(True)
            if current.attempt == n:
                return None  # moved already by a commit that did not finish
            return current.model_copy(
                update={"attempt": n, "reason": reason, "unschedulable": False, "updated_at": now()}
            )

        updated = await self.kv_jobs.update(job.job_id, change)
        if not fenced:
            return
        if updated is not None:
            self.jobs[job.job_id] = Job.of(updated)
            self.view.job_changed(job.job_id)
        record = AttemptRecord(
            job_id=job.job_id,
            attempt=n,
            tasks=[
                TaskStatus(role=t.role, role_no=t.role_no, index=t.index, node=t.node, gpus=t.gpus)
                for t in tasks
            ],
        )
        if not await self.kv_attempts.create(record.key, record):
            existing = await self.kv_attempts.get(record.key)  # an earlier leader's: reuse it
            if existing is None:
                log.error("scheduler.bad_attempt_record", attempt=record.key)
                return
            record = existing
        self.attempts[record.key] = record
        self.view.attempt_changed(record.key)  # held at once: the next plan cannot reuse it
        await self._send_assignments(job, record)
        PLACED.inc()
        await self.js.publish(
            subjects.job_event(job.job_id, JobEventKind.PLACED),
            JobEvent(
                job_id=job.job_id,
                job_name=job.job_name,
                kind=JobEventKind.PLACED,
                state=job.state,
                attempt=n,
                detail=reason,
            ).to_bytes(),
            headers={Headers.MSG_ID: f"{job.job_id}:{n}:placed"},
        )
        log.info("scheduler.placed", job_id=job.job_id, attempt=n, nodes=nodes)

    async def _send_assignments(self, job: Job, record: AttemptRecord) -> None:
        gang = [_spec(t) for t in record.tasks]
        config = with_secrets(job.config, await self._secrets(job))
        for node in sorted({t.node for t in gang}):
            order = Assignment(
                job_id=job.job_id,
                attempt=record.attempt,
                user=job.user,
                config=config,
                gang=gang,
                node=node,
            )
            await self.js.publish(
                subjects.assign(node),
                order.to_bytes(),
                headers={Headers.MSG_ID: f"assign:{record.key}:{node}"},
            )

    async def _secrets(self, job: Job) -> dict[str, Any]:
        """The job's secret jobEnvs values (kept apart by the validator), for its tasks' orders
        only: orders go to the placed nodes' own subjects, which no other identity may read."""
        if REDACTED not in job.config.jobEnvs.values():
            return {}
        try:
            entry = await self.secrets.get(job.job_id)
        except KeyNotFoundError:
            return {}  # a value that is really "***"
        hidden = json.loads(entry.value or b"{}")
        if not isinstance(hidden, dict):
            raise ValueError(f"job {job.job_id}: its secrets record is not an object")
        return hidden

    async def _finish_interrupted_commits(self) -> None:
        """A new leader re-sends the orders of attempts that no task has acted on yet: an earlier
        leader may have died between writing the attempt and sending them. Orders carry message
        ids and agents ignore tasks they already run or ran, so a second copy is harmless."""
        for record in list(self.attempts.values()):
            job = self.jobs.get(record.job_id)
            if job is None or record.ended or job.attempt != record.attempt or job.state.final:
                continue
            if all(t.state == TaskState.PLACED for t in record.tasks):
                log.info("scheduler.resend_orders", attempt=record.key)
                await self._send_assignments(job, record)

    async def set_reason(self, job_id: str, attempt: int, reason: str, unschedulable: bool = False) -> None:
        def change(current: JobRecord) -> JobRecord | None:
            if current.attempt != attempt or current.state.final:
                return None
            if (current.reason, current.unschedulable) == (reason, unschedulable):
                return None
            return current.model_copy(
                update={"reason": reason, "unschedulable": unschedulable, "updated_at": now()}
            )

        updated = await self.kv_jobs.update(job_id, change)
        if updated is not None:
            self.jobs[job_id] = Job.of(updated)
            self.view.job_changed(job_id)


def _spec(t: TaskStatus) -> TaskSpec:
    return TaskSpec(role=t.role, role_no=t.role_no, index=t.index, node=t.node, gpus=t.gpus)
