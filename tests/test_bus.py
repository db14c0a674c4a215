"""muster.shared.bus against a real nats-server: pulling from a durable consumer."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest

from muster.shared import bus
from muster.shared.natsserver import free_port


async def pull(nats_url: str, stream: str):
    nc = await bus.connect("test", nats_url)
    js = nc.jetstream()
    await js.add_stream(name=stream, subjects=[f"{stream.lower()}.>"])
    sub = await bus.durable(js, f"{stream.lower()}.>", "reader", stream)
    return nc, js, sub


async def test_a_lone_message_is_taken_at_once_not_when_the_batch_would_fill(nats_url):
    """Light traffic: one message and a batch of 64 must not wait out the fetch's timeout (nats-py's
    own fetch(64) would hold it for the whole 30 s here)."""
    nc, js, sub = await pull(nats_url, "LONE")
    try:
        waiting = asyncio.ensure_future(bus.Puller(sub, 64).next(wait=30))
        await asyncio.sleep(0.2)  # the fetch is waiting when the message comes
        await js.publish("lone.x", b"one")
        msgs = await asyncio.wait_for(waiting, 20)
        assert [m.data for m in msgs] == [b"one"]
    finally:
        await nc.close()


async def test_messages_spaced_out_and_acked_late_are_each_taken_at_once(nats_url):
    """As a service consumes: a fetch is already waiting when each message comes, and the one
    before is acked later, by its handler. nats-py's fetch(64, timeout=30) sometimes held such a
    message until the 30 s ran out (bench.launch's submit→running tail); none may wait that long."""
    nc, js, sub = await pull(nats_url, "SPACED")
    late: list[float] = []
    acks: set[asyncio.Task[None]] = set()

    async def ack_later(msg) -> None:
        await asyncio.sleep(0.02)
        await msg.ack()

    async def read(n: int) -> None:
        puller = bus.Puller(sub, 64)
        while len(late) < n:
            for m in await puller.next(wait=30):
                late.append(asyncio.get_running_loop().time() - float(m.data))
                task = asyncio.ensure_future(ack_later(m))
                acks.add(task)
                task.add_done_callback(acks.discard)

    try:
        reader = asyncio.ensure_future(read(10))
        for i in range(10):
            await asyncio.sleep(0.3 if i % 2 else 0.9)
            await js.publish("spaced.x", str(asyncio.get_running_loop().time()).encode())
        await asyncio.wait_for(reader, 20)
        assert len(late) == 10 and max(late) < 10, late
    finally:
        await nc.close()


async def test_what_is_ready_comes_in_batches_and_nothing_is_lost(nats_url):
    nc, js, sub = await pull(nats_url, "MANY")
    try:
        await asyncio.gather(*(js.publish("many.x", str(i).encode()) for i in range(200)))
        got: list[bytes] = []
        fetches = 0
        puller = bus.Puller(sub, 64)
        while len(got) < 200:
            msgs = await asyncio.wait_for(puller.next(wait=10), 20)
            fetches += 1
            for m in msgs:
                got.append(m.data)
                await m.ack()
        assert sorted(int(d) for d in got) == list(range(200))  # each once, none lost
        assert fetches < 200  # taken in batches, not one by one
        with_nothing_left = puller.next(wait=0.5)
        try:
            await with_nothing_left
            raise AssertionError("a fetch with nothing to read returned")
        except TimeoutError:
            pass
    finally:
        await nc.close()


async def test_a_puller_asks_once_per_batch_and_a_deleted_consumer_is_an_error(nats_url):
    """Under load one pull request serves a whole batch (nats-py's fetch costs one to three
    requests per handful of messages); a consumer that is gone raises, it is not waited on."""
    nc, js, sub = await pull(nats_url, "ASKS")
    asks: list[bytes] = []

    async def ask(msg) -> None:
        asks.append(msg.data)

    counter = await nc.subscribe("$JS.API.CONSUMER.MSG.NEXT.ASKS.reader", cb=ask)
    try:
        await asyncio.gather(*(js.publish("asks.x", str(i).encode()) for i in range(256)))
        puller = bus.Puller(sub, 64)
        got: list[bytes] = []
        while len(got) < 256:
            for m in await asyncio.wait_for(puller.next(wait=10), 20):
                got.append(m.data)
                await m.ack()
        assert sorted(int(d) for d in got) == list(range(256))
        await nc.flush()
        assert 4 <= len(asks) <= 6, asks  # 256 / 64, and the one left open
        await counter.unsubscribe()  # it would answer for a consumer that is gone
        await js.delete_consumer("ASKS", "reader")
        try:
            await asyncio.wait_for(puller.next(wait=5), 10)
            raise AssertionError("a deleted consumer was waited on")
        except nats.js.errors.APIError:
            pass
    finally:
        await nc.close()


async def test_muster_jetstream_publishes_and_reads_as_nats_py_does(nats_url):
    """`bus.JetStream` (the context every service uses) answers as nats-py's own context: the
    same acks, duplicates, KV revisions, reads and errors, for many publishes in flight at once."""
    nc = await bus.connect("test", nats_url)
    try:
        ours, theirs = bus.jetstream(nc), nc.jetstream()
        await theirs.add_stream(name="SAME", subjects=["same.>"])
        acks = await asyncio.gather(*(ours.publish("same.x", b"%d" % i) for i in range(300)))
        assert sorted(a.seq for a in acks) == list(range(1, 301))
        assert {a.stream for a in acks} == {"SAME"}
        first = await ours.publish("same.y", b"a", headers={"Nats-Msg-Id": "m1"})
        again = await ours.publish("same.y", b"a", headers={"Nats-Msg-Id": "m1"})
        assert (again.seq, again.duplicate, first.duplicate) == (first.seq, True, None)
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await ours.publish("nowhere.x", b"")
        with pytest.raises(nats.js.errors.BadRequestError):  # the server refuses it
            await ours.publish("same.z", b"", headers={"Nats-Expected-Last-Sequence": "1"})

        kv = await ours.create_key_value(bucket="same_kv", direct=True)
        assert kv._js is ours  # KV writes and reads go through it
        assert await kv.create("k", b"1") == 1
        with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
            await kv.create("k", b"2")
        with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
            await kv.update("k", b"2", last=7)
        assert await kv.update("k", b"2", last=1) == 2
        entry = await kv.get("k")
        assert (entry.value, entry.revision) == (b"2", 2)
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get("absent")
        await kv.delete("k")
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get("k")
        assert await kv.create("k", b"3") == 4  # over its delete marker, as nats-py does
        theirs_kv = await theirs.key_value("same_kv")
        assert (await theirs_kv.get("k")).value == b"3"
    finally:
        await nc.close()


async def test_muster_jetstream_times_out_and_goes_on_after_a_reconnect(tmp_path):
    """No ack: a nats TimeoutError at the timeout, not a hang. After the server is back (and the
    connection with it) publishes are acked again on the same context."""
    from muster.shared.natsserver import NatsServer

    server = NatsServer(tmp_path / "n").start()
    nc = await bus.connect("test", server.url)
    try:
        js = bus.jetstream(nc, timeout=0.5)
        await js.add_stream(name="T", subjects=["t.>"])

        async def silent(msg):  # a responder that never answers
            pass

        await nc.subscribe("silent.x", cb=silent)
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish("silent.x", b"")
        assert (await js.publish("t.a", b"1")).seq == 1
        port = int(server.url.rsplit(":", 1)[1])
        server.stop()
        server = NatsServer(tmp_path / "n", port=port).start()
        for _ in range(100):
            if nc.is_connected:
                break
            await asyncio.sleep(0.1)
        for _ in range(40):  # JetStream may still be recovering its streams at first
            with contextlib.suppress(nats.errors.TimeoutError, nats.js.errors.APIError):
                ack = await js.publish("t.a", b"2")
                break
        assert ack.seq == 2  # the stream is on disk: it goes on
    finally:
        await nc.close()
        server.stop()


async def test_a_durable_takes_the_ack_limit_asked_for_also_when_it_exists(nats_url):
    """The supervisor records a gang's events in one write when they are all in flight at once:
    the server's default of 1,000 unacked messages cut a 2,000-task gang's into batches of 1,000.
    A consumer made before with the default gets the limit asked for now, and keeps its messages."""
    nc, js, _ = await pull(nats_url, "ACKS")
    try:
        await js.publish("acks.x", b"kept")
        assert (await js.consumer_info("ACKS", "reader")).config.max_ack_pending == 1000
        again = await bus.durable(js, "acks.>", "reader", "ACKS", max_ack_pending=2048)
        info = await js.consumer_info("ACKS", "reader")
        assert info.config.max_ack_pending == 2048
        assert info.config.filter_subject == "acks.>"
        msgs = await bus.Puller(again, 16).next(wait=10)
        assert [m.data for m in msgs] == [b"kept"]
    finally:
        await nc.close()


def test_a_free_port_is_one_no_outgoing_connection_can_take_before_it_is_bound():
    """`free_port()` hands out ports a process binds later (a service's metrics, a test's
    nats-server). Ports the kernel picks are also those it gives to outgoing connections, and
    one was taken so under load before its agent bound it. Each is outside the kernel's
    ephemeral range, free when handed out, and never handed out twice; a free preferred port
    is taken as asked, a busy one is not."""
    low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert not [p for p in ports if low <= p <= high]
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports[0]))  # each was free: it binds
        held.listen()
        assert free_port(ports[0]) != ports[0]  # in use: another
    assert free_port(ports[1]) == ports[1]  # free: as asked


