"""The bus adapter: connecting to NATS, and the JetStream streams and KV buckets Muster needs.

Every service and the CLI connect through `connect()`; every JetStream resource is declared in
`ensure_jetstream()`, which is idempotent and safe to call from any number of replicas at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared import subjects

M = TypeVar("M")
DEFAULT_URL = "nats://127.0.0.1:4222"
LEASE_TTL = 4.0  # seconds a leader's lease lives without renewal
LOGS_MAX_BYTES = int(os.environ.get("MUSTER_LOGS_MAX_BYTES", str(1 << 30)))
log = structlog.get_logger()


def nats_url() -> str:
    return os.environ.get("MUSTER_NATS_URL", DEFAULT_URL)


def node_timeout() -> float:
    """Seconds without a heartbeat after which a node is lost (supervisor) and gets no work (scheduler)."""
    return float(os.environ.get("MUSTER_NODE_TIMEOUT", "5"))


def replicas() -> int:
    """JetStream replicas for every stream and bucket: 1 on one machine, 3 on a NATS cluster."""
    return int(os.environ.get("MUSTER_JS_REPLICAS", "1"))


async def connect(
    name: str,
    url: str | None = None,
    *,
    connect_timeout: float | None = None,
    quiet: bool = False,
) -> NATS:
    """Connect, retrying the first connection for up to `connect_timeout` seconds, then reconnect
    forever. Each disconnect and reconnect is logged; raises `ConnectionError` if never connected."""
    url = url or nats_url()
    if connect_timeout is None:
        connect_timeout = float(os.environ.get("MUSTER_CONNECT_TIMEOUT", "30"))
    logger = log.bind(component=name, url=url)

    client: list[NATS] = []

    async def disconnected() -> None:
        closing = client and (client[0].is_closed or client[0].is_draining)
        if not quiet and not closing:
            logger.warning("nats.disconnected")

    async def reconnected() -> None:
        if not quiet:
            logger.info("nats.reconnected")

    async def error(exc: Exception) -> None:
        if not quiet:
            logger.warning("nats.error", error=str(exc) or type(exc).__name__)

    # With unlimited reconnects nats-py retries the first connection forever: bound it here.
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                servers=url.split(","),
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=2,
                ping_interval=5,
                max_outstanding_pings=3,
                disconnected_cb=disconnected,
                reconnected_cb=reconnected,
                error_cb=error,
                allow_reconnect=True,
            ),
            connect_timeout,
        )
    except TimeoutError:
        raise ConnectionError(f"cannot reach NATS at {url} within {connect_timeout:g}s") from None
    client.append(nc)
    return nc


async def ensure_jetstream(nc: NATS) -> tuple[JetStreamContext, dict[str, KeyValue]]:
    """Create (or update) every stream and bucket. Returns the JetStream context and the buckets."""
    js = nc.jetstream(timeout=5)
    r = replicas()
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.SUBMISSIONS_STREAM,
            subjects=[subjects.SUBMIT, subjects.KILL],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            max_msg_size=-1,
            duplicate_window=120,
            num_replicas=r,
            description="User requests: job submissions (validator) and kill requests (supervisor)",
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.EVENTS_STREAM,
            subjects=[subjects.EVENTS_PREFIX + ".>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=30 * 24 * 3600,
            duplicate_window=120,
            num_replicas=r,
            description="Audit trail: submission verdicts and every job's history",
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.COMMANDS_STREAM,
            subjects=[subjects.NODE_COMMANDS_PREFIX + ".>"],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=120,
            num_replicas=r,
            description="Orders for node agents (assign, kill), one durable consumer per node",
        ),
    )
    await _ensure_stream(
        js,
        StreamConfig(
            name=subjects.LOGS_STREAM,
            subjects=[subjects.LOGS_PREFIX + ".>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=7 * 24 * 3600,
            max_bytes=LOGS_MAX_BYTES,
            num_replicas=r,
            description="Task output, one subject per task: outlives containers and retries",
        ),
    )
    buckets = {}
    for bucket, history, ttl in (
        (subjects.JOBS_BUCKET, 5, 0),
        (subjects.JOB_NAMES_BUCKET, 1, 0),
        (subjects.NODES_BUCKET, 1, 0),
        (subjects.ATTEMPTS_BUCKET, 5, 0),
        (subjects.RENDEZVOUS_BUCKET, 1, 0),
        (subjects.LEASES_BUCKET, 1, LEASE_TTL),
    ):
        buckets[bucket] = await _ensure_bucket(js, bucket, history, r, ttl)
    return js, buckets


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except BadRequestError as exc:
        if exc.err_code != 10058:
            raise
        # It exists with another config (an older Muster, or made with other settings): bring
        # its subjects and limits up to date, but never change how many replicas it has, so a
        # client without MUSTER_JS_REPLICAS cannot shrink a cluster's streams.
        current = await js.stream_info(config.name)
        config.num_replicas = current.config.num_replicas
        await js.update_stream(config)


async def _ensure_bucket(js: JetStreamContext, bucket: str, history: int, r: int, ttl: float) -> KeyValue:
    try:
        return await js.key_value(bucket)
    except Exception:
        pass
    try:
        return await js.create_key_value(
            KeyValueConfig(
                bucket=bucket, history=history, replicas=r, storage=StorageType.FILE, ttl=ttl or None
            )
        )
    except BadRequestError:
        return await js.key_value(bucket)  # another replica created it first


def header(msg: Any, name: str) -> str | None:
    return (msg.headers or {}).get(name)


async def cas_update(
    kv: KeyValue, key: str, decode: Callable[[bytes], M], change: Callable[[M], M | None]
) -> M | None:
    """Read-modify-write of one KV record with the revision read, retried until no other writer
    got in between. `change` returns the new record, or None to leave it as it is."""
    while True:
        entry = await kv.get(key)
        updated = change(decode(entry.value))
        if updated is None:
            return None
        try:
            await kv.update(key, updated.to_bytes(), last=entry.revision)
            return updated
        except KeyWrongLastSequenceError:
            continue


async def durable(
    js: JetStreamContext, subject: str, name: str, stream: str, **settings: Any
) -> JetStreamContext.PullSubscription:
    """The durable pull consumer `name`, shared by every replica that uses it: explicit acks,
    redelivery after 30 s without one, never given up on. `settings` add to that."""
    config = ConsumerConfig(
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=30,
        max_deliver=-1,
        **settings,
    )
    return await js.pull_subscribe(subject, durable=name, stream=stream, config=config)


def acked(handle: Callable[[Msg], Awaitable[None]], logger: Any) -> Callable[[Msg], Awaitable[None]]:
    """Wrap a handler: ack once it returns; on an error, log it and have the message redelivered."""

    async def run(msg: Msg) -> None:
        try:
            await handle(msg)
            await msg.ack()
        except Exception:
            logger.error("handler.failed", subject=msg.subject, exc_info=True)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1)

    return run


async def consume(
    sub: Any, handle: Callable[[Any], Awaitable[None]], stop: asyncio.Event, logger: Any, batch: int = 64
) -> None:
    """Pull from a durable consumer and handle each message until `stop`. A fetch that fails
    (disconnected, server restarting) is logged once per outage and retried; nats-py resumes the
    subscription after a reconnect."""
    failing = False
    while not stop.is_set():
        try:
            msgs = await sub.fetch(batch, timeout=1)
        except (nats.errors.TimeoutError, TimeoutError):
            continue
        except Exception as exc:
            if not failing:
                logger.warning("consumer.fetch_failed", error=str(exc) or type(exc).__name__)
            failing = True
            await asyncio.sleep(0.5)
            continue
        if failing:
            logger.info("consumer.fetch_restored")
        failing = False
        for msg in msgs:
            await handle(msg)
