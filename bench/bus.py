"""Through the bus: jobs/s from submission to running on simulated nodes, beside the bus's floor.

    python -m bench.bus [--nodes 1000] [--rates 50,100,200] [--seconds 30] [--task-seconds 5]

A fresh mesh (`bench.cluster`: nats-server with authentication, each service its own process,
one process of N sim nodes, 8 V100s each). Then, measured on that same server:

  * the floor: raw JetStream publish+ack of a job-sized message to a scratch stream, one at a
    time (latency) and 256 in flight (throughput);
  * the pipeline's floor (`bench.chain`): at each offered rate, job-sized messages through four
    bare JetStream hops, each its own process, as a job passes validator, scheduler, agent and
    supervisor on its way to running, with none of their work: what any design of that shape
    could reach on this machine;
  * for each offered rate R: single-task jobs (1 GPU, 1 CPU, running `--task-seconds` in the sim)
    submitted at R a second, open loop, for `--seconds`, each through the submit subject as a user
    would (JetStream publish, acknowledged). A job counts as running when its `running` job event
    arrives (the supervisor publishes it once the task reported running); submit→running is from
    just before the publish to that event. Jobs still not running `--drain` seconds after the
    last submission are counted as missing. Sustained = jobs running / time from the first
    submission to the last running event.
  * for each rate, the cost of one job over its whole life (issue 28): from the first submission
    until every job that ran has ended (its `ended` event), the messages the server took in
    (published: clients' and JetStream's own) and delivered (its /varz counters), each client's
    messages in and out (/connz) and each process's CPU (/proc), less what the idle mesh uses
    over as long (measured for `--idle` seconds just before: the nodes' beats, the services'
    timers), divided by the jobs that ended; and how busy the machine was (all cores).

Prints a table, then one JSON line. Everything is on this machine: the services, the sim nodes,
nats-server and this load generator share its cores, so the figures are the whole system's."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bench import chain
from bench.cluster import BENCH_USER, Mesh
from muster.shared import subjects
from muster.shared.subjects import Headers

IMAGE = "muster/bench:sim"  # never pulled: the sim runtime starts nothing


def job(name: str, task_seconds: float) -> bytes:
    return json.dumps(
        {
            "jobName": name,
            "image": IMAGE,
            "gpuType": "V100",
            "taskRoles": [
                {
                    "name": "worker",
                    "taskNumber": 1,
                    "cpuNumber": 1,
                    "memoryMB": 1024,
                    "gpuNumber": 1,
                    "command": "python train.py",
                }
            ],
            "extras": {"sim": {"seconds": task_seconds, "exitCode": 0}},
        }
    ).encode()


def pct(values: list[float], q: float) -> float | None:
    """The q-quantile (nearest rank) in ms to 0.1, None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


async def floor(nc: NATS, size: int, count: int = 3000) -> dict[str, float]:
    """Raw JetStream publish+ack to a scratch file stream on the same server."""
    js = nc.jetstream()
    stream = f"BENCH_FLOOR_{uuid.uuid4().hex[:8]}"
    await js.add_stream(name=stream, subjects=[f"bench.floor.{stream}"])
    payload = b"x" * size
    try:
        lat = []
        for _ in range(300):
            t = time.perf_counter()
            await js.publish(f"bench.floor.{stream}", payload)
            lat.append((time.perf_counter() - t) * 1000)
        start = time.perf_counter()
        for low in range(0, count, 256):
            await asyncio.gather(
                *(js.publish(f"bench.floor.{stream}", payload) for _ in range(min(256, count - low)))
            )
        rate = count / (time.perf_counter() - start)
    finally:
        await js.delete_stream(stream)
    return {"publish_ack_per_s": round(rate), "publish_ack_ms_p50": round(statistics.median(lat), 3)}


