"""Property test: a random cluster lives through random submits and completions, with the planner
run after each step and its plans committed; the invariants of placement hold at every step, for
whole GPUs and for shares of one (gpuNumber 0.25 ...): each GPU index is held whole by one task, or
shared by fractional tasks whose shares add up to at most one GPU, never both."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from muster.services.scheduler.placement import Cluster, NodeState, PendingJob, Plan, allocate, plan, release
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import GpuDevice, TaskSpec

MODELS = ["V100", "T4", "A100"]


@st.composite
def nodes(draw: Any) -> list[NodeState]:
    out = []
    for i in range(draw(st.integers(1, 6))):
        gpus: list[GpuDevice] = []
        for _ in range(draw(st.integers(0, 2))):
            model = draw(st.sampled_from(MODELS))
            count = draw(st.integers(1, 8))
            gpus += [GpuDevice(index=len(gpus) + k, model=model) for k in range(count)]
        cpus = draw(st.integers(2, 32))
        memory_mb = draw(st.integers(2, 32)) * 1024
        out.append(NodeState(f"n{i}", cpus, memory_mb, gpus))
    return out


roles = st.lists(
    st.tuples(
        st.integers(1, 3),
        st.integers(1, 8),
        st.integers(1, 8),
        st.sampled_from([0, 0, 1, 1, 2, 4, 8, 0.25, 0.5, 0.75, 0.1]),
    ),
    min_size=1,
    max_size=2,
)
gpu_types = st.sampled_from([None, None, None, "v100", "T4", "A100"])
submit = st.tuples(st.just("submit"), roles, gpu_types)
complete = st.tuples(st.just("complete"), st.integers(0, 1000))
operations = st.lists(st.one_of(submit, submit, submit, complete), min_size=6, max_size=24)


def make_job(n: int, shape: list[tuple[int, int, int, float]], gpu_type: str | None) -> PendingJob:
    config = JobConfig.model_validate(
        {
            "jobName": f"j{n}",
            "image": "busybox",
            "gpuType": gpu_type,
            "taskRoles": [
                {
                    "name": f"r{i}",
                    "taskNumber": k,
                    "cpuNumber": c,
                    "memoryMB": m * 512,
                    "gpuNumber": g,
                    "command": "run",
                }
                for i, (k, c, m, g) in enumerate(shape)
            ],
        }
    )
    return PendingJob(f"j{n}", config)


def check(view: dict[str, NodeState], queue: list[PendingJob], result: Plan) -> None:
    by_id = {j.job_id: j for j in queue}
    assert set(result.placements) | set(result.pending) == set(by_id)
    assert not set(result.placements) & set(result.pending)
    assert all(result.pending.values())
    assert result.unschedulable <= set(result.pending)
    for job_id, tasks in result.placements.items():
        config = by_id[job_id].config
        expected = [(no, r.name, i) for no, r in enumerate(config.taskRoles) for i in range(r.taskNumber)]
        assert [(t.role_no, t.role, t.index) for t in tasks] == expected
        for t in tasks:
            devices = {d.index: d.model for d in view[t.node].gpus}
            role = config.taskRoles[t.role_no]
            assert len(t.gpus) == role.gpu_devices
            assert t.gpu_milli == (role.gpu_milli if role.shares_gpu else None)
            if config.gpuType:
                assert all(devices[i].lower() == config.gpuType.lower() for i in t.gpus)


def check_capacity(view: dict[str, NodeState], running: dict[str, tuple[JobConfig, list[TaskSpec]]]) -> None:
    shares: dict[tuple[str, int], int] = {}
    for _, tasks in running.values():
        for t in tasks:
            if t.gpu_milli is not None:
                shares[(t.node, t.gpus[0])] = shares.get((t.node, t.gpus[0]), 0) + t.gpu_milli
    for n in view.values():
        assert 0 <= n.used_cpus <= n.cpus
        assert 0 <= n.used_memory_mb <= n.memory_mb
        assert n.used_gpus <= {d.index for d in n.gpus}
        assert not n.used_gpus & set(n.shared), "a GPU is held whole and shared"
        assert all(0 < used <= 1000 for used in n.shared.values())
        assert n.shared == {i: used for (node, i), used in shares.items() if node == n.name}


@settings(max_examples=200, deadline=None)
@given(nodes(), operations)
def test_invariants_hold_through_submits_and_completions(cluster: list[NodeState], ops: list[Any]) -> None:
    view = {n.name: n for n in cluster}
    queue: list[PendingJob] = []
    running: dict[str, tuple[JobConfig, list[TaskSpec]]] = {}
    for n, op in enumerate(ops):
        if op[0] == "submit":
            queue.append(make_job(n, op[1], op[2]))
        elif running:
            job_id = sorted(running)[op[1] % len(running)]
            config, tasks = running.pop(job_id)
            release(view, config, tasks)
        before = copy.deepcopy(view)
        result = plan(view.values(), queue)
        assert view == before
        check(view, queue, result)
        event(f"placed {min(len(result.placements), 2)}, pending {min(len(result.pending), 2)}")
        event(f"unschedulable: {bool(result.unschedulable)}, head: {result.head is not None}")
        event(f"waiting behind the head: {any('waiting behind' in r for r in result.pending.values())}")
        if queue and queue[0].job_id not in result.unschedulable:  # FIFO: the first job is never held back
            alone = plan(view.values(), queue[:1])
            assert (queue[0].job_id in result.placements) == (queue[0].job_id in alone.placements)
            # The cheap question the preemption and elastic cores ask has the same answer.
            assert Cluster(view.values()).place_alone(queue[0]) == alone.placements.get(queue[0].job_id)
            assert view == before
        seen: dict[str, set[int]] = {name: set(n.used_gpus) for name, n in view.items()}
        shared: dict[str, dict[int, int]] = {name: dict(n.shared) for name, n in view.items()}
        for job in queue:
            if job.job_id in result.placements:
                tasks = result.placements[job.job_id]
                for t in tasks:
                    assert not seen[t.node] & set(t.gpus), "a GPU index is used twice"
                    if t.gpu_milli is None:
                        assert not set(shared[t.node]) & set(t.gpus), "a shared GPU is also held whole"
                        seen[t.node] |= set(t.gpus)
                    else:
                        shared[t.node][t.gpus[0]] = shared[t.node].get(t.gpus[0], 0) + t.gpu_milli
                        assert shared[t.node][t.gpus[0]] <= 1000, "a GPU is shared beyond itself"
                    event(f"shares a GPU: {t.gpu_milli is not None}")
                allocate(view, job.config, tasks)  # raises on over-allocation or a GPU used twice
                running[job.job_id] = (job.config, tasks)
        check_capacity(view, running)
        queue = [j for j in queue if j.job_id not in result.placements]
    for config, tasks in running.values():
        release(view, config, tasks)
    assert all(
        n.used_cpus == n.used_memory_mb == 0 and not n.used_gpus and not n.shared for n in view.values()
    )
