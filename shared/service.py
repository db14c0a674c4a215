"""Running a long-lived service: connection, health and metrics endpoint, signals, and exit codes.

A service is an object with `async run(stop: asyncio.Event)`. `main()` connects it to NATS
(reconnecting forever), serves `/healthz` (200 only while the NATS connection is up) and
`/metrics` (Prometheus), stops cleanly on SIGTERM/SIGINT, and exits non-zero when the service
fails, so a supervisor (compose, systemd, `muster up`) sees it and restarts it.

A connection the server closed for good (nats-py does not reconnect after most server errors)
is a failure too: the service is stopped at once (given CLOSED_GRACE seconds to wind down) and
`run_service` raises, so the process exits 1 (`muster up` restarts that service) instead of
living on with no bus. A bad setting in the environment (shared/settings.py) is one line on
stderr and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import signal
import sys
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

import prometheus_client
import structlog
from nats.aio.client import Client as NATS
from prometheus_client.core import CounterMetricFamily

from muster.shared import auth, bus, logs, settings

NATS_CONNECTED = prometheus_client.Gauge(
    "muster_nats_connected", "1 while this service's NATS connection is up", ["service"]
)
NATS_CLOSED = prometheus_client.Gauge(
    "muster_nats_closed",
    "1 once this service's NATS connection was closed for good by the server (it then exits)",
    ["service"],
)
CLOSED_GRACE = 5.0  # seconds a service whose connection was closed for good has to stop


class BusCollector:
    """`muster_nats_reconnects_total{service}`: read on scrape from the connection's own count
    (nats-py's `stats`), for every service connected in this process (`muster up` runs several)."""

    def __init__(self) -> None:
        self.clients: weakref.WeakValueDictionary[str, NATS] = weakref.WeakValueDictionary()

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "muster_nats_reconnects",
            "Times this service's NATS connection was re-established",
            labels=["service"],
        )
        for name, nc in sorted(self.clients.items()):
            with contextlib.suppress(Exception):
                family.add_metric([name], float(nc.stats.get("reconnects", 0)))
        yield family


BUS = BusCollector()
prometheus_client.REGISTRY.register(BUS)

# More JSON endpoints beside /healthz and /metrics, by path: a service adds its own (the
# supervisor's /sd/agents). The function is called on each request and must be quick.
ROUTES: dict[str, Callable[[], bytes]] = {}


class Service(Protocol):
    async def run(self, stop: asyncio.Event) -> None: ...


