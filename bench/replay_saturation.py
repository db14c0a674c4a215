"""Saturation with fractional GPUs kept: how much of a cluster's GPUs a placement rule puts to use
before it starts refusing work, with tasks that ask for part of one GPU.

    python -m bench.replay_saturation [--trace DIR_OR_CSV] [--rules whole,share,fgd] [--refused 0.05]
                                      [--limit N] [--json]

The trace's tasks (`bench/replay_trace.py`, which keeps each task's `gpu_milli`) arrive in trace
order and never leave. Each is placed on the first try or refused. The useful GPU share is the GPUs
the placed tasks asked for (a fraction counts as its fraction, not as the whole GPU it may hold),
over the cluster's GPUs, at the first task after which the refused GPU demand reaches `--refused`
(5 %) of the GPU demand arrived so far. The first refusal (which task, and the useful share then)
is reported beside it. Rules:

  * `whole`: what Muster does today. A fractional task takes a whole GPU. The node is chosen by
    best fit (fewest free GPUs left, then fewest CPUs, then least memory, then name).
  * `share`: the same best fit, but a fractional task may share a GPU, and free GPUs are counted
    in shares: the node with the least free GPU capacity left wins; on it, the GPU with the least
    share left (an already shared one before an untouched one). A GPU is whole (one task's) or
    shared (fractional tasks only), never both.
  * `fgd`: FGD-like (Weng et al., "Beware of Fragmentation", ATC'23). Fractional tasks share as
    in `share`, and the placement chosen is the one that raises the node's expected GPU
    fragmentation least. A node's fragmentation for a task shape is its free GPU capacity that
    this shape could not use: all of it where the shape cannot run there (GPU model, too few free
    GPUs, or too few CPUs or too little memory left for the shape's median task); for a fraction
    d, the GPUs with less than d free; for whole GPUs, the partly used ones. The expectation is
    over the trace's GPU task shapes (GPU count, share, model), weighted by how often each
    occurs. Ties go by `share`'s best fit. Without the CPU and memory term it did no better than
    `share` on the Alibaba trace: its refusals there are 1-GPU tasks that find free GPUs only on
    nodes whose CPUs or memory are spent.

  * `muster-whole`, `muster`: Muster's own placement core (services/scheduler/placement.py,
    `Cluster.place_alone` then `Cluster.allocate`, as the scheduler commits a plan), each task a
    one-task job; `muster-whole` with every share rounded up to a whole GPU (what a config could
    ask before fractional gpuNumber), `muster` with the shares kept (gpuNumber 0.05 ... 0.81).

CPUs and memory are whole-node checks, as in Muster's placement.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.replay import DEFAULT_TRACE, SAMPLE_TRACE
from bench.replay_trace import Trace, TraceError, TraceTask, load
from muster.services.scheduler import placement

WHOLE = 1000  # milli-GPUs in one GPU
RULES = ("whole", "share", "fgd", "muster-whole", "muster")


@dataclass(frozen=True)
class Ask:
    """What one task asks of one node: `gpus` whole GPUs, or (gpus 1) `milli` < 1000 of one."""

    cpus: int
    memory_mb: int
    gpus: int
    milli: int  # WHOLE unless a fraction of one GPU
    model: str | None  # lower case; None: any
    share: float  # the GPUs the task asked for, a fraction as the fraction (under `whole` too)


@dataclass
class Node:
    name: str
    model: str  # lower case
    cpus: int  # free
    memory_mb: int  # free
    free: list[int]  # milli-GPUs free on each GPU (WHOLE: untouched)

    def untouched(self) -> int:
        return sum(1 for f in self.free if f == WHOLE)


def asks_of(trace: Trace, keep_fractions: bool) -> list[Ask]:
    out = []
    for task in trace.tasks:
        roles = task.config.taskRoles
        if len(roles) != 1 or roles[0].taskNumber != 1:
            raise TraceError(f"{task.name}: the saturation mode takes single-task jobs only")
        role = roles[0]
        model = task.config.gpuType.lower() if task.config.gpuType and role.gpuNumber else None
        asked = task.gpu_milli if role.gpuNumber == 1 else WHOLE
        share = asked / WHOLE if asked < WHOLE else float(role.gpuNumber)
        milli = asked if keep_fractions else WHOLE
        out.append(Ask(role.cpuNumber, role.memoryMB, role.gpuNumber, milli, model, share))
    return out


def fits_host(node: Node, ask: Ask) -> bool:
    """CPUs, memory and model."""
    return (
        node.cpus >= ask.cpus
        and node.memory_mb >= ask.memory_mb
        and (ask.model is None or not ask.gpus or ask.model == node.model)
    )


def gpu_choices(free: Sequence[int], ask: Ask) -> list[list[int]]:
    """The GPU indices `ask` may take on a node with these free shares: for whole GPUs, the first
    untouched ones; for a fraction, one GPU per distinct free share that fits (the first index
    with it). Empty: it cannot run there."""
    if not ask.gpus:
        return [[]]
    if ask.milli >= WHOLE:
        untouched = [i for i, f in enumerate(free) if f == WHOLE]
        return [untouched[: ask.gpus]] if len(untouched) >= ask.gpus else []
    seen: dict[int, int] = {}
    for i, f in enumerate(free):
        if f >= ask.milli and f not in seen:
            seen[f] = i
    return [[i] for i in seen.values()]


def after(free: Sequence[int], ask: Ask, gpus: Sequence[int]) -> list[int]:
    taken = ask.milli if ask.milli < WHOLE else WHOLE
    return [f - taken if i in gpus else f for i, f in enumerate(free)]


class Fragmentation:
    """Expected GPU fragmentation of a node state over the workload's GPU task shapes (`fgd`).
    A shape is (GPU count, share, model) with the median CPUs and memory of its tasks. The result
    is cached per (model, free shares, and which shapes' CPUs and memory still fit)."""

    def __init__(self, asks: Sequence[Ask]) -> None:
        groups: dict[tuple[int, int, str | None], list[Ask]] = {}
        for a in asks:
            if a.gpus:
                groups.setdefault((a.gpus, a.milli, a.model), []).append(a)
        total = sum(len(g) for g in groups.values())
        self.cpus = sorted({statistics.median_low([a.cpus for a in g]) for g in groups.values()})
        self.memory = sorted({statistics.median_low([a.memory_mb for a in g]) for g in groups.values()})
        self.shapes = [
            (
                gpus,
                milli,
                model,
                self.cpus.index(statistics.median_low([a.cpus for a in g])),
                self.memory.index(statistics.median_low([a.memory_mb for a in g])),
                len(g) / total,
            )
            for (gpus, milli, model), g in groups.items()
        ]
        self._cache: dict[tuple[str, tuple[int, ...], int, int], float] = {}

    def of(self, model: str, free: Sequence[int], cpus: int, memory_mb: int) -> float:
        key = (
            model,
            tuple(sorted(free)),
            bisect.bisect_right(self.cpus, cpus),
            bisect.bisect_right(self.memory, memory_mb),
        )
        if key not in self._cache:
            self._cache[key] = self._compute(*key)
        return self._cache[key]

    def _compute(self, model: str, free: tuple[int, ...], cpu_level: int, memory_level: int) -> float:
        total = sum(free) / WHOLE
        untouched = free.count(WHOLE)
        partial = (sum(free) - untouched * WHOLE) / WHOLE
        expected = 0.0
        for gpus, milli, shape_model, cpus, memory, p in self.shapes:
            if (
                (shape_model is not None and shape_model != model)
                or cpus >= cpu_level
                or memory >= memory_level
            ):
                lost = total  # it cannot run here at all
            elif milli < WHOLE:
                lost = sum(f for f in free if f < milli) / WHOLE
            else:
                lost = partial if untouched >= gpus else total
            expected += p * lost
        return expected


def place(nodes: Sequence[Node], ask: Ask, frag: Fragmentation | None) -> tuple[Node, list[int]] | None:
    """The node and GPUs for `ask` under the rule (`frag` for `fgd`), or None: refused."""
    best: tuple[Any, ...] | None = None
    chosen: tuple[Node, list[int]] | None = None
    for node in nodes:
        if not fits_host(node, ask):
            continue
        before = frag.of(node.model, node.free, node.cpus, node.memory_mb) if frag is not None else 0.0
        for gpus in gpu_choices(node.free, ask):
            left = after(node.free, ask, gpus)
            if ask.gpus:
                fit: tuple[Any, ...] = (
                    sum(left),
                    left[gpus[0]] if ask.milli < WHOLE else 0,
                    node.cpus - ask.cpus,
                    node.memory_mb - ask.memory_mb,
                    node.name,
                )
            else:  # a CPU-only task: nodes without GPUs first, then the fewest GPUs
                fit = (
                    bool(node.free),
                    len(node.free),
                    node.cpus - ask.cpus,
                    node.memory_mb - ask.memory_mb,
                    node.name,
                )
            delta = 0.0
            if frag is not None:
                delta = (
                    frag.of(node.model, left, node.cpus - ask.cpus, node.memory_mb - ask.memory_mb) - before
                )
            key = (delta, *fit)
            if best is None or key < best:
                best, chosen = key, (node, gpus)
    return chosen


@dataclass
class Saturation:
    rule: str
    tasks: int
    gpus: int
    threshold: float
    reached_at: int | None  # tasks arrived when the refused demand first reached the threshold
    useful_share: float  # placed useful GPUs / cluster GPUs then (at the end if never reached)
    held_share: float  # GPUs held (a shared GPU counts whole) / cluster GPUs then
    refused_share: float  # refused / arrived GPU demand then
    first_refusal: int | None  # the task that was refused first (its position, from 1)
    useful_at_first_refusal: float | None
    wall_s: float

    def report(self) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


class MusterPlacer:
    """Muster's placement core as the saturation loop drives it: one job per task, placed alone
    on the live cluster and committed, or refused."""

    def __init__(self, trace: Trace, keep_fractions: bool) -> None:
        self.cluster = placement.Cluster(n.copy(empty=True) for n in trace.nodes)
        self.jobs = [self._job(i, t, keep_fractions) for i, t in enumerate(trace.tasks)]

    @staticmethod
    def _job(i: int, task: TraceTask, keep_fractions: bool) -> placement.PendingJob:
        config = task.config
        role = config.taskRoles[0]
        if keep_fractions and role.gpuNumber == 1 and task.gpu_milli < WHOLE:
            role = role.model_copy(update={"gpuNumber": task.gpu_milli / WHOLE})
            config = config.model_copy(update={"taskRoles": [role]})
        return placement.PendingJob(f"t{i}", config)

    def place(self, position: int) -> bool:
        job = self.jobs[position]
        specs = self.cluster.place_alone(job)
        if specs is None:
            return False
        self.cluster.allocate(job.config, specs)
        return True

    def held(self) -> int:
        return sum(len(n.used_gpus) + len(n.shared) for n in self.cluster.nodes.values())


def saturate(trace: Trace, rule: str, threshold: float = 0.05) -> Saturation:
    clock = time.perf_counter()
    asks = asks_of(trace, keep_fractions=rule not in ("whole", "muster-whole"))
    muster = MusterPlacer(trace, rule == "muster") if rule.startswith("muster") else None
    frag = Fragmentation(asks) if rule == "fgd" else None
    nodes = [
        Node(
            n.name,
            (n.gpus[0].model if n.gpus else "").lower(),
            n.cpus,
            n.memory_mb,
            [WHOLE] * len(n.gpus),
        )
        for n in trace.nodes
    ]
    total = sum(len(n.free) for n in nodes)
    arrived = refused = useful = 0.0
    first: int | None = None
    useful_first: float | None = None
    reached: int | None = None
    for position, ask in enumerate(asks, 1):
        arrived += ask.share
        if muster is not None:
            if muster.place(position - 1):
                useful += ask.share
            else:
                refused += ask.share
                if first is None:
                    first, useful_first = position, useful / total
            if ask.gpus and refused >= threshold * arrived and refused > 0:
                reached = position
                break
            continue
        where = place(nodes, ask, frag)
        if where is None:
            refused += ask.share
            if first is None:
                first, useful_first = position, useful / total
        else:
            node, gpus = where
            node.cpus -= ask.cpus
            node.memory_mb -= ask.memory_mb
            node.free = after(node.free, ask, gpus)
            useful += ask.share
        if ask.gpus and refused >= threshold * arrived and refused > 0:
            reached = position
            break
    held = muster.held() if muster is not None else sum(1 for n in nodes for f in n.free if f < WHOLE)
    return Saturation(
        rule,
        len(asks),
        total,
        threshold,
        reached,
        useful / total,
        held / total,
        refused / arrived if arrived else 0.0,
        first,
        useful_first,
        time.perf_counter() - clock,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.replay_saturation", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--trace", type=Path, default=None, help="a trace directory (Alibaba) or a task CSV")
    p.add_argument("--nodes-csv", type=Path, default=None)
    p.add_argument("--rules", default=",".join(RULES), help=f"comma-separated, of: {', '.join(RULES)}")
    p.add_argument("--refused", type=float, default=0.05, help="share of the arrived GPU demand refused")
    p.add_argument("--limit", type=int, default=None, help="only the first N tasks")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    args = p.parse_args(argv)
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    if not rules or any(r not in RULES for r in rules) or not 0 < args.refused < 1:
        print(f"--rules takes {', '.join(RULES)}; --refused a share in (0, 1)", file=sys.stderr)
        return 2
    path = args.trace or DEFAULT_TRACE
    if args.trace is None and not DEFAULT_TRACE.is_dir():
        print(
            f"the default trace is not there: {DEFAULT_TRACE}; pass --trace, e.g. {SAMPLE_TRACE}",
            file=sys.stderr,
        )
        return 2
    try:
        trace = load(path, args.nodes_csv, None, 0, args.limit)
        runs = [saturate(trace, rule, args.refused).report() for rule in rules]
    except TraceError as e:
        print(f"cannot replay: {e}", file=sys.stderr)
        return 2
    if not args.json:
        print(
            f"trace {trace.source}: {len(trace.tasks):,} tasks on {len(trace.nodes):,} nodes, "
            f"{trace.total_gpus:,} GPUs"
        )
        print(
            f"tasks in trace order, never leaving; measured when {args.refused:.0%} of the GPU demand "
            "is refused"
        )
        print(
            f"{'rule':<6} {'useful':>7} {'held':>7} {'refused':>8} {'at task':>8} | {'first refusal':>13}"
            f" {'useful then':>11} | {'wall s':>6}"
        )
        for r in runs:
            at = "never" if r["reached_at"] is None else f"{r['reached_at']:,}"
            first = "-" if r["first_refusal"] is None else f"{r['first_refusal']:,}"
            then = "-" if r["useful_at_first_refusal"] is None else f"{r['useful_at_first_refusal']:.1%}"
            print(
                f"{r['rule']:<6} {r['useful_share']:>7.1%} {r['held_share']:>7.1%} {r['refused_share']:>8.1%}"
                f" {at:>8} | {first:>13} {then:>11} | {r['wall_s']:>6.2f}"
            )
        print(
            "(useful: the GPUs placed tasks asked for; held: GPUs with anything on them; "
            "at task: when measured)"
        )
    print(
        json.dumps(
            {"bench": "replay_saturation", "trace": trace.source, "refused": args.refused, "rules": runs}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
