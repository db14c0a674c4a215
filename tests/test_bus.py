"""shared.bus against a real nats-server: pulling from a durable consumer."""

from __future__ import annotations

import asyncio

import nats.js.errors

from shared import bus


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
