"""The pipeline's floor: what a chain of bare JetStream hops sustains on this machine.

    python -m bench.chain [--hops 4] [--rates 500,1000,2000] [--seconds 10]

A job reaches `running` through four services in turn, each taking it from JetStream and
writing the next step back (validator: submission → job record; scheduler: → the node's order;
agent: → task running; supervisor: → the job's `running` event). This bench keeps only that
shape and drops all the work: N processes, each a durable pull consumer on its own stream
(`bus.Puller`, as the services read), publishing every message it takes to the next stream
(acks awaited together, a batch at a time) and acking it; the last publishes a plain NATS
message that this driver, which offered job-sized messages open-loop at each rate, times.

What it sustains is the most any design with that many JetStream hops per job can reach here,
with these client libraries, before it does anything at all. `bench.bus` runs it beside its
figures on the same server; alone it starts its own.

Prints a table, then one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

from bench.cluster import cpu_seconds
from muster.shared import auth, bus
from muster.shared.natsserver import NatsServer, die_with_parent

DONE = "bench.chain.done"
NUMBERS = itertools.count()


def stream(i: int) -> str:
    return f"BENCH_CHAIN_{i}"


def subject(i: int) -> str:
    return f"bench.chain.{i}"


async def hop(i: int, last: bool) -> None:
    """Take from stream i, hand each message on (to stream i+1, or DONE when last), ack it."""
    nc = await bus.connect(f"chain-{i}", quiet=True)
    js = nc.jetstream(timeout=30)
    sub = await js.pull_subscribe(subject(i), durable=f"hop{i}", stream=stream(i))
    puller = bus.Puller(sub, 256)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    while not stop.is_set():
        try:
            msgs = await puller.next()
        except TimeoutError:
            continue
        if last:
            for m in msgs:
                await nc.publish(DONE, m.data)
        else:
            await asyncio.gather(*(js.publish(subject(i + 1), m.data) for m in msgs))
        for m in msgs:
            await m.ack()
    await puller.close()
    await nc.close()


async def prepare(nc: NATS, hops: int) -> None:
    js = nc.jetstream()
    for i in range(hops):
        name = stream(i)
        with contextlib.suppress(Exception):  # none from an earlier run
            await js.delete_stream(name)
        await js.add_stream(StreamConfig(name=name, subjects=[subject(i)], storage=StorageType.FILE))
        await js.add_consumer(name, ConsumerConfig(durable_name=f"hop{i}", ack_policy=AckPolicy.EXPLICIT))


async def offer(nc: NATS, rate: float, seconds: float, size: int, drain: float) -> dict[str, Any]:
    js = nc.jetstream(timeout=30)
    sent: dict[int, float] = {}
    got: dict[int, float] = {}
    arrived = asyncio.Event()

    async def done(msg: Any) -> None:
        n = int(msg.data[:12]) - first
        if n in sent:  # not a straggler of an earlier rate
            got[n] = time.perf_counter()
            arrived.set()

    sub = await nc.subscribe(DONE, cb=done)
    pad = b"x" * max(0, size - 12)
    first = next(NUMBERS) * 10**9  # each offer numbers its messages apart
    pending: set[asyncio.Future[Any]] = set()
    start = time.perf_counter()
    total = int(rate * seconds)
    for n in range(total):
        delay = start + n / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent[n] = time.perf_counter()
        f = asyncio.ensure_future(js.publish(subject(0), b"%012d" % (first + n) + pad))
        pending.add(f)
        f.add_done_callback(pending.discard)
    if pending:
        await asyncio.wait(pending, timeout=30)
    deadline = time.perf_counter() + drain
    while len(got) < total and time.perf_counter() < deadline:
        arrived.clear()
        try:
            await asyncio.wait_for(arrived.wait(), deadline - time.perf_counter())
        except TimeoutError:
            break
    await sub.unsubscribe()
    lat = sorted((got[n] - sent[n]) * 1000 for n in got)
    span = max(got.values()) - start if got else 0.0

    def pct(q: float) -> float | None:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))], 1) if lat else None

    return {
        "offered_per_s": rate,
        "sent": total,
        "through": len(got),
        "sustained_per_s": round(len(got) / span, 1) if span else 0.0,
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "max_ms": pct(1.0),
    }


async def measure(
    url: str,
    creds: Path | None,
    hops: int,
    rates: list[float],
    seconds: float,
    size: int,
    workdir: Path,
    server_pid: int | None = None,
) -> dict[str, Any]:
    """Start `hops` hop processes against the server at `url`, offer each rate in turn, and
    report what came through and the CPU burned: by the hops together, by this driver, and by
    nats-server (`server_pid`; on a shared server that includes whatever else it serves)."""
    credentials = auth.load_credentials(creds) if creds else None
    nc = await bus.connect("bench-chain", url, credentials=credentials, quiet=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        await prepare(nc, hops)
        env = {**os.environ, "MUSTER_NATS_URL": url, "PYTHONUNBUFFERED": "1"}
        if creds:
            env["MUSTER_CREDENTIALS"] = str(creds)
        for i in range(hops):
            out = open(workdir / f"chain-{i}.log", "wb")  # noqa: SIM115, ASYNC230 (the child keeps it)
            args = [sys.executable, "-m", "bench.chain", "--hop", str(i)] + (
                ["--last"] if i == hops - 1 else []
            )
            procs.append(
                subprocess.Popen(  # noqa: ASYNC220 (started once, before the clock)
                    args, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
                )
            )
        await asyncio.sleep(1.0)
        # A warm-up, so every hop has connected and asked before the clock starts.
        await offer(nc, 50, 1, size, 10)
        rows = []
        for rate in rates:
            groups = {"hops": [p.pid for p in procs], "driver": [os.getpid()]}
            if server_pid:
                groups["nats-server"] = [server_pid]
            cpu0, t0 = {k: sum(map(cpu_seconds, v)) for k, v in groups.items()}, time.monotonic()
            row = await offer(nc, rate, seconds, size, 10)
            elapsed = time.monotonic() - t0
            used = {k: sum(map(cpu_seconds, v)) - cpu0[k] for k, v in groups.items()}
            row["cpu_percent"] = {k: round(100 * v / elapsed, 1) for k, v in used.items()}
            # Per message through all hops: what Muster's CPU per job is set beside, with and
            # without this driver (Muster's figure leaves its own load generator out).
            through = max(1, row["through"])
            bare = used["hops"] + used.get("nats-server", 0.0)
            row["cpu_ms_per_message"] = {
                "hops_and_server": round(1000 * bare / through, 3),
                "with_driver": round(1000 * (bare + used["driver"]) / through, 3),
            }
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a hop exited ({p.returncode}); see {workdir}/chain-*.log")
            rows.append(row)
        return {"hops": hops, "message_bytes": size, "rows": rows}
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
        await nc.close()


def table(report: dict[str, Any]) -> str:
    lines = [
        f"pipeline floor: {report['hops']} bare JetStream hops, each its own process "
        f"({report['message_bytes']} B messages)",
        f"{'offered/s':>9} {'through':>7} {'sustained/s':>11} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"
        "  CPU, % of a core",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['offered_per_s']:>9g} {r['through']:>7} {r['sustained_per_s']:>11} {r['p50_ms']:>8} "
            f"{r['p99_ms']:>8} {r['max_ms']:>8}  "
            + ", ".join(f"{k} {v:g}" for k, v in r["cpu_percent"].items())
            + f"; {r['cpu_ms_per_message']['hops_and_server']:g} ms CPU per message (hops + server)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hops", type=int, default=4)
    p.add_argument("--rates", default="500,1000,2000", help="offered messages/s, comma-separated")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--size", type=int, default=734, help="bytes per message (a job's record on the wire)")
    p.add_argument("--hop", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--last", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.hop is not None:
        asyncio.run(hop(args.hop, args.last))
        return 0
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    with tempfile.TemporaryDirectory(prefix="muster-chain-") as tmp:
        server = NatsServer(Path(tmp) / "nats").start()
        try:
            assert server.proc is not None
            report = asyncio.run(
                measure(
                    server.url, None, args.hops, rates, args.seconds, args.size, Path(tmp), server.proc.pid
                )
            )
        finally:
            server.stop()
    print(table(report))
    print(json.dumps({"bench": "chain", **report}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
