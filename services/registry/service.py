"""The rendezvous registry: collects every task's endpoint for an attempt and, when all are in,
publishes the attempt's cluster spec exactly once (the barrier every task waits behind).

Endpoints arrive through one durable consumer shared by all replicas. What has been collected
lives in the KV bucket `muster_rendezvous` (key `<job>.<attempt>`), updated with the revision
read, so a replica killed at any point loses nothing and two replicas never lose an endpoint.
The spec is published with a message id, so publishing it again after a crash is harmless.

An elastic attempt (`AttemptRecord.elastic`) has a spec per membership: whenever every member's
endpoint is in and the members differ from the last spec's, the next version is published (a
task joined: its endpoint completes the gang; a task was removed or ended: the scheduler or the
supervisor says so on `attempt_members`, consumed by a second durable consumer). Agents read the
last one; torchrun-style jobs rendezvous by themselves and only need the first member's address."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Histogram

from shared import bus, consume, shapes, subjects
from shared.messages import AttemptRecord, Endpoint, EndpointReported, Rendezvous, TaskStatus, attempt_key
from shared.store import GroupCommit, Store
from shared.subjects import Headers

log = structlog.get_logger(service="registry")
SPECS = Counter("muster_registry_specs_total", "Cluster specs published")
MEMBERS_CONSUMER = "registry-members"
RECENT = 4096  # rendezvous this replica wrote last, kept as (revision, bytes): writes start there
IN_FLIGHT = 2048  # endpoints handled at once: a gang this big is collected in one write
FETCH = 256  # endpoints asked of the server at once
BATCHED = Histogram(
    "muster_registry_batch_endpoints",
    "Endpoints of one attempt collected by one write of its rendezvous",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
)


class Registry:
    def __init__(self, nc: NATS, js: JetStreamContext, buckets: dict[str, KeyValue]):
        self.nc, self.js = nc, js
        self.kv = buckets[subjects.RENDEZVOUS_BUCKET]
        self.store = Store(self.kv, Rendezvous, cache=RECENT)
        self.attempts = Store(buckets[subjects.ATTEMPTS_BUCKET], AttemptRecord)
        self.batches = GroupCommit(self._write_batch)  # endpoints of one attempt, written together

    @classmethod
    async def build(cls, nc: NATS) -> Registry:
        js, buckets = await bus.setup(nc)
        return cls(nc, js, buckets)

    async def run(self, stop: asyncio.Event) -> None:
        sub = await bus.durable(
            self.js, subjects.ENDPOINTS, subjects.REGISTRY_CONSUMER, subjects.EVENTS_STREAM
        )
        # No order per attempt: the endpoints of one attempt are handled together (`on_endpoint`),
        # as many in flight as a big gang has, so each write of its rendezvous takes them all.
        handling = consume.Handling(
            subjects.REGISTRY_CONSUMER,
            consume.sent(EndpointReported),
            self.on_endpoint,
            log,
            parallel=IN_FLIGHT,
        )
        changes = await bus.durable(
            self.js, subjects.attempt_members("*", "*"), MEMBERS_CONSUMER, subjects.EVENTS_STREAM
        )
        on_change = consume.Handling(MEMBERS_CONSUMER, _named_attempt, self.on_members, log, key=lambda k: k)
        await asyncio.gather(
            consume.serve(sub, handling, stop, FETCH), consume.serve(changes, on_change, stop)
        )

    async def on_members(self, key: str) -> None:
        """An elastic attempt's members changed without a new endpoint: publish its next spec."""
        attempt = await self.attempts.get(key)
        if attempt is not None and attempt.elastic and not attempt.ended:
            await self.collect([], attempt)

    async def on_endpoint(self, sent: consume.Sent[EndpointReported]) -> None:
        """Collect an endpoint only from the node its task was placed on, for an attempt that
        exists and has not ended: a spec is only ever published for a real gang.

        The endpoints of one attempt that arrive while its rendezvous is being written wait and
        go into the next write together (group commit): one read of the attempt record and one
        read-modify-write of the rendezvous per batch, not per endpoint, so a gang of N costs
        O(N) however its endpoints come. Each handler returns (and its message is acked) only
        once the write that holds its endpoint is done; a failed write fails them all
        (redelivered)."""
        await self.batches.add(attempt_key(sent.message.job_id, sent.message.attempt), sent)

    async def _write_batch(self, key: str, items: list[consume.Sent[EndpointReported]]) -> None:
        attempt = await self.attempts.get(key)
        tasks = {t.key: t for t in attempt.tasks} if attempt is not None else {}
        accepted = []
        for sent in items:
            why = (
                "no such attempt"
                if attempt is None
                else endpoint_refusal(sent.message, sent.subject, sent.by, attempt, tasks)
            )
            if why is not None:
                consume.REFUSED.labels("endpoint").inc()
                log.warning("registry.endpoint_refused", subject=sent.subject[:200], why=why)
            else:
                accepted.append(sent.message.endpoint)
        if attempt is not None and accepted:
            BATCHED.observe(len(accepted))
            await self.collect(accepted, attempt)

    async def collect(self, eps: Sequence[Endpoint], attempt: AttemptRecord) -> None:
        """Add `eps` to the attempt's rendezvous in one write; publish the spec once every
        member's endpoint is in (for an elastic attempt, again whenever its members change)."""
        key = attempt.key
        members = sorted(t.key for t in attempt.members())
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
            for ep in eps:
                state.endpoints[f"{ep.role}.{ep.index}"] = ep
            if attempt.elastic:  # the gang is its members now: a removed or ended task leaves it
                state.gang_size = len(members)
                state.endpoints = {k: e for k, e in state.endpoints.items() if k in members}
                complete = all(k in state.endpoints for k in members)
                due = complete and members != state.members
            else:
                complete = len(state.endpoints) >= state.gang_size
                due = complete and not state.published
            written = (
                state.model_copy(update={"version": state.version + 1, "members": members, "published": True})
                if due
                else state
            )
            if due:
                # Publish first (idempotent by message id), then record it: a crash in between
                # only republishes the same spec.
                await self.publish(written)
            if revision is None:
                if await self.store.create(key, written):
                    return
            elif await self.store.write(key, written, revision):
                return
            # It exists, or another replica wrote in between: read it and merge again.

    async def publish(self, state: Rendezvous) -> None:
        version = "" if state.version <= 1 else f".v{state.version}"
        await self.js.publish(
            subjects.cluster_spec(state.job_id, state.attempt),
            state.spec().to_bytes(),
            headers={Headers.MSG_ID: f"spec:{state.job_id}.{state.attempt}{version}"},
        )
        SPECS.inc()
        log.info(
            "registry.spec_published",
            job_id=state.job_id,
            attempt=state.attempt,
            tasks=state.gang_size,
            version=max(1, state.version),
        )


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
    return None
