"""Placement core: a snapshot of nodes and a FIFO queue of gangs in, a plan out. No I/O.

(The planner before the index, kept for tests/test_placement_differential.py. One change since
the copy: the best-fit rank's starved-GPU key, `muster.services.scheduler.placement.FED_CPUS`, first
for GPU tasks since fractional GPUs came (docs/BENCHMARKS.md, saturation), a policy both
planners share; the index must still find exactly what this pass over the nodes finds.)

Owns per-node resource accounting (`NodeState`, `allocate`, `release`), gang placement of one job
(feasibility → best-fit rank → tentative allocations committed or discarded as a whole, like
Volcano's statement), FIFO order with backfill, and the reason text for every job left waiting.
The scheduler service feeds it snapshots and commits the `Plan` it returns.

Per job, in queue order:
  * feasible nodes for a task: enough free CPUs, memory and GPUs of the job's `gpuType` (any model
    when unset, matched case-insensitively) on one node; a task gets exact device indexes;
  * rank: GPU tasks go where the fewest free GPUs remain, CPU-only tasks to GPU-less nodes first,
    then to the node with the fewest free GPUs, then best fit on CPUs and memory;
  * a job's largest tasks are placed first; if any task finds no node, the job places nothing.

A job that does not fit even when every schedulable node is empty is *unschedulable*: it waits
with a reason saying it can never run on the current nodes and it never blocks the queue.

Backfill rule (reservation): the first job that is not unschedulable and does not fit now is the
*head*. The head is packed onto empty copies of the nodes, preferring the nodes with the most of
what it needs free now, and the CPUs, memory and GPUs (counted per model) each of its tasks would
use are claimed on those nodes (`Plan.reserved`). Every later job is placed only if it fits in
what is free after subtracting the claims, so it can use any node the head does not need and any
resources the head leaves over on the nodes it does need; a job that fits only by using claimed
resources waits "behind" the head. Only the head is protected: other waiting jobs may be overtaken.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from muster.services.scheduler.placement import FED_CPUS
from muster.shared.jobconfig import JobConfig, TaskRole
from muster.shared.messages import GpuDevice, NodeInfo, TaskSpec

NEVER = "can never run on the current nodes: "


@dataclass
class NodeState:
    """One node's capacity and what placed tasks use of it. Assign a new list to `gpus` rather
    than changing it in place: the (index, lower-cased model) view of it is cached."""

    name: str
    cpus: int
    memory_mb: int
    gpus: list[GpuDevice]
    used_cpus: int = 0
    used_memory_mb: int = 0
    used_gpus: set[int] = field(default_factory=set)
    _devices: tuple[list[GpuDevice], list[tuple[int, str]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def from_info(cls, info: NodeInfo) -> NodeState:
        return cls(name=info.node, cpus=info.cpus, memory_mb=info.memory_mb, gpus=list(info.gpus))

    @property
    def free_cpus(self) -> int:
        return self.cpus - self.used_cpus

    @property
    def free_memory_mb(self) -> int:
        return self.memory_mb - self.used_memory_mb

    @property
    def free_gpu_count(self) -> int:
        """Free GPUs of any model."""
        return len(self.gpus) - len(self.used_gpus)

    def devices(self) -> list[tuple[int, str]]:
        """(index, lower-cased model) of every GPU, by index."""
        if self._devices is None or self._devices[0] is not self.gpus:
            self._devices = (self.gpus, sorted((d.index, d.model.lower()) for d in self.gpus))
        return self._devices[1]

    def free_gpus(self, model: str | None = None) -> list[int]:
        """Free device indexes of `model` (any model when None, case-insensitive), ascending."""
        want = model.lower() if model else None
        return [i for i, m in self.devices() if i not in self.used_gpus and (want is None or m == want)]

    def copy(self, *, empty: bool = False) -> NodeState:
        if empty:
            twin = NodeState(self.name, self.cpus, self.memory_mb, self.gpus)
        else:
            twin = NodeState(
                self.name,
                self.cpus,
                self.memory_mb,
                self.gpus,
                self.used_cpus,
                self.used_memory_mb,
                set(self.used_gpus),
            )
        twin._devices = (self.gpus, self.devices())  # a cache, shared: the device list never changes
        return twin


@dataclass(frozen=True)
class PendingJob:
    job_id: str
    config: JobConfig


@dataclass
class Claim:
    """Resources on one node held for the head job; backfill jobs may not use them."""

    cpus: int = 0
    memory_mb: int = 0
    gpus: Counter[str] = field(default_factory=Counter)  # lower-cased model -> count


@dataclass
class Plan:
    placements: dict[str, list[TaskSpec]] = field(default_factory=dict)  # in (role_no, index) order
    pending: dict[str, str] = field(default_factory=dict)  # job id -> reason a person can act on
    unschedulable: set[str] = field(default_factory=set)  # pending jobs that can never fit now
    head: str | None = None  # the blocked job that backfill must not delay
    reserved: dict[str, Claim] = field(default_factory=dict)  # node -> what is held for the head


# ------------------------------------------------------------------ accounting


def _take(node: NodeState, cpus: int, memory_mb: int, gpus: Sequence[int]) -> None:
    """Add a task's usage to `node`; ValueError (and no change) if it would not fit."""
    known = {d.index for d in node.gpus}
    for i in gpus:
        if i not in known:
            raise ValueError(f"node {node.name} has no GPU {i}")
        if i in node.used_gpus:
            raise ValueError(f"GPU {i} on node {node.name} is already in use")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"GPU indexes {list(gpus)} on node {node.name} repeat")
    if node.used_cpus + cpus > node.cpus:
        raise ValueError(f"node {node.name}: {node.used_cpus + cpus} CPUs would exceed its {node.cpus}")
    if node.used_memory_mb + memory_mb > node.memory_mb:
        raise ValueError(
            f"node {node.name}: {node.used_memory_mb + memory_mb} MB would exceed its {node.memory_mb} MB"
        )
    node.used_cpus += cpus
    node.used_memory_mb += memory_mb
    node.used_gpus.update(gpus)


