"""NATS server metrics for Prometheus, read from the servers' monitoring ports (nats-server `-m
PORT` serves JSON: /varz, /jsz), which Prometheus cannot read itself.

One `NatsCollector` polls every server it is given (GET /varz and /jsz, each bounded by a short
timeout) every few seconds and keeps the last answer; a scrape reads that copy, so a slow or dead
server never slows /metrics: it reads `muster_nats_server_up{server} 0`. Hosted in two places:
- `muster up` registers one for its embedded server, on its own /metrics;
- compose runs `python -m muster.shared.natsmetrics --monitor http://nats-1:8222,...` as the service
  `nats-exporter` (/metrics and /healthz on port 9100), one for the whole cluster.
Labels: `server` (the monitoring address as given: bounded by the servers configured).

`samples` is pure (the servers' JSON in, samples out)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import httpx
import prometheus_client
import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from muster.shared import settings

log = structlog.get_logger(service="nats-metrics")

POLL_EVERY = settings.seconds("MUSTER_NATS_POLL_EVERY", 5.0, low=0.1)
POLL_TIMEOUT = 2.0  # seconds one request to a server's monitoring port may take

# (metric, kind, help, where in the JSON: ("varz" | "jsz", key path))
METRICS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("muster_nats_server_connections", "gauge", "Client connections open", ("varz", "connections")),
    (
        "muster_nats_server_connections_opened",
        "counter",
        "Client connections ever opened",
        ("varz", "total_connections"),
    ),
    ("muster_nats_server_subscriptions", "gauge", "Subscriptions", ("varz", "subscriptions")),
    ("muster_nats_server_routes", "gauge", "Routes to other servers of the cluster", ("varz", "routes")),
    (
        "muster_nats_server_slow_consumers",
        "counter",
        "Clients dropped as slow consumers",
        ("varz", "slow_consumers"),
    ),
    ("muster_nats_server_in_messages", "counter", "Messages received", ("varz", "in_msgs")),
    ("muster_nats_server_out_messages", "counter", "Messages sent", ("varz", "out_msgs")),
    ("muster_nats_server_in_bytes", "counter", "Bytes received", ("varz", "in_bytes")),
    ("muster_nats_server_out_bytes", "counter", "Bytes sent", ("varz", "out_bytes")),
    ("muster_nats_server_memory_bytes", "gauge", "Resident memory of the server", ("varz", "mem")),
    ("muster_nats_server_cpu_percent", "gauge", "CPU use of the server (100 = one core)", ("varz", "cpu")),
    ("muster_nats_server_jetstream_streams", "gauge", "JetStream streams", ("jsz", "streams")),
    ("muster_nats_server_jetstream_consumers", "gauge", "JetStream consumers", ("jsz", "consumers")),
    ("muster_nats_server_jetstream_messages", "gauge", "Messages stored in JetStream", ("jsz", "messages")),
    ("muster_nats_server_jetstream_bytes", "gauge", "Bytes stored in JetStream", ("jsz", "bytes")),
    (
        "muster_nats_server_jetstream_api_requests",
        "counter",
        "JetStream API requests",
        ("jsz", "api", "total"),
    ),
    (
        "muster_nats_server_jetstream_api_errors",
        "counter",
        "JetStream API requests that failed",
        ("jsz", "api", "errors"),
    ),
)


def _dig(doc: Any, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return float(doc) if isinstance(doc, int | float) and not isinstance(doc, bool) else None


def samples(varz: dict[str, Any], jsz: dict[str, Any] | None) -> dict[str, float]:
    """The metrics of one server from its /varz and /jsz (None: JetStream off or not answered);
    what a server does not report is left out."""
    docs = {"varz": varz, "jsz": jsz or {}}
    out = {}
    for name, _, _, (doc, *path) in METRICS:
        value = _dig(docs[doc], tuple(path))
        if value is not None:
            out[name] = value
    meta = (jsz or {}).get("meta_cluster")
    if isinstance(meta, dict) and meta.get("leader"):
        out["muster_nats_server_jetstream_meta_leader"] = float(meta.get("leader") == varz.get("server_name"))
    return out


class NatsCollector:
    """The last answer of each server (`poll` refreshes them); a scrape never waits on a server."""

    def __init__(self, urls: list[str], timeout: float = POLL_TIMEOUT) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout = timeout
        # server label -> its samples (None: the last poll failed). Replaced whole on each poll,
        # so a scrape from another thread reads one consistent copy.
        self.last: dict[str, dict[str, float] | None] = {self.label(u): None for u in self.urls}

    @staticmethod
    def label(url: str) -> str:
        return urlsplit(url).netloc or url

    async def poll_once(self, client: httpx.AsyncClient) -> None:
        async def one(url: str) -> tuple[str, dict[str, float] | None]:
            try:
                varz = (await client.get(f"{url}/varz")).raise_for_status().json()
                try:
                    jsz = (await client.get(f"{url}/jsz")).raise_for_status().json()
                except (httpx.HTTPError, ValueError):
                    jsz = None
                return self.label(url), samples(varz, jsz)
            except (httpx.HTTPError, ValueError, TypeError, AttributeError):
                return self.label(url), None

        results = await asyncio.gather(*(one(u) for u in self.urls))
        self.last = dict(results)

    async def poll(self, stop: asyncio.Event, every: float = POLL_EVERY) -> None:
        """Refresh every `every` seconds until `stop`; never raises."""
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(self.poll_once(client), self.timeout * 2 + 1)
                except Exception as exc:  # a timeout, or a bug: the servers read as down
                    log.warning("nats_metrics.poll_failed", error=str(exc) or type(exc).__name__)
                    self.last = {self.label(u): None for u in self.urls}
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), every)

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        last = self.last
        up = GaugeMetricFamily(
            "muster_nats_server_up",
            "1 if the server's monitoring port answered the last poll",
            labels=["server"],
        )
        for server, values in sorted(last.items()):
            up.add_metric([server], 0.0 if values is None else 1.0)
        yield up
        described = [
            *METRICS,
            ("muster_nats_server_jetstream_meta_leader", "gauge", "1 on the JetStream meta leader", ()),
        ]
        for name, kind, text, _ in described:
            family: GaugeMetricFamily | CounterMetricFamily
            if kind == "counter":
                family = CounterMetricFamily(name, text, labels=["server"])
            else:
                family = GaugeMetricFamily(name, text, labels=["server"])
            for server, values in sorted(last.items()):
                if values is not None and name in values:
                    family.add_metric([server], values[name])
            yield family


# ---------------------------------------------------------------- the standalone exporter


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.startswith("/metrics"):
            body, ctype = prometheus_client.generate_latest(), prometheus_client.CONTENT_TYPE_LATEST
            status = 200
        elif self.path.startswith("/healthz"):
            body, ctype, status = b"ok\n", "text/plain", 200
        else:
            body, ctype, status = b"not found\n", "text/plain", 404
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


async def _main(urls: list[str], port: int, every: float) -> None:
    collector = NatsCollector(urls)
    prometheus_client.REGISTRY.register(collector)
    server = ThreadingHTTPServer(("0.0.0.0", port), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("nats_metrics.started", servers=urls, port=port)
    try:
        await collector.poll(stop, every)
    finally:
        server.shutdown()


def main() -> None:
    from muster.shared import logs

    p = argparse.ArgumentParser(
        description="Prometheus metrics of NATS servers, from their monitoring ports."
    )
    p.add_argument(
        "--monitor",
        default=os.environ.get("MUSTER_NATS_MONITOR", "http://127.0.0.1:8222"),
        help="comma-separated monitoring URLs (default $MUSTER_NATS_MONITOR or http://127.0.0.1:8222)",
    )
    p.add_argument(
        "--port", type=int, default=settings.number("MUSTER_METRICS_PORT", 9100, int, low=0, high=65535)
    )
    p.add_argument("--every", type=float, default=POLL_EVERY, help="seconds between polls")
    args = p.parse_args()
    logs.configure("nats-exporter")
    urls = [u.strip() for u in args.monitor.split(",") if u.strip()]
    asyncio.run(_main(urls, args.port, args.every))


if __name__ == "__main__":
    main()
