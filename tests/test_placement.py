"""Placement core as scenarios: nodes and a queue in, placements and pending reasons out."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

import pytest

from muster.services.scheduler.placement import (
    Claim,
    NodeState,
    PendingJob,
    Plan,
    allocate,
    plan,
    release,
)
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import GpuDevice, NodeInfo, TaskSpec

Role = tuple[str, int, int, int, int]  # name, taskNumber, cpuNumber, memoryMB, gpuNumber


def node(
    name: str,
    cpus: int = 32,
    mem: int = 131072,
    gpus: str = "",
    used_gpus: tuple[int, ...] = (),
    used_cpus: int = 0,
    used_mem: int = 0,
) -> NodeState:
    """`gpus="4xV100,2xT4"`: device indexes are numbered in that order from 0."""
    devices: list[GpuDevice] = []
    for part in filter(None, gpus.split(",")):
        count, model = part.split("x", 1)
        devices += [
            GpuDevice(index=len(devices) + k, model=model, memory_mb=16384) for k in range(int(count))
        ]
    return NodeState(name, cpus, mem, devices, used_cpus, used_mem, set(used_gpus))


def job(job_id: str, roles: list[Role] | None = None, gpuType: str | None = None) -> PendingJob:
    roles = roles or [("worker", 1, 1, 1000, 0)]
    config = JobConfig.model_validate(
        {
            "jobName": job_id,
            "image": "busybox",
            "gpuType": gpuType,
            "taskRoles": [
                {"name": n, "taskNumber": k, "cpuNumber": c, "memoryMB": m, "gpuNumber": g, "command": "run"}
                for n, k, c, m, g in roles
            ],
        }
    )
    return PendingJob(job_id, config)


def shown(tasks: list[TaskSpec]) -> list[str]:
    return [f"{t.role}.{t.index}@{t.node}:{','.join(map(str, t.gpus))}" for t in tasks]


@dataclass
class Case:
    name: str
    nodes: list[NodeState]
    queue: list[PendingJob]
    placed: dict[str, list[str]] = field(default_factory=dict)  # job -> shown(tasks), config order
    pending: dict[str, str] = field(default_factory=dict)  # job -> text the reason must contain
    unschedulable: set[str] = field(default_factory=set)
    head: str | None = None
    avoid: frozenset[str] = frozenset()


V100_HALF_BUSY = dict(cpus=32, gpus="8xV100", used_gpus=(0, 1, 2, 3), used_cpus=4)
HEAD = job("jhead", [("trainer", 1, 8, 8192, 8)], gpuType="V100")

CASES = [
    # ---------------------------------------------------------------- gang
    Case(
        "gang: the third task does not fit, so nothing is placed",
        [node("a", cpus=8, used_cpus=2), node("b", cpus=4)],
        [job("j1", [("worker", 3, 4, 1000, 0)])],
        pending={"j1": "only 2 of 3 tasks fit in what is free now"},
        head="j1",
    ),
    Case(
        "gang: a job bigger than the whole cluster can never run",
        [node("a", cpus=4), node("b", cpus=4)],
        [job("j1", [("worker", 3, 3, 1000, 0)])],
        pending={
            "j1": "can never run on the current nodes: its 3 tasks need 9 CPUs in all; the cluster has 8"
        },
        unschedulable={"j1"},
    ),
    Case(
        "gang: enough in total but it does not pack, even on empty nodes",
        [node("a", cpus=5), node("b", cpus=5)],
        [job("j1", [("worker", 3, 3, 1000, 0)])],
        pending={"j1": "its 3 tasks do not pack onto the nodes even when they are empty"},
        unschedulable={"j1"},
    ),
    Case(
        "gang: every task of every role is placed, in config order",
        [node("a", gpus="4xV100"), node("b", gpus="4xV100")],
        [job("j1", [("ps", 1, 2, 1000, 0), ("worker", 2, 2, 1000, 4)])],
        placed={"j1": ["ps.0@a:", "worker.0@a:0,1,2,3", "worker.1@b:0,1,2,3"]},
    ),
    Case(
        "gang: larger tasks are placed first so the big one still finds its node",
        [node("a", cpus=8, gpus="1xV100"), node("b", cpus=2, gpus="2xV100")],
        [job("j1", [("small", 1, 1, 1000, 1), ("big", 1, 8, 1000, 1)])],
        placed={"j1": ["small.0@b:0", "big.0@a:0"]},
    ),
    # ---------------------------------------------------------------- GPU type and indexes
    Case(
        "gpuType: a T4 job goes to the T4 node, matched case-insensitively",
        [node("v", gpus="4xV100"), node("t", gpus="4xT4")],
        [job("j1", [("worker", 1, 1, 1000, 2)], gpuType="t4")],
        placed={"j1": ["worker.0@t:0,1"]},
    ),
    Case(
        "gpuType: a T4 job waits for T4s rather than taking free V100s",
        [node("v", gpus="4xV100"), node("t", gpus="4xT4", used_gpus=(0, 1, 2))],
        [job("j1", [("worker", 1, 1, 1000, 2)], gpuType="T4")],
        pending={"j1": "needs 2 T4 on one node; largest free block is 1 T4 (t)"},
        head="j1",
    ),
    Case(
        "indexes: tasks sharing a node get disjoint devices",
        [node("a", gpus="8xV100")],
        [job("j1", [("worker", 4, 1, 1000, 2)])],
        placed={"j1": ["worker.0@a:0,1", "worker.1@a:2,3", "worker.2@a:4,5", "worker.3@a:6,7"]},
    ),
    Case(
        "indexes: devices already in use are skipped",
        [node("a", gpus="4xV100", used_gpus=(0, 2))],
        [job("j1", [("worker", 1, 1, 1000, 2)])],
        placed={"j1": ["worker.0@a:1,3"]},
    ),
    Case(
        "mixed models: each job gets devices of its own type",
        [node("a", gpus="4xV100,2xT4")],
        [job("jt", [("w", 1, 1, 1000, 2)], gpuType="T4"), job("jv", [("w", 1, 1, 1000, 4)], gpuType="V100")],
        placed={"jt": ["w.0@a:4,5"], "jv": ["w.0@a:0,1,2,3"]},
    ),
    Case(
        "mixed models: without gpuType any model will do",
        [node("a", gpus="4xV100,2xT4")],
        [job("j1", [("w", 1, 1, 1000, 6)])],
        placed={"j1": ["w.0@a:0,1,2,3,4,5"]},
    ),
    # ---------------------------------------------------------------- best fit
    Case(
        "best fit: a 1-GPU task takes the last free GPU, not the empty 8-GPU node",
        [node("big", gpus="8xV100"), node("small", gpus="8xV100", used_gpus=(0, 1, 2, 3, 4, 5, 6))],
        [job("j1", [("w", 1, 1, 1000, 1)])],
        placed={"j1": ["w.0@small:7"]},
    ),
    Case(
        "best fit: CPU tasks go to GPU-less nodes",
        [node("g", cpus=64, gpus="4xV100"), node("c", cpus=8)],
        [job("j1", [("w", 2, 2, 1000, 0)])],
        placed={"j1": ["w.0@c:", "w.1@c:"]},
    ),
    Case(
        "best fit: CPU tasks prefer a GPU-less node even to a GPU node whose GPUs are all busy",
        [node("g", cpus=4, gpus="4xV100", used_gpus=(0, 1, 2, 3)), node("c", cpus=16)],
        [job("j1", [("w", 1, 2, 1000, 0)])],
        placed={"j1": ["w.0@c:"]},
    ),
    Case(
        "best fit: among GPU nodes, CPU tasks go where the fewest GPUs are free",
        [node("g1", gpus="4xV100"), node("g2", gpus="4xV100", used_gpus=(0, 1, 2))],
        [job("j1", [("w", 1, 2, 1000, 0)])],
        placed={"j1": ["w.0@g2:"]},
    ),
    Case(
        "best fit: CPU tasks go where the fewest CPUs remain",
        [node("c1", cpus=16), node("c2", cpus=8)],
        [job("j1", [("w", 1, 4, 1000, 0)])],
        placed={"j1": ["w.0@c2:"]},
    ),
    # ---------------------------------------------------------------- CPU and memory limits
    Case(
        "limits: CPUs bound how many GPU tasks share a node",
        [node("a", cpus=8, used_cpus=4, gpus="8xV100")],
        [job("j1", [("worker", 2, 3, 1000, 1)])],
        pending={"j1": "only 1 of 2 tasks fit in what is free now (task worker needs 1 GPU, 3 CPUs"},
        head="j1",
    ),
    Case(
        "limits: memory bounds how many tasks share a node",
        [node("a", mem=8192, used_mem=4096, gpus="8xV100")],
        [job("j1", [("worker", 2, 1, 3000, 1)])],
        pending={"j1": "only 1 of 2 tasks fit in what is free now"},
        head="j1",
    ),
    # ---------------------------------------------------------------- FIFO and backfill
    Case(
        "FIFO: of two equal jobs that cannot both fit, the earlier one is placed",
        [node("a", gpus="4xV100")],
        [job("j1", [("w", 1, 1, 1000, 4)]), job("j2", [("w", 1, 1, 1000, 4)])],
        placed={"j1": ["w.0@a:0,1,2,3"]},
        pending={"j2": "needs 4 GPUs on one node; no GPU is free now"},
        head="j2",
    ),
    Case(
        "FIFO: the same jobs the other way round",
        [node("a", gpus="4xV100")],
        [job("j2", [("w", 1, 1, 1000, 4)]), job("j1", [("w", 1, 1, 1000, 4)])],
        placed={"j2": ["w.0@a:0,1,2,3"]},
        pending={"j1": "no GPU is free now"},
        head="j1",
    ),
    Case(
        "backfill (a): small jobs run on what the blocked head cannot use",
        [node("v", **V100_HALF_BUSY), node("t", cpus=16, gpus="4xT4"), node("c", cpus=16)],
        [
            HEAD,
            job("jt4", [("w", 1, 1, 1000, 1)], gpuType="T4"),
            job("jcpu", [("w", 1, 4, 1000, 0)]),
            job("jany", [("w", 1, 1, 1000, 1)]),
        ],
        placed={"jt4": ["w.0@t:0"], "jcpu": ["w.0@c:"], "jany": ["w.0@t:1"]},
        pending={"jhead": "needs 8 V100 on one node; largest free block is 4 V100 (v); first in line"},
        head="jhead",
    ),
    Case(
        "backfill (b): a job that would take the head's GPUs waits behind it",
        [node("v", **V100_HALF_BUSY), node("c", cpus=16)],
        [
            HEAD,
            job("jv", [("w", 1, 1, 1000, 1)], gpuType="V100"),
            job("jbig", [("w", 1, 1, 1000, 5)], gpuType="V100"),
            job("jcpu", [("w", 1, 4, 1000, 0)]),
        ],
        placed={"jcpu": ["w.0@c:"]},
        pending={
            "jhead": "largest free block is 4 V100 (v)",
            "jv": "waiting behind job jhead (FIFO)",
            "jbig": "needs 5 V100 on one node; largest free block is 4 V100 (v)",
        },
        head="jhead",
    ),
    Case(
        "backfill: CPUs the head leaves over on its node may be used",
        [node("v", **V100_HALF_BUSY)],
        [HEAD, job("jcpu", [("w", 1, 4, 1000, 0)])],
        placed={"jcpu": ["w.0@v:"]},
        pending={"jhead": "largest free block is 4 V100 (v)"},
        head="jhead",
    ),
    Case(
        "backfill: CPUs the head needs on its node may not be used",
        [node("v", cpus=12, gpus="8xV100", used_gpus=(0, 1, 2, 3), used_cpus=2)],
        [HEAD, job("jcpu", [("w", 1, 4, 1000, 0)])],
        pending={"jhead": "largest free block is 4 V100 (v)", "jcpu": "waiting behind job jhead (FIFO)"},
        head="jhead",
    ),
    Case(
        "backfill: a job that can never run does not block the queue",
        [node("a", cpus=8, gpus="4xV100")],
        [job("jhuge", [("w", 1, 16, 1000, 0)]), job("j1", [("w", 1, 1, 1000, 1)])],
        placed={"j1": ["w.0@a:0"]},
        pending={"jhuge": "can never run"},
        unschedulable={"jhuge"},
    ),
    Case(
        "avoid: avoided nodes get nothing",
        [node("a", gpus="4xV100"), node("b", gpus="4xV100")],
        [job("j1", [("w", 1, 1, 1000, 1)])],
        placed={"j1": ["w.0@b:0"]},
        avoid=frozenset({"a"}),
    ),
    # ---------------------------------------------------------------- reasons
    Case(
        "reason: no nodes",
        [],
        [job("j1")],
        pending={"j1": "no nodes registered"},
        unschedulable={"j1"},
    ),
    Case(
        "reason: every node avoided",
        [node("a")],
        [job("j1")],
        pending={"j1": "no schedulable nodes: every node is avoided (a)"},
        unschedulable={"j1"},
        avoid=frozenset({"a"}),
    ),
    Case(
        "reason: no GPU of the type",
        [node("a", gpus="4xV100"), node("b", gpus="2xT4"), node("c")],
        [job("j1", [("w", 1, 1, 1000, 1)], gpuType="A100")],
        pending={
            "j1": "can never run on the current nodes: no node has a GPU of type A100 (cluster has: T4, V100)"
        },
        unschedulable={"j1"},
    ),
    Case(
        "reason: more CPUs than the largest node",
        [node("a", cpus=32), node("b", cpus=16)],
        [job("j1", [("worker", 1, 64, 1000, 0)])],
        pending={
            "j1": "can never run on the current nodes: task worker needs 64 CPUs; the largest node has 32"
        },
        unschedulable={"j1"},
    ),
    Case(
        "reason: more memory than the largest node",
        [node("a", mem=32768)],
        [job("j1", [("worker", 1, 1, 65536, 0)])],
        pending={"j1": "task worker needs 65536 MB of memory; the largest node has 32768 MB"},
        unschedulable={"j1"},
    ),
    Case(
        "reason: more GPUs than the largest node",
        [node("a", gpus="8xV100")],
        [job("j1", [("worker", 1, 1, 1000, 16)], gpuType="v100")],
        pending={"j1": "task worker needs 16 v100 on one node; the largest node has 8"},
        unschedulable={"j1"},
    ),
    Case(
        "reason: no single node has everything a task needs",
        [node("a", cpus=64), node("b", cpus=8, gpus="8xV100")],
        [job("j1", [("worker", 1, 32, 1000, 8)])],
        pending={"j1": "task worker needs 8 GPUs, 32 CPUs and 1000 MB on one node; no node has all of them"},
        unschedulable={"j1"},
    ),
    Case(
        "reason: avoided nodes are named when they are left out",
        [node("a", cpus=8), node("b", cpus=64)],
        [job("j1", [("worker", 1, 32, 1000, 0)])],
        pending={"j1": "the largest node has 8 (avoided nodes not counted: b)"},
        unschedulable={"j1"},
        avoid=frozenset({"b"}),
    ),
    Case(
        "reason: largest free GPU block",
        [
            node("a", gpus="8xV100", used_gpus=(0, 1, 2, 3, 4)),
            node("b", gpus="8xV100", used_gpus=tuple(range(8))),
        ],
        [job("j1", [("worker", 2, 1, 1000, 4)], gpuType="V100")],
        pending={"j1": "needs 2×4 V100 on one node each; largest free block is 3 V100 (a)"},
        head="j1",
    ),
    Case(
        "reason: not enough free CPUs now",
        [node("a", cpus=16, used_cpus=8)],
        [job("j1", [("worker", 1, 16, 1000, 0)])],
        pending={"j1": "task worker needs 16 CPUs on one node; at most 8 are free (a)"},
        head="j1",
    ),
    Case(
        "reason: not enough free memory now",
        [node("a", mem=16384, used_mem=8192)],
        [job("j1", [("worker", 1, 1, 10000, 0)])],
        pending={"j1": "task worker needs 10000 MB on one node; at most 8192 MB are free (a)"},
        head="j1",
    ),
    Case(
        "reason: GPUs free on one node, CPUs on another",
        [
            node("a", cpus=16, used_cpus=12, gpus="4xV100"),
            node("b", cpus=16, gpus="4xV100", used_gpus=(0, 1, 2, 3)),
        ],
        [job("j1", [("worker", 1, 8, 1000, 1)])],
        pending={
            "j1": "task worker needs 1 GPU, 8 CPUs and 1000 MB on one node; no node has all of them free now"
        },
        head="j1",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_scenario(case: Case) -> None:
    before = copy.deepcopy(case.nodes)
    result = plan(case.nodes, case.queue, avoid=case.avoid)
    assert {j: shown(ts) for j, ts in result.placements.items()} == case.placed
    assert set(result.pending) == set(case.pending)
    for job_id, text in case.pending.items():
        assert text in result.pending[job_id]
    assert result.unschedulable == case.unschedulable
    assert result.head == case.head
    assert case.nodes == before  # plan works on copies


def test_head_reserves_what_it_needs_on_the_nearest_node() -> None:
    nodes = [node("v", **V100_HALF_BUSY), node("w", gpus="8xV100", used_gpus=tuple(range(6))), node("c")]
    result = plan(nodes, [HEAD])
    assert result.reserved == {"v": Claim(cpus=8, memory_mb=8192, gpus=Counter({"v100": 8}))}
    assert "holding resources on v" in result.pending["jhead"]


def test_placed_resources_are_deducted_before_the_next_job() -> None:
    result = plan([node("a", cpus=4)], [job("j1", [("w", 1, 3, 1000, 0)]), job("j2", [("w", 1, 3, 1000, 0)])])
    assert list(result.placements) == ["j1"]
    reason = "task w needs 3 CPUs on one node; at most 1 are free (a); first in line, holding resources on a"
    assert result.pending["j2"] == reason


def test_an_empty_queue_gives_an_empty_plan() -> None:
    assert plan([node("a")], []) == Plan()


# ------------------------------------------------------------------ NodeState, allocate, release


def test_node_state_from_info() -> None:
    info = NodeInfo(
        node="n1",
        address="10.0.0.1",
        cpus=16,
        memory_mb=65536,
        gpus=[GpuDevice(index=1, model="Tesla-V100"), GpuDevice(index=0, model="tesla-v100")],
        runtime="docker",
        agent_id="x",
    )
    state = NodeState.from_info(info)
    assert (state.name, state.free_cpus, state.free_memory_mb) == ("n1", 16, 65536)
    assert state.free_gpus() == [0, 1]
    assert state.free_gpus("TESLA-V100") == [0, 1]
    assert state.free_gpus("T4") == []


def placed_on(nodes: list[NodeState], pending: PendingJob) -> list[TaskSpec]:
    return plan(nodes, [pending]).placements[pending.job_id]


def test_allocate_then_plan_sees_the_usage_and_release_frees_it() -> None:
    view = {"a": node("a", cpus=8, gpus="4xV100")}
    j1 = job("j1", [("w", 2, 2, 1000, 2)])
    tasks = placed_on(list(view.values()), j1)
    allocate(view, j1.config, tasks)
    assert (view["a"].used_cpus, view["a"].used_gpus) == (4, {0, 1, 2, 3})
    assert "no GPU is free now" in plan(view.values(), [job("j2", [("w", 1, 1, 1000, 1)])]).pending["j2"]
    release(view, j1.config, tasks)
    assert (view["a"].used_cpus, view["a"].used_memory_mb, view["a"].used_gpus) == (0, 0, set())


def test_allocate_raises_on_a_gpu_already_in_use_and_changes_nothing() -> None:
    view = {"a": node("a", gpus="4xV100", used_gpus=(2,))}
    j1 = job("j1", [("w", 2, 1, 1000, 1)])
    tasks = [
        TaskSpec(role="w", role_no=0, index=0, node="a", gpus=[0]),
        TaskSpec(role="w", role_no=0, index=1, node="a", gpus=[2]),
    ]
    before = copy.deepcopy(view)
    with pytest.raises(ValueError, match="GPU 2 on node a is already in use"):
        allocate(view, j1.config, tasks)
    assert view == before


def test_allocate_raises_when_two_tasks_claim_the_same_gpu() -> None:
    view = {"a": node("a", gpus="4xV100")}
    j1 = job("j1", [("w", 2, 1, 1000, 1)])
    tasks = [TaskSpec(role="w", role_no=0, index=i, node="a", gpus=[3]) for i in range(2)]
    with pytest.raises(ValueError, match="already in use"):
        allocate(view, j1.config, tasks)
    assert view["a"].used_gpus == set()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (TaskSpec(role="w", role_no=0, index=0, node="a", gpus=[9]), "node a has no GPU 9"),
        (TaskSpec(role="w", role_no=0, index=0, node="zz", gpus=[0]), "unknown node zz"),
        (TaskSpec(role="w", role_no=0, index=0, node="a", gpus=[0, 1]), "holds 2 GPUs, its role needs 1"),
        (TaskSpec(role="x", role_no=0, index=0, node="a", gpus=[0]), "is not a role of job"),
    ],
)
def test_allocate_rejects_inconsistent_tasks(spec: TaskSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        allocate({"a": node("a", gpus="4xV100")}, job("j1", [("w", 1, 1, 1000, 1)]).config, [spec])


def test_allocate_raises_beyond_cpu_and_memory_capacity() -> None:
    tasks = [TaskSpec(role="w", role_no=0, index=0, node="a")]
    with pytest.raises(ValueError, match="9 CPUs would exceed its 8"):
        allocate({"a": node("a", cpus=8, used_cpus=4)}, job("j", [("w", 1, 5, 1000, 0)]).config, tasks)
    with pytest.raises(ValueError, match="would exceed its 2000 MB"):
        allocate({"a": node("a", mem=2000)}, job("j", [("w", 1, 1, 3000, 0)]).config, tasks)


def test_release_raises_on_what_is_not_in_use_and_skips_departed_nodes() -> None:
    j1 = job("j1", [("w", 1, 1, 1000, 1)])
    view = {"a": node("a", gpus="4xV100")}
    with pytest.raises(ValueError, match="GPU 0 on node a is not in use"):
        release(view, j1.config, [TaskSpec(role="w", role_no=0, index=0, node="a", gpus=[0])])
    release(view, j1.config, [TaskSpec(role="w", role_no=0, index=0, node="gone", gpus=[0])])
    assert view["a"].used_gpus == set()


def test_a_huge_job_past_the_nodes_totals_is_judged_from_its_roles_alone(monkeypatch):
    """A job of 640,000 tasks (one accepted before the task limits) was made into one object
    per task on every plan: seconds of the leader's loop, past its 4 s lease on a loaded
    machine. Past HUGE_JOB tasks it is first held against what the nodes have in all."""
    from muster.services.scheduler import placement

    def no_demand(config):  # type: ignore[no-untyped-def]
        raise AssertionError("one object per task was made")

    nodes = [node("a", cpus=64, gpus="8xV100"), node("b", cpus=64, gpus="8xV100")]
    monkeypatch.setattr(placement, "_demand", no_demand)
    huge = job("huge", [(f"w{r}", 10_000, 1, 100, 0) for r in range(64)])
    result = plan(nodes, [huge])
    assert "huge" in result.unschedulable
    assert result.pending["huge"] == (
        "can never run on the current nodes: "
        "its 640000 tasks need 640000 CPUs in all; the cluster has 128 CPUs"
    )
    gpus = job("gpus", [("w", 10_000, 1, 100, 1), ("v", 10_000, 1, 100, 1)], gpuType="V100")
    assert "need 20000 V100 in all; the cluster has 16 V100" in plan(nodes, [gpus]).pending["gpus"]
    # Within the totals, the usual checks decide.
    big = [node("a", cpus=8000, mem=2_000_000), node("b", cpus=8000, mem=2_000_000)]
    assert placement.Capacity(big).beyond(huge.config) is not None  # 640,000 CPUs: still too many
    wide = job("wide", [("w", 10_000, 1, 100, 0), ("v", 1, 1, 100, 0)])
    assert placement.Capacity(big).beyond(wide.config) is None
