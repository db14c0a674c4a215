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
so the bus's round trips overlap. When a job may be placed is the shared lifecycle rule
(shared/lifecycle.py `attempt_to_place`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import uuid
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge, Histogram

from services.scheduler import elastic, placement, quota
from services.scheduler import metrics as cluster_metrics
from services.scheduler.avoid import nodes_to_avoid, plan_around
from services.scheduler.view import Job, View
from shared import bus, liveness, settings, subjects
from shared.jobconfig import has_secrets, rank, with_secrets
from shared.messages import (
    Assignment,
    AttemptRecord,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    KillOrder,
    MembersChanged,
    NodeInfo,
    TaskSpec,
    TaskState,
    TaskStatus,
    VirtualCluster,
    node_refusal,
    now,
    vc_refusal,
)
from shared.store import Store
from shared.subjects import Headers

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
RENEW_EVERY = 1.0  # seconds between lease renewals, whatever a cycle is doing
# Jobs behind the head that one plan tries at most (Slurm's bf_max_job_test); later ones wait.
BACKFILL_WINDOW = settings.number("MUSTER_BACKFILL_WINDOW", 500, int, low=0)
IN_FLIGHT = 128  # commits and reason writes of one cycle in flight at once
# Seconds a preempted gang gets between SIGTERM and SIGKILL, to checkpoint.
PREEMPT_GRACE = settings.seconds("MUSTER_PREEMPT_GRACE", 30.0)
ELASTIC_GRACE = settings.seconds("MUSTER_ELASTIC_GRACE", 10.0)  # SIGTERM..SIGKILL of a removed task
PREEMPT_TRIES = 16  # waiting jobs one cycle looks at for a preemption that would let them run
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
        self.leading = False  # its view is synced and it leads: the cluster gauges are its
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
            self.leading = True
            await self._finish_interrupted_commits()
            self.wake.set()  # the first cycle of a new leader plans whatever waits
            while not stop.is_set() and not lost.is_set():
                if self.view.expire(now()) or self.view.elastic:  # elastic roles: look every second
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
            self.leading = False
            renewing.cancel()

    # ------------------------------------------------------------ one cycle

    async def cycle(self, lost: asyncio.Event | None = None) -> None:
        at = now()
        waiting = self.view.queue(at)
        PENDING.set(self.view.waiting)
        blocked = await self._place(waiting, at, lost) if waiting else []
        if self.view.elastic and not (lost is not None and lost.is_set()):
            await self._resize(blocked, at)

    async def _place(
        self, waiting: list[tuple[Job, int]], at: datetime, lost: asyncio.Event | None
    ) -> list[Job]:
        """Plan the waiting jobs and commit the plan; returns the jobs that could run on this
        cluster but do not fit now, in queue order (what elastic roles shrink for)."""
        held_back: dict[str, str] = {}
        order: quota.Order[placement.PendingJob] | None = None
        queue: list[placement.PendingJob] | quota.Order[placement.PendingJob]
        if self.vcs or self.view.ranked:
            order, ledger, running = self._sharing(waiting, at)
            queue = order
        else:
            queue = [placement.PendingJob(j.job_id, j.config.smallest()) for j, _ in waiting]
        avoid = nodes_to_avoid(self.view.avoid_candidates(at), at)
        plan = plan_around(self.view.cluster, self.view.capacity, queue, avoid, BACKFILL_WINDOW)
        borrowed: set[str] = set()
        if order is not None:
            held_back = order.held()
            placed = [p.job_id for p in order.taken if p.job_id in plan.placements]
            if len(placed) < len(plan.placements):  # the second plan (around avoided nodes) placed more
                placed = order.in_order(plan.placements)
            for job_id in placed:  # in queue order: who is within its quota, placements counted
                job = self.jobs[job_id]
                use = quota.need(job.config)
                if not ledger.within(job.config.virtualCluster, use):
                    borrowed.add(job.job_id)
                ledger.take(job.config.virtualCluster, job.user, use)
            await self._preempt_for(self._in_order(order), plan, ledger, running)
            plan.pending.update(held_back)
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
                    await self.commit(job, n, plan.placements[job.job_id], job.job_id in borrowed)
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
        # In queue order; what is shrunk for reads the first PREEMPT_TRIES of them only.
        blocked = (job for job, _ in waiting) if order is None else self._in_order(order)
        return list(
            itertools.islice(
                (
                    job
                    for job in blocked
                    if job.job_id in plan.pending
                    and job.job_id not in plan.unschedulable
                    and job.job_id not in held_back
                ),
                PREEMPT_TRIES,
            )
        )

    def _in_order(self, order: quota.Order[placement.PendingJob]) -> Iterator[Job]:
        """The waiting jobs in sharing order, taken from `order` as far as they are read."""
        for pending in order.ordered():
            job = self.jobs.get(pending.job_id)
            if job is not None:
                yield job

    # ------------------------------------------------------------ elastic roles (elastic.py)

    async def _resize(self, blocked: list[Job], at: datetime) -> None:
        """Shrink elastic roles for the first waiting job that removing their newest tasks would
        let in; else (nothing waits, or nothing waiting could be let in so) grow them into free
        capacity, which no waiting job can use now."""
        ready = []
        for key in sorted(self.view.elastic):
            record = self.attempts.get(key)
            job = self.jobs.get(record.job_id) if record is not None else None
            if record is not None and job is not None and elastic.settled(record, at):
                ready.append((job, record))
        if not ready:
            return
        if blocked:
            for waiting in blocked[:PREEMPT_TRIES]:
                pending = placement.PendingJob(waiting.job_id, waiting.config.smallest())
                running = [(job.config, record) for job, record in ready if job.job_id != waiting.job_id]
                chosen = elastic.shrink_for(self.view.cluster, pending, running)
                if chosen:
                    await self._shrink(chosen, waiting)
                    return
        ledger = None
        if self.vcs:  # a VC that may not borrow: its elastic jobs grow only within its quota
            capacity = quota.capacity_of(self.view.capacity.cluster.nodes.values())
            ledger = quota.Ledger(quota.limits(self.vcs, capacity), self.view.running(at))
        for job, record in ready:
            added = elastic.grow(self.view.cluster, job.config, record)
            if added and ledger is not None and not ledger.limit(job.config.virtualCluster).borrow:
                kept = []
                for spec in added:
                    one = quota.task_need(job.config, spec.role_no)
                    if not ledger.within(job.config.virtualCluster, one):
                        break
                    ledger.take(job.config.virtualCluster, job.user, one)
                    kept.append(spec)
                added = kept
            if added:
                await self._grow(job, record, added)

    async def _grow(self, job: Job, record: AttemptRecord, added: list[TaskSpec]) -> None:
        at = now()

        def change(a: AttemptRecord) -> AttemptRecord | None:
            if a.ended or a.resized_at != record.resized_at:
                return None  # changed meanwhile: the next cycle looks again
            joined = [
                TaskStatus(
                    role=s.role, role_no=s.role_no, index=s.index, node=s.node, gpus=s.gpus, placed_at=at
                )
                for s in added
            ]
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
        for record, spec in chosen:
            by_attempt.setdefault(record.key, []).append(spec)
        for key, specs in by_attempt.items():
            keys = {s.key for s in specs}

            def change(a: AttemptRecord, keys: set[str] = keys) -> AttemptRecord | None:
                if a.ended:
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
            for node in sorted({s.node for s in specs}):
                mine = sorted(s.key for s in specs if s.node == node)
                order = KillOrder(
                    job_id=updated.job_id,
                    attempt=updated.attempt,
                    reason=why,
                    grace=ELASTIC_GRACE,
                    tasks=mine,
                )
                await self.js.publish(
                    subjects.kill(node),
                    order.to_bytes(),
                    headers={Headers.MSG_ID: f"kill:{key}:{node}:{','.join(mine)}"},
                )
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
        await self.js.publish(
            subjects.job_event(job.job_id, kind),
            JobEvent(
                job_id=job.job_id,
                job_name=job.job_name,
                kind=kind,
                state=job.state,
                attempt=attempt,
                detail=detail,
            ).to_bytes(),
            headers={Headers.MSG_ID: msg_id},
        )

    def _sharing(
        self, waiting: list[tuple[Job, int]], at: datetime
    ) -> tuple[quota.Order[placement.PendingJob], quota.Ledger, list[quota.Running]]:
        """With virtual clusters or priorities in use: the queue in sharing order (quota.py),
        made as the planner takes it; the ledger; what runs."""
        running = self.view.running(at)
        capacity = quota.capacity_of(self.view.capacity.cluster.nodes.values())
        ledger = quota.Ledger(quota.limits(self.vcs, capacity), running)
        fixed = self.fixed.of
        order = quota.Order(
            ledger,
            (
                (
                    fixed(j.job_id, j.config, j.user, j.submitted_at),
                    placement.PendingJob(j.job_id, j.config.smallest()),
                )
                for j, _ in waiting
            ),
        )
        self.fixed.next_cycle()
        return order, ledger, running

    async def _preempt_for(
        self,
        waiting: Iterable[Job],
        plan: placement.Plan,
        ledger: quota.Ledger,
        running: list[quota.Running],
    ) -> None:
        """The first waiting job (in queue order) that cannot run now but would if some gangs
        stopped gets them stopped. None while any gang is still stopping (preempted, or ended and
        tearing down): what it frees may be enough, and choosing more victims before it is
        would stop more than needed. Read from the records, so a new leader keeps to it too."""
        stopping = [r for r in running if r.stopping]
        if stopping:
            for job_id in plan.pending:
                n = sum(1 for r in stopping if r.preempted_by == job_id)
                if n:
                    plan.pending[job_id] = f"waiting for {n} preempted gang(s) to stop"
            return
        tried = 0
        for job in waiting:
            if job.job_id not in plan.pending or job.job_id in plan.unschedulable:
                continue
            tried += 1
            if tried > PREEMPT_TRIES:
                return
            w = quota.Waiting(
                job.job_id,
                job.config.virtualCluster,
                job.user,
                rank(job.config.priority),
                job.config,
                job.submitted_at,
            )
            options = quota.candidates(w, ledger, running)
            victims = quota.choose_victims(self.view.cluster, w, options)
            if not victims:
                continue
            await asyncio.gather(*(self._preempt(job, v) for v in victims))
            plan.pending[job.job_id] = (
                f"preempted {', '.join(v.job_id for v in victims)} to make room; waiting for them to stop"
            )
            return

    async def _preempt(self, job: Job, victim: quota.Running) -> None:
        """End the victim's attempt as preempted (the supervisor then re-queues it, uncharged)
        and tell its nodes to stop it: SIGTERM, SIGKILL after PREEMPT_GRACE."""
        if victim.vc == job.config.virtualCluster:
            why = f"preempted by {job.job_id} ({job.config.priority} priority, {job.user})"
            label = "priority"
        else:
            why = (
                f"preempted by {job.job_id}: virtual cluster {job.config.virtualCluster} reclaims "
                f"the capacity {victim.vc} borrowed"
            )
            label = "reclaim"
        at = now()

        def end(a: AttemptRecord) -> AttemptRecord | None:
            if a.ended or a.preempted_by is not None:
                return None
            return a.model_copy(
                update={"ended_at": at, "outcome": JobState.STOPPED, "rule": why, "preempted_by": job.job_id}
            )

        record = await self.kv_attempts.update(victim.key, end)
        if record is None:
            return  # it ended by itself meanwhile
        self.attempts[record.key] = record
        self.view.attempt_changed(record.key)
        PREEMPTIONS.labels(label).inc()
        order = KillOrder(job_id=record.job_id, attempt=record.attempt, reason=why, grace=PREEMPT_GRACE)
        for node in sorted({t.node for t in record.tasks if not t.state.ended}):
            await self.js.publish(
                subjects.kill(node), order.to_bytes(), headers={Headers.MSG_ID: f"kill:{record.key}:{node}"}
            )
        victim_job = self.jobs.get(record.job_id)  # a victim is a job the view runs: it is there
        if victim_job is not None:
            detail = f"{why}; stopping with a {PREEMPT_GRACE:g}s grace, then waiting again (not charged)"
            await self._event(
                victim_job, JobEventKind.PREEMPTED, record.attempt, detail, f"{record.key}:preempted"
            )
        log.info("scheduler.preempted", victim=record.key, for_job=job.job_id, why=why)

    async def commit(self, job: Job, n: int, tasks: list[TaskSpec], borrowed: bool = False) -> None:
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
            if n == 1:
                TO_PLACED.observe(max(0.0, (now() - job.submitted_at).total_seconds()))
        record = AttemptRecord(
            job_id=job.job_id,
            attempt=n,
            borrowed=borrowed,
            elastic=[r.name for r in job.config.taskRoles if r.elastic],
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
        await self._event(job, JobEventKind.PLACED, n, reason, f"{job.job_id}:{n}:placed")
        log.info("scheduler.placed", job_id=job.job_id, attempt=n, nodes=nodes)

    async def _send_assignments(self, job: Job, record: AttemptRecord, only: set[str] | None = None) -> None:
        """Every node's part of the attempt (or only `only`'s). An elastic attempt's gang is its
        members now, its config sized to them; each change of members is a new order."""
        gang = [_spec(t) for t in record.members()]
        config = with_secrets(job.config, await self._secrets(job))
        if record.elastic:
            config = config.sized(record.counts())
        version = f":{len(record.tasks)}" if record.elastic else ""
        # Each node is sent its own tasks only: the whole gang in every order would be O(N) per
        # node, O(N²) bytes for a gang of N (280 MB of orders for 2,000 tasks); where its peers
        # are comes in the cluster spec.
        on: dict[str, list[TaskSpec]] = {}
        for spec in gang:
            on.setdefault(spec.node, []).append(spec)
        for node in sorted(on if only is None else only):
            order = Assignment(
                job_id=job.job_id,
                attempt=record.attempt,
                user=job.user,
                config=config,
                gang=on.get(node, []),
                node=node,
            )
            await self.js.publish(
                subjects.assign(node),
                order.to_bytes(),
                headers={Headers.MSG_ID: f"assign:{record.key}:{node}{version}"},
            )

    async def _secrets(self, job: Job) -> dict[str, Any]:
        """The job's secret jobEnvs values (kept apart by the validator), for its tasks' orders
        only: orders go to the placed nodes' own subjects, which no other identity may read."""
        if not has_secrets(job.config):
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


def _resized(before: AttemptRecord, after: AttemptRecord, why: str) -> str:
    was, now_ = before.counts(), after.counts()
    return "; ".join(
        f"{role}: {was.get(role, 0)} → {now_.get(role, 0)} tasks {why}" for role in after.elastic
    )
