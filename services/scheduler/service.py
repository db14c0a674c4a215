"""The scheduler service: one active leader places waiting jobs as gangs; standbys wait.

Leadership is a lease in the KV bucket `muster_leases` (its entries expire LEASE_TTL seconds
after their last write): the leader renews it every second and stops placing the moment a
renewal fails; the renewal runs in a task of its own, and planning runs off the event loop, so a
large queue never costs the lease. A standby creates the key once it has expired. The leader's
view (nodes, jobs, attempts) is kept by KV watchers (records that do not decode are skipped and
counted), so a new leader rebuilds it from the bus, and every placement is fenced: the attempt
record `<job>.<n>` is created only if absent, so no attempt is placed twice. The placement
itself is the pure `placement.plan`; when a job may be placed is the supervisor policy's
`attempt_to_place`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from datetime import timedelta
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge

from services.scheduler import placement
from services.scheduler.avoid import nodes_to_avoid, plan_around
from services.supervisor.policy import attempt_to_place
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
    attempt_key,
    node_refusal,
    now,
)
from shared.store import Store
from shared.subjects import Headers

log = structlog.get_logger(service="scheduler")
PLACED = Counter("muster_scheduler_placements_total", "Attempts placed")
PENDING = Gauge("muster_scheduler_pending_jobs", "Jobs waiting for resources")
LEADER = Gauge("muster_scheduler_leader", "1 while this replica is the active scheduler")
RENEW_EVERY = 1.0  # seconds between lease renewals, whatever a cycle is doing


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
        self.nodes: dict[str, NodeInfo] = {}
        self.jobs: dict[str, JobRecord] = {}
        self.attempts: dict[str, AttemptRecord] = {}
        self.wake = asyncio.Event()
        self.synced = {name: asyncio.Event() for name in ("nodes", "jobs", "attempts")}

    @classmethod
    async def build(cls, nc: NATS) -> Scheduler:
        js, buckets = await bus.setup(nc)
        return cls(nc, js, buckets)

    # ------------------------------------------------------------ leadership

    async def run(self, stop: asyncio.Event) -> None:
        def changed(_key: str) -> None:
            self.wake.set()

        watchers = [
            asyncio.create_task(self.kv_nodes.mirror(self.nodes, self.synced["nodes"], changed)),
            asyncio.create_task(self.kv_jobs.mirror(self.jobs, self.synced["jobs"], changed)),
            asyncio.create_task(self.kv_attempts.mirror(self.attempts, self.synced["attempts"], changed)),
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
            while not stop.is_set() and not lost.is_set():
                self.wake.clear()
                try:
                    await self.cycle(lost)
                except Exception:
                    log.error("scheduler.cycle_failed", exc_info=True)
                waits = [asyncio.ensure_future(e.wait()) for e in (self.wake, stop, lost)]
                await asyncio.wait(waits, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
        finally:
            renewing.cancel()

    # ------------------------------------------------------------ one cycle

    def live_nodes(self) -> dict[str, placement.NodeState]:
        cutoff = now() - timedelta(seconds=self.node_timeout)
        return {
            name: placement.NodeState.from_info(info)
            for name, info in self.nodes.items()
            if info.heartbeat_at >= cutoff and info.restarting_until is None and not info.drained
        }

    def queue(self) -> list[tuple[JobRecord, int]]:
        """Jobs to place now, with the number of the attempt to place (the policy's rule)."""
        waiting, at = [], now()
        for job in self.jobs.values():
            if job.state != JobState.WAITING:
                continue
            n = attempt_to_place(job, self.attempts.get(attempt_key(job.job_id, job.attempt)), at)
            if n is not None:
                waiting.append((job, n))
        return sorted(waiting, key=lambda jn: (jn[0].submitted_at, jn[0].job_id))

    async def cycle(self, lost: asyncio.Event | None = None) -> None:
        nodes = self.live_nodes()
        for attempt in self.attempts.values():
            job = self.jobs.get(attempt.job_id)
            live = [_spec(t) for t in attempt.tasks if not t.state.ended and t.node in nodes]
            if job is None or not live:
                continue
            try:
                placement.allocate(nodes, job.config, live)
            except ValueError as exc:
                # Never place on top of a view that does not add up: say so loudly and wait.
                log.error("scheduler.inconsistent_view", attempt=attempt.key, error=str(exc))
                return
        waiting = self.queue()
        PENDING.set(len(waiting))
        if not waiting:
            return
        queue = [placement.PendingJob(j.job_id, j.config) for j, _ in waiting]
        avoid = nodes_to_avoid(self.attempts.values(), now())
        # The plan is pure CPU work over copies: off the event loop, so heartbeats of the bus
        # connection and the lease renewal go on while a large queue is planned.
        plan = await asyncio.to_thread(plan_around, nodes, queue, avoid)
        for job, n in waiting:
            if lost is not None and lost.is_set():
                return  # no longer the leader: place nothing more
            if job.job_id in plan.placements:
                await self.commit(job, n, plan.placements[job.job_id])
            elif job.job_id in plan.pending:
                await self.set_reason(
                    # With no node registered at all, the cluster is starting, not too small.
                    job.job_id,
                    job.attempt,
                    plan.pending[job.job_id],
                    job.job_id in plan.unschedulable and bool(nodes),
                )

    async def commit(self, job: JobRecord, n: int, tasks: list[TaskSpec]) -> None:
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
            self.jobs[job.job_id] = updated
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

    async def _send_assignments(self, job: JobRecord, record: AttemptRecord) -> None:
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

    async def _secrets(self, job: JobRecord) -> dict[str, Any]:
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
            self.jobs[job_id] = updated


def _spec(t: TaskStatus) -> TaskSpec:
    return TaskSpec(role=t.role, role_no=t.role_no, index=t.index, node=t.node, gpus=t.gpus)
