"""Liveness at a real node's heartbeat (issue 23.3) and stalled reporters (23.2): beats on core
NATS, expiry from a heap, and a node whose agent is still connected is not lost because its
beats are late (a busy sim process, a slow agent), while one whose connection is gone is."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime, timedelta

from services.supervisor.service import Supervisor
from shared import auth, bus, subjects
from shared.liveness import Beats
from shared.messages import AttemptRecord, NodeInfo, TaskState, TaskStatus

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
