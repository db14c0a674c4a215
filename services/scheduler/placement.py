"""Placement core: a snapshot of nodes and a FIFO queue of gangs in, a plan out. No I/O.

Owns per-node resource accounting (`NodeState`, `allocate`, `release`), gang placement of one job
(feasibility → best-fit rank → tentative allocations committed or discarded as a whole, like
Volcano's statement), FIFO order with backfill, and the reason text for every job left waiting.
The scheduler service feeds it snapshots and commits the `Plan` it returns.

Per job, in queue order:
  * feasible nodes for a task: enough free CPUs, memory and GPUs of the job's `gpuType` (any model
    when unset, matched case-insensitively) on one node; a task gets exact device indexes;
  * rank: GPU tasks go where the fewest free GPUs would be left *starved* (without `FED_CPUS`
    CPUs each beside them), then where the fewest free GPUs remain; CPU-only tasks to GPU-less nodes
    first, then to the node with the fewest free GPUs; then best fit on CPUs and memory;
  * a job's largest tasks are placed first; if any task finds no node, the job places nothing;
  * a task that asks for part of one GPU (gpuNumber 0.01 to 0.99, `TaskSpec.gpu_milli` in
    thousandths) shares a GPU with other such tasks: each GPU index is held whole by one task or
    shared, never both (`NodeState.used_gpus` / `NodeState.shared`). A share goes into the shared
    GPU it fills best (on nodes where it starves the fewest untouched GPUs), else to an untouched
    GPU of a node that already shares one, else where a 1-GPU task would go; CPU-only tasks keep
    off the CPUs of nodes whose shared GPUs still have room.

A job that does not fit even when every schedulable node is empty is *unschedulable*: it waits
with a reason saying it can never run on the current nodes and it never blocks the queue.

Backfill rule (reservation): the first job that is not unschedulable and does not fit now is the
*head*. The head is packed onto empty copies of the nodes, preferring the nodes with the most of
what it needs free now, and the CPUs, memory and GPUs (counted per model) each of its tasks would
use are claimed on those nodes (`Plan.reserved`). Every later job is placed only if it fits in
what is free after subtracting the claims, so it can use any node the head does not need and any
resources the head leaves over on the nodes it does need; a job that fits only by using claimed
resources waits "behind" the head. Only the head is protected: other waiting jobs may be overtaken.

Lending the reservation (`stoppable` given): with no runtimes known, claimed resources would sit idle
until the head fits. Instead a job behind the head that fits only by using them starts *on loan*.
The caller says which running gangs stood behind a waiting job in the queue (`stoppable`); as
soon as the head would fit on what is free plus
what the running gangs behind it hold, the plan places the head there and names the gangs it
displaces (`Plan.stop`: released from the last the caller gave on, the newest start as the
cluster holds them, until the head fits, then every one it does not displace is kept). The
caller stops them gracefully and uncharged (they keep their place in the queue) before the head
starts. Any gang that overtook the head may be called back, not only those
on its claims: a gang started on unclaimed resources while an earlier head waited may stand where
this head is to go, and under strict FIFO it would not run before it. The claimed resources never
idle while a job behind the head fits on them, and the head starts no later than under the
reservation. A gang is stopped only for a job that stood ahead of it, and the head it is stopped
for is placed in the same plan, so it is not stopped for the same job twice. The reservation is
laid as if what the head may stop were free, so it does not wander away from it.

What holds (tests/test_queue_guarantee.py, random workloads against strict FIFO): the longest wait
is at most strict FIFO's on nearly every workload, not on all (best fit packs the nodes
differently from FIFO's history, so a wide job can find them more fragmented), and not per job:
a job FIFO would have started early can wait longer here behind a head that took what it would
have used. Without lending, the reservation alone breaks the longest-wait bound more often.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any, Protocol

from muster.shared.jobconfig import WHOLE_GPU, JobConfig, TaskRole
from muster.shared.messages import GpuDevice, NodeInfo, TaskSpec

NEVER = "can never run on the current nodes: "
HUGE_JOB = 10_000  # tasks: past it a job is first held against the nodes' totals (Capacity.beyond)
# A free GPU left with fewer CPUs than this beside it is one almost no task can use: 99 % of the
# GPU tasks of the Alibaba GPU 2023 trace ask at least 4 CPUs per GPU. Best fit avoids leaving
# GPUs so starved when a node with the CPUs to spare can take the task instead: on that trace it
# strands fewer GPUs than first-fit at every load tried (docs/BENCHMARKS.md, trace replay), where
# plain best fit on CPUs stranded more at three of five.
FED_CPUS = 4


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
    used_gpus: set[int] = field(default_factory=set)  # held whole, each by one task
    shared: dict[int, int] = field(default_factory=dict)  # index -> thousandths held by fractional tasks
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
        """Untouched GPUs of any model: neither held whole nor shared."""
        return len(self.gpus) - len(self.used_gpus) - len(self.shared)

    def room(self, model: str | None = None) -> list[tuple[int, int]]:
        """(thousandths left, index) of each shared GPU of `model` (any when None) with room."""
        want = model.lower() if model else None
        return [
            (WHOLE_GPU - used, i)
            for i, m in self.devices()
            if (used := self.shared.get(i)) is not None and used < WHOLE_GPU and (want is None or m == want)
        ]

    def devices(self) -> list[tuple[int, str]]:
        """(index, lower-cased model) of every GPU, by index."""
        if self._devices is None or self._devices[0] is not self.gpus:
            self._devices = (self.gpus, sorted((d.index, d.model.lower()) for d in self.gpus))
        return self._devices[1]

    def free_gpus(self, model: str | None = None) -> list[int]:
        """Free device indexes of `model` (any model when None, case-insensitive), ascending."""
        want = model.lower() if model else None
        return [
            i
            for i, m in self.devices()
            if i not in self.used_gpus and i not in self.shared and (want is None or m == want)
        ]

    def use(self, cpus: int, memory_mb: int, gpus: Sequence[int], milli: int = WHOLE_GPU) -> None:
        """Count a placed task's usage; ValueError (and no change) if it would not fit."""
        _take(self, cpus, memory_mb, gpus, milli)

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
                dict(self.shared),
            )
        twin._devices = (self.gpus, self.devices())  # a cache, shared: the device list never changes
        return twin


@dataclass(frozen=True)
class PendingJob:
    job_id: str
    config: JobConfig


class Backlog(Protocol):
    """A queue made as the planner takes it (quota.Order): in order while the planner needs the
    order, then `rest()`, the jobs not yet taken, in any order, once its backfill window has
    closed (from there a job's outcome depends only on its own shape)."""

    def __iter__(self) -> Iterator[PendingJob]: ...

    def rest(self) -> Iterable[PendingJob]: ...

    def in_order(self, job_ids: Iterable[str]) -> list[str]:
        """Some of its jobs in its order (without taking it that far)."""
        ...


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
    # With lending (`stoppable`): running gangs to stop, gracefully and uncharged, before a head in
    # `placements` can start, each -> the head it is stopped for.
    stop: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Loan:
    """A running gang as a head may call it back (what `Cluster.plan`'s `stoppable` returns)."""

    job_id: str
    config: JobConfig
    tasks: Sequence[TaskSpec]