def test_processes_side_by_side_pick_ports_from_slices_that_never_meet(monkeypatch):
    """Two test workers each handed out a "free" port, the same one, to two agents (CI: "no free
    metrics port"): `_handed` is one process's. With MUSTER_PORT_SLICE i/n (conftest sets it per
    worker) a process picks only from its own n-th of the ports."""
    from muster.shared import natsserver

    picked = {}
    for i in (0, 1):
        monkeypatch.setenv("MUSTER_PORT_SLICE", f"{i}/2")
        monkeypatch.setattr(natsserver, "_handed", set())  # as if each were its own process
        picked[i] = {free_port() for _ in range(100)}
    assert len(picked[0]) == len(picked[1]) == 100 and not picked[0] & picked[1]
    assert len({p % 2 for p in picked[0]}) == len({p % 2 for p in picked[1]}) == 1  # every other


async def test_a_refused_client_gives_up_at_its_bound_every_time(tmp_path):
    """A client the server refuses (no credentials on a server that wants them) gets a
    `ConnectionError` naming the refusal once `connect_timeout` has passed, every time. It
    used to go on retrying past it (~5 % of tries: nats-py retried the first connection until
    cancelled, and the cancel could be lost), and a compose test hung for minutes on one."""
    from muster.shared import auth
    from muster.shared.natsserver import NatsServer

    keys = auth.AuthDir(tmp_path / "auth")
    keys.ensure("root", "admin")
    loop = asyncio.get_running_loop()

    async def refused(bound: float) -> float:
        start = loop.time()
        with pytest.raises(ConnectionError, match=r"(?i)authorization"):
            await bus.connect("stranger", server.url, connect_timeout=bound, quiet=True)
        return loop.time() - start

    with NatsServer(tmp_path / "nats", auth_config=keys.server_config) as server:
        bounds = [0.6 + (i % 7) * 0.1 for i in range(100)]
        done, hung = await asyncio.wait([asyncio.create_task(refused(b)) for b in bounds], timeout=30)
        for task in hung:
            task.cancel()
        assert not hung, f"{len(hung)} of {len(bounds)} refused clients still trying after 30 s"
        assert all(t.exception() is None for t in done), [t.exception() for t in done if t.exception()]
        # A refused client asks again every 0.5 s until its bound (and the server is told so).
        assert max(t.result() for t in done) < max(bounds) + 5


