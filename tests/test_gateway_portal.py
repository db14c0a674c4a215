"""Issue 26: what the gateway answers so that the web portal's pages need no whole-list reads.
The pure cores first (services/gateway/listing.py's `changed`, services/gateway/cluster.py),
then the real services on a sim node: each waiting job's place in the queue (the scheduler's
`muster.queue`), the `nodes` page (a device names its job to its owner only), and the jobs that
changed since a time."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from muster.services.gateway.cluster import Cluster, live
from muster.services.gateway.listing import Listing, Query, Summary, micros
from muster.services.gateway.service import BAD_QUEUE, QUEUE_STALE, Queue
from muster.shared import auth, bus, client, subjects
from muster.shared.messages import (
    AttemptRecord,
    GpuDevice,
    JobState,
    NodeInfo,
    QueueOrder,
    TaskState,
    TaskStatus,
)
from muster.shared.natsserver import NatsServer
from tests.test_listing import record
from tests.test_sharing import Bench
from tests.test_sim import SimCluster, wait_nodes

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Counting(dict[str, Summary]):
    """The listing's summaries, counting how many a question reads."""

    reads = 0

    def __getitem__(self, key: str) -> Summary:
        self.reads += 1
        return super().__getitem__(key)


class Clock:
    def __init__(self) -> None:
        self.t = micros(T0)

    def __call__(self) -> int:
        return self.t


# ---------------------------------------------------------------- changed since, the index alone


def test_what_changed_since_costs_the_changes_not_the_jobs_retained():
    clock = Clock()
    listing = Listing(clock)
    jobs = Counting()
    listing.jobs = jobs
    users = ("alice", "bob")
    for i in range(50_000):  # retained, written long ago
        clock.t += 1
        r = record(i, JobState.SUCCEEDED, user=users[i % 2])
        listing[r.job_id] = Summary.of(r)
    since = listing.now() + 1
    clock.t += 1_000_000
    changed = []
    for n, i in enumerate(range(10, 50_000, 1999)):  # 25 of them written again, one a second
        clock.t += 1_000_000
        state = (JobState.RUNNING, JobState.WAITING, JobState.FAILED)[n % 3]
        r = record(i, state, user=users[i % 2])
        listing[r.job_id] = Summary.of(r)
        changed.append(r)
    new = record(99_999, JobState.WAITING, user="bob")  # and one new job
    clock.t += 1_000_000
    listing[new.job_id] = Summary.of(new)
    changed.append(new)

    jobs.reads = 0
    answer = listing.changed(Query(subjects.ALL), since, 1000, 1 << 20)
    assert [j["job_id"] for j in answer["jobs"]] == [r.job_id for r in reversed(changed)]
    assert answer["more"] is False and answer["total"] == 50_001
    assert jobs.reads == len(changed)  # the changes walked, nothing else of the 50,001
    assert answer["now"] == datetime.fromtimestamp(clock.t / 1e6, UTC).isoformat()

    # The asker's own (the same scope rules), filtered as a page is; `more` past the limit.
    jobs.reads = 0
    bob = listing.changed(Query("bob", (JobState.WAITING,)), since, 1000, 1 << 20)
    expected = [r.job_id for r in reversed(changed) if r.user == "bob" and r.state == JobState.WAITING]
    assert [j["job_id"] for j in bob["jobs"]] == expected and len(expected) >= 3
    assert jobs.reads <= len(changed) and bob["counts"]["WAITING"] == len(expected)
    two = listing.changed(Query(subjects.ALL), since, 2, 1 << 20)
    assert len(two["jobs"]) == 2 and two["more"] is True
    assert (
        listing.changed(Query(subjects.ALL), since, 1000, 1 << 20, lambda s, item: item.update(x=1))["jobs"][
            0
        ]["x"]
        == 1
    )

    # Nothing since `now`; a write after it is seen at or after it, even if the clock goes back.
    later = micros(datetime.fromisoformat(answer["now"]))
    assert listing.changed(Query(subjects.ALL), later + 1, 1000, 1 << 20)["jobs"] == []
    clock.t -= 10_000_000
    again = changed[0].model_copy(update={"state": JobState.STOPPED})
    listing[again.job_id] = Summary.of(again)
    after = listing.changed(Query(subjects.ALL), later, 1000, 1 << 20)
    # (At or after: the last job, written at the very microsecond of `now`, comes again.)
    assert [(j["job_id"], j["state"]) for j in after["jobs"]] == [
        (again.job_id, "STOPPED"),
        (new.job_id, "WAITING"),
    ]
    del listing[again.job_id]  # pruned: gone from what changed too
    assert [j["job_id"] for j in listing.changed(Query(subjects.ALL), later, 9, 1 << 20)["jobs"]] == [
        new.job_id
    ]
    assert again.job_id not in listing.seen["alice" if again.user == "alice" else "bob"]


