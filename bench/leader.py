"""The scheduler leader alone: its CPU per job and the placements per second it carries, with
nothing else on the machine to wait for.

    python -m bench.leader [--nodes 2000] [--rates 300,1000,max] [--jobs 6000] [--task-seconds 1]

`bench.bus` measures the leader inside the whole pipeline: on two cores the seven processes
saturate near 300 jobs/s, so the leader is never the bottleneck there and its cost per job is
that of small batches. Here one scheduler process (default settings) runs on a real
nats-server (with authentication), and this process stands in for everything around it,
writing what those services write, to the same buckets and subjects:

  * the nodes, as their agents: N node records (8 V100, 64 CPUs each), and every node's beat
    every 2 s on core NATS, as a real agent beats;
  * the validator: job records (one task, 1 GPU), created open loop at the offered rate (`max`:
    as fast as this process writes them, at most 512 in flight);
  * the agents and the supervisor, for each job once its attempt record appears (the
    scheduler's placement): the job moved to the attempt, the attempt's task running and the job
    running, then after `--task-seconds` the attempt ended (succeeded) and the job succeeded, the
    five writes the supervisor makes for a one-task job.

So the leader sees every record write of a one-task job's life that it sees in a deployment
(the job's creation and the supervisor's writes of it, its own attempt record and the
supervisor's writes of that), and does all of its own work (plans, attempt records, orders to
the nodes). No agent takes the orders: they stay in their stream.

Per rate: jobs offered and placed a second (placed: jobs / first creation to last placement),
creation to placement p50/p99, and per job over the jobs' whole lives (first creation to the
last final write, less the idle mesh over as long, measured just before), the CPU of the
scheduler, nats-server and this driver, and the scheduler's messages in and out. The leader's
cap is the rate where its CPU reaches one core: 1,000 / (ms per job) jobs a second.

Prints a table, then one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from bench import bus as bus_bench
from bench.bus import Sample, pct, per_job
from bench.cluster import BENCH_USER, Mesh
from muster.shared import bus, subjects
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import (
    AttemptRecord,
    GpuDevice,
    JobRecord,
    JobState,
    NodeInfo,
    TaskState,
    now,
)

BEAT = 2.0  # seconds between a real agent's beats
IN_FLIGHT = 512  # the driver's writes awaiting their acknowledgement
KV_OP = "KV-Operation"


def node_record(i: int) -> tuple[str, bytes]:
    name = f"lead-{i:05d}"
    info = NodeInfo(
        node=name,
        address=f"10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}",
        cpus=64,
        memory_mb=262144,
        gpus=[GpuDevice(index=k, model="V100") for k in range(8)],
        runtime="sim",
        agent_id="bench",
    )
    return name, info.to_bytes()


# The one-task job bench.bus submits (its sim `extras` unread here: no agent runs it).
CONFIG = JobConfig.model_validate_json(bus_bench.job("lead", 1.0))


def job_record(job_id: str) -> JobRecord:
    """As the validator writes it (the config shared: it is never changed)."""
    return JobRecord(
        job_id=job_id,
        job_name=job_id,
        submission_id=job_id,
        user=BENCH_USER,
        config=CONFIG,
        submitted_at=now(),
    )


class Driver:
    """The nodes, the validator and the supervisor, as far as the leader can tell."""

    def __init__(self, nc: NATS, jobs: KeyValue, attempts: KeyValue, task_seconds: float) -> None:
        self.nc, self.jobs, self.attempts = nc, jobs, attempts
        self.task_seconds = task_seconds
        self.gate = asyncio.Semaphore(IN_FLIGHT)
        self.records: dict[str, JobRecord] = {}  # job id -> as created
        self.created: dict[str, float] = {}  # job id -> when its creation was acknowledged
        self.placed: dict[str, float] = {}  # job id -> when its attempt record appeared
        self.ended: dict[str, float] = {}  # job id -> when its final write was acknowledged
        self.failed: list[str] = []
        self.changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._prefix = f"$KV.{subjects.ATTEMPTS_BUCKET}."

    async def watch(self) -> None:
        await self.nc.subscribe(f"{self._prefix}>", cb=self._on_attempt)

    async def _on_attempt(self, msg: Msg) -> None:
        at = time.perf_counter()
        if msg.headers and msg.headers.get(KV_OP) in ("DEL", "PURGE"):
            return
        job_id, _, n = msg.subject[len(self._prefix) :].rpartition(".")
        if job_id not in self.records or job_id in self.placed or n != "1":
            return  # not ours, or a later write of it (ours)
        self.placed[job_id] = at
        self.changed.set()
        self._spawn(self._live(job_id, AttemptRecord.model_validate_json(msg.data)))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _put(self, kv: KeyValue, key: str, data: bytes) -> None:
        async with self.gate:
            await kv.put(key, data)

    async def _live(self, job_id: str, placed: AttemptRecord) -> None:
        """The supervisor's writes for a one-task job: the job moved to its attempt (`adopt`),
        running (attempt, then job), and after the task's run its end (attempt, then job)."""
        try:
            job, task = self.records[job_id], placed.tasks[0]
            t = now()
            where = f"placed on {task.node}; starting tasks"
            taken = {"attempt": 1, "reason": where, "updated_at": t}
            await self._put(self.jobs, job_id, job.model_copy(update=taken).to_bytes())
            running = placed.model_copy(
                update={"tasks": [task.model_copy(update={"state": TaskState.RUNNING, "started_at": t})]}
            )
            await self._put(self.attempts, placed.key, running.to_bytes())
            update = {"state": JobState.RUNNING, "attempt": 1, "reason": "running", "updated_at": t}
            await self._put(self.jobs, job_id, job.model_copy(update=update).to_bytes())
            await asyncio.sleep(self.task_seconds)
            t = now()
            done = running.tasks[0].model_copy(
                update={"state": TaskState.SUCCEEDED, "exit_code": 0, "ended_at": t}
            )
            ended = running.model_copy(
                update={
                    "tasks": [done],
                    "ended_at": t,
                    "outcome": JobState.SUCCEEDED,
                    "rule": "every task succeeded",
                }
            )
            await self._put(self.attempts, placed.key, ended.to_bytes())
            update = {
                "state": JobState.SUCCEEDED,
                "attempt": 1,
                "settled": 1,
                "reason": "succeeded",
                "updated_at": t,
            }
            await self._put(self.jobs, job_id, job.model_copy(update=update).to_bytes())
            self.ended[job_id] = time.perf_counter()
        except Exception as exc:  # a failed write: counted, the run goes on
            self.failed.append(f"{job_id}: {exc!r}"[:200])
        self.changed.set()

    async def create(self, job_id: str) -> None:
        record = self.records[job_id] = job_record(job_id)
        try:
            async with self.gate:
                await self.jobs.create(job_id, record.to_bytes())
            self.created[job_id] = time.perf_counter()
        except Exception as exc:
            self.failed.append(f"{job_id}: {exc!r}"[:200])

    async def offer(self, tag: str, rate: float | None, count: int) -> float:
        """Create `count` jobs at `rate` a second (None: as fast as they are acknowledged, up
        to IN_FLIGHT at once), open loop; seconds it took."""
        start = time.perf_counter()
        pending = []
        for i in range(count):
            if rate is not None:
                delay = start + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            else:
                await self.gate.acquire()  # the creation takes it again: wait for room first
                self.gate.release()
            pending.append(asyncio.create_task(self.create(f"{tag}-{i:06d}")))
        await asyncio.gather(*pending)
        return time.perf_counter() - start

    async def settle(self, ids: list[str], timeout: float) -> None:
        """Until every job of `ids` has ended (or failed), or `timeout` seconds."""
        await self.until(lambda: all(j in self.ended or j not in self.created for j in ids), timeout)

    async def until(self, done: Callable[[], bool], timeout: float) -> None:
        """Until `done()` (checked at each placement or end, and every 0.1 s), or `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not done():
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), 0.1)


def sample(mesh: Mesh) -> Sample:
    """The mesh's counters, and this process's own CPU as the `driver`'s."""
    s = Sample.of(mesh)
    return Sample(s.at, {**s.cpu, "driver": time.process_time()}, s.clients, s.server, s.machine)