async def test_a_try_at_an_unreachable_server_ends_by_itself(monkeypatch):
    """With no server answering, each try of the first connection ends by itself (two turns per
    server), so `connect_timeout` holds even if the bound around a try never fires: Python 3.11
    can lose the cancel that ends it, and with unlimited attempts a try went round the servers
    until cancelled. Here the bound is taken away (the seam); the client still gives up."""
    real = asyncio.wait_for
    tries = 0

    async def unbounded(aw, timeout):  # a try is never cancelled; closing keeps its bound
        nonlocal tries
        if asyncio.iscoroutine(aw) and aw.__qualname__.endswith("Client.connect"):
            tries += 1
            return await aw
        return await real(aw, timeout)

    monkeypatch.setattr(bus.asyncio, "wait_for", unbounded)
    url = f"nats://127.0.0.1:{free_port()},nats://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match="cannot reach NATS"):
        await real(bus.connect("lonely", url, connect_timeout=2.0, quiet=True), 30)
    assert tries >= 2


@pytest.mark.parametrize("signals", [False, True], ids=["redelivered", "said-working"])
async def test_a_message_handled_past_its_ack_wait_is_handled_once_and_holds_one_slot(
    nats_url, monkeypatch, signals
):
    """A handler that runs past the consumer's ack wait (an agent's kill waiting out its grace)
    got its message again every ack wait, and each copy took a slot to wait behind it: with
    a long enough grace no slot was left and the node took no order at all. Now a copy of a
    message still handled is dropped (the handling acks it), and a long handling tells the
    server it is still working, so no copy comes."""
    from nats.js.api import ConsumerConfig

    from muster.shared import consume

    if signals:
        monkeypatch.setattr(consume, "WORKING_EVERY", 0.3)
    nc = await bus.connect("test", nats_url)
    try:
        js = nc.jetstream()
        stream = f"SLOW{int(signals)}"
        await js.add_stream(name=stream, subjects=[f"{stream}.>"])
        # Told every 0.3 s, the server is given 3 s: a loaded machine's pause of the loop must
        # not pass for silence (the handling still runs past it: 4.5 s).
        wait = 3.0 if signals else 1.0
        sub = await js.pull_subscribe(f"{stream}.>", "slow", config=ConsumerConfig(ack_wait=wait))
        handled: list[str] = []

        async def handle(text: str) -> None:
            handled.append(text)
            if text == "long":
                await asyncio.sleep(4.5)

        from prometheus_client import REGISTRY

        def redelivered() -> float:
            return REGISTRY.get_sample_value("muster_messages_redelivered_total", {"consumer": "slow"}) or 0.0

        before = redelivered()
        handling = consume.Handling("slow", lambda m: m.data.decode(), handle, structlog_like(), parallel=2)
        stop = asyncio.Event()
        serving = asyncio.create_task(consume.serve(sub, handling, stop, batch=8))
        await js.publish(f"{stream}.a", b"long")
        await asyncio.sleep(3.5)  # three ack waits: three copies before
        for i in range(3):
            await js.publish(f"{stream}.a", f"quick{i}".encode())
        deadline = asyncio.get_running_loop().time() + 15
        while len(handled) < 4 or (await sub.consumer_info()).num_ack_pending:
            assert asyncio.get_running_loop().time() < deadline, handled
            await asyncio.sleep(0.1)
        assert handled.count("long") == 1 and sorted(handled[1:]) == ["quick0", "quick1", "quick2"], handled
        # The copies came (or, told it is worked on, the server sent none).
        assert (redelivered() - before == 0) if signals else (redelivered() - before >= 2)
        stop.set()
        await asyncio.wait_for(serving, 15)
    finally:
        await nc.close()


