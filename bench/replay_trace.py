"""Trace files in, Muster jobs and nodes out: what `bench.replay` replays, and every liberty taken.

Two task formats, told apart by their header:
  * Alibaba GPU 2023 (github.com/alibaba/clusterdata, cluster-trace-gpu-v2023): `openb_pod_list_*.csv`
    with name, cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec, qos, pod_phase, creation_time,
    deletion_time, scheduled_time; nodes from `openb_node_list_*.csv` (sn, cpu_milli, memory_mib,
    gpu, model).
  * a simple one: submit_time, duration, gpus[, gpu_model][, cpus][, memory_mb][, name]; nodes from
    a node CSV (name, cpus, memory_mb, gpus, gpu_model, or the Alibaba shape) or `uniform_nodes`.
    A Philly-shaped workload is this shape (`bench/replay_workload.py` writes one). A job asking
    for more GPUs than the largest node has becomes a gang of whole nodes (see `gang_config`).

Every task becomes a single-task Muster job (one role `task`, taskNumber 1), built through the
real `JobConfig` model so a task Muster would reject is rejected here too. The mapping, and why:
  * arrival = creation_time; duration = deletion_time - scheduled_time, or deletion_time -
    creation_time for a task the real cluster never scheduled (phase Pending, 897 of the default
    list): that is how long it waited there before it was deleted, not a run time, but the
    replay runs it that long (it is counted as `pending` timing); never < 0.
  * cpuNumber = ceil(cpu_milli / 1000), at least 1: Muster counts whole CPUs.
  * memoryMB = memory_mib, raised to 100 (JobConfig's floor) where the trace says less.
  * a fractional GPU (num_gpu 1, gpu_milli < 1000) takes one whole GPU: Muster does not share GPUs.
    The GPU-time that costs is counted (`Adjustments.rounding_gpu_s`).
  * gpu_spec lists the models a task may use, Muster's `gpuType` names one (or none: any). A spec
    that allows every model the cluster has becomes "any"; a narrower one is narrowed further, to
    the allowed model with the most GPUs in the cluster (ties: name). The replay never lets a task
    onto a model its spec forbids, but may keep it off models the spec allows: it can only wait
    longer than it would have in the trace, never less. How many tasks were narrowed is counted.
    A spec naming no model the cluster has keeps its first model: Muster says it can never run.
  * a pod list without times (`openb_pod_list_multigpu50.csv`) takes them, by task name, from
    `openb_pod_list_default.csv` beside it (its first 8,152 tasks are that file's, unchanged); each
    task not in it gets the (creation_time, duration) of a task drawn, with `random.Random(seed)`,
    from the default tasks with the same num_gpu (any GPU task when none has it).
A row that cannot be read is skipped and named (file, line, column, why); the replay reports them.
"""

from __future__ import annotations

import csv
import math
import random
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from muster.services.scheduler.placement import NodeState
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import GpuDevice

ALIBABA_TASKS = "openb_pod_list_default.csv"
ALIBABA_NODES = "openb_node_list_gpu_node.csv"
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
POD_TIMES = ("creation_time", "deletion_time")
SIMPLE_COLUMNS = ("submit_time", "duration", "gpus")
SIMPLE_DEFAULTS = {"cpus": 1, "memory_mb": 1024}  # a simple trace that leaves them out
ALIBABA_NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
SIMPLE_NODE_COLUMNS = ("name", "cpus", "memory_mb", "gpus", "gpu_model")
MIN_MEMORY_MB = 100  # JobConfig's floor for memoryMB


class TraceError(ValueError):
    """A trace that cannot be replayed at all: a missing file, a header without a needed column."""


class BadRow(ValueError):
    """One row that cannot be read; it is skipped and named."""


