"""The gateway: how users read what Muster knows of their jobs, and nothing else.

Users hold no JetStream rights. They ask the gateway by NATS request/reply on
`muster.api.<name>.<verb>`, a subject the server lets only identity `<name>` publish, so the
gateway knows who asks without trusting anything the request says; admins ask as
`muster.api._all.<verb>` and see every job. A job that is not the asker's is answered exactly as
a job that does not exist. Records are stored with secret jobEnvs values already redacted.

Verbs (JSON in, JSON out; every answer is `{"error": ..., "code": ...}` or the result):
- `ping`: who the gateway takes the asker to be.
- `jobs` `{"state", "user", "vc", "name", "since", "until", "cursor", "limit"}`: a page of the
  asker's jobs (every job for an admin), newest first, filtered (listing.py): `{"jobs", "next"}`,
  and on the first page (no cursor) `counts` per state, `total`, and `queued` (the jobs waiting,
  as the scheduler last said; null before it has). At most 1000 (default 100) jobs and 512 KiB
  a page; pass `next` back as `cursor` for the page after. Each WAITING job has `place`: its
  place in the queue (1 first), null beyond the QUEUE_SHOWN the scheduler names or when unknown.
  With `changed_since` (an ISO time with a zone) instead of a cursor: the jobs (same filters)
  whose record the gateway saw written since then, most recently first, at most `limit`:
  `{"jobs", "more", "now", "counts", "total", "queued"}`; pass `now` back next time (`more`:
  others changed too, read the list again). It costs what changed, not the jobs retained.
- `job` `{"ref"}`: one job by id or name, with every attempt, and `place` and `queued`.
- `verdict` `{"sid"}`: the stored verdict on one of the asker's submissions.
- `logs` `{"job_id", "attempt", "task", "after", "limit"}`: output lines after stream sequence
  `after`, about `limit` (and at most 512 KiB) per answer, with `more` when there are others;
  only lines the task's own node published, for a task the attempt has, count.
- `metrics` `{"job_id", "attempt", "task", "after", "limit"}`: the training metric batches its
  tasks published (MUSTER_METRICS), paged the same way; only batches from the node each task ran
  on count. `job` also answers each task's latest values of its current attempt.
- `events` `{"job_id", "after", "limit"}`: the job's history, paged the same way.
- `vcs`: every virtual cluster: its quota, what it holds (and of that, borrowed beyond the quota),
  its jobs running and waiting. Totals only: anyone may ask.
- `nodes` `{"cursor", "limit"}`: the cluster (cluster.py), anyone may ask: a page of nodes by
  name, each with its state (healthy, draining, restarting, lost), address, CPUs and memory
  (and used), GPUs per model (total, used, free) and per device (used, and its job's id only
  when the asker owns that job or is an admin); at most 1000 (default 100) and 512 KiB a page,
  `next` as for jobs. The first page also has `summary` (nodes per state, GPUs per model) and
  `allocation`: `[[iso time, GPUs used, GPUs of nodes not lost], ...]`, sampled by each replica
  every MUSTER_ALLOCATION_SAMPLE seconds (default 60) for the last 24 hours.

Places in the queue come from the scheduler leader's `muster.queue` (messages.QueueOrder), which
every replica hears (no queue group) and keeps the latest of; one older than QUEUE_STALE seconds
(no leader) is not believed. Nodes' liveness comes from their beats (`muster.beat.<node>`).

Streams are read a page at a time by one batched direct get (no consumer): nothing beyond the
page reaches the gateway, however large the stream. No answer is sent above the server's
payload limit: one that would be, or that fails to go, is logged, counted and answered with an
error instead.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import re
from typing import Any, ClassVar

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter
from pydantic import ValidationError

from muster.services.gateway.cluster import Cluster, live
from muster.services.gateway.listing import Listing, Query, Summary, cursor_key, micros
from muster.shared import bus, liveness, settings, subjects, vcquota
from muster.shared.auth import NAME_RE
from muster.shared.messages import (
    AttemptRecord,
    JobRecord,
    JobState,
    MetricBatch,
    NodeInfo,
    Question,
    QueueOrder,
    Verdict,
    VirtualCluster,
    attempt_key,
    node_refusal,
    now,
    vc_refusal,
)
from muster.shared.store import Store, confirmed

log = structlog.get_logger(service="gateway")
REQUESTS = Counter("muster_gateway_requests_total", "Questions answered by the gateway", ["verb", "outcome"])
BAD_BATCHES = Counter(
    "muster_gateway_bad_metric_batches_total", "Metric batches skipped: not decoded or not believed"
)
BAD_LOGS = Counter(
    "muster_gateway_bad_log_messages_total",
    "Output messages skipped: not from the node their task was placed on, or for a task the attempt has not",
)
UNSENT = Counter(
    "muster_gateway_answers_unsent_total",
    "Answers not sent as they were: above the server's payload limit, or the send failed",
    ["verb", "why"],
)
BAD_QUEUE = Counter("muster_gateway_bad_queue_orders_total", "Queue orders skipped: they do not decode")
MAX_REPLY = 512 * 1024
# Questions answered at once; past it one is answered "busy" at once. The server's limits on a
# subscription's pending messages do not apply: each is taken off the subscription as it comes.
MAX_ANSWERING = settings.number("MUSTER_GATEWAY_MAX_ANSWERING", 256, int, low=1)
# Of them, one asker's at most (the subject's name, which the server checked): one user's flood of
# slow questions leaves the others room.
MAX_PER_ASKER = settings.number("MUSTER_GATEWAY_MAX_PER_ASKER", 32, int, low=1)
INBOXES = "_INBOX."  # where answers may go: every client's replies come there (shared/auth.py)
JOBS_PAGE, JOBS_PAGE_MAX = 100, 1000  # jobs in a page: by default, at most
NODES_PAGE, NODES_PAGE_MAX = 100, 1000  # nodes in a page: by default, at most
QUEUE_STALE = 60.0  # seconds after which the last queue order heard is not believed (no leader)
# Seconds between two samples of the GPU allocation (the cluster page's chart).
ALLOCATION_SAMPLE = settings.seconds("MUSTER_ALLOCATION_SAMPLE", 60.0, low=1.0)
SYNC_WAIT = 10.0  # seconds a question waits for the gateway's first read of the job list
READ_WAIT = 2.0  # seconds a listing waits for the gateway's mirror to hold every earlier write
DIRECT_WAIT = 5.0  # seconds for a page of a stream
LATEST_TASKS = 64  # `job` answers the latest metrics of at most this many tasks
VCS_FRESH = 5.0  # seconds a `vcs` answer serves every asker
# `job` answers a job's newest attempts, at most this many (and one asked for by number), within
# a page's bytes: a job restarted for ever (retryCount -2, preemptions) has thousands.
ATTEMPTS_SHOWN = 20
KEY_RE = re.compile(r"^[-/_=.a-zA-Z0-9]{1,128}$")
TASK_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.\d+)?$")


class Refused(Exception):
    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


Stored = tuple[str, int, bytes]  # a stream message: its subject, sequence and data


class Queue:
    """The scheduler leader's last queue order (QueueOrder on `muster.queue`): each job's place,
    and how many wait. One that does not decode is counted and skipped (the last good one
    stands); one older than QUEUE_STALE seconds (no leader says any more) is not believed."""

    def __init__(self) -> None:
        self.places: dict[str, int] = {}  # job id -> its place, 1 first
        self.total = 0
        self.at = -math.inf  # when heard (loop time)

    def heard(self, data: bytes | None, at: float) -> bool:
        try:
            order = QueueOrder.from_bytes(data)
        except ValueError:
            BAD_QUEUE.inc()
            return False
        self.places = {job_id: n for n, job_id in enumerate(order.jobs, start=1)}
        self.total, self.at = order.total, at
        return True

    def queued(self, at: float) -> int | None:
        return self.total if at - self.at < QUEUE_STALE else None

    def place(self, s: Summary, at: float) -> int | None:
        """A waiting job's place, if the scheduler said lately (None beyond what it named)."""
        if s.state != JobState.WAITING or at - self.at >= QUEUE_STALE:
            return None
        return self.places.get(s.job_id)


