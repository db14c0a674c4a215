"""Sharing in simulated time: a trace replayed by Muster's own cores with and without preemption
and elastic jobs.

    python -m bench.replay_sharing [--trace DIR_OR_CSV] [--speedup K] [--elastic-share 0.5]
                                   [--high-share 0.1] [--dwell S] [--limit N] [--json]

The trace's jobs (bench/replay_trace.py) are marked by a hash of their name, the same in every
scenario: a share of the multi-GPU ones elastic (g GPUs on one node becomes a role of 1-GPU tasks,
minTaskNumber ceil(g/2), maxTaskNumber g; its work is g × duration GPU-seconds, done at the rate of
the tasks it has: linear scaling, the usual assumption for data-parallel jobs), a share of all
jobs high priority (the rest normal). Scenarios, each a separate replay:

  * base: the scheduler without this work: submission order, fixed gangs (an elastic job at its
    maximum), no preemption;
  * preempt: high jobs first; a high job that does not fit stops normal gangs
    (`quota.candidates`/`choose_victims`, the least lost GPU-seconds); a stop is graceful, so a
    victim keeps its progress and waits again in its old place;
  * elastic: elastic jobs start at their minimum, grow into free GPUs when nothing waits and shrink
    (newest tasks first) for a waiting job (`elastic.grow`/`shrink_for`), at most once per
    `--dwell` seconds each;
  * both.

Per scenario: GPU allocation (time-weighted, over the active period: until the last start),
queueing delay (first start - arrival: mean, p50, p99, max; and of high jobs), job completion
time, preemptions and resizes. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.replay import DEFAULT_TRACE, SAMPLE_TRACE, never_fits, summary
from bench.replay_trace import Trace, TraceError, load
from muster.services.scheduler import elastic, placement, quota
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import AttemptRecord, TaskSpec, TaskState, TaskStatus

EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
SCENARIOS = {"base": (False, False), "preempt": (True, False), "elastic": (False, True), "both": (True, True)}


def _share(name: str, salt: str) -> float:
    """A number in [0, 1) fixed by the job's name: which jobs are elastic, which high."""
    return int(hashlib.sha256(f"{salt}:{name}".encode()).hexdigest()[:8], 16) / 2**32


