"""Client side of the submit protocol, used by the CLI and the tests (and by any program that
submits jobs): publish a config to the submit subject and wait for that submission's verdict."""

from __future__ import annotations

import asyncio
import hashlib
import uuid

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NotFoundError

from shared import bus, subjects
from shared.messages import Verdict
from shared.subjects import Headers


async def submit(
    nc: NATS, data: bytes, *, user: str = "anonymous", timeout: float = 30.0, sid: str | None = None
) -> tuple[str, Verdict | None]:
    """Submit one config; returns (submission id, verdict or None if none came within `timeout`).

    Raises `bus.NotSetUp` if Muster's streams are still missing after `timeout` (services
    starting): a client never creates or changes them.
    The verdict subscription is made before publishing, so another client's verdict is never
    taken for ours and ours cannot be missed; the MUSTER_EVENTS stream is the fallback if it was
    published while the connection was down."""
    sid = sid or uuid.uuid4().hex
    deadline = asyncio.get_running_loop().time() + timeout
    sub = await nc.subscribe(subjects.verdict(sid))
    try:
        await bus.open_jetstream(nc, wait=timeout)
        await nc.jetstream(timeout=10).publish(
            subjects.SUBMIT,
            data,
            headers={
                Headers.SUBMISSION_ID: sid,
                Headers.USER: user,
                Headers.MSG_ID: f"{sid}:{hashlib.sha256(data).hexdigest()[:16]}",
            },
        )
        return sid, await wait_verdict(nc, sub, sid, deadline - asyncio.get_running_loop().time())
    finally:
        await sub.unsubscribe()


async def wait_verdict(nc: NATS, sub: Subscription, sid: str, timeout: float) -> Verdict | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            msg = await sub.next_msg(timeout=min(2.0, max(0.05, deadline - loop.time())))
            return Verdict.from_bytes(msg.data)
        except NatsTimeout:
            pass
        verdict = await stored_verdict(nc, sid)
        if verdict is not None:
            return verdict
    return None


async def stored_verdict(nc: NATS, sid: str) -> Verdict | None:
    try:
        stored = await nc.jetstream(timeout=5).get_last_msg(subjects.EVENTS_STREAM, subjects.verdict(sid))
    except NotFoundError:
        return None
    except Exception:
        await asyncio.sleep(0.2)  # reconnecting: the caller asks again
        return None
    return Verdict.from_bytes(stored.data)