# ---------------------------------------------------------------- the cluster page, the core alone

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)


def node(name: str, gpus: int = 4, model: str = "V100", **kw: Any) -> NodeInfo:
    return NodeInfo(
        node=name,
        address=f"10.0.0.{len(name)}",
        cpus=16,
        memory_mb=65536,
        runtime="sim",
        agent_id=name,
        gpus=[GpuDevice(index=i, model=model) for i in range(gpus)],
        heartbeat_at=kw.pop("heartbeat_at", NOW),
        **kw,
    )


def cluster_of(nodes: list[NodeInfo], jobs: list[Any], attempts: list[AttemptRecord]) -> Cluster:
    listing = Listing()
    for r in jobs:
        listing[r.job_id] = Summary.of(r)
    c = Cluster(listing, node_timeout=30, sample_every=60)
    for info in nodes:
        c.nodes[info.node] = info
        c.node_changed(info.node)
    for a in attempts:
        kept = live(a)
        if kept is not None:
            c.held[a.key] = kept
    return c


def attempt(job_id: str, *tasks: tuple[str, list[int], TaskState]) -> AttemptRecord:
    return AttemptRecord(
        job_id=job_id,
        attempt=1,
        tasks=[
            TaskStatus(role="w", role_no=0, index=i, node=n, gpus=g, state=s)
            for i, (n, g, s) in enumerate(tasks)
        ],
    )


def test_a_shared_gpu_shows_every_job_on_it_and_how_much_of_it_is_taken():
    """Two jobs' tasks on parts of one GPU (issue 27): the device names both (as the asker may
    see them), says it is shared and how many thousandths are taken; the GPU counts once."""
    alice, bob = record(1, JobState.RUNNING, user="alice"), record(2, JobState.RUNNING, user="bob")

    def half(job_id: str, milli: int) -> AttemptRecord:
        task = TaskStatus(
            role="w", role_no=0, index=0, node="a", gpus=[1], gpu_milli=milli, state=TaskState.RUNNING
        )
        return AttemptRecord(job_id=job_id, attempt=1, tasks=[task])

    c = cluster_of([node("a")], [alice, bob], [half(alice.job_id, 500), half(bob.job_id, 250)])
    c.beat("a", NOW)
    admin = {n["name"]: n for n in c.page(subjects.ALL, None, 100, 1 << 20, NOW)["nodes"]}
    shared = admin["a"]["devices"][1]
    assert shared["used"] and shared["shared_milli"] == 750, shared
    assert sorted(shared["jobs"]) == sorted([alice.job_id, bob.job_id]) and shared["job"] in shared["jobs"]
    assert "shared_milli" not in admin["a"]["devices"][0]  # free: not shared
    assert admin["a"]["gpus"] == [{"model": "V100", "total": 4, "used": 1, "free": 3}]
    mine = {n["name"]: n for n in c.page("alice", None, 100, 1 << 20, NOW)["nodes"]}
    assert mine["a"]["devices"][1]["jobs"] == [alice.job_id]  # bob's part: used, whose not said
    assert c.summary(NOW)["gpus"] == [{"model": "V100", "total": 4, "used": 1, "free": 3}]


