"""The scheduler service: one active leader places waiting jobs as gangs; standbys wait.

Leadership is a lease in the KV bucket `muster_leases` (its entries expire LEASE_TTL seconds
after their last write): the leader renews it every second and stops placing the moment a
renewal fails; a standby creates the key once it has expired. The leader's view (nodes, jobs,
attempts) is kept by KV watchers, so a new leader rebuilds it from the bus, and every placement
is fenced: the attempt record `<job>.<n>` is created only if absent, so no attempt is placed
twice. The placement itself is the pure `placement.plan`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta

import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge

from services.scheduler import placement
from shared import bus, subjects
from shared.messages import (
    Assignment,
    AttemptRecord,
    FailureKind,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    NodeInfo,
    TaskSpec,
    TaskState,
    TaskStatus,
    now,
)
from shared.subjects import Headers

log = structlog.get_logger(service="scheduler")
PLACED = Counter("muster_scheduler_placements_total", "Attempts placed")
PENDING = Gauge("muster_scheduler_pending_jobs", "Jobs waiting for resources")
AVOID_AFTER = int(os.environ.get("MUSTER_AVOID_AFTER", "3"))
AVOID_WINDOW = float(os.environ.get("MUSTER_AVOID_WINDOW", "600"))
LEADER = Gauge("muster_scheduler_leader", "1 while this replica is the active scheduler")


class Scheduler:
    def __init__(
        self, nc: NATS, js: JetStreamContext, buckets: dict[str, KeyValue], node_timeout: float | None = None
    ):
        self.nc, self.js = nc, js
        self.node_timeout = bus.node_timeout() if node_timeout is None else node_timeout
        self.kv_nodes = buckets[subjects.NODES_BUCKET]
        self.kv_jobs = buckets[subjects.JOBS_BUCKET]
        self.kv_attempts = buckets[subjects.ATTEMPTS_BUCKET]
        self.leases = buckets[subjects.LEASES_BUCKET]
        self.identity = uuid.uuid4().hex[:12]
        self.nodes: dict[str, NodeInfo] = {}
        self.jobs: dict[str, JobRecord] = {}
        self.attempts: dict[str, AttemptRecord] = {}
        self.wake = asyncio.Event()
        self.synced = {name: asyncio.Event() for name in ("nodes", "jobs", "attempts")}

    @classmethod
    async def build(cls, nc: NATS) -> Scheduler:
        js, buckets = await bus.ensure_jetstream(nc)
        return cls(nc, js, buckets)

    # ------------------------------------------------------------ the view

    async def _watch(self, name: str, kv: KeyValue, into: dict, decode) -> None:
        while True:
            try:
                watcher = await kv.watchall()
                async for entry in watcher:
                    if entry is None:
                        self.synced[name].set()
                        continue
                    if entry.operation in ("DEL", "PURGE") or not entry.value:
                        into.pop(entry.key, None)
                    else:
                        into[entry.key] = decode(entry.value)
                    self.wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("scheduler.watch_restart", bucket=name, error=str(exc) or type(exc).__name__)
                await asyncio.sleep(1)

    # ------------------------------------------------------------ leadership

    async def run(self, stop: asyncio.Event) -> None:
        watchers = [
            asyncio.create_task(self._watch("nodes", self.kv_nodes, self.nodes, NodeInfo.from_bytes)),
            asyncio.create_task(self._watch("jobs", self.kv_jobs, self.jobs, JobRecord.from_bytes)),
            asyncio.create_task(
                self._watch("attempts", self.kv_attempts, self.attempts, AttemptRecord.from_bytes)
            ),
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

    async def _lead(self, stop: asyncio.Event, revision: int) -> None:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in self.synced.values())), 30)
        await self._finish_interrupted_commits()
        renew_at = asyncio.get_running_loop().time() + 1.0
        while not stop.is_set():
            loop = asyncio.get_running_loop()
            if loop.time() >= renew_at:
                try:
                    revision = await self.leases.update(
                        subjects.SCHEDULER_LEASE, self.identity.encode(), last=revision
                    )
                except Exception as exc:
                    log.warning("scheduler.lease_lost", error=str(exc) or type(exc).__name__)
                    return
                renew_at = loop.time() + 1.0
            self.wake.clear()
            try:
                await self.cycle()
            except Exception:
                log.error("scheduler.cycle_failed", exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), max(0.05, renew_at - loop.time()))

    # ------------------------------------------------------------ one cycle

    def live_nodes(self) -> dict[str, placement.NodeState]:
        cutoff = now() - timedelta(seconds=self.node_timeout)
        return {
            name: placement.NodeState.from_info(info)
            for name, info in self.nodes.items()
            if info.heartbeat_at >= cutoff
        }

    def queue(self) -> list[tuple[JobRecord, int]]:
        """Jobs to place now, with the number of the attempt to place: never placed; moved to an
        attempt whose record was never written (a leader died mid-commit); or whose last attempt
        has ended, been settled by the supervisor as a retry, every task of it gone, and whose
        backoff has passed."""
        waiting, at = [], now()
        for job in self.jobs.values():
            if job.state != JobState.WAITING:
                continue
            current = self.attempts.get(f"{job.job_id}.{job.attempt}")
            if job.attempt == 0:
                waiting.append((job, 1))
            elif current is None:
                waiting.append((job, job.attempt))
            elif (
                current.ended
                and job.settled >= job.attempt
                and all(t.state.ended for t in current.tasks)
                and (job.not_before is None or job.not_before <= at)
            ):
                waiting.append((job, job.attempt + 1))
        return sorted(waiting, key=lambda jn: (jn[0].submitted_at, jn[0].job_id))

    async def cycle(self) -> None:
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
        plan = plan_around(nodes, queue, nodes_to_avoid(self.attempts.values(), now()))
        for job, n in waiting:
            if job.job_id in plan.placements:
                await self.commit(job, n, plan.placements[job.job_id])
            elif plan.pending.get(job.job_id) and plan.pending[job.job_id] != job.reason:
                await self.set_reason(job.job_id, job.attempt, plan.pending[job.job_id])

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
            return current.model_copy(update={"attempt": n, "reason": reason, "updated_at": now()})

        updated = await bus.cas_update(self.kv_jobs, job.job_id, JobRecord.from_bytes, change)
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
        try:
            await self.kv_attempts.create(record.key, record.to_bytes())
        except KeyWrongLastSequenceError:
            record = AttemptRecord.from_bytes((await self.kv_attempts.get(record.key)).value)
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
        for node in sorted({t.node for t in gang}):
            order = Assignment(
                job_id=job.job_id,
                attempt=record.attempt,
                user=job.user,
                config=job.config,
                gang=gang,
                node=node,
            )
            await self.js.publish(
                subjects.assign(node),
                order.to_bytes(),
                headers={Headers.MSG_ID: f"assign:{record.key}:{node}"},
            )

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

    async def set_reason(self, job_id: str, attempt: int, reason: str) -> None:
        def change(current: JobRecord) -> JobRecord | None:
            if current.attempt != attempt or current.state.final or current.reason == reason:
                return None
            return current.model_copy(update={"reason": reason, "updated_at": now()})

        with contextlib.suppress(KeyNotFoundError):
            updated = await bus.cas_update(self.kv_jobs, job_id, JobRecord.from_bytes, change)
            if updated is not None:
                self.jobs[job_id] = updated


def _spec(t: TaskStatus) -> TaskSpec:
    return TaskSpec(role=t.role, role_no=t.role_no, index=t.index, node=t.node, gpus=t.gpus)


def nodes_to_avoid(attempts: Iterable[AttemptRecord], at: datetime) -> set[str]:
    """Nodes that keep failing attempts: platform failures at AVOID_AFTER different moments
    (10 s apart, so one agent restart that loses several tasks at once counts once) within
    AVOID_WINDOW seconds before `at`."""
    since = at - timedelta(seconds=AVOID_WINDOW)
    moments: dict[str, set[int]] = {}
    for a in attempts:
        if a.failure and a.failure.kind == FailureKind.PLATFORM and a.ended_at and a.ended_at >= since:
            moments.setdefault(a.failure.node, set()).add(int(a.ended_at.timestamp() // 10))
    return {node for node, seen in moments.items() if len(seen) >= AVOID_AFTER}


def plan_around(
    nodes: dict[str, placement.NodeState], queue: list[placement.PendingJob], avoid: set[str]
) -> placement.Plan:
    """Place around the nodes to avoid; a job that fits only on them still runs there: avoiding
    is a preference, never a reason to wait forever."""
    plan = placement.plan(nodes.values(), queue, avoid)
    stuck = [j for j in queue if j.job_id in plan.unschedulable]
    if not avoid or not stuck:
        return plan
    rest = {name: n.copy() for name, n in nodes.items()}
    configs = {j.job_id: j.config for j in queue}
    for job_id, tasks in plan.placements.items():
        placement.allocate(rest, configs[job_id], tasks)
    second = placement.plan(rest.values(), stuck)
    plan.placements.update(second.placements)
    for job_id in second.placements:
        plan.pending.pop(job_id, None)
    plan.pending.update(second.pending)
    return plan
