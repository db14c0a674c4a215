"""Running the portal: for a deployment (`python -m muster.services.portal`, compose), and inside
`muster up` / `muster ui` (a local portal whose one person signs in with a one-time link)."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys
from urllib.parse import urlsplit

from aiohttp import web

from muster.services.portal.app import Portal, serve
from muster.shared import bus, logs, settings
from muster.shared.auth import Credentials
from muster.shared.logins import Logins, Sessions

DEFAULT_PORT = 8480


async def nats_reachable(url: str, timeout: float = 2.0) -> bool:
    """Whether any server of `url` accepts a TCP connection (the portal's health: it holds no
    bus connection of its own, only those of the people signed in)."""
    for server in url.split(","):
        parts = urlsplit(server.strip() if "://" in server else f"nats://{server.strip()}")
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname, parts.port or 4222), timeout
            )
        except (OSError, TimeoutError, ValueError):
            continue
        writer.close()
        return True
    return False


def local_portal(url: str, local: Credentials | None, logins: Logins | None = None) -> tuple[Portal, str]:
    """A portal for this machine's person: their credentials (None on an open bus), a one-time
    sign-in token, sessions sealed with a key that lives as long as the process; `./` in a
    config is taken to be the directory it runs in (as `muster up`'s data roots are)."""
    token = secrets.token_urlsafe(24)
    portal = Portal(
        url,
        Sessions(os.urandom(32)),
        logins=logins,
        local=local,
        token=token,
        open_bus=local is None,
        base=os.getcwd(),
    )
    return portal, token


def main() -> None:
    log = logs.configure("portal")
    try:
        port = settings.number("MUSTER_PORTAL_PORT", DEFAULT_PORT, int, low=1, high=65535)
    except settings.SettingError as exc:
        print(f"portal: {exc}", file=sys.stderr)
        sys.exit(2)
    host = os.environ.get("MUSTER_PORTAL_HOST", "0.0.0.0")
    url = bus.nats_url()
    logins = Logins(os.environ.get("MUSTER_AUTH_DIR", "/auth"))
    try:
        key = logins.portal_key()
    except OSError as exc:
        print(
            f"portal: no session key in {logins.path} ({exc.strerror}): run `muster admin keys`",
            file=sys.stderr,
        )
        sys.exit(2)
    secure = os.environ.get("MUSTER_PORTAL_SECURE_COOKIE", "") in ("1", "true", "yes")
    portal = Portal(url, Sessions(key), logins=logins, secure_cookie=secure)

    async def health(request: web.Request) -> web.Response:
        if await nats_reachable(url):
            return web.Response(text="ok\n")
        return web.Response(text="nats unreachable\n", status=503)

    portal.health = health  # type: ignore[method-assign]

    async def amain() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        runner = await serve(portal, host, port, reuse_port=True)
        log.info("portal.serving", url=f"http://{host}:{port}/", nats=bus.shown(url))
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(amain())
    except OSError as exc:
        log.error("portal.failed", error=str(exc))
        sys.exit(1)
