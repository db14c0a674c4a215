"""Differential test: the indexed planner (`placement.plan`, `Cluster.plan`) decides exactly what
the planner before it decided (`tests/reference_placement.py`, a copy of
services/scheduler/placement.py at 0987d91, before the index, with the rank's starved-GPU key
added since), on random snapshots: placements,
device indexes, reasons, the head and its claims. A `Cluster` kept up to date by joins, leaves,
allocations and releases plans like one built from scratch."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

import tests.reference_placement as old
from muster.services.scheduler import placement as new
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import GpuDevice, TaskSpec

MODELS = ["V100", "T4", "A100"]


@st.composite
def snapshot(draw: Any) -> list[dict[str, Any]]:
    """Nodes, some partly used: name, cpus, memory, GPUs by model, and what is used."""
    out = []
    for i in range(draw(st.integers(1, 10))):
        gpus: list[GpuDevice] = []
        for _ in range(draw(st.integers(0, 2))):
            model = draw(st.sampled_from(MODELS))
            gpus += [GpuDevice(index=len(gpus) + k, model=model) for k in range(draw(st.integers(1, 8)))]
        cpus = draw(st.sampled_from([4, 8, 16, 32]))
        memory_mb = draw(st.sampled_from([4, 8, 16, 32])) * 1024
        used_gpus = (
            set(draw(st.lists(st.sampled_from([d.index for d in gpus]), unique=True))) if gpus else set()
        )
        used_cpus = draw(st.integers(0, cpus))
        used_memory = draw(st.integers(0, memory_mb // 1024)) * 1024
        out.append(
            {
                "name": f"n{i:02d}",
                "cpus": cpus,
                "memory_mb": memory_mb,
                "gpus": gpus,
                "used": (used_cpus, used_memory, used_gpus),
            }
        )
    return out


def old_nodes(spec: list[dict[str, Any]]) -> list[old.NodeState]:
    return [
        old.NodeState(
            n["name"], n["cpus"], n["memory_mb"], list(n["gpus"]), *n["used"][:2], set(n["used"][2])
        )
        for n in spec
    ]


def new_nodes(spec: list[dict[str, Any]]) -> list[new.NodeState]:
    return [
        new.NodeState(
            n["name"], n["cpus"], n["memory_mb"], list(n["gpus"]), *n["used"][:2], set(n["used"][2])
        )
        for n in spec
    ]


role = st.tuples(
    st.integers(1, 4),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([0, 1, 2, 4, 8]),
)
job = st.tuples(
    st.lists(role, min_size=1, max_size=2), st.sampled_from([None, None, "V100", "t4", "A100", "K80"])
)


def queue_of(jobs: list[Any]) -> list[Any]:
    out = []
    for n, (roles, gpu_type) in enumerate(jobs):
        config = JobConfig.model_validate(
            {
                "jobName": f"j{n}",
                "image": "busybox",
                "gpuType": gpu_type,
                "taskRoles": [
                    {"name": f"r{i}", "taskNumber": k, "cpuNumber": c, "memoryMB": m * 1024, "gpuNumber": g}
                    | {"command": "run"}
                    for i, (k, c, m, g) in enumerate(roles)
                ],
            }
        )
        out.append((f"j{n}", config))
    return out


def same(a: Any, b: Any) -> None:
    assert a.placements == b.placements
    assert a.pending == b.pending
    assert a.unschedulable == b.unschedulable
    assert a.head == b.head
    assert {k: (c.cpus, c.memory_mb, dict(c.gpus)) for k, c in a.reserved.items()} == {
        k: (c.cpus, c.memory_mb, dict(c.gpus)) for k, c in b.reserved.items()
    }


@settings(max_examples=400, deadline=None)
@given(snapshot(), st.lists(job, min_size=1, max_size=12), st.data())
def test_the_indexed_planner_decides_as_the_old_one(
    spec: list[dict[str, Any]], jobs: list[Any], data: Any
) -> None:
    queue = queue_of(jobs)
    names = [n["name"] for n in spec]
    avoid = set(data.draw(st.lists(st.sampled_from(names), unique=True, max_size=2)))
    before = old.plan(old_nodes(spec), [old.PendingJob(i, c) for i, c in queue], avoid)
    after = new.plan(new_nodes(spec), [new.PendingJob(i, c) for i, c in queue], avoid)
    same(before, after)


@st.composite
def alike(draw: Any) -> list[dict[str, Any]]:
    """Nodes of one GPU model and count with their GPUs and CPUs partly used: many leave the
    same free GPUs, so the rank's later keys (starved GPUs, then CPUs) choose between them."""
    gpus = [GpuDevice(index=k, model="V100") for k in range(draw(st.sampled_from([2, 4, 8])))]
    out = []
    for i in range(draw(st.integers(2, 12))):
        cpus = draw(st.integers(4, 48))
        used_gpus = set(draw(st.lists(st.sampled_from([d.index for d in gpus]), unique=True)))
        out.append(
            {
                "name": f"n{i:02d}",
                "cpus": cpus,
                "memory_mb": 64 * 1024,
                "gpus": gpus,
                "used": (draw(st.integers(0, cpus)), 0, used_gpus),
            }
        )
    return out


