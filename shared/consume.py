"""Typed, concurrent handling of what a service consumes: a message that does not decode is
terminated and counted, never redelivered; handlers run concurrently, in order per key; a handler
that keeps failing is given up on. Apart from `muster.shared.bus` (connecting, streams, buckets) so that
clients that only publish and ask (the CLI) never load the metrics machinery."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge

from muster.shared import settings, shapes, subjects
from muster.shared.bus import consume

M = TypeVar("M")


REJECTED = Counter(
    "muster_messages_rejected_total",
    "Messages terminated without being handled: undecodable, or failing on every delivery",
    ["consumer", "why"],
)
MAX_DELIVERIES = settings.number("MUSTER_MAX_DELIVERIES", 10, int, low=1)
REFUSED = Counter(
    "muster_claims_refused_total",
    "Messages that decoded but claimed what their sender may not: another node's task, another "
    "user's job, an attempt that does not exist, a heartbeat from the future or beyond belief",
    ["kind"],
)

REDELIVERED = Counter(
    "muster_messages_redelivered_total",
    "Messages handled again: delivered before and not acked (a handler failed, or a consumer died)",
    ["consumer"],
)
# From the server's consumer info, polled every LAG_EVERY seconds by each replica consuming (so
# read them with max by (consumer)): what the stream holds that no replica has taken yet, and
# what was taken but not acked yet.
PENDING = Gauge(
    "muster_consumer_pending_messages", "Messages not yet delivered to the consumer", ["consumer"]
)
ACK_PENDING = Gauge(
    "muster_consumer_ack_pending_messages", "Messages delivered but not acked yet", ["consumer"]
)
REDELIVERING = Gauge(
    "muster_consumer_redelivered_messages",
    "Messages delivered more than once and not acked yet",
    ["consumer"],
)
LAG_EVERY = settings.seconds("MUSTER_LAG_EVERY", 10.0, low=0.1)
LAG_WAIT = 3.0  # seconds one consumer-info request may take
CANCEL_WAIT = 5.0  # seconds a drain waits for the handlers it cancelled to end
# Seconds between "still working" signals for a message whose handling runs long (a kill waiting
# out its grace): below the consumers' ack wait (30 s), so the server does not deliver it again.
WORKING_EVERY = 10.0


class Handling(Generic[M]):
    """How one consumer's messages are handled: decoded (a message that does not
    decode is terminated at once, counted and logged — never redelivered), then `handle`d
    concurrently up to `parallel` at a time, in order for messages of the same `key`, acked
    when it returns. A handler that fails is retried after a delay, and given up on (terminated,
    counted, logged) after MAX_DELIVERIES deliveries, so one bad message never stalls the rest;
    `given_up(message, why)`, if any, is then told, so that what waits on the message (a gang on
    its node's order) is not left waiting for a deadline."""

    def __init__(
        self,
        consumer: str,
        decode: Callable[[Msg], M],
        handle: Callable[[M], Awaitable[None]],
        logger: Any,
        key: Callable[[M], str] | None = None,
        parallel: int = 64,
        given_up: Callable[[M, str], Awaitable[None]] | None = None,
    ):
        self.consumer, self.decode, self.handle, self.log, self.key = consumer, decode, handle, logger, key
        self.given_up = given_up
        self.slots = asyncio.Semaphore(parallel)
        self.last: dict[str, asyncio.Task[None]] = {}  # per key, the newest message's handling
        self.running: set[asyncio.Task[None]] = set()
        self.rejected: dict[str, int] = {}
        # Stream sequence -> (message, when its handling began), while it is handled.
        self.underway: dict[int, tuple[Msg, float]] = {}
        self._working: asyncio.Task[None] | None = None

    def _reject(self, msg: Msg, why: str, detail: str) -> None:
        """Count a terminated message; log the 1st, 10th, 100th... of each kind, so a flood of
        garbage cannot flood the log too."""
        REJECTED.labels(self.consumer, why).inc()
        n = self.rejected[why] = self.rejected.get(why, 0) + 1
        if n & (n - 1) == 0 or n % 1000 == 0:  # powers of two, then every thousandth
            self.log.warning(
                "message.rejected",
                consumer=self.consumer,
                why=why,
                subject=msg.subject,
                error=detail,
                count=n,
            )

    async def take(self, msg: Msg) -> None:
        """Start handling one message; returns once a slot is free (back-pressure on fetch)."""
        try:
            decoded = self.decode(msg)
        except Exception as exc:
            self._reject(msg, "undecodable", shapes.refusal(exc))
            with contextlib.suppress(Exception):
                await msg.term()
            return
        seq = None
        with contextlib.suppress(Exception):
            seq = msg.metadata.sequence.stream
            if (msg.metadata.num_delivered or 1) > 1:
                REDELIVERED.labels(self.consumer).inc()
        if seq is not None and seq in self.underway:
            # Delivered again while its handling still runs (it outlived the ack wait before a
            # "working" signal went): that handling acks it. Another would hold a slot waiting
            # behind it, one more every ack wait, until no slot was left for any message.
            return
        await self.slots.acquire()
        key = self.key(decoded) if self.key else None
        before = self.last.get(key) if key is not None else None
        task = asyncio.create_task(self._run(msg, decoded, before))
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        if seq is not None:
            self.underway[seq] = (msg, asyncio.get_running_loop().time())
            task.add_done_callback(lambda _: self.underway.pop(seq, None))
            if self._working is None or self._working.done():
                self._working = asyncio.create_task(self._still_working())
        if key is not None:
            self.last[key] = task
            task.add_done_callback(lambda t: self.last.get(key) is t and self.last.pop(key))

    async def _run(self, msg: Msg, decoded: M, before: asyncio.Task[None] | None) -> None:
        try:
            if before is not None:
                await asyncio.wait([before])
            await self.handle(decoded)
            await msg.ack()
        except Exception as exc:
            delivered = msg.metadata.num_delivered or 1
            if delivered >= MAX_DELIVERIES:
                why = f"{type(exc).__name__}: {exc}"[:200]
                self._reject(msg, "handler_failed", why)
                if self.given_up is not None:
                    try:
                        await self.given_up(decoded, why)
                    except Exception:
                        self.log.error("handler.given_up_failed", consumer=self.consumer, exc_info=True)
                with contextlib.suppress(Exception):
                    await msg.term()
            else:
                self.log.error("handler.failed", consumer=self.consumer, subject=msg.subject, exc_info=True)
                with contextlib.suppress(Exception):
                    await msg.nak(delay=min(30, delivered))
        finally:
            self.slots.release()

    async def _still_working(self) -> None:
        """While messages are handled, tell the server of each handled for WORKING_EVERY or
        longer that it is still being worked on (its ack wait starts again)."""
        loop = asyncio.get_running_loop()
        while self.underway:
            await asyncio.sleep(WORKING_EVERY)
            for msg, began in list(self.underway.values()):
                if loop.time() - began >= WORKING_EVERY:
                    with contextlib.suppress(Exception):
                        await msg.in_progress()

    async def drain(self, timeout: float | None = None) -> None:
        """Wait for the handlers in flight; those still running after `timeout` seconds are
        cancelled (their messages, neither acked nor nak'd, come again after the ack wait)."""
        if self.running:
            _, late = await asyncio.wait(list(self.running), timeout=timeout)
            if late:
                self.log.warning("consumer.drain_cut", consumer=self.consumer, cut=len(late), wait=timeout)
                for task in late:
                    task.cancel()
                await asyncio.wait(late, timeout=CANCEL_WAIT)
        if self._working is not None:
            self._working.cancel()


def payload(model: Any) -> Callable[[Msg], Any]:
    """A `Handling` decoder: the message's payload as `model` (a `Message`)."""
    return lambda msg: model.from_bytes(msg.data)


@dataclass(frozen=True)
class Sent(Generic[M]):
    """A message with who sent it: its subject's last token, which the server's permissions let
    an authenticated identity set only to its own name (a node, a user, or PLATFORM)."""

    by: str
    subject: str
    message: M


def sent(model: Any) -> Callable[[Msg], Sent[Any]]:
    """A `Handling` decoder: the payload as `model`, with its sender."""
    return lambda msg: Sent(subjects.sender(msg.subject), msg.subject, model.from_bytes(msg.data))


async def serve(
    sub: Any,
    handling: Handling[Any],
    stop: asyncio.Event,
    batch: int = 64,
    renew: Callable[[], Awaitable[Any]] | None = None,
) -> None:
    """`consume` with typed, concurrent handling (see `Handling`); waits for the handlers in
    flight before returning. Meanwhile the consumer's lag is polled (`watch_lag`). `renew`: how
    to make the consumer again when it is gone (`bus.renewing`)."""
    lag = asyncio.create_task(watch_lag(sub, handling.consumer, stop))
    try:
        await consume(sub, handling.take, stop, handling.log, batch, renew=renew)
    finally:
        lag.cancel()
        await handling.drain()


async def watch_lag(sub: Any, consumer: str, stop: asyncio.Event, every: float | None = None) -> None:
    """Every `every` seconds (LAG_EVERY), the consumer's info from the server, each request
    bounded by LAG_WAIT: its pending, ack-pending and redelivered counts as gauges. A request that
    fails or times out leaves the last values and is tried again next time; never raises."""
    every = LAG_EVERY if every is None else every
    while not stop.is_set():
        try:
            info = await asyncio.wait_for(sub.consumer_info(), LAG_WAIT)
            PENDING.labels(consumer).set(info.num_pending or 0)
            ACK_PENDING.labels(consumer).set(info.num_ack_pending or 0)
            REDELIVERING.labels(consumer).set(info.num_redelivered or 0)
        except asyncio.CancelledError:
            raise
        except Exception:
            pass  # the bus is down or slow: the health endpoint says so, not this
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