def _give_back(node: NodeState, cpus: int, memory_mb: int, gpus: Sequence[int]) -> None:
    """Remove a task's usage from `node`; ValueError (and no change) if it was not in use."""
    for i in gpus:
        if i not in node.used_gpus:
            raise ValueError(f"GPU {i} on node {node.name} is not in use")
    if cpus > node.used_cpus or memory_mb > node.used_memory_mb:
        raise ValueError(f"node {node.name} has less in use than the task to release")
    node.used_cpus -= cpus
    node.used_memory_mb -= memory_mb
    node.used_gpus.difference_update(gpus)


class _Statement:
    """Tentative allocations of one gang: kept as they are, or all undone by `discard`."""

    def __init__(self) -> None:
        self.done: list[tuple[NodeState, int, int, list[int]]] = []

    def allocate(self, node: NodeState, cpus: int, memory_mb: int, gpus: list[int]) -> None:
        _take(node, cpus, memory_mb, gpus)
        self.done.append((node, cpus, memory_mb, gpus))

    def discard(self) -> None:
        for node, cpus, memory_mb, gpus in reversed(self.done):
            _give_back(node, cpus, memory_mb, gpus)
        self.done.clear()

    def claims(self) -> dict[str, Claim]:
        out: dict[str, Claim] = {}
        for node, cpus, memory_mb, gpus in self.done:
            claim = out.setdefault(node.name, Claim())
            claim.cpus += cpus
            claim.memory_mb += memory_mb
            models = dict(node.devices())
            claim.gpus.update(models[i] for i in gpus)
        return out


def _role_of(config: JobConfig, task: TaskSpec) -> TaskRole:
    roles = config.taskRoles
    if not 0 <= task.role_no < len(roles) or roles[task.role_no].name != task.role:
        raise ValueError(f"task {task.key} (role_no {task.role_no}) is not a role of job {config.jobName}")
    return roles[task.role_no]


def allocate(nodes: Mapping[str, NodeState], config: JobConfig, tasks: Iterable[TaskSpec]) -> None:
    """Record placed tasks as used on `nodes` (e.g. to rebuild the view after a restart).

    All or nothing: raises ValueError, changing nothing, on an unknown node or GPU, a GPU count
    that differs from the role's, a GPU index already in use, or CPUs/memory beyond capacity."""
    stmt = _Statement()
    try:
        for task in tasks:
            role = _role_of(config, task)
            node = nodes.get(task.node)
            if node is None:
                raise ValueError(f"task {task.key} is on unknown node {task.node}")
            if len(task.gpus) != role.gpuNumber:
                raise ValueError(
                    f"task {task.key} holds {len(task.gpus)} GPUs, its role needs {role.gpuNumber}"
                )
            stmt.allocate(node, role.cpuNumber, role.memoryMB, list(task.gpus))
    except ValueError:
        stmt.discard()
        raise