@dataclass(frozen=True)
class TraceTask:
    name: str
    arrival: float  # seconds from the start of the trace
    duration: float  # seconds it runs once started
    config: JobConfig  # the single-task Muster job it becomes
    gpu_milli: int = 1000  # share of one GPU the trace asked for (1000: whole GPUs)
    spec: str = ""  # the trace's gpu_spec, as written
    memory_mb: int = MIN_MEMORY_MB  # the trace's memory, before JobConfig's floor
    timing: str = "trace"  # trace | pending (never scheduled there) | borrowed | drawn
    clamped: bool = False  # its duration came out negative and was set to 0
    qos: str = ""  # the trace's QoS class (Alibaba: LS, BE, Burstable, Guaranteed), if it has one

    @property
    def gpus(self) -> int:
        """All the GPUs the job holds (a gang's tasks together)."""
        return sum(r.gpuNumber * r.taskNumber for r in self.config.taskRoles)


@dataclass
class Adjustments:
    """What the mapping changed in a list of tasks, counted, so the report says what the replay
    is not."""

    fractional: int = 0  # tasks asking for part of one GPU, given a whole one
    rounding_gpu_s: float = 0.0  # GPU-seconds those whole GPUs cost beyond the asked share
    narrowed: Counter[str] = field(default_factory=Counter)  # "A|B -> B": tasks kept to one model
    any_model: int = 0  # GPU tasks whose spec allows every model of the cluster: gpuType unset
    memory_raised: int = 0  # memory below JobConfig's floor, raised to it
    timing: Counter[str] = field(default_factory=Counter)  # TraceTask.timing -> tasks
    clamped: int = 0  # negative durations set to 0


def adjustments(tasks: list[TraceTask]) -> Adjustments:
    out = Adjustments()
    for task in tasks:
        if task.gpus == 1 and task.gpu_milli < 1000:
            out.fractional += 1
            out.rounding_gpu_s += (1000 - task.gpu_milli) / 1000 * task.duration
        allowed = sorted({m for m in task.spec.split("|") if m})
        if task.gpus and allowed:
            if task.config.gpuType is None:
                out.any_model += 1
            elif len(allowed) > 1:
                out.narrowed[f"{'|'.join(allowed)} -> {task.config.gpuType}"] += 1
        out.memory_raised += task.memory_mb < MIN_MEMORY_MB
        out.timing[task.timing] += 1
        out.clamped += task.clamped
    return out


@dataclass
class Trace:
    source: str
    tasks: list[TraceTask]  # in arrival order (file order breaks ties)
    nodes: list[NodeState]
    skipped: list[str]  # "file line N, column C: why" for every row left out
    notes: list[str] = field(default_factory=list)  # rules applied to the whole file

    @property
    def total_gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)


# ------------------------------------------------------------------ reading rows


def _rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """(line number, row) of a CSV with a header; TraceError if a required column is missing."""
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in reader.fieldnames or []]
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(f"{path}: the header lacks column(s) {', '.join(missing)} (it has: {header})")
        reader.fieldnames = header
        for row in reader:
            yield reader.line_num, {k: (v or "").strip() for k, v in row.items() if k is not None}


def _header(path: Path) -> list[str]:
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    with path.open(newline="") as f:
        return [h.strip() for h in next(csv.reader(f), [])]