async def beat(nc: NATS, names: list[str], stop: asyncio.Event) -> None:
    """Every node beats every BEAT seconds, spread over the period (20 slices)."""
    slices = 20
    step = max(1, -(-len(names) // slices))
    while not stop.is_set():
        for low in range(0, len(names), step):
            for name in names[low : low + step]:
                await nc.publish(subjects.beat(name), b"")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), BEAT / slices)
            if stop.is_set():
                return


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    with Mesh(workdir, args.nodes, services=("scheduler",), agents=False) as mesh:
        start = time.monotonic()
        nc = await mesh.connect()
        stop = asyncio.Event()
        beating: asyncio.Task[None] | None = None
        try:
            _, buckets = await bus.ensure_jetstream(nc)
            nodes = buckets[subjects.NODES_BUCKET]
            names = []
            for low in range(0, args.nodes, 256):
                pairs = [node_record(i) for i in range(low, min(args.nodes, low + 256))]
                await asyncio.gather(*(nodes.put(name, data) for name, data in pairs))
                names += [name for name, _ in pairs]
            beating = asyncio.create_task(beat(nc, names, stop))
            driver = Driver(
                nc, buckets[subjects.JOBS_BUCKET], buckets[subjects.ATTEMPTS_BUCKET], args.task_seconds
            )
            await driver.watch()
            # The leader is ready once it has placed a first job (its lease taken, views synced).
            await driver.create("warmup-000000")
            await driver.settle(["warmup-000000"], args.timeout)
            if "warmup-000000" not in driver.ended:
                mesh.check()
                raise RuntimeError(
                    f"the scheduler placed no first job in {args.timeout:g}s: {driver.failed[:3]}"
                )
            ready_s = time.monotonic() - start
            rows = []
            for n, rate in enumerate(args.rates):
                tag = f"r{n}"
                idle0 = sample(mesh)
                await asyncio.sleep(args.idle)
                idle1 = first = sample(mesh)
                count = args.jobs
                offered_s = await driver.offer(tag, rate, count)
                ids = [f"{tag}-{i:06d}" for i in range(count)]
                await driver.until(lambda ids=ids: all(j in driver.placed for j in ids), args.timeout)
                placing = sample(mesh)  # every job placed (the ends of the first ones are in it)
                await driver.settle(ids, args.timeout)
                await asyncio.sleep(args.drain)  # what the leader still has to read of the last writes
                last = sample(mesh)
                mesh.check()
                created = [driver.created[j] for j in ids if j in driver.created]
                placed = [driver.placed[j] for j in ids if j in driver.placed]
                waits = [
                    1000 * (driver.placed[j] - driver.created[j])
                    for j in ids
                    if j in driver.placed and j in driver.created
                ]
                ended = sum(1 for j in ids if j in driver.ended)
                span = (max(placed) - min(created)) if placed and created else 0.0
                cost = per_job((idle0, idle1), (first, last), ended)
                rows.append(
                    {
                        "offered_per_s": rate,
                        "jobs": count,
                        "created_per_s": round(len(created) / offered_s, 1) if offered_s else None,
                        "placed": len(placed),
                        "ended": ended,
                        "placed_per_s": round(len(placed) / span, 1) if span else None,
                        "created_to_placed_ms": {
                            "p50": pct(waits, 0.5),
                            "p99": pct(waits, 0.99),
                            "max": pct(waits, 1.0),
                        },
                        "scheduler_cpu_ms_per_job": cost["cpu_ms"].get("scheduler"),
                        "scheduler_messages_per_job": cost["by_client"].get("scheduler"),
                        # Its busy share from the first creation until every job was placed.
                        "scheduler_core_percent": round(
                            100
                            * (placing.cpu["scheduler"] - first.cpu["scheduler"])
                            / max(1e-9, placing.at - first.at),
                            1,
                        ),
                        "per_job": cost,
                    }
                )
            return {
                "bench": "leader",
                "nodes": args.nodes,
                "beat_s": BEAT,
                "ready_s": round(ready_s, 1),
                "rows": rows,
                "failed": driver.failed[:5],
            }
        finally:
            stop.set()
            if beating is not None:
                with contextlib.suppress(Exception):
                    await beating
            await nc.close()