def release(nodes: Mapping[str, NodeState], config: JobConfig, tasks: Iterable[TaskSpec]) -> None:
    """Give back the resources of ended tasks. Tasks on nodes no longer in `nodes` are skipped (the
    node took its resources with it). All or nothing: ValueError if something was not in use."""
    done: list[tuple[NodeState, int, int, list[int]]] = []
    try:
        for task in tasks:
            role = _role_of(config, task)
            node = nodes.get(task.node)
            if node is not None:
                _give_back(node, role.cpuNumber, role.memoryMB, list(task.gpus))
                done.append((node, role.cpuNumber, role.memoryMB, list(task.gpus)))
    except ValueError:
        for node, cpus, memory_mb, gpus in reversed(done):
            _take(node, cpus, memory_mb, gpus)
        raise


# ------------------------------------------------------------------ one gang


@dataclass(frozen=True)
class _Shape:
    """What one task needs on one node."""

    gpus: int
    cpus: int
    memory_mb: int
    model: str | None  # lower-cased gpuType; None = any model


@dataclass(frozen=True)
class _Task:
    role_no: int
    index: int
    role: str


Groups = list[tuple[_Shape, list[_Task]]]
# A node's rank for a task shape, smaller first: numbers, then the node's name as a tie-break.
Rank = tuple[int | str, ...]
Ranker = Callable[[NodeState, _Shape, Claim | None], Rank]


def _demand(config: JobConfig) -> Groups:
    """The job's tasks grouped by shape, largest shape first (GPUs, then CPUs, then memory)."""
    model = config.gpuType.lower() if config.gpuType else None
    groups: dict[_Shape, list[_Task]] = {}
    for role_no, role in enumerate(config.taskRoles):
        shape = _Shape(role.gpuNumber, role.cpuNumber, role.memoryMB, model if role.gpuNumber else None)
        tasks = groups.setdefault(shape, [])
        tasks.extend(_Task(role_no, i, role.name) for i in range(role.taskNumber))
    return sorted(groups.items(), key=lambda kv: (kv[0].gpus, kv[0].cpus, kv[0].memory_mb), reverse=True)


def _usable_gpus(node: NodeState, model: str | None, claim: Claim | None) -> list[int]:
    """Free device indexes of `model` (any when None), ascending, less those `claim` holds."""
    free = [(i, m) for i, m in node.devices() if i not in node.used_gpus]
    if claim is not None and claim.gpus:
        held = Counter(claim.gpus)
        kept = []
        for i, m in reversed(free):  # the claim holds the highest free indexes of each model
            if held[m] > 0:
                held[m] -= 1
            else:
                kept.append((i, m))
        free = kept[::-1]
    return [i for i, m in free if model is None or m == model]


def _fits(node: NodeState, shape: _Shape, claim: Claim | None) -> bool:
    cpus, memory_mb = (claim.cpus, claim.memory_mb) if claim else (0, 0)
    if node.free_cpus - cpus < shape.cpus or node.free_memory_mb - memory_mb < shape.memory_mb:
        return False
    if shape.gpus == 0 or (claim is None and shape.model is None):
        return node.free_gpu_count >= shape.gpus
    return node.free_gpu_count >= shape.gpus and len(_usable_gpus(node, shape.model, claim)) >= shape.gpus