def _num(row: Mapping[str, str], column: str, default: float | None = None) -> float:
    """A finite number ≥ 0 from one cell; BadRow naming the column otherwise."""
    text = row.get(column, "")
    if text == "":
        if default is not None:
            return default
        raise BadRow(f"column {column}: empty")
    try:
        value = float(text)
    except ValueError:
        raise BadRow(f"column {column}: {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise BadRow(f"column {column}: {text!r} is not a finite number ≥ 0")
    return value


def _int(row: Mapping[str, str], column: str, default: int | None = None) -> int:
    value = _num(row, column, None if default is None else float(default))
    if value != int(value):
        raise BadRow(f"column {column}: {row[column]!r} is not a whole number")
    return int(value)


def job_config(
    name: str,
    cpus: int,
    memory_mb: int,
    gpus: int,
    gpu_type: str | None,
    roles: list[tuple[str, int, int, int, int]] | None = None,
) -> JobConfig:
    """The single-task Muster job a trace task becomes (or, given `roles` as (name, tasks, cpus,
    memory_mb, gpus), that gang); BadRow if JobConfig rejects it."""
    shape = roles or [("task", 1, cpus, memory_mb, gpus)]
    try:
        return JobConfig.model_validate(
            {
                "jobName": name,
                "image": "busybox",
                "gpuType": gpu_type,
                "taskRoles": [
                    {
                        "name": role,
                        "taskNumber": count,
                        "cpuNumber": role_cpus,
                        "memoryMB": role_memory_mb,
                        "gpuNumber": role_gpus,
                        "command": "replay",
                    }
                    for role, count, role_cpus, role_memory_mb, role_gpus in shape
                ],
            }
        )
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadRow(f"as a Muster job, {where}: {first['msg']}") from None


# ------------------------------------------------------------------ nodes


def read_nodes(path: Path, skipped: list[str]) -> list[NodeState]:
    """Nodes from an Alibaba node list or a simple node CSV; nodes without GPUs are kept."""
    alibaba = "sn" in _header(path)
    required = ALIBABA_NODE_COLUMNS if alibaba else SIMPLE_NODE_COLUMNS
    nodes: list[NodeState] = []
    seen: set[str] = set()
    for line, row in _rows(path, required):
        try:
            name = row["sn" if alibaba else "name"]
            if not name:
                raise BadRow(f"column {'sn' if alibaba else 'name'}: empty")
            if name in seen:
                raise BadRow(f"node {name} is listed twice")
            if alibaba:
                cpus = _int(row, "cpu_milli") // 1000
                memory_mb, count, model = _int(row, "memory_mib"), _int(row, "gpu"), row["model"]
            else:
                cpus, memory_mb = _int(row, "cpus"), _int(row, "memory_mb")
                count, model = _int(row, "gpus"), row["gpu_model"]
            if count and not model:
                raise BadRow(f"column {'model' if alibaba else 'gpu_model'}: empty for {count} GPUs")
        except BadRow as e:
            skipped.append(f"{path.name} line {line}, {e}")
            continue
        seen.add(name)
        devices = [GpuDevice(index=i, model=model) for i in range(count)]
        nodes.append(NodeState(name, cpus, memory_mb, devices))
    if not nodes:
        raise TraceError(f"{path}: no nodes could be read")
    return nodes


def uniform_nodes(count: int, gpus: int, model: str, cpus: int, memory_mb: int) -> list[NodeState]:
    return [
        NodeState(f"node-{i:05d}", cpus, memory_mb, [GpuDevice(index=k, model=model) for k in range(gpus)])
        for i in range(count)
    ]


def gpus_by_model(nodes: list[NodeState]) -> Counter[str]:
    return Counter(d.model for n in nodes for d in n.gpus)


def gpu_type_for(spec: str, cluster: Counter[str]) -> str | None:
    """One `gpuType` for a `|`-separated list of allowed models (see the module docstring)."""
    allowed = sorted({m for m in spec.split("|") if m})
    have = {m.lower() for m in cluster}
    if not allowed or (have and have <= {m.lower() for m in allowed}):
        return None
    present = [m for m in allowed if m.lower() in have]
    return min(present, key=lambda m: (-cluster[m], m)) if present else allowed[0]


# ------------------------------------------------------------------ tasks

Times = tuple[float, float | None, float, str]  # creation, scheduled (None: never), deletion, timing


def _row_times(row: Mapping[str, str]) -> Times:
    created, deleted = _num(row, "creation_time"), _num(row, "deletion_time")
    scheduled = _num(row, "scheduled_time") if row.get("scheduled_time") else None
    return created, scheduled, deleted, "trace" if scheduled is not None else "pending"


def _borrowed_times(path: Path, rows: list[tuple[int, dict[str, str]]], seed: int) -> dict[str, Times]:
    """Times by task name for a pod list without them, taken from the default pod list beside it;
    tasks it lacks get a seeded draw (see the module docstring)."""
    default = path.with_name(ALIBABA_TASKS)
    if not default.is_file():
        raise TraceError(
            f"{path}: it has no {'/'.join(POD_TIMES)} columns, and there is no {ALIBABA_TASKS} beside it "
            "to take arrivals and durations from"
        )
    known: dict[str, Times] = {}
    by_gpus: dict[int, list[tuple[float, float]]] = {}
    for _, row in _rows(default, (*POD_COLUMNS, *POD_TIMES)):
        try:
            created, scheduled, deleted, _ = _row_times(row)
            gpus = _int(row, "num_gpu")
        except BadRow:
            continue
        known[row["name"]] = (created, scheduled, deleted, "borrowed")
        if gpus:
            by_gpus.setdefault(gpus, []).append(
                (created, deleted - (created if scheduled is None else scheduled))
            )
    rng = random.Random(seed)
    every = [pair for pairs in by_gpus.values() for pair in pairs]
    out: dict[str, Times] = {}
    for _, row in rows:
        name = row.get("name", "")
        if name in known:
            out[name] = known[name]
            continue
        try:
            pool = by_gpus.get(_int(row, "num_gpu")) or every
        except BadRow:
            continue
        if pool:
            created, duration = rng.choice(pool)
            out[name] = (created, created, created + duration, "drawn")
    return out


def read_alibaba_tasks(path: Path, nodes: list[NodeState], seed: int, skipped: list[str]) -> list[TraceTask]:
    rows = list(_rows(path, POD_COLUMNS))
    header = set(rows[0][1]) if rows else set()
    borrowed = None if set(POD_TIMES) <= header else _borrowed_times(path, rows, seed)
    cluster = gpus_by_model(nodes)
    tasks: list[TraceTask] = []
    seen: set[str] = set()
    for line, row in rows:
        try:
            name = row["name"]
            if not name:
                raise BadRow("column name: empty")
            if name in seen:
                raise BadRow(f"task {name} is listed twice")
            cpus = max(1, math.ceil(_num(row, "cpu_milli") / 1000))
            memory_mb, gpus, milli = _int(row, "memory_mib"), _int(row, "num_gpu"), _int(row, "gpu_milli", 0)
            if borrowed is None:
                created, scheduled, deleted, timing = _row_times(row)
            elif name in borrowed:
                created, scheduled, deleted, timing = borrowed[name]
            else:
                raise BadRow("no arrival and duration could be found or drawn for it")
            spec = row.get("gpu_spec", "")
            gpu_type = gpu_type_for(spec, cluster) if gpus else None
            config = job_config(name, cpus, max(memory_mb, MIN_MEMORY_MB), gpus, gpu_type)
        except BadRow as e:
            skipped.append(f"{path.name} line {line}, {e}")
            continue
        seen.add(name)
        duration = deleted - (created if scheduled is None else scheduled)
        share = milli if gpus == 1 and 0 < milli < 1000 else 1000
        tasks.append(
            TraceTask(
                name,
                created,
                max(0.0, duration),
                config,
                share,
                spec,
                memory_mb,
                timing,
                duration < 0,
                row.get("qos", ""),
            )
        )
    return tasks


def gang_config(
    name: str, cpus: int, memory_mb: int, gpus: int, model: str | None, per_node: int
) -> JobConfig:
    """The job of a simple-trace row. One task, unless it asks for more GPUs than the largest node
    has (`per_node`): then a gang of tasks of `per_node` GPUs (role `task`), and one of the rest
    (role `rest`) if `per_node` does not divide `gpus`, as a Philly job spanning servers runs.
    The row's CPUs and memory are the job's: each task gets its GPUs' share, rounded up."""
    if not per_node or gpus <= per_node:
        return job_config(name, cpus, memory_mb, gpus, model)
    whole, rest = divmod(gpus, per_node)

    def share(total: int, part: int, floor: int) -> int:
        return max(floor, math.ceil(total * part / gpus))

    roles = [("task", whole, share(cpus, per_node, 1), share(memory_mb, per_node, MIN_MEMORY_MB), per_node)]
    if rest:
        roles.append(("rest", 1, share(cpus, rest, 1), share(memory_mb, rest, MIN_MEMORY_MB), rest))
    return job_config(name, cpus, memory_mb, gpus, model, roles)


def read_simple_tasks(path: Path, skipped: list[str], per_node: int = 0) -> list[TraceTask]:
    """Tasks of a simple CSV (`per_node`: the most GPUs a node has; a job asking for more becomes a
    gang, `gang_config`)."""
    tasks: list[TraceTask] = []
    seen: set[str] = set()
    for line, row in _rows(path, SIMPLE_COLUMNS):
        try:
            name = row.get("name") or f"job-{line:06d}"
            if name in seen:
                raise BadRow(f"task {name} is listed twice")
            arrival, duration = _num(row, "submit_time"), _num(row, "duration")
            gpus = _int(row, "gpus")
            cpus = _int(row, "cpus", SIMPLE_DEFAULTS["cpus"])
            memory_mb = _int(row, "memory_mb", SIMPLE_DEFAULTS["memory_mb"])
            model = row.get("gpu_model") or None
            config = gang_config(name, cpus, memory_mb, gpus, model, per_node)
        except BadRow as e:
            skipped.append(f"{path.name} line {line}, {e}")
            continue
        seen.add(name)
        tasks.append(TraceTask(name, arrival, duration, config, spec=model or "", memory_mb=memory_mb))
    return tasks


def load(
    trace: Path,
    nodes_csv: Path | None = None,
    nodes: list[NodeState] | None = None,
    seed: int = 0,
    limit: int | None = None,
) -> Trace:
    """A trace directory (its default Alibaba pod list) or one task CSV, with its nodes: `nodes`,
    else `nodes_csv`, else the Alibaba GPU node list beside the tasks. `limit`: only the first
    tasks by arrival."""
    tasks_csv = trace / ALIBABA_TASKS if trace.is_dir() else trace
    skipped: list[str] = []
    alibaba = "num_gpu" in _header(tasks_csv)
    if nodes is None:
        node_file = nodes_csv or tasks_csv.with_name(ALIBABA_NODES)
        if nodes_csv is None and not (alibaba and node_file.is_file()):
            raise TraceError(
                f"{tasks_csv}: no nodes given (--nodes-csv, or --nodes N) and no {ALIBABA_NODES} beside it"
            )
        nodes = read_nodes(node_file, skipped)
    if alibaba:
        tasks = read_alibaba_tasks(tasks_csv, nodes, seed, skipped)
    else:
        tasks = read_simple_tasks(tasks_csv, skipped, max((len(n.gpus) for n in nodes), default=0))
    order = sorted(range(len(tasks)), key=lambda i: (tasks[i].arrival, i))
    tasks = [tasks[i] for i in order][:limit]
    notes = []
    timing = adjustments(tasks).timing
    if timing["pending"]:
        notes.append(
            f"{timing['pending']} tasks were never scheduled in the trace (Pending): "
            "their duration is deletion - creation"
        )
    if timing["borrowed"] or timing["drawn"]:
        notes.append(
            f"{tasks_csv.name} has no times: {timing['borrowed']} tasks took theirs by name from "
            f"{ALIBABA_TASKS}, {timing['drawn']} drew the (creation, duration) of a default task with "
            f"the same num_gpu (random.Random({seed}))"
        )
    return Trace(str(tasks_csv), tasks, nodes, skipped, notes)