def rates(text: str) -> list[float | None]:
    out: list[float | None] = []
    for part in text.split(","):
        part = part.strip()
        if part == "max":
            out.append(None)
            continue
        value = float(part)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"--rates: {part} is not a positive rate (or max)")
        out.append(value)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2000, help="nodes (8 V100 each), beating every 2 s")
    p.add_argument("--rates", type=rates, default=rates("300,1000,max"), help="jobs/s offered, or max")
    p.add_argument("--jobs", type=int, default=6000, help="jobs offered at each rate")
    p.add_argument("--task-seconds", type=float, default=1.0, help="from running to ended")
    p.add_argument(
        "--idle", type=float, default=5.0, help="seconds the idle mesh is measured before each rate"
    )
    p.add_argument("--drain", type=float, default=1.0, help="seconds after the last write before the count")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="muster-bench-leader-") as tmp:
        report = asyncio.run(run(args, args.workdir or Path(tmp)))
    nodes, ready = report["nodes"], report["ready_s"]
    print(f"the scheduler alone, {nodes} nodes beating every {BEAT:g} s (ready in {ready} s)")
    print(
        "offered/s   jobs  created/s  placed/s  created→placed p50 / p99 ms"
        "  scheduler: ms/job  msgs/job  % of a core placing  nats-server ms/job  driver ms/job"
    )
    for r in report["rows"]:
        cpu = r["per_job"]["cpu_ms"]
        lat = r["created_to_placed_ms"]
        offered = "max" if r["offered_per_s"] is None else f"{r['offered_per_s']:g}"
        print(
            f"{offered:>9} {r['jobs']:>6} {r['created_per_s']!s:>10} {r['placed_per_s']!s:>9}"
            f"  {lat['p50']!s:>12} / {lat['p99']!s:<12} {r['scheduler_cpu_ms_per_job']!s:>11}"
            f" {r['scheduler_messages_per_job']!s:>9} {r['scheduler_core_percent']!s:>19}"
            f" {cpu.get('nats-server')!s:>20} {cpu.get('driver')!s:>14}"
        )
    print(
        "placed/s: jobs placed / first creation to last placement; below the offered rate, the "
        "leader is saturated and its ms/job is what caps a deployment (1,000 / ms jobs a second "
        "of one core)"
    )
    if report["failed"]:
        print("failed writes:", *report["failed"], sep="\n  ")
    print(json.dumps(report))
    return 0 if all(r["ended"] == r["jobs"] for r in report["rows"]) and not report["failed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
