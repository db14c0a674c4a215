"""The validator: turns submissions into accepted jobs (state WAITING) or rejections.

It pulls from the MUSTER_SUBMISSIONS work queue through one durable consumer shared by every
replica, so a submission published while no validator runs waits for one, and each is handled
by exactly one replica at a time. Handling is idempotent: the job id is derived from the
submission id, the name claim and the job record are created only if absent, and every publish
carries a message id, so a redelivery after a crash converges on the same result.

A submission id names one config: the job record keeps the sha256 of the accepted config's
canonical JSON (`digest`), so the same id with the same config (a redelivery, a client sending
again, the same file reformatted) gets the same job, and with another config a rejection that
names the `Muster-Submission-Id` header.

Job names are unique among unfinished jobs through claims in bucket `muster_job_names` (name ->
job id), made before the job record is written. A claim never outlives a submission that was not
accepted: it is released (only while it still points at that job, checked by revision) when a
submission is given up on after MAX_DELIVERIES crashed deliveries, and a claim whose job has no
record is taken over once it is MUSTER_NAME_CLAIM_TIMEOUT seconds old (default 300: far longer
than judging plus every redelivery takes), should a release ever be missed.

Limits on tasks per job and live tasks per user are in `limits.py`; each user's live tasks are
counted from a view of the jobs bucket kept by a KV watcher (records that do not decode are
skipped), so judging a submission scans nothing. Replicas each keep their own view, so
submissions judged at the same moment by two replicas may pass the per-user limit by one job.

Virtual clusters are the operator's (`muster admin vc set`, bucket `muster_vcs`), watched the
same way and changeable at run time: a job naming a VC that has no record (other than `default`,
which every user may use at any priority unless a record of that name says otherwise), or one
that does not admit its submitter, is refused on `virtualCluster`; a priority above the VC's
`max_priority` is refused on `priority`. A redelivered submission keeps the verdict its job got.

Datasets are the operator's too (`muster admin dataset set`, bucket `muster_datasets`), watched
alike: a `data` entry naming a dataset that has no record, one that does not admit the submitter,
or asking `:rw` of a read-only one is refused on `data[i]` (docs/data.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import re
from collections.abc import Awaitable
from datetime import datetime
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import InvalidKeyError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge, Histogram

from muster.services.validator import limits
from muster.shared import auth, bus, consume, hostpaths, settings, subjects
from muster.shared.jobconfig import (
    NAME_RE,
    FieldError,
    JobConfig,
    check_job,
    job_warnings,
    rank,
    split_secrets,
)
from muster.shared.loader import MAX_CONFIG_BYTES, ConfigSyntaxError, loads
from muster.shared.messages import (
    Dataset,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    Verdict,
    VirtualCluster,
    dataset_refusal,
    job_id_for,
    now,
    vc_refusal,
)
from muster.shared.store import Store, confirmed
from muster.shared.subjects import Headers

VERDICTS = Counter("muster_validator_verdicts_total", "Submissions judged", ["verdict"])
UNSEEN = Gauge("muster_validator_unseen_jobs", "Accepted jobs no scheduler has looked at yet")
HELD = Counter(
    "muster_validator_held_total",
    "Submissions held back before judging: more accepted jobs than MUSTER_ADMISSION_BACKLOG "
    "were waiting for a scheduler's first look",
)
LATENCY = Histogram("muster_validator_seconds", "Time to judge one submission")

# After this many deliveries that crashed the handler, the submission is rejected rather than
# retried forever (a poison message must not block the queue).
MAX_DELIVERIES = 5
PARALLEL = settings.number("MUSTER_VALIDATOR_PARALLEL", 64, int, low=1)  # submissions judged at once
DEFAULT_VC = "default"  # exists without a record: every user, any priority
IMPLICIT_DEFAULT = VirtualCluster(name=DEFAULT_VC)

log = structlog.get_logger(service="validator")


class Validator:
    def __init__(self, nc: NATS, js: JetStreamContext, buckets: dict[str, KeyValue], batch: int = 32):
        self.nc, self.js, self.batch = nc, js, batch
        self.yaml_parsing = asyncio.Semaphore(1)  # see `parse`
        self.jobs = Store(buckets[subjects.JOBS_BUCKET], JobRecord)
        self.names = buckets[subjects.JOB_NAMES_BUCKET]
        self.secrets = buckets[subjects.SECRETS_BUCKET]
        self.vc_store = Store(buckets[subjects.VCS_BUCKET], VirtualCluster, check=vc_refusal)
        self.vcs: dict[str, VirtualCluster] = {}  # the VCs bucket as a watcher keeps it
        self.vcs_synced = asyncio.Event()
        self.ds_store = Store(buckets[subjects.DATASETS_BUCKET], Dataset, check=dataset_refusal)
        self.datasets: dict[str, Dataset] = {}  # the datasets bucket as a watcher keeps it
        self.datasets_synced = asyncio.Event()
        self.claim_timeout = claim_timeout()
        self.limits = limits.Limits.from_env()
        # Where dir fields may point, when known here (else the agents judge at launch).
        self.roots = hostpaths.parse_roots(os.environ.get("MUSTER_DATA_ROOTS", ""))
        self.view: dict[str, limits.Live] = {}  # the jobs bucket as a watcher keeps it (slim)
        self.live = limits.LiveTasks()
        self._admitted: dict[str, limits.Live] = {}  # created here, not yet seen by the watcher
        self.synced = asyncio.Event()
        # Admission control: accepted jobs no scheduler has looked at yet, and room for more.
        self.backlog, self.admission_wait = admission_settings()
        self.unseen: set[str] = set()
        self.room = asyncio.Event()
        self.room.set()
        self._holding = False  # logged once per spell of holding back

    @classmethod
    async def build(cls, nc: NATS) -> Validator:
        js, buckets = await bus.setup(nc)
        return cls(nc, js, buckets)

    async def run(self, stop: asyncio.Event) -> None:
        watching = [
            asyncio.create_task(self.jobs.mirror(self.view, self.synced, self.job_changed, limits.Live.of)),
            asyncio.create_task(self.vc_store.mirror(self.vcs, self.vcs_synced)),
            asyncio.create_task(self.ds_store.mirror(self.datasets, self.datasets_synced)),
        ]
        try:
            # Judge nothing before every user's live tasks and every virtual cluster are known.
            ready = asyncio.ensure_future(
                asyncio.gather(self.synced.wait(), self.vcs_synced.wait(), self.datasets_synced.wait())
            )
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait((ready, stopped), return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            stopped.cancel()
            submissions = functools.partial(
                bus.durable,
                self.js,
                subjects.SUBMIT,
                subjects.VALIDATOR_CONSUMER,
                subjects.SUBMISSIONS_STREAM,
                max_ack_pending=1000,
            )
            sub = await bus.patiently(submissions)
            # Submissions are judged concurrently: their KV writes and publishes overlap. A
            # user's limits stay exact (each acceptance is counted before its first await) and
            # a job name is claimed atomically, so order between them does not matter.
            lag = asyncio.create_task(consume.watch_lag(sub, subjects.VALIDATOR_CONSUMER, stop))
            try:
                renew = bus.renewing(self.nc, submissions)
                await bus.consume(sub, self.handle, stop, log, self.batch, parallel=PARALLEL, renew=renew)
            finally:
                lag.cancel()
        finally:
            for watcher in watching:
                watcher.cancel()

    def job_changed(self, job_id: str) -> None:
        live = self.view.get(job_id)
        self.live.update(job_id, live)
        self._seen(job_id, live is not None and live.unseen)

    def _seen(self, job_id: str, unseen: bool) -> None:
        if unseen:
            self.unseen.add(job_id)
        else:
            self.unseen.discard(job_id)
        UNSEEN.set(len(self.unseen))
        if len(self.unseen) < self.backlog:
            self.room.set()

    async def admission(self) -> None:
        """Admission control. Past its capacity the platform must not spend the CPU it needs to
        place and start the jobs it has on accepting more: while more than `backlog` accepted
        jobs wait for a scheduler's first look (placed, or told why not), each submission waits
        up to `admission_wait` seconds for room before it is judged. Held submissions stay in
        their stream, acknowledged to their senders; nothing is lost, verdicts come later. With
        no scheduler at all, submissions are still judged, each after the wait."""
        if len(self.unseen) < self.backlog:
            if self._holding:
                self._holding = False
                log.info("validator.admission_resumed", unseen=len(self.unseen))
            return
        HELD.inc()
        if not self._holding:
            self._holding = True
            log.warning("validator.admission_holding", unseen=len(self.unseen), backlog=self.backlog)
        self.room.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.room.wait(), self.admission_wait)

    async def handle(self, msg: Msg) -> None:
        meta = msg.metadata
        sid = bus.header(msg, Headers.SUBMISSION_ID) or ""
        if not re.fullmatch(subjects.SUBMISSION_ID_RE, sid):
            sid = f"s{meta.sequence.stream}"
        # The owner is who published it: the subject's last token, which an authenticated
        # identity can only set to its own name (never a header or the spec).
        user = subjects.requester(msg.subject)
        if not auth.NAME_RE.fullmatch(user):
            consume.REJECTED.labels(subjects.VALIDATOR_CONSUMER, "bad_submitter").inc()
            log.warning("validator.bad_submitter", subject=msg.subject[:200])
            await msg.term()
            return
        await self.admission()
        try:
            with LATENCY.time():
                verdict = await self.judge(sid, user, msg.data, meta.timestamp or now())
        except Exception as exc:
            if meta.num_delivered < MAX_DELIVERIES:
                log.warning("validator.retry", submission=sid, error=str(exc) or type(exc).__name__)
                await msg.nak(delay=1)
                return
            log.error("validator.gave_up", submission=sid, exc_info=True)
            try:
                verdict = await self.give_up(sid, user, msg.data)
            except Exception as exc:  # the bus is away: the next delivery gives up again
                log.warning("validator.give_up_failed", submission=sid, error=str(exc) or type(exc).__name__)
                await msg.nak(delay=1)
                return
        VERDICTS.labels("accepted" if verdict.accepted else "rejected").inc()
        log.info(
            "validator.verdict",
            submission=sid,
            accepted=verdict.accepted,
            job_id=verdict.job_id,
            errors=len(verdict.errors),
        )
        await msg.ack()  # lost: redelivered, and judged again to the same verdict

    async def give_up(self, sid: str, user: str, data: bytes) -> Verdict:
        """Reject a submission whose judging kept crashing, first releasing the name it may have
        claimed, unless its job record was written (then the claim is that job's)."""
        name = job_name_in(data)
        job_id = job_id_for(user, sid)
        if name is not None and await self.jobs.get(job_id, confirm=True) is None:
            await self.release_name(subjects.name_key(user, name), job_id)
        reason = "internal error while validating; see validator logs"
        return await self.reject(sid, user, name, [FieldError(path="", reason=reason)], data)

    async def parse(self, data: bytes) -> Any:
        """`loads`, off the event loop where the payload may be YAML: PyYAML's bounded loader
        reads ~50 KB a second, so one user's 1 MiB YAML held every submission for ~20 s (and
        again at each redelivery). JSON (the CLI's and the portal's) is read in place: a
        megabyte in ms. One YAML at a time: a thread holds the interpreter as it parses."""
        if data.lstrip()[:1] in (b"{", b"["):
            return loads(data)
        async with self.yaml_parsing:
            return await asyncio.to_thread(loads, data)

    async def judge(self, sid: str, user: str, data: bytes, received: datetime) -> Verdict:
        if len(data) > MAX_CONFIG_BYTES:
            return await self.reject(
                sid,
                user,
                None,
                [FieldError(path="", reason=f"payload is {len(data)} bytes; the limit is 1 MiB")],
                data,
            )
        try:
            raw = await self.parse(data)
        except ConfigSyntaxError as exc:
            return await self.reject(sid, user, None, [FieldError(path="", reason=str(exc))], data)
        config, errors = check_job(raw)
        if config is None:
            return await self.reject(sid, user, _job_name(raw), errors, data)
        canonical = canonical_json(config)
        if len(canonical) > MAX_CONFIG_BYTES:
            reason = f"config is {len(canonical)} bytes once decoded; the limit is 1 MiB"
            return await self.reject(sid, user, config.jobName, [FieldError(path="", reason=reason)], data)
        digest = hashlib.sha256(canonical).hexdigest()

        job_id = job_id_for(user, sid)
        # A redelivery, or the submission id used again: its record is in the mirror (synced
        # before anything is judged) or was written here (and counted live), and only then is it
        # read (a round trip per submission saved). One the mirror has not shown yet loses its
        # `create` below.
        known = job_id in self.view or job_id in self._admitted or job_id in self.live.jobs
        existing = await self.jobs.get(job_id, confirm=True) if known else None
        if existing is not None:
            if record_digest(existing) != digest:
                return await self.reject(sid, user, config.jobName, [reused(job_id)], data)
            return await self.accept(existing, data, job_warnings(raw))
        errors = check_vc(config, user, self.vcs)
        errors += check_data(config, user, self.datasets)
        errors += limits.check(config.most_tasks, user, self.live.of(user), self.limits)
        errors += hostpaths.check_dirs(config, user, self.roots) if self.roots else []
        if errors:
            return await self.reject(sid, user, config.jobName, errors, data)
        # Secret-looking jobEnvs values live apart, where only the scheduler reads them; the
        # record (and every view of it) shows REDACTED.
        shown, hidden = split_secrets(config)
        record = JobRecord(
            job_id=job_id,
            job_name=config.jobName,
            submission_id=sid,
            user=user,
            config=shown,
            digest=digest,
            submitted_at=received,
        )
        # Counted now, before any await: a submission judged meanwhile sees these tasks.
        self.live.update(job_id, limits.Live.of(record))
        try:
            return await self._admit(record, hidden, data, job_warnings(raw))
        finally:
            admitted = self._admitted.pop(job_id, None)  # popped whatever the view holds
            self.live.update(job_id, self.view.get(job_id) or admitted)

    async def _admit(
        self, record: JobRecord, hidden: dict[str, Any], data: bytes, warnings: list[FieldError]
    ) -> Verdict:
        """Claim the job's name, store its secrets and record: the accepted job, or a rejection."""
        sid, user, config, job_id = record.submission_id, record.user, record.config, record.job_id
        digest = record.digest
        holder = await self.claim_name(subjects.name_key(user, config.jobName), job_id)
        if holder is not None:
            return await self.reject(
                sid,
                user,
                config.jobName,
                [
                    FieldError(
                        path="jobName",
                        reason=f"a job named {config.jobName!r} is not finished yet ({holder})",
                    )
                ],
                data,
            )
        if hidden:  # stored first: a record never lacks them
            await self.secrets.put(job_id, json.dumps(hidden).encode())
        if await self.jobs.create(job_id, record):
            if job_id not in self.view:  # counted until the watcher has it
                self._admitted[job_id] = limits.Live.of(record)
                self._seen(job_id, True)
        else:
            # Another replica got there first with this submission id (ack wait passed, or the
            # same id published twice at once): the same config is the same job.
            winner = await self.jobs.get(job_id, confirm=True)
            if winner is None:
                raise RuntimeError(f"job record {job_id} exists but does not decode")
            if record_digest(winner) != digest:
                if winner.job_name != config.jobName:
                    await self.release_name(subjects.name_key(user, config.jobName), job_id)
                return await self.reject(sid, user, config.jobName, [reused(job_id)], data)
            record = winner
        return await self.accept(record, data, warnings)

    async def accept(
        self, record: JobRecord, data: bytes, warnings: list[FieldError] | None = None
    ) -> Verdict:
        """Announce an accepted job (again, on a redelivery: every publish is deduplicated):
        its `accepted` event, which opens its history (the submission's time is the record's
        `submitted_at`: a `submitted` event said nothing more), and the verdict to its
        submitter. The two publishes leave in this order and their acks are awaited together."""
        kind = JobEventKind.ACCEPTED
        event = JobEvent(
            job_id=record.job_id,
            job_name=record.job_name,
            kind=kind,
            state=JobState.WAITING,
            submission_id=record.submission_id,
            user=record.user,
        )
        sends: list[Awaitable[object]] = [
            bus.publish_once(
                self.js, subjects.job_event(record.job_id, kind), event.to_bytes(), f"{record.job_id}:{kind}"
            )
        ]
        verdict = Verdict(
            submission_id=record.submission_id,
            user=record.user,
            accepted=True,
            job_id=record.job_id,
            job_name=record.job_name,
            warnings=warnings or [],
        )
        sends.append(self.publish_verdict(verdict, data))
        await asyncio.gather(*sends)
        return verdict

    async def claim_name(self, name: str, job_id: str) -> str | None:
        """Claim `name` for `job_id`. Returns None on success, else a description of the holder."""
        while True:
            try:
                await self.names.create(name, job_id.encode())
                return None
            except KeyWrongLastSequenceError:
                pass
            entry = await confirmed(self.names, name)
            if entry is None:
                continue  # released in between: try again
            holder = (entry.value or b"").decode(errors="replace")
            if holder == job_id:
                return None  # our own claim, from an earlier delivery
            state = await self.job_state(holder)
            if state is not None and not state.final:
                return f"job {holder} is {state}"
            if state is None:
                age = await self.claim_age(entry.revision)
                if age is None:
                    continue  # the claim moved on in between: look again
                if age < self.claim_timeout:
                    # Claimed by a submission being handled right now (or redelivered soon).
                    return f"job {holder} is being accepted"
                log.warning("validator.stale_claim_taken", name=name, holder=holder, age=round(age))
            try:
                await self.names.update(name, job_id.encode(), last=entry.revision)
                return None
            except KeyWrongLastSequenceError:
                continue  # someone else moved it: look again

    async def claim_age(self, revision: int | None) -> float | None:
        """Seconds since the claim at `revision` was written (the server's timestamp); None when
        that revision is gone (replaced since)."""
        try:
            stored = await self.js.get_msg(f"KV_{subjects.JOB_NAMES_BUCKET}", seq=revision)
        except NotFoundError:
            return None
        return (now() - stored.time).total_seconds() if stored.time else 0.0

    async def job_state(self, job_id: str) -> JobState | None:
        """The job's state; None when it has no record (or one that does not decode)."""
        try:
            record = await self.jobs.get(job_id, confirm=True)
        except InvalidKeyError:  # a claim holding garbage
            return None
        return record.state if record is not None else None

    async def release_name(self, name: str, job_id: str) -> None:
        """Drop the claim on `name` if it still points at `job_id` (checked by revision)."""
        try:
            entry = await self.names.get(name)
            if entry.value == job_id.encode():
                await self.names.delete(name, last=entry.revision)
        except (KeyNotFoundError, KeyWrongLastSequenceError):
            pass  # gone, or taken by someone else in between

    async def reject(
        self, sid: str, user: str, name: str | None, errors: list[FieldError], data: bytes
    ) -> Verdict:
        verdict = Verdict(submission_id=sid, user=user, accepted=False, job_name=name, errors=errors)
        await self.publish_verdict(verdict, data)
        return verdict

    async def publish_verdict(self, verdict: Verdict, data: bytes) -> None:
        # One verdict per submission id and payload: a redelivery is deduplicated, while another
        # payload under a used id gets its own (stored) verdict.
        payload_id = hashlib.sha256(data).hexdigest()[:16]
        await bus.publish_once(
            self.js,
            subjects.verdict(verdict.user, verdict.submission_id),
            verdict.to_bytes(),
            f"verdict:{verdict.submission_id}:{payload_id}",
        )


def check_vc(config: JobConfig, user: str, vcs: dict[str, VirtualCluster]) -> list[FieldError]:
    """The errors of `user` submitting `config` to its virtual cluster, given the configured VCs
    (`default` needs no record: everyone, up to high priority; a record named so overrides it)."""
    name = config.virtualCluster
    vc = vcs.get(name)
    if vc is None and name == DEFAULT_VC:
        vc = IMPLICIT_DEFAULT
    if vc is None:
        known = ", ".join([DEFAULT_VC, *sorted(n for n in vcs if n != DEFAULT_VC)])
        return [FieldError(path="virtualCluster", reason=f"no virtual cluster {name!r}; known: {known}")]
    errors = []
    if not vc.admits(user):
        reason = f"user {user!r} may not submit to virtual cluster {name!r}"
        errors.append(FieldError(path="virtualCluster", reason=reason))
    if rank(config.priority) > rank(vc.max_priority):
        reason = (
            f"{config.priority!r} is above virtual cluster {name!r}'s highest priority, {vc.max_priority!r}"
        )
        errors.append(FieldError(path="priority", reason=reason))
    return errors


def check_data(config: JobConfig, user: str, datasets: dict[str, Dataset]) -> list[FieldError]:
    """The errors of `user` mounting `config`'s `data` entries, given the configured datasets."""
    errors = []
    for i, mount in enumerate(config.mounts):
        ds = datasets.get(mount.name)
        if ds is None:
            known = ", ".join(sorted(n for n, d in datasets.items() if d.admits(user))) or "none"
            reason = (
                f"no dataset {mount.name!r}; yours to mount: {known}; an admin defines it with "
                f"`muster admin dataset set {mount.name} --source DIR` (docs/data.md)"
            )
        elif not ds.admits(user):
            reason = f"user {user!r} may not mount dataset {mount.name!r}"
        elif mount.rw and not ds.writable:
            reason = f"dataset {mount.name!r} is read-only: drop ':rw'"
        else:
            continue
        errors.append(FieldError(path=f"data[{i}]", reason=reason))
    return errors


def canonical_json(config: JobConfig) -> bytes:
    """The config as compact JSON with sorted keys: equal for equal configs, however written."""
    return json.dumps(
        config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode()


def record_digest(record: JobRecord) -> str:
    """A record's config digest (records written before `digest` existed have none stored)."""
    return record.digest or hashlib.sha256(canonical_json(record.config)).hexdigest()


def admission_settings() -> tuple[int, float]:
    """MUSTER_ADMISSION_BACKLOG (accepted jobs no scheduler has looked at, beyond which
    submissions are held back; default 2000, 0: never) and MUSTER_ADMISSION_WAIT (the longest a
    submission is held, seconds; default 5)."""
    text = os.environ.get("MUSTER_ADMISSION_BACKLOG", "").strip() or "2000"
    backlog = int(text) if re.fullmatch(r"\d+", text) else -1
    if backlog < 0:
        raise settings.SettingError(f"MUSTER_ADMISSION_BACKLOG must be a number of jobs ≥ 0, got {text!r}")
    return (backlog or 1 << 62), _seconds("MUSTER_ADMISSION_WAIT", "5")


def claim_timeout() -> float:
    """MUSTER_NAME_CLAIM_TIMEOUT: seconds after which a claim whose job has no record is stale."""
    return _seconds("MUSTER_NAME_CLAIM_TIMEOUT", "300")


def _seconds(name: str, default: str) -> float:
    """A setting of seconds ≥ 0 from the environment; ValueError naming it when it is not one."""
    text = os.environ.get(name, "").strip() or default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise settings.SettingError(f"{name} must be a number of seconds ≥ 0, got {text!r}")
    return value


def job_name_in(data: bytes) -> str | None:
    """The jobName a payload asks for, if it has a valid one; never raises."""
    try:
        raw = loads(data)
    except Exception:
        return None
    return _job_name(raw)


def _job_name(raw: Any) -> str | None:
    """The jobName of a decoded config if it is a valid name (a verdict names no other)."""
    name = raw.get("jobName") if isinstance(raw, dict) else None
    return name if isinstance(name, str) and re.fullmatch(NAME_RE, name) and len(name) <= 64 else None


def reused(job_id: str) -> FieldError:
    return FieldError(
        path=Headers.SUBMISSION_ID, reason=f"already used by job {job_id} with a different config"
    )