gpu_job = st.tuples(
    st.lists(
        st.tuples(st.integers(1, 3), st.integers(1, 12), st.just(1), st.sampled_from([1, 1, 2])),
        min_size=1,
        max_size=2,
    ),
    st.sampled_from([None, "V100"]),
)


@settings(max_examples=300, deadline=None)
@given(alike(), st.lists(gpu_job, min_size=1, max_size=10))
def test_the_index_ranks_starved_gpus_as_the_pass_over_the_nodes_does(
    spec: list[dict[str, Any]], jobs: list[Any]
) -> None:
    queue = queue_of(jobs)
    before = old.plan(old_nodes(spec), [old.PendingJob(i, c) for i, c in queue])
    after = new.plan(new_nodes(spec), [new.PendingJob(i, c) for i, c in queue])
    same(before, after)


@settings(max_examples=150, deadline=None)
@given(snapshot(), snapshot(), st.lists(job, min_size=1, max_size=8), st.data())
def test_a_cluster_kept_up_to_date_plans_like_a_fresh_one(
    first: list[dict[str, Any]], joiners: list[dict[str, Any]], jobs: list[Any], data: Any
) -> None:
    """Nodes join (some replacing one of the same name) and leave; placed jobs are allocated and
    some released again; after every step the kept cluster plans as a fresh snapshot does."""
    for n in joiners:
        n["name"] = n["name"].replace("n", "m") if data.draw(st.booleans()) else n["name"]
    cluster = new.Cluster(new_nodes(first))
    capacity = new.Capacity(new_nodes(first))
    queue = [new.PendingJob(i, c) for i, c in queue_of(jobs)]
    running: list[tuple[JobConfig, list[TaskSpec]]] = []
    for n in new_nodes(joiners):
        if data.draw(st.booleans()):
            if n.name in cluster.nodes:  # a node that re-registers comes back empty, its tasks gone
                running = [(c, [t for t in ts if t.node != n.name]) for c, ts in running]
            cluster.add(n)
            capacity.add(n)
        elif cluster.nodes:
            gone = data.draw(st.sampled_from(sorted(cluster.nodes)))
            cluster.remove(gone)
            capacity.remove(gone)
            running = [(c, [t for t in ts if t.node != gone]) for c, ts in running]
        result = cluster.plan(queue, capacity)
        fresh = new.plan(list(cluster.nodes.values()), queue)
        same(result, fresh)
        same(cluster.plan(queue, capacity), fresh)  # again, on the capacity's lent empty nodes
        for j in queue:
            if j.job_id in result.placements:
                cluster.allocate(j.config, result.placements[j.job_id])
                running.append((j.config, result.placements[j.job_id]))
        queue = [j for j in queue if j.job_id not in result.placements]
        if running and data.draw(st.booleans()):
            config, tasks = running.pop(data.draw(st.integers(0, len(running) - 1)))
            cluster.release(config, tasks)
    reference = old.plan(old_nodes_of(cluster), [old.PendingJob(j.job_id, j.config) for j in queue])
    same(reference, cluster.plan(queue, capacity))


def old_nodes_of(cluster: new.Cluster) -> list[old.NodeState]:
    return [
        old.NodeState(
            n.name, n.cpus, n.memory_mb, list(n.gpus), n.used_cpus, n.used_memory_mb, set(n.used_gpus)
        )
        for n in cluster.nodes.values()
    ]


def test_the_index_follows_every_change():
    """After allocations and releases through the cluster, its lists match a rebuilt index."""
    nodes = [
        new.NodeState(f"n{i}", 16, 65536, [GpuDevice(index=k, model="V100") for k in range(i % 3 * 4)])
        for i in range(9)
    ]
    cluster = new.Cluster(nodes)
    (jid, config), *_ = queue_of([([(3, 2, 2, 4)], None)])
    result = cluster.plan([new.PendingJob(jid, config)])
    cluster.allocate(config, result.placements[jid])
    assert any(n.used_gpus for n in cluster.nodes.values())
    assert lists(cluster) == lists(new.Cluster(cluster.nodes.values()))
    cluster.release(config, result.placements[jid])
    assert all(n.used_cpus == 0 and not n.used_gpus for n in cluster.nodes.values())
    assert lists(cluster) == lists(new.Cluster(nodes))


def lists(cluster: new.Cluster) -> Any:
    """The index's non-empty lists (a group emptied by a change may stay as an empty list)."""
    groups = {(k, sig): v for k, g in cluster._groups.items() for sig, v in g.items() if v}
    return groups, cluster._most, cluster._cpus, cluster._memory
