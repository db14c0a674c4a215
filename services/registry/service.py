"""The rendezvous registry: collects every task's endpoint for an attempt and, when all are in,
publishes the attempt's cluster spec exactly once (the barrier every task waits behind).

Endpoints arrive through one durable consumer shared by all replicas. What has been collected
lives in the KV bucket `muster_rendezvous` (key `<job>.<attempt>`), updated with the revision
read, so a replica killed at any point loses nothing and two replicas never lose an endpoint.
The spec is published with a message id, so publishing it again after a crash is harmless."""

from __future__ import annotations

import asyncio

import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from prometheus_client import Counter

from shared import bus, consume, subjects
from shared.messages import AttemptRecord, EndpointReported, Rendezvous, attempt_key
from shared.store import Store
from shared.subjects import Headers

log = structlog.get_logger(service="registry")
SPECS = Counter("muster_registry_specs_total", "Cluster specs published")


class Registry:
    def __init__(self, nc: NATS, js: JetStreamContext, buckets: dict[str, KeyValue]):
        self.nc, self.js = nc, js
        self.kv = buckets[subjects.RENDEZVOUS_BUCKET]
        self.store = Store(self.kv, Rendezvous)
        self.attempts = Store(buckets[subjects.ATTEMPTS_BUCKET], AttemptRecord)

    @classmethod
    async def build(cls, nc: NATS) -> Registry:
        js, buckets = await bus.setup(nc)
        return cls(nc, js, buckets)

    async def run(self, stop: asyncio.Event) -> None:
        sub = await bus.durable(
            self.js, subjects.ENDPOINTS, subjects.REGISTRY_CONSUMER, subjects.EVENTS_STREAM
        )
        handling = consume.Handling(
            subjects.REGISTRY_CONSUMER,
            consume.sent(EndpointReported),
            self.on_endpoint,
            log,
            key=lambda r: attempt_key(r.message.job_id, r.message.attempt),
        )
        await consume.serve(sub, handling, stop)

    async def on_endpoint(self, sent: consume.Sent[EndpointReported]) -> None:
        """Collect an endpoint only from the node its task was placed on, for an attempt that
        exists and has not ended: a spec is only ever published for a real gang."""
        report = sent.message
        attempt = await self.attempts.get(attempt_key(report.job_id, report.attempt))
        why = (
            "no such attempt" if attempt is None else endpoint_refusal(report, sent.subject, sent.by, attempt)
        )
        if why is not None:
            consume.REFUSED.labels("endpoint").inc()
            log.warning("registry.endpoint_refused", subject=sent.subject[:200], why=why)
            return
        assert attempt is not None
        await self.collect(report.model_copy(update={"gang_size": len(attempt.tasks)}))

    async def collect(self, report: EndpointReported) -> None:
        key = attempt_key(report.job_id, report.attempt)
        ep = report.endpoint
        while True:
            fresh = Rendezvous(job_id=report.job_id, attempt=report.attempt, gang_size=report.gang_size)
            try:
                entry = await self.kv.get(key)
                revision: int | None = entry.revision
                state = self.store.decode(key, entry.value) or fresh  # garbage is replaced
            except KeyNotFoundError:
                state, revision = fresh, None
            state.endpoints[f"{ep.role}.{ep.index}"] = ep
            complete = len(state.endpoints) >= state.gang_size
            if complete and not state.published:
                # Publish first (idempotent by message id), then record it: a crash in between
                # only republishes the same spec.
                await self.publish(state)
                state.published = True
            try:
                if revision is None:
                    await self.kv.create(key, state.to_bytes())
                else:
                    await self.kv.update(key, state.to_bytes(), last=revision)
                return
            except KeyWrongLastSequenceError:
                continue  # another replica wrote in between: merge again

    async def publish(self, state: Rendezvous) -> None:
        await self.js.publish(
            subjects.cluster_spec(state.job_id, state.attempt),
            state.spec().to_bytes(),
            headers={Headers.MSG_ID: f"spec:{state.job_id}.{state.attempt}"},
        )
        SPECS.inc()
        log.info("registry.spec_published", job_id=state.job_id, attempt=state.attempt, tasks=state.gang_size)


def endpoint_refusal(
    report: EndpointReported, subject: str, sender: str, attempt: AttemptRecord
) -> str | None:
    """Why an endpoint report may not be collected, or None."""
    ep = report.endpoint
    expected = subjects.task_event(report.job_id, report.attempt, ep.role, ep.index, "endpoint", sender)
    if subject != expected:
        return f"payload does not match its subject (expected {expected})"
    if attempt.ended:
        return f"attempt {attempt.key} has ended"
    task = next((t for t in attempt.tasks if t.role == ep.role and t.index == ep.index), None)
    if task is None:
        return f"attempt {attempt.key} has no task {ep.role}.{ep.index}"
    if sender != task.node or ep.node != task.node:
        return f"sent by node {sender} for node {ep.node}, but {ep.role}.{ep.index} was placed on {task.node}"
    return None