# ------------------------------------------------------------------ accounting


def _take(node: NodeState, cpus: int, memory_mb: int, gpus: Sequence[int], milli: int = WHOLE_GPU) -> None:
    """Add a task's usage to `node`; ValueError (and no change) if it would not fit. `milli` below
    WHOLE_GPU: the task's share of its one GPU, which is then shared (fractional tasks only)."""
    known = {d.index for d in node.gpus}
    for i in gpus:
        if i not in known:
            raise ValueError(f"node {node.name} has no GPU {i}")
        if i in node.used_gpus:
            raise ValueError(f"GPU {i} on node {node.name} is already in use")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"GPU indexes {list(gpus)} on node {node.name} repeat")
    if milli < WHOLE_GPU:
        if len(gpus) != 1:
            raise ValueError(f"a share of a GPU is of one GPU, not {len(gpus)} on node {node.name}")
        if node.shared.get(gpus[0], 0) + milli > WHOLE_GPU:
            raise ValueError(
                f"GPU {gpus[0]} on node {node.name} has {WHOLE_GPU - node.shared[gpus[0]]}/1000 left, "
                f"not {milli}"
            )
    else:
        for i in gpus:
            if i in node.shared:
                raise ValueError(f"GPU {i} on node {node.name} is shared: it cannot be held whole")
    if node.used_cpus + cpus > node.cpus:
        raise ValueError(f"node {node.name}: {node.used_cpus + cpus} CPUs would exceed its {node.cpus}")
    if node.used_memory_mb + memory_mb > node.memory_mb:
        raise ValueError(
            f"node {node.name}: {node.used_memory_mb + memory_mb} MB would exceed its {node.memory_mb} MB"
        )
    node.used_cpus += cpus
    node.used_memory_mb += memory_mb
    if milli < WHOLE_GPU:
        node.shared[gpus[0]] = node.shared.get(gpus[0], 0) + milli
    else:
        node.used_gpus.update(gpus)


def _give_back(
    node: NodeState, cpus: int, memory_mb: int, gpus: Sequence[int], milli: int = WHOLE_GPU
) -> None:
    """Remove a task's usage from `node`; ValueError (and no change) if it was not in use."""
    if milli < WHOLE_GPU:
        if len(gpus) != 1 or node.shared.get(gpus[0], 0) < milli:
            raise ValueError(f"GPU {list(gpus)} on node {node.name} does not hold a share of {milli}/1000")
    else:
        for i in gpus:
            if i not in node.used_gpus:
                raise ValueError(f"GPU {i} on node {node.name} is not in use")
    if cpus > node.used_cpus or memory_mb > node.used_memory_mb:
        raise ValueError(f"node {node.name} has less in use than the task to release")
    node.used_cpus -= cpus
    node.used_memory_mb -= memory_mb
    if milli < WHOLE_GPU:
        left = node.shared[gpus[0]] - milli
        if left:
            node.shared[gpus[0]] = left
        else:
            del node.shared[gpus[0]]  # the last share gone: the GPU is untouched again
    else:
        node.used_gpus.difference_update(gpus)


class _Statement:
    """Tentative allocations of one gang (or of a whole plan): kept as they are, or undone by
    `discard`. Bound to a `Cluster`, every allocation keeps its index in step."""

    def __init__(
        self,
        cluster: Cluster | None = None,
        done: list[tuple[NodeState, int, int, list[int], int]] | None = None,
    ) -> None:
        self.cluster = cluster
        self.done: list[tuple[NodeState, int, int, list[int], int]] = list(done or [])

    def allocate(
        self, node: NodeState, cpus: int, memory_mb: int, gpus: list[int], milli: int = WHOLE_GPU
    ) -> None:
        if self.cluster is not None:
            self.cluster.take(node.name, cpus, memory_mb, gpus, milli)
        else:
            _take(node, cpus, memory_mb, gpus, milli)
        self.done.append((node, cpus, memory_mb, gpus, milli))

    def discard(self, mark: int = 0) -> None:
        """Undo the allocations made since `mark` (a length of `done`; 0: all of them)."""
        while len(self.done) > mark:
            node, cpus, memory_mb, gpus, milli = self.done.pop()
            if self.cluster is not None:
                self.cluster.give(node.name, cpus, memory_mb, gpus, milli)
            else:
                _give_back(node, cpus, memory_mb, gpus, milli)

    def claims(self) -> dict[str, Claim]:
        """What the allocations hold per node; a share of a GPU holds that whole GPU."""
        out: dict[str, Claim] = {}
        for node, cpus, memory_mb, gpus, _milli in self.done:
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
    _allocate_all(_Statement(), nodes, config, tasks)


def _allocate_all(
    stmt: _Statement, nodes: Mapping[str, NodeState], config: JobConfig, tasks: Iterable[TaskSpec]
) -> None:
    try:
        for task in tasks:
            role = _role_of(config, task)
            node = nodes.get(task.node)
            if node is None:
                raise ValueError(f"task {task.key} is on unknown node {task.node}")
            if len(task.gpus) != role.gpu_devices:
                raise ValueError(
                    f"task {task.key} holds {len(task.gpus)} GPUs, its role needs {role.gpuNumber}"
                )
            if task.gpu_milli != (role.gpu_milli if role.shares_gpu else None):
                raise ValueError(
                    f"task {task.key} holds {task.gpu_share} of a GPU, its role needs {role.gpuNumber}"
                )
            stmt.allocate(node, role.cpuNumber, role.memoryMB, list(task.gpus), role.gpu_milli)
    except ValueError:
        stmt.discard()
        raise


def release(nodes: Mapping[str, NodeState], config: JobConfig, tasks: Iterable[TaskSpec]) -> None:
    """Give back the resources of ended tasks. Tasks on nodes no longer in `nodes` are skipped (the
    node took its resources with it). All or nothing: ValueError if something was not in use."""
    done: list[tuple[NodeState, int, int, list[int], int]] = []
    try:
        for task in tasks:
            role = _role_of(config, task)
            node = nodes.get(task.node)
            if node is not None:
                _give_back(node, role.cpuNumber, role.memoryMB, list(task.gpus), _milli_of(task))
                done.append((node, role.cpuNumber, role.memoryMB, list(task.gpus), _milli_of(task)))
    except ValueError:
        for node, cpus, memory_mb, gpus, milli in reversed(done):
            _take(node, cpus, memory_mb, gpus, milli)
        raise


def _milli_of(task: TaskSpec) -> int:
    return WHOLE_GPU if task.gpu_milli is None else task.gpu_milli


