"""Client side of Muster's protocols, used by the CLI and the tests (and by any program that
submits jobs): publish a config to the submit subject and wait for that submission's verdict;
ask the gateway about jobs, and page through its job list."""

from __future__ import annotations

import asyncio
import getpass
import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NotFoundError

from muster.shared import bus, subjects
from muster.shared.auth import NAME_RE
from muster.shared.subjects import Headers

if TYPE_CHECKING:
    from muster.shared.messages import Verdict


def submitter(nc: NATS) -> str:
    """Who `nc` submits as: its identity's name; on an open bus, this machine's user name."""
    ident = bus.identity(nc)
    if ident is not None:
        return ident.name
    try:
        name = getpass.getuser()
    except Exception:
        return "anonymous"
    return name if NAME_RE.match(name) else "anonymous"


def asker(nc: NATS) -> str:
    """Who `nc` asks the gateway as: a user sees its own jobs; an admin, or anyone on an open
    bus (where nothing is enforced), every job."""
    ident = bus.identity(nc)
    return ident.name if ident is not None and ident.role != "admin" else subjects.ALL


async def submit(
    nc: NATS, data: bytes, *, user: str | None = None, timeout: float = 30.0, sid: str | None = None
) -> tuple[str, Verdict | None]:
    """Submit one config as `user` (default `submitter(nc)`: with authentication on, the server
    lets an identity submit only as itself); returns (submission id, verdict or None if none
    came within `timeout`).

    Raises `bus.NotSetUp` if Muster's streams are still missing after `timeout` (services
    starting): a client never creates or changes them.
    The verdict subscription is made before publishing, so another client's verdict is never
    taken for ours and ours cannot be missed; the gateway's copy from the MUSTER_EVENTS stream
    is the fallback if it was published while the connection was down."""
    sid, verdict = await submit_json(nc, data, user=user, timeout=timeout, sid=sid)
    return sid, _model(verdict)


async def submit_json(
    nc: NATS, data: bytes, *, user: str | None = None, timeout: float = 30.0, sid: str | None = None
) -> tuple[str, dict[str, Any] | None]:
    """`submit`, with the verdict as the validator's JSON: it imports no model (pydantic is most
    of a CLI's start-up), for `muster submit`."""
    user = user or submitter(nc)
    sid = sid or uuid.uuid4().hex
    deadline = asyncio.get_running_loop().time() + timeout
    sub = await nc.subscribe(subjects.verdict(user, sid))
    try:
        if bus.identity(nc) is None:
            await bus.open_jetstream(nc, wait=timeout)
        await bus.publish_once(
            nc.jetstream(timeout=10),
            subjects.submit(user),
            data,
            f"{user}:{sid}:{hashlib.sha256(data).hexdigest()[:16]}",
            headers={Headers.SUBMISSION_ID: sid},
        )
        left = deadline - asyncio.get_running_loop().time()
        return sid, await _wait_verdict(nc, sub, sid, left, user)
    finally:
        await sub.unsubscribe()


async def wait_verdict(
    nc: NATS, sub: Subscription, sid: str, timeout: float, user: str | None = None
) -> Verdict | None:
    """The verdict on submission `sid`, from `sub` (its subject) or else the stored copy."""
    return _model(await _wait_verdict(nc, sub, sid, timeout, user or submitter(nc)))


async def stored_verdict(nc: NATS, sid: str, user: str | None = None) -> Verdict | None:
    """The verdict kept in MUSTER_EVENTS, read through the gateway (users may not read streams)."""
    return _model(await _stored_verdict(nc, sid, user or submitter(nc)))


def _model(verdict: dict[str, Any] | None) -> Verdict | None:
    from muster.shared.messages import Verdict

    return None if verdict is None else Verdict.model_validate(verdict)


def _verdict_json(data: bytes | None) -> dict[str, Any] | None:
    """A verdict's JSON, or None for anything that is not one (it is then ignored)."""
    try:
        verdict = json.loads(data or b"")
    except ValueError:
        return None
    return verdict if isinstance(verdict, dict) and isinstance(verdict.get("accepted"), bool) else None


async def _wait_verdict(
    nc: NATS, sub: Subscription, sid: str, timeout: float, user: str
) -> dict[str, Any] | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        try:
            msg = await sub.next_msg(timeout=min(2.0, max(0.05, deadline - loop.time())))
            verdict = _verdict_json(msg.data)
            if verdict is not None:
                return verdict
            continue
        except NatsTimeout:
            pass
        verdict = await _stored_verdict(nc, sid, user)
        if verdict is not None:
            return verdict
    return None


async def _stored_verdict(nc: NATS, sid: str, user: str) -> dict[str, Any] | None:
    try:
        if bus.identity(nc) is None:
            stored = await nc.jetstream(timeout=5).get_last_msg(
                subjects.EVENTS_STREAM, subjects.verdict(user, sid), direct=True
            )
            return _verdict_json(stored.data)
        answer = await ask(nc, "verdict", {"sid": sid}, user)
    except NotFoundError:
        return None
    except Exception:
        await asyncio.sleep(0.2)  # reconnecting, or the gateway is away: the caller asks again
        return None
    verdict = answer.get("verdict")
    return verdict if isinstance(verdict, dict) else None


class Refused(Exception):
    """The gateway (or the server) refused a question; `code` is the CLI's exit code."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


async def ask(
    nc: NATS, verb: str, request: dict[str, Any] | None = None, who: str | None = None, timeout: float = 10.0
) -> dict[str, Any]:
    """Ask the gateway (as `who`, default `asker(nc)`); raises `Refused` with its reason, or
    with the server's when this identity may not ask that, and `TimeoutError` if none answers."""
    who = who or asker(nc)
    try:
        msg = await nc.request(subjects.api(who, verb), json.dumps(request or {}).encode(), timeout=timeout)
    except NoRespondersError:
        raise TimeoutError("no gateway answers (is `muster up`, or the gateway service, running?)") from None
    except NatsTimeout:
        refused = bus.refusals(nc)
        if refused:
            raise Refused(f"not allowed: {refused[-1].removeprefix('nats: ')}", 1) from None
        raise TimeoutError(f"the gateway did not answer within {timeout:g}s") from None
    try:
        answer = json.loads(msg.data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise Refused(f"the gateway's answer to {verb!r} is not a JSON object: {msg.data[:80]!r}", 1)
    if "error" in answer:
        code = answer.get("code", 2)
        code = code if type(code) is int and 1 <= code <= 125 else 1  # an exit status
        raise Refused(str(answer["error"])[:2000], code)
    return answer


async def job_pages(
    nc: NATS, limit: int | None = None, page: int = 100, who: str | None = None, **filters: Any
) -> AsyncIterator[dict[str, Any]]:
    """The gateway's job list (`jobs`), newest first, page by page: each page as the gateway
    answers it (`jobs`, `next`; the first also `counts` and `total`), following `next` until
    there is none or `limit` jobs came. `filters`: state (a list), user, vc, name, since, until
    (ISO times with a zone). Raises as `ask` does."""
    got, cursor = 0, None
    while limit is None or got < limit:
        size = page if limit is None else min(page, limit - got)
        request = {k: v for k, v in filters.items() if v is not None} | {"limit": size}
        if cursor is not None:
            request["cursor"] = cursor
        answer = await ask(nc, "jobs", request, who)
        got += len(answer["jobs"])
        yield answer
        cursor, before = answer.get("next"), cursor
        if not cursor or not answer["jobs"] or cursor == before:  # (a page that does not move on)
            return
