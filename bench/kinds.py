"""Messages per job by kind: what one job's whole life puts through the server, subject by subject.

    python -m bench.kinds [--nodes 100] [--rate 50] [--seconds 10] [--task-seconds 2]

A fresh mesh (`bench.cluster`), then a tap (its own connection, subscribed to `>`) sees every
message the server routes: clients' publishes, KV writes, JetStream's deliveries, acks, API
requests and replies. Single-task jobs (as `bench.bus` submits them) are offered at `--rate` for
`--seconds`; the tap counts from the first submission until every job has ended, less what it
counted on the idle mesh over as long (measured for `--idle` seconds just before), per ended job,
by kind. Kinds name the subject with its ids left out (`muster.events.job.*.placed`, `kv put
muster_jobs`, `deliver KV_muster_jobs`, `ack MUSTER_EVENTS`...). The tap's own deliveries are not
in the server's counters it prints beside (/connz names it). Prints a table, then one JSON line.

The tap costs CPU, so this bench counts messages only; `bench.bus` measures CPU without it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from bench.bus import Tracker, offer
from bench.cluster import BENCH_USER, Mesh
from muster.shared import bus, subjects

TAP = "bench-tap"
_ID = re.compile(r"\d|^[A-Za-z0-9_-]{20,}$")  # a token that names one thing (job, node, inbox)


def kind(msg: Msg) -> str:
    """The message's kind: its subject with the tokens that name one thing left out."""
    subject, reply = msg.subject, msg.reply or ""
    t = subject.split(".")
    if reply.startswith("$JS.ACK."):  # a JetStream delivery: it keeps the subject it was stored on
        return f"deliver {reply.split('.')[2]}"
    if subject.startswith("$KV."):
        return f"kv put {t[1]}"
    if subject.startswith("$JS.ACK."):
        return f"ack {t[2]}"
    if subject.startswith("$JS.API.CONSUMER.MSG.NEXT."):
        return f"pull request {t[6]}"
    if subject.startswith("$JS.API.DIRECT.GET."):
        return f"kv get {t[4]}"
    if subject.startswith("$JS.API."):
        return "js api " + ".".join(x for x in t[2:5] if not _ID.search(x))
    if subject.startswith("$JS."):
        return ".".join(t[:3])
    headers = msg.headers or {}
    if headers.get("Status"):
        return f"js status {headers.get('Status')}"
    if subject.startswith("_INBOX") or subject.startswith("_R_"):
        if headers.get("Nats-Stream"):
            return f"kv get reply {headers['Nats-Stream']}"
        if msg.data[:10] == b'{"stream":':
            return "publish ack"
        return "reply"
    return ".".join("*" if _ID.search(x) else x for x in t)


def self_less(mesh: Mesh) -> tuple[int, int]:
    """The server's published and delivered counts so far (/varz), less what it delivered to the
    tap (/connz): what the mesh would have cost without it."""
    published, delivered = mesh.server_messages()
    return published, delivered - mesh.messages().get(TAP, 0)


class Tap:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    async def on(self, msg: Msg) -> None:
        self.counts[kind(msg)] += 1


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    with Mesh(workdir, args.nodes, env={"MUSTER_MAX_TASKS_PER_USER": "100000000"}) as mesh:
        await mesh.wait_ready()
        nc = await mesh.connect()
        tap_nc = await bus.connect(TAP, mesh.url, credentials=mesh.credentials())
        try:
            tracker = Tracker()
            for what in ("running", "placed", "ended"):
                await nc.subscribe(subjects.job_event("*", what), cb=tracker.on_job_event)
            await nc.subscribe(subjects.verdict(BENCH_USER, "*"), cb=tracker.on_verdict)
            tap = Tap()
            await tap_nc.subscribe(">", cb=tap.on, pending_msgs_limit=1_000_000)
            await asyncio.sleep(args.settle)  # the mesh's start-up messages are not its idle cost
            idle0, t0, quiet0 = Counter(tap.counts), time.monotonic(), self_less(mesh)
            await asyncio.sleep(args.idle)
            idle1, t1, server0 = Counter(tap.counts), time.monotonic(), self_less(mesh)
            row = await offer(nc, tracker, args.rate, args.seconds, args.task_seconds, args.drain, "k")
            names = [n for n in tracker.submitted if n.startswith("k-")]
            deadline = time.monotonic() + args.task_seconds + args.drain
            while time.monotonic() < deadline and any(n not in tracker.ended for n in names):
                tracker.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(tracker.changed.wait(), 1.0)
            await tap_nc.flush()
            life1, t2 = Counter(tap.counts), time.monotonic()
            server1 = self_less(mesh)
            ended = max(1, sum(1 for n in names if n in tracker.ended))
            scale = (t2 - t1) / (t1 - t0)
            idle = idle1 - idle0
            per_job = {
                k: round((life1[k] - idle1[k] - scale * idle[k]) / ended, 2)
                for k in set(life1) | set(idle)
                if abs(life1[k] - idle1[k] - scale * idle[k]) / ended >= 0.05
            }
            # The server's counts over the jobs' lives, less the idle mesh's over as long.
            published, delivered = (
                (server1[j] - server0[j] - scale * (server0[j] - quiet0[j])) / ended for j in (0, 1)
            )
            return {
                "nodes": args.nodes,
                "offered_per_s": args.rate,
                "jobs": ended,
                "running": row["running"],
                "lives_s": round(t2 - t1, 2),
                "idle_per_s": {k: round(v / (t1 - t0), 1) for k, v in idle.most_common(8)},
                "by_kind": dict(sorted(per_job.items(), key=lambda kv: -kv[1])),
                "seen_per_job": round(sum(per_job.values()), 1),
                # The server's own count (/varz, the idle mesh left out) beside the tap's.
                "published_per_job": round(published, 1),
                "delivered_per_job": round(delivered, 1),
            }
        finally:
            await tap_nc.close()
            await nc.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--rate", type=float, default=50.0, help="offered jobs/s")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds the rate is offered")
    p.add_argument("--task-seconds", type=float, default=2.0, help="how long each sim task runs")
    p.add_argument("--drain", type=float, default=30.0, help="seconds to wait for the last jobs")
    p.add_argument("--idle", type=float, default=5.0, help="seconds the idle mesh is counted first")
    p.add_argument("--settle", type=float, default=3.0, help="seconds before counting starts")
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and data here (default: a temp dir)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="muster-kinds-") as tmp:
        report = asyncio.run(run(args, args.workdir or Path(tmp)))
    print(
        f"{report['jobs']} jobs ended ({report['nodes']} sim nodes, {report['offered_per_s']:g}/s offered), "
        f"{report['published_per_job']} messages per job published (the server's count), "
        f"{report['seen_per_job']} seen by the tap, by kind (idle mesh subtracted):"
    )
    for k, v in report["by_kind"].items():
        print(f"  {v:>7.2f}  {k}")
    print(json.dumps({"bench": "kinds", **report}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
