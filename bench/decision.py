"""Decision core: how fast the placement core places jobs, with no bus and no I/O.

    python -m bench.decision [--quick]

For 100, 1,000 and 10,000 nodes × 8 GPUs, jobs of 1 task and gangs of 16 and 64 tasks (one GPU,
4 CPUs and 16 GB each), it measures:
- placements/s: one `Cluster.plan` over a queue of 1 to 10,000 such jobs on empty nodes, as the
  scheduler plans (a kept cluster, the service's backfill window), beside the same plan by the
  planner before the index (`tests/reference_placement.py`: a fresh snapshot scanned per task),
  the floor this work started from, where it finishes in reasonable time;
- decision latency: p50/p99 of placing one arriving job (plan + allocate) on a cluster that is
  half full, the cost the scheduler pays per submission.
Prints a table, then one JSON line with every figure."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from muster.services.scheduler import attained, placement
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import GpuDevice
from tests import reference_placement as before

WINDOW = 500  # the scheduler service's default backfill window (MUSTER_BACKFILL_WINDOW)


def make_nodes(module: Any, n: int) -> list[Any]:
    return [
        module.NodeState(f"node-{i:05d}", 64, 262144, [GpuDevice(index=k, model="V100") for k in range(8)])
        for i in range(n)
    ]


def make_job(tasks: int, n: int, gpus: int = 1) -> JobConfig:
    role = {"name": "worker", "taskNumber": tasks, "cpuNumber": 4, "memoryMB": 16384, "gpuNumber": gpus}
    return JobConfig.model_validate(
        {"jobName": f"j{n}", "image": "busybox", "gpuType": "V100", "taskRoles": [role | {"command": "x"}]}
    )


def throughput(nodes: int, tasks: int, queue: int, old: bool) -> dict[str, Any]:
    """One plan of `queue` jobs on empty nodes: placements (jobs placed) per second."""
    jobs = [make_job(tasks, i) for i in range(queue)]
    cluster = placement.Cluster(make_nodes(placement, nodes))
    capacity = placement.Capacity(make_nodes(placement, nodes))
    pending = [placement.PendingJob(f"j{i}", c) for i, c in enumerate(jobs)]
    t = time.perf_counter()
    result = cluster.plan(pending, capacity, window=WINDOW)
    took = time.perf_counter() - t
    row: dict[str, Any] = {
        "nodes": nodes,
        "tasks": tasks,
        "queue": queue,
        "placed": len(result.placements),
        "seconds": round(took, 4),
        "jobs_per_s": round(len(result.placements) / took) if result.placements else 0,
        "tasks_per_s": round(len(result.placements) * tasks / took) if result.placements else 0,
    }
    if old:
        old_nodes = make_nodes(before, nodes)
        old_queue = [before.PendingJob(f"j{i}", c) for i, c in enumerate(jobs)]
        t = time.perf_counter()
        old_result = before.plan(old_nodes, old_queue)
        old_took = time.perf_counter() - t
        assert old_result.placements == result.placements, "the index changed a decision"
        row["before_seconds"] = round(old_took, 4)
        row["before_jobs_per_s"] = (
            round(len(old_result.placements) / old_took) if old_result.placements else 0
        )
        row["speedup"] = round(old_took / took, 1)
    return row


def latency(nodes: int, tasks: int, samples: int) -> dict[str, Any]:
    """Per arriving job on a half-full cluster: plan a queue of one, allocate what it places,
    release the oldest job so the fill stays put."""
    cluster = placement.Cluster(make_nodes(placement, nodes))
    capacity = placement.Capacity(make_nodes(placement, nodes))
    filler = make_job(8, -1)
    half = nodes // 2
    fill = cluster.plan([placement.PendingJob(f"f{i}", filler) for i in range(half)], capacity)
    for specs in fill.placements.values():
        cluster.allocate(filler, specs)
    job = make_job(tasks, 0)
    running: list[Any] = []
    took = []
    for i in range(samples):
        t = time.perf_counter()
        result = cluster.plan([placement.PendingJob(f"x{i}", job)], capacity, window=WINDOW)
        specs = result.placements.get(f"x{i}")
        if specs:
            cluster.allocate(job, specs)
        took.append(time.perf_counter() - t)
        if specs:
            running.append(specs)
        if len(running) > 4:
            cluster.release(job, running.pop(0))
    took.sort()
    return {
        "nodes": nodes,
        "tasks": tasks,
        "samples": samples,
        "p50_ms": round(statistics.median(took) * 1000, 3),
        "p99_ms": round(took[int(len(took) * 0.99) - 1] * 1000, 3),
    }


def build_cost(nodes: int) -> dict[str, Any]:
    """A scheduler that starts (or a plan from a fresh snapshot) builds the index once."""
    states = make_nodes(placement, nodes)
    t = time.perf_counter()
    placement.Cluster(states)
    placement.Capacity(states)
    return {"nodes": nodes, "build_ms": round((time.perf_counter() - t) * 1000, 2)}


def shadow_cost(nodes: int, jobs: int) -> dict[str, Any]:
    """The queue's FIFO shadow (attained.py), as the scheduler makes it in a thread every 30 s
    while jobs wait: strict FIFO over `jobs` jobs of 1-8 GPUs (one a minute on average, running
    a minute to ten hours) on `nodes` empty nodes."""
    rng = random.Random(0)
    shapes = {g: make_job(1, g, gpus=g) for g in (1, 2, 4, 8)}
    at, seen = 0.0, []
    for i in range(jobs):
        at += rng.expovariate(1 / 60)
        run = rng.choice([60.0, 600.0, 3600.0, 36000.0])
        seen.append(attained.Seen(f"j{i}", at, run, shapes[rng.choice([1, 1, 2, 4, 8])]))
    t = time.perf_counter()
    shadow = attained.Shadow.make(make_nodes(placement, nodes), seen)
    took = time.perf_counter() - t
    waited = sum(1 for b in shadow.bounds.values() if b > 0)
    return {"nodes": nodes, "jobs": jobs, "waited_in_fifo": waited, "shadow_s": round(took, 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes only (a test runs this)")
    args = p.parse_args(argv)
    sizes = [100, 1000] if args.quick else [100, 1000, 10000]
    queues = [1, 100] if args.quick else [1, 100, 1000, 10000]
    rows = []
    print(
        f"{'nodes':>6} {'tasks':>5} {'queue':>6} {'placed':>6} {'ms':>9} {'jobs/s':>8} {'tasks/s':>8}"
        "   before"
    )
    for nodes in sizes:
        for tasks in (1, 16, 64):
            for queue in queues:
                # The old planner scans every node per task: only where it ends in seconds.
                old = nodes * queue * tasks <= 2_000_000
                row = throughput(nodes, tasks, queue, old)
                rows.append(row)
                was = (
                    f"{row['before_seconds'] * 1000:9.1f} ms {row['before_jobs_per_s']:>7}/s"
                    f"  ×{row['speedup']}"
                    if old
                    else ""
                )
                print(
                    f"{nodes:>6} {tasks:>5} {queue:>6} {row['placed']:>6} {row['seconds'] * 1000:9.1f} "
                    f"{row['jobs_per_s']:>8} {row['tasks_per_s']:>8}   {was}"
                )
    print()
    print(f"{'nodes':>6} {'tasks':>5}  decision latency per arriving job (half-full cluster)")
    lat = []
    for nodes in sizes:
        for tasks in (1, 16, 64):
            row = latency(nodes, tasks, 200 if args.quick else 1000)
            lat.append(row)
            print(f"{nodes:>6} {tasks:>5}  p50 {row['p50_ms']:.3f} ms  p99 {row['p99_ms']:.3f} ms")
    builds = [build_cost(n) for n in sizes]
    print()
    print("index build: " + ", ".join(f"{b['nodes']} nodes {b['build_ms']} ms" for b in builds))
    shadows = [shadow_cost(n, 200 if args.quick else attained.SHADOW_JOBS) for n in (8, *sizes)]
    print(
        "FIFO shadow (attained.py): "
        + ", ".join(
            f"{x['jobs']} jobs on {x['nodes']} nodes {x['shadow_s']} s ({x['waited_in_fifo']} waited)"
            for x in shadows
        )
    )
    out = {"bench": "decision", "throughput": rows, "latency": lat, "build": builds, "shadow": shadows}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
