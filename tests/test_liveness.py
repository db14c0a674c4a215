"""Liveness at a real node's heartbeat (issue 23.3) and stalled reporters (23.2): beats on core
NATS, expiry from a heap, and a node whose agent is still connected is not lost because its
beats are late (a busy sim process, a slow agent), while one whose connection is gone is."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime, timedelta

from muster.services.agent import service as agent_service
from muster.services.agent.sim_runtime import SimRuntime
from muster.services.supervisor.service import Supervisor
from muster.shared import auth, bus, subjects
from muster.shared.liveness import Beats
from muster.shared.messages import AttemptRecord, NodeInfo, TaskState, TaskStatus, now

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_quiet_nodes_come_from_a_heap_of_one_entry_per_node():
    beats = Beats(timeout=5)
    for name in ("a", "b", "c"):
        assert beats.saw(name, T0)  # new
    for s in range(1, 60):  # a beats every second, b until 10 s; c never again
        at = T0 + timedelta(seconds=s)
        assert not beats.saw("a", at)
        if s < 10:
            beats.saw("b", at)
        quiet = beats.quiet(at)
        assert quiet == (["c"] if s == 6 else ["b"] if s == 15 else []), s
        assert len(beats._heap) <= 3
    assert beats.alive("a", T0 + timedelta(seconds=60)) and not beats.alive("b", T0 + timedelta(seconds=60))
    assert beats.saw("c", T0 + timedelta(seconds=61))  # back: it was quiet
    assert not beats.saw("c", T0 + timedelta(seconds=30))  # an older sign changes nothing


def test_forgotten_nodes_leave_nothing_behind_and_one_that_comes_back_is_quiet_once():
    """Nodes come and go (autoscaled hosts, each a new name): a forgotten node's heap entry
    stayed for ever where nobody asked which nodes were quiet (the gateway: one per node name
    ever seen). A forgotten node that comes back, then goes quiet, is reported once."""
    beats = Beats(timeout=5)
    for i in range(1000):
        beats.saw(f"gone-{i}", T0)
        beats.forget(f"gone-{i}")
    beats.saw("back", T0)
    beats.forget("back")
    assert beats.saw("back", T0 + timedelta(seconds=1))  # new again
    assert len(beats._heap) <= 66 and not beats.last.keys() - {"back"}
    assert beats.quiet(T0 + timedelta(seconds=7)) == ["back"]
    assert beats.quiet(T0 + timedelta(seconds=30)) == [] and not beats._heap


def test_an_agent_may_beat_and_answer_only_as_its_own_node():
    rights = auth.permissions(auth.Identity(name="agent-n1", role="agent", nkey="x", node="n1"))
    assert subjects.beat("n1") in rights["publish"]["allow"]
    assert not [s for s in rights["publish"]["allow"] if s.startswith(subjects.beat(""))][1:]
    assert subjects.alive("n1") in rights["subscribe"]["allow"]
    assert subjects.alive("*") not in rights["subscribe"]["allow"]
    supervisor = auth.permissions(auth.Identity(name="supervisor", role="supervisor", nkey="x"))
    assert subjects.alive("*") in supervisor["publish"]["allow"]
    assert subjects.beat("*") in supervisor["subscribe"]["allow"]


def record(name: str) -> NodeInfo:
    return NodeInfo(node=name, address="10.0.0.1", cpus=8, memory_mb=8192, runtime="sim", agent_id=name)


async def test_a_connected_node_whose_beats_are_late_is_not_lost_until_its_connection_goes(
    nats_url, monkeypatch
):
    """Three nodes with running tasks stop beating: `gone` has no connection at all (its agent
    died), `busy` is connected and answers the supervisor's question (its beats are stuck behind
    other work), `stalled` is connected but answers nothing (a process too busy to run its loop).
    Only `gone` is lost at the node timeout; `stalled` once its connection closes."""
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", "1")
    monkeypatch.setenv("MUSTER_NODE_STALL_GRACE", "60")
    nc = await bus.connect("test", nats_url)
    busy = await bus.connect("busy", nats_url)
    stalled = await bus.connect("stalled", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        names = ("gone", "busy", "stalled")
        for name in names:
            await buckets[subjects.NODES_BUCKET].put(name, record(name).to_bytes())
        attempt = AttemptRecord(
            job_id="jlive",
            attempt=1,
            tasks=[
                TaskStatus(role="w", role_no=0, index=i, node=n, state=TaskState.RUNNING)
                for i, n in enumerate(names)
            ],
        )
        await buckets[subjects.ATTEMPTS_BUCKET].put(attempt.key, attempt.to_bytes())

        async def answer(msg):
            await msg.respond(b"")

        await busy.subscribe(subjects.alive("busy"), cb=answer)
        await stalled.subscribe(subjects.alive("stalled"))  # subscribed, never answers
        declared: dict[str, float] = {}

        async def on_declared(msg):
            node = msg.subject.split(".")[6]  # task_event(..., role, index, ...): index -> node
            declared.setdefault(names[int(node)], time.monotonic())

        await nc.subscribe(
            subjects.task_event("*", "*", "*", "*", "exited", subjects.PLATFORM), cb=on_declared
        )
        supervisor = Supervisor(nc, js, buckets)
        stop = asyncio.Event()
        running = asyncio.create_task(supervisor.run(stop))
        try:
            t0 = time.monotonic()
            while "gone" not in declared:
                assert time.monotonic() - t0 < 30, "a node with no connection was never declared lost"
                await asyncio.sleep(0.1)
            # Well past the node timeout (1 s): the connected ones are not lost.
            await asyncio.sleep(4)
            assert set(declared) == {"gone"}, declared
            await stalled.close()  # the stalled process dies: its connection goes
            t1 = time.monotonic()
            while "stalled" not in declared:
                assert time.monotonic() - t1 < 30, "a node whose connection closed was never lost"
                await asyncio.sleep(0.1)
            assert "busy" not in declared
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(running, 15)
    finally:
        for c in (nc, busy, stalled):
            with contextlib.suppress(Exception):
                await c.close()


async def test_a_stall_longer_than_the_grace_is_a_lost_node(nats_url, monkeypatch):
    """The grace is bounded: a node connected but silent longer than it is lost anyway (a
    frozen machine whose connection the server keeps for minutes)."""
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", "1")
    monkeypatch.setenv("MUSTER_NODE_STALL_GRACE", "2")
    nc = await bus.connect("test", nats_url)
    frozen = await bus.connect("frozen", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        await buckets[subjects.NODES_BUCKET].put("frozen", record("frozen").to_bytes())
        attempt = AttemptRecord(
            job_id="jfrozen",
            attempt=1,
            tasks=[TaskStatus(role="w", role_no=0, index=0, node="frozen", state=TaskState.RUNNING)],
        )
        await buckets[subjects.ATTEMPTS_BUCKET].put(attempt.key, attempt.to_bytes())
        await frozen.subscribe(subjects.alive("frozen"))
        got = asyncio.Event()

        async def on_declared(msg):
            got.set()

        await nc.subscribe(
            subjects.task_event("jfrozen", "*", "*", "*", "exited", subjects.PLATFORM), cb=on_declared
        )
        stop = asyncio.Event()
        t0 = time.monotonic()
        running = asyncio.create_task(Supervisor(nc, js, buckets).run(stop))
        try:
            await asyncio.wait_for(got.wait(), 30)
            assert time.monotonic() - t0 >= 3  # the node timeout and the grace passed first
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(running, 15)
    finally:
        await nc.close()
        await frozen.close()


async def test_agents_registered_together_spread_their_record_refreshes(nats_url, tmp_path, monkeypatch):
    """40 agents register at once (a fleet restarted together, a sim process): each rewrites its
    node record once a refresh period (3 s here), the first time at a random point of the
    first period, so their rewrites are spread over it. On main every one came a whole period
    after registering: 10,000 sim nodes rewrote their records within the same few seconds of
    every minute."""
    monkeypatch.setattr(agent_service, "REFRESH", 3.0)
    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        agents = [
            agent_service.Agent(
                nc,
                js,
                buckets,
                agent_service.AgentOptions(
                    node=f"r{i}",
                    address="127.0.0.1",
                    cpus=1,
                    memory_mb=1024,
                    gpus=[],
                    work_root=str(tmp_path / f"r{i}"),
                ),
                SimRuntime(),
            )
            for i in range(40)
        ]
        await asyncio.gather(*(a.start() for a in agents))
        loop = asyncio.get_running_loop()
        registered = loop.time()
        first: dict[str, float] = {}  # node -> when its record was first rewritten

        async def rewritten(msg) -> None:
            first.setdefault(msg.subject.rsplit(".", 1)[1], loop.time() - registered)

        await nc.subscribe(f"$KV.{subjects.NODES_BUCKET}.>", cb=rewritten)  # after registering
        while len(first) < len(agents):
            assert loop.time() - registered < 30, "records never refreshed"
            await asyncio.gather(*(a.beat() for a in agents))  # each beats every 50 ms
            await asyncio.sleep(0.05)
        assert max(first.values()) - min(first.values()) > 1.5, sorted(first.values())
        for a in agents:
            await a.reporter.close()
    finally:
        await nc.close()


async def test_a_node_heard_of_while_its_agent_is_asked_is_not_lost(nats_url, monkeypatch):
    """An agent killed and started again: its old connection is gone (the question finds no
    responders), but the new agent beats while the supervisor asks. That node is alive: it is
    not declared lost (it was, with "no heartbeat for -0s")."""
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", "1")
    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        await buckets[subjects.NODES_BUCKET].put("reborn", record("reborn").to_bytes())
        attempt = AttemptRecord(
            job_id="jreborn",
            attempt=1,
            tasks=[TaskStatus(role="w", role_no=0, index=0, node="reborn", state=TaskState.RUNNING)],
        )
        await buckets[subjects.ATTEMPTS_BUCKET].put(attempt.key, attempt.to_bytes())
        declared = asyncio.Event()

        async def on_declared(msg):
            declared.set()

        await nc.subscribe(
            subjects.task_event("jreborn", "*", "*", "*", "exited", subjects.PLATFORM), cb=on_declared
        )
        supervisor = Supervisor(nc, js, buckets)
        asked = 0

        async def reborn_while_asked(node: str) -> bool | None:
            nonlocal asked
            asked += 1
            supervisor.heard(node, now())  # the new agent's beat, while the old one is gone
            return False  # no responders: the old connection is gone

        monkeypatch.setattr(supervisor, "ask_alive", reborn_while_asked)
        stop = asyncio.Event()
        running = asyncio.create_task(supervisor.run(stop))
        try:
            t0 = time.monotonic()
            while asked < 3:
                assert time.monotonic() - t0 < 30, "the quiet node was never asked about"
                assert not declared.is_set(), "a node heard of while asked was declared lost"
                await asyncio.sleep(0.1)
            assert not declared.is_set(), "a node heard of while asked was declared lost"
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(running, 15)
    finally:
        await nc.close()
