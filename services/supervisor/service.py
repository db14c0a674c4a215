"""The supervisor: follows task states and enforces the job's completion policy.

It consumes task events (running, exited) and kill requests through durable consumers shared by
all replicas, records each task's state on its attempt (KV `muster_attempts`), moves the job to
RUNNING, and when the policy says the attempt has ended: sends kill orders for the tasks still
alive and settles the job (final state, or WAITING for its next attempt). Every write is a
read-modify-write with the revision read; replaying an event changes nothing. The rules are
the pure `policy` module; this file is only the I/O around them.

Once a second, from watched (not polled) views of nodes, jobs and attempts, it also:
- declares the tasks of a lost node ended (cause `node_lost`): silent for MUSTER_NODE_TIMEOUT,
  or past the restart grace its agent announced when it stopped for a restart;
- fails tasks still not started MUSTER_START_TIMEOUT seconds after placement (cause platform);
- deletes the records of jobs finished more than MUSTER_JOB_RETENTION seconds ago, and nodes
  silent for more than MUSTER_NODE_RETENTION seconds."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import Coroutine, Iterable
from datetime import datetime, timedelta
from typing import Any

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Histogram

from muster.services.supervisor import policy
from muster.services.supervisor.policy import Finished, NextStep, RetryLimits
from muster.shared import bus, consume, liveness, service, settings, subjects
from muster.shared.jobconfig import JobConfig
from muster.shared.liveness import Beats
from muster.shared.messages import (
    AttemptRecord,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    KillOrder,
    KillRequest,
    MembersChanged,
    NodeInfo,
    TaskCause,
    TaskEvent,
    TaskEventKind,
    TaskState,
    TaskStatus,
    attempt_key,
    node_refusal,
    now,
)
from muster.shared.store import GroupCommit, Store, purge_deletes

log = structlog.get_logger(service="supervisor")
RECENT_RECORDS = 16384  # job and attempt records kept as bytes, each (see Supervisor.jobs)
JOBS_ENDED = Counter("muster_jobs_ended_total", "Jobs that reached a final state", ["state"])
PRUNED = Counter("muster_supervisor_pruned_total", "Records deleted after their retention", ["kind"])
# Counted once per fact across replicas: by the replica whose write applied it (a replay changes
# nothing and counts nothing). Labels are enums: bounded.
ATTEMPTS_ENDED = Counter("muster_attempts_ended_total", "Attempts that ended, by outcome", ["outcome"])
RETRIES = Counter(
    "muster_job_retries_total",
    "New attempts after an ended one, by classification: user (charged to retryCount), platform "
    "(its own budget), restart (uncharged: retryCount -2)",
    ["classification"],
)
TASK_STARTS = Counter("muster_task_starts_total", "Tasks that started running")
TASK_FAILURES = Counter(
    "muster_task_failures_total",
    "Tasks that failed, by cause (exited: a non-zero exit code); tasks stopped on purpose "
    "(kill, gang teardown) are not failures",
    ["cause"],
)
NODES_LOST = Counter("muster_nodes_lost_total", "Nodes this replica saw go silent past the node timeout")
TO_RUNNING = Histogram(
    "muster_job_running_seconds",
    "Time from a job's submission to its first attempt running",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400),
)

DAY = 24 * 3600.0
ALIVE_WAIT = 1.0  # seconds a quiet node's agent has to answer whether it is there
SETTLE_GRACE = 120.0  # seconds after its end an attempt whose job is not settled counts as missed
IN_FLIGHT = 2048  # task events handled at once: a gang this big is recorded in one write
WRITE_SPACING = 0.00025  # seconds between writes of an attempt record, per task of it
MAX_SPACING = 1.0
# A big attempt's events are written once they stop coming for this long (at most its spacing
# after the first): a gang's burst of reports in one write, not a few first and the rest after.
LINGER = 0.02
FETCH = IN_FLIGHT  # task events asked of the server at once: a gang this big comes in one fetch
BATCHED = Histogram(
    "muster_supervisor_batch_events",
    "Task events of one attempt applied by one write of its record",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
)


def _seconds(name: str, default: float) -> float:
    return settings.seconds(name, default)


def failed(ev: TaskEvent) -> bool:
    """A task's end is a failure: not an exit 0, not stopped on purpose."""
    return ev.cause != TaskCause.KILLED and (ev.cause != TaskCause.EXITED or ev.exit_code != 0)


def agent_targets(nodes: Iterable[NodeInfo]) -> list[dict[str, Any]]:
    """The agents' /metrics for Prometheus's HTTP service discovery (`http_sd_configs`): one
    target group per node record that names its metrics port, labelled with the node's name.
    New agents are scraped without editing Prometheus's config."""
    out = []
    for n in sorted(nodes, key=lambda n: n.node):
        if n.metrics_port is None:
            continue
        host = f"[{n.address}]" if ":" in n.address else n.address
        out.append({"targets": [f"{host}:{n.metrics_port}"], "labels": {"node": n.node}})
    return out