def test_a_node_shows_its_state_and_what_live_tasks_hold_naming_only_the_askers_jobs():
    mine = record(1, JobState.RUNNING, user="alice")  # 1 CPU, 128 MB a task
    theirs = record(2, JobState.RUNNING, user="bob")
    done = record(3, JobState.RUNNING, user="bob")
    nodes = [
        node("a"),
        node("b", drained=True),
        node("c", restarting_until=NOW + timedelta(minutes=1), heartbeat_at=NOW - timedelta(hours=1)),
        node("d", heartbeat_at=NOW - timedelta(minutes=5)),
        node("e", gpus=2, model="A100"),
    ]
    attempts = [
        attempt(mine.job_id, ("a", [0, 1], TaskState.RUNNING), ("e", [1], TaskState.PLACED)),
        attempt(theirs.job_id, ("a", [3], TaskState.RUNNING)),
        attempt(done.job_id, ("a", [2], TaskState.SUCCEEDED)),  # ended: holds nothing
    ]
    c = cluster_of(nodes, [mine, theirs, done], attempts)
    c.beat("a", NOW)
    assert len(c.held) == 2  # the ended attempt is not kept
    shown = {n["name"]: n for n in c.page("alice", None, 100, 1 << 20, NOW)["nodes"]}
    assert {n: s["state"] for n, s in shown.items()} == {
        "a": "healthy",
        "b": "draining",
        "c": "restarting",
        "d": "lost",
        "e": "healthy",
    }
    a = shown["a"]
    assert a["devices"] == [
        {"index": 0, "model": "V100", "used": True, "job": mine.job_id, "jobs": [mine.job_id]},
        {"index": 1, "model": "V100", "used": True, "job": mine.job_id, "jobs": [mine.job_id]},
        {"index": 2, "model": "V100", "used": False, "job": None, "jobs": []},
        {"index": 3, "model": "V100", "used": True, "job": None, "jobs": []},  # bob's: whose not said
    ]
    assert a["gpus"] == [{"model": "V100", "total": 4, "used": 3, "free": 1}]
    assert (a["cpus"], a["cpus_used"], a["memory_mb"], a["memory_mb_used"]) == (16, 2, 65536, 256)
    assert shown["e"]["gpus"] == [{"model": "A100", "total": 2, "used": 1, "free": 1}]
    bob = {n["name"]: n for n in c.page("bob", None, 100, 1 << 20, NOW)["nodes"]}
    assert [d["job"] for d in bob["a"]["devices"]] == [None, None, None, theirs.job_id]
    admin = {n["name"]: n for n in c.page(subjects.ALL, None, 100, 1 << 20, NOW)["nodes"]}
    assert [d["job"] for d in admin["a"]["devices"]] == [mine.job_id, mine.job_id, None, theirs.job_id]
    summary = c.summary(NOW)
    assert summary["states"] == {"healthy": 2, "draining": 1, "restarting": 1, "lost": 1}
    assert summary["gpus"] == [
        {"model": "A100", "total": 2, "used": 1, "free": 1},
        {"model": "V100", "total": 16, "used": 3, "free": 1},  # free: on healthy nodes only
    ]
    # The attempt ends: what it held is free again; a node removed leaves the page.
    del c.held[attempts[0].key]
    del c.nodes["d"]
    c.node_changed("d")
    shown = {n["name"]: n for n in c.page("alice", None, 100, 1 << 20, NOW)["nodes"]}
    assert list(shown) == ["a", "b", "c", "e"] and shown["a"]["gpus"][0]["used"] == 1


def test_ten_thousand_nodes_page_within_the_budget_each_once():
    nodes = [node(f"n{i:05d}", gpus=8) for i in range(10_000)]
    c = cluster_of(nodes, [], [])
    budget = 512 * 1024
    seen, cursor, pages = [], None, 0
    while True:
        after = cursor.split(".", 1)[1] if cursor else None
        page = c.page("alice", after, 1000, budget, NOW)
        assert len(json.dumps(page, separators=(",", ":"))) <= budget + 100  # (the envelope)
        if cursor is None:
            assert page["summary"]["nodes"] == 10_000 and page["summary"]["states"]["healthy"] == 10_000
        seen += [n["name"] for n in page["nodes"]]
        pages += 1
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == sorted(n.node for n in nodes) and pages > 10  # the byte budget cut them


def test_the_allocation_is_sampled_kept_a_day_and_thinned_to_fit():
    mine = record(1, JobState.RUNNING)
    c = cluster_of(
        [node("a"), node("lost", heartbeat_at=NOW - timedelta(hours=1))],
        [mine],
        [attempt(mine.job_id, ("a", [0, 2], TaskState.RUNNING))],
    )
    for m in range(0, 26 * 60):  # 26 hours of a sample a minute
        at = NOW + timedelta(minutes=m)
        c.beat("a", at)
        assert c.sample(at) == (2, 4)  # the lost node's GPUs are not counted
    kept = c.shown_allocation(1 << 20)
    assert kept[-1] == [(NOW + timedelta(minutes=26 * 60 - 1)).isoformat(), 2, 4]
    first = datetime.fromisoformat(kept[0][0])
    assert (
        timedelta(hours=23, minutes=58) <= datetime.fromisoformat(kept[-1][0]) - first <= timedelta(hours=24)
    )
    thin = c.shown_allocation(10_000)
    assert len(json.dumps(thin)) <= 10_000 and thin[-1] == kept[-1] and len(thin) > 100


