"""`muster up`: the embedded mesh — a nats-server with JetStream (unless joining one) and every
service built so far, each supervised in this process: a service that fails is logged and
restarted with backoff, so nothing dies silently. Ctrl-C stops everything it started.

The embedded server requires authentication (shared/auth.py): `muster up` keeps an auth
directory in its data dir with an identity per service, one for the local agent, and an admin
identity named after this machine's user, and leaves a note (in $XDG_STATE_HOME/muster/up/) by
which the CLI on this machine finds that admin identity for this bus with no setup."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import os
import signal
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client as NATS

from shared import auth, bus, settings
from shared.natsserver import NatsServer, free_port
from shared.service import Service, run_service, serve_health

log = structlog.get_logger(service="mesh")

Builder = Callable[[NATS], Awaitable[Service]]


def builders() -> dict[str, Builder]:
    """Every service of the mesh (auth.SERVICES), imported only here: the CLI reads this module's
    notes (`local_identity`) on every command, and must not pay for the services' imports."""
    from services.gateway.service import Gateway
    from services.registry.service import Registry
    from services.scheduler.service import Scheduler
    from services.supervisor.service import Supervisor
    from services.validator.service import Validator

    return {
        "validator": Validator.build,
        "scheduler": Scheduler.build,
        "registry": Registry.build,
        "supervisor": Supervisor.build,
        "gateway": Gateway.build,
    }


def _state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "muster" / "up"


def _note(url: str) -> Path:
    """Where `muster up` serving `url` notes its local identity (one note per host and port)."""
    u = urllib.parse.urlsplit(url.split(",")[0].strip())
    return _state_dir() / f"{u.hostname or '127.0.0.1'}_{u.port or 4222}.json"


def local_identity(url: str | None = None) -> auth.Credentials | None:
    """The local admin identity of the `muster up` serving `url` (default MUSTER_NATS_URL)."""
    note = _note(url or bus.nats_url())
    try:
        path = json.loads(note.read_text())["credentials"]
        return auth.load_credentials(path)
    except (OSError, ValueError, KeyError, TypeError, auth.AuthError):
        return None


def local_note(url: str | None = None) -> dict[str, Any]:
    """What the `muster up` serving `url` noted: its admin credentials, auth dir, server pid."""
    try:
        doc = json.loads(_note(url or bus.nats_url()).read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def local_user() -> str:
    try:
        name = getpass.getuser()
    except Exception:
        name = "admin"
    return name if auth.NAME_RE.match(name) and name not in auth.SERVICES else "admin"


def default_data_dir() -> Path:
    base = os.environ.get("MUSTER_DATA_DIR") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "muster"
    )
    return Path(base)