def placed(attempt: AttemptRecord) -> str:
    """What a job's reason and its `placed` event say of where its attempt was placed."""
    return f"placed on {', '.join(sorted({t.node for t in attempt.tasks}))}; starting tasks"


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
            platform=settings.number("MUSTER_PLATFORM_RETRIES", 10, int, low=0),
            backoff=settings.seconds("MUSTER_RETRY_BACKOFF", 1.0),
        )
        # Jobs and attempts are mirrored below anyway: their writes start from the mirrored revision.
        # The newest records' bytes: a task event's writes start from them, without a read.
        self.jobs = Store(buckets[subjects.JOBS_BUCKET], JobRecord, cache=RECENT_RECORDS)
        self.attempts = Store(buckets[subjects.ATTEMPTS_BUCKET], AttemptRecord, cache=RECENT_RECORDS)
        self.nodes = Store(buckets[subjects.NODES_BUCKET], NodeInfo, check=node_refusal)
        self.names = buckets[subjects.JOB_NAMES_BUCKET]
        self.secrets = buckets[subjects.SECRETS_BUCKET]
        self.rendezvous = buckets[subjects.RENDEZVOUS_BUCKET]
        self.node_timeout = bus.node_timeout()
        self.start_timeout = _seconds("MUSTER_START_TIMEOUT", 600)
        self.job_retention = _seconds("MUSTER_JOB_RETENTION", 7 * DAY)
        self.node_retention = _seconds("MUSTER_NODE_RETENTION", DAY)
        # Watched views: what the once-a-second checks read, without a request per record.
        self.view_nodes: dict[str, NodeInfo] = {}
        self.absent: dict[str, datetime] = {}  # nodes with live tasks but no record, since when
        # Of the history a retention keeps (days of it), only what is still live is held whole:
        # a finished job as the little its pruning needs, a settled attempt not at all. So
        # memory and the checks' scans follow the live work, not the retention.
        self.view_jobs: dict[str, JobRecord | Finished] = {}
        self.view_attempts: dict[str, AttemptRecord] = {}
        self.synced = {name: asyncio.Event() for name in ("nodes", "jobs", "attempts")}
        self.declared: set[str] = set()  # "<attempt>/<task>" this replica already declared ended
        self.lost: set[str] = set()  # nodes seen lost, counted once until they beat again
        self.prunes = 0
        # Events of one attempt, written together, and a big attempt's record not rewritten more
        # often than its size allows (`spacing`): its tasks' events may trickle in for minutes.
        self.batches = GroupCommit(self.apply_events, self.spacing, LINGER)
        # Liveness (shared/liveness.py): each node's last sign of life, the nodes found quiet
        # (no sign for the node timeout) and not heard since, and, for the nodes with tasks
        # not ended, where those tasks are: a lost node costs its own tasks, not a pass over
        # every task of every attempt.
        self.beats = Beats(self.node_timeout)
        self.quiet: set[str] = set()
        self.stall_grace = _seconds("MUSTER_NODE_STALL_GRACE", 3 * self.node_timeout)
        self.tasks_on: dict[str, dict[str, list[int]]] = {}  # node -> attempt key -> task positions
        self._nodes_of: dict[str, set[str]] = {}  # attempt key -> nodes in tasks_on
        self._adopting: set[str] = set()  # attempt keys whose `adopt` runs now
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def build(cls, nc: NATS) -> Supervisor:
        js, buckets = await bus.setup(nc)
        return cls(nc, js, buckets)

    async def run(self, stop: asyncio.Event) -> None:
        events_consumer = functools.partial(
            bus.durable,
            self.js,
            "",
            subjects.SUPERVISOR_CONSUMER,
            subjects.EVENTS_STREAM,
            filter_subjects=subjects.TASK_STATES,
            max_ack_pending=IN_FLIGHT,  # the server's default (1,000) would cut a big gang's batch
        )
        kills_consumer = functools.partial(
            bus.durable,
            self.js,
            subjects.KILL,
            subjects.SUPERVISOR_KILL_CONSUMER,
            subjects.SUBMISSIONS_STREAM,
        )
        events, kills = await bus.patiently(events_consumer), await bus.patiently(kills_consumer)
        # No order per key here: `on_task_event` keeps each attempt's events in order itself,
        # and handles as many at once as a big gang sends.
        on_event = consume.Handling(
            subjects.SUPERVISOR_CONSUMER, consume.sent(TaskEvent), self.on_task_event, log, parallel=IN_FLIGHT
        )
        on_kill = consume.Handling(
            subjects.SUPERVISOR_KILL_CONSUMER,
            consume.sent(KillRequest),
            self.on_kill,
            log,
            key=lambda r: r.message.job_id,
        )
        await liveness.listen(self.nc, self.heard)  # before the nodes' records: no beat is missed
        mirrors = [
            asyncio.create_task(self.nodes.mirror(self.view_nodes, self.synced["nodes"], self.node_changed)),
            asyncio.create_task(self.jobs.mirror(self.view_jobs, self.synced["jobs"], keep=Finished.held)),
            asyncio.create_task(
                self.attempts.mirror(
                    self.view_attempts, self.synced["attempts"], self.attempt_changed, keep=policy.unsettled
                )
            ),
        ]
        service.ROUTES["/sd/agents"] = lambda: json.dumps(agent_targets(self.view_nodes.values())).encode()
        try:
            await asyncio.gather(
                consume.serve(events, on_event, stop, FETCH, bus.renewing(self.nc, events_consumer)),
                consume.serve(kills, on_kill, stop, 16, bus.renewing(self.nc, kills_consumer)),
                self.watch(stop),
            )
        finally:
            service.ROUTES.pop("/sd/agents", None)
            for m in mirrors:
                m.cancel()

    # ------------------------------------------------------------ task events

    async def on_task_event(self, sent: consume.Sent[TaskEvent]) -> None:
        """Queue the event for its attempt's next write and return once that write is done.

        The events of one attempt that arrive while its record is being written go into the next
        write together, in the order they came (group commit): one read-modify-write of the
        attempt record per batch, not per event, so a gang of N starting (N running events) or
        lost (N declared ends) costs O(N), not N writes of an O(N) record. A failed batch fails
        each of its handlers (their messages are redelivered)."""
        await self.batches.add(attempt_key(sent.message.job_id, sent.message.attempt), sent)

    def spacing(self, key: str, waiting: int, last: int = 0) -> float:
        """The least time between two writes of the attempt record `key` while `waiting` of its
        events wait and its last write took `last`: WRITE_SPACING seconds per task of it (a
        write is ~250 bytes per task), at most MAX_SPACING; none once an eighth of its tasks'
        events wait, or right after a write of as many. A gang of N whose events trickle in is
        then written at most every N·WRITE_SPACING seconds, ~1 MB/s whatever N, where each write
        of its own would be O(N) per event, O(N²) for the gang; a burst (a gang starting at
        once) is written in batches of N/8 or more as soon as they are in, its tail at once
        after them, and a small gang's events at once as before (40 tasks: 10 ms)."""
        attempt = self.view_attempts.get(key)
        if attempt is None or 8 * max(waiting, last) >= len(attempt.tasks):
            return 0.0
        return min(MAX_SPACING, WRITE_SPACING * len(attempt.tasks))

    @staticmethod
    def _refusals(known: AttemptRecord | None, items: list[consume.Sent[TaskEvent]]) -> list[str | None]:
        """Why each event may not be applied to `known` (None: it may)."""
        if known is None:
            return ["no such attempt"] * len(items)
        tasks = {t.key: t for t in known.tasks}
        return [policy.event_refusal(s.message, s.subject, s.by, known, tasks) for s in items]

    async def apply_events(self, key: str, items: list[consume.Sent[TaskEvent]]) -> None:
        """Apply task events of the attempt `key`, in order, in one write of its record."""
        first = items[0].message
        # Read for what never changes (the job's config; where the attempt's tasks were placed):
        # the mirrored copy serves; the stored record when the mirror has none yet, or holds
        # the job only as finished (a late event).
        held = self.view_jobs.get(first.job_id)
        job = held if isinstance(held, JobRecord) else await self.jobs.get(first.job_id, confirm=True)
        if job is None:
            log.warning("supervisor.unknown_job", job_id=first.job_id, events=len(items))
            return
        mirrored = self.view_attempts.get(key)
        known = mirrored or await self.attempts.get(key, confirm=True)  # None refuses
        refusals = self._refusals(known, items)
        if mirrored is not None and any(refusals):
            # The mirror may lag the record: an elastic role's new task can report before the
            # write that added it is seen here. Refused only by the stored record.
            known = await self.attempts.get(key, confirm=True)
            refusals = self._refusals(known, items)
        events = []
        for sent, why in zip(items, refusals, strict=True):
            if why is not None:
                consume.REFUSED.labels("task_event").inc()
                log.warning("supervisor.event_refused", subject=sent.subject[:200], why=why)
            else:
                events.append(sent.message)
        if not events:
            return
        at = now()
        applied: list[bool] = []

        def change(stored: AttemptRecord) -> AttemptRecord | None:
            # The policy changes the record and its list of tasks in place, and replaces a task it
            # changes (never changing one): a copy of both (the stored one may be the view's) is
            # O(tasks) pointers, not O(tasks) TaskStatus copies per write of a big gang's record.
            a = stored.model_copy(update={"tasks": list(stored.tasks)})
            applied[:] = policy.apply_task_events(job.config, a, events, at)
            return a if any(applied) else None

        attempt = await self.attempts.update(key, change)
        if attempt is None:  # replayed events: nothing new, but finish what may be unfinished
            applied = [False] * len(events)
            attempt = await self.attempts.get(key, confirm=True)
            if attempt is None:
                log.warning("supervisor.unknown_attempt", attempt=key)
                return
        BATCHED.observe(len(events))
        for ev, did in zip(events, applied, strict=True):
            if not did:
                continue
            if ev.kind == TaskEventKind.RUNNING:
                TASK_STARTS.inc()
            elif failed(ev):
                TASK_FAILURES.labels(ev.cause or "unknown").inc()
        if any(ev.kind == TaskEventKind.RUNNING for ev in events) and not attempt.ended:
            await self.set_running(attempt)
        if attempt.ended:
            await self.end_attempt(attempt)
        elif any(ev.kind == TaskEventKind.EXITED and ev.role in attempt.elastic for ev in events):
            # An elastic role goes on without it: the registry publishes the smaller gang.
            await self.js.publish(
                subjects.attempt_members(attempt.job_id, attempt.attempt), MembersChanged().to_bytes()
            )

    async def set_running(self, attempt: AttemptRecord) -> None:
        """The job runs its attempt. A job whose record does not name the attempt yet (its
        `adopt` has not come) moves to it in the same write, and its `placed` event comes first."""
        n = attempt.attempt
        adopted: list[bool] = []

        def change(job: JobRecord) -> JobRecord | None:
            adopted[:] = [job.attempt < n]
            if job.attempt > n or job.state != JobState.WAITING or job.settled >= n:
                return None
            update = {"state": JobState.RUNNING, "attempt": n, "reason": "running", "unschedulable": False}
            return job.model_copy(update=update | {"updated_at": now()})

        job = await self.jobs.update(attempt.job_id, change)
        if job is not None:
            if adopted and adopted[0]:
                await self.tell_placed(job, attempt)
            if n == 1:
                TO_RUNNING.observe(max(0.0, (now() - job.submitted_at).total_seconds()))
            await self.event(job, JobEventKind.RUNNING, "running")

    # ------------------------------------------------------------ placements

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def unadopted(self, attempt: AttemptRecord) -> bool:
        """Whether the attempt is live and its job's record, as watched, does not name it: a
        placement this supervisor has to take up (`adopt`)."""
        if attempt.ended or attempt.key in self._adopting:
            return False
        job = self.view_jobs.get(attempt.job_id)
        if job is None:
            return False  # not watched yet: the once-a-second check looks again
        return job.state.final or job.attempt < attempt.attempt

    async def adopt(self, attempt: AttemptRecord) -> None:
        """A placed attempt whose job record does not name it yet: the scheduler leader only
        creates the attempt record. The job moves to it (the reason says where it was placed,
        and its history gets `placed`). A job that ended before (killed while it was placed)
        has the attempt ended and its tasks stopped instead, so nothing of it runs on.
        Compare-and-set on the records: idempotent, and safe with several replicas."""
        key, n = attempt.key, attempt.attempt
        self._adopting.add(key)
        try:
            final: list[JobRecord] = []

            def change(job: JobRecord) -> JobRecord | None:
                final[:] = [job] if job.state.final else []
                if job.state != JobState.WAITING or job.attempt >= n or job.settled >= n:
                    return None
                update = {"attempt": n, "reason": placed(attempt), "unschedulable": False}
                return job.model_copy(update=update | {"updated_at": now()})

            job = await self.jobs.update(attempt.job_id, change)
            if job is not None:
                await self.tell_placed(job, attempt)
                return
            if not final:
                return
            why = final[0].reason

            def end(a: AttemptRecord) -> AttemptRecord | None:
                if a.ended:
                    return None
                return a.model_copy(update={"ended_at": now(), "outcome": JobState.STOPPED, "rule": why})

            ended = await self.attempts.update(key, end)
            if ended is not None:
                ATTEMPTS_ENDED.labels(JobState.STOPPED).inc()
                log.info("supervisor.placed_after_end", attempt=key, job_state=final[0].state)
                await self.kill_rest(ended)
        except Exception as exc:  # the once-a-second check tries again
            log.warning("supervisor.adopt_failed", attempt=key, error=str(exc) or type(exc).__name__)
        finally:
            self._adopting.discard(key)

    async def tell_placed(self, job: JobRecord, attempt: AttemptRecord) -> None:
        """The job's `placed` event, as of the moment its record named the attempt (waiting),
        whichever write did it: the take-up, or a running report or an end that came first."""
        was = job.model_copy(update={"state": JobState.WAITING, "attempt": attempt.attempt})
        await self.event(was, JobEventKind.PLACED, placed(attempt))

    async def check_placements(self) -> None:
        """Placements no write has taken up yet (one seen before its job was, or whose adopt
        failed): taken up now."""
        for attempt in list(self.view_attempts.values()):
            if self.unadopted(attempt):
                await self.adopt(attempt)

    async def end_attempt(self, attempt: AttemptRecord) -> None:
        """Apply an ended attempt to its job: kill what is left of the gang, then end the job or
        make it wait for its next attempt. Idempotent: `JobRecord.settled` records it was done.
        A preempted one is settled once every task's end has come: one that ended of itself
        before the preemption decides it (`policy.own_end`), if it can."""
        await self.kill_rest(attempt)
        if attempt.preempted_by is not None and not all(t.state.ended for t in attempt.tasks):
            return
        steps: list[NextStep] = []
        unnamed: list[bool] = []  # the job record did not name the attempt yet (no `placed` told)

        def change(job: JobRecord) -> JobRecord | None:
            steps.clear()
            unnamed[:] = [job.attempt < attempt.attempt]
            settled = policy.settle(job, attempt, self.limits, now())
            if settled is None:
                return None
            steps.append(settled[1])
            return settled[0]

        job = await self.jobs.update(attempt.job_id, change)
        if job is None:
            return
        step = steps[0]
        if unnamed and unnamed[0]:  # its history says where it ran before how it ended
            await self.tell_placed(job, attempt)
        ATTEMPTS_ENDED.labels(attempt.outcome or "unknown").inc()
        if step.state == JobState.WAITING:
            RETRIES.labels("platform" if step.platform else "user" if step.charged else "restart").inc()
            await self.attempts.update(
                attempt.key,
                lambda a: a.model_copy(update={"charged": step.charged}) if a.charged is None else None,
            )
            await self.event(job, JobEventKind.RETRYING, step.reason)
        else:
            JOBS_ENDED.labels(step.state).inc()
            await self.event(job, JobEventKind.ENDED, step.reason)

    # ------------------------------------------------------------ kill

    async def on_kill(self, sent: consume.Sent[KillRequest]) -> None:
        """A kill request is honoured only from the job's owner (its subject names who sent it;
        an admin sends as the owner). Another user's job is refused as if it did not exist. The
        request decoded, so its job id is a job id's shape (no subject or key is built from
        anything else); who killed it is who sent it, whatever the payload's `user` says."""
        job = await self.jobs.get(sent.message.job_id, confirm=True)  # just submitted, perhaps
        if job is None or job.user != sent.by:
            consume.REFUSED.labels("kill").inc()
            log.warning("supervisor.kill_refused", job_id=sent.message.job_id, by=sent.by[:64])
            return
        await self.kill_job(sent.message.model_copy(update={"user": sent.by}))

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

        job = await self.jobs.update(req.job_id, stop_job)
        if job is None:
            return
        if job.attempt:

            def end(a: AttemptRecord) -> AttemptRecord | None:
                if a.ended:
                    return None
                return a.model_copy(update={"ended_at": now(), "outcome": JobState.STOPPED, "rule": reason})

            if await self.attempts.update(attempt_key(job.job_id, job.attempt), end) is not None:
                ATTEMPTS_ENDED.labels(JobState.STOPPED).inc()
            attempt = await self.attempts.get(attempt_key(job.job_id, job.attempt), confirm=True)
            if attempt is not None:
                await self.kill_rest(attempt, grace=req.grace)
        JOBS_ENDED.labels(JobState.STOPPED).inc()
        await self.event(job, JobEventKind.KILLED, reason)

    async def kill_rest(self, attempt: AttemptRecord, grace: float | None = None) -> None:
        """Kill orders to every node with a task of the attempt not yet ended. The agent stops the
        ones it runs and reports the ones it does not know, so every task reaches a final state."""
        nodes = sorted({t.node for t in attempt.tasks if not t.state.ended})
        order = KillOrder(
            job_id=attempt.job_id,
            attempt=attempt.attempt,
            reason=attempt.rule,
            grace=self.kill_grace if grace is None else grace,
        )
        for node in nodes:
            await bus.publish_once(
                self.js, subjects.kill(node), order.to_bytes(), f"kill:{attempt.key}:{node}"
            )

    # ------------------------------------------------------------ once a second

    async def watch(self, stop: asyncio.Event) -> None:
        await asyncio.gather(*(e.wait() for e in self.synced.values()))
        loop = asyncio.get_running_loop()
        prune_at = loop.time() + 10
        # Silence is only evidence once this replica has itself been listening for a node
        # timeout: after it starts, and after each reconnect (heartbeats sent while it was cut
        # off reached the bucket, but its view of them may lag).
        reconnects = self.nc.stats["reconnects"]
        listening_since = loop.time()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            if self.nc.stats["reconnects"] != reconnects or not self.nc.is_connected:
                reconnects, listening_since = self.nc.stats["reconnects"], loop.time()
            try:
                if loop.time() - listening_since > self.node_timeout:
                    await self.check_nodes()
                await self.check_placements()
                await self.check_starts()
                await self.check_deadlines()
                if loop.time() >= prune_at:
                    prune_at = loop.time() + 60
                    await self.settle_missed()
                    await self.prune()
            except Exception as exc:
                log.warning("supervisor.check_failed", error=str(exc) or type(exc).__name__)

    def heard(self, node: str, at: datetime) -> None:
        """A beat on the bus: a dict write, unless the node had gone quiet."""
        if self.beats.saw(node, at):
            self.quiet.discard(node)

    def node_changed(self, node: str) -> None:
        info = self.view_nodes.get(node)
        if info is None:  # removed (pruned by this replica or another): nothing of it is kept
            self.beats.forget(node)
            self.quiet.discard(node)
        elif self.beats.saw(node, info.heartbeat_at):
            self.quiet.discard(node)

    def attempt_changed(self, key: str) -> None:
        """Keep `tasks_on` (node -> the attempt's tasks there not yet ended) for this attempt:
        O(its tasks) per write of its record, which the group commit keeps few."""
        for node in self._nodes_of.pop(key, ()):
            on = self.tasks_on.get(node)
            if on is not None:
                on.pop(key, None)
                if not on:
                    del self.tasks_on[node]
        attempt = self.view_attempts.get(key)
        if attempt is None:
            return
        if self.unadopted(attempt):
            self._adopting.add(key)  # one at a time per attempt, however many writes come meanwhile
            self._spawn(self.adopt(attempt))
        nodes = set()
        for i, t in enumerate(attempt.tasks):
            if not t.state.ended:
                self.tasks_on.setdefault(t.node, {}).setdefault(key, []).append(i)
                nodes.add(t.node)
        if nodes:
            self._nodes_of[key] = nodes

    async def check_nodes(self) -> None:
        """Every task not ended on a lost node, in any attempt (an ended attempt's leftovers too),
        is reported ended with cause `node_lost`, through the same path as any other exit.

        A node is lost when nothing was heard of it (beat or record) for the node timeout, unless
        it announced a restart whose grace has not passed, or its agent is still connected: a
        node found quiet is asked directly (`subjects.alive`, core NATS). The server answers "no
        responders" at once when the agent's connection is gone (its process died, or the
        server dropped it): lost. An answer is a sign of life. No answer in ALIVE_WAIT means the
        agent is connected but not answering (a stalled process, a busy sim process, a frozen
        machine whose connection the server has not dropped yet): it is given up to
        MUSTER_NODE_STALL_GRACE seconds more (default 3 node timeouts), then lost anyway."""
        at = now()
        self.quiet.update(self.beats.quiet(at))
        candidates = [self.view_nodes[n] for n in self.quiet if n in self.view_nodes]
        silent = policy.lost_nodes(candidates, at, self.node_timeout, self.beats.last)
        stalled = [
            n
            for n in silent
            if (at - self.beats.last[n]).total_seconds() <= self.node_timeout + self.stall_grace
        ]
        answers = await asyncio.gather(*(self.ask_alive(n) for n in stalled)) if stalled else []
        for name, answer in zip(stalled, answers, strict=True):
            if answer is True:
                self.heard(name, now())
            if answer is not False:  # it answered, or is connected and stalled: not lost (yet)
                del silent[name]
        # A node heard of while its agent was asked (a new agent's first beat or record, as the
        # old one's connection is gone) is not lost.
        silent = {name: info for name, info in silent.items() if not self.beats.alive(name, now())}
        lost = {
            name: f"node {name} lost (no heartbeat for {(at - self.beats.last[name]).total_seconds():.0f}s)"
            for name in silent
        }
        NODES_LOST.inc(len(set(lost) - self.lost))
        self.lost = set(lost)
        # A node with tasks but no record to believe (deleted, or refused: from the future, beyond
        # belief) is as silent as one that stopped beating.
        self.absent = {n: self.absent.get(n, at) for n in self.tasks_on if n not in self.view_nodes}
        for name, since in self.absent.items():
            if (at - since).total_seconds() > self.node_timeout:
                lost[name] = f"node {name} lost (no believable node record for {self.node_timeout:g}s)"
        ending = []
        for name, why in lost.items():
            for key, positions in list(self.tasks_on.get(name, {}).items()):
                attempt = self.view_attempts.get(key)
                for i in positions if attempt is not None else ():
                    assert attempt is not None
                    task = attempt.tasks[i]
                    mark = f"{attempt.key}/{task.key}"
                    if task.node == name and not task.state.ended and mark not in self.declared:
                        ending.append((attempt, task, why))
        # A task that reported its own end before its node was lost ends as it said.
        reports = await asyncio.gather(*(self.exit_report(a, t) for a, t, _ in ending))
        told = [(a, t, r) for (a, t, _), r in zip(ending, reports, strict=True) if r is not None]
        # Applied together: the group commit writes an attempt's in one batch, not one each.
        applied = await asyncio.gather(*(self.on_task_event(r) for _, _, r in told), return_exceptions=True)
        for (attempt, task, _), result in zip(told, applied, strict=True):
            if isinstance(result, BaseException):  # looked up and applied again next check
                error = str(result)[:200] or type(result).__name__
                log.warning(
                    "supervisor.exit_report_unapplied", attempt=attempt.key, task=task.key, error=error
                )
            else:
                self.declared.add(f"{attempt.key}/{task.key}")  # not again while the mirror catches up
                log.info("supervisor.exit_report_applied", attempt=attempt.key, task=task.key)
        for (attempt, task, why), report in zip(ending, reports, strict=True):
            if report is None:
                await self.declare_ended(attempt, task, TaskCause.NODE_LOST, why, "lost")

    async def exit_report(self, attempt: AttemptRecord, task: TaskStatus) -> consume.Sent[TaskEvent] | None:
        """The task's own exit report, if its node sent one before it was lost. Its delivery may
        be held by a replica that took it and died before its ack (it comes again only after the
        ack wait, 30 s), while the node, gone too, is found lost sooner: the task was recorded as
        lost with the node when it had ended as it said (a chaos run: two tasks that exited 3
        recorded node_lost). One direct read per task of a lost node, once; none otherwise."""
        subject = subjects.task_event(
            attempt.job_id, attempt.attempt, task.role, task.index, TaskEventKind.EXITED, task.node
        )
        try:
            stored = await self.js.get_last_msg(subjects.EVENTS_STREAM, subject, direct=True)
        except NotFoundError:
            return None
        except Exception as exc:  # the bus away: declared lost as before
            error = str(exc)[:200] or type(exc).__name__
            log.warning("supervisor.exit_report_unread", attempt=attempt.key, task=task.key, error=error)
            return None
        try:
            event = TaskEvent.from_bytes(stored.data or b"")
            why = policy.event_refusal(event, subject, task.node, attempt)
        except ValueError as exc:
            why = str(exc)[:200]
        if why is not None:  # garbage, or not the report it is filed as: the node is lost with it
            consume.REFUSED.labels("task_event").inc()
            log.warning("supervisor.exit_report_refused", subject=subject[:200], why=why)
            return None
        return consume.Sent(task.node, subject, event)

    async def ask_alive(self, node: str) -> bool | None:
        """Whether the node's agent answers (True), is gone from the bus (False: no responders),
        or is connected but did not answer in time (None)."""
        try:
            await self.nc.request(subjects.alive(node), b"", timeout=ALIVE_WAIT)
            return True
        except nats.errors.NoRespondersError:
            return False
        except Exception:  # a timeout, or the bus away (then the reconnect resets listening)
            return None

    async def check_starts(self) -> None:
        """Tasks still not started long after their attempt was placed fail as platform faults."""
        cutoff = now() - timedelta(seconds=self.start_timeout)
        for attempt in list(self.view_attempts.values()):
            if attempt.ended or attempt.placed_at >= cutoff:
                continue
            for task in attempt.tasks:
                if task.state == TaskState.PLACED and (task.placed_at or attempt.placed_at) < cutoff:
                    why = f"not started within {self.start_timeout:g}s of placement on {task.node}"
                    await self.declare_ended(attempt, task, TaskCause.PLATFORM, why, "start-timeout")

    async def check_deadlines(self) -> None:
        """Attempts running past their job's maxRunTimeSec end as failed (the stored record
        decides: one replica does it), and the rest of their gang is stopped."""
        at = now()
        for attempt in list(self.view_attempts.values()):
            job = self.view_jobs.get(attempt.job_id)
            if not isinstance(job, JobRecord) or job.config.maxRunTimeSec is None:
                continue
            if policy.timed_out(job.config, attempt, at) is None:
                continue
            config = job.config

            def end(stored: AttemptRecord, config: JobConfig = config) -> AttemptRecord | None:
                return policy.timed_out(config, stored, now())

            ended = await self.attempts.update(attempt.key, end)
            if ended is not None:
                ATTEMPTS_ENDED.labels(JobState.FAILED).inc()
                log.info("supervisor.time_limit", attempt=ended.key, limit=config.maxRunTimeSec)
                await self.end_attempt(ended)

    async def declare_ended(
        self, attempt: AttemptRecord, task: TaskStatus, cause: TaskCause, reason: str, tag: str
    ) -> None:
        mark = f"{attempt.key}/{task.key}"
        if mark in self.declared:
            return
        await bus.publish_once(
            self.js,
            subjects.task_event(
                attempt.job_id,
                attempt.attempt,
                task.role,
                task.index,
                TaskEventKind.EXITED,
                subjects.PLATFORM,
            ),
            TaskEvent(
                job_id=attempt.job_id,
                attempt=attempt.attempt,
                role=task.role,
                index=task.index,
                node=task.node,
                kind=TaskEventKind.EXITED,
                cause=cause,
                reason=reason,
            ).to_bytes(),
            f"{tag}:{mark}",
        )
        self.declared.add(mark)
        log.warning(
            "supervisor.task_declared_ended", attempt=attempt.key, task=task.key, cause=cause, reason=reason
        )

    async def settle_missed(self) -> None:
        """Attempts that ended while their job was never settled for them: every delivery of
        the event that ended one failed to settle it (the bus away longer than its retries).
        The mirror drops an attempt once it and its tasks have ended, so nothing else would look
        again and the job would stay running for ever. One read per such job, none otherwise.
        Only one that ended SETTLE_GRACE ago or more: one that ended just now is being settled
        by its event's handler (its retries last under a minute), which this would only repeat."""
        ended_by = now() - timedelta(seconds=SETTLE_GRACE)
        for job in list(self.view_jobs.values()):
            if not isinstance(job, JobRecord) or job.state.final or job.attempt <= job.settled:
                continue
            key = attempt_key(job.job_id, job.attempt)
            if key in self.view_attempts:
                continue  # still watched: its end is applied as it comes
            attempt = await self.attempts.get(key, confirm=True)
            if attempt is not None and attempt.ended_at is not None and attempt.ended_at < ended_by:
                log.warning("supervisor.settling_missed", attempt=key)
                await self.end_attempt(attempt)

    async def prune(self) -> None:
        """Delete finished jobs' records after their retention, and nodes long gone."""
        at = now()
        for job in list(self.view_jobs.values()):
            if isinstance(job, Finished) and policy.should_prune(job, at, self.job_retention):
                await self.forget_job(job)
        cutoff = at - timedelta(seconds=self.node_retention)
        for node in list(self.view_nodes.values()):
            if self.beats.last.get(node.node, node.heartbeat_at) < cutoff:
                await self.forget_node(node)
        self.declared = {m for m in self.declared if m.split("/")[0] in self.view_attempts}
        self.prunes += 1
        if self.prunes % 60 == 0:  # hourly: drop the delete markers the deletions left behind
            buckets = (
                self.jobs.kv,
                self.attempts.kv,
                self.nodes.kv,
                self.rendezvous,
                self.names,
                self.secrets,
            )
            for kv in buckets:
                await purge_deletes(kv, older_than=3600)

    async def forget_job(self, job: JobRecord | Finished) -> None:
        # One beyond the attempt it names: one placed as it was killed, ended by `adopt`.
        for n in range(1, job.attempt + 2):
            key = attempt_key(job.job_id, n)
            await self.attempts.delete(key)
            await self.rendezvous.purge(key)
            # Its endpoints, each under its own key (services/registry): one purge for all.
            endpoints = subjects.endpoint_keys(job.job_id, n)
            await self.js.purge_stream(self.rendezvous._stream, subject=f"{self.rendezvous._pre}{endpoints}")
        name = subjects.name_key(job.user, job.job_name)
        with contextlib.suppress(KeyNotFoundError, KeyWrongLastSequenceError):
            claim = await self.names.get(name)
            if claim.value == job.job_id.encode():
                await self.names.delete(name, last=claim.revision)
        with contextlib.suppress(KeyNotFoundError):
            await self.secrets.purge(job.job_id)
        await self.jobs.delete(job.job_id)
        PRUNED.labels("job").inc()
        log.info("supervisor.job_pruned", job_id=job.job_id, ended=job.updated_at.isoformat())

    async def forget_node(self, node: NodeInfo) -> None:
        # Its record goes last: a sweep that fails before it finds the node again next time.
        with contextlib.suppress(NotFoundError):
            await self.js.delete_consumer(subjects.COMMANDS_STREAM, subjects.agent_consumer(node.node))
        # Orders it never read stay in the work queue without its consumer (secret values in them)
        await self.js.purge_stream(subjects.COMMANDS_STREAM, subject=subjects.node_commands(node.node))
        await self.nodes.delete(node.node)
        self.beats.forget(node.node)
        self.quiet.discard(node.node)
        PRUNED.labels("node").inc()
        log.info("supervisor.node_pruned", node=node.node, last_heartbeat=node.heartbeat_at.isoformat())

    # ------------------------------------------------------------ shared

    async def event(self, job: JobRecord, kind: JobEventKind, detail: str) -> None:
        await bus.publish_once(
            self.js,
            subjects.job_event(job.job_id, kind),
            JobEvent(
                job_id=job.job_id,
                job_name=job.job_name,
                kind=kind,
                state=job.state,
                attempt=job.attempt,
                detail=detail,
            ).to_bytes(),
            f"{job.job_id}:{job.attempt}:{kind}",
        )
        log.info(
            "supervisor.job_state", job_id=job.job_id, attempt=job.attempt, state=job.state, reason=detail
        )