def elastic_config(config: JobConfig) -> JobConfig:
    """g GPUs in one task becomes g tasks of 1 GPU, from ceil(g/2) to g of them."""
    role = config.taskRoles[0]
    g = role.gpuNumber
    one = role.model_copy(
        update={
            "taskNumber": g,
            "gpuNumber": 1,
            "cpuNumber": max(1, role.cpuNumber // g),
            "memoryMB": max(100, role.memoryMB // g),
            "minTaskNumber": math.ceil(g / 2),
            "maxTaskNumber": g,
        }
    )
    return config.model_copy(update={"taskRoles": [one]})


@dataclass
class Job:
    name: str
    arrival: float
    config: JobConfig  # what it runs as (elastic: the role of 1-GPU tasks)
    elastic: bool
    rank: int  # 1 normal, 2 high
    work: float  # left: seconds at full size (fixed), GPU-seconds (elastic)
    record: AttemptRecord | None = None  # while it runs
    last: float = 0.0  # when `work` was last brought up to date
    first_start: float | None = None
    version: int = 0  # finish events of older versions are stale
    started_at: float = 0.0

    @property
    def rate(self) -> float:
        if self.record is None:
            return 0.0
        return float(len(self.record.members())) if self.elastic else 1.0


@dataclass
class Outcome:
    scenario: str
    delays: list[float] = field(default_factory=list)
    high_delays: list[float] = field(default_factory=list)
    jcts: list[float] = field(default_factory=list)
    gpu_s: float = 0.0
    active_s: float = 0.0
    preemptions: int = 0
    resizes: int = 0
    left_waiting: int = 0
    wall_s: float = 0.0

    def report(self, total_gpus: int) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "placed": len(self.delays),
            "left_waiting": self.left_waiting,
            "gpu_alloc_active": round(self.gpu_s / (total_gpus * self.active_s), 4)
            if self.active_s
            else None,
            "queue_delay_s": {k: round(v, 1) for k, v in summary(self.delays).items()},
            "high_queue_delay_s": {k: round(v, 1) for k, v in summary(self.high_delays).items()},
            "jct_s": {k: round(v, 1) for k, v in summary(self.jcts).items()},
            "preemptions": self.preemptions,
            "resizes": self.resizes,
            "wall_s": round(self.wall_s, 2),
        }


def jobs_of(trace: Trace, speedup: float, elastic_share: float, high_share: float) -> list[Job]:
    never = never_fits(trace.nodes, trace.tasks)
    out = []
    for t in trace.tasks:
        if t.name in never:
            continue
        g = t.gpus
        flexible = g >= 2 and _share(t.name, "elastic") < elastic_share
        config = elastic_config(t.config) if flexible else t.config
        work = g * t.duration if flexible else t.duration
        out.append(
            Job(
                t.name,
                t.arrival / speedup,
                config,
                flexible,
                2 if _share(t.name, "high") < high_share else 1,
                work,
            )
        )
    return out


def replay(trace: Trace, jobs: list[Job], scenario: str, dwell: float) -> Outcome:
    """One scenario over fresh copies of `jobs`."""
    preempt, flexible = SCENARIOS[scenario]
    clock = time.perf_counter()
    nodes = [n.copy(empty=True) for n in trace.nodes]
    cluster, capacity = placement.Cluster(nodes), placement.Capacity(nodes)
    total = sum(len(n.gpus) for n in nodes)
    jobs = [_as_run(j, flexible) for j in jobs]
    by_name = {j.name: j for j in jobs}
    arrivals = sorted(jobs, key=lambda j: j.arrival)
    out = Outcome(scenario)
    finishes: list[tuple[float, int, str, int]] = []
    queue: list[Job] = []
    running: dict[str, Job] = {}
    used, now, seq, nxt, last_start, wake_at = 0, 0.0, 0, 0, 0.0, -1.0
    segments: list[tuple[float, float, int]] = []  # (from, to, GPUs used)

    def at(t: float) -> datetime:
        return EPOCH + timedelta(seconds=t)

    def progress(j: Job) -> None:
        j.work = max(0.0, j.work - j.rate * (now - j.last))
        j.last = now

    def schedule(j: Job) -> None:
        nonlocal seq
        j.version += 1
        seq += 1
        heapq.heappush(finishes, (now + j.work / j.rate, seq, j.name, j.version))

    def start(j: Job, specs: list[TaskSpec]) -> None:
        nonlocal used, last_start
        cluster.allocate(j.config, specs)
        j.record = AttemptRecord(
            job_id=j.name,
            attempt=1,
            tasks=[_running(s) for s in specs],
            elastic=[j.config.taskRoles[0].name] if j.elastic else [],
            placed_at=at(now),
        )
        j.last = j.started_at = now
        used += sum(len(s.gpus) for s in specs)
        if j.first_start is None:
            j.first_start = now
            out.delays.append(now - j.arrival)
            if j.rank > 1:
                out.high_delays.append(now - j.arrival)
        last_start = now
        running[j.name] = j
        schedule(j)

    def stop(j: Job) -> None:
        nonlocal used
        assert j.record is not None
        progress(j)
        members = [t.spec() for t in j.record.members()]
        cluster.release(j.config, members)
        used -= sum(len(s.gpus) for s in members)
        j.record, j.version = None, j.version + 1
        del running[j.name]

    def place() -> list[Job]:
        # In arrival order (a preempted job's is its old place); high first when priorities count.
        order = sorted(queue, key=lambda j: (-j.rank if preempt else 0, j.arrival))
        plan = cluster.plan(
            [placement.PendingJob(j.name, j.config.smallest()) for j in order], capacity, window=500
        )
        for j in order:
            if j.name in plan.placements:
                start(j, plan.placements[j.name])
        queue[:] = [j for j in queue if j.name not in plan.placements]
        return [j for j in order if j.name not in plan.placements and j.name not in plan.unschedulable]

    def resize(j: Job, record: AttemptRecord) -> None:
        nonlocal used
        before = used
        progress(j)
        used = (
            before + sum(len(t.gpus) for t in record.members()) - sum(len(t.gpus) for t in j.record.members())
        )  # type: ignore[union-attr]
        j.record = record
        out.resizes += 1
        schedule(j)

    while nxt < len(arrivals) or finishes:
        t = min(
            arrivals[nxt].arrival if nxt < len(arrivals) else math.inf,
            finishes[0][0] if finishes else math.inf,
        )
        segments.append((now, t, used))
        now = t
        while finishes and finishes[0][0] <= now:
            _, _, name, version = heapq.heappop(finishes)
            j = by_name.get(name)  # "": a dwell is over, only look again
            if j is None or version != j.version or j.record is None:
                continue  # resized or stopped since
            stop(j)
            out.jcts.append(now - j.arrival)
        while nxt < len(arrivals) and arrivals[nxt].arrival <= now:
            queue.append(arrivals[nxt])
            nxt += 1
        blocked = place() if queue else []
        if preempt and blocked:
            high = next((j for j in blocked if j.rank > 1), None)
            if high is not None:
                w = quota.Waiting(
                    high.name, "default", "u", high.rank, high.config.smallest(), at(high.arrival)
                )
                options = [
                    quota.Running(
                        r.name,
                        r.name,
                        "default",
                        "u",
                        r.rank,
                        r.config,
                        [s.spec() for s in r.record.members()],
                        quota.Amount(),
                        False,
                        (now - r.started_at) * r.rate,
                    )
                    for r in running.values()
                    if r.rank < high.rank and r.record is not None
                ]
                victims = quota.choose_victims(cluster, w, sorted(options, key=lambda o: o.lost))
                for v in victims or []:
                    stop(by_name[v.job_id])
                    queue.append(by_name[v.job_id])
                    out.preemptions += 1
                if victims:
                    blocked = place()
        if flexible:
            ready = [
                (j, j.record)
                for j in running.values()
                if j.elastic and j.record is not None and elastic.settled(j.record, at(now), dwell)
            ]
            helped = False
            if blocked:
                for w in blocked[:16]:  # as the scheduler (PREEMPT_TRIES)
                    pending = placement.PendingJob(w.name, w.config.smallest())
                    chosen = elastic.shrink_for(cluster, pending, [(j.config, r) for j, r in ready])
                    if chosen:
                        for record, spec in chosen:
                            j = by_name[record.job_id]
                            assert j.record is not None
                            cluster.release(j.config, [spec])
                            tasks = [
                                x.model_copy(update={"removed": True}) if x.key == spec.key else x
                                for x in j.record.tasks
                            ]
                            resize(j, j.record.model_copy(update={"tasks": tasks, "resized_at": at(now)}))
                        place()
                        helped = True
                        break
            if not helped and used < total:  # as the scheduler: grow into room no one waiting can use
                for j, record in ready:
                    added = elastic.grow(cluster, j.config, record)
                    if added:
                        cluster.allocate(j.config, added)
                        joined = [_running(s, at(now)) for s in added]
                        resize(
                            j,
                            record.model_copy(
                                update={"tasks": [*record.tasks, *joined], "resized_at": at(now)}
                            ),
                        )
            # An elastic job held back only by its dwell may change once it is over: look again
            # then (otherwise nothing changes until the next arrival or end).
            ready_at = [
                ((j.record.resized_at or j.record.placed_at) - EPOCH).total_seconds() + dwell
                for j in running.values()
                if j.elastic and j.record is not None
            ]
            soon = min((x for x in ready_at if x > now), default=math.inf)
            if soon < math.inf and not (now < wake_at <= soon):
                seq, wake_at = seq + 1, soon
                heapq.heappush(finishes, (wake_at, seq, "", -1))
    # Every GPU given back: what was allocated and released balances (a GPU used twice would
    # have failed at allocation).
    if used != 0 or any(n.used_gpus or n.used_cpus for n in cluster.nodes.values()):
        raise AssertionError(f"{scenario}: the cluster is not empty at the end ({used} GPUs counted)")
    out.active_s = last_start
    out.gpu_s = sum(u * (min(b, last_start) - a) for a, b, u in segments if a < last_start)
    out.left_waiting = len(queue)
    out.wall_s = time.perf_counter() - clock
    return out


def _as_run(j: Job, flexible: bool) -> Job:
    """A fresh copy of `j` for one scenario: without elasticity, an elastic job is a fixed gang at
    its maximum, doing its work in its duration."""
    if flexible or not j.elastic:
        return Job(j.name, j.arrival, j.config, j.elastic, j.rank, j.work)
    role = j.config.taskRoles[0]
    fixed = role.model_copy(update={"minTaskNumber": None, "maxTaskNumber": None})
    config = j.config.model_copy(update={"taskRoles": [fixed]})
    return Job(j.name, j.arrival, config, False, j.rank, j.work / role.taskNumber)


def _running(s: TaskSpec, joined: datetime | None = None) -> TaskStatus:
    return TaskStatus(
        role=s.role,
        role_no=s.role_no,
        index=s.index,
        node=s.node,
        gpus=s.gpus,
        state=TaskState.RUNNING,
        placed_at=joined,
    )


# ------------------------------------------------------------------ the command


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.replay_sharing", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--trace", type=Path, default=None, help="a trace directory (Alibaba) or a task CSV")
    p.add_argument(
        "--speedup", type=float, default=20000.0, help="divide arrival times by K (a busy cluster)"
    )
    p.add_argument("--elastic-share", type=float, default=0.5, help="share of multi-GPU jobs made elastic")
    p.add_argument("--high-share", type=float, default=0.1, help="share of jobs of high priority")
    p.add_argument("--dwell", type=float, default=30.0, help="seconds between two changes of one elastic job")
    p.add_argument("--limit", type=int, default=None, help="only the first N tasks (by arrival)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"of: {', '.join(SCENARIOS)}")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    args = p.parse_args(argv)
    scenarios = [x for x in args.scenarios.split(",") if x]
    if any(x not in SCENARIOS for x in scenarios) or args.speedup <= 0 or args.dwell < 0:
        print(f"scenarios are {', '.join(SCENARIOS)}; --speedup > 0, --dwell ≥ 0", file=sys.stderr)
        return 2
    path = args.trace or DEFAULT_TRACE
    if args.trace is None and not DEFAULT_TRACE.is_dir():
        print(f"no default trace at {DEFAULT_TRACE}; pass --trace, e.g. {SAMPLE_TRACE}", file=sys.stderr)
        return 2
    try:
        trace = load(path, limit=args.limit)
    except TraceError as e:
        print(f"cannot replay: {e}", file=sys.stderr)
        return 2
    jobs = jobs_of(trace, args.speedup, args.elastic_share, args.high_share)
    total = sum(len(n.gpus) for n in trace.nodes)
    runs = [replay(trace, jobs, name, args.dwell).report(total) for name in scenarios]
    about = {
        "trace": trace.source,
        "jobs": len(jobs),
        "elastic_jobs": sum(j.elastic for j in jobs),
        "high_jobs": sum(j.rank > 1 for j in jobs),
        "gpus": total,
        "speedup": args.speedup,
        "dwell_s": args.dwell,
    }
    if not args.json:
        print(
            f"{about['trace']}: {about['jobs']} jobs ({about['elastic_jobs']} elastic, "
            f"{about['high_jobs']} high) on {total} GPUs, arrivals ×{args.speedup:g}, dwell {args.dwell:g}s"
        )
        head = (
            "scenario",
            "GPU alloc",
            "wait mean",
            "p50",
            "p99",
            "high wait",
            "JCT mean",
            "preempt",
            "resize",
        )
        print(f"{head[0]:<9}" + "".join(f"{h:>11}" for h in head[1:]))
        for r in runs:
            d, h, c = r["queue_delay_s"], r["high_queue_delay_s"], r["jct_s"]
            alloc = "-" if r["gpu_alloc_active"] is None else f"{100 * r['gpu_alloc_active']:.1f}%"
            cells = [alloc, *(f"{x:,.0f}" for x in (d["mean"], d["p50"], d["p99"], h["mean"], c["mean"]))]
            cells += [str(r["preemptions"]), str(r["resizes"])]
            print(f"{r['scenario']:<9}" + "".join(f"{x:>11}" for x in cells))
    print(json.dumps({"bench": "replay_sharing", **about, "scenarios": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
