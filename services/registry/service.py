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
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from prometheus_client import Counter
from pydantic import Field

from shared import bus, subjects
from shared.messages import ClusterSpec, Endpoint, EndpointReported, Message
from shared.subjects import Headers

log = structlog.get_logger(service="registry")
SPECS = Counter("muster_registry_specs_total", "Cluster specs published")


class Rendezvous(Message):
    """What the registry has collected for one attempt."""

    job_id: str
    attempt: int
    gang_size: int
    endpoints: dict[str, Endpoint] = Field(default_factory=dict)  # "<role>.<index>" -> endpoint
    published: bool = False

    def spec(self) -> ClusterSpec:
        ordered = sorted(self.endpoints.values(), key=lambda e: (e.role_no, e.index))
        return ClusterSpec(job_id=self.job_id, attempt=self.attempt, endpoints=ordered)


class Registry:
    def __init__(self, nc: NATS, js: JetStreamContext, buckets: dict[str, KeyValue]):
        self.nc, self.js = nc, js
        self.kv = buckets[subjects.RENDEZVOUS_BUCKET]

    @classmethod
    async def build(cls, nc: NATS) -> Registry:
        js, buckets = await bus.ensure_jetstream(nc)
        return cls(nc, js, buckets)

    async def run(self, stop: asyncio.Event) -> None:
        sub = await bus.durable(
            self.js, subjects.ENDPOINTS, subjects.REGISTRY_CONSUMER, subjects.EVENTS_STREAM
        )
        await bus.consume(sub, bus.acked(self.handle, log), stop, log, 64)

    async def handle(self, msg: Msg) -> None:
        await self.collect(EndpointReported.from_bytes(msg.data))

    async def collect(self, report: EndpointReported) -> None:
        key = f"{report.job_id}.{report.attempt}"
        ep = report.endpoint
        while True:
            try:
                entry = await self.kv.get(key)
                state, revision = Rendezvous.from_bytes(entry.value), entry.revision
            except KeyNotFoundError:
                state = Rendezvous(job_id=report.job_id, attempt=report.attempt, gang_size=report.gang_size)
                revision = None
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