async def serve_health(
    service: str, nc: NATS, port: int, host: str = "0.0.0.0"
) -> asyncio.base_events.Server:
    """A minimal HTTP endpoint: GET /healthz and GET /metrics."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = request.decode("latin-1").split()
            path = parts[1] if len(parts) > 1 else "/"
            NATS_CONNECTED.labels(service).set(1 if nc.is_connected else 0)
            if path.startswith("/metrics"):
                status, ctype = "200 OK", prometheus_client.CONTENT_TYPE_LATEST
                body = prometheus_client.generate_latest()
            elif path.split("?")[0] in ROUTES:
                try:
                    status, ctype, body = "200 OK", "application/json", ROUTES[path.split("?")[0]]()
                except Exception:
                    status, ctype, body = "500 Internal Server Error", "text/plain", b"failed\n"
            elif path.startswith("/healthz"):
                ok = nc.is_connected
                status = "200 OK" if ok else "503 Service Unavailable"
                closed = getattr(nc, "is_closed", False)
                down = b"nats connection closed\n" if closed else b"nats disconnected\n"
                ctype, body = "text/plain", (b"ok\n" if ok else down)
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--nats-url", default=None, help="NATS URL (default $MUSTER_NATS_URL or 4222)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=settings.number("MUSTER_METRICS_PORT", 0, int, low=0, high=65535),
        help="serve /healthz and /metrics on this port (default $MUSTER_METRICS_PORT; 0: off)",
    )
    return p


# Garbage collection of a long-running service process. CPython's defaults (700, 10, 10) make a
# full collection every ~70,000 allocations, and a full collection scans every object the
# service holds (its views, and in a sim process a thousand agents): under bench.bus at 150
# jobs/s, 11 full collections in 25 s in the sim process, scheduler and supervisor, of up to
# 311 ms each: the tail of submit→running. Full collections are made rare (cyclic garbage that
# lives long enough to reach the oldest generation waits for one) and what the build made is
# frozen out of them; young collections stay small (larger ones, 2000/20, paused longer: up to
# 180 ms against 87 ms, three rounds of 150 jobs/s each). Only process entry points tune it
# (`python -m muster.services.<name>`, `muster up`), never a test or library process.
GC_THRESHOLDS = (700, 10, 1000)
_gc_tuned = False


def tune_gc() -> None:
    global _gc_tuned
    gc.set_threshold(*GC_THRESHOLDS)
    _gc_tuned = True


async def run_service(
    name: str,
    build: Callable[[NATS], Awaitable[Service]],
    *,
    url: str | None = None,
    metrics_port: int = 0,
    stop: asyncio.Event | None = None,
    credentials: auth.Credentials | None = None,
) -> None:
    """Connect (as `credentials`, default MUSTER_CREDENTIALS), build and run one service until
    `stop` is set. Raises if the service fails, or (ConnectionError) once its NATS connection
    was closed for good: it is then stopped, given CLOSED_GRACE seconds."""
    log = structlog.get_logger(service=name)
    stop = stop or asyncio.Event()
    nc = await bus.connect(name, url, credentials=credentials)
    BUS.clients[name] = nc
    NATS_CLOSED.labels(name).set(0)
    server = None
    # The service's own stop: `stop`, or its connection gone for good.
    halt = asyncio.Event()
    watch = asyncio.create_task(_halt_when(stop, bus.closed(nc), halt))
    running: asyncio.Future[None] | None = None
    try:
        if metrics_port:
            server = await serve_health(name, nc, metrics_port)
        building = asyncio.ensure_future(build(nc))
        if not await _until_closed(nc, building):
            building.cancel()
            await asyncio.wait([building])
            raise ConnectionError(f"{name}: the NATS connection was closed while starting: {_why(nc)}")
        service = building.result()
        if _gc_tuned:
            gc.freeze()  # what the build made lives as long as the service: never scanned again
        log.info("service.started", nats=nc.connected_url.geturl() if nc.connected_url else None)
        running = asyncio.ensure_future(service.run(halt))
        await _until_closed(nc, running)
        if not running.done():  # the connection is gone: the service has a moment to stop
            await asyncio.wait([running], timeout=CLOSED_GRACE)
        if nc.is_closed and not stop.is_set():
            NATS_CLOSED.labels(name).set(1)
            NATS_CONNECTED.labels(name).set(0)
            raise ConnectionError(f"{name}: the NATS connection was closed: {_why(nc)}")
        running.result()  # the service's own failure, if any
        log.info("service.stopped")
    finally:
        watch.cancel()
        if running is not None and not running.done():
            running.cancel()
            await asyncio.wait([running])
        if server:
            server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 5)


async def _halt_when(stop: asyncio.Event, gone: asyncio.Event, halt: asyncio.Event) -> None:
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(gone.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        halt.set()
    finally:
        for w in waits:
            w.cancel()


async def _until_closed(nc: NATS, work: asyncio.Future[Any]) -> bool:
    """Wait for `work` to be done (True) or `nc` to be closed for good (False, `work` left as
    it is). Cancelled, it cancels `work`."""
    gone = asyncio.ensure_future(bus.closed(nc).wait())
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        gone.cancel()
    return work.done()


def _why(nc: NATS) -> str:
    err = nc.last_error
    return (str(err) or type(err).__name__) if err else "closed by the server"


def main(name: str, build: Callable[[NATS], Awaitable[Service]], description: str) -> None:
    """Entry point of `python -m muster.services.<name>`."""
    run_main(name, lambda: build, base_parser(description).parse_args())


def run_main(
    name: str, make_build: Callable[[], Callable[[NATS], Awaitable[Service]]], args: argparse.Namespace
) -> None:
    """Run one service until SIGTERM/SIGINT; exit 1 if it fails. `make_build` runs after logging
    is configured, so what it logs (inventory discovery, runtime choice) is JSON too."""
    log = logs.configure(name)
    tune_gc()

    async def amain() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run_service(name, make_build(), url=args.nats_url, metrics_port=args.metrics_port, stop=stop)

    try:
        asyncio.run(amain())
    except settings.SettingError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        sys.exit(2)
    except ConnectionError as exc:  # no NATS, or the connection closed for good: no traceback
        log.error("service.failed", error=str(exc) or type(exc).__name__)
        sys.exit(1)
    except Exception as exc:
        log.error("service.failed", error=str(exc) or type(exc).__name__, exc_info=True)
        sys.exit(1)