def _best_fit(node: NodeState, shape: _Shape, claim: Claim | None) -> Rank:
    """Smaller is better: leave the fewest free GPUs, then the fewest free CPUs and memory."""
    cpus, memory_mb = (claim.cpus, claim.memory_mb) if claim else (0, 0)
    free_gpus = node.free_gpu_count if claim is None else len(_usable_gpus(node, None, claim))
    gpus_after = free_gpus - shape.gpus
    cpus_after = node.free_cpus - cpus - shape.cpus
    memory_after = node.free_memory_mb - memory_mb - shape.memory_mb
    if shape.gpus:  # the starved-GPU key, added to both planners since the copy (the policy)
        starved = max(0, gpus_after - cpus_after // FED_CPUS)
        return (starved, gpus_after, cpus_after, memory_after, node.name)
    return (bool(node.gpus), gpus_after, cpus_after, memory_after, node.name)


def _place_gang(
    groups: Groups, nodes: list[NodeState], claims: Mapping[str, Claim], rank: Ranker, stmt: _Statement
) -> tuple[list[TaskSpec], tuple[_Shape, _Task] | None]:
    """Place tasks into `stmt` until one finds no node; returns the specs and that task (or None).

    Tasks of one shape share a heap of feasible nodes: placing a task changes only its node's rank."""
    specs: list[TaskSpec] = []
    for shape, tasks in groups:
        heap = [
            (rank(n, shape, claims.get(n.name)), i)
            for i, n in enumerate(nodes)
            if _fits(n, shape, claims.get(n.name))
        ]
        heapq.heapify(heap)
        for task in tasks:
            if not heap:
                return specs, (shape, task)
            _, i = heapq.heappop(heap)
            node, claim = nodes[i], claims.get(nodes[i].name)
            gpus = _usable_gpus(node, shape.model, claim)[: shape.gpus]
            stmt.allocate(node, shape.cpus, shape.memory_mb, gpus)
            specs.append(
                TaskSpec(role=task.role, role_no=task.role_no, index=task.index, node=node.name, gpus=gpus)
            )
            if _fits(node, shape, claim):
                heapq.heappush(heap, (rank(node, shape, claim), i))
    return specs, None


def _closest_to_free(live: Mapping[str, NodeState]) -> Ranker:
    """Rank empty copies of nodes by how much of a task is free on the real node now (most first),
    less what the head's earlier tasks already claimed there."""

    def rank(node: NodeState, shape: _Shape, _claim: Claim | None) -> Rank:
        real = live[node.name]
        gpus = len(real.free_gpus(shape.model)) - len(node.used_gpus)
        return (
            -gpus,
            -(real.free_cpus - node.used_cpus),
            -(real.free_memory_mb - node.used_memory_mb),
            node.name,
        )

    return rank


def _reserve(groups: Groups, live: list[NodeState], empty: list[NodeState]) -> dict[str, Claim]:
    """Where the head would go once enough frees up: packed on empty nodes, nearest-to-free first."""
    stmt = _Statement()
    _, failed = _place_gang(groups, empty, {}, _closest_to_free({n.name: n for n in live}), stmt)
    if failed is not None:  # the spread-out packing failed; the best-fit one is known to succeed
        stmt.discard()
        _place_gang(groups, empty, {}, _best_fit, stmt)
    claims = stmt.claims()
    stmt.discard()
    return claims


# ------------------------------------------------------------------ reasons


def _gpus(n: int, label: str | None) -> str:
    return f"{n} {label}" if label else f"{n} GPU{'' if n == 1 else 's'}"


def _shape_text(shape: _Shape, label: str | None) -> str:
    parts = [_gpus(shape.gpus, label)] if shape.gpus else []
    parts += [f"{shape.cpus} CPUs", f"{shape.memory_mb} MB"]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _gpu_demand(config: JobConfig) -> str:
    """`2×4 V100 on one node each` / `8 V100 on one node`."""
    roles = [r for r in config.taskRoles if r.gpuNumber]
    parts = [
        _gpus(r.gpuNumber, config.gpuType)
        if r.taskNumber == 1
        else f"{r.taskNumber}×{_gpus(r.gpuNumber, config.gpuType)}"
        for r in roles
    ]
    each = " each" if sum(r.taskNumber for r in roles) > 1 else ""
    return " + ".join(parts) + f" on one node{each}"


@dataclass
class _Largest:
    """The most of each resource free on any one node, with that node's name (the greatest name on
    a tie: best fit breaks ties the other way, so placing rarely touches these nodes).
    A cheap necessary test before a full placement, and the numbers a reason quotes."""

    gpus: dict[str | None, tuple[int, str]] = field(default_factory=dict)  # model (None: any) -> most
    cpus: tuple[int, str] = (0, "")
    memory_mb: tuple[int, str] = (0, "")

    @classmethod
    def of(cls, nodes: Iterable[NodeState]) -> _Largest:
        out = cls()
        for n in nodes:
            counts: dict[str | None, int] = {None: n.free_gpu_count}
            for i, m in n.devices():
                if i not in n.used_gpus:
                    counts[m] = counts.get(m, 0) + 1
            for model, k in counts.items():
                out.gpus[model] = max(out.gpu_block(model), (k, n.name))
            out.cpus = max(out.cpus, (n.free_cpus, n.name))
            out.memory_mb = max(out.memory_mb, (n.free_memory_mb, n.name))
        return out

    def holders(self) -> set[str]:
        """The nodes the numbers come from: placing on other nodes leaves every maximum as it is."""
        return {name for _, name in self.gpus.values()} | {self.cpus[1], self.memory_mb[1]}

    def gpu_block(self, model: str | None) -> tuple[int, str]:
        return self.gpus.get(model, (0, ""))

    def could_host(self, shape: _Shape) -> bool:
        return (
            self.gpu_block(shape.model)[0] >= shape.gpus
            and self.cpus[0] >= shape.cpus
            and self.memory_mb[0] >= shape.memory_mb
        )


def _role_never_fits(
    role: TaskRole, shape: _Shape, label: str | None, empty: list[NodeState], largest: _Largest
) -> str | None:
    gpus, cpus, memory = largest.gpu_block(shape.model)[0], largest.cpus[0], largest.memory_mb[0]
    if gpus < shape.gpus:
        return f"task {role.name} needs {_gpus(shape.gpus, label)} on one node; the largest node has {gpus}"
    if cpus < shape.cpus:
        return f"task {role.name} needs {shape.cpus} CPUs; the largest node has {cpus}"
    if memory < shape.memory_mb:
        return f"task {role.name} needs {shape.memory_mb} MB of memory; the largest node has {memory} MB"
    if any(_fits(n, shape, None) for n in empty):
        return None
    return f"task {role.name} needs {_shape_text(shape, label)} on one node; no node has all of them"


def _gang_never_fits(
    config: JobConfig, groups: Groups, empty: list[NodeState], largest: _Largest
) -> str | None:
    if _place(groups, empty, {}, largest, keep=False)[1] is None:
        return None
    n = config.total_tasks
    model = config.gpuType.lower() if config.gpuType else None
    totals: list[tuple[int, int, Callable[[int], str]]] = [
        (
            sum(s.gpus * len(t) for s, t in groups),
            sum(len(e.free_gpus(model)) for e in empty),
            lambda k: _gpus(k, config.gpuType),
        ),
        (sum(s.cpus * len(t) for s, t in groups), sum(e.cpus for e in empty), lambda k: f"{k} CPUs"),
        (sum(s.memory_mb * len(t) for s, t in groups), sum(e.memory_mb for e in empty), lambda k: f"{k} MB"),
    ]
    for need, have, show in totals:
        if need > have:
            return f"its {n} tasks need {show(need)} in all; the cluster has {show(have)}"
    return f"its {n} tasks do not pack onto the nodes even when they are empty"


def _never_fits(config: JobConfig, groups: Groups, empty: list[NodeState], largest: _Largest) -> str | None:
    """Why the job cannot fit even when every schedulable node is empty; None if it can."""
    model = config.gpuType.lower() if config.gpuType else None
    if model and any(s.gpus for s, _ in groups) and not any(e.free_gpus(model) for e in empty):
        have = sorted({d.model.lower(): d.model for e in empty for d in e.gpus}.values())
        has = f"cluster has: {', '.join(have)}" if have else "cluster has no GPUs"
        return f"no node has a GPU of type {config.gpuType} ({has})"
    for shape, tasks in groups:
        role = config.taskRoles[tasks[0].role_no]
        why = _role_never_fits(role, shape, config.gpuType, empty, largest)
        if why:
            return why
    return _gang_never_fits(config, groups, empty, largest)


def _why_not_now(config: JobConfig, shape: _Shape, failed: _Task, placed: int, free: _Largest) -> str:
    """Why a job that fits on empty nodes does not fit on what is free now (`free`)."""
    label = config.gpuType
    if shape.gpus:
        block, where = free.gpu_block(shape.model)
        if block == 0:
            return f"needs {_gpu_demand(config)}; no {label or 'GPU'} is free now"
        if block < shape.gpus:
            return f"needs {_gpu_demand(config)}; largest free block is {_gpus(block, label)} ({where})"
    cpus, where = free.cpus
    if cpus < shape.cpus:
        return f"task {failed.role} needs {shape.cpus} CPUs on one node; at most {cpus} are free ({where})"
    memory, where = free.memory_mb
    if memory < shape.memory_mb:
        have = f"at most {memory} MB are free ({where})"
        return f"task {failed.role} needs {shape.memory_mb} MB on one node; {have}"
    if placed:
        return (
            f"only {placed} of {config.total_tasks} tasks fit in what is free now "
            f"(task {failed.role} needs {_shape_text(shape, label)} on one node)"
        )
    return (
        f"task {failed.role} needs {_shape_text(shape, label)} on one node; no node has all of them free now"
    )


# ------------------------------------------------------------------ the queue


def plan(nodes: Iterable[NodeState], queue: Sequence[PendingJob], avoid: Set[str] = frozenset()) -> Plan:
    """Place the queue in FIFO order with backfill around the head (see the module docstring).

    `nodes` and the jobs are not changed; nodes named in `avoid` get nothing."""
    all_nodes = list(nodes)
    live = [n.copy() for n in all_nodes if n.name not in avoid]
    capacity = _Capacity(all_nodes, avoid)
    result = Plan()
    free = _Largest.of(live)  # kept current: placing only lowers what is free
    for job in queue:
        groups = _demand(job.config)
        specs, failed = _place(groups, live, result.reserved, free)
        if failed is None:
            result.placements[job.job_id] = sorted(specs, key=lambda t: (t.role_no, t.index))
            if {t.node for t in specs} & free.holders():
                free = _Largest.of(live)
            continue
        never = capacity.never(job.config, groups)
        if never is not None:
            result.pending[job.job_id] = never
            result.unschedulable.add(job.job_id)
            continue
        if result.head is not None:  # did it fail only because of the head's claims?
            specs, failed = _place(groups, live, {}, free, keep=False)
            if failed is None:
                result.pending[job.job_id] = (
                    f"waiting behind job {result.head} (FIFO): "
                    f"it fits now only on resources held for {result.head}"
                )
                continue
        assert failed is not None
        result.pending[job.job_id] = _why_not_now(job.config, *failed, len(specs), free)
        if result.head is None:
            result.head = job.job_id
            result.reserved = _reserve(groups, live, capacity.nodes)
            held = ", ".join(sorted(result.reserved))
            result.pending[job.job_id] += f"; first in line, holding resources on {held}"
    return result


def _place(
    groups: Groups, live: list[NodeState], claims: Mapping[str, Claim], free: _Largest, keep: bool = True
) -> tuple[list[TaskSpec], tuple[_Shape, _Task] | None]:
    """Best-fit placement of a gang on `live`, kept only if `keep` and every task found a node.
    A shape no single node could host fails at once, without a pass over the nodes."""
    for shape, tasks in groups:
        if not free.could_host(shape):
            return [], (shape, tasks[0])
    stmt = _Statement()
    specs, failed = _place_gang(groups, live, claims, _best_fit, stmt)
    if failed is not None or not keep:
        stmt.discard()
    return specs, failed


class _Capacity:
    """The schedulable nodes as if empty: answers "can this job ever run here?", once per job shape."""

    def __init__(self, all_nodes: list[NodeState], avoid: Set[str]) -> None:
        self.registered = len(all_nodes)
        self.avoided = sorted(n.name for n in all_nodes if n.name in avoid)
        self.nodes = [n.copy(empty=True) for n in all_nodes if n.name not in avoid]
        self.largest = _Largest.of(self.nodes)
        self._answers: dict[tuple[str | None, tuple[tuple[str, int, int, int, int], ...]], str | None] = {}

    def never(self, config: JobConfig, groups: Groups) -> str | None:
        """Why the job can never run on the current schedulable nodes; None if it can."""
        if not self.registered:
            return "no nodes registered"
        if not self.nodes:
            return f"no schedulable nodes: every node is avoided ({', '.join(self.avoided)})"
        key = (
            config.gpuType and config.gpuType.lower(),
            tuple((r.name, r.taskNumber, r.cpuNumber, r.memoryMB, r.gpuNumber) for r in config.taskRoles),
        )
        if key not in self._answers:
            why = _never_fits(config, groups, self.nodes, self.largest)
            note = f" (avoided nodes not counted: {', '.join(self.avoided)})" if self.avoided else ""
            self._answers[key] = NEVER + why + note if why else None
        return self._answers[key]