class Tracker:
    """Submission times by job name, and when each job's running event arrived."""

    def __init__(self) -> None:
        self.submitted: dict[str, float] = {}
        self.running: dict[str, float] = {}
        self.accepted: dict[str, float] = {}  # the verdict arrived
        self.placed: dict[str, float] = {}  # the scheduler's placed event arrived
        self.ended: dict[str, float] = {}  # its ended event arrived (its whole life is over)
        self.rejected: list[str] = []
        self.changed = asyncio.Event()

    async def on_job_event(self, msg: Msg) -> None:
        at = time.perf_counter()
        try:
            event = json.loads(msg.data)
            name, kind = event["job_name"], event["kind"]
        except (ValueError, KeyError, TypeError):
            return
        if name not in self.submitted:
            return
        if kind == "placed":
            self.placed.setdefault(name, at)
        elif kind == "ended":
            self.ended.setdefault(name, at)
            self.changed.set()
        elif kind == "running" and name not in self.running:
            self.running[name] = at
            self.changed.set()

    async def on_verdict(self, msg: Msg) -> None:
        at = time.perf_counter()
        try:
            verdict = json.loads(msg.data)
        except ValueError:
            return
        if verdict.get("job_name"):
            self.accepted.setdefault(verdict["job_name"], at)
        if not verdict.get("accepted"):
            self.rejected.append(json.dumps(verdict.get("errors"))[:300])


@dataclass(frozen=True)
class Sample:
    """What the mesh had used by `at`: CPU seconds per process, messages per client (in + out),
    the server's own counters (published, delivered) and the machine's CPU jiffies (busy, all)."""

    at: float
    cpu: dict[str, float]
    clients: dict[str, int]
    server: tuple[int, int]
    machine: tuple[int, int]

    @classmethod
    def of(cls, mesh: Mesh) -> Sample:
        return cls(time.monotonic(), mesh.cpu(), mesh.messages(), mesh.server_messages(), machine_jiffies())