def test_only_the_scheduler_publishes_the_queue_and_the_gateway_hears_it_and_beats():
    def rights(role: str, side: str) -> list[str]:
        ident = auth.Identity(name=role if role != "user" else "alice", role=role, nkey="x")
        return list(auth.permissions(ident)[side]["allow"])

    assert subjects.QUEUE in rights("scheduler", "publish")
    for role in ("user", "gateway", "validator", "supervisor", "registry"):
        assert subjects.QUEUE not in rights(role, "publish"), role
    assert {subjects.QUEUE, subjects.beat("*")} <= set(rights("gateway", "subscribe"))
    assert subjects.QUEUE not in rights("user", "subscribe")


def test_the_gateway_keeps_the_last_good_queue_order_while_it_is_fresh():
    waiting = [Summary.of(record(i, JobState.WAITING)) for i in range(3)]
    running = Summary.of(record(9, JobState.RUNNING))
    q = Queue()
    assert q.place(waiting[0], 0.0) is None and q.queued(0.0) is None  # nothing heard yet
    order = QueueOrder(at=T0, total=5, jobs=[waiting[1].job_id, waiting[0].job_id, running.job_id])
    assert q.heard(order.to_bytes(), 100.0)
    assert [q.place(s, 101.0) for s in waiting] == [2, 1, None] and q.queued(101.0) == 5
    assert q.place(running, 101.0) is None  # no place once it runs, whatever the order said
    bad = BAD_QUEUE._value.get()
    for garbage in (
        b"",
        b"{",
        b'{"at": "yesterday", "total": 1}',
        b'{"at": "2026-01-01T00:00:00Z", "total": -1}',
    ):
        assert not q.heard(garbage, 102.0)
    assert BAD_QUEUE._value.get() == bad + 4 and q.place(waiting[1], 103.0) == 1  # the last good one
    assert q.place(waiting[1], 100.0 + QUEUE_STALE) is None and q.queued(100.0 + QUEUE_STALE) is None


# ---------------------------------------------------------------- through the bus, on a sim node


@pytest.fixture
async def bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Bench]:
    """The control plane as processes and one sim node of 4 V100s; the GPU allocation sampled
    every second."""
    monkeypatch.setenv("MUSTER_ALLOCATION_SAMPLE", "1")
    with NatsServer(tmp_path / "nats") as server:
        cluster = SimCluster(server.url, tmp_path)
        try:
            cluster.core()
            cluster.sim("sim", 1, "--gpus", "4xV100")
            nc = await bus.connect("test", server.url)
            try:
                assert len(await wait_nodes(nc, "sim", 1)) == 1, cluster.logs()
                await bus.ensure_jetstream(nc)
                yield Bench(cluster, nc)
            finally:
                await nc.close()
        finally:
            cluster.stop_all()