def structlog_like():
    import structlog

    return structlog.get_logger()


async def test_a_consumer_made_at_a_services_start_waits_for_a_bus_that_does_not_answer_yet():
    """A service made its consumers once as it started: a server restarting just then (CI
    saw it: the validator's consumer info timed out just after a reconnect, JetStream not yet
    up) ended the service, and nothing was judged until it was started again. It asks again
    every second for up to PATIENCE seconds; what is not the bus's silence still raises."""
    tries: list[int] = []

    async def after_two() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise nats.errors.TimeoutError
        return "consumer"

    assert await bus.patiently(after_two, wait=30) == "consumer" and len(tries) == 3

    async def never() -> str:
        raise nats.errors.NoRespondersError

    with pytest.raises(nats.errors.NoRespondersError):
        await bus.patiently(never, wait=0.5)

    async def refused() -> str:
        raise nats.js.errors.NotFoundError

    with pytest.raises(nats.js.errors.NotFoundError):
        await bus.patiently(refused, wait=30)


async def test_a_message_given_up_on_is_told_to_whoever_waits_on_it(nats_url, monkeypatch):
    """A message whose handler fails every time is terminated after MAX_DELIVERIES; the
    handling's `given_up` is told (an agent then says its order's tasks did not start)."""
    from nats.js.api import ConsumerConfig

    from muster.shared import consume

    monkeypatch.setattr(consume, "MAX_DELIVERIES", 2)
    nc = await bus.connect("test", nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="GIVEN", subjects=["GIVEN.>"])
        sub = await js.pull_subscribe("GIVEN.>", "given", config=ConsumerConfig(ack_wait=5))
        tries: list[str] = []
        told: list[tuple[str, str]] = []

        async def handle(text: str) -> None:
            tries.append(text)
            raise OSError(28, "No space left on device")

        async def given_up(text: str, why: str) -> None:
            told.append((text, why))

        handling = consume.Handling(
            "given", lambda m: m.data.decode(), handle, structlog_like(), given_up=given_up
        )
        stop = asyncio.Event()
        serving = asyncio.create_task(consume.serve(sub, handling, stop, batch=8))
        await js.publish("GIVEN.a", b"order")
        deadline = asyncio.get_running_loop().time() + 20
        while not told:
            assert asyncio.get_running_loop().time() < deadline, tries
            await asyncio.sleep(0.1)
        assert tries == ["order", "order"] and told == [
            ("order", "OSError: [Errno 28] No space left on device")
        ]
        stop.set()
        await asyncio.wait_for(serving, 15)
    finally:
        await nc.close()