async def supervise(
    name: str, build: Builder, url: str, stop: asyncio.Event, credentials: auth.Credentials | None = None
) -> None:
    delay = 0.5
    while not stop.is_set():
        try:
            await run_service(name, build, url=url, stop=stop, credentials=credentials)
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
    agent: Callable[[int | None], Builder] | None = None,
    node: str | None = None,
    open_bus: bool = False,
    sim: bool = False,
    metrics_port: int | None = None,
) -> int:
    """Run the mesh until SIGTERM/SIGINT. `node`: the local agent's node name (its identity);
    `sim`: the agent is a process of simulated nodes, as the one sim identity (it can act as any
    node: a benchmark's, see shared/auth.py); `open_bus`: an embedded server without
    authentication (anyone who reaches it may do anything). `metrics_port`: /metrics and /healthz
    of everything in this process, and of the embedded server (read from its monitoring port);
    None: MUSTER_METRICS_PORT, else 9100 or a free port; 0: off."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    server, note = None, None
    creds: dict[str, auth.Credentials | None] = {}
    url = os.environ.get("MUSTER_NATS_URL")
    if url:
        announce(f"joining NATS at {bus.shown(url)}")
        auth_dir = os.environ.get("MUSTER_AUTH_DIR")
        if auth_dir:  # an auth dir made for that bus: each service as itself
            keys = auth.AuthDir(auth_dir)
            creds = {n: auth.load_credentials(keys.creds(n)) for n in auth.SERVICES}
            if node is not None:
                name = auth.SIM_IDENTITY if sim else auth.agent_name(node)
                creds["agent"] = auth.load_credentials(keys.creds(name))
    else:
        keys = auth.AuthDir(data_dir / "auth")
        admin = None
        if not open_bus:
            creds = dict(keys.ensure_services())
            if sim:
                creds["agent"] = keys.ensure(auth.SIM_IDENTITY, "sim")
            elif node is not None:
                creds["agent"] = keys.ensure(auth.agent_name(node), "agent", node)
            admin = keys.ensure(local_user(), "admin")
        cert, key = os.environ.get("MUSTER_TLS_SERVER_CERT"), os.environ.get("MUSTER_TLS_SERVER_KEY")
        server = NatsServer(
            data_dir / "nats",
            port=port or free_port(4222),
            auth_config=None if open_bus else keys.server_config,
            tls={"cert_file": cert, "key_file": key} if cert and key else None,
            monitor_port=free_port(8222),
        )
        server.start()  # from the main thread: the server dies with us (see NatsServer)
        url = server.url
        announce(f"NATS: {url} (JetStream data in {server.data_dir})")
        if port is None and server.port != 4222:
            announce(f"4222 was busy; in other shells: export MUSTER_NATS_URL={url}")
        if admin is not None:
            note = _note(url)
            note.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            assert server.proc is not None
            doc = {
                "credentials": str(keys.creds(admin.name)),
                "auth_dir": str(keys.path),
                "pid": server.proc.pid,
            }
            note.write_text(json.dumps(doc))
            announce(
                f"NATS requires credentials: the CLI on this machine acts as admin {admin.name!r} "
                f"({keys.creds(admin.name)}); add a user with `muster admin user add NAME` and "
                "give them the file it writes (MUSTER_CREDENTIALS=FILE)"
            )
        creds["muster-up"] = admin
    if metrics_port is None:
        metrics_port = settings.number("MUSTER_METRICS_PORT", -1, int, low=0, high=65535)  # unset: -1
        if metrics_port < 0:
            metrics_port = free_port(9100, "0.0.0.0")
    health, poll, nc = None, None, None
    try:
        # Fail fast on a bad URL or an unusable JetStream, before starting the services.
        nc = await bus.connect("muster-up", url, connect_timeout=15, credentials=creds.get("muster-up"))
        await bus.ensure_jetstream(nc)
        if metrics_port:  # the connection stays open: /healthz says whether it is up
            health = await serve_health("muster-up", nc, metrics_port)
            announce(f"metrics: http://127.0.0.1:{metrics_port}/metrics")
            if server is not None and server.monitor_port:
                poll = _nats_metrics(server, stop)
        else:
            await nc.close()
        services = builders()
        if agent is not None:
            services["agent"] = agent(metrics_port or None)  # its node record tells the port
        tasks = [asyncio.create_task(supervise(n, b, url, stop, creds.get(n))) for n, b in services.items()]
        announce(f"services: {', '.join(services)} — Ctrl-C to stop")
        watch = asyncio.create_task(_watch_server(server, stop))
        await stop.wait()
        announce("stopping")
        _, pending = await asyncio.wait(tasks, timeout=10)
        for t in pending:
            t.cancel()
        watch.cancel()
        if poll is not None:
            poll.cancel()
        if server and server.proc and server.proc.returncode not in (None, 0):
            return 1
        return 0
    finally:
        if health is not None:
            health.close()
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5)
        if note is not None:
            note.unlink(missing_ok=True)
        if server:
            await asyncio.to_thread(server.stop)


def _nats_metrics(server: NatsServer, stop: asyncio.Event) -> asyncio.Task[None]:
    """The embedded server's metrics (shared/natsmetrics.py) on this process's /metrics."""
    import prometheus_client

    from shared.natsmetrics import NatsCollector

    collector = NatsCollector([f"http://{server.host}:{server.monitor_port}"])
    prometheus_client.REGISTRY.register(collector)  # type: ignore[arg-type]

    async def poll() -> None:
        try:
            await collector.poll(stop)
        finally:
            prometheus_client.REGISTRY.unregister(collector)  # type: ignore[arg-type]

    return asyncio.create_task(poll())


async def _watch_server(server: NatsServer | None, stop: asyncio.Event) -> None:
    """If the embedded nats-server dies, everything stops with an error instead of hanging."""
    if server is None or server.proc is None:
        return
    await asyncio.to_thread(server.proc.wait)
    log.error("nats_server.exited", code=server.proc.returncode, log=str(server.log_file))
    stop.set()
