"""The rendezvous registry: collects every task's endpoint for an attempt and, when all are in,
publishes the attempt's cluster spec exactly once (the barrier every task waits behind).

Endpoints arrive through one durable consumer shared by all replicas. What has been collected
lives in the KV bucket `muster_rendezvous`: each endpoint under its own key
(`<job>.<attempt>.<role>.<index>`, written before it counts), and the attempt's record (key
`<job>.<attempt>`) with a bit per task saying which are in, updated with the revision read, so
a replica killed at any point loses nothing and two replicas never lose an endpoint. A gang of
N costs N small writes and a record of N bits per batch, however its endpoints trickle in (a
record holding every endpoint, rewritten per batch, cost O(N) per batch: O(N²) for a gang
whose endpoints come a few at a time). The spec is built once, when the last bit is set, from
the endpoints this replica stored (those another replica stored are read back in one watch of
the attempt's keys). It is published with a message id, so publishing it again after a crash
is harmless.

An elastic attempt (`AttemptRecord.elastic`) has a spec per membership: whenever every member's
endpoint is in and the members differ from the last spec's, the next version is published (a
task joined: its endpoint completes the gang; a task was removed or ended: the scheduler or the
supervisor says so on `attempt_members`, consumed by a second durable consumer). Agents read the
last one; torchrun-style jobs rendezvous by themselves and only need the first member's address."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Histogram

from muster.shared import bus, consume, shapes, subjects
from muster.shared.messages import (
    AttemptRecord,
    ClusterSpec,
    Endpoint,
    EndpointReported,
    Rendezvous,
    TaskStatus,
    attempt_key,
    membership,
)
from muster.shared.store import BAD_RECORDS, GroupCommit, Store

log = structlog.get_logger(service="registry")
SPECS = Counter("muster_registry_specs_total", "Cluster specs published")
MEMBERS_CONSUMER = "registry-members"
RECENT = 4096  # rendezvous this replica wrote last, kept as (revision, bytes): writes start there
GANGS = 1024  # attempts this replica collects for, kept (see `Gang`), the newest
ATTEMPT_REUSE = 5.0  # seconds an attempt record read serves its next batches (placement is fixed)
READ_WAIT = 30.0  # seconds to read a gang's stored endpoints back
IN_FLIGHT = 2048  # endpoints handled at once: a gang this big is collected in one write
FETCH = 256  # endpoints asked of the server at once
BATCHED = Histogram(
    "muster_registry_batch_endpoints",
    "Endpoints of one attempt collected by one write of its rendezvous",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
)


@dataclass
class Gang:
    """What this replica holds of one attempt it collects for: the attempt record (read once
    for many batches: where each task was placed never changes) with each task's position in
    it, and the endpoints this replica stored (so the spec needs no read of them back)."""

    attempt: AttemptRecord
    read_at: float  # loop time of the read
    tasks: dict[str, TaskStatus]  # "<role>.<index>" -> the task
    positions: dict[str, int]  # "<role>.<index>" -> its bit in `Rendezvous.collected`
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    _members: tuple[list[str], int, str] | None = None

    @classmethod
    def of(cls, attempt: AttemptRecord, at: float, endpoints: dict[str, Endpoint] | None = None) -> Gang:
        positions = {t.key: i for i, t in enumerate(attempt.tasks)}
        tasks = {t.key: t for t in attempt.tasks}
        return cls(attempt, at, tasks, positions, endpoints if endpoints is not None else {})

    def members(self) -> tuple[list[str], int, str]:
        """The gang now: its tasks' keys (sorted), their bits and their digest, worked out once
        per read of the attempt (a fixed gang's are its tasks for good)."""
        if self._members is None:
            members = sorted(t.key for t in self.attempt.members())
            mask = 0
            for k in members:
                mask |= 1 << self.positions[k]
            self._members = (members, mask, membership(members))
        return self._members


class Registry:
    def __init__(self, nc: NATS, js: JetStreamContext, buckets: dict[str, KeyValue]):
        self.nc, self.js = nc, js
        self.kv = buckets[subjects.RENDEZVOUS_BUCKET]
        self.store = Store(self.kv, Rendezvous, cache=RECENT)
        self.attempts = Store(buckets[subjects.ATTEMPTS_BUCKET], AttemptRecord)
        self.batches = GroupCommit(self._write_batch)  # endpoints of one attempt, written together
        self.gangs: collections.OrderedDict[str, Gang] = collections.OrderedDict()  # the newest last
        self._absent: dict[str, float] = {}  # attempt -> loop time it was found not to exist
        self._refused = 0  # endpoint reports refused (the 1st, 2nd, 4th... are logged)

    @classmethod
    async def build(cls, nc: NATS) -> Registry:
        js, buckets = await bus.setup(nc)
        return cls(nc, js, buckets)

    async def run(self, stop: asyncio.Event) -> None:
        endpoints = functools.partial(
            bus.durable,
            self.js,
            subjects.ENDPOINTS,
            subjects.REGISTRY_CONSUMER,
            subjects.EVENTS_STREAM,
            max_ack_pending=IN_FLIGHT,  # the server's default (1,000) is less than a big gang
        )
        sub = await bus.patiently(endpoints)
        # No order per attempt: the endpoints of one attempt are handled together (`on_endpoint`),
        # as many in flight as a big gang has, so each write of its rendezvous takes them all.
        handling = consume.Handling(
            subjects.REGISTRY_CONSUMER,
            consume.sent(EndpointReported),
            self.on_endpoint,
            log,
            parallel=IN_FLIGHT,
        )
        members = functools.partial(
            bus.durable, self.js, subjects.attempt_members("*", "*"), MEMBERS_CONSUMER, subjects.EVENTS_STREAM
        )
        changes = await bus.patiently(members)
        on_change = consume.Handling(MEMBERS_CONSUMER, _named_attempt, self.on_members, log, key=lambda k: k)
        await asyncio.gather(
            consume.serve(sub, handling, stop, FETCH, bus.renewing(self.nc, endpoints)),
            consume.serve(changes, on_change, stop, renew=bus.renewing(self.nc, members)),
        )

    async def on_members(self, key: str) -> None:
        """An elastic attempt's members changed without a new endpoint: publish its next spec."""
        attempt = await self.attempts.get(key, confirm=True)
        if attempt is not None and attempt.elastic and not attempt.ended:
            await self.collect([], attempt)
        else:
            self.gangs.pop(key, None)  # ended (or gone): nothing is collected for it again

    async def on_endpoint(self, sent: consume.Sent[EndpointReported]) -> None:
        """Collect an endpoint only from the node its task was placed on, for an attempt that
        exists and has not ended: a spec is only ever published for a real gang.

        The endpoints of one attempt that arrive while its rendezvous is being written wait and
        go into the next write together (group commit); each endpoint is stored under its own
        key and the attempt's record holds a bit per task, so a gang of N costs O(N) however
        its endpoints come (in one batch or one at a time). Each handler returns (and its
        message is acked) only once the write that holds its endpoint is done; a failed write
        fails them all (redelivered)."""
        await self.batches.add(attempt_key(sent.message.job_id, sent.message.attempt), sent)

    async def _gang(self, key: str) -> Gang | None:
        """The attempt `key` as this replica last read it, read again when that is older than
        ATTEMPT_REUSE seconds, and for an elastic attempt always (its members are what its spec
        lists; a role that grew has new tasks). A fixed gang's tasks never change: a report for a
        task it lacks is refused, not a reason to read (and decode) the record again, which a
        node sending such reports made the registry do for every batch. None: no such attempt
        (so for ATTEMPT_REUSE seconds: its record is written before any order goes)."""
        at = asyncio.get_running_loop().time()
        if at - self._absent.get(key, -math.inf) < ATTEMPT_REUSE:
            return None
        gang = self.gangs.get(key)
        if gang is None or gang.attempt.elastic or at - gang.read_at > ATTEMPT_REUSE:
            attempt = await self.attempts.get(key, confirm=True)  # None refuses the endpoints
            if attempt is None:
                self._absent[key] = at
                while len(self._absent) > GANGS:
                    self._absent.pop(next(iter(self._absent)))
                return None
            if attempt.ended:  # nothing of it is collected again: not kept
                self.gangs.pop(key, None)
                return Gang.of(attempt, at)
            gang = self._remember(attempt, at)
        return gang

    def _remember(self, attempt: AttemptRecord, at: float | None = None) -> Gang:
        """A gang for this read of its attempt, keeping the endpoints this replica holds of it."""
        old = self.gangs.pop(attempt.key, None)
        at = asyncio.get_running_loop().time() if at is None else at
        gang = self.gangs[attempt.key] = Gang.of(attempt, at, old.endpoints if old else None)
        while len(self.gangs) > GANGS:
            self.gangs.popitem(last=False)
        return gang

    async def _write_batch(self, key: str, items: list[consume.Sent[EndpointReported]]) -> None:
        gang = await self._gang(key)
        accepted = []
        for sent in items:
            why = (
                "no such attempt"
                if gang is None
                else endpoint_refusal(sent.message, sent.subject, sent.by, gang.attempt, gang.tasks)
            )
            if why is not None:
                consume.REFUSED.labels("endpoint").inc()
                self._refused += 1
                if self._refused & (self._refused - 1) == 0 or self._refused % 1000 == 0:  # no flood
                    log.warning(
                        "registry.endpoint_refused", subject=sent.subject[:200], why=why, count=self._refused
                    )
            else:
                accepted.append(sent.message.endpoint)
        if gang is not None and accepted:
            BATCHED.observe(len(accepted))
            await self._collect(accepted, gang)

    async def collect(self, eps: Sequence[Endpoint], attempt: AttemptRecord) -> None:
        """Add `eps` (endpoints of `attempt`'s tasks, already checked) to its rendezvous; publish
        the spec once every member's endpoint is in (for an elastic attempt, again whenever its
        members change)."""
        await self._collect(eps, self._remember(attempt))

    async def _collect(self, eps: Sequence[Endpoint], gang: Gang) -> None:
        """Store each endpoint under its own key (a put: a redelivered one writes the same
        again), then set their bits in the attempt's record in one write; the spec is built
        once, when the last member's bit is set."""
        attempt = gang.attempt
        key = attempt.key
        await asyncio.gather(*(self._store(attempt, ep) for ep in eps))
        bits = 0
        for ep in eps:
            gang.endpoints[_task(ep)] = ep
            bits |= 1 << gang.positions[_task(ep)]
        members, mask, digest = gang.members()
        # First try on what this replica last wrote (or, for an attempt it has not seen, on no
        # record at all: most endpoints of a gang come to one replica, a gang of one has one):
        # a write proves it current, and only a conflict costs a read.
        known: tuple[int | None, bytes | None] | None = self.store.cached(key) or (None, None)
        while True:
            if known is not None:
                (revision, data), known = known, None
            else:
                try:
                    entry = await self.kv.get(key)
                    revision, data = entry.revision, entry.value
                except KeyNotFoundError:
                    revision, data = None, None
            fresh = Rendezvous(job_id=attempt.job_id, attempt=attempt.attempt, gang_size=len(members))
            state = (self.store.decode(key, data) if data else None) or fresh  # garbage is replaced
            collected = state.bits | bits | await self._migrate(state, gang)
            complete = collected & mask == mask
            if attempt.elastic:  # the gang is its members now: a removed or ended task leaves it
                due = complete and digest != state.membership
            else:
                due = complete and not state.published
            update: dict[str, object] = {"collected": format(collected, "x"), "endpoints": {}}
            if attempt.elastic:
                update["gang_size"] = len(members)
            if due:
                update |= {"version": state.version + 1, "membership": digest, "published": True}
            written = state.model_copy(update=update)
            if due:
                # Publish first (idempotent by message id), then record it: a crash in between
                # only republishes the same spec.
                spec = await self._spec(gang, members, written.version)
                await self.publish(spec, len(members))
            if revision is None:
                done = await self.store.create(key, written)
            else:
                done = await self.store.write(key, written, revision)
            if done:
                if due and not attempt.elastic:  # its spec is out: nothing is collected again
                    self.gangs.pop(key, None)  # (a report redelivered reads the record again)
                return
            # It exists, or another replica wrote in between: read it and merge again.

    async def _store(self, attempt: AttemptRecord, ep: Endpoint) -> None:
        await self.kv.put(subjects.endpoint_key(attempt.job_id, attempt.attempt, _task(ep)), ep_bytes(ep))

    async def _migrate(self, state: Rendezvous, gang: Gang) -> int:
        """The bits of the endpoints a record written by an older registry holds in itself,
        once each is stored under its own key."""
        eps = [ep for k, ep in state.endpoints.items() if k in gang.positions]
        await asyncio.gather(*(self._store(gang.attempt, ep) for ep in eps))
        bits = 0
        for ep in eps:
            gang.endpoints.setdefault(_task(ep), ep)
            bits |= 1 << gang.positions[_task(ep)]
        return bits

    async def _spec(self, gang: Gang, members: list[str], version: int) -> ClusterSpec:
        """The spec of `members` (every bit set): from the endpoints this replica stored, the
        others (another replica's, or stored before this one started) read back in one pass."""
        missing = {k for k in members if k not in gang.endpoints}
        if missing:
            gang.endpoints.update(await self._read_endpoints(gang.attempt, missing))
        ordered = sorted((gang.endpoints[k] for k in members), key=lambda e: (e.role_no, e.index))
        a = gang.attempt
        return ClusterSpec(job_id=a.job_id, attempt=a.attempt, endpoints=ordered, version=max(1, version))

    async def _read_endpoints(self, attempt: AttemptRecord, wanted: set[str]) -> dict[str, Endpoint]:
        """The stored endpoints of `wanted` tasks of the attempt, in one watch of its keys (not a
        read each). Each was stored before its bit was set, so all are there; bounded wait."""
        prefix = f"{attempt.key}."
        found: dict[str, Endpoint] = {}
        watcher = await self.kv.watch(subjects.endpoint_keys(attempt.job_id, attempt.attempt))
        try:
            async with asyncio.timeout(READ_WAIT):
                while not wanted <= found.keys():
                    entry = await watcher.updates(timeout=READ_WAIT)
                    if entry is None or entry.operation in ("DEL", "PURGE") or not entry.value:
                        continue  # nats-py's "no more for now" marker (may come early), a deletion
                    task = entry.key[len(prefix) :]
                    if task in wanted:
                        try:
                            found[task] = Endpoint.model_validate_json(entry.value)
                        except ValueError as exc:  # not an endpoint: skipped, counted and named
                            BAD_RECORDS.labels(subjects.RENDEZVOUS_BUCKET).inc()
                            log.warning("registry.bad_endpoint_record", key=entry.key, error=str(exc)[:200])
        except TimeoutError:
            lacking = sorted(wanted - found.keys())[:5]
            raise RuntimeError(f"endpoints of {attempt.key} collected but not found: {lacking}") from None
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
        return found

    async def publish(self, spec: ClusterSpec, tasks: int) -> None:
        version = "" if spec.version <= 1 else f".v{spec.version}"
        await bus.publish_once(
            self.js,
            subjects.cluster_spec(spec.job_id, spec.attempt),
            spec.to_bytes(),
            f"spec:{spec.job_id}.{spec.attempt}{version}",
        )
        SPECS.inc()
        log.info(
            "registry.spec_published",
            job_id=spec.job_id,
            attempt=spec.attempt,
            tasks=tasks,
            version=spec.version,
        )


def _task(ep: Endpoint) -> str:
    return f"{ep.role}.{ep.index}"


def ep_bytes(ep: Endpoint) -> bytes:
    return ep.model_dump_json().encode()


def _named_attempt(msg: Any) -> str:
    """The attempt an `attempt_members` message names in its subject (the payload is ignored)."""
    parts = msg.subject.split(".")
    if (
        len(parts) != 6
        or parts[-1] != "members"
        or not shapes.is_job_id(parts[3])
        or not re.fullmatch(r"[1-9][0-9]{0,8}", parts[4])
    ):
        raise ValueError(f"not an attempt_members subject: {msg.subject[:200]}")
    return attempt_key(parts[3], int(parts[4]))


def endpoint_refusal(
    report: EndpointReported,
    subject: str,
    sender: str,
    attempt: AttemptRecord,
    tasks: dict[str, TaskStatus] | None = None,
) -> str | None:
    """Why an endpoint report may not be collected, or None. `tasks`: the attempt's tasks by
    key, when the caller has them (a batch checks each endpoint without a pass over the gang)."""
    ep = report.endpoint
    expected = subjects.task_event(report.job_id, report.attempt, ep.role, ep.index, "endpoint", sender)
    if subject != expected:
        return f"payload does not match its subject (expected {expected})"
    if attempt.ended:
        return f"attempt {attempt.key} has ended"
    if tasks is None:
        tasks = {t.key: t for t in attempt.tasks}
    task = tasks.get(f"{ep.role}.{ep.index}")
    if task is None:
        return f"attempt {attempt.key} has no task {ep.role}.{ep.index}"
    if sender != task.node or ep.node != task.node:
        return f"sent by node {sender} for node {ep.node}, but {ep.role}.{ep.index} was placed on {task.node}"
    if ep.role_no != task.role_no:  # the spec would fail on every node, blamed on each of them
        return f"{ep.role}.{ep.index} is of role number {task.role_no}, not {ep.role_no}"
    return None
