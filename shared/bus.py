"""The bus adapter: connecting to NATS, and the JetStream streams and KV buckets Muster needs.

Every service and the CLI connect through `connect()`; every JetStream resource is declared in
`ensure_jetstream()`, which is idempotent and safe to call from any number of replicas at once.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import nats
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError
from nats.js.kv import KeyValue

from shared import subjects

DEFAULT_URL = "nats://127.0.0.1:4222"
log = structlog.get_logger()


def nats_url() -> str:
    return os.environ.get("MUSTER_NATS_URL", DEFAULT_URL)


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
            subjects=[subjects.SUBMIT],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            max_msg_size=-1,
            duplicate_window=120,
            num_replicas=r,
            description="Job submissions waiting for a validator",
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
    buckets = {}
    for bucket, history in ((subjects.JOBS_BUCKET, 5), (subjects.JOB_NAMES_BUCKET, 1)):
        buckets[bucket] = await _ensure_bucket(js, bucket, history, r)
    return js, buckets


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except BadRequestError as exc:
        # Exists with another config (an older Muster): bring it up to date.
        if exc.err_code == 10058:
            await js.update_stream(config)
        else:
            raise


async def _ensure_bucket(js: JetStreamContext, bucket: str, history: int, r: int) -> KeyValue:
    try:
        return await js.key_value(bucket)
    except Exception:
        pass
    try:
        return await js.create_key_value(
            KeyValueConfig(bucket=bucket, history=history, replicas=r, storage=StorageType.FILE)
        )
    except BadRequestError:
        return await js.key_value(bucket)  # another replica created it first


def header(msg: Any, name: str) -> str | None:
    return (msg.headers or {}).get(name)
