"""Trace replay: a GPU cluster trace in simulated time, placed by Muster's own core and baselines.

    python -m bench.replay [--trace DIR_OR_CSV] [--nodes-csv F | --nodes N ...]
                           [--policies muster,fifo,firstfit|all] [--limit N] [--speedup K]
                           [--lose-progress] [--json]

A discrete-event driver: arrivals and completions in a heap of simulated time; after each batch of
events at one instant, if something arrived or freed, the policy decides over the whole waiting
queue (arrival order) and what it places starts now and ends `duration` later. Nothing is re-planned
when nothing changed. A preemptive policy (`las`, `muster`) may stop running jobs first: a stopped
job keeps its progress (unless `--lose-progress`), waits again, and runs its remaining time when
started next; the replay decides once more right after the stops, and a policy may name times at
which it wants to decide again (a running job changing priority). Trace files and how their
tasks become Muster jobs: `bench/replay_trace.py`
(fractional GPUs take a whole GPU; a multi-model gpu_spec is narrowed to one model; both counted in
the report). Policies: `bench/replay_policies.py`. A job that can never fit on the nodes (Muster's
`plan` says so, with its reason) never enters the queue and is reported as never placed.

Per policy it reports (a table, then one JSON line with every figure):
  * GPU allocation: allocated / total GPUs, time-weighted, per `--bucket` seconds (default an hour
    of the trace, 3600 / speedup, widened to keep at most 5,000 buckets) over the *active period*
    (from 0 to the last start, a restart included; after it the run only drains, which for this
    trace means months of a few long pods); its mean, the same until the last arrival (one window
    for every policy), over the whole run, and the peak. *At saturation*: while a GPU job waits;
  * queueing delay (start - arrival; for a job that was stopped, all its time not running: finish -
    arrival - duration) and job completion time (finish - arrival): mean, p50, p99, max, in
    simulated seconds, over the jobs placed; and how many stops (preemptions) there were, with
    `--lose-progress` what share of the GPU time allocated went into runs they threw away, and
    the allocation until the last arrival less those runs (`kept`);
  * GPUs stranded by fragmentation at saturation: while a GPU job waits, the free GPUs on nodes
    where no waiting GPU task fits now (too few free GPUs of its model there, or too few CPUs or
    too little memory left beside them), time-weighted mean; beside it, all free GPUs then;
  * jobs never placed, by reason; the wall-clock time of the replay (and of the policy's decisions).
`--speedup K` divides every arrival time by K (durations are kept) to study a saturated cluster.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.replay_policies import POLICIES, Need, Policy, fits, needs
from bench.replay_trace import Trace, TraceError, TraceTask, adjustments, load, uniform_nodes
from bench.replay_vcs import ORDERS, Sharing, facts_for, vcs_for
from muster.services.scheduler.placement import NodeState, PendingJob, allocate, plan, release

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "alibaba-gpu-2023"
SAMPLE_TRACE = ROOT / "tests" / "data" / "alibaba-gpu-2023-sample"
BASELINES = (  # --policies all
    *("muster", "muster-reserve", "muster-las", "muster-fifo-las"),
    *("fifo", "firstfit", "greedy", "sjf", "las"),
)
MAX_BUCKETS = 5000  # the allocation series is widened past its bucket rather than grow longer


# ------------------------------------------------------------------ what can never run


def never_fits(nodes: Sequence[NodeState], tasks: Iterable[TraceTask]) -> dict[str, str]:
    """Task name -> Muster's reason, for every task that cannot run even on empty nodes. Asked of
    the real core (`plan` marks such jobs unschedulable), once per distinct job shape."""
    by_shape: dict[tuple[Any, ...], list[str]] = {}
    first: dict[tuple[Any, ...], PendingJob] = {}
    for task in tasks:
        roles = task.config.taskRoles
        key = (
            task.config.gpuType,
            tuple((r.cpuNumber, r.memoryMB, r.gpuNumber, r.taskNumber) for r in roles),
        )
        by_shape.setdefault(key, []).append(task.name)
        first.setdefault(key, PendingJob(task.name, task.config))
    empty = [n.copy(empty=True) for n in nodes]
    result = plan(empty, list(first.values()))
    out: dict[str, str] = {}
    for key, job in first.items():
        if job.job_id in result.unschedulable:
            for name in by_shape[key]:
                out[name] = result.pending[job.job_id]
    return out


# ------------------------------------------------------------------ fragmentation


def stranded_gpus(nodes: Iterable[NodeState], waiting: Iterable[Need]) -> int:
    """Free GPUs on the nodes where no waiting GPU task fits now. Waiting needs are cut to the ones
    no other need of the same model and GPU count is smaller than in both CPUs and memory."""
    groups: dict[tuple[str | None, int], list[tuple[int, int]]] = {}
    for need in waiting:
        if need.gpus:
            groups.setdefault((need.model, need.gpus), []).append((need.cpus, need.memory_mb))
    frontier: list[Need] = []
    for (model, gpus), points in groups.items():
        least_memory = math.inf
        for cpus, memory_mb in sorted(set(points)):
            if memory_mb < least_memory:
                least_memory = memory_mb
                frontier.append(Need(gpus, cpus, memory_mb, model))
    total = 0
    for node in nodes:
        free = node.free_gpu_count
        if free and not any(need.gpus <= free and fits(node, need) for need in frontier):
            total += free
    return total


# ------------------------------------------------------------------ the measurements


def _pct(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of sorted `xs`."""
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))] if xs else 0.0


def summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    mean = sum(xs) / len(xs) if xs else 0.0
    return {"mean": mean, "p50": _pct(xs, 0.5), "p99": _pct(xs, 0.99), "max": xs[-1] if xs else 0.0}


@dataclass
class Meter:
    """Time-weighted sums of the cluster's state between events (a state holds until the next),
    and the allocated GPUs as steps, for the series over the active period."""

    total_gpus: int
    steps: list[tuple[float, int]] = field(default_factory=list)  # (from, allocated GPUs) on change
    span_s: float = 0.0  # the last event
    gpu_s: float = 0.0  # allocated GPU-seconds over the run
    saturated_s: float = 0.0  # time with a GPU job waiting
    saturated_gpu_s: float = 0.0
    stranded_gpu_s: float = 0.0
    free_gpu_s: float = 0.0
    peak_used: int = 0

    def add(self, start: float, end: float, used: int, saturated: bool, stranded: int) -> None:
        if end <= start:
            return
        span = end - start
        self.span_s = end
        self.gpu_s += used * span
        self.peak_used = max(self.peak_used, used)
        if not self.steps or self.steps[-1][1] != used:
            self.steps.append((start, used))
        if saturated:
            self.saturated_s += span
            self.saturated_gpu_s += used * span
            self.stranded_gpu_s += stranded * span
            self.free_gpu_s += (self.total_gpus - used) * span

    def series(self, until: float, bucket_s: float) -> list[float]:
        """Allocated / total GPUs, time-weighted, per `bucket_s` from 0 to `until` (the last
        bucket counts only its own length)."""
        if until <= 0 or not self.total_gpus:
            return []
        count = max(1, math.ceil(until / bucket_s - 1e-9))  # not one more for a rounding error
        busy = [0.0] * count
        ends = [t for t, _ in self.steps[1:]] + [self.span_s]
        for (start, used), end in zip(self.steps, ends, strict=True):
            end = min(end, until)
            i = min(int(start // bucket_s), count - 1)
            while used and i < count and i * bucket_s < end:
                busy[i] += used * max(0.0, min(end, (i + 1) * bucket_s) - max(start, i * bucket_s))
                i += 1
        lengths = [bucket_s] * (count - 1) + [until - (count - 1) * bucket_s]
        return [b / (self.total_gpus * n) if n > 0 else 0.0 for b, n in zip(busy, lengths, strict=True)]


@dataclass
class Run:
    policy: str
    jobs: int
    started: dict[str, float]  # job -> start
    delays: list[float]
    jcts: list[float]
    never: dict[str, str]
    left_waiting: list[str]
    meter: Meter
    replans: int
    wall_s: float
    decide_s: float
    bucket_s: float
    order: dict[str, float] | None = None  # a sharing policy's order (bench/replay_vcs.py)
    waited: dict[str, float] = field(default_factory=dict)  # job -> its wait (as `delays`)
    stops: int = 0  # running jobs a preemptive policy stopped
    lost_gpu_s: float = 0.0  # GPU-seconds of runs a stop threw away (`lose_progress`)
    lost_by_last_arrival: float = 0.0  # the part of them before the last arrival
    stopped_jobs: int = 0  # distinct jobs among them
    last_start: float = 0.0  # the last start, a stopped job's restart included
    last_arrival: float = 0.0

    def report(self) -> dict[str, Any]:
        m = self.meter
        active = max(self.last_start, max(self.started.values(), default=0.0))
        bucket_s = max(self.bucket_s, active / MAX_BUCKETS)
        series = m.series(active, bucket_s)
        sat = m.saturated_s
        to_arrival = m.series(self.last_arrival, self.last_arrival)[0] if self.last_arrival else 0.0
        return {
            "policy": self.policy,
            "wall_s": round(self.wall_s, 3),
            "decide_s": round(self.decide_s, 3),
            "replans": self.replans,
            "jobs": self.jobs,
            "placed": len(self.started),
            "never_placed": len(self.never),
            "never_reasons": dict(Counter(self.never.values()).most_common()),
            "left_waiting": len(self.left_waiting),
            "preemptions": self.stops,
            "preempted_jobs": self.stopped_jobs,
            # Allocated GPU time that was thrown away (runs stopped with progress lost): counted
            # in the allocation figures below, though none of it finished anything.
            "lost_gpu_s": round(self.lost_gpu_s, 1),
            "lost_share": round(self.lost_gpu_s / m.gpu_s, 4) if m.gpu_s else 0.0,
            "queue_delay_s": {k: round(v, 1) for k, v in summary(self.delays).items()},
            "jct_s": {k: round(v, 1) for k, v in summary(self.jcts).items()},
            "active_s": round(active, 1),
            "run_s": round(m.span_s, 1),
            "gpu_alloc_active": round(m.series(active, active)[0], 4) if active else None,
            "gpu_alloc_arrivals": round(to_arrival, 4) if self.last_arrival else None,
            # The same less the runs stops threw away: what went into work that finished.
            "gpu_alloc_arrivals_kept": (
                round(to_arrival - self.lost_by_last_arrival / (m.total_gpus * self.last_arrival), 4)
                if self.last_arrival and m.total_gpus
                else None
            ),
            "gpu_alloc_run": round(m.gpu_s / (m.total_gpus * m.span_s), 4) if m.span_s else None,
            "gpu_alloc_peak": round(m.peak_used / m.total_gpus, 4) if m.total_gpus else 0.0,
            "gpu_alloc_peak_bucket": round(max(series, default=0.0), 4),
            "saturated_s": round(sat, 1),
            "saturated_share_active": round(sat / active, 4) if active else None,
            "gpu_alloc_saturated": round(m.saturated_gpu_s / (m.total_gpus * sat), 4) if sat else None,
            "stranded_gpus_saturated": round(m.stranded_gpu_s / sat, 2) if sat else None,
            "free_gpus_saturated": round(m.free_gpu_s / sat, 2) if sat else None,
            "gpu_alloc_by_tenth": [round(x, 4) for x in m.series(active, active / 10)] if active else [],
            "bucket_s": bucket_s,
            "gpu_alloc_by_bucket": [round(x, 4) for x in series],
            **({"order": self.order} if self.order is not None else {}),
        }


# ------------------------------------------------------------------ the event loop


def replay(
    trace: Trace,
    policy: Policy,
    speedup: float = 1.0,
    bucket_s: float | None = None,
    never: Mapping[str, str] | None = None,
    lose_progress: bool = False,
) -> Run:
    """Replay `trace` under `policy` in simulated time. `bucket_s`: the allocation series' step
    (default: an hour of the trace, 3600 / speedup); `never`: tasks kept out of the queue (by
    default, asked of Muster's core here); `lose_progress`: a stopped job runs its whole duration
    again (no checkpoint), its lost run time counted as waiting."""
    clock = time.perf_counter()
    never = never_fits(trace.nodes, trace.tasks) if never is None else never
    nodes = {n.name: n.copy(empty=True) for n in trace.nodes}
    tasks = {t.name: t for t in trace.tasks}
    jobs = {t.name: PendingJob(t.name, t.config) for t in trace.tasks}
    arrivals = [(t.arrival / speedup, t.name) for t in trace.tasks]  # sorted: the trace is
    job_needs = {t.name: needs(t.config) for t in trace.tasks}
    policy.durations = {t.name: t.duration for t in trace.tasks}  # for an oracle (sjf)
    policy.clock = 0.0
    policy.lose_progress = lose_progress
    meter = Meter(sum(len(n.gpus) for n in trace.nodes))
    arrived_at: dict[str, float] = {}
    started: dict[str, float] = {}
    placed: dict[str, list[Any]] = {}
    ending: list[tuple[float, int, str]] = []  # (finish, order, job); stale once the job is stopped
    live: dict[str, int] = {}  # running job -> the order of its entry in `ending`
    ran_from: dict[str, float] = {}  # running job -> when it (re)started
    left: dict[str, float] = {}  # stopped job -> seconds of its duration still to run
    delay_of: dict[str, float] = {}  # in order of first start
    jct_of: dict[str, float] = {}
    stops = 0
    lost_gpu_s = lost_by_last_arrival = 0.0
    last_arrival = arrivals[-1][0] if arrivals else 0.0
    last_start = 0.0
    wake = math.inf  # when the policy wants to decide again
    queue: list[str] = []
    waiting: Counter[Need] = Counter()  # needs of the waiting jobs' tasks
    with_free = {name for name, node in nodes.items() if node.free_gpu_count}  # nodes with a free GPU
    used = replans = 0
    decide_s = 0.0
    next_arrival = 0
    arrived_order: dict[str, int] = {}
    now = 0.0
    state = (0, False, 0)  # used GPUs, a GPU job waits, stranded GPUs: holds from `now` on
    seq = 0

    def stop(name: str) -> None:
        nonlocal used
        release(nodes, jobs[name].config, placed[name])
        policy.ended(jobs[name], placed[name])
        for spec in placed[name]:
            used -= len(spec.gpus)
            if spec.gpus:
                with_free.add(spec.node)
        del live[name]

    while next_arrival < len(arrivals) or ending:
        t = min(
            arrivals[next_arrival][0] if next_arrival < len(arrivals) else math.inf,
            ending[0][0] if ending else math.inf,
            wake,
        )
        meter.add(now, t, *state)
        now = t
        policy.clock = now
        changed = now >= wake
        stopped_now = False
        wake = math.inf
        while ending and ending[0][0] <= now:
            _, order_no, name = heapq.heappop(ending)
            if live.get(name) != order_no:
                continue  # it was stopped: this end is void
            stop(name)
            if name in left:  # it was stopped once: its wait is all its time not running
                delay_of[name] = now - arrived_at[name] - tasks[name].duration
                jct_of[name] = now - arrived_at[name]
            changed = True
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= now:
            name = arrivals[next_arrival][1]
            next_arrival += 1
            arrived_at[name] = now
            arrived_order[name] = next_arrival
            if name not in never:
                queue.append(name)
                waiting.update(n for _, _, n in job_needs[name])
                changed = True
        if changed and queue:
            replans += 1
            tick = time.perf_counter()
            decided = policy.place(nodes, [jobs[name] for name in queue])
            decide_s += time.perf_counter() - tick
            stopped_now = bool(policy.stops)
            for name in policy.stops:
                if lose_progress:
                    gpus = sum(len(spec.gpus) for spec in placed[name])
                    lost_gpu_s += (now - ran_from[name]) * gpus
                    before = min(now, last_arrival) - min(ran_from[name], last_arrival)
                    lost_by_last_arrival += before * gpus
                stop(name)
                stops += 1
                ran = 0.0 if lose_progress else now - ran_from[name]
                left[name] = left.get(name, tasks[name].duration) - ran
                queue.append(name)
                waiting.update(n for _, _, n in job_needs[name])
            if policy.stops:
                queue.sort(key=lambda name: arrived_order[name])
                policy.stops = []
            for name in queue:
                specs = decided.get(name)
                if specs is None:
                    continue
                allocate(nodes, jobs[name].config, specs)
                policy.started(jobs[name], specs)
                placed[name] = specs
                started.setdefault(name, now)
                last_start = now
                ran_from[name] = now
                waiting.subtract(n for _, _, n in job_needs[name])
                for spec in specs:
                    used += len(spec.gpus)
                    if spec.gpus and not nodes[spec.node].free_gpu_count:
                        with_free.discard(spec.node)
                finish = now + left.get(name, tasks[name].duration)
                if name not in left:
                    delay_of[name] = now - arrived_at[name]
                    jct_of[name] = finish - arrived_at[name]
                seq += 1
                live[name] = seq
                heapq.heappush(ending, (finish, seq, name))
            if decided:
                queue = [name for name in queue if name not in decided]
                waiting = +waiting
        if queue:
            asked = policy.wakeup()
            wake = math.inf if asked is None else max(asked, math.nextafter(now, math.inf))
            if stopped_now:  # the stopped jobs wait again: decide once more, as a cycle would next
                wake = math.nextafter(now, math.inf)
        gpu_waits = any(need.gpus for need in waiting)
        stranded = stranded_gpus((nodes[n] for n in with_free), waiting) if gpu_waits else 0
        state = (used, gpu_waits, stranded)
    order = None
    if isinstance(policy, Sharing):
        order = {
            "order_s": round(policy.order_s, 3),
            "plan_s": round(decide_s - policy.order_s, 3),
            "order_share_of_plan": round(policy.order_s / max(1e-9, decide_s - policy.order_s), 4),
            "given_per_replan": round(policy.given / max(1, replans), 1),
            "keyed_per_replan": round(policy.keyed / max(1, replans), 1),
        }
    return Run(
        order=order,
        policy=policy.name,
        jobs=len(trace.tasks),
        started=started,
        delays=list(delay_of.values()),
        waited=delay_of,
        jcts=list(jct_of.values()),
        stops=stops,
        lost_gpu_s=lost_gpu_s,
        lost_by_last_arrival=lost_by_last_arrival,
        stopped_jobs=len(left),
        last_start=last_start,
        last_arrival=last_arrival,
        never={name: why for name, why in never.items() if name in tasks},
        left_waiting=queue,
        meter=meter,
        replans=replans,
        wall_s=time.perf_counter() - clock,
        decide_s=decide_s,
        bucket_s=bucket_s or 3600.0 / speedup,
    )


# ------------------------------------------------------------------ the report


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def describe(trace: Trace, speedup: float) -> dict[str, Any]:
    m = adjustments(trace.tasks)
    models = Counter(d.model for n in trace.nodes for d in n.gpus)
    gpu_s = sum(t.gpus * t.duration for t in trace.tasks)
    return {
        "trace": trace.source,
        "tasks": len(trace.tasks),
        "nodes": len(trace.nodes),
        "gpus": trace.total_gpus,
        "gpus_by_model": dict(sorted(models.items())),
        "speedup": speedup,
        "fractional_tasks": m.fractional,
        "rounding_gpu_h": round(m.rounding_gpu_s / 3600, 1),
        "rounding_share": round(m.rounding_gpu_s / gpu_s, 4) if gpu_s else 0.0,
        "narrowed_to_one_model": dict(m.narrowed.most_common()),
        "spec_allows_every_model": m.any_model,
        "memory_raised_to_100mb": m.memory_raised,
        "durations_clamped": m.clamped,
        "timing": dict(m.timing),
        "notes": trace.notes,
        "skipped_rows": len(trace.skipped),
        "skipped": trace.skipped[:50],
    }


def print_table(about: dict[str, Any], runs: list[dict[str, Any]], setup_s: float) -> None:
    a = about
    print(
        f"trace    {a['trace']}: {a['tasks']:,} tasks; {a['nodes']:,} nodes, {a['gpus']:,} GPUs "
        f"({', '.join(f'{k} {v}' for k, v in a['gpus_by_model'].items())}); arrivals ×{a['speedup']:g}"
    )
    narrowed = sum(a["narrowed_to_one_model"].values())
    print(
        f"mapping  {a['fractional_tasks']:,} fractional-GPU tasks take a whole GPU "
        f"(+{a['rounding_gpu_h']:,} GPU-hours, {a['rounding_share'] * 100:.1f}% of the trace's GPU-time); "
        f"{narrowed} multi-model gpu_specs narrowed to one model, {a['spec_allows_every_model']} allow any; "
        f"{a['memory_raised_to_100mb']} memory raised to 100 MB; {a['durations_clamped']} durations clamped"
    )
    for note in a["notes"]:
        print(f"         {note}")
    print(f"skipped  {a['skipped_rows']} rows" + "".join(f"\n         {s}" for s in a["skipped"][:10]))
    print(f"setup    {setup_s:.2f} s (reading the trace, asking Muster's core which jobs can never fit)")
    print()
    print(
        f"{'policy':<14} {'wall s':>7} {'decide s':>8} {'replans':>7} {'placed':>6} {'never':>5}"
        f" | {'delay mean':>10} {'p50':>9} {'p99':>10} {'max':>10} | {'JCT mean':>10} {'p50':>10} {'p99':>10}"
        f" {'max':>10} {'stops':>6} {'lost':>6}"
    )
    for r in runs:
        d, j = r["queue_delay_s"], r["jct_s"]
        print(
            f"{r['policy']:<14} {r['wall_s']:>7.2f} {r['decide_s']:>8.2f} {r['replans']:>7} {r['placed']:>6}"
            f" {r['never_placed']:>5} | {_s(d['mean']):>10} {_s(d['p50']):>9} {_s(d['p99']):>10}"
            f" {_s(d['max']):>10} | {_s(j['mean']):>10} {_s(j['p50']):>10} {_s(j['p99']):>10}"
            f" {_s(j['max']):>10} {r['preemptions']:>6} {_share(r['lost_share']):>6}"
        )
    print(
        "(delays and JCT in simulated seconds; a stopped job's delay is all its time not running;"
        " lost: the share of allocated GPU time in runs that stops threw away, with --lose-progress)"
    )
    print()
    print(
        f"{'policy':<14} {'alloc active':>12} {'arrivals':>8} {'kept':>6} {'run':>6} {'peak':>6}"
        f" {'peak bkt':>8}"
        f" | {'saturated s':>11} {'share':>6} {'alloc@sat':>9} {'stranded@sat':>12} {'free@sat':>8}"
    )
    for r in runs:
        print(
            f"{r['policy']:<14} {_share(r['gpu_alloc_active']):>12} {_share(r['gpu_alloc_arrivals']):>8}"
            f" {_share(r['gpu_alloc_arrivals_kept']):>6} {_share(r['gpu_alloc_run']):>6}"
            f" {_share(r['gpu_alloc_peak']):>6} {_share(r['gpu_alloc_peak_bucket']):>8} |"
            f" {_s(r['saturated_s']):>11} {_share(r['saturated_share_active']):>6}"
            f" {_share(r['gpu_alloc_saturated']):>9} {_s2(r['stranded_gpus_saturated']):>12}"
            f" {_s2(r['free_gpus_saturated']):>8}"
        )
    print(
        "(active: from 0 to the last start, after which the run only drains; arrivals: to the last arrival;\n"
        " kept: the same less runs that stops threw away (--lose-progress);\n"
        f" peak bkt: the busiest {runs[0]['bucket_s']:g} s bucket; saturated: a GPU job is waiting;"
        " stranded: free GPUs on nodes where no waiting GPU task fits, time-weighted mean)"
    )
    print()
    print("GPU allocation by tenth of the active period:")
    for r in runs:
        print(f"{r['policy']:<14} " + " ".join(f"{x * 100:5.1f}%" for x in r["gpu_alloc_by_tenth"]))
    shared = [r for r in runs if "order" in r]
    if shared:
        print()
        print(
            f"sharing order: {a['vcs']} VCs, {a['users_per_vc']} users each (priority from QoS), "
            f"{'borrowing' if a['borrow'] else 'not borrowing'} beyond their quotas"
        )
        print(
            f"{'policy':<15} {'order s':>8} {'plan s':>8} {'order/plan':>10} {'given/replan':>12}"
            f" {'keyed/replan':>12}"
        )
        for r in shared:
            o = r["order"]
            print(
                f"{r['policy']:<15} {o['order_s']:>8.2f} {o['plan_s']:>8.2f}"
                f" {o['order_share_of_plan']:>10.1%} {o['given_per_replan']:>12,.0f}"
                f" {o['keyed_per_replan']:>12,.0f}"
            )
    for r in runs:
        if r["never_reasons"]:
            print(f"never placed under {r['policy']}: {r['never_placed']}")
            for why, n in list(r["never_reasons"].items())[:5]:
                print(f"    {n:>5}  {why}")
            break


def _s2(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.replay",
        description=(__doc__ or "").split("\n")[0],
        epilog=f"default trace: {DEFAULT_TRACE}",
    )
    p.add_argument("--trace", type=Path, default=None, help="a trace directory (Alibaba) or a task CSV")
    p.add_argument(
        "--nodes-csv",
        type=Path,
        default=None,
        help="nodes: an Alibaba node list or name,cpus,memory_mb,gpus,gpu_model",
    )
    p.add_argument("--nodes", type=int, default=None, help="nodes: N identical nodes instead of a node CSV")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-model", default="V100")
    p.add_argument("--cpus-per-node", type=int, default=64)
    p.add_argument("--memory-per-node", type=int, default=512 * 1024, help="MB")
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated, of: {', '.join([*POLICIES, *ORDERS])}; all: {','.join(BASELINES)} "
        "(default: muster,fifo,firstfit; with --vcs: muster-vc)",
    )
    p.add_argument(
        "--vcs",
        type=int,
        default=0,
        help="K > 0: tasks drawn into K virtual clusters (1/K of the GPUs each), priority from QoS, "
        "behind the scheduler's sharing order (bench/replay_vcs.py)",
    )
    p.add_argument("--users", type=int, default=4, help="with --vcs: users per virtual cluster")
    p.add_argument(
        "--no-borrow", action="store_true", help="with --vcs: no VC runs beyond its quota (the rest waits)"
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first N tasks (by arrival)")
    p.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by K (durations kept)")
    p.add_argument(
        "--bucket",
        type=float,
        default=None,
        help="seconds per allocation sample (default: an hour of the trace, 3600/K)",
    )
    p.add_argument("--seed", type=int, default=0, help="for tasks whose times are drawn (multigpu50)")
    p.add_argument(
        "--lose-progress",
        action="store_true",
        help="a stopped job (las, muster) starts again from the beginning instead of where it was",
    )
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    chosen = args.policies or ("muster-vc" if args.vcs else "muster,fifo,firstfit")
    if chosen == "all":
        chosen = ",".join(BASELINES)
    policies = [p.strip() for p in chosen.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES and p not in ORDERS]
    if unknown or not policies:
        known = ", ".join([*POLICIES, *ORDERS])
        print(f"unknown policy {', '.join(unknown)}; known: {known}", file=sys.stderr)
        return 2
    if args.vcs < 0 or args.users < 1 or (any(p in ORDERS for p in policies) and not args.vcs):
        print("--vcs K (K >= 1) goes with muster-vc and muster-vc-sort, and --users >= 1", file=sys.stderr)
        return 2
    if args.speedup <= 0 or (args.bucket is not None and args.bucket <= 0):
        print("--speedup and --bucket must be > 0", file=sys.stderr)
        return 2
    trace_path = args.trace or DEFAULT_TRACE
    if args.trace is None and not DEFAULT_TRACE.is_dir():
        print(
            f"the default trace is not there: {DEFAULT_TRACE} (the Alibaba GPU 2023 trace, ../shared/traces "
            f"from the repo); pass --trace DIR_OR_CSV, e.g. --trace {SAMPLE_TRACE.relative_to(ROOT)}",
            file=sys.stderr,
        )
        return 2
    clock = time.perf_counter()
    try:
        given = (
            uniform_nodes(
                args.nodes, args.gpus_per_node, args.gpu_model, args.cpus_per_node, args.memory_per_node
            )
            if args.nodes
            else None
        )
        trace = load(trace_path, args.nodes_csv, given, args.seed, args.limit)
    except TraceError as e:
        print(f"cannot replay: {e}", file=sys.stderr)
        return 2
    never = never_fits(trace.nodes, trace.tasks)
    setup_s = time.perf_counter() - clock

    def policy(name: str) -> Policy:
        if name in ORDERS:
            facts = facts_for(trace, args.vcs, args.users, args.speedup)
            return Sharing(name, facts, vcs_for(trace.nodes, args.vcs, not args.no_borrow), trace.nodes)
        return POLICIES[name]()

    runs = [
        replay(trace, policy(name), args.speedup, args.bucket, never, args.lose_progress).report()
        for name in policies
    ]
    about = describe(trace, args.speedup)
    about["stops_lose_progress"] = args.lose_progress
    if args.vcs:
        about.update(vcs=args.vcs, users_per_vc=args.users, borrow=not args.no_borrow)
    if not args.json:
        print_table(about, runs, setup_s)
    print(json.dumps({"bench": "replay", **about, "setup_s": round(setup_s, 3), "policies": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
