"""The registry against a real bus: replicas write each attempt's rendezvous on the revision
they last wrote (a guess, proved by the write), so a stale guess must cost a read, never an
endpoint or a second spec."""

from __future__ import annotations

import asyncio

from muster.services.registry.service import Registry
from muster.shared import bus, consume, subjects
from muster.shared.messages import (
    AttemptRecord,
    ClusterSpec,
    Endpoint,
    EndpointReported,
    Rendezvous,
    TaskStatus,
)
from tests.conftest import count_calls


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


async def test_a_gang_of_one_is_published_without_a_read(nats_url, monkeypatch):
    """A one-task gang's rendezvous is created in one write: nothing is read first."""
    r, nc = await replica(nats_url)
    reads = count_calls(monkeypatch, r.kv, "get")
    try:
        attempt = gang(1)
        await r.collect([endpoint(0)], attempt)
        assert reads() == 0
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


def report(attempt: AttemptRecord, ep: Endpoint, by: str | None = None) -> consume.Sent[EndpointReported]:
    by = by or ep.node
    subject = subjects.task_event(attempt.job_id, attempt.attempt, ep.role, ep.index, "endpoint", by)
    message = EndpointReported(
        job_id=attempt.job_id, attempt=attempt.attempt, gang_size=len(attempt.tasks), endpoint=ep
    )
    return consume.Sent(by, subject, message)


async def test_forged_reports_cost_no_read_and_a_published_gang_is_let_go(nats_url, monkeypatch):
    """A node sending reports for a task a fixed gang lacks (worker.99), or for an attempt there
    is not, made the registry read and decode the record again for every batch (a 1,000-task
    record: ~10 ms of its one loop each), and said each in a log line. A gang whose spec was out
    stayed held (~1.7 MB for 1,000 tasks) until 1,024 newer ones pushed it out. A report whose
    role number is not its task's made a spec every node failed on. Now: one read, no re-read for
    a task the gang cannot have, "absent" remembered a while, the published gang let go."""
    r, nc = await replica(nats_url)
    attempt = gang(2)
    reads = count_calls(monkeypatch, r.attempts, "get")
    try:
        await r.attempts.kv.put(attempt.key, attempt.to_bytes())
        forged = Endpoint(role="worker", role_no=0, index=99, node="n0", host="10.0.0.1", port=6000)
        for _ in range(5):
            await r._write_batch(attempt.key, [report(attempt, forged)])
        assert reads() == 1, reads()
        none = AttemptRecord(job_id="jnone", attempt=1, tasks=attempt.tasks)
        for _ in range(5):
            await r._write_batch(none.key, [report(none, endpoint(0))])
        assert reads() == 2, reads()
        wrong_role = endpoint(0).model_copy(update={"role_no": 1})
        await r._write_batch(attempt.key, [report(attempt, wrong_role)])
        assert not await specs(nats_url, attempt)
        await r._write_batch(attempt.key, [report(attempt, endpoint(0)), report(attempt, endpoint(1))])
        (published,) = await specs(nats_url, attempt)
        assert [e.port for e in published.endpoints] == [5000, 5001]
        assert attempt.key not in r.gangs  # its spec is out: let go
    finally:
        await nc.close()
