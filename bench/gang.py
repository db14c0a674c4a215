"""Big gangs: time from placement to every task running, for one gang of N tasks on M sim nodes.

    python -m bench.gang [--tasks 1000,2000] [--nodes 2000] [--task-seconds 30] [--rounds 3]
                         [--sim-processes 1]

For each size: a fresh mesh (`bench.cluster`: nats-server with authentication, each service its
own process, one process of M sim nodes beating every 2 s as real agents do, default settings:
MUSTER_NODE_TIMEOUT as shipped), then one job of one role of N tasks, each a whole node (8 GPUs),
submitted as a user would. Measured from placement, when the last of the gang's orders (one per
node) is sent (what the scheduler's `placed` event marked until the supervisor took that event
over, issue 28):

  * reported: the last task's `running` event as its agent published it;
  * recorded: the attempt record shows every task RUNNING (the supervisor wrote it), seen on the
    bucket's subject as the write happens (each write decoded once; polling the record would
    load the machine with the decoding of a record O(N) in size, more for a bigger gang);
  * per-process CPU over the gang's start, as a percentage of one core and in seconds;
  * `sim CPU`: the sim process's own CPU from placement to the last running report (the
    busiest one's with --sim-processes), its serial work in that time, and `beyond`: the time
    to the record showing all running less that (what the platform and the bus add to it);
  * writes of the attempt and rendezvous records (KV revisions) while it started, and the
    rendezvous' endpoint writes (one per task, each its own key) with the bytes written to the
    rendezvous bucket in all (linear in the gang's size however its endpoints come);
  * nodes declared lost and tasks ended by the platform (there should be none), and the job's
    attempt number at the end (1: it was never retried);
  * where the time went: each write of the attempt record (when, how many tasks it showed
    running), when the orders, the endpoint reports and the spec were first and last seen
    (`steps`; the bench's own subscriptions to them cost nats-server a copy of each), and each
    process's CPU from the spec until every task had reported running.

The gang runs `--task-seconds` (long enough to be all running) and is then killed. With
`--rounds R`, the sizes are measured R times, in turn (a fresh mesh each), and the median of
each size's times is printed with its ratio to the first size's: one run's times on a busy
machine vary by more than the ratio asked (2,000 tasks in at most twice the 1,000's time).
With `--sim-processes P`, the M sim nodes are P processes of M/P (sim, sim2, ...; each its CPU
figure), as agents are separate processes on their own machines; the scheduler fills the first
process's nodes first, so a smaller gang may use fewer of them.

Prints a table, then one JSON line. The services, the sim nodes and nats-server share this
machine's cores: the figures are the whole system's."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cluster import Mesh
from muster.shared import client, subjects
from muster.shared.messages import AttemptRecord, JobRecord, TaskState, attempt_key

BUCKETS = {"attempts": subjects.ATTEMPTS_BUCKET, "rendezvous": subjects.RENDEZVOUS_BUCKET}

IMAGE = "muster/bench:sim"  # never pulled: the sim runtime starts nothing


def gang(name: str, tasks: int, task_seconds: float) -> bytes:
    return json.dumps(
        {
            "jobName": name,
            "image": IMAGE,
            "gpuType": "V100",
            "retryCount": 0,
            "taskRoles": [
                {
                    "name": "worker",
                    "taskNumber": tasks,
                    "cpuNumber": 8,
                    "memoryMB": 8192,
                    "gpuNumber": 8,
                    "command": "python train.py",
                }
            ],
            "extras": {"sim": {"seconds": task_seconds, "exitCode": 0}},
        }
    ).encode()


async def last_seq(js: Any, name: str) -> int:
    """How many writes the bucket has taken so far (its stream's last sequence)."""
    return int((await js.stream_info(f"KV_{BUCKETS[name]}")).state.last_seq)


class Watch:
    """What happens to the gang, as the bus says it."""

    def __init__(self, tasks: int, cpu: Any = None) -> None:
        self.tasks, self.cpu = tasks, cpu  # cpu(): each process's CPU seconds so far
        self.job_id = ""
        # Writes to the rendezvous bucket, seen on its subjects: its record, its endpoints, bytes.
        self.rendezvous = {"records": 0, "endpoints": 0, "bytes": 0}
        self.placed: float | None = None  # the gang's last order sent: it is placed
        self.orders = 0
        self.running: set[str] = set()
        self.by_process: dict[str, int] = {}  # running reports by sim process (its nodes' prefix)
        self.reported: float | None = None
        self.first: float | None = None  # the first task's running report
        # When each step of the start was first and last seen: orders sent, endpoints reported,
        # the cluster spec published (the phases of `placed_to_first_running_s`).
        self.seen: dict[str, list[float]] = {}
        # Each process's CPU at placement, when the spec was first seen and when every task had
        # reported running: what the start costs after the spec, process by process, and how much
        # of the time after placement the sim process's own work fills.
        self.cpu_at: dict[str, dict[str, float]] = {}
        self.lost = 0  # tasks the platform declared ended (node lost, start timeout)
        self.writes: list[tuple[float, int]] = []  # the attempt record's: when, tasks running
        self.recorded: float | None = None
        self.all_recorded = asyncio.Event()
        self.all_reported = asyncio.Event()
        self.was_placed = asyncio.Event()

    def _placed(self) -> None:
        self.placed = time.monotonic()
        if self.cpu is not None:
            self.cpu_at["placed"] = self.cpu()
        self.was_placed.set()

    async def on_rendezvous(self, msg: Any) -> None:
        key = msg.subject[len(f"$KV.{subjects.RENDEZVOUS_BUCKET}.") :]
        if key.startswith(f"{self.job_id}."):
            self.rendezvous["records" if key.count(".") == 1 else "endpoints"] += 1
            self.rendezvous["bytes"] += len(msg.data)

    def saw(self, step: str) -> None:
        at = time.monotonic()
        if step == "spec" and self.cpu is not None and "spec" not in self.cpu_at:
            self.cpu_at["spec"] = self.cpu()
        self.seen.setdefault(step, [at, at])[1] = at

    async def on_step(self, msg: Any) -> None:
        if msg.subject.endswith(".assign"):
            self.saw("orders")
            self.orders += 1
            if self.orders == self.tasks and self.placed is None:  # one per node: every node's is out
                self._placed()
        else:
            self.saw("spec")

    async def on_endpoint(self, msg: Any) -> None:
        self.saw("endpoints")

    async def on_attempt(self, msg: Any) -> None:
        if msg.subject != f"$KV.{subjects.ATTEMPTS_BUCKET}.{attempt_key(self.job_id, 1)}" or not msg.data:
            return
        with contextlib.suppress(ValueError):
            record = AttemptRecord.from_bytes(msg.data)
            running = sum(t.state == TaskState.RUNNING for t in record.tasks)
            self.writes.append((time.monotonic(), running))
            if running == self.tasks and self.recorded is None:
                self.recorded = time.monotonic()
                self.all_recorded.set()

    async def on_task_event(self, msg: Any) -> None:
        token = msg.subject.split(".")
        if token[3] != self.job_id:
            return
        if token[-1] == subjects.PLATFORM:
            self.lost += 1
        elif token[-2] == "running":
            task = f"{token[5]}.{token[6]}"
            if task not in self.running:
                process = token[-1].rsplit("-", 1)[0]  # its node's prefix
                self.by_process[process] = self.by_process.get(process, 0) + 1
            self.running.add(task)
            self.first = self.first or time.monotonic()
            if len(self.running) == self.tasks and self.reported is None:
                self.reported = time.monotonic()
                if self.cpu is not None:
                    self.cpu_at["reported"] = self.cpu()
                self.all_reported.set()


async def measure(
    tasks: int, nodes: int, task_seconds: float, timeout: float, workdir: Path, sim_processes: int = 1
) -> dict[str, Any]:
    env = {"MUSTER_MAX_TASKS_PER_JOB": str(max(1000, tasks)), "MUSTER_MAX_TASKS_PER_USER": str(10 * tasks)}
    with Mesh(workdir, nodes, env=env, sim_processes=sim_processes) as mesh:
        ready_s = await mesh.wait_ready()
        await asyncio.sleep(2)  # every node beaten once more: all schedulable
        nc = await mesh.connect()
        try:
            js = nc.jetstream()
            watch = Watch(tasks, mesh.cpu)
            await nc.subscribe(
                subjects.task_event("*", "*", "*", "*", "running", "*"), cb=watch.on_task_event
            )
            await nc.subscribe(subjects.task_event("*", "*", "*", "*", "exited", "*"), cb=watch.on_task_event)
            await nc.subscribe(
                f"$KV.{subjects.RENDEZVOUS_BUCKET}.>", cb=watch.on_rendezvous, pending_msgs_limit=1_000_000
            )
            await nc.subscribe(f"$KV.{subjects.ATTEMPTS_BUCKET}.>", cb=watch.on_attempt)
            await nc.subscribe(subjects.assign("*"), cb=watch.on_step, pending_msgs_limit=1_000_000)
            await nc.subscribe(subjects.cluster_spec("*", "*"), cb=watch.on_step)
            await nc.subscribe(subjects.ENDPOINTS, cb=watch.on_endpoint, pending_msgs_limit=1_000_000)
            writes0 = {name: await last_seq(js, name) for name in BUCKETS}
            cpu0, t0 = mesh.cpu(), time.monotonic()
            _, verdict = await client.submit(nc, gang(f"gang-{tasks}", tasks, task_seconds))
            if verdict is None or not verdict.accepted:
                raise RuntimeError(f"the gang was not accepted: {verdict}")
            watch.job_id = verdict.job_id
            await asyncio.wait_for(watch.was_placed.wait(), timeout)
            assert watch.placed is not None
            end = watch.placed + timeout
            while time.monotonic() < end and watch.recorded is None:
                mesh.check()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(watch.all_recorded.wait(), 0.5)
            recorded = watch.recorded
            cpu1, elapsed = mesh.cpu(), time.monotonic() - t0
            # The KV streams' message counts: every write of either record while the gang started
            # (the rendezvous bucket's endpoint keys apart).
            writes = {name: await last_seq(js, name) - writes0[name] for name in BUCKETS}
            writes["rendezvous"] -= watch.rendezvous["endpoints"]
            sim = _sim_serial(watch.cpu_at)
            jobs = await js.key_value(subjects.JOBS_BUCKET)
            job = JobRecord.from_bytes((await jobs.get(verdict.job_id)).value)
            return {
                "tasks": tasks,
                "nodes": nodes,
                "ready_s": round(ready_s, 1),
                "submit_to_placed_s": round(watch.placed - t0, 2),
                "placed_to_first_running_s": None
                if watch.first is None
                else round(watch.first - watch.placed, 3),
                # Each step's first and last sight, seconds after placement.
                "steps": {k: [round(t - watch.placed, 3) for t in v] for k, v in watch.seen.items()},
                "cpu_spec_to_reported_s": _between(watch.cpu_at, "spec", "reported"),
                # The sim process's CPU from placement to the last running report (the busiest one's,
                # with --sim-processes): its own serial work, one core at most, in that time. What
                # the time after placement holds beyond it is the platform's (and the bus's) part.
                "sim_cpu_placed_to_reported_s": sim,
                "beyond_sim_s": None
                if recorded is None or sim is None
                else round(recorded - watch.placed - sim, 2),
                "placed_to_reported_s": None
                if watch.reported is None
                else round(watch.reported - watch.placed, 2),
                "placed_to_recorded_s": None if recorded is None else round(recorded - watch.placed, 2),
                # What the user waits: from the submission to the record showing all running.
                "submit_to_recorded_s": None if recorded is None else round(recorded - t0, 2),
                "running_reported": len(watch.running),
                "running_by_process": dict(sorted(watch.by_process.items())),
                # Each write of the attempt record while it started: seconds after placement, and
                # how many of its tasks it showed running.
                "attempt_writes": [
                    (round(t - watch.placed, 3), n) for t, n in watch.writes if t >= watch.placed
                ],
                "declared_ended_by_platform": watch.lost,
                "attempt": job.attempt,
                "kv_writes": writes,
                "endpoint_writes": watch.rendezvous["endpoints"],
                "rendezvous_bytes": watch.rendezvous["bytes"],
                "cpu_seconds": {k: round(cpu1[k] - cpu0[k], 2) for k in sorted(cpu1)},
                "cpu_percent": {k: round(100 * (cpu1[k] - cpu0[k]) / elapsed, 1) for k in sorted(cpu1)},
            }
        finally:
            await nc.close()


def _between(cpu_at: dict[str, dict[str, float]], a: str, b: str) -> dict[str, float] | None:
    """Each process's CPU seconds between the samples `a` and `b`, if both were taken."""
    if a not in cpu_at or b not in cpu_at:
        return None
    return {k: round(cpu_at[b][k] - v, 2) for k, v in cpu_at[a].items()}


def _sim_serial(cpu_at: dict[str, dict[str, float]]) -> float | None:
    """The busiest sim process's CPU seconds from placement to the last running report."""
    spent = _between(cpu_at, "placed", "reported")
    sims = [v for k, v in (spent or {}).items() if k.startswith("sim")]
    return max(sims) if sims else None


def _median(values: list[float | None]) -> float | None:
    """The median; None when any is None (a size that did not all run is not timed)."""
    if not values or any(v is None for v in values):
        return None
    return float(statistics.median(v for v in values if v is not None))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="1000,2000", help="comma-separated gang sizes")
    p.add_argument("--nodes", type=int, default=None, help="sim nodes (default: the largest gang)")
    p.add_argument("--task-seconds", type=float, default=60.0, help="how long each task runs")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for all running")
    p.add_argument("--rounds", type=int, default=1, help="measure each size this many times, in turn")
    p.add_argument(
        "--sim-processes", type=int, default=1, help="split the sim nodes over this many processes"
    )
    p.add_argument("--workdir", type=Path, default=None, help="keep logs and data here (default: a temp dir)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.tasks.split(",") if s.strip()]
    nodes = args.nodes or max(sizes)
    rows = []
    with tempfile.TemporaryDirectory(prefix="muster-gang-") as tmp:
        root = args.workdir or Path(tmp)
        for k in range(max(1, args.rounds)):
            for n in sizes:
                where = root / f"t{n}" if args.rounds <= 1 else root / f"r{k}-t{n}"
                rows.append(
                    asyncio.run(measure(n, nodes, args.task_seconds, args.timeout, where, args.sim_processes))
                )
    print("One gang, placement to every task running (s), on sim nodes beating every 2 s")
    print(
        f"{'tasks':>6} {'nodes':>6} {'reported':>9} {'recorded':>9} {'x first':>8} {'lost':>5} "
        f"{'writes a/r':>11} {'rdv KB':>7} {'sim CPU':>8} {'beyond':>7}  CPU s"
    )
    first = rows[0]["placed_to_recorded_s"] if rows else None
    for r in rows:
        cpu = " ".join(f"{k}={v}" for k, v in r["cpu_seconds"].items())
        writes = f"{r['kv_writes']['attempts']}/{r['kv_writes']['rendezvous']}"
        reported, recorded = r["placed_to_reported_s"], r["placed_to_recorded_s"]
        ratio = f"{recorded / first:.2f}" if recorded and first else "-"
        lost, kb = r["declared_ended_by_platform"], round(r["rendezvous_bytes"] / 1024)
        print(
            f"{r['tasks']:>6} {r['nodes']:>6} {reported!s:>9} {recorded!s:>9} {ratio:>8} {lost:>5} "
            f"{writes:>11} {kb:>7} {r['sim_cpu_placed_to_reported_s']!s:>8} {r['beyond_sim_s']!s:>7}  {cpu}"
        )
    medians = {n: _median([r["placed_to_recorded_s"] for r in rows if r["tasks"] == n]) for n in sizes}
    sim = {n: _median([r["sim_cpu_placed_to_reported_s"] for r in rows if r["tasks"] == n]) for n in sizes}
    beyond = {n: _median([r["beyond_sim_s"] for r in rows if r["tasks"] == n]) for n in sizes}
    submitted = {n: _median([r["submit_to_recorded_s"] for r in rows if r["tasks"] == n]) for n in sizes}
    print("sim CPU: the sim process's own CPU from placement to the last running report (its serial")
    print("work); beyond: the time after placement to the record showing all running, less that")
    named = (
        ("all recorded running", medians),
        ("sim CPU", sim),
        ("beyond", beyond),
        ("from submission, all recorded running", submitted),
    )
    for name, values in named:
        base = values[sizes[0]]
        for n, m in values.items():
            ratio = f"{m / base:.2f}" if m is not None and base else "-"
            print(f"median of {max(1, args.rounds)}: {n} tasks, {name}: {m} s (x{ratio})")
    print(
        json.dumps(
            {
                "bench": "gang",
                "rows": rows,
                "median_recorded_s": medians,
                "median_sim_cpu_s": sim,
                "median_beyond_sim_s": beyond,
                "median_submit_to_recorded_s": submitted,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
