"""The scheduler service: one active leader places waiting jobs as gangs; standbys wait.

Leadership is a lease in the KV bucket `muster_leases` (its entries expire LEASE_TTL seconds
after their last write): the leader renews it every second and stops placing the moment a
renewal fails; the renewal runs in a task of its own and a plan is bounded (the backfill window),
so a large queue never costs the lease. A standby creates the key once it has expired. The leader's
view (nodes, jobs, attempts) is kept by KV watchers (records that do not decode are skipped and
counted), so a new leader rebuilds it from the bus, and every placement is fenced: the attempt
record `<job>.<n>` is created only if absent, so no attempt is placed twice. Placing writes that
record and sends the orders, nothing more: the supervisor moves the job record to the attempt
and tells its history (`Supervisor.adopt`), which keeps the leader, the one process every
placement waits for, to one record write per job.

The view is incremental (`view.View`): allocations follow the attempt records change by change,
nodes join and leave the placement index as their records do, and only a change a plan could
see wakes a cycle. A cycle plans the waiting queue with the indexed core (`Cluster.plan`, a
bounded backfill window behind the head) and commits its placements and reasons concurrently,
so the bus's round trips overlap. When a job may be placed is the shared lifecycle rule
(shared/lifecycle.py `attempt_to_place`).

The leader tells the gateways the waiting queue's order (`muster.queue`, core NATS: the first
QUEUE_SHOWN jobs of the order its last cycle considered, and how many wait) when it changed, at
most once a second, and every 10 s while it leads, so that a gateway started later learns it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from datetime import datetime
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge, Histogram

from muster.services.scheduler import attained, elastic, quota
from muster.services.scheduler import metrics as cluster_metrics
from muster.services.scheduler.cycle import Decision, Place, Preempt, Wait, decide
from muster.services.scheduler.view import Job, View
from muster.shared import bus, liveness, settings, subjects
from muster.shared.jobconfig import has_secrets, with_secrets
from muster.shared.messages import (
    Assignment,
    AttemptRecord,
    JobEvent,
    JobEventKind,
    JobRecord,
    KillOrder,
    MembersChanged,
    NodeInfo,
    QueueOrder,
    TaskSpec,
    TaskState,
    TaskStatus,
    VirtualCluster,
    node_refusal,
    now,
    vc_refusal,
)
from muster.shared.store import Store, confirmed

log = structlog.get_logger(service="scheduler")
RECENT_JOBS = 8192  # job records the scheduler keeps as bytes (see kv_jobs)
PLACED = Counter("muster_scheduler_placements_total", "Attempts placed")
PENDING = Gauge("muster_scheduler_pending_jobs", "Jobs waiting for resources")
LEADER = Gauge("muster_scheduler_leader", "1 while this replica is the active scheduler")
CYCLE_SECONDS = Histogram(
    "muster_scheduler_plan_seconds",
    "Time to plan the waiting queue, once per cycle",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
SHADOW_SECONDS = Histogram(
    "muster_scheduler_shadow_seconds",
    "Time to replay the queue's FIFO shadow (attained.py), in a thread",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RENEW_EVERY = 1.0  # seconds between lease renewals, whatever a cycle is doing
# A leader writes nothing once this long has passed since its last renewal was sent: a loop held
# (a long plan, a pause) past the lease's life would otherwise place on a view a new leader may
# already be changing. The margin covers the renewal's own way to the server.
LEASE_TRUSTED = subjects.LEASE_TTL - 1.0
QUEUE_EVERY = 10.0  # seconds between publications of an unchanged queue order, while leading
QUEUE_SPACING = 1.0  # seconds at least between two (a changed order waits, then goes: the latest)
IN_FLIGHT = 128  # commits and reason writes of one cycle in flight at once
ORDERS_IN_FLIGHT = 64  # one attempt's orders (one per node) in flight at once
SYNC_WAIT = 30.0  # seconds between warnings while a new leader waits for its buckets' first read
# Seconds a preempted gang gets between SIGTERM and SIGKILL, to checkpoint.
ELASTIC_GRACE = settings.seconds("MUSTER_ELASTIC_GRACE", 10.0)  # SIGTERM..SIGKILL of a removed task
PREEMPTIONS = Counter("muster_scheduler_preemptions_total", "Gangs stopped to make room", ["why"])
# Seconds from a job's submission to its first placement (waits of minutes to a day are normal).
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
TO_PLACED = Histogram(
    "muster_job_placed_seconds",
    "Time from a job's submission to its first placement",
    buckets=LATENCY_BUCKETS,
)


class Scheduler:
    def __init__(
        self, nc: NATS, js: JetStreamContext, buckets: dict[str, KeyValue], node_timeout: float | None = None
    ):
        self.nc, self.js = nc, js
        self.node_timeout = bus.node_timeout() if node_timeout is None else node_timeout
        self.kv_nodes = Store(buckets[subjects.NODES_BUCKET], NodeInfo, check=node_refusal)
        # The newest job records' bytes, so that placing a job just submitted writes without
        # reading it first; bounded, so a long queue costs no more memory per job.
        self.kv_jobs = Store(buckets[subjects.JOBS_BUCKET], JobRecord, cache=RECENT_JOBS)
        self.kv_attempts = Store(buckets[subjects.ATTEMPTS_BUCKET], AttemptRecord)
        self.kv_vcs = Store(buckets[subjects.VCS_BUCKET], VirtualCluster, check=vc_refusal)
        self.vcs: dict[str, VirtualCluster] = {}
        self.fixed = quota.Fixeds()  # what each waiting job's place in the sharing order reads
        self.secrets = buckets[subjects.SECRETS_BUCKET]
        self.leases = buckets[subjects.LEASES_BUCKET]
        self.identity = uuid.uuid4().hex[:12]
        self.view = View(self.node_timeout)
        self.nodes, self.jobs, self.attempts = self.view.nodes, self.view.jobs, self.view.attempts
        self.wake = asyncio.Event()
        self.synced = {name: asyncio.Event() for name in ("nodes", "jobs", "attempts", "vcs")}
        self.held: int | None = None  # the lease's revision while this replica holds it
        self.renewed = -math.inf  # monotonic: when the last renewal that succeeded was sent
        self.leading = False  # its view is synced and it leads: the cluster gauges are its
        # The queue order: the last one published, when (loop time), and the latest decided.
        self._queue_sent: tuple[list[str], int] | None = None
        self._queue_sent_at = -QUEUE_EVERY
        self._queue: tuple[list[str], int] | None = None
        # The queue's FIFO shadow (attained.py; None: submission order), made off the loop.
        self.shadow: attained.Shadow | None = attained.Shadow() if attained.ON else None
        self._shadowing: asyncio.Task[None] | None = None
        self._shadow_at = -attained.SHADOW_EVERY  # loop time of the last shadow started
        self._due_at: float | None = None  # when the next waiting job becomes due (epoch seconds)
        cluster_metrics.COLLECTOR.schedulers.add(self)

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

        def beat(name: str, at: datetime) -> None:
            if self.view.node_beat(name, at):
                self.wake.set()

        await liveness.listen(self.nc, beat)  # before the nodes' records: no beat is missed
        watchers = [
            asyncio.create_task(self.kv_vcs.mirror(self.vcs, self.synced["vcs"], lambda _: self.wake.set())),
            asyncio.create_task(self.kv_nodes.mirror(self.nodes, self.synced["nodes"], node)),
            asyncio.create_task(
                self.kv_jobs.mirror(self.jobs, self.synced["jobs"], job, Job.of, refresh=Job.refresh)
            ),
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
            await self._release()

    async def _release(self) -> None:
        """Hand the lease over at once, if this replica holds it: deleted only at the revision it
        wrote (a replica that no longer leads, stopping, deleted its successor's lease)."""
        held, self.held = self.held, None
        if held is not None:
            with contextlib.suppress(Exception):
                await self.leases.delete(subjects.SCHEDULER_LEASE, last=held)

    async def _acquire(self) -> int | None:
        sent = time.monotonic()
        try:
            self.held = await self.leases.create(subjects.SCHEDULER_LEASE, self.identity.encode())
            self.renewed = sent
            return self.held
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
            sent = time.monotonic()
            try:
                revision = await asyncio.wait_for(
                    self.leases.update(subjects.SCHEDULER_LEASE, self.identity.encode(), last=revision),
                    LEASE_TRUSTED - RENEW_EVERY,
                )
                self.held, self.renewed = revision, sent
            except Exception as exc:
                log.warning("scheduler.lease_lost", error=str(exc) or type(exc).__name__)
                self.held = None
                lost.set()
                return

    def deposed(self, lost: asyncio.Event | None) -> bool:
        """Whether this leader must write nothing more: its lease was lost, or its last renewal
        is too old to be sure it still holds it (then it is taken as lost)."""
        if lost is None:
            return False
        if not lost.is_set() and time.monotonic() - self.renewed > LEASE_TRUSTED:
            log.warning("scheduler.lease_stale", seconds=round(time.monotonic() - self.renewed, 1))
            lost.set()
        return lost.is_set()

    async def _lead(self, stop: asyncio.Event, revision: int) -> None:
        lost = asyncio.Event()
        renewing = asyncio.create_task(self._renew(revision, lost))
        try:
            if not await self._synced(stop, lost):
                return
            self.leading = True
            self._queue_sent = self._queue = None  # a new leader tells the gateways at once
            if self.shadow is not None:
                self.shadow, self._shadow_at = attained.Shadow(), -attained.SHADOW_EVERY  # its own
            await self._finish_interrupted_commits()
            self.wake.set()  # the first cycle of a new leader plans whatever waits
            while not stop.is_set() and not lost.is_set():
                await self.publish_queue()
                if self.view.expire(now()) or self.view.elastic:  # elastic roles: look every second
                    self.wake.set()
                if self._due_at is not None and now().timestamp() >= self._due_at:
                    self._due_at = None
                    self.wake.set()  # a waiting job is due: it may call back what overtook it
                self._shadow_when_due()
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
            self.leading = False
            renewing.cancel()
            if lost.is_set():
                await self._release()  # held still, if only a renewal was late: free at once
            if self._shadowing is not None:
                self._shadowing.cancel()

    async def _synced(self, stop: asyncio.Event, lost: asyncio.Event) -> bool:
        """Wait until every mirrored bucket has been read once (a big one may take a while: said
        every SYNC_WAIT, the lease renewed meanwhile), then until the mirrors hold every write
        made before this leadership began: a standby's mirrors were read through long ago, and
        one a little behind (a big record decoding, a watch set up again) would place on GPUs
        the last leader gave away just before it went. False if stopped or the lease is lost."""
        while not (stop.is_set() or lost.is_set()):
            behind = [name for name, e in self.synced.items() if not e.is_set()]
            if not behind:
                return await self._caught_up(stop, lost)
            waits = [asyncio.ensure_future(e.wait()) for e in (*(self.synced[n] for n in behind), stop, lost)]
            done, _ = await asyncio.wait(waits, timeout=SYNC_WAIT, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if not done:
                log.warning("scheduler.sync_slow", waiting_for=sorted(behind), seconds=SYNC_WAIT)
        return False

    async def _caught_up(self, stop: asyncio.Event, lost: asyncio.Event) -> bool:
        stores: dict[str, Store[Any]] = {
            "nodes": self.kv_nodes,
            "jobs": self.kv_jobs,
            "attempts": self.kv_attempts,
            "vcs": self.kv_vcs,
        }
        while not (stop.is_set() or lost.is_set()):
            try:
                done = await asyncio.gather(*(store.caught_up(SYNC_WAIT) for store in stores.values()))
            except Exception as exc:  # the bus is away: asked again, the lease renewed meanwhile
                log.warning("scheduler.catch_up_failed", error=str(exc) or type(exc).__name__)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
                continue
            if all(done):
                return True
            behind = [name for name, ok in zip(stores, done, strict=True) if not ok]
            log.warning("scheduler.sync_slow", waiting_for=behind, seconds=SYNC_WAIT)
        return False

    def _shadow_when_due(self) -> None:
        """Make the queue's FIFO shadow again, every SHADOW_EVERY while jobs wait, in a thread
        (its cost is O(SHADOW_JOBS) placements): the view's nodes and jobs are copied here, and
        the cycle after it lands reads the new bounds."""
        loop = asyncio.get_running_loop()
        if self.shadow is None or not self.view.waiting or (self._shadowing and not self._shadowing.done()):
            return
        if loop.time() - self._shadow_at < attained.SHADOW_EVERY:
            return
        self._shadow_at = loop.time()
        try:
            nodes = [n.copy(empty=True) for n in self.view.capacity.cluster.nodes.values()]
            seen = self.view.seen(now().timestamp(), attained.SHADOW_JOBS)
        except Exception:  # the old bounds stay (lower ones only protect more): said, never fatal
            log.error("scheduler.shadow_failed", exc_info=True)
            return

        async def make() -> None:
            started = loop.time()
            try:
                self.shadow = await asyncio.to_thread(attained.Shadow.make, nodes, seen)
            except Exception:
                log.error("scheduler.shadow_failed", exc_info=True)
                return
            SHADOW_SECONDS.observe(loop.time() - started)
            self.wake.set()  # bounds moved: the order may have

        self._shadowing = asyncio.create_task(make())

    # ------------------------------------------------------------ one cycle

    async def cycle(self, lost: asyncio.Event | None = None) -> None:
        """Decide (cycle.py, pure), then apply the decision."""
        at = now()
        PENDING.set(self.view.waiting)
        decision = decide(self.view, self.vcs, self.fixed, at, shadow=self.shadow)
        if decision.resize_failed is not None:
            log.error("scheduler.resize_failed", error=decision.resize_failed[:500])
        self._due_at = decision.due_at
        if decision.queued:
            CYCLE_SECONDS.observe((now() - at).total_seconds())
        await self.apply(decision, lost)
        if lost is None or not lost.is_set():
            self._queue = (decision.queue, self.view.waiting)  # the waiting count once applied
            await self.publish_queue()

    async def publish_queue(self) -> None:
        """Tell the gateways the waiting queue's order (core NATS: a lost one is replaced by the
        next): the latest one decided, once it changed (at most one per QUEUE_SPACING: the
        leader's loop sends a change held back within a second), and every QUEUE_EVERY anyway."""
        if self._queue is None:
            return
        at = asyncio.get_running_loop().time()
        since = at - self._queue_sent_at
        if not (since >= QUEUE_EVERY or (since >= QUEUE_SPACING and self._queue != self._queue_sent)):
            return
        jobs, total = self._queue_sent = self._queue
        self._queue_sent_at = at
        try:
            await self.nc.publish(subjects.QUEUE, QueueOrder(at=now(), total=total, jobs=jobs).to_bytes())
        except Exception as exc:
            log.warning("scheduler.queue_unsent", error=str(exc) or type(exc).__name__)

    async def apply(self, decision: Decision, lost: asyncio.Event | None = None) -> None:
        """Preemptions first (their kill orders), then placements and reasons together, at most
        IN_FLIGHT at a time (their round trips overlap instead of adding up), then the elastic
        shrink or grows. Once leadership is lost, nothing more is placed or resized."""
        if self.deposed(lost):
            return
        if decision.preempt:
            await asyncio.gather(*(self._preempt(p) for p in decision.preempt))
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def one(step: Place | Wait) -> None:
            async with gate:
                if self.deposed(lost):
                    return  # no longer the leader: place nothing more
                if isinstance(step, Place):
                    await self.commit(step.job, step.attempt, step.tasks, step.borrowed)
                else:
                    await self.set_reason(step.job.job_id, step.job.attempt, step.reason, step.unschedulable)

        results = await asyncio.gather(*(one(step) for step in decision.steps), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            log.warning("scheduler.commit_errors", count=len(failures), first=repr(failures[0])[:300])
            self.wake.set()
        if self.deposed(lost):
            return
        if decision.shrink is not None:
            await self._shrink(decision.shrink.tasks, decision.shrink.for_job)
        for g in decision.grow:
            await self._grow(g.job, g.record, g.added)

    # ------------------------------------------------------------ applying elastic changes (elastic.py)

    async def _grow(self, job: Job, record: AttemptRecord, added: list[TaskSpec]) -> None:
        at = now()

        def change(a: AttemptRecord) -> AttemptRecord | None:
            if a.ended or a.resized_at != record.resized_at or a.counts() != record.counts():
                return None  # changed meanwhile: the next cycle looks again
            roles = {s.role for s in added}
            if any(t.role in roles and t.state == TaskState.SUCCEEDED for t in a.tasks):
                return None  # a task of the role succeeded since: the training ends, it grows no more
            joined = [TaskStatus.placed(s, placed_at=at) for s in added]
            return a.model_copy(update={"tasks": [*a.tasks, *joined], "resized_at": at})

        updated = await self.kv_attempts.update(record.key, change)
        if updated is None:
            return
        self.attempts[updated.key] = updated
        self.view.attempt_changed(updated.key)
        await self._send_assignments(job, updated, {s.node for s in added})
        detail = _resized(record, updated, "into free capacity")
        await self._event(
            job, JobEventKind.RESIZED, updated.attempt, detail, f"{updated.key}:resized:{len(updated.tasks)}"
        )
        log.info("scheduler.grew", attempt=updated.key, tasks=[s.key for s in added])

    async def _shrink(self, chosen: list[tuple[AttemptRecord, TaskSpec]], waiting: Job) -> None:
        at = now()
        why = f"removed to make room for {waiting.job_id}"
        by_attempt: dict[str, list[TaskSpec]] = {}
        read: dict[str, AttemptRecord] = {}  # the record each choice was made on
        for record, spec in chosen:
            by_attempt.setdefault(record.key, []).append(spec)
            read[record.key] = record
        for key, specs in by_attempt.items():
            keys = {s.key for s in specs}

            def change(
                a: AttemptRecord, keys: set[str] = keys, seen: AttemptRecord = read[key]
            ) -> AttemptRecord | None:
                # Only on the gang the choice was made on: a member that failed since would
                # leave the role below its minimum once these are removed (the attempt FAILED,
                # charged, for a shrink).
                if a.ended or a.counts() != seen.counts() or not elastic.settled(a, at, dwell=0):
                    return None
                tasks = [
                    t.model_copy(update={"removed": True, "reason": why})
                    if t.key in keys and not t.state.ended
                    else t
                    for t in a.tasks
                ]
                return a.model_copy(update={"tasks": tasks, "resized_at": at})

            before = self.attempts.get(key)
            updated = await self.kv_attempts.update(key, change)
            if updated is None or before is None:
                continue
            self.attempts[key] = updated
            self.view.attempt_changed(key)
            await self._stop_removed(updated, [(s.node, s.key) for s in specs], why)
            await self.js.publish(
                subjects.attempt_members(updated.job_id, updated.attempt), MembersChanged().to_bytes()
            )
            job = self.jobs.get(updated.job_id)
            if job is not None:
                detail = _resized(before, updated, f"for waiting job {waiting.job_id}")
                await self._event(
                    job,
                    JobEventKind.RESIZED,
                    updated.attempt,
                    detail,
                    f"{key}:resized:{len(updated.members())}",
                )
            log.info("scheduler.shrank", attempt=key, tasks=sorted(keys), for_job=waiting.job_id)

    async def _event(self, job: Job, kind: JobEventKind, attempt: int, detail: str, msg_id: str) -> None:
        event = JobEvent(
            job_id=job.job_id,
            job_name=job.job_name,
            kind=kind,
            state=job.state,
            attempt=attempt,
            detail=detail,
        )
        await bus.publish_once(self.js, subjects.job_event(job.job_id, kind), event.to_bytes(), msg_id)

    async def _preempt(self, p: Preempt) -> None:
        """End the victim's attempt as preempted (the supervisor then re-queues it, uncharged)
        and tell its nodes to stop it: SIGTERM, SIGKILL after quota.PREEMPT_GRACE."""
        job, victim, why = p.for_job, p.victim, p.why
        at = now()

        record = await self.kv_attempts.update(victim.key, lambda a: p.stopped(a, at))
        if record is None:
            return  # it ended, or a task of it did, meanwhile
        self.attempts[record.key] = record
        self.view.attempt_changed(record.key)
        PREEMPTIONS.labels(p.kind).inc()
        await self._stop_preempted(record, why)
        victim_job = self.jobs.get(record.job_id)  # a victim is a job the view runs: it is there
        if victim_job is not None:
            grace = quota.PREEMPT_GRACE
            detail = f"{why}; stopping with a {grace:g}s grace, then waiting again (not charged)"
            await self._event(
                victim_job, JobEventKind.PREEMPTED, record.attempt, detail, f"{record.key}:preempted"
            )
        log.info("scheduler.preempted", victim=record.key, for_job=job.job_id, why=why)

    async def _stop_preempted(self, record: AttemptRecord, why: str) -> None:
        """The kill orders of a preempted attempt's live tasks, one per node (their ids the same
        each time: a leader that sends them again is not heard twice)."""
        order = KillOrder(job_id=record.job_id, attempt=record.attempt, reason=why, grace=quota.PREEMPT_GRACE)
        for node in sorted({t.node for t in record.tasks if not t.state.ended}):
            await bus.publish_once(
                self.js, subjects.kill(node), order.to_bytes(), f"kill:{record.key}:{node}"
            )

    async def _stop_removed(self, record: AttemptRecord, tasks: list[tuple[str, str]], why: str) -> None:
        """The kill orders of an elastic attempt's tasks (node, task key) removed by a shrink."""
        for node in sorted({node for node, _ in tasks}):
            mine = sorted(key for n, key in tasks if n == node)
            order = KillOrder(
                job_id=record.job_id, attempt=record.attempt, reason=why, grace=ELASTIC_GRACE, tasks=mine
            )
            await bus.publish_once(
                self.js, subjects.kill(node), order.to_bytes(), f"kill:{record.key}:{node}:{','.join(mine)}"
            )

    async def commit(self, job: Job, n: int, tasks: list[TaskSpec], borrowed: bool = False) -> None:
        """Place attempt n: its record is created (only if absent: the fence against placing it
        twice; an earlier leader's is reused), then the agents get their orders. The job record
        is not written here: the supervisor moves the job to the attempt once it sees the record
        (or ends the attempt if the job ended meanwhile) and tells its history (`placed`), so the
        leader, which every placement waits for, does one write per job and not two."""
        nodes = sorted({t.node for t in tasks})
        record = AttemptRecord(
            job_id=job.job_id,
            attempt=n,
            borrowed=borrowed,
            elastic=[r.name for r in job.config.taskRoles if r.elastic],
            tasks=[TaskStatus.placed(t) for t in tasks],
        )
        if await self.kv_attempts.create(record.key, record):
            if n == 1:
                TO_PLACED.observe(max(0.0, (now() - job.submitted_at).total_seconds()))
        else:
            existing = await self.kv_attempts.get(record.key, confirm=True)  # an earlier leader's: reuse it
            if existing is None:
                log.error("scheduler.bad_attempt_record", attempt=record.key)
                return
            record = existing
        self.attempts[record.key] = record
        self.view.attempt_changed(record.key)  # held at once: the next plan cannot reuse it
        await self._send_assignments(job, record)
        PLACED.inc()
        log.info("scheduler.placed", job_id=job.job_id, attempt=n, nodes=nodes)

    async def _send_assignments(self, job: Job, record: AttemptRecord, only: set[str] | None = None) -> None:
        """Every node's part of the attempt (or only `only`'s). An elastic attempt's gang is its
        members now, its config sized to them; each change of members is a new order."""
        gang = [_spec(t) for t in record.members()]
        hidden = await self._secrets(job)
        config = with_secrets(job.config, hidden)
        secret_names = sorted(k for k in hidden if k in config.jobEnvs)  # (not codeSync's URL)
        if record.elastic:
            config = config.sized(record.counts())
        version = f":{len(record.tasks)}" if record.elastic else ""
        # Each node is sent its own tasks only: the whole gang in every order would be O(N) per
        # node, O(N²) bytes for a gang of N (280 MB of orders for 2,000 tasks); where its peers
        # are comes in the cluster spec.
        on: dict[str, list[TaskSpec]] = {}
        for spec in gang:
            on.setdefault(spec.node, []).append(spec)
        # ORDERS_IN_FLIGHT at once: a gang of 2,000 nodes waits ~30 round trips for its orders to
        # be stored, not 2,000 one after the other (~1 s on two cores before).
        gate = asyncio.Semaphore(ORDERS_IN_FLIGHT)

        async def send(node: str) -> None:
            order = Assignment(
                job_id=job.job_id,
                attempt=record.attempt,
                user=job.user,
                config=config,
                gang=on.get(node, []),
                node=node,
                secret_names=secret_names,
            )
            async with gate:
                await bus.publish_once(
                    self.js, subjects.assign(node), order.to_bytes(), f"assign:{record.key}:{node}{version}"
                )

        sent = await asyncio.gather(
            *(send(n) for n in sorted(on if only is None else only)), return_exceptions=True
        )
        failed = [r for r in sent if isinstance(r, BaseException)]
        if failed:  # as one at a time: the commit fails, and what was stored stays stored
            raise failed[0]

    async def _secrets(self, job: Job) -> dict[str, Any]:
        """The job's secret jobEnvs values (kept apart by the validator), for its tasks' orders
        only: orders go to the placed nodes' own subjects, which no other identity may read."""
        if not has_secrets(job.config):
            return {}
        entry = await confirmed(self.secrets, job.job_id)  # written before the job's record
        if entry is None:
            return {}  # a value that is really "***"
        hidden = json.loads(entry.value or b"{}")
        if not isinstance(hidden, dict):
            raise ValueError(f"job {job.job_id}: its secrets record is not an object")
        return hidden

    async def _finish_interrupted_commits(self) -> None:
        """A new leader re-sends the orders of attempts that no task has acted on yet: an earlier
        leader may have died between writing the attempt and sending them. Orders carry message
        ids and agents ignore tasks they already run or ran, so a second copy is harmless. So
        with the kill orders of gangs it preempted and of tasks it removed from elastic roles,
        whose tasks still run: they would hold their GPUs until the gang ended of itself, and
        the job they made room for would wait for them."""
        for record in list(self.attempts.values()):
            live = [t for t in record.tasks if not t.state.ended]
            removed = [(t.node, t.key) for t in live if t.removed]
            try:
                if record.preempted_by is not None and live:
                    log.info("scheduler.resend_kills", attempt=record.key, preempted_for=record.preempted_by)
                    await self._stop_preempted(record, f"preempted for {record.preempted_by}")
                elif removed and not record.ended:
                    log.info("scheduler.resend_kills", attempt=record.key, removed=[k for _, k in removed])
                    await self._stop_removed(record, removed, next(t.reason for t in live if t.removed))
            except Exception as exc:  # as a resend of orders below
                log.error("scheduler.resend_failed", attempt=record.key, error=repr(exc)[:300])
            job = self.jobs.get(record.job_id)
            if job is None or record.ended or record.attempt != self.view.current(job) or job.state.final:
                continue
            if all(t.state == TaskState.PLACED for t in record.tasks):
                log.info("scheduler.resend_orders", attempt=record.key)
                try:
                    await self._send_assignments(job, record)
                except Exception as exc:  # one attempt's orders, not the leadership: its tasks
                    # stay placed and the supervisor ends them uncharged after the start deadline
                    log.error("scheduler.resend_failed", attempt=record.key, error=repr(exc)[:300])

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


def _resized(before: AttemptRecord, after: AttemptRecord, why: str) -> str:
    was, now_ = before.counts(), after.counts()
    return "; ".join(
        f"{role}: {was.get(role, 0)} → {now_.get(role, 0)} tasks {why}" for role in after.elastic
    )
