"""The gateway: how users read what Muster knows of their jobs, and nothing else.

Users hold no JetStream rights. They ask the gateway by NATS request/reply on
`muster.api.<name>.<verb>`, a subject the server lets only identity `<name>` publish, so the
gateway knows who asks without trusting anything the request says; admins ask as
`muster.api._all.<verb>` and see every job. A job that is not the asker's is answered exactly as
a job that does not exist. Records are stored with secret jobEnvs values already redacted.

Verbs (JSON in, JSON out; every answer is `{"error": ..., "code": ...}` or the result):
- `ping`: who the gateway takes the asker to be.
- `jobs`: the asker's jobs (every job for an admin).
- `job` `{"ref"}`: one job by id or name, with every attempt.
- `verdict` `{"sid"}`: the stored verdict on one of the asker's submissions.
- `logs` `{"job_id", "attempt", "task", "after", "limit"}`: output lines after stream sequence
  `after`, at most `limit` (and 512 KiB) per answer, with `more` when there are others.
- `metrics` `{"job_id", "attempt", "task", "after", "limit"}`: the training metric batches its
  tasks published (MUSTER_METRICS), paged the same way; only batches from the node each task ran
  on count. `job` also answers each task's latest values of its current attempt.
- `events` `{"job_id", "after", "limit"}`: the job's history, paged the same way.
- `vcs`: every virtual cluster: its quota, what it holds (and of that, borrowed beyond the quota),
  its jobs running and waiting. Totals only: anyone may ask.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter
from pydantic import ValidationError

from services.scheduler import placement, quota
from shared import bus, subjects
from shared.auth import NAME_RE
from shared.messages import (
    AttemptRecord,
    JobRecord,
    JobState,
    MetricBatch,
    NodeInfo,
    Question,
    Verdict,
    VirtualCluster,
    attempt_key,
    node_refusal,
    vc_refusal,
)
from shared.store import Store

log = structlog.get_logger(service="gateway")
REQUESTS = Counter("muster_gateway_requests_total", "Questions answered by the gateway", ["verb", "outcome"])
BAD_BATCHES = Counter(
    "muster_gateway_bad_metric_batches_total", "Metric batches skipped: not decoded or not believed"
)
MAX_REPLY = 512 * 1024
LATEST_TASKS = 64  # `job` answers the latest metrics of at most this many tasks
KEY_RE = re.compile(r"^[-/_=.a-zA-Z0-9]{1,128}$")
TASK_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.\d+)?$")


class Refused(Exception):
    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Listed:
    """What the gateway keeps of each job for listing and finding by name: the record as its JSON
    (about a quarter of the decoded record's size, kept for every job of the retention period) and the
    fields it filters and sorts on."""

    job_id: str
    user: str
    job_name: str
    submitted_at: datetime
    data: bytes

    @classmethod
    def of(cls, record: JobRecord) -> Listed:
        return cls(record.job_id, record.user, record.job_name, record.submitted_at, record.to_bytes())


class Gateway:
    def __init__(self, nc: NATS, js: JetStreamContext, buckets: dict[str, KeyValue]):
        self.nc, self.js = nc, js
        self.jobs = Store(buckets[subjects.JOBS_BUCKET], JobRecord)
        self.names = buckets[subjects.JOB_NAMES_BUCKET]
        self.attempts = Store(buckets[subjects.ATTEMPTS_BUCKET], AttemptRecord)
        self.view: dict[str, Listed] = {}
        self.synced = asyncio.Event()
        self.kv_vcs = Store(buckets[subjects.VCS_BUCKET], VirtualCluster, check=vc_refusal)
        self.kv_nodes = Store(buckets[subjects.NODES_BUCKET], NodeInfo, check=node_refusal)
        self.vcs: dict[str, VirtualCluster] = {}
        self.vcs_synced = asyncio.Event()
        self.running: set[asyncio.Task[None]] = set()

    @classmethod
    async def build(cls, nc: NATS) -> Gateway:
        js, buckets = await bus.setup(nc)
        return cls(nc, js, buckets)

    async def run(self, stop: asyncio.Event) -> None:
        mirror = asyncio.create_task(self.jobs.mirror(self.view, self.synced, keep=Listed.of))
        vcs = asyncio.create_task(self.kv_vcs.mirror(self.vcs, self.vcs_synced))
        # A queue group: replicas share the questions.
        sub = await self.nc.subscribe(subjects.api("*", "*"), queue="gateway", cb=self._take)
        try:
            await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            mirror.cancel()
            vcs.cancel()
            if self.running:
                await asyncio.wait(list(self.running), timeout=5)

    async def _take(self, msg: Msg) -> None:
        task = asyncio.create_task(self._answer(msg))
        self.running.add(task)
        task.add_done_callback(self.running.discard)

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
        with contextlib.suppress(Exception):
            await msg.respond(json.dumps(answer, default=str).encode())

    # ------------------------------------------------------------ questions

    async def ping(self, who: str, request: Question) -> dict[str, Any]:
        return {"user": who, "admin": who == subjects.ALL}

    async def list_jobs(self, who: str, request: Question) -> dict[str, Any]:
        await asyncio.wait_for(self.synced.wait(), 10)
        listed = [x for x in self.view.values() if who == subjects.ALL or x.user == who]
        listed.sort(key=lambda x: x.submitted_at)
        return {"jobs": [json.loads(x.data) for x in listed]}

    async def job(self, who: str, request: Question) -> dict[str, Any]:
        record = await self.resolve(who, request.ref)
        history = []
        for n in range(1, record.attempt + 1):
            attempt = await self.attempts.get(attempt_key(record.job_id, n))
            if attempt is not None:
                history.append(attempt.model_dump(mode="json"))
        answer: dict[str, Any] = {"job": record.model_dump(mode="json"), "attempts": history}
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
            batch = self.believed(stored.subject, stored.data, {f"{role}.{index}": node})
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
        record, attempt, role, index = await self.tasks_asked(who, request)
        subject = subjects.task_logs(record.job_id, attempt, role, index)
        after, limit = request.after, request.limit

        def line(m: Msg) -> list[Any]:
            token = m.subject.split(".")
            return [f"{token[-3]}.{token[-2]}", m.data.decode("utf-8", "replace")]

        lines, last, more = await self.page(subjects.LOGS_STREAM, subject, after, limit, line)
        return {"lines": lines, "last": last, "more": more, "final": record.state.final}

    async def metrics(self, who: str, request: Question) -> dict[str, Any]:
        """A page of the training metric batches of one attempt's tasks (or one task's): each
        `{"task", "points": [{"t", "step", "name", "value"}], "dropped"}`."""
        record, attempt, role, index = await self.tasks_asked(who, request)
        subject = subjects.task_metrics(record.job_id, attempt, role, index)
        after, limit = request.after, request.limit
        placed = await self.attempts.get(attempt_key(record.job_id, attempt))
        nodes = {t.key: t.node for t in placed.tasks} if placed is not None else {}

        def render(m: Msg) -> dict[str, Any] | None:
            batch = self.believed(m.subject, m.data, nodes)
            if batch is None:
                return None
            return {
                "task": f"{batch.role}.{batch.index}",
                "points": [p.model_dump(mode="json") for p in batch.points],
                "dropped": batch.dropped,
            }

        batches, last, more = await self.page(subjects.METRICS_STREAM, subject, after, limit, render)
        metrics = [b for b in batches if b is not None and (b["points"] or b["dropped"])]
        return {"batches": metrics, "last": last, "more": more, "final": record.state.final}

    async def events(self, who: str, request: Question) -> dict[str, Any]:
        """The job's history (submitted, accepted, placed, running, retrying, ended...)."""
        record = await self.resolve(who, request.job_id or request.ref)
        subject = subjects.job_events(record.job_id)
        events, last, more = await self.page(
            subjects.EVENTS_STREAM, subject, request.after, request.limit, lambda m: json.loads(m.data)
        )
        return {"events": events, "last": last, "more": more, "final": record.state.final}

    async def virtual_clusters(self, who: str, request: Question) -> dict[str, Any]:
        """Per VC: quota (`default`'s is what the others leave of the registered nodes), used
        and borrowed (by live tasks' GPU models), jobs running and waiting."""
        await asyncio.wait_for(asyncio.gather(self.synced.wait(), self.vcs_synced.wait()), 10)
        nodes = {name: info async for name, info in self.kv_nodes.items()}
        capacity = quota.capacity_of(placement.NodeState.from_info(n) for n in nodes.values())
        limits = quota.limits(self.vcs, capacity)

        def model_of(node: str, index: int) -> str | None:
            info = nodes.get(node)
            return next((d.model for d in info.gpus if d.index == index), None) if info else None

        rows: dict[str, dict[str, Any]] = {}

        def row(name: str) -> dict[str, Any]:
            if name not in rows:
                rows[name] = {"used": quota.Amount(), "borrowed": quota.Amount(), "running": 0, "waiting": 0}
            return rows[name]

        for name in limits:
            row(name)
        for listed in list(self.view.values()):
            record = self.jobs.decode(listed.job_id, listed.data)
            if record is None or record.state.final:
                continue
            r = row(record.config.virtualCluster)
            r["waiting" if record.state == JobState.WAITING else "running"] += 1
            attempt = (
                await self.attempts.get(attempt_key(record.job_id, record.attempt))
                if record.attempt
                else None
            )
            if attempt is None:
                continue
            live = [t.spec() for t in attempt.tasks if not t.state.ended]
            use = quota.held(record.config, live, model_of)
            r["used"].add(use)
            if attempt.borrowed:
                r["borrowed"].add(use)
        out = []
        for name in sorted(rows, key=lambda n: (n != quota.DEFAULT_VC, n)):
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

    async def page(
        self, stream: str, subject: str, after: int, limit: int, render: Callable[[Msg], Any]
    ) -> tuple[list[Any], int, bool]:
        """Up to `limit` (and MAX_REPLY bytes) messages on `subject` after stream sequence
        `after`, rendered; the last sequence read; whether there are more."""
        out: list[Any] = []
        last, size = after, 0
        start = (
            ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after + 1)
            if after
            else ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        )
        sub = await self.js.subscribe(subject, stream=stream, ordered_consumer=True, config=start)
        try:
            # Each message says how many remain after it; the consumer's info, whether there
            # are any at all (what the server has already pushed counts as delivered).
            info = await sub.consumer_info()
            more = info.num_pending > 0 or (info.delivered.consumer_seq or 0) > 0
            while more and len(out) < limit and size < MAX_REPLY:
                try:
                    m = await sub.next_msg(timeout=5)
                except NatsTimeout:
                    break
                out.append(render(m))
                size += len(m.data) + 64
                last = m.metadata.sequence.stream
                more = m.metadata.num_pending > 0
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return out, last, more

    async def resolve(self, who: str, ref: Any) -> JobRecord:
        """A job the asker may see, by id or else by name; anything else is "no such job"."""
        if not isinstance(ref, str) or not KEY_RE.match(ref):
            raise Refused(f"no job {str(ref)[:64]!r}")
        record = await self.jobs.get(ref)
        if record is not None and (who == subjects.ALL or record.user == who):
            return record
        if who != subjects.ALL:
            with contextlib.suppress(Exception):
                entry = await self.names.get(subjects.name_key(who, ref))
                record = await self.jobs.get((entry.value or b"").decode(errors="replace"))
                if record is not None and record.user == who:
                    return record
        else:
            await asyncio.wait_for(self.synced.wait(), 10)
            named = [x for x in self.view.values() if x.job_name == ref]
            if named:
                record = await self.jobs.get(max(named, key=lambda x: x.submitted_at).job_id)
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
    }
