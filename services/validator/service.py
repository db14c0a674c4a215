"""The validator: turns submissions into accepted jobs (state WAITING) or rejections.

It pulls from the MUSTER_SUBMISSIONS work queue through one durable consumer shared by every
replica, so a submission published while no validator runs waits for one, and each is handled
by exactly one replica at a time. Handling is idempotent: the job id is derived from the
submission id, the name claim and the job record are created only if absent, and every publish
carries a message id, so a redelivery after a crash converges on the same result.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from datetime import datetime

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Histogram

from shared import bus, subjects
from shared.jobconfig import FieldError, check_job
from shared.loader import MAX_CONFIG_BYTES, ConfigSyntaxError, loads
from shared.messages import JobEvent, JobEventKind, JobRecord, JobState, Verdict, job_id_for, now
from shared.subjects import Headers

VERDICTS = Counter("muster_validator_verdicts_total", "Submissions judged", ["verdict"])
LATENCY = Histogram("muster_validator_seconds", "Time to judge one submission")

# After this many deliveries that crashed the handler, the submission is rejected rather than
# retried forever (a poison message must not block the queue).
MAX_DELIVERIES = 5
USER_RE = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")

log = structlog.get_logger(service="validator")


class Validator:
    def __init__(self, nc: NATS, js: JetStreamContext, buckets: dict[str, KeyValue], batch: int = 32):
        self.nc, self.js, self.batch = nc, js, batch
        self.jobs = buckets[subjects.JOBS_BUCKET]
        self.names = buckets[subjects.JOB_NAMES_BUCKET]

    @classmethod
    async def build(cls, nc: NATS) -> Validator:
        js, buckets = await bus.ensure_jetstream(nc)
        return cls(nc, js, buckets)

    async def run(self, stop: asyncio.Event) -> None:
        sub = await bus.durable(
            self.js,
            subjects.SUBMIT,
            subjects.VALIDATOR_CONSUMER,
            subjects.SUBMISSIONS_STREAM,
            max_ack_pending=1000,
        )
        await bus.consume(sub, self.handle, stop, log, self.batch)

    async def handle(self, msg: Msg) -> None:
        meta = msg.metadata
        sid = bus.header(msg, Headers.SUBMISSION_ID) or ""
        if not re.match(subjects.SUBMISSION_ID_RE, sid):
            sid = f"s{meta.sequence.stream}"
        user = bus.header(msg, Headers.USER) or "anonymous"
        if not USER_RE.match(user):
            user = "anonymous"
        try:
            with LATENCY.time():
                verdict = await self.judge(sid, user, msg.data, meta.timestamp or now())
        except Exception as exc:
            if meta.num_delivered < MAX_DELIVERIES:
                log.warning("validator.retry", submission=sid, error=str(exc) or type(exc).__name__)
                await msg.nak(delay=1)
                return
            log.error("validator.gave_up", submission=sid, exc_info=True)
            verdict = Verdict(
                submission_id=sid,
                accepted=False,
                errors=[FieldError(path="", reason="internal error while validating; see validator logs")],
            )
            await self.publish_verdict(verdict)
        VERDICTS.labels("accepted" if verdict.accepted else "rejected").inc()
        log.info(
            "validator.verdict",
            submission=sid,
            accepted=verdict.accepted,
            job_id=verdict.job_id,
            errors=len(verdict.errors),
        )
        await msg.ack_sync()

    async def judge(self, sid: str, user: str, data: bytes, received: datetime) -> Verdict:
        if len(data) > MAX_CONFIG_BYTES:
            return await self.reject(
                sid, None, [FieldError(path="", reason=f"payload is {len(data)} bytes; the limit is 1 MiB")]
            )
        try:
            raw = loads(data)
        except ConfigSyntaxError as exc:
            return await self.reject(sid, None, [FieldError(path="", reason=str(exc))])
        config, errors = check_job(raw)
        if config is None:
            name = raw.get("jobName") if isinstance(raw, dict) else None
            return await self.reject(sid, name if isinstance(name, str) else None, errors)

        job_id = job_id_for(sid)
        holder = await self.claim_name(config.jobName, job_id)
        if holder is not None:
            return await self.reject(
                sid,
                config.jobName,
                [
                    FieldError(
                        path="jobName",
                        reason=f"a job named {config.jobName!r} is not finished yet ({holder})",
                    )
                ],
            )
        record = JobRecord(
            job_id=job_id,
            job_name=config.jobName,
            submission_id=sid,
            user=user,
            config=config,
            submitted_at=received,
        )
        with contextlib.suppress(KeyWrongLastSequenceError):  # a redelivery: written before the crash
            await self.jobs.create(job_id, record.to_bytes())
        for kind in (JobEventKind.SUBMITTED, JobEventKind.ACCEPTED):
            event = JobEvent(
                job_id=job_id,
                job_name=config.jobName,
                kind=kind,
                state=JobState.WAITING,
                submission_id=sid,
                user=user,
            )
            await self.js.publish(
                subjects.job_event(job_id, kind),
                event.to_bytes(),
                headers={Headers.MSG_ID: f"{job_id}:{kind}"},
            )
        verdict = Verdict(submission_id=sid, accepted=True, job_id=job_id, job_name=config.jobName)
        await self.publish_verdict(verdict)
        return verdict

    async def claim_name(self, name: str, job_id: str) -> str | None:
        """Claim `name` for `job_id`. Returns None on success, else a description of the holder."""
        while True:
            try:
                await self.names.create(name, job_id.encode())
                return None
            except KeyWrongLastSequenceError:
                pass
            try:
                entry = await self.names.get(name)
            except KeyNotFoundError:
                continue  # released in between: try again
            holder = (entry.value or b"").decode()
            if holder == job_id:
                return None  # our own claim, from an earlier delivery
            state = await self.job_state(holder)
            if state is not None and not state.final:
                return f"job {holder} is {state}"
            if state is None:
                # Claimed by a submission being handled right now (or redelivered soon).
                return f"job {holder} is being accepted"
            try:
                await self.names.update(name, job_id.encode(), last=entry.revision)
                return None
            except KeyWrongLastSequenceError:
                continue  # someone else moved it: look again

    async def job_state(self, job_id: str) -> JobState | None:
        try:
            entry = await self.jobs.get(job_id)
        except KeyNotFoundError:
            return None
        return JobRecord.from_bytes(entry.value).state

    async def reject(self, sid: str, name: str | None, errors: list[FieldError]) -> Verdict:
        verdict = Verdict(submission_id=sid, accepted=False, job_name=name, errors=errors)
        await self.publish_verdict(verdict)
        return verdict

    async def publish_verdict(self, verdict: Verdict) -> None:
        await self.js.publish(
            subjects.verdict(verdict.submission_id),
            verdict.to_bytes(),
            headers={Headers.MSG_ID: f"verdict:{verdict.submission_id}"},
        )