# ------------------------------------------------------------------ one gang


@dataclass(frozen=True)
class _Shape:
    """What one task needs on one node."""

    gpus: int  # GPU devices (1 for a share of one)
    cpus: int
    memory_mb: int
    model: str | None  # lower-cased gpuType; None = any model
    milli: int = WHOLE_GPU  # below WHOLE_GPU: a share of one GPU, which it shares

    @property
    def shares(self) -> bool:
        return self.milli < WHOLE_GPU

    def spec(self, task: _Task, node: str, gpus: list[int]) -> TaskSpec:
        milli = self.milli if self.shares else None
        return TaskSpec(
            role=task.role, role_no=task.role_no, index=task.index, node=node, gpus=gpus, gpu_milli=milli
        )


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
        shape = _Shape(
            role.gpu_devices, role.cpuNumber, role.memoryMB, model if role.gpuNumber else None, role.gpu_milli
        )
        tasks = groups.setdefault(shape, [])
        tasks.extend(_Task(role_no, i, role.name) for i in range(role.taskNumber))
    return sorted(
        groups.items(), key=lambda kv: (kv[0].gpus, kv[0].milli, kv[0].cpus, kv[0].memory_mb), reverse=True
    )


def _usable_gpus(node: NodeState, model: str | None, claim: Claim | None) -> list[int]:
    """Free device indexes of `model` (any when None), ascending, less those `claim` holds."""
    free = [(i, m) for i, m in node.devices() if i not in node.used_gpus and i not in node.shared]
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


def _has_room(node: NodeState) -> bool:
    """Whether a GPU of `node` is shared and has room for more."""
    return any(used < WHOLE_GPU for used in node.shared.values())


def _shared_gpu(node: NodeState, shape: _Shape) -> int | None:
    """The shared GPU of `node` a share of `shape` best fits (the least room left after it), or None."""
    rooms = [(left - shape.milli, i) for left, i in node.room(shape.model) if left >= shape.milli]
    return min(rooms)[1] if rooms else None


def _gpus_for(node: NodeState, shape: _Shape, claim: Claim | None) -> list[int]:
    """The device indexes a task of `shape` gets on `node` (known to fit): a share goes to the
    shared GPU it fits best, else to an untouched one, which it makes shared."""
    if shape.shares and (i := _shared_gpu(node, shape)) is not None:
        return [i]
    return _usable_gpus(node, shape.model, claim)[: shape.gpus]


def _fits(node: NodeState, shape: _Shape, claim: Claim | None) -> bool:
    cpus, memory_mb = (claim.cpus, claim.memory_mb) if claim else (0, 0)
    if node.free_cpus - cpus < shape.cpus or node.free_memory_mb - memory_mb < shape.memory_mb:
        return False
    if shape.shares and node.shared and _shared_gpu(node, shape) is not None:
        return True
    if shape.gpus == 0 or (claim is None and shape.model is None):
        return node.free_gpu_count >= shape.gpus
    return node.free_gpu_count >= shape.gpus and len(_usable_gpus(node, shape.model, claim)) >= shape.gpus


