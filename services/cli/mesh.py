"""`muster up`: the embedded mesh — a nats-server with JetStream (unless joining one) and every
service built so far, each supervised in this process: a service that fails is logged and
restarted with backoff, so nothing dies silently. Ctrl-C stops everything it started."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog
from nats.aio.client import Client as NATS

from services.registry.service import Registry
from services.scheduler.service import Scheduler
from services.supervisor.service import Supervisor
from services.validator.service import Validator
from shared import bus
from shared.natsserver import NatsServer, free_port
from shared.service import Service, run_service

log = structlog.get_logger(service="mesh")

Builder = Callable[[NATS], Awaitable[Service]]

SERVICES: dict[str, Builder] = {
    "validator": Validator.build,
    "scheduler": Scheduler.build,
    "registry": Registry.build,
    "supervisor": Supervisor.build,
}


def default_data_dir() -> Path:
    base = os.environ.get("MUSTER_DATA_DIR") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "muster"
    )
    return Path(base)


async def supervise(name: str, build: Builder, url: str, stop: asyncio.Event) -> None:
    delay = 0.5
    while not stop.is_set():
        try:
            await run_service(name, build, url=url, stop=stop)
            delay = 0.5
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("service.crashed", name=name, error=str(exc) or type(exc).__name__, exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, 10.0)


async def up(
    data_dir: Path,
    port: int | None,
    announce: Callable[[str], None],
    agent: Callable[[], Builder] | None = None,
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    server = None
    url = os.environ.get("MUSTER_NATS_URL")
    if url:
        announce(f"joining NATS at {bus.shown(url)}")
    else:
        server = NatsServer(data_dir / "nats", port=port or free_port(4222))
        server.start()  # from the main thread: the server dies with us (see NatsServer)
        url = server.url
        announce(f"NATS: {url} (JetStream data in {server.data_dir})")
        if port is None and server.port != 4222:
            announce(f"4222 was busy; in other shells: export MUSTER_NATS_URL={url}")
    try:
        # Fail fast on a bad URL or an unusable JetStream, before starting the services.
        nc = await bus.connect("muster-up", url, connect_timeout=15)
        await bus.ensure_jetstream(nc)
        await nc.close()
        services = dict(SERVICES)
        if agent is not None:
            services["agent"] = agent()
        tasks = [asyncio.create_task(supervise(n, b, url, stop)) for n, b in services.items()]
        announce(f"services: {', '.join(services)} — Ctrl-C to stop")
        watch = asyncio.create_task(_watch_server(server, stop))
        await stop.wait()
        announce("stopping")
        _, pending = await asyncio.wait(tasks, timeout=10)
        for t in pending:
            t.cancel()
        watch.cancel()
        if server and server.proc and server.proc.returncode not in (None, 0):
            return 1
        return 0
    finally:
        if server:
            await asyncio.to_thread(server.stop)


async def _watch_server(server: NatsServer | None, stop: asyncio.Event) -> None:
    """If the embedded nats-server dies, everything stops with an error instead of hanging."""
    if server is None or server.proc is None:
        return
    await asyncio.to_thread(server.proc.wait)
    log.error("nats_server.exited", code=server.proc.returncode, log=str(server.log_file))
    stop.set()