def machine_jiffies() -> tuple[int, int]:
    """(busy, all) CPU jiffies of the whole machine so far, every core, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def per_job(idle: tuple[Sample, Sample], life: tuple[Sample, Sample], jobs: int) -> dict[str, Any]:
    """The cost of one job over the jobs' whole lives: what the mesh used from the first
    submission until every job had ended, less what it uses idle (the nodes' beats, the
    services' timers) over as long, measured just before; divided by the jobs."""
    (i0, i1), (l0, l1) = idle, life
    scale = (l1.at - l0.at) / max(1e-9, i1.at - i0.at)
    n = max(1, jobs)

    def cost(a0: float, a1: float, b0: float, b1: float) -> float:
        return max(0.0, (b1 - b0) - scale * (a1 - a0)) / n

    cpu = {
        k: round(1000 * cost(i0.cpu.get(k, 0), i1.cpu.get(k, 0), l0.cpu.get(k, 0), v), 3)
        for k, v in l1.cpu.items()
    }
    cpu["all"] = round(sum(cpu.values()), 3)
    clients = {
        k: round(cost(i0.clients.get(k, 0), i1.clients.get(k, 0), l0.clients.get(k, 0), v), 1)
        for k, v in sorted(l1.clients.items())
    }
    published, delivered = (
        round(cost(i0.server[j], i1.server[j], l0.server[j], l1.server[j]), 1) for j in (0, 1)
    )
    busy, total = (l1.machine[0] - l0.machine[0]), (l1.machine[1] - l0.machine[1])
    return {
        "jobs": jobs,
        "lives_s": round(l1.at - l0.at, 2),
        "idle_window_s": round(i1.at - i0.at, 2),
        "idle_published_per_s": round((i1.server[0] - i0.server[0]) / max(1e-9, i1.at - i0.at), 1),
        "published": published,
        "delivered": delivered,
        "by_client": clients,
        "cpu_ms": cpu,
        "machine_busy_percent": round(100 * busy / max(1, total), 1),
    }


async def offer(
    nc: NATS, tracker: Tracker, rate: float, seconds: float, task_seconds: float, drain: float, tag: str
) -> dict[str, Any]:
    js = nc.jetstream(timeout=30)
    subject = subjects.submit(BENCH_USER)
    names: list[str] = []
    pending: set[asyncio.Future[Any]] = set()
    failed = 0

    def done(f: asyncio.Future[Any]) -> None:
        nonlocal failed
        pending.discard(f)
        if f.cancelled() or f.exception() is not None:
            failed += 1

    start = time.perf_counter()
    total = int(rate * seconds)
    for i in range(total):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        name = f"{tag}-{i}"
        data = job(name, task_seconds)
        sid = f"{tag}-{i}"
        tracker.submitted[name] = time.perf_counter()
        names.append(name)
        f = asyncio.ensure_future(
            js.publish(subject, data, headers={Headers.SUBMISSION_ID: sid, Headers.MSG_ID: sid})
        )
        pending.add(f)
        f.add_done_callback(done)
    offered_s = time.perf_counter() - start
    if pending:
        await asyncio.wait(pending, timeout=30)
    deadline = time.perf_counter() + drain
    while time.perf_counter() < deadline and any(n not in tracker.running for n in names):
        tracker.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(tracker.changed.wait(), max(0.01, deadline - time.perf_counter()))
    latencies = [(tracker.running[n] - tracker.submitted[n]) * 1000 for n in names if n in tracker.running]
    ran = [tracker.running[n] for n in names if n in tracker.running]
    # Where the time went: submit -> verdict (validator), -> placed event (scheduler), -> running
    # event (agent started it and reported; supervisor recorded it).
    stages: dict[str, list[float]] = {"verdict": [], "placed": [], "running": []}
    for n in names:
        marks = [tracker.submitted[n], tracker.accepted.get(n), tracker.placed.get(n), tracker.running.get(n)]
        if None not in marks:
            for stage, (a, b) in zip(stages, itertools.pairwise(marks), strict=True):
                stages[stage].append((b - a) * 1000)  # type: ignore[operator]
    span = (max(ran) - start) if ran else 0.0
    return {
        "offered_per_s": rate,
        "submitted": total,
        "offered_s": round(offered_s, 2),
        "publish_failed": failed,
        "running": len(latencies),
        "missing": total - len(latencies),
        "sustained_per_s": round(len(latencies) / span, 1) if ran else 0.0,
        "submit_to_running_ms": {
            "p50": pct(latencies, 0.5),
            "p99": pct(latencies, 0.99),
            "max": pct(latencies, 1.0),
            "mean": round(statistics.fmean(latencies), 1) if latencies else None,
        },
        "stage_ms": {
            k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99), "max": pct(v, 1.0)} for k, v in stages.items()
        },
    }


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    # Past its capacity a backlog of waiting jobs builds; the per-user limit on live tasks would
    # reject the load itself (one user submits it all), so it is lifted here.
    with Mesh(workdir, args.nodes, env={"MUSTER_MAX_TASKS_PER_USER": "100000000"}) as mesh:
        ready_s = await mesh.wait_ready()
        nc = await mesh.connect()
        try:
            tracker = Tracker()
            await nc.subscribe(subjects.job_event("*", "running"), cb=tracker.on_job_event)
            await nc.subscribe(subjects.job_event("*", "placed"), cb=tracker.on_job_event)
            await nc.subscribe(subjects.job_event("*", "ended"), cb=tracker.on_job_event)
            await nc.subscribe(subjects.verdict(BENCH_USER, "*"), cb=tracker.on_verdict)
            size = len(job("x" * 16, args.task_seconds))
            the_floor = await floor(nc, size)
            assert mesh.server is not None and mesh.server.proc is not None
            pipeline = await chain.measure(
                mesh.url,
                mesh.keys.creds(BENCH_USER),
                4,
                args.rates,
                args.chain_seconds,
                size,
                workdir,
                mesh.server.proc.pid,
            )
            rows = []
            for n, rate in enumerate(args.rates):
                tag = f"r{n}-{int(rate)}"
                idle0 = Sample.of(mesh)
                await asyncio.sleep(args.idle)
                idle1 = start = Sample.of(mesh)
                row = await offer(nc, tracker, rate, args.seconds, args.task_seconds, args.drain, tag)
                running = Sample.of(mesh)
                row["cpu_percent"] = {
                    k: round(100 * (v - start.cpu.get(k, 0)) / (running.at - start.at), 1)
                    for k, v in running.cpu.items()
                }
                # Then until every job that ran has ended: its whole life is on the counters.
                mine = [name for name in tracker.running if name.startswith(f"{tag}-")]
                deadline = time.monotonic() + args.task_seconds + args.drain
                while time.monotonic() < deadline and any(name not in tracker.ended for name in mine):
                    tracker.changed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(tracker.changed.wait(), 1.0)
                ended = sum(1 for name in tracker.ended if name.startswith(f"{tag}-"))
                row["per_job"] = per_job((idle0, idle1), (start, Sample.of(mesh)), ended)
                mesh.check()
                rows.append(row)
            return {
                "nodes": args.nodes,
                "ready_s": round(ready_s, 1),
                "floor": the_floor,
                "pipeline_floor": pipeline,
                "rows": rows,
                "rejected": tracker.rejected[:5],
            }
        finally:
            await nc.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--rates", default="50,100,200", help="offered jobs/s, comma-separated, each in turn")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds each rate is offered")
    p.add_argument("--task-seconds", type=float, default=5.0, help="how long each sim task runs")
    p.add_argument("--drain", type=float, default=30.0, help="seconds to wait for the last jobs to run")
    p.add_argument(
        "--chain-seconds",
        type=float,
        default=10.0,
        help="seconds each rate is offered to the pipeline's floor",
    )
    p.add_argument(
        "--idle", type=float, default=5.0, help="seconds the idle mesh is measured before each rate"
    )
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and data here (default: a temp dir)")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    with tempfile.TemporaryDirectory(prefix="muster-bus-") as tmp:
        report = asyncio.run(run(args, args.workdir or Path(tmp)))
    f = report["floor"]
    print(
        f"{report['nodes']} sim nodes (registered in {report['ready_s']} s); floor on the same server: "
        f"JetStream publish+ack {f['publish_ack_per_s']}/s (256 in flight), "
        f"{f['publish_ack_ms_p50']} ms one at a time"
    )
    print(chain.table(report["pipeline_floor"]))
    print("Muster:")
    print(
        f"{'offered/s':>9} {'jobs':>6} {'running':>7} {'missing':>7} {'sustained/s':>11} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}  busiest (% of a core)"
    )
    for r in report["rows"]:
        lat = r["submit_to_running_ms"]
        busiest = sorted(r["cpu_percent"].items(), key=lambda kv: -kv[1])[:4]
        print(
            f"{r['offered_per_s']:>9g} {r['submitted']:>6} {r['running']:>7} {r['missing']:>7} "
            f"{r['sustained_per_s']:>11} {lat['p50']:>8} {lat['p99']:>8} {lat['max']:>8}  "
            + ", ".join(f"{k} {v:g}" for k, v in busiest)
        )
    print(
        "stages, p50/p99/max ms: submit→verdict (validator), →placed (scheduler), →running (agent+supervisor)"
    )
    for r in report["rows"]:
        st = r["stage_ms"]
        print(
            f"{r['offered_per_s']:>9g}  "
            + "   ".join(f"{k} {v['p50']}/{v['p99']}/{v['max']}" for k, v in st.items())
        )
    print(
        "per job over its whole life (first submission to every job ended, less the idle mesh "
        "over as long): messages the server took in / delivered, CPU ms of all processes (busiest), "
        "and how busy the machine was (all cores)"
    )
    for r in report["rows"]:
        pj = r["per_job"]
        busiest = sorted(((k, v) for k, v in pj["cpu_ms"].items() if k != "all"), key=lambda kv: -kv[1])[:4]
        print(
            f"{r['offered_per_s']:>9g}  {pj['jobs']} jobs ended in {pj['lives_s']} s: "
            f"{pj['published']} published, {pj['delivered']} delivered, CPU {pj['cpu_ms']['all']} ms ("
            + ", ".join(f"{k} {v:g}" for k, v in busiest)
            + f"); machine {pj['machine_busy_percent']} % busy; idle mesh {pj['idle_published_per_s']} msgs/s"
        )
    if report["rejected"]:
        print("rejected (first):", *report["rejected"], sep="\n  ")
    print(json.dumps({"bench": "bus", **report}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