class Gateway:
    def __init__(self, nc: NATS, js: JetStreamContext, buckets: dict[str, KeyValue]):
        self.nc, self.js = nc, js
        self.jobs = Store(buckets[subjects.JOBS_BUCKET], JobRecord)
        self.names = buckets[subjects.JOB_NAMES_BUCKET]
        self.attempts = Store(buckets[subjects.ATTEMPTS_BUCKET], AttemptRecord)
        self.listing = Listing()  # every retained job, summarised and indexed
        self.synced = asyncio.Event()
        self.kv_vcs = Store(buckets[subjects.VCS_BUCKET], VirtualCluster, check=vc_refusal)
        self.kv_nodes = Store(buckets[subjects.NODES_BUCKET], NodeInfo, check=node_refusal)
        self.vcs: dict[str, VirtualCluster] = {}
        self.vcs_synced = asyncio.Event()
        self.cluster = Cluster(self.listing, bus.node_timeout(), ALLOCATION_SAMPLE)
        self.nodes_synced, self.held_synced = asyncio.Event(), asyncio.Event()
        self.queue = Queue()  # the scheduler's last queue order
        self.running: set[asyncio.Task[None]] = set()
        self._misdirected = 0  # questions whose reply subject was not an inbox
        self.asking: collections.Counter[str] = collections.Counter()  # asker -> questions in hand
        self._vcs: tuple[float, asyncio.Future[dict[str, Any]]] | None = None  # the last `vcs` answer

    @classmethod
    async def build(cls, nc: NATS) -> Gateway:
        js, buckets = await bus.setup(nc)
        return cls(nc, js, buckets)

    async def run(self, stop: asyncio.Event) -> None:
        await liveness.listen(self.nc, self.cluster.beat)  # before the node records: no beat is missed
        # Every replica hears the queue order (no queue group) and keeps the latest.
        queue = await self.nc.subscribe(subjects.QUEUE, cb=self._queue_heard)
        cluster = self.cluster
        background = [
            asyncio.create_task(self.jobs.mirror(self.listing, self.synced, keep=Summary.of)),
            asyncio.create_task(self.kv_vcs.mirror(self.vcs, self.vcs_synced)),
            asyncio.create_task(self.kv_nodes.mirror(cluster.nodes, self.nodes_synced, cluster.node_changed)),
            asyncio.create_task(self.attempts.mirror(cluster.held, self.held_synced, keep=live)),
            asyncio.create_task(self._sample()),
        ]
        # A queue group: replicas share the questions.
        sub = await self.nc.subscribe(subjects.api("*", "*"), queue="gateway", cb=self._take)
        try:
            await stop.wait()
        finally:
            for s in (sub, queue):
                with contextlib.suppress(Exception):
                    await s.unsubscribe()
            for task in background:
                task.cancel()
            if self.running:
                await asyncio.wait(list(self.running), timeout=5)

    async def _queue_heard(self, msg: Msg) -> None:
        self.queue.heard(msg.data, asyncio.get_running_loop().time())

    def place(self, s: Summary) -> int | None:
        return self.queue.place(s, asyncio.get_running_loop().time())

    def queued(self) -> int | None:
        return self.queue.queued(asyncio.get_running_loop().time())

    def _placed(self, s: Summary, item: dict[str, Any]) -> None:
        if s.state == JobState.WAITING:
            item["place"] = self.place(s)

    async def _sample(self) -> None:
        """The GPU allocation every ALLOCATION_SAMPLE seconds, the first once the records are read."""
        await asyncio.gather(self.synced.wait(), self.nodes_synced.wait(), self.held_synced.wait())
        while True:
            try:
                self.cluster.sample(now())
            except Exception as exc:  # a gap in the chart, never the end of the sampling
                log.warning("gateway.sample_failed", error=str(exc) or type(exc).__name__)
            await asyncio.sleep(ALLOCATION_SAMPLE)

    async def _take(self, msg: Msg) -> None:
        if msg.reply and not msg.reply.startswith(INBOXES):
            # An answer goes only to an inbox: the server lets a responder publish its answer on
            # whatever reply subject the asker named, so `$KV.muster_jobs.<id>` or another node's
            # orders subject would have been overwritten with it (docs/security.md).
            REQUESTS.labels("?", "refused").inc()
            self._misdirected += 1
            if self._misdirected & (self._misdirected - 1) == 0:  # the 1st, 2nd, 4th...: no flood
                log.warning("gateway.reply_refused", subject=msg.subject[:200], reply=msg.reply[:200])
            return
        who = msg.subject.rsplit(".", 2)[-2] if msg.subject.count(".") >= 2 else "?"
        mine = self.asking[who]
        if len(self.running) >= MAX_ANSWERING or mine >= MAX_PER_ASKER:  # a flood of questions
            verb = msg.subject.rsplit(".", 1)[-1]
            verb = verb if verb in self.VERBS else "?"
            REQUESTS.labels(verb, "busy").inc()
            if msg.reply:
                busy = (
                    f"the gateway is busy ({len(self.running)} questions in hand); ask again shortly"
                    if mine < MAX_PER_ASKER
                    else f"{mine} of your questions are in hand; ask again once they are answered"
                )
                await self._respond(msg, verb, {"error": busy, "code": 1})
            return
        task = asyncio.create_task(self._answer(msg))
        self.running.add(task)
        self.asking[who] += 1

        def done(task: asyncio.Task[None]) -> None:
            self.running.discard(task)
            self.asking[who] -= 1
            if not self.asking[who]:
                del self.asking[who]

        task.add_done_callback(done)

    async def _answer(self, msg: Msg) -> None:
        if not msg.reply:
            return
        parts = msg.subject.split(".")
        who, verb = parts[-2], parts[-1]
        try:
            if who != subjects.ALL and not NAME_RE.match(who):
                raise Refused(f"bad asker {who!r}")
            try:
                request = Question.model_validate_json(msg.data or b"{}")
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}" for e in exc.errors()[:5]
                )
                raise Refused(f"bad question: {problems}") from None
            handler = self.VERBS.get(verb)
            if handler is None:
                raise Refused(f"no such question {verb!r}; ask one of {', '.join(self.VERBS)}")
            answer = await handler(self, who, request)
            REQUESTS.labels(verb if verb in self.VERBS else "?", "ok").inc()
        except Refused as exc:
            REQUESTS.labels(verb if verb in self.VERBS else "?", "refused").inc()
            answer = {"error": str(exc), "code": exc.code}
        except Exception as exc:
            REQUESTS.labels(verb if verb in self.VERBS else "?", "failed").inc()
            log.warning("gateway.failed", subject=msg.subject[:200], error=str(exc) or type(exc).__name__)
            answer = {"error": f"the gateway could not answer: {type(exc).__name__}", "code": 1}
        await self._respond(msg, verb if verb in self.VERBS else "?", answer)

    async def _respond(self, msg: Msg, verb: str, answer: dict[str, Any]) -> None:
        """Send `answer`; one above the server's payload limit, or that fails to go, is logged,
        counted and replaced by an error (which may still be lost if the asker went away)."""
        data = json.dumps(answer, default=str, separators=(",", ":")).encode()
        if len(data) > self.nc.max_payload:
            UNSENT.labels(verb, "too_large").inc()
            log.warning("gateway.answer_too_large", subject=msg.subject[:200], bytes=len(data))
            error = f"the answer ({len(data)} bytes) is above the server's limit of {self.nc.max_payload}"
            data = json.dumps({"error": error, "code": 1}).encode()
        try:
            await msg.respond(data)
        except Exception as exc:
            why = str(exc) or type(exc).__name__
            UNSENT.labels(verb, "send").inc()
            log.warning("gateway.answer_unsent", subject=msg.subject[:200], error=why)
            unsent = {"error": f"the answer could not be sent: {why}", "code": 1}
            with contextlib.suppress(Exception):
                await msg.respond(json.dumps(unsent).encode())

    @property
    def budget(self) -> int:
        """Bytes a page's items may take: MAX_REPLY, within the server's payload limit."""
        return max(1024, min(MAX_REPLY, self.nc.max_payload - 4096))

    async def listed(self) -> Listing:
        """The job list, once the gateway has read the bucket through."""
        try:
            await asyncio.wait_for(self.synced.wait(), SYNC_WAIT)
        except TimeoutError:
            read = len(self.listing)
            why = f"the gateway is still reading the job list ({read} jobs so far); ask again"
            raise Refused(why, 1) from None
        # Read your writes: a job whose submit was accepted is in the bucket, but the mirror may
        # hear of it a moment later (more so with clustered servers). Listed at once, it would
        # be missing; so the listing waits, briefly, for the mirror to hold every earlier write.
        with contextlib.suppress(Exception):  # the bus is away: list what the mirror holds
            if not await self.jobs.caught_up(READ_WAIT):
                log.warning("gateway.listing_behind", applied=self.jobs.applied)
        return self.listing

    # ------------------------------------------------------------ questions

    async def ping(self, who: str, request: Question) -> dict[str, Any]:
        return {"user": who, "admin": who == subjects.ALL}

    async def list_jobs(self, who: str, request: Question) -> dict[str, Any]:
        """A page of the asker's jobs (an admin's: everyone's, or one user's), newest first."""
        scope = who
        if request.user is not None and request.user != who:
            if who != subjects.ALL:
                raise Refused(f"user {request.user!r}: you may list only your own jobs")
            scope = request.user
        try:
            after = cursor_key(request.cursor) if request.cursor is not None else None
        except ValueError as exc:
            raise Refused(str(exc)) from None
        query = Query(
            scope=scope,
            states=tuple(dict.fromkeys(request.state)) if request.state else Query.states,
            vc=request.vc,
            name=request.name,
            since=micros(request.since) if request.since else None,
            until=micros(request.until) if request.until else None,
            after=after,
        )
        limit = min(request.limit, JOBS_PAGE_MAX) if "limit" in request.model_fields_set else JOBS_PAGE
        listing = await self.listed()
        if request.changed_since is not None:
            if request.cursor is not None:
                raise Refused("changed_since takes no cursor: it answers what changed, newest first")
            answer = listing.changed(query, micros(request.changed_since), limit, self.budget, self._placed)
        else:
            answer = listing.page(query, limit, self.budget, self._placed)
        if "counts" in answer:
            answer["queued"] = self.queued()
        return answer

    async def job(self, who: str, request: Question) -> dict[str, Any]:
        """A job's record and its newest attempts (`ATTEMPTS_SHOWN`, within a page's bytes; the
        newest always), with the one numbered `attempt` when asked for; `attempts_total` says
        how many it has had."""
        record = await self.resolve(who, request.ref)
        wanted = list(range(record.attempt, max(0, record.attempt - ATTEMPTS_SHOWN), -1))  # newest first
        if (
            request.attempt is not None
            and request.attempt <= record.attempt
            and request.attempt not in wanted
        ):
            wanted.append(request.attempt)
        found = await asyncio.gather(
            *(self.attempts.get(attempt_key(record.job_id, n), confirm=True) for n in wanted)
        )
        history: list[dict[str, Any]] = []
        size = 0
        for n, attempt in zip(wanted, found, strict=True):
            if attempt is None:
                continue
            doc = attempt.model_dump(mode="json")
            size += len(json.dumps(doc, default=str, separators=(",", ":")))
            if history and size > self.budget and n != request.attempt:
                continue  # past the page: the newest and the one asked for are always answered
            history.append(doc)
        history.sort(key=lambda a: a["attempt"])
        answer: dict[str, Any] = {
            "job": record.model_dump(mode="json"),
            "attempts": history,
            "attempts_total": record.attempt,
        }
        answer["place"] = self.place(Summary.of(record))
        answer["queued"] = self.queued()
        if history and (record.config.metrics or record.config.noProgressTimeoutSec):
            answer["metrics"] = await self.latest_metrics(AttemptRecord.model_validate(history[-1]))
        return answer

    async def latest_metrics(self, attempt: AttemptRecord) -> dict[str, Any]:
        """Per task of the attempt (the first LATEST_TASKS): its latest metric values and when it
        last printed, from the last batch its node's agent published."""

        async def one(role: str, index: int, node: str) -> dict[str, Any] | None:
            subject = subjects.task_metrics(attempt.job_id, attempt.attempt, role, index, node)
            try:
                stored = await self.js.get_last_msg(subjects.METRICS_STREAM, subject, direct=True)
            except NotFoundError:
                return None
            except Exception as exc:  # status without metrics rather than no status at all
                log.warning("gateway.metrics_unread", subject=subject, error=str(exc) or type(exc).__name__)
                return None
            # A stored message always has a subject; one without is no task's batch (refused).
            batch = self.believed(stored.subject or "", stored.data, {f"{role}.{index}": node})
            if batch is None:
                return None
            return {
                "latest": [p.model_dump(mode="json") for p in batch.latest],
                "last_output_at": batch.last_output_at.isoformat() if batch.last_output_at else None,
            }

        tasks = attempt.tasks[:LATEST_TASKS]
        found = await asyncio.gather(*(one(t.role, t.index, t.node) for t in tasks))
        return {t.key: f for t, f in zip(tasks, found, strict=True) if f is not None}

    @staticmethod
    def believed(subject: str, data: bytes | None, nodes: dict[str, str]) -> MetricBatch | None:
        """A batch whose subject names the node its task ran on (`nodes`: task -> node) and that
        decodes and agrees with its subject; else None, counted."""
        token = subject.split(".")
        try:
            batch = MetricBatch.from_bytes(data)
            task = f"{token[-3]}.{token[-2]}"
            if (
                nodes.get(task) != token[-1]
                or batch.node != token[-1]
                or f"{batch.role}.{batch.index}" != task
                or str(batch.attempt) != token[-4]
            ):
                raise ValueError("not its task's node")
            return batch
        except (ValueError, IndexError):
            BAD_BATCHES.inc()
            return None

    async def verdict(self, who: str, request: Question) -> dict[str, Any]:
        sid = request.sid
        if who == subjects.ALL or sid is None or not re.match(subjects.SUBMISSION_ID_RE, sid):
            raise Refused("no such submission")
        try:
            subject = subjects.verdict(who, sid)
            stored = await self.js.get_last_msg(subjects.EVENTS_STREAM, subject, direct=True)
        except NotFoundError:
            return {"verdict": None}
        return {"verdict": Verdict.from_bytes(stored.data).model_dump(mode="json")}

    async def tasks_asked(self, who: str, request: Question) -> tuple[JobRecord, int, str, str]:
        """The job, attempt, role and index (`*`: every one) a logs or metrics question names."""
        record = await self.resolve(who, request.job_id)
        attempt, task = request.attempt, request.task or ""
        if attempt is None or not 1 <= attempt <= max(1, record.attempt):
            raise Refused(f"job {record.job_id} has no attempt {attempt}")
        if task and not TASK_RE.match(task):
            raise Refused(f"bad task {task!r}: expected ROLE or ROLE.INDEX")
        role, _, index = task.partition(".") if task else ("*", "", "*")
        return record, attempt, role or "*", index or "*"

    async def logs(self, who: str, request: Question) -> dict[str, Any]:
        """A page of output lines (`[task, line]`): only messages on the subject of the node
        each task was placed on, for tasks the attempt has, are believed; others are skipped
        and counted (any agent may publish output under its own node's name)."""
        record, attempt, role, index = await self.tasks_asked(who, request)
        placed = await self.attempts.get(attempt_key(record.job_id, attempt), confirm=True)
        nodes = {t.key: t.node for t in placed.tasks} if placed is not None else {}
        task = f"{role}.{index}"
        node = nodes.get(task, "*") if "*" not in task else "*"  # one task: its own node's subject
        subject = subjects.task_logs(record.job_id, attempt, role, index, node)
        msgs, last, more = await self.read(subjects.LOGS_STREAM, subject, request.after, request.limit)
        lines: list[list[str]] = []
        size, budget = 0, self.budget
        for n, (subj, seq, data) in enumerate(msgs):
            token = subj.split(".")
            key = f"{token[-3]}.{token[-2]}" if len(token) == 7 else ""
            if not key or nodes.get(key) != token[-1]:
                BAD_LOGS.inc()
                last = seq
                continue
            text = data.decode("utf-8", "replace")
            page = [[key, line] for line in text.split("\n")]
            cost = len(json.dumps(page, separators=(",", ":")))
            if lines and (size + cost > budget or len(lines) >= request.limit):
                more, last = True, msgs[n - 1][1]
                break
            if cost > budget:  # one message above a page (not an agent's): as much as fits
                page = page[: max(1, len(page) * budget // cost)]
                page[-1] = [key, page[-1][1][: budget // 8]]
                page.append([key, "[muster: the rest of this message is too large for one answer]"])
            lines.extend(page)
            size += cost
            last = seq
        return {"lines": lines, "last": last, "more": more, "final": record.state.final}

    async def metrics(self, who: str, request: Question) -> dict[str, Any]:
        """A page of the training metric batches of one attempt's tasks (or one task's): each
        `{"task", "points": [{"t", "step", "name", "value"}], "dropped"}`."""
        record, attempt, role, index = await self.tasks_asked(who, request)
        subject = subjects.task_metrics(record.job_id, attempt, role, index)
        placed = await self.attempts.get(attempt_key(record.job_id, attempt), confirm=True)
        nodes = {t.key: t.node for t in placed.tasks} if placed is not None else {}
        msgs, last, more = await self.read(subjects.METRICS_STREAM, subject, request.after, request.limit)
        out = []
        for subj, _, data in msgs:
            batch = self.believed(subj, data, nodes)
            if batch is not None and (batch.points or batch.dropped):
                out.append(
                    {
                        "task": f"{batch.role}.{batch.index}",
                        "points": [p.model_dump(mode="json") for p in batch.points],
                        "dropped": batch.dropped,
                    }
                )
        return {"batches": out, "last": last, "more": more, "final": record.state.final}

    async def events(self, who: str, request: Question) -> dict[str, Any]:
        """The job's history (accepted, placed, running, retrying, ended...)."""
        record = await self.resolve(who, request.job_id or request.ref)
        subject = subjects.job_events(record.job_id)
        msgs, last, more = await self.read(subjects.EVENTS_STREAM, subject, request.after, request.limit)
        events = []
        for _, _, data in msgs:
            with contextlib.suppress(ValueError):
                events.append(json.loads(data))
        return {"events": events, "last": last, "more": more, "final": record.state.final}

    async def virtual_clusters(self, who: str, request: Question) -> dict[str, Any]:
        """Per VC: quota (`default`'s is what the others leave of the registered nodes), used
        and borrowed (by live tasks' GPU models), jobs running and waiting. It reads two records
        per placed job: one answer is made for every asker within VCS_FRESH seconds (any user
        asking again and again made the gateway read the whole cluster's records each time)."""
        loop = asyncio.get_running_loop()
        if self._vcs is None or loop.time() - self._vcs[0] > VCS_FRESH:
            made = asyncio.ensure_future(self._virtual_clusters())
            self._vcs = (loop.time(), made)

            def failed(made: asyncio.Future[dict[str, Any]]) -> None:
                if self._vcs is not None and self._vcs[1] is made and (made.cancelled() or made.exception()):
                    self._vcs = None  # not kept: the next asker makes it again

            made.add_done_callback(failed)
        return await asyncio.shield(self._vcs[1])

    async def _virtual_clusters(self) -> dict[str, Any]:
        listing = await self.listed()
        await asyncio.wait_for(self.vcs_synced.wait(), SYNC_WAIT)
        await self.synced_nodes()
        nodes = self.cluster.nodes
        capacity = vcquota.capacity_of(nodes.values())
        limits = vcquota.limits(self.vcs, capacity)

        def model_of(node: str, index: int) -> str | None:
            info = nodes.get(node)
            return next((d.model for d in info.gpus if d.index == index), None) if info else None

        rows: dict[str, dict[str, Any]] = {}

        def row(name: str) -> dict[str, Any]:
            if name not in rows:
                rows[name] = {
                    "used": vcquota.Amount(),
                    "borrowed": vcquota.Amount(),
                    "running": 0,
                    "waiting": 0,
                }
            return rows[name]

        for name in limits:
            row(name)
        placed: list[Summary] = []
        for state in (JobState.WAITING, JobState.RUNNING):
            for s in list(listing.of_state(subjects.ALL, state)):
                row(s.vc)["waiting" if state == JobState.WAITING else "running"] += 1
                if s.attempt:
                    placed.append(s)

        async def holding(s: Summary) -> tuple[JobRecord, AttemptRecord] | None:
            """A placed job's record and current attempt (the list keeps neither)."""
            record = await self.jobs.get(s.job_id)
            if record is None or record.state.final or not record.attempt:
                return None
            attempt = await self.attempts.get(attempt_key(record.job_id, record.attempt))
            return None if attempt is None else (record, attempt)

        held = []
        for i in range(0, len(placed), 64):
            held += await asyncio.gather(*(holding(s) for s in placed[i : i + 64]))
        for pair in held:  # what they hold
            if pair is None:
                continue
            record, attempt = pair
            live = [t.spec() for t in attempt.tasks if not t.state.ended]
            use = vcquota.held(record.config, live, model_of)
            r = row(record.config.virtualCluster)
            r["used"].add(use)
            if attempt.borrowed:
                r["borrowed"].add(use)
        out = []
        for name in sorted(rows, key=lambda n: (n != vcquota.DEFAULT_VC, n)):
            vc, lim, r = self.vcs.get(name), limits.get(name), rows[name]
            out.append(
                {
                    "name": name,
                    "configured": vc is not None,
                    "quota": lim.shown() if lim else "none (the VC was removed)",
                    "borrow": lim.borrow if lim else False,
                    "users": vc.users if vc else ["*"],
                    "max_priority": vc.max_priority if vc else "high",
                    "used": r["used"].shown(),
                    "borrowed": r["borrowed"].shown(),
                    "running": r["running"],
                    "waiting": r["waiting"],
                }
            )
        return {"vcs": out}

    async def synced_nodes(self) -> None:
        try:
            both = asyncio.gather(self.nodes_synced.wait(), self.held_synced.wait())
            await asyncio.wait_for(both, SYNC_WAIT)
        except TimeoutError:
            raise Refused("the gateway is still reading the node and attempt records; ask again", 1) from None

    async def list_nodes(self, who: str, request: Question) -> dict[str, Any]:
        """A page of the cluster's nodes by name (cluster.py); the first with a summary and the
        GPU allocation over time. A device names its job only to the job's owner or an admin."""
        await self.listed()
        await self.synced_nodes()
        after = None
        if request.cursor is not None:
            after = request.cursor.split(".", 1)[1]
        limit = min(request.limit, NODES_PAGE_MAX) if "limit" in request.model_fields_set else NODES_PAGE
        return self.cluster.page(who, after, limit, self.budget, now())

    async def read(self, stream: str, subject: str, after: int, limit: int) -> tuple[list[Stored], int, bool]:
        """Up to `limit` messages on `subject` (a filter) after stream sequence `after`, and
        about `self.budget` bytes of them, by one batched direct get: the server sends the batch
        and an end-of-batch mark saying how many remain, so nothing beyond the page ever reaches
        the gateway (no consumer, nothing pushed ahead). Returns the messages, the last
        sequence read and whether more remain."""
        budget = self.budget
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(
            inbox, pending_msgs_limit=limit + 16, pending_bytes_limit=budget + 4 * self.nc.max_payload
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DIRECT_WAIT
        out: list[Stored] = []
        last = after
        try:
            request = {"seq": after + 1, "next_by_subj": subject, "batch": limit, "max_bytes": budget}
            await self.nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(), reply=inbox)
            while True:
                m = await sub.next_msg(timeout=max(0.01, deadline - loop.time()))
                headers = m.headers or {}
                status = headers.get("Status")
                if status == "404":  # nothing after `after`
                    return out, last, False
                if status == "204":  # the end of the batch
                    return out, last, int(headers.get("Nats-Num-Pending") or 0) > 0
                if status:
                    raise RuntimeError(f"{stream}: {status} {headers.get('Description', '')}".strip())
                last = int(headers.get("Nats-Sequence") or last)
                out.append((headers.get("Nats-Subject", ""), last, m.data or b""))
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def resolve(self, who: str, ref: Any) -> JobRecord:
        """A job the asker may see, by id or else by name; anything else is "no such job".
        Records are read with `confirm` (a replica that lags must not say "no such job" of the
        id `muster submit` has just printed; Store.get)."""
        if not isinstance(ref, str) or not KEY_RE.match(ref):
            raise Refused(f"no job {str(ref)[:64]!r}")
        record = await self.jobs.get(ref, confirm=True)
        if record is not None and (who == subjects.ALL or record.user == who):
            return record
        if who != subjects.ALL:
            with contextlib.suppress(Exception):
                entry = await confirmed(self.names, subjects.name_key(who, ref))
                if entry is not None:
                    record = await self.jobs.get((entry.value or b"").decode(errors="replace"), confirm=True)
                    if record is not None and record.user == who:
                        return record
        else:
            named = [x for x in (await self.listed()).values() if x.job_name == ref]
            if named:
                latest = max(named, key=lambda x: (x.submitted, x.job_id)).job_id
                record = await self.jobs.get(latest, confirm=True)
                if record is not None:
                    return record
        raise Refused(f"no job with id or name {ref!r}")

    VERBS: ClassVar[dict[str, Any]] = {
        "ping": ping,
        "jobs": list_jobs,
        "job": job,
        "verdict": verdict,
        "logs": logs,
        "metrics": metrics,
        "events": events,
        "vcs": virtual_clusters,
        "nodes": list_nodes,
    }
