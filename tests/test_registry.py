"""The registry against a real bus: replicas write each attempt's rendezvous on the revision
they last wrote (a guess, proved by the write), so a stale guess must cost a read, never an
endpoint or a second spec."""

from __future__ import annotations

import asyncio

from muster.services.registry.service import Registry
from muster.shared import bus, subjects
from muster.shared.messages import AttemptRecord, ClusterSpec, Endpoint, Rendezvous, TaskStatus


def gang(n: int) -> AttemptRecord:
    tasks = [TaskStatus(role="worker", role_no=0, index=i, node=f"n{i}") for i in range(n)]
    return AttemptRecord(job_id="jreg", attempt=1, tasks=tasks)


def endpoint(i: int) -> Endpoint:
    return Endpoint(role="worker", role_no=0, index=i, node=f"n{i}", host="10.0.0.1", port=5000 + i)


async def replica(nats_url: str) -> tuple[Registry, object]:
    nc = await bus.connect("test", nats_url)
    js, buckets = await bus.setup(nc)
    return Registry(nc, js, buckets), nc


async def specs(nats_url: str, attempt: AttemptRecord) -> list[ClusterSpec]:
    nc = await bus.connect("test", nats_url)
    try:
        js = nc.jetstream()
        sub = await js.subscribe(
            subjects.cluster_spec(attempt.job_id, attempt.attempt), ordered_consumer=True
        )
        out = []
        while True:
            try:
                out.append(ClusterSpec.from_bytes((await sub.next_msg(timeout=1)).data))
            except Exception:
                return out
    finally:
        await nc.close()


async def test_replicas_taking_turns_on_one_gang_collect_every_endpoint_and_publish_once(nats_url):
    """Two replicas take a 6-task gang's endpoints in turns (each one's own last write is stale
    after the other's), then both at once: every endpoint is kept and one spec goes out."""
    a, nca = await replica(nats_url)
    b, ncb = await replica(nats_url)
    attempt = gang(6)
    try:
        for i in range(4):
            await (a if i % 2 == 0 else b).collect([endpoint(i)], attempt)
        await asyncio.gather(a.collect([endpoint(4)], attempt), b.collect([endpoint(5)], attempt))
        entry = await a.kv.get(attempt.key)
        state = Rendezvous.from_bytes(entry.value)
        assert state.bits == 0b111111
        assert state.published and state.version == 1
        published = await specs(nats_url, attempt)
        assert len(published) == 1
        assert [e.port for e in published[0].endpoints] == [5000 + i for i in range(6)]
        # A replayed endpoint (a redelivery) changes nothing and publishes nothing new.
        await b.collect([endpoint(2)], attempt)
        assert len(await specs(nats_url, attempt)) == 1
    finally:
        await nca.close()
        await ncb.close()


async def test_a_gang_of_one_is_published_without_a_read(nats_url):
    """A one-task gang's rendezvous is created in one write: nothing is read first."""
    r, nc = await replica(nats_url)
    reads = 0
    get = r.kv.get

    async def counted(key: str):
        nonlocal reads
        reads += 1
        return await get(key)

    r.kv.get = counted  # type: ignore[method-assign]
    try:
        attempt = gang(1)
        await r.collect([endpoint(0)], attempt)
        assert reads == 0
        assert len(await specs(nats_url, attempt)) == 1
        # A replica that has not seen it (a fresh one) guesses "absent", loses the create, reads.
        other, nco = await replica(nats_url)
        await other.collect([endpoint(0)], attempt)
        state = Rendezvous.from_bytes((await r.kv.get(attempt.key)).value)
        assert state.bits == 1 and state.published
        assert len(await specs(nats_url, attempt)) == 1
        await nco.close()
    finally:
        await nc.close()


async def test_a_rendezvous_an_older_registry_wrote_is_completed_with_its_endpoints(nats_url):
    """A record of the former layout (every endpoint inside it), left mid-rendezvous by an older
    registry: the next endpoint moves them to their own keys and completes the gang."""
    r, nc = await replica(nats_url)
    attempt = gang(3)
    try:
        older = Rendezvous(
            job_id=attempt.job_id,
            attempt=1,
            gang_size=3,
            endpoints={f"worker.{i}": endpoint(i) for i in range(2)},
        )
        await r.kv.put(attempt.key, older.to_bytes())
        await r.collect([endpoint(2)], attempt)
        (published,) = await specs(nats_url, attempt)
        assert [e.port for e in published.endpoints] == [5000, 5001, 5002]
        state = Rendezvous.from_bytes((await r.kv.get(attempt.key)).value)
        assert state.bits == 0b111 and state.published and not state.endpoints
        stored = await r.kv.get(subjects.endpoint_key(attempt.job_id, 1, "worker.0"))
        assert Endpoint.model_validate_json(stored.value) == endpoint(0)
    finally:
        await nc.close()
