"""The placement policies `bench.replay` compares, each as `(nodes, queue) -> {job_id: [TaskSpec]}`.

  * `muster`: the scheduler's own core, `muster.services.scheduler.placement.plan` (FIFO, best fit,
    backfill around a reserved head), with the service's backfill window, lending the head's
    reservation as the service does: jobs behind it run on what it holds, and running jobs that
    arrived after it are stopped (keeping their progress) once it fits on what they hold.
  * `muster-reserve`: the same without lending: the claims idle until the head fits (the rule
    before issue 27).
  * `muster-las`: `muster` with the queue in least-attained-service order (Tiresias' levels, as
    `las`) instead of arrival order, through the same core (`MusterLeastAttained`).
  * `muster-fifo-las`: `muster-las`, except that a job that has waited as long as a FIFO shadow
    says strict FIFO would have made it wait goes first, in arrival order, and is not stopped by
    the least-attained order (`MusterFifoBounded`): the scheduler's default order (attained.py).
  * `fifo`: strict FIFO. Jobs start in arrival order only; the first that does not fit blocks
    every later one (no backfill). Nodes are chosen by the same best-fit rank as Muster's.
  * `firstfit`: FIFO order, greedy: any job that fits starts, each task on the first node in name
    order that can host it (no best fit, no reservation).
  * `greedy`: backfill over the whole queue with no reservation: every waiting job, in arrival
    order, starts if it fits now (best-fit nodes, as Muster's). Large jobs can starve.
  * `sjf`: oracle shortest job first, non-preemptive: the queue in order of the trace's durations
    (ties: arrival), every job that fits starts (best fit). An oracle: no scheduler knows them.
  * `las`: least attained service, preemptive (Tiresias' discretised LAS, NSDI'19): a job's
    attained service is the GPU-seconds it has run; the queue is ordered by its *level* (`LEVELS`:
    below 1 GPU-hour, below 10, below 100, beyond), then arrival; every job that fits starts (best
    fit); a waiting job that does not fit stops running jobs of a higher level (the newest first)
    when that lets it start. A stopped job keeps its progress and waits again at its level.

A policy decides, it does not commit: it may place tentatively on `nodes` but leaves them as they
were; the replay allocates what it returns. Jobs that can never fit on the nodes are kept out of
the queue by the replay (with Muster's reason), so no policy is asked to wait for them.

`muster` is the core as the scheduler service runs it (`Kept`): one `Cluster` and `Capacity`
built on the first decision and kept in step by `started`/`ended`, so a decision costs what it
tries, not a rebuild of the node index. `muster_snapshot` hands `plan` a snapshot instead (an
index rebuilt per decision, a pass over the cluster); both start exactly the same jobs on the same
nodes (a test holds them to it), only the replay's speed differs.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from muster.services.scheduler import attained
from muster.services.scheduler.placement import (
    FED_CPUS,
    Capacity,
    Cluster,
    Loan,
    NodeState,
    PendingJob,
    allocate,
    plan,
    release,
    starved,
)
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import TaskSpec

Placements = dict[str, list[TaskSpec]]
Decide = Callable[[Mapping[str, NodeState], Sequence[PendingJob]], Placements]
WINDOW = 500  # the scheduler service's default backfill window (MUSTER_BACKFILL_WINDOW)


class Policy:
    """A policy as the replay drives it: `place` decides; `started`/`ended` tell a stateful core
    what the replay committed (a stateless one ignores them). The replay sets `clock` (simulated
    seconds) before each call and hands an oracle the trace's `durations` (job -> seconds). A
    preemptive policy lists in `stops` the running jobs its last `place` needs stopped first (its
    placements count on their resources); the replay stops them (`ended`), runs them again later
    from where they were, and asks `wakeup` when it next wants to decide with nothing arriving or
    ending (None: never)."""

    def __init__(self, name: str, decide: Decide) -> None:
        self.name = name
        self._decide = decide
        self.clock = 0.0
        self.durations: Mapping[str, float] = {}
        self.lose_progress = False  # whether a stopped job starts over (set by the replay)
        self.stops: list[str] = []

    def wakeup(self) -> float | None:
        return None

    def place(self, nodes: Mapping[str, NodeState], queue: Sequence[PendingJob]) -> Placements:
        return self._decide(nodes, queue)

    def started(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        """`tasks` of `job` were allocated on the replay's nodes."""

    def ended(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        """`tasks` of `job` were released from the replay's nodes."""


# ------------------------------------------------------------------ one task's needs


@dataclass(frozen=True)
class Need:
    """What one task needs on one node (the baselines' view of a task, as Muster's feasibility)."""

    gpus: int
    cpus: int
    memory_mb: int
    model: str | None  # lower-cased gpuType of a GPU task; None: any model


def needs(config: JobConfig) -> list[tuple[int, int, Need]]:
    """(role number, task index, need) of every task, largest first (GPUs, CPUs, memory), as
    Muster places a gang's tasks."""
    model = config.gpuType.lower() if config.gpuType else None
    out = [
        (role_no, index, Need(r.gpuNumber, r.cpuNumber, r.memoryMB, model if r.gpuNumber else None))
        for role_no, r in enumerate(config.taskRoles)
        for index in range(r.taskNumber)
    ]
    return sorted(out, key=lambda t: (-t[2].gpus, -t[2].cpus, -t[2].memory_mb, t[0], t[1]))


def fits(node: NodeState, need: Need) -> bool:
    """Enough free CPUs, memory and GPUs of the model on the node (cheap checks first)."""
    if node.free_cpus < need.cpus or node.free_memory_mb < need.memory_mb:
        return False
    if node.free_gpu_count < need.gpus:
        return False
    return need.model is None or not need.gpus or len(node.free_gpus(need.model)) >= need.gpus


def best_fit_rank(node: NodeState, need: Need) -> tuple[int | str, ...]:
    """Muster's best-fit rank (smaller first): fewest GPUs left, then (a GPU task) fewest of them
    starved, then CPUs, memory, name; CPU-only tasks prefer nodes without GPUs."""
    gpus, cpus = node.free_gpu_count - need.gpus, node.free_cpus - need.cpus
    memory_mb = node.free_memory_mb - need.memory_mb
    if need.gpus:
        return (gpus, starved(gpus, cpus), cpus, memory_mb, node.name)
    return (bool(node.gpus), gpus, cpus, memory_mb, node.name)


def best_fit(candidates: Iterable[NodeState], need: Need) -> NodeState | None:
    """The fitting node of least `best_fit_rank`, by a pass over `candidates` (the reference that
    `NodeIndex.best` answers faster)."""
    best: NodeState | None = None
    rank: tuple[int | str, ...] = ()
    for node in candidates:
        if fits(node, need):
            mine = best_fit_rank(node, need)
            if best is None or mine < rank:
                best, rank = node, mine
    return best


def first_fit(candidates: Iterable[NodeState], need: Need) -> NodeState | None:
    """The first of `candidates` that fits (pass them in name order), by a pass over them."""
    return next((node for node in candidates if fits(node, need)), None)


# ------------------------------------------------------------------ an index for the baselines

Group = tuple[bool, int]  # (has GPUs, free GPUs)
Entry = tuple[int, int, str]  # (free CPUs, free memory, name): best-fit order inside a group


class NodeIndex:
    """The nodes grouped by (has GPUs, free GPUs), each group kept in best-fit order and in name
    order, so that a baseline finds its node without a pass over the cluster: the first group a
    need can use, then the first entry there with the CPUs, memory and model, is the node of least
    `best_fit_rank`; the least name over the groups' first fitting nodes is the first fit.

    It reads the `NodeState`s it was built on: `touch(name)` after every change of a node."""

    def __init__(self, nodes: Mapping[str, NodeState]) -> None:
        self.nodes = nodes
        self._at: dict[str, tuple[Group, Entry]] = {}
        self._ranked: dict[Group, list[Entry]] = {}
        self._named: dict[Group, list[str]] = {}
        self.most_gpus = 0
        for name in nodes:
            self.touch(name)

    def touch(self, name: str) -> None:
        """Put the node where its state now says."""
        old = self._at.pop(name, None)
        if old is not None:
            ranked, named = self._ranked[old[0]], self._named[old[0]]
            del ranked[bisect.bisect_left(ranked, old[1])]
            del named[bisect.bisect_left(named, name)]
        node = self.nodes[name]
        group = (bool(node.gpus), node.free_gpu_count)
        entry = (node.free_cpus, node.free_memory_mb, name)
        bisect.insort(self._ranked.setdefault(group, []), entry)
        bisect.insort(self._named.setdefault(group, []), name)
        self._at[name] = (group, entry)
        self.most_gpus = max(self.most_gpus, len(node.gpus))

    def _groups(self, need: Need) -> list[Group]:
        """The groups a need may use, in best-fit order (fewest GPUs left first; for a CPU-only
        task, nodes without GPUs first)."""
        if need.gpus:
            return [(True, k) for k in range(need.gpus, self.most_gpus + 1)]
        return [(False, 0), *((True, k) for k in range(self.most_gpus + 1))]

    def best(self, need: Need) -> NodeState | None:
        """As `Cluster.best`: the least-starved fitting node of the first group that has one."""
        for group in self._groups(need):
            node = self._least_starved(self._ranked.get(group, []), need, group[1] - need.gpus)
            if node is not None:
                return node
        return None

    def _least_starved(self, entries: list[Entry], need: Need, left: int) -> NodeState | None:
        """The first fitting entry from the CPUs that starve none of the `left` GPUs, else the
        first of the least-starved level below them (`Cluster._least_starved`)."""
        if not need.gpus or left <= 0:
            return self._from(entries, need, need.cpus)
        fed = need.cpus + left * FED_CPUS
        node = self._from(entries, need, fed)
        if node is not None:
            return node
        for i in range(
            bisect.bisect_left(entries, (fed,)) - 1, bisect.bisect_left(entries, (need.cpus,)) - 1, -1
        ):
            top = self.nodes[entries[i][2]]
            if entries[i][1] >= need.memory_mb and fits(top, need):
                level = starved(left, top.free_cpus - need.cpus)
                return self._from(entries, need, need.cpus + (left - level) * FED_CPUS)
        return None

    def _from(self, entries: list[Entry], need: Need, cpus: int) -> NodeState | None:
        """The first entry with at least `cpus` free that fits `need`."""
        for i in range(bisect.bisect_left(entries, (cpus,)), len(entries)):
            node = self.nodes[entries[i][2]]
            if entries[i][1] >= need.memory_mb and fits(node, need):
                return node
        return None

    def first(self, need: Need) -> NodeState | None:
        found: str | None = None
        for group in self._groups(need):
            for name in self._named.get(group, []):
                if found is not None and name >= found:
                    break
                if fits(self.nodes[name], need):
                    found = name
                    break
        return None if found is None else self.nodes[found]


Choose = Callable[[NodeIndex, Need], NodeState | None]


class Kept:
    """What a baseline keeps between decisions: the index (kept in step with the nodes by
    `touch`) and each job's task needs, worked out once per job rather than once per decision."""

    def __init__(self, nodes: Mapping[str, NodeState]) -> None:
        self.nodes = nodes
        self.index = NodeIndex(nodes)
        self._needs: dict[str, list[tuple[int, int, Need]]] = {}

    def needs(self, job: PendingJob) -> list[tuple[int, int, Need]]:
        if job.job_id not in self._needs:
            self._needs[job.job_id] = needs(job.config)
        return self._needs[job.job_id]

    def forget(self, job_id: str) -> None:
        self._needs.pop(job_id, None)


class _Tentative:
    """Placements made on the live nodes during one decision, all released (and the index put
    back) before it returns. A need that found no node is remembered: placing only lowers what is
    free, so it finds none again until the decision ends."""

    def __init__(self, kept: Kept) -> None:
        self.kept, self.nodes, self.index = kept, kept.nodes, kept.index
        self.failed: set[Need] = set()
        self.done: list[tuple[JobConfig, list[TaskSpec]]] = []

    def _change(self, apply: Callable[..., None], config: JobConfig, specs: list[TaskSpec]) -> None:
        apply(self.nodes, config, specs)
        for spec in specs:
            self.index.touch(spec.node)

    def place(self, job: PendingJob, choose: Choose) -> list[TaskSpec] | None:
        """The job's tasks, each where `choose` puts it, kept; None (nothing kept) if one fails."""
        specs: list[TaskSpec] = []
        for role_no, index, need in self.kept.needs(job):
            node = None if need in self.failed else choose(self.index, need)
            if node is None:
                if not specs:  # failed on the decision's own state, not beside this gang's tasks
                    self.failed.add(need)
                else:
                    self._change(release, job.config, specs)
                return None
            role = job.config.taskRoles[role_no]
            gpus = node.free_gpus(need.model)[: need.gpus]
            spec = TaskSpec(role=role.name, role_no=role_no, index=index, node=node.name, gpus=gpus)
            self._change(allocate, job.config, [spec])
            specs.append(spec)
        specs.sort(key=lambda t: (t.role_no, t.index))
        self.done.append((job.config, specs))
        return specs

    def undo(self) -> None:
        for config, specs in reversed(self.done):
            self._change(release, config, specs)
        self.done.clear()


# ------------------------------------------------------------------ the policies


def muster(nodes: Mapping[str, NodeState], queue: Sequence[PendingJob]) -> Placements:
    """The scheduler's placement core on a snapshot of the nodes (it copies them)."""
    return plan(nodes.values(), queue, window=WINDOW).placements


class MusterKept(Policy):
    """The scheduler's placement core as the service keeps it: a `Cluster` (the indexed nodes)
    and a `Capacity` (the same nodes empty) built for the nodes of the first decision, then kept
    in step with what the replay commits, as the service's view keeps them with the bus.

    `lend`: jobs behind the protected head start on its claimed resources, and running jobs that
    arrived after the head are stopped (keeping their progress) as soon as the head would fit on
    what is free plus what they hold (`placement` module docstring); without it the claims idle
    until the head fits (the rule before issue 27, kept as `muster-reserve` to measure against).
    `snapshot`: rebuild the index from the nodes for every decision instead (the same starts,
    slower)."""

    def __init__(self, name: str = "muster", lend: bool = True, snapshot: bool = False) -> None:
        super().__init__(name, self._decide)
        self.lend, self.snapshot = lend, snapshot
        self._nodes: Mapping[str, NodeState] | None = None
        self._cluster = Cluster()
        self._capacity = Capacity()
        self.running: dict[str, Loan] = {}  # oldest start first
        self.arrived: dict[str, int] = {}  # job -> its place in arrival order (the queue's order)

    def _stoppable(self, waiting: str) -> list[Loan]:
        """The running jobs that arrived after `waiting`, oldest start first."""
        mine, arrived = self.arrived[waiting], self.arrived
        return [loan for job_id, loan in self.running.items() if arrived[job_id] > mine]

    def _decide(self, nodes: Mapping[str, NodeState], queue: Sequence[PendingJob]) -> Placements:
        if self._nodes is not nodes or self.snapshot:
            self._nodes, self._cluster, self._capacity = (
                nodes,
                Cluster(nodes.values()),
                Capacity(nodes.values()),
            )
        for job in queue:
            self.arrived.setdefault(job.job_id, len(self.arrived))
        result = self._cluster.plan(
            queue,
            self._capacity,
            window=WINDOW,
            stoppable=self._stoppable if self.lend else None,
        )
        self.stops = list(result.stop)
        return result.placements

    def started(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        self.running[job.job_id] = Loan(job.job_id, job.config, list(tasks))
        if self._nodes is not None and not self.snapshot:
            self._cluster.allocate(job.config, tasks)

    def ended(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        self.running.pop(job.job_id, None)
        if self._nodes is not None and not self.snapshot:
            self._cluster.release(job.config, tasks)


def strict_fifo(
    nodes: Mapping[str, NodeState], queue: Sequence[PendingJob], kept: Kept | None = None
) -> Placements:
    """Arrival order only: stop at the first job that does not fit (best-fit nodes). `kept`: the
    state kept in step with `nodes` since an earlier decision (built here when None)."""
    out: Placements = {}
    tentative = _Tentative(kept or Kept(nodes))
    try:
        for job in queue:
            specs = tentative.place(job, NodeIndex.best)
            if specs is None:
                break
            out[job.job_id] = specs
    finally:
        tentative.undo()
    return out


def _greedy(
    nodes: Mapping[str, NodeState],
    queue: Sequence[PendingJob],
    kept: Kept | None,
    choose: Choose,
) -> Placements:
    """`queue` in its order, skipping what does not fit (no reservation), each task on the node
    `choose` picks (NodeIndex.first or NodeIndex.best)."""
    out: Placements = {}
    tentative = _Tentative(kept or Kept(nodes))
    try:
        for job in queue:
            specs = tentative.place(job, choose)
            if specs is not None:
                out[job.job_id] = specs
    finally:
        tentative.undo()
    return out


def greedy_first_fit(
    nodes: Mapping[str, NodeState], queue: Sequence[PendingJob], kept: Kept | None = None
) -> Placements:
    """Arrival order, skipping what does not fit; each task on the first node by name that fits."""
    return _greedy(nodes, queue, kept, NodeIndex.first)


def greedy_best_fit(
    nodes: Mapping[str, NodeState], queue: Sequence[PendingJob], kept: Kept | None = None
) -> Placements:
    """`queue` in its order, skipping what does not fit (no reservation); best-fit nodes."""
    return _greedy(nodes, queue, kept, NodeIndex.best)


class Indexed(Policy):
    """A baseline with its `Kept` state (built on the first decision, for the nodes it is handed
    then, kept in step by `started`/`ended`): a decision costs what it tries, not a pass over the
    cluster."""

    def __init__(
        self, name: str, decide: Callable[[Mapping[str, NodeState], Sequence[PendingJob], Kept], Placements]
    ) -> None:
        super().__init__(name, lambda nodes, queue: decide(nodes, queue, self._kept_for(nodes)))
        self._kept: Kept | None = None

    def _kept_for(self, nodes: Mapping[str, NodeState]) -> Kept:
        if self._kept is None or self._kept.nodes is not nodes:
            self._kept = Kept(nodes)
        return self._kept

    def started(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        if self._kept is not None:
            self._kept.forget(job.job_id)
            for task in tasks:
                self._kept.index.touch(task.node)

    def ended(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        if self._kept is not None:
            for task in tasks:
                self._kept.index.touch(task.node)


class ShortestFirst(Indexed):
    """Oracle SJF: the queue by the trace's duration (ties: arrival), then `greedy_best_fit`."""

    def __init__(self) -> None:
        super().__init__("sjf", self._shortest_first)

    def _shortest_first(
        self, nodes: Mapping[str, NodeState], queue: Sequence[PendingJob], kept: Kept
    ) -> Placements:
        order = sorted(range(len(queue)), key=lambda i: (self.durations[queue[i].job_id], i))
        return greedy_best_fit(nodes, [queue[i] for i in order], kept)


LEVELS = attained.LEVELS  # LAS thresholds of attained GPU-seconds (the scheduler's)
MAX_VICTIMS = 64  # running jobs a waiting one may try to stop, per decision


def level(attained_gpu_s: float) -> int:
    """The LAS queue of a job that has run `attained_gpu_s` GPU-seconds (0: the first)."""
    return bisect.bisect_right(LEVELS, attained_gpu_s)


class LeastAttained(Indexed):
    """Discretised least-attained-service, preemptive (see the module docstring).

    Why levels and not the exact attained service: ordered by the exact figure, two jobs of equal
    GPUs would overtake each other at every decision, each stop a checkpoint and restart in a real
    cluster. With levels a job is stopped only for a job of a lower level, and within a level jobs
    keep arrival order without preemption, so two jobs stop each other back and forth at most once
    per level the stopper climbs (Tiresias' 2D-LAS does the same; its starvation guard, which
    moves a job that waited long back to the first queue, is not modelled: a long job can wait
    behind a stream of short ones). The thresholds grow
    ×10 from one GPU-hour: a Philly-shaped trace runs minutes to days on 1-64 GPUs, so a short
    debug job passes every long one and a day-long 8-GPU job has left the first queues in hours.
    A stop is free here (no checkpoint cost)."""

    def __init__(self) -> None:
        super().__init__("las", self._least_attained)
        self.attained: dict[str, float] = {}  # job -> GPU-seconds run before its current start
        self.running: dict[str, tuple[PendingJob, list[TaskSpec], float, int]] = {}  # start, GPUs
        # Running jobs by level, kept by the times they cross into the next (a heap of (time, job,
        # its start): an entry of a job since stopped is void), so that neither finding victims
        # nor the next wake-up is a pass over every running job.
        self.level_of: dict[str, int] = {}
        self.by_level: list[dict[str, float]] = [{} for _ in range(len(LEVELS) + 1)]  # job -> start
        self.crossings: list[tuple[float, str, float]] = []

    def service(self, job_id: str) -> float:
        """GPU-seconds the job has run, until `clock`."""
        done = self.attained.get(job_id, 0.0)
        if job_id in self.running:
            _, _, start, gpus = self.running[job_id]
            done += gpus * (self.clock - start)
        return done

    def _next_crossing(self, job_id: str) -> None:
        mine, (_, _, start, gpus) = self.level_of[job_id], self.running[job_id]
        if gpus and mine < len(LEVELS):
            at = start + (LEVELS[mine] - self.attained.get(job_id, 0.0)) / gpus
            heapq.heappush(self.crossings, (at, job_id, start))

    def _live(self, entry: tuple[float, str, float]) -> bool:
        _, job_id, start = entry
        return job_id in self.running and self.running[job_id][2] == start

    def _advance(self) -> None:
        """Move the running jobs whose crossing time has come to their next level."""
        while self.crossings and (self.crossings[0][0] <= self.clock or not self._live(self.crossings[0])):
            entry = heapq.heappop(self.crossings)
            if self._live(entry):
                job_id = entry[1]
                mine = self.level_of[job_id]
                self.by_level[mine + 1][job_id] = self.by_level[mine].pop(job_id)
                self.level_of[job_id] = mine + 1
                self._next_crossing(job_id)

    def started(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        super().started(job, tasks)
        self.running[job.job_id] = (job, list(tasks), self.clock, sum(len(t.gpus) for t in tasks))
        mine = level(self.attained.get(job.job_id, 0.0))
        self.level_of[job.job_id] = mine
        self.by_level[mine][job.job_id] = self.clock
        self._next_crossing(job.job_id)

    def ended(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        super().ended(job, tasks)
        self.attained[job.job_id] = self.service(job.job_id)
        self.running.pop(job.job_id, None)
        self.by_level[self.level_of.pop(job.job_id)].pop(job.job_id, None)

    def wakeup(self) -> float | None:
        """When the next running job enters a higher level (it may then be stopped for a waiting
        job of a lower one)."""
        self._advance()
        return self.crossings[0][0] if self.crossings else None

    def victims(self, above: int) -> Iterator[str]:
        """Running jobs of a level above `above`: the highest level first, then the newest start."""
        for mine in range(len(LEVELS), above, -1):
            ranked = sorted(self.by_level[mine].items(), key=lambda item: (item[1], item[0]), reverse=True)
            yield from (job_id for job_id, _ in ranked)

    def _least_attained(
        self, nodes: Mapping[str, NodeState], queue: Sequence[PendingJob], kept: Kept
    ) -> Placements:
        self._advance()
        levels = {job.job_id: level(self.attained.get(job.job_id, 0.0)) for job in queue}
        order = sorted(range(len(queue)), key=lambda i: (levels[queue[i].job_id], i))
        out: Placements = {}
        stopped: list[str] = []
        tentative = _Tentative(kept)
        undo: list[tuple[Callable[..., None], JobConfig, list[TaskSpec]]] = []

        def change(apply: Callable[..., None], config: JobConfig, specs: list[TaskSpec]) -> None:
            tentative._change(apply, config, specs)
            undo.append((release if apply is allocate else allocate, config, specs))

        hopeless: set[tuple[int, tuple[tuple[int, int, Need], ...]]] = set()
        try:
            for i in order:
                job = queue[i]
                specs = tentative.place(job, NodeIndex.best)
                mine = levels[job.job_id]
                shape = (mine, tuple(kept.needs(job)))
                if specs is None and shape not in hopeless:
                    specs = self._stop_for(job, mine, stopped, tentative, change)
                    if specs is None:
                        hopeless.add(shape)
                if specs is not None:
                    out[job.job_id] = specs
        finally:
            tentative.undo()
            for apply, config, specs in reversed(undo):
                apply(kept.nodes, config, specs)
                for spec in specs:
                    kept.index.touch(spec.node)
        self.stops = stopped
        return out

    def _stop_for(
        self,
        job: PendingJob,
        mine: int,
        stopped: list[str],
        tentative: _Tentative,
        change: Callable[[Callable[..., None], JobConfig, list[TaskSpec]], None],
    ) -> list[TaskSpec] | None:
        """Stop running jobs of a level above `mine`, one at a time, until `job` fits; keep the
        stops on the nodes it took (the others run on), or none if it never fits."""
        tried: list[tuple[JobConfig, list[TaskSpec], str]] = []
        for victim in self.victims(mine):
            if len(tried) >= MAX_VICTIMS:
                break
            if victim in stopped:
                continue
            victim_job, victim_specs, _, _ = self.running[victim]
            change(release, victim_job.config, victim_specs)
            tried.append((victim_job.config, victim_specs, victim))
            tentative.failed.clear()  # something was freed
            specs = tentative.place(job, NodeIndex.best)
            if specs is not None:
                for config, their_specs, name in reversed(tried):  # run on, those it did not need
                    try:
                        change(allocate, config, their_specs)
                    except ValueError:
                        stopped.append(name)
                return specs
        for config, their_specs, _ in reversed(tried):
            change(allocate, config, their_specs)
        return None


class MusterLeastAttained(MusterKept):
    """Muster's core, lending, with the queue in least-attained-service order (`level` of the
    GPU-seconds a job has run, then arrival) instead of arrival order: the head is the first job
    in that order that does not fit, and it calls back running jobs behind it in that order, so a
    new job stops jobs that have run past a level (Tiresias' discretised LAS, through the same
    `plan`). Jobs that never ran keep arrival order among themselves; a job stopped after it ran
    waits behind every new one of a lower level, so FIFO's bound is not kept by construction
    (tests/test_queue_guarantee.py measures it). No wake-up at level crossings: it decides at
    arrivals and completions, which an overloaded cluster has often."""

    def __init__(self) -> None:
        super().__init__("muster-las")
        self.attained: dict[str, float] = {}  # GPU-seconds run before the current start
        self.since: dict[str, tuple[float, int]] = {}  # running job -> (start, GPUs)
        self._running_keys: dict[str, tuple[int, ...]] | None = None

    def _key(self, job_id: str) -> tuple[int, int]:
        done = self.attained.get(job_id, 0.0)
        if job_id in self.since:
            start, gpus = self.since[job_id]
            done += gpus * (self.clock - start)
        return level(done), self.arrived[job_id]

    def _stoppable(self, waiting: str) -> list[Loan]:
        # The running jobs' keys, once per decision (the clock and what runs stand still in one).
        if self._running_keys is None:
            self._running_keys = {job_id: self._key(job_id) for job_id in self.running}
        mine, keys = self._key(waiting), self._running_keys
        return [loan for job_id, loan in self.running.items() if keys[job_id] > mine]

    def _decide(self, nodes: Mapping[str, NodeState], queue: Sequence[PendingJob]) -> Placements:
        for job in queue:
            self.arrived.setdefault(job.job_id, len(self.arrived))
        self._running_keys = None
        return super()._decide(nodes, sorted(queue, key=lambda job: self._key(job.job_id)))

    def started(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        super().started(job, tasks)
        self.since[job.job_id] = (self.clock, sum(len(t.gpus) for t in tasks))

    def ended(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        self.attained[job.job_id] = self.attained.get(job.job_id, 0.0)
        start, gpus = self.since.pop(job.job_id, (self.clock, 0))
        self.attained[job.job_id] += gpus * (self.clock - start)
        super().ended(job, tasks)


SHADOW_EVERY = 10  # decisions between two replays of the FIFO shadow (`MusterFifoBounded`), at least
SHADOW_SHARE = 20  # and at least 1/20 of the jobs seen: a shadow costs O(jobs), so O(1) per decision


class MusterFifoBounded(MusterLeastAttained):
    """`muster-las` bounded by a FIFO shadow: least-attained order, except for jobs that are
    *due*, which go first in arrival order and are stopped only for earlier due ones (`muster`'s
    rule among them).

    A job is due once the time it has waited so far (arrival to now, less the time it ran)
    reaches a lower bound on its wait under strict FIFO. The bound is the scheduler's shadow
    (`attained.Shadow`: strict FIFO as Muster places gangs, which starts jobs exactly when the
    bench's `fifo` does, tests/test_attained.py) replayed over the newest `horizon` jobs seen
    (`MUSTER_SHADOW_JOBS`), each running for what is known of its run time: the
    whole of it once it ended, the wall time it has run so far while it runs or waits. Shorter
    run times only start FIFO's jobs earlier (up to best fit's packing), so what the shadow
    says a job waits under FIFO is at most what it would. Nothing of the future is used: no
    runtime estimate, no oracle. A job that arrives between two replays of the shadow is given
    the latest start the shadow holds (FIFO starts nothing before an earlier arrival), less its
    arrival; a shadow replayed less often is only more cautious (its bounds are lower). Where
    a stop loses progress (`lose_progress`, set by the replay), a job's whole time counts as
    waited, should it be stopped now, and its longest run is what is known of its run time,
    and only a due job stops a running one (a stop throws the run away).

    What it does: while FIFO would still be busy with earlier work, a newcomer may stop a job
    that has run long (as `muster-las`), but not one that has waited as long as FIFO would have
    made it wait. On an overloaded cluster FIFO's waits are long, so the least-attained order
    rules; where FIFO would start a job soon, the job is protected as under `muster`. The
    shadow is replayed every `SHADOW_EVERY` decisions, or every 1/`SHADOW_SHARE` of the jobs seen
    when that is more (each replay costs O(horizon)), and no more often than the scheduler
    replays it (`MUSTER_SHADOW_EVERY`, 30 s of the replay's clock). This is the scheduler's
    default order (services/scheduler/attained.py). The replay's `--lose-progress` is the
    scheduler's default; a replay without it is the scheduler with every job `"resumable":
    true` (it resumes from its checkpoints)."""

    def __init__(self, every: int = SHADOW_EVERY, horizon: int = attained.SHADOW_JOBS) -> None:
        super().__init__()
        self.name = "muster-fifo-las"
        self.every, self.horizon = every, horizon
        self.arrival: dict[str, float] = {}  # job -> when it was first seen (its arrival)
        self.config: dict[str, JobConfig] = {}
        self.ran: dict[str, float] = {}  # wall seconds run before the current start
        self.longest: dict[str, float] = {}  # its longest run before the current start
        self.shadow = attained.Shadow()  # each job's lower bound on its wait under FIFO
        self.nodes: list[NodeState] = []
        self.decisions = 0
        self.next_shadow = every  # the decision that replays the shadow next
        self.shadow_at = -math.inf  # the clock at the last replay (the scheduler's: one per 30 s)
        self.queued: list[str] = []
        self._kept_keys: dict[str, tuple[tuple[int, ...], float]] = {}  # running job -> key, until

    def _now(self, job_id: str) -> float:
        """Seconds the job has run since its current start (0 when it is not running)."""
        return self.clock - self.since[job_id][0] if job_id in self.since else 0.0

    def _ran(self, job_id: str) -> float:
        """What is known of the job's run time: all it ran, or with progress lost at a stop,
        its longest run (each run starts over)."""
        if self.lose_progress:
            return max(self.longest.get(job_id, 0.0), self._now(job_id))
        return self.ran.get(job_id, 0.0) + self._now(job_id)

    def _due_at(self, job_id: str) -> float | None:
        """When the job becomes due, or would if stopped now (None: it is), by the scheduler's
        rule (`attained.Shadow.rank`): with progress lost at a stop, all its time counts as
        waited; with it kept, its time not running."""
        service = attained.Service(ran=self._ran(job_id))
        arrival = self.arrival[job_id]
        return self.shadow.due_at(job_id, arrival, self.clock, service, not self.lose_progress)

    def due(self, job_id: str) -> bool:
        return self._due_at(job_id) is None

    def _key(self, job_id: str) -> tuple[int, int, int]:  # type: ignore[override]
        if self.due(job_id):
            return 0, 0, self.arrived[job_id]
        return (1, *super()._key(job_id))

    def _running_key(self, job_id: str) -> tuple[tuple[int, ...], float]:
        """A running job's key, and until when it holds: a due one stays due while it runs (its
        wait only grows, or with progress kept stands still) until the shadow changes; one not
        due holds until it becomes due or crosses into its next level."""
        key = self._key(job_id)
        if key[0] == 0:
            return key, math.inf
        until = math.inf
        if self.lose_progress:  # all its time counts as waited: due once it reaches the bound
            due = self._due_at(job_id)
            until = math.inf if due is None else due
        start, gpus = self.since[job_id]
        mine = key[1]
        if gpus and mine < len(LEVELS):
            until = min(until, start + (LEVELS[mine] - self.attained.get(job_id, 0.0)) / gpus)
        return key, until

    def _stoppable(self, waiting: str) -> list[Loan]:
        """As `muster-las`'s, with each running job's key kept until it may change (a replay
        with thousands running asks for them at every head). Where a stop loses progress, only
        a due job calls back (the scheduler's rule for gangs that do not resume, attained.py),
        the newest start stopped first; where it keeps it, the one last in the order."""
        mine, kept, clock = self._key(waiting), self._kept_keys, self.clock
        if self.lose_progress and mine[0] != 0:
            return []
        out = []
        for job_id, loan in self.running.items():
            entry = kept.get(job_id)
            if entry is None or clock >= entry[1]:
                entry = kept[job_id] = self._running_key(job_id)
            if entry[0] > mine:
                out.append(loan)
        # Stopped from the end (the scheduler's cycle.last_called_back): resumable, the last in
        # the order first; else the newest start first (`running` is in start order).
        if not self.lose_progress:
            out.sort(key=lambda loan: kept[loan.job_id][0])
        return out

    def _shadow(self) -> None:
        """Strict FIFO replayed over the newest `horizon` jobs seen, each with what is known of
        its run time (the scheduler's shadow, `attained.Shadow`)."""
        newest = list(self.arrival)[-self.horizon :]  # in arrival order
        seen = [attained.Seen(j, self.arrival[j], self._ran(j), self.config[j]) for j in newest]
        self.shadow = attained.Shadow.make(self.nodes, seen)
        self._kept_keys.clear()

    def _decide(self, nodes: Mapping[str, NodeState], queue: Sequence[PendingJob]) -> Placements:
        if not self.nodes:
            self.nodes = [n.copy(empty=True) for n in nodes.values()]
        for job in queue:
            if job.job_id not in self.arrival:
                self.arrival[job.job_id] = self.clock
                self.config[job.job_id] = job.config
        self.decisions += 1
        self.queued = [job.job_id for job in queue]
        if self.decisions >= self.next_shadow and self.clock >= self.shadow_at + attained.SHADOW_EVERY:
            self._shadow()
            self.shadow_at = self.clock
            self.next_shadow = self.decisions + max(self.every, len(self.arrival) // SHADOW_SHARE)
        return super()._decide(nodes, queue)

    def wakeup(self) -> float | None:
        """When the next waiting job becomes due (it may then stop a job that overtook it)."""
        times = (self._due_at(job_id) for job_id in self.queued if job_id not in self.since)
        return min((t for t in times if t is not None), default=None)

    def started(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        super().started(job, tasks)
        self._kept_keys.pop(job.job_id, None)

    def ended(self, job: PendingJob, tasks: Sequence[TaskSpec]) -> None:
        run = self._now(job.job_id)
        self.ran[job.job_id] = self.ran.get(job.job_id, 0.0) + run
        self.longest[job.job_id] = max(self.longest.get(job.job_id, 0.0), run)
        self._kept_keys.pop(job.job_id, None)
        super().ended(job, tasks)


EPSILON_S = 1e-6  # waits this close to their bound are at it (sums of floats)


POLICIES: dict[str, Callable[[], Policy]] = {
    "muster": MusterKept,
    "muster_snapshot": lambda: MusterKept("muster_snapshot", snapshot=True),
    "muster-reserve": lambda: MusterKept("muster-reserve", lend=False),
    "muster-las": MusterLeastAttained,
    "muster-fifo-las": MusterFifoBounded,
    "fifo": lambda: Indexed("fifo", strict_fifo),
    "firstfit": lambda: Indexed("firstfit", greedy_first_fit),
    "greedy": lambda: Indexed("greedy", greedy_best_fit),
    "sjf": ShortestFirst,
    "las": LeastAttained,
}