def starved(gpus_after: int, cpus_after: int) -> int:
    """How many of the free GPUs a placement leaves would have fewer than FED_CPUS CPUs each."""
    return max(0, gpus_after - cpus_after // FED_CPUS)


def _best_fit(node: NodeState, shape: _Shape, claim: Claim | None) -> Rank:
    """Smaller is better: for a GPU task, starve the fewest of the free GPUs it leaves, then
    leave the fewest free GPUs; for a CPU-only task, GPU-less nodes first, then the fewest free
    GPUs; then the fewest free CPUs and memory."""
    cpus, memory_mb = (claim.cpus, claim.memory_mb) if claim else (0, 0)
    free_gpus = node.free_gpu_count if claim is None else len(_usable_gpus(node, None, claim))
    gpus_after = free_gpus - shape.gpus
    cpus_after = node.free_cpus - cpus - shape.cpus
    memory_after = node.free_memory_mb - memory_mb - shape.memory_mb
    if shape.gpus:
        return (starved(gpus_after, cpus_after), gpus_after, cpus_after, memory_after, node.name)
    return (bool(node.gpus), gpus_after, cpus_after, memory_after, node.name)


def _place_gang(
    groups: Groups, nodes: list[NodeState], claims: Mapping[str, Claim], rank: Ranker, stmt: _Statement
) -> tuple[list[TaskSpec], tuple[_Shape, _Task] | None]:
    """Place tasks into `stmt` until one finds no node; returns the specs and that task (or None).
    A pass over `nodes` with any `rank` (the reservation's); `Cluster.best` does best fit faster.

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
            gpus = _gpus_for(node, shape, claim)
            stmt.allocate(node, shape.cpus, shape.memory_mb, gpus, shape.milli)
            specs.append(shape.spec(task, node.name, gpus))
            if _fits(node, shape, claim):
                heapq.heappush(heap, (rank(node, shape, claim), i))
    return specs, None


def _closest_to_free(live: Mapping[str, NodeState]) -> Ranker:
    """Rank empty copies of nodes by how much of a task is free on the real node now (most first),
    less what the head's earlier tasks already claimed there."""

    def rank(node: NodeState, shape: _Shape, _claim: Claim | None) -> Rank:
        real = live.get(node.name)
        if real is None:  # out of the live view (it did not add up): nothing counts as free there
            return (1, 1, 1, node.name)
        gpus = len(real.free_gpus(shape.model)) - len(node.used_gpus)
        return (
            -gpus,
            -(real.free_cpus - node.used_cpus),
            -(real.free_memory_mb - node.used_memory_mb),
            node.name,
        )

    return rank


def _reserve(groups: Groups, live: Cluster, empty: list[NodeState]) -> dict[str, Claim]:
    """Where the head would go once enough frees up: packed on empty nodes, nearest-to-free first.
    A pass over every node, but only for the head, once per plan."""
    stmt = _Statement()
    try:
        _, failed = _place_gang(groups, empty, {}, _closest_to_free(live.nodes), stmt)
        if failed is not None:  # the spread-out packing failed; the best-fit one is known to succeed
            stmt.discard()
            _place_gang(groups, empty, {}, _best_fit, stmt)
        return stmt.claims()
    finally:
        stmt.discard()  # the empty nodes are lent (Capacity.empty_nodes): left empty again


# ------------------------------------------------------------------ reasons


def _gpus(n: float, label: str | None) -> str:
    if isinstance(n, float):  # a share of one GPU
        return f"{n:g} of a {label or 'GPU'}"
    return f"{n} {label}" if label else f"{n} GPU{'' if n == 1 else 's'}"


def _asked(shape: _Shape) -> float:
    return shape.milli / WHOLE_GPU if shape.shares else shape.gpus


def _shape_text(shape: _Shape, label: str | None) -> str:
    parts = [_gpus(_asked(shape), label)] if shape.gpus else []
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


def _role_never_fits(
    role: TaskRole, shape: _Shape, label: str | None, empty: Cluster, avoid: Set[str]
) -> str | None:
    gpus = empty.gpu_block(shape.model, avoid)[0]
    cpus, memory = empty.cpu_block(avoid)[0], empty.memory_block(avoid)[0]
    if gpus < shape.gpus:
        need = _gpus(_asked(shape), label)
        return f"task {role.name} needs {need} on one node; the largest node has {gpus}"
    if cpus < shape.cpus:
        return f"task {role.name} needs {shape.cpus} CPUs; the largest node has {cpus}"
    if memory < shape.memory_mb:
        return f"task {role.name} needs {shape.memory_mb} MB of memory; the largest node has {memory} MB"
    if empty.best(shape, {}, avoid) is not None:
        return None
    return f"task {role.name} needs {_shape_text(shape, label)} on one node; no node has all of them"


def _gang_never_fits(config: JobConfig, groups: Groups, empty: Cluster, avoid: Set[str]) -> str | None:
    if _place(groups, empty, {}, _Free(empty, avoid), _Statement(empty), keep=False)[1] is None:
        return None
    n = config.total_tasks
    model = config.gpuType.lower() if config.gpuType else None
    nodes = [e for name, e in empty.nodes.items() if name not in avoid]
    totals: list[tuple[int, int, Callable[[int], str]]] = [
        (
            sum(s.gpus * len(t) for s, t in groups),
            sum(len(e.free_gpus(model)) for e in nodes),
            lambda k: _gpus(k, config.gpuType),
        ),
        (sum(s.cpus * len(t) for s, t in groups), sum(e.cpus for e in nodes), lambda k: f"{k} CPUs"),
        (sum(s.memory_mb * len(t) for s, t in groups), sum(e.memory_mb for e in nodes), lambda k: f"{k} MB"),
    ]
    for need, have, show in totals:
        if need > have:
            return f"its {n} tasks need {show(need)} in all; the cluster has {show(have)}"
    return f"its {n} tasks do not pack onto the nodes even when they are empty"


def _never_fits(config: JobConfig, groups: Groups, empty: Cluster, avoid: Set[str]) -> str | None:
    """Why the job cannot fit even when every schedulable node is empty; None if it can."""
    model = config.gpuType.lower() if config.gpuType else None
    if model and any(s.gpus for s, _ in groups) and empty.gpu_block(model, avoid)[0] == 0:
        nodes = [e for name, e in empty.nodes.items() if name not in avoid]
        have = sorted({d.model.lower(): d.model for e in nodes for d in e.gpus}.values())
        has = f"cluster has: {', '.join(have)}" if have else "cluster has no GPUs"
        return f"no node has a GPU of type {config.gpuType} ({has})"
    for shape, tasks in groups:
        role = config.taskRoles[tasks[0].role_no]
        why = _role_never_fits(role, shape, config.gpuType, empty, avoid)
        if why:
            return why
    return _gang_never_fits(config, groups, empty, avoid)


def _why_not_now(config: JobConfig, shape: _Shape, failed: _Task, placed: int, free: _Free) -> str:
    """Why a job that fits on empty nodes does not fit on what is free now (`free`)."""
    label = config.gpuType
    if shape.gpus:
        block, where = free.gpu_block(shape.model)
        if block == 0 and shape.shares:
            return f"needs {_gpu_demand(config)}; no {label or 'GPU'} has {_asked(shape):g} free now"
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


# ------------------------------------------------------------------ the index


Entry = tuple[int, int, str]  # (free CPUs, free memory MB, name): a node's place in its group
Top = tuple[int, str]  # (free amount, name): a node's place in a "most free" list


def _drop(entries: list[Any], entry: Any) -> None:
    i = bisect.bisect_left(entries, entry)
    if i == len(entries) or entries[i] != entry:
        raise AssertionError(f"index out of step: {entry} is not where it should be")
    del entries[i]


def _top(entries: list[Top], avoid: Set[str]) -> Top:
    """The largest entry whose node is not avoided; (0, "") if none."""
    for entry in reversed(entries):
        if entry[1] not in avoid:
            return entry
    return (0, "")


class Cluster:
    """Nodes and what placed tasks use of them, kept indexed so that finding the best node for a
    task costs about log(nodes) rather than a pass over all of them.

    Nodes are grouped by (has GPUs, free GPUs); in a group, by the models they carry, and each of
    those lists is ordered by (free CPUs, free memory, name): the order of the best-fit rank
    within each level of starved GPUs, which falls as free CPUs rise. The best node for a task is
    in the first group that has a feasible one: the first feasible entry from enough CPUs to
    starve none (found by bisecting, stepping over the few entries short of memory or of the
    model), or, if none, the first of the least-starved level below that. Lists of (free, name)
    per GPU model, CPUs and memory give the largest free block of each, which reasons quote and
    which rule out a task no node can host without a search.

    Every change of a node goes through `take`/`give` (or a `_Statement` bound to this cluster)
    so the lists never go stale; nodes join and leave with `add`/`remove`."""

    def __init__(self, nodes: Iterable[NodeState] = ()) -> None:
        self.nodes: dict[str, NodeState] = {n.name: n.copy() for n in nodes}
        self._sig: dict[str, tuple[str, ...]] = {}  # node -> its GPU models, lower-cased, sorted
        self._groups: dict[tuple[bool, int, bool], dict[tuple[str, ...], list[Entry]]] = {}
        self._most: dict[str | None, list[Top]] = {None: []}  # model (None: any) -> free GPUs
        self._cpus: list[Top] = []
        self._memory: list[Top] = []
        self.most_gpus = 0  # the most GPUs any node has (free-GPU groups go up to it)
        self._sharing: set[str] = set()  # nodes with a shared GPU that has room left
        self._hosting: set[str] = set()  # nodes with a shared GPU
        for node in self.nodes.values():
            self._learn(node)
            self._index(node, sort=False)
            self._note_sharing(node)
        for group in self._groups.values():
            for entries in group.values():
                entries.sort()
        for tops in (*self._most.values(), self._cpus, self._memory):
            tops.sort()

    def __len__(self) -> int:
        return len(self.nodes)

    # -------------------------------------------------------- keeping the index

    def _learn(self, node: NodeState) -> None:
        models = {m for _, m in node.devices()}
        self._sig[node.name] = tuple(sorted(models))
        self.most_gpus = max(self.most_gpus, len(node.gpus))

    def _entries(self, node: NodeState) -> list[tuple[list[Any], Any]]:
        """Every (list, entry) that stands for `node` as it is now."""
        name, sig = node.name, self._sig[node.name]
        cpus, memory_mb, gpus = node.free_cpus, node.free_memory_mb, node.free_gpu_count
        group = self._groups.setdefault((bool(node.gpus), gpus, _has_room(node)), {})
        out: list[tuple[list[Any], Any]] = [
            (group.setdefault(sig, []), (cpus, memory_mb, name)),
            (self._most[None], (gpus, name)),
            (self._cpus, (cpus, name)),
            (self._memory, (memory_mb, name)),
        ]
        if len(sig) == 1:  # the usual node: one model, so its free GPUs are all of that model
            out.append((self._most.setdefault(sig[0], []), (gpus, name)))
        elif sig:
            free = Counter(m for i, m in node.devices() if i not in node.used_gpus and i not in node.shared)
            out += [(self._most.setdefault(m, []), (free[m], name)) for m in sig]
        return out

    def _note_sharing(self, node: NodeState) -> None:
        if node.shared:
            self._hosting.add(node.name)
        else:
            self._hosting.discard(node.name)
        if node.shared and any(used < WHOLE_GPU for used in node.shared.values()):
            self._sharing.add(node.name)
        else:
            self._sharing.discard(node.name)

    def _index(self, node: NodeState, sort: bool = True) -> None:
        for entries, entry in self._entries(node):
            if sort:
                bisect.insort(entries, entry)
            else:
                entries.append(entry)

    def _unindex(self, node: NodeState) -> None:
        for entries, entry in self._entries(node):
            _drop(entries, entry)

    def add(self, node: NodeState) -> None:
        """A node joins (a copy of `node` is kept); a node of that name already here is replaced."""
        if node.name in self.nodes:
            self.remove(node.name)
        mine = node.copy()
        self.nodes[mine.name] = mine
        self._learn(mine)
        self._index(mine)
        self._note_sharing(mine)

    def remove(self, name: str) -> None:
        node = self.nodes.pop(name, None)
        if node is not None:
            self._unindex(node)
            del self._sig[name]
            self._sharing.discard(name)
            self._hosting.discard(name)

    def take(self, name: str, cpus: int, memory_mb: int, gpus: Sequence[int], milli: int = WHOLE_GPU) -> None:
        node = self.nodes[name]
        self._unindex(node)
        try:
            _take(node, cpus, memory_mb, gpus, milli)
        finally:
            self._index(node)
            self._note_sharing(node)

    def give(self, name: str, cpus: int, memory_mb: int, gpus: Sequence[int], milli: int = WHOLE_GPU) -> None:
        node = self.nodes[name]
        self._unindex(node)
        try:
            _give_back(node, cpus, memory_mb, gpus, milli)
        finally:
            self._index(node)
            self._note_sharing(node)

    def allocate(self, config: JobConfig, tasks: Iterable[TaskSpec]) -> None:
        """`allocate` on this cluster's nodes, through the index (all or nothing)."""
        _allocate_all(_Statement(self), self.nodes, config, tasks)

    def release(self, config: JobConfig, tasks: Iterable[TaskSpec]) -> None:
        """`release` on this cluster's nodes, through the index (tasks of gone nodes skipped)."""
        done: list[tuple[str, int, int, list[int], int]] = []
        try:
            for task in tasks:
                role = _role_of(config, task)
                if task.node in self.nodes:
                    self.give(task.node, role.cpuNumber, role.memoryMB, list(task.gpus), _milli_of(task))
                    done.append((task.node, role.cpuNumber, role.memoryMB, list(task.gpus), _milli_of(task)))
        except ValueError:
            for name, cpus, memory_mb, gpus, milli in reversed(done):
                self.take(name, cpus, memory_mb, gpus, milli)
            raise

    # -------------------------------------------------------- questions

    def best(self, shape: _Shape, claims: Mapping[str, Claim], avoid: Set[str]) -> NodeState | None:
        """The node the best-fit rank puts first for one task of `shape`, or None if none fits;
        avoided nodes are never chosen, claimed ones only with what their claim leaves. A share
        of a GPU goes into a GPU already shared where one has room (`_best_share`), else to an
        untouched GPU on a node that already shares one (`_new_share`), and only then where a
        1-GPU task would go. A CPU-only task goes where no GPU capacity is left: nodes whose
        shared GPUs have room come after those whose GPUs are full, at each level of free GPUs."""
        if shape.shares and self._sharing:
            shared = self._best_share(shape, claims, avoid)
            if shared is not None:
                return shared
        if shape.shares and self._hosting:
            shared = self._new_share(shape, claims, avoid)
            if shared is not None:
                return shared
        found: NodeState | None = None
        levels: list[tuple[tuple[bool, int, bool], ...]]
        if shape.gpus:
            levels = [((True, k, False), (True, k, True)) for k in range(shape.gpus, self.most_gpus + 1)]
        else:  # where no GPU capacity is left first: shared GPUs with room after untouched ones
            levels = [((False, 0, False),)]
            levels += [((True, k, room),) for k in range(self.most_gpus + 1) for room in (False, True)]
        for level in levels:
            for key in level:
                group = self._groups.get(key)
                if not group:
                    continue
                for sig, entries in group.items():
                    if shape.model is not None and shape.model not in sig:
                        continue
                    node = self._least_starved(entries, shape, key[1] - shape.gpus, claims, avoid)
                    if node is not None and (
                        found is None or _best_fit(node, shape, None) < _best_fit(found, shape, None)
                    ):
                        found = node
            # More free GPUs left can still starve fewer: look on until one starves none.
            if found is not None and (not shape.gpus or _best_fit(found, shape, None)[0] == 0):
                break
        for name, claim in claims.items():
            node = self.nodes.get(name)
            if node is None or name in avoid or not _fits(node, shape, claim):
                continue
            if found is None or _best_fit(node, shape, claim) < _best_fit(
                found, shape, claims.get(found.name)
            ):
                found = node
        return found

    def _best_share(self, shape: _Shape, claims: Mapping[str, Claim], avoid: Set[str]) -> NodeState | None:
        """The node whose shared GPU a share of `shape` fills best: the fewest untouched GPUs
        left starved of CPUs, then the least room left on that GPU, then the fewest CPUs and
        memory left. A pass over the nodes with shared GPUs (the few that run fractional tasks)."""
        best: tuple[Rank, NodeState] | None = None
        for name in self._sharing:
            if name in avoid:
                continue
            node = self.nodes[name]
            claim = claims.get(name)
            cpus, memory_mb = (claim.cpus, claim.memory_mb) if claim else (0, 0)
            cpus_after = node.free_cpus - cpus - shape.cpus
            memory_after = node.free_memory_mb - memory_mb - shape.memory_mb
            if cpus_after < 0 or memory_after < 0:
                continue
            rooms = [left for left, _ in node.room(shape.model) if left >= shape.milli]
            if not rooms:
                continue
            untouched = node.free_gpu_count
            rank: Rank = (
                starved(untouched, cpus_after),
                min(rooms) - shape.milli,
                cpus_after,
                memory_after,
                name,
            )
            if best is None or rank < best[0]:
                best = (rank, node)
        return None if best is None else best[1]

    def _new_share(self, shape: _Shape, claims: Mapping[str, Claim], avoid: Set[str]) -> NodeState | None:
        """Where no shared GPU has room: the best-fit node among those that already share a GPU
        (an untouched GPU there becomes shared), so that shared GPUs gather on few nodes and
        the others stay whole for whole-GPU tasks. A pass over the nodes that share GPUs."""
        best: tuple[Rank, NodeState] | None = None
        for name in self._hosting:
            if name in avoid:
                continue
            node = self.nodes[name]
            claim = claims.get(name)
            if not _fits(node, shape, claim):
                continue
            rank = _best_fit(node, shape, claim)
            if best is None or rank < best[0]:
                best = (rank, node)
        return None if best is None else best[1]

    def _least_starved(
        self,
        entries: list[Entry],
        shape: _Shape,
        gpus_after: int,
        claims: Mapping[str, Claim],
        avoid: Set[str],
    ) -> NodeState | None:
        """The best-fit node of one ordered list of nodes with the same free GPUs for a task of
        `shape`: the first feasible one with the CPUs to starve no GPU it leaves, else the first
        feasible one of the least-starved level (the one of the most CPUs below that)."""
        if not shape.gpus or gpus_after <= 0:
            return self._first(entries, shape, claims, avoid, shape.cpus)
        fed = shape.cpus + gpus_after * FED_CPUS
        node = self._first(entries, shape, claims, avoid, fed)
        if node is not None:
            return node
        lowest = bisect.bisect_left(entries, (shape.cpus,))
        for i in range(bisect.bisect_left(entries, (fed,)) - 1, lowest - 1, -1):
            node = self._feasible(entries[i], shape, claims, avoid)
            if node is not None:
                level = starved(gpus_after, node.free_cpus - shape.cpus)
                return self._first(
                    entries, shape, claims, avoid, shape.cpus + (gpus_after - level) * FED_CPUS
                )
        return None

    def _first(
        self, entries: list[Entry], shape: _Shape, claims: Mapping[str, Claim], avoid: Set[str], cpus: int
    ) -> NodeState | None:
        """The first node of one ordered list with at least `cpus` free that can host `shape`."""
        for i in range(bisect.bisect_left(entries, (cpus,)), len(entries)):
            node = self._feasible(entries[i], shape, claims, avoid)
            if node is not None:
                return node
        return None

    def _feasible(
        self, entry: Entry, shape: _Shape, claims: Mapping[str, Claim], avoid: Set[str]
    ) -> NodeState | None:
        """The entry's node if it is unclaimed, not avoided and has the memory and GPUs of the
        model for `shape` (the CPUs are the caller's bisection)."""
        _, memory_mb, name = entry
        if memory_mb < shape.memory_mb or name in claims or name in avoid:
            return None
        node = self.nodes[name]
        if shape.model is not None and len(node.free_gpus(shape.model)) < shape.gpus:
            return None
        return node

    def gpu_block(self, model: str | None, avoid: Set[str] = frozenset()) -> Top:
        """The most free GPUs of `model` (any when None) on one node, and that node."""
        return _top(self._most.get(model, []), avoid)

    def cpu_block(self, avoid: Set[str] = frozenset()) -> Top:
        return _top(self._cpus, avoid)

    def memory_block(self, avoid: Set[str] = frozenset()) -> Top:
        return _top(self._memory, avoid)

    def could_host(self, shape: _Shape, avoid: Set[str]) -> bool:
        """A cheap necessary test: some node has the GPUs, some the CPUs, some the memory."""
        return (
            (self.gpu_block(shape.model, avoid)[0] >= shape.gpus or (shape.shares and bool(self._sharing)))
            and self.cpu_block(avoid)[0] >= shape.cpus
            and self.memory_block(avoid)[0] >= shape.memory_mb
        )

    # -------------------------------------------------------- planning

    def place_alone(self, job: PendingJob, avoid: Set[str] = frozenset()) -> list[TaskSpec] | None:
        """Where `job` would go now, alone (as `plan([job])` places it), or None: without working
        out a reason or a reservation when it does not fit, the cost of a failed plan. The cluster
        is unchanged."""
        stmt = _Statement(self)
        try:
            specs, failed = _place(_demand(job.config), self, {}, _Free(self, avoid), stmt, keep=False)
        finally:
            stmt.discard()
        return None if failed is not None else sorted(specs, key=lambda t: (t.role_no, t.index))

    def plan(
        self,
        queue: Sequence[PendingJob] | Backlog,
        capacity: Capacity | None = None,
        avoid: Set[str] = frozenset(),
        window: int | None = None,
        stoppable: Callable[[str], Sequence[Loan]] | None = None,
        stop_first: bool = False,
    ) -> Plan:
        """Place the queue in FIFO order with backfill around the head (see the module docstring),
        as tentative allocations that are all undone before returning: the cluster is unchanged.

        `stoppable(job)`: the running gangs that stood behind the waiting `job` in the queue,
        the first to stop last (oldest start first, as the cluster holds them, unless the
        caller's order says otherwise: cycle.last_called_back). Given, the head lends its claimed resources
        (module docstring): a job behind it that fits only on them is placed, and a head that
        fits on what is free plus what its stoppable gangs hold is placed there, the ones it
        displaces in `Plan.stop` (counted as gone for the rest of the plan). `stop_first`: the
        caller stops them before it can place the head (the scheduler service: a gang takes its
        grace to stop), so the head is not placed: it stays the head, its claims where it is to
        go, nothing is lent for the rest of the plan, and the gangs to stop still hold theirs.

        `capacity`: the same nodes as if empty (kept by the caller across plans; built here when
        None). `window`: how many jobs behind the head are tried at most (like Slurm's
        bf_max_job_test); later ones wait with a reason saying so, unless they can never run.
        Once the window has closed nothing more is placed and the head stays, so a later job's
        outcome (a reason known for its shape, can never run, or waiting in the queue) does not
        depend on where it stands: a `Backlog` is then taken through its `rest()`, in any order."""
        capacity = capacity or Capacity(self.nodes.values())
        free = _Free(self, avoid)
        result = Plan()
        stmt = _Statement(self)
        # Placing only lowers what is free, so while nothing has been placed, a job shaped like
        # one that just failed fails the same way: its reason is reused, not worked out again.
        placed = 0
        known: dict[Hashable, tuple[int, str | None, str, bool]] = {}
        tried_behind = 0
        lifted: list[Loan] = []  # loans to stop: released from the cluster until the plan ends
        lend = stoppable is not None
        jobs = iter(queue)
        rest = None if isinstance(queue, Sequence) else queue.rest
        try:
            while True:
                if (
                    rest is not None
                    and window is not None
                    and result.head is not None
                    and tried_behind >= window
                ):
                    jobs, rest = iter(rest()), None  # the window has closed: the others as they come
                job = next(jobs, None)
                if job is None:
                    break
                key = _shape_key(job.config)
                seen = known.get(key)
                if seen is not None and seen[:2] == (placed, result.head):
                    result.pending[job.job_id] = seen[2]
                    if seen[3]:
                        result.unschedulable.add(job.job_id)
                    continue
                never = capacity.beyond(job.config, avoid)  # a huge job: before one object a task
                if never is not None:
                    result.pending[job.job_id] = never
                    result.unschedulable.add(job.job_id)
                    continue
                groups = _demand(job.config)
                if window is not None and result.head is not None and tried_behind >= window:
                    never = capacity.never(job.config, groups, avoid)
                    result.pending[job.job_id] = never or (
                        f"waiting in the queue: backfill tries the first {window} jobs behind job "
                        f"{result.head}, which is first in line"
                    )
                    if never:
                        result.unschedulable.add(job.job_id)
                    continue
                if result.head is not None:
                    tried_behind += 1
                specs, failed = _place(groups, self, result.reserved, free, stmt)
                if failed is None:
                    result.placements[job.job_id] = sorted(specs, key=lambda t: (t.role_no, t.index))
                    placed += 1
                    continue
                never = capacity.never(job.config, groups, avoid)
                if never is not None:
                    result.pending[job.job_id] = never
                    result.unschedulable.add(job.job_id)
                    known[key] = (placed, result.head, never, True)
                    continue
                if result.head is not None:  # did it fail only because of the head's claims?
                    specs, failed = _place(groups, self, {}, free, stmt, keep=lend)
                    if failed is None and lend:  # on loan: stopped if the head can start
                        result.placements[job.job_id] = sorted(specs, key=lambda t: (t.role_no, t.index))
                        placed += 1
                        continue
                    if failed is None:
                        result.pending[job.job_id] = (
                            f"waiting behind job {result.head} (FIFO): "
                            f"it fits now only on resources held for {result.head}"
                        )
                        known[key] = (placed, result.head, result.pending[job.job_id], False)
                        continue
                assert failed is not None
                # The running gangs that stood behind it (if this becomes the head): it may stop them.
                mine: list[Loan] = []
                if result.head is None and stoppable is not None:
                    mine = [r for r in stoppable(job.job_id) if r.job_id not in result.stop]
                    if mine and not self._might_fit(groups, mine, avoid):
                        mine = []  # not even with all of them gone: not worth lifting them
                    mark = len(stmt.done)
                    taken, stop = self._call_back(groups, mine, free, stmt) if mine else ([], [])
                    if taken and stop_first:  # it goes where it was placed, once they have stopped
                        result.reserved = _Statement(None, stmt.done[mark:]).claims()
                        stmt.discard(mark)
                        self._put_back(stop)
                        result.head, lend = job.job_id, False
                        result.stop = {r.job_id: job.job_id for r in stop}
                        names, held = ", ".join(r.job_id for r in stop), ", ".join(sorted(result.reserved))
                        result.pending[job.job_id] = (
                            f"first in line: stopping {len(stop)} gang(s) that started after it "
                            f"({names}); it starts on {held} once they have stopped"
                        )
                        continue
                    if taken:
                        result.placements[job.job_id] = sorted(taken, key=lambda t: (t.role_no, t.index))
                        for r in stop:
                            result.stop[r.job_id] = job.job_id
                        lifted += stop
                        placed += 1
                        continue
                result.pending[job.job_id] = _why_not_now(job.config, *failed, len(specs), free)
                if result.head is None:
                    result.head = job.job_id
                    self._lift(mine)  # the reservation is laid where what it may stop runs
                    try:
                        result.reserved = _reserve(groups, self, capacity.empty_nodes(avoid))
                    finally:
                        self._put_back(mine)
                    held = ", ".join(sorted(result.reserved))
                    result.pending[job.job_id] += f"; first in line, holding resources on {held}"
                else:
                    known[key] = (placed, result.head, result.pending[job.job_id], False)
        finally:
            stmt.discard()
            self._put_back(lifted)
        return result

    def _might_fit(self, groups: Groups, loans: Sequence[Loan], avoid: Set[str]) -> bool:
        """A cheap necessary test for a head of one task (that fits on no node as it is): some
        node the loans hold tasks on has, with what they hold there, the task's GPUs (of its
        model), CPUs and memory. True for a gang or a share of one GPU (it is tried)."""
        if len(groups) != 1 or len(groups[0][1]) != 1 or groups[0][0].shares:
            return True
        shape = groups[0][0]
        held: dict[str, list[int]] = {}  # node -> [GPUs of the model, CPUs, memory]
        for loan in loans:
            for task in loan.tasks:
                node = self.nodes.get(task.node)
                if node is None or task.node in avoid:
                    continue
                role = _role_of(loan.config, task)
                mine = held.setdefault(task.node, [0, 0, 0])
                if shape.model is None:
                    mine[0] += len(task.gpus)
                elif task.gpus:
                    models = dict(node.devices())
                    mine[0] += sum(1 for i in task.gpus if models.get(i) == shape.model)
                mine[1] += role.cpuNumber
                mine[2] += role.memoryMB
        for name, (gpus, cpus, memory_mb) in held.items():
            node = self.nodes[name]
            free_gpus = node.free_gpu_count if shape.model is None else len(node.free_gpus(shape.model))
            if (
                free_gpus + gpus >= shape.gpus
                and node.free_cpus + cpus >= shape.cpus
                and node.free_memory_mb + memory_mb >= shape.memory_mb
            ):
                return True
        return False

    def _lift(self, loans: Sequence[Loan]) -> None:
        for loan in loans:
            self.release(loan.config, loan.tasks)

    def _put_back(self, loans: Sequence[Loan]) -> None:
        for loan in reversed(loans):
            self.allocate(loan.config, loan.tasks)

    def _call_back(
        self, groups: Groups, loans: list[Loan], free: _Free, stmt: _Statement
    ) -> tuple[list[TaskSpec], list[Loan]]:
        """Place the head on what is free plus what its `loans` hold, if it fits there: released
        from the last on until it fits (the caller's order: the last is the first to stop), then
        every one it does not displace taken back (the first first). Returns the head's tasks
        (kept in `stmt`) and the loans to stop (left released: the caller puts them back when
        the plan ends); ([], []) and nothing changed if it does not fit even with all of them
        gone."""
        self._lift(loans)
        specs, failed = _place(groups, self, {}, free, stmt, keep=False)
        self._put_back(loans)
        if failed is not None:
            return [], []
        released: list[Loan] = []
        for loan in reversed(loans):
            self._lift([loan])
            released.append(loan)
            specs, failed = _place(groups, self, {}, free, stmt)
            if failed is None:
                break
        else:
            self._put_back(released)
            return [], []
        stop = []
        for loan in reversed(released):  # the first first: the ones the caller keeps longest
            try:
                self.allocate(loan.config, loan.tasks)
            except ValueError:
                stop.append(loan)
        return specs, stop


def _shape_key(config: JobConfig) -> Hashable:
    """What placement and its reasons depend on in a job: equal keys, equal outcomes."""
    return (
        config.gpuType,
        tuple((r.name, r.taskNumber, r.cpuNumber, r.memoryMB, r.gpuNumber) for r in config.taskRoles),
    )


class _Free:
    """What is free now on the cluster's schedulable nodes, as the reasons quote it."""

    def __init__(self, cluster: Cluster, avoid: Set[str]) -> None:
        self.cluster, self.avoid = cluster, avoid

    def gpu_block(self, model: str | None) -> Top:
        return self.cluster.gpu_block(model, self.avoid)

    @property
    def cpus(self) -> Top:
        return self.cluster.cpu_block(self.avoid)

    @property
    def memory_mb(self) -> Top:
        return self.cluster.memory_block(self.avoid)

    def could_host(self, shape: _Shape) -> bool:
        return self.cluster.could_host(shape, self.avoid)


def _place(
    groups: Groups,
    cluster: Cluster,
    claims: Mapping[str, Claim],
    free: _Free,
    stmt: _Statement,
    keep: bool = True,
) -> tuple[list[TaskSpec], tuple[_Shape, _Task] | None]:
    """Best-fit placement of a gang on `cluster` into `stmt`, kept only if `keep` and every task
    found a node (else this gang's allocations are undone). A shape no single node could host
    fails at once, without a search."""
    for shape, tasks in groups:
        if not free.could_host(shape):
            return [], (shape, tasks[0])
    mark = len(stmt.done)
    specs: list[TaskSpec] = []
    failed: tuple[_Shape, _Task] | None = None
    for shape, tasks in groups:
        for task in tasks:
            node = cluster.best(shape, claims, free.avoid)
            if node is None:
                failed = (shape, task)
                break
            gpus = _gpus_for(node, shape, claims.get(node.name))
            stmt.allocate(node, shape.cpus, shape.memory_mb, gpus, shape.milli)
            specs.append(shape.spec(task, node.name, gpus))
        if failed is not None:
            break
    if failed is not None or not keep:
        stmt.discard(mark)
    return specs, failed


class Capacity:
    """The nodes as if empty: answers "can this job ever run here?", once per job shape and set
    of avoided nodes, until a node joins or leaves (`add`/`remove`)."""

    def __init__(self, nodes: Iterable[NodeState] = ()) -> None:
        self.cluster = Cluster(n.copy(empty=True) for n in nodes)
        self._answers: dict[Hashable, str | None] = {}
        self._empty: dict[frozenset[str], list[NodeState]] = {}

    def add(self, node: NodeState) -> None:
        self.cluster.add(node.copy(empty=True))
        self._answers.clear()
        self._empty.clear()

    def remove(self, name: str) -> None:
        if name in self.cluster.nodes:
            self.cluster.remove(name)
            self._answers.clear()
            self._empty.clear()

    def empty_nodes(self, avoid: Set[str]) -> list[NodeState]:
        """Empty copies of the schedulable nodes, to plan a reservation on: made once per set of
        avoided nodes (until a node joins or leaves) and lent, so whoever plans on them must
        leave them empty again (`_reserve` does)."""
        key = frozenset(avoid)
        if key not in self._empty:
            if len(self._empty) > 16:
                self._empty.clear()
            nodes = self.cluster.nodes.items()
            self._empty[key] = [n.copy(empty=True) for name, n in nodes if name not in avoid]
        return self._empty[key]

    def beyond(self, config: JobConfig, avoid: Set[str] = frozenset()) -> str | None:
        """For a job of more than HUGE_JOB tasks, why it asks more in all than the schedulable
        nodes have (it can never run), worked out from its roles before one object per task is
        made: a job of 640,000 tasks (one accepted before the task limits) took seconds of the
        leader's loop each plan, past its lease on a loaded machine. None: the usual checks
        decide."""
        if config.total_tasks <= HUGE_JOB:
            return None
        key = ("beyond", _shape_key(config), tuple(sorted(avoid)))
        if key not in self._answers:
            nodes = [node for name, node in self.cluster.nodes.items() if name not in avoid]
            model = config.gpuType.lower() if config.gpuType else None
            roles = config.taskRoles
            rows: list[tuple[int, int, Callable[[int], str]]] = [
                (
                    sum(r.gpu_devices * r.taskNumber for r in roles if r.gpuNumber),
                    sum(len(node.free_gpus(model)) for node in nodes),
                    lambda k: _gpus(k, config.gpuType),
                ),
                (
                    sum(r.cpuNumber * r.taskNumber for r in roles),
                    sum(n.cpus for n in nodes),
                    lambda k: f"{k} CPUs",
                ),
                (
                    sum(r.memoryMB * r.taskNumber for r in roles),
                    sum(n.memory_mb for n in nodes),
                    lambda k: f"{k} MB",
                ),
            ]
            n = config.total_tasks
            why = next(
                (
                    f"its {n} tasks need {show(need)} in all; the cluster has {show(have)}"
                    for need, have, show in rows
                    if need > have
                ),
                None,
            )
            self._answers[key] = NEVER + why if why else None
        return self._answers[key]

    def never(self, config: JobConfig, groups: Groups, avoid: Set[str] = frozenset()) -> str | None:
        """Why the job can never run on the current schedulable nodes; None if it can."""
        nodes = self.cluster.nodes
        if not nodes:
            return "no nodes registered"
        avoided = sorted(name for name in avoid if name in nodes)
        if len(avoided) == len(nodes):
            return f"no schedulable nodes: every node is avoided ({', '.join(avoided)})"
        key = (_shape_key(config), tuple(avoided))
        if key not in self._answers:
            why = _never_fits(config, groups, self.cluster, avoid)
            note = f" (avoided nodes not counted: {', '.join(avoided)})" if avoided else ""
            self._answers[key] = NEVER + why + note if why else None
        return self._answers[key]


def plan(
    nodes: Iterable[NodeState],
    queue: Sequence[PendingJob],
    avoid: Set[str] = frozenset(),
    window: int | None = None,
    stoppable: Callable[[str], Sequence[Loan]] | None = None,
    stop_first: bool = False,
) -> Plan:
    """Place the queue in FIFO order with backfill around the head (see the module docstring).

    `nodes` and the jobs are not changed; nodes named in `avoid` get nothing. A planner that
    runs often keeps a `Cluster` and a `Capacity` up to date instead and calls `Cluster.plan`."""
    all_nodes = list(nodes)
    return Cluster(all_nodes).plan(queue, Capacity(all_nodes), avoid, window, stoppable, stop_first)