async def test_places_nodes_and_changes_through_the_gateway(bench: Bench) -> None:
    nc = bench.nc
    heard: list[QueueOrder] = []

    async def order(msg: Any) -> None:
        heard.append(QueueOrder.from_bytes(msg.data))

    await nc.subscribe(subjects.QUEUE, cb=order)
    running = await bench.submit("running", gpus=2)
    await bench.until("it runs", lambda: bench.running(running))
    first = await bench.submit("first", gpus=4)
    second = await bench.submit("second", gpus=4, user="bob")

    async def queued() -> bool:
        page = await client.ask(nc, "jobs", {"state": ["WAITING"]}, who="alice")
        return page["queued"] == 2 and [j.get("place") for j in page["jobs"]] == [1]

    await bench.until("alice's waiting job is first of two in the queue", queued)

    async def told() -> bool:  # what the leader published, as anyone listening hears it
        return bool(heard) and (heard[-1].jobs, heard[-1].total) == ([first, second], 2)

    await bench.until("the scheduler publishes the queue", told)
    page = await client.ask(nc, "jobs", who="bob")
    assert [(j["job_id"], j["place"]) for j in page["jobs"]] == [(second, 2)] and page["queued"] == 2
    one = await client.ask(nc, "job", {"ref": second}, who="bob")
    assert (one["place"], one["queued"]) == (2, 2)
    one = await client.ask(nc, "job", {"ref": running}, who="alice")
    assert one["place"] is None  # running: no place in the queue
    # A queue order that does not decode is skipped: the last good one stands.
    await nc.publish(subjects.QUEUE, b'{"at": "yesterday", "jobs": 3}')
    await nc.flush()
    assert (await client.ask(nc, "job", {"ref": second}, who="bob"))["place"] == 2

    # The cluster page: alice sees her job on two devices, bob sees them used, by no one named.
    async def nodes(who: str) -> dict[str, Any]:
        return await client.ask(nc, "nodes", who=who)

    mine = await nodes("alice")
    [n] = mine["nodes"]
    assert n["state"] == "healthy" and n["gpus"] == [{"model": "V100", "total": 4, "used": 2, "free": 2}]
    assert sorted(d["job"] for d in n["devices"] if d["job"]) == [running, running]
    assert mine["summary"]["gpus"][0]["total"] == 4 and mine["next"] is None
    assert mine["allocation"]  # the first sample at start (maybe before the node registered)

    async def sampled() -> bool:
        return (await nodes("alice"))["allocation"][-1][1:] == [2, 4]

    await bench.until("the allocation shows 2 of 4 GPUs used", sampled)
    theirs = (await nodes("bob"))["nodes"][0]
    assert [d["used"] for d in theirs["devices"]] == [d["used"] for d in n["devices"]]
    assert all(d["job"] is None for d in theirs["devices"])
    assert (await client.ask(nc, "nodes", {"limit": 1, "cursor": f"1.{n['name']}"}))["nodes"] == []

    # Live changes: nothing of alice's changed since `now`; killing her running job changes it
    # (and lets her waiting job run); bob asks and sees only his own.
    base = await client.ask(nc, "jobs", {"changed_since": "2000-01-01T00:00:00+00:00"}, who="alice")
    assert {j["job_id"] for j in base["jobs"]} == {running, first} and base["more"] is False
    since = base["now"]
    assert (await client.ask(nc, "jobs", {"changed_since": since}, who="alice"))["jobs"] == []
    await bench.kill(running)

    async def changed() -> bool:
        got = await client.ask(nc, "jobs", {"changed_since": since}, who="alice")
        states = {j["job_id"]: j["state"] for j in got["jobs"]}
        return states.get(running) == "STOPPED" and states.get(first) == "RUNNING"

    await bench.until("the kill and the placement show as changes", changed)
    got = await client.ask(nc, "jobs", {"changed_since": since, "state": ["STOPPED"]}, who="alice")
    assert [j["job_id"] for j in got["jobs"]] == [running] and got["counts"]["STOPPED"] == 1
    assert all(
        j["user"] == "bob"
        for j in (await client.ask(nc, "jobs", {"changed_since": since}, who="bob"))["jobs"]
    )
    with pytest.raises(client.Refused, match="changed_since"):
        await client.ask(nc, "jobs", {"changed_since": "2026-01-01T00:00:00"}, who="alice")  # no zone
    with pytest.raises(client.Refused, match="no cursor"):
        await client.ask(nc, "jobs", {"changed_since": since, "cursor": "1.j1"}, who="alice")

    async def bob_first() -> bool:
        return (await client.ask(nc, "job", {"ref": second}, who="bob"))["place"] == 1

    await bench.until("bob's job moves up to first", bob_first)

    # A gateway started later learns the queue from the leader's periodic order (every 10 s),
    # with nothing changing meanwhile; the first one goes.
    [old] = [p for p in bench.cluster.procs if "muster.services.gateway" in p.args]
    bench.cluster.start("muster.services.gateway")
    old.kill()
    old.wait(10)

    async def learnt() -> bool:
        try:
            one = await client.ask(nc, "job", {"ref": second}, who="bob", timeout=2)
        except (TimeoutError, client.Refused):
            return False
        return (one["place"], one["queued"]) == (1, 1)

    await bench.until("the new gateway knows bob's place", learnt)
