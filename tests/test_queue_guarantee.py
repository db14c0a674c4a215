"""The protected head's promise with lending (issue 27): what holds, tested.

1. The pure core, property-tested on random clusters, running gangs and queues: a plan leaves the
   cluster as it was; it stops only running gangs that stood behind the head they are stopped for,
   and places that head in the same plan; what it places fits beside what runs on once the
   stopped gangs are gone; and the head it leaves waiting does not fit even if every running gang
   behind it stopped (so it waits no longer than it must).
2. Against strict FIFO (bench.replay's `fifo`) on seeded random workloads: the longest wait is at
   most FIFO's on nearly every workload, and almost no job waits longer than under FIFO; it is
   not a per-job guarantee (best fit packs the nodes as FIFO's history did not), and the
   reservation without lending (`muster-reserve`) breaks both far more often.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muster.services.scheduler.placement import Cluster, Loan, NodeState, PendingJob, allocate, plan
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import GpuDevice

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is not an installed package; `python -m pytest` finds it anyway
    sys.path.insert(0, str(ROOT))

from bench import replay as rp  # noqa: E402
from bench import replay_policies as bp  # noqa: E402
from bench.replay_policies import POLICIES  # noqa: E402
from bench.replay_trace import Trace, TraceTask, gang_config, uniform_nodes  # noqa: E402


def make_job(name: str, shape: list[tuple[int, int, int]]) -> PendingJob:
    config = JobConfig.model_validate(
        {
            "jobName": name,
            "image": "busybox",
            "taskRoles": [
                {
                    "name": f"r{i}",
                    "taskNumber": k,
                    "cpuNumber": c,
                    "memoryMB": 512,
                    "gpuNumber": g,
                    "command": "x",
                }
                for i, (k, c, g) in enumerate(shape)
            ],
        }
    )
    return PendingJob(name, config)


shapes = st.lists(
    st.tuples(st.integers(1, 3), st.integers(1, 8), st.sampled_from([0, 1, 1, 2, 4, 8])),
    min_size=1,
    max_size=2,
)


@st.composite
def cases(draw: Any) -> tuple[list[NodeState], list[Loan], list[PendingJob], dict[str, int]]:
    nodes = [
        NodeState(
            f"n{i}",
            draw(st.integers(4, 32)),
            64 * 1024,
            [GpuDevice(index=k, model="V100") for k in range(draw(st.sampled_from([0, 4, 8])))],
        )
        for i in range(draw(st.integers(1, 5)))
    ]
    jobs = [make_job(f"j{i}", draw(shapes)) for i in range(draw(st.integers(2, 14)))]
    # Some of them run already (placed greedily, in a drawn order); the rest wait, in queue order.
    ranks = {job.job_id: draw(st.integers(0, 100)) for job in jobs}  # the queue order: lower first
    running: list[Loan] = []
    for job in draw(st.permutations(jobs)):
        if draw(st.booleans()):
            tasks = Cluster(nodes).place_alone(job)
            if tasks is not None:
                allocate({n.name: n for n in nodes}, job.config, tasks)
                running.append(Loan(job.job_id, job.config, tasks))
    placed = {r.job_id for r in running}
    queue = sorted((j for j in jobs if j.job_id not in placed), key=lambda j: (ranks[j.job_id], j.job_id))
    return nodes, running, queue, ranks


@settings(max_examples=300, deadline=None)
@given(cases())
def test_a_plan_stops_only_what_stood_behind_the_head_it_places_and_leaves_no_head_that_could_start(
    case: tuple[list[NodeState], list[Loan], list[PendingJob], dict[str, int]],
) -> None:
    nodes, running, queue, ranks = case

    def ahead(waiting: str, run: str) -> bool:
        return (ranks[waiting], waiting) < (ranks[run], run)

    cluster = Cluster(nodes)
    before = {n.name: (n.used_cpus, n.used_memory_mb, set(n.used_gpus)) for n in cluster.nodes.values()}

    def stoppable(waiting: str) -> list[Loan]:
        return [r for r in running if ahead(waiting, r.job_id)]

    result = cluster.plan(queue, stoppable=stoppable)
    assert {
        n.name: (n.used_cpus, n.used_memory_mb, set(n.used_gpus)) for n in cluster.nodes.values()
    } == before
    assert plan(nodes, queue, stoppable=stoppable).placements == result.placements

    configs = {j.job_id: j.config for j in queue} | {r.job_id: r.config for r in running}
    for victim, head in result.stop.items():
        assert head in result.placements and ahead(head, victim)
        assert victim in {r.job_id for r in running}

    # What it places fits beside what runs on once the stopped gangs are gone.
    after = Cluster(n.copy(empty=True) for n in nodes)
    for r in running:
        if r.job_id not in result.stop:
            after.allocate(r.config, r.tasks)
    for job_id, tasks in result.placements.items():
        after.allocate(configs[job_id], tasks)

    # The head left waiting would not fit even with every running gang behind it stopped: only
    # what runs on ahead of it and what the plan placed ahead of it held.
    if result.head is not None:
        head = next(j for j in queue if j.job_id == result.head)
        alone = Cluster(n.copy(empty=True) for n in nodes)
        for r in running:
            if not ahead(head.job_id, r.job_id) and r.job_id not in result.stop:
                alone.allocate(r.config, r.tasks)
        for job in queue:
            if job.job_id == head.job_id:
                break
            if job.job_id in result.placements:
                alone.allocate(job.config, result.placements[job.job_id])
        assert alone.place_alone(head) is None


# ------------------------------------------------------------------ against strict FIFO


def random_workload(rng: random.Random) -> Trace:
    per_node = rng.choice([4, 8])
    tasks = []
    now = 0.0
    for i in range(rng.randint(5, 60)):
        now += rng.choice([0, 0, 1, 3, 10, 30])
        gpus = rng.choice([1, 1, 1, 2, 3, 4, per_node, 2 * per_node])
        name = f"j{i:03d}"
        config = gang_config(name, 1, 1024, gpus, None, per_node)
        tasks.append(TraceTask(name, now, rng.choice([5, 20, 60, 200, 1000]), config))
    return Trace("random", tasks, uniform_nodes(rng.randint(1, 4), per_node, "V100", 64, 512 * 1024), [])


def test_against_strict_fifo_the_longest_wait_holds_on_nearly_every_random_workload() -> None:
    workloads = 150
    beyond = {"muster": 0, "muster-reserve": 0}  # workloads whose longest wait is above FIFO's
    worst = {"muster": 1.0, "muster-reserve": 1.0}
    later = {"muster": 0, "muster-reserve": 0}  # jobs that wait longer than under FIFO
    jobs = stops = 0
    for seed in range(workloads):
        trace = random_workload(random.Random(seed))
        fifo = rp.replay(trace, POLICIES["fifo"](), 1.0)
        jobs += len(fifo.waited)
        for name in beyond:
            mine = rp.replay(trace, POLICIES[name](), 1.0)
            assert mine.waited.keys() == fifo.waited.keys()  # every job that can ever fit ran
            longest, theirs = max(mine.waited.values()), max(fifo.waited.values())
            if longest > theirs:
                beyond[name] += 1
                worst[name] = max(worst[name], longest / theirs)
            later[name] += sum(1 for job, w in mine.waited.items() if w > fifo.waited[job])
            stops += mine.stops if name == "muster" else 0
    assert stops > 0  # heads did call back what overtook them
    # Lending: the bound holds on all but a few workloads, and then by a few per cent.
    assert beyond["muster"] <= workloads * 0.02 and worst["muster"] <= 1.1, (beyond, worst)
    assert later["muster"] <= jobs * 0.005, (later, jobs)
    # The reservation alone (idling claims, wandering with what is free) breaks it far more often.
    assert beyond["muster-reserve"] >= 5 * max(1, beyond["muster"]), beyond
    assert later["muster-reserve"] >= 10 * max(1, later["muster"]), later


@pytest.mark.parametrize("lose_progress", [False, True], ids=["progress kept", "progress lost"])
def test_least_attained_order_under_a_fifo_shadow_keeps_fifos_bound(
    monkeypatch: pytest.MonkeyPatch, lose_progress: bool
) -> None:
    """`muster-fifo-las` (bench.replay_policies.MusterFifoBounded): least-attained order, where a
    job that has waited as long as a FIFO shadow says FIFO would have made it wait goes first.
    With the levels scaled to these workloads' run times (so the least-attained order acts),
    plain `muster-las` breaks FIFO's bound on some workloads; the shadow keeps it as `muster`
    does, and still completes jobs sooner on average than `muster`. With progress lost at a stop
    (no checkpoints) too: then a job's whole time counts as waiting, should it be stopped, and
    only a due job calls a running one back (a stop throws its run away)."""
    monkeypatch.setattr(bp, "LEVELS", (60.0, 600.0, 6000.0))
    callers: list[bool] = []  # for each head that called gangs back in muster-fifo-las: was it due?

    class Recorded(bp.MusterFifoBounded):
        def _stoppable(self, waiting: str) -> list[Loan]:
            out = super()._stoppable(waiting)
            if out:
                callers.append(self.due(waiting))
            return out

    policies = {**POLICIES, "muster-fifo-las": Recorded}
    workloads = 150
    names = ("muster", "muster-las", "muster-fifo-las")
    beyond = dict.fromkeys(names, 0)
    worst = dict.fromkeys(names, 1.0)
    later = dict.fromkeys(names, 0)
    jct = dict.fromkeys(names, 0.0)
    stops = dict.fromkeys(names, 0)
    lost = dict.fromkeys(names, 0.0)  # GPU-seconds of runs thrown away, and their share at most
    share = dict.fromkeys(names, 0.0)
    jobs = 0
    for seed in range(workloads):
        trace = random_workload(random.Random(seed))
        fifo = rp.replay(trace, POLICIES["fifo"](), 1.0)
        jobs += len(fifo.waited)
        for name in names:
            mine = rp.replay(trace, policies[name](), 1.0, lose_progress=lose_progress)
            assert mine.waited.keys() == fifo.waited.keys()
            longest, theirs = max(mine.waited.values()), max(fifo.waited.values())
            if longest > theirs:
                beyond[name] += 1
                worst[name] = max(worst[name], longest / theirs)
            later[name] += sum(1 for job, w in mine.waited.items() if w > fifo.waited[job])
            jct[name] += sum(mine.jcts) / len(mine.jcts)
            stops[name] += mine.stops
            lost[name] += mine.lost_gpu_s
            report = mine.report()
            share[name] = max(share[name], report["lost_share"])
            kept, allocated = report["gpu_alloc_arrivals_kept"], report["gpu_alloc_arrivals"]
            assert kept == allocated if not mine.lost_gpu_s else 0 <= kept <= allocated, (kept, allocated)
    assert beyond["muster-las"] >= 5 and later["muster-las"] >= jobs * 0.1, (beyond, later)
    assert beyond["muster-fifo-las"] <= workloads * 0.02 and worst["muster-fifo-las"] <= 1.1, (beyond, worst)
    assert later["muster-fifo-las"] <= jobs * 0.005, (later, jobs)
    # the least-attained order does act (more stops than muster's callbacks alone) and pays
    assert stops["muster-fifo-las"] > stops["muster"], stops
    # What a stop throws away is counted only where progress is lost, and is part of what ran.
    if lose_progress:
        assert lost["muster-fifo-las"] > 0 and 0 < share["muster-fifo-las"] < 1, (lost, share)
        assert callers and all(callers), callers.count(False)
    else:
        assert lost == dict.fromkeys(names, 0.0), lost
        # by the least-attained order too, while not due
        assert callers.count(False) >= len(callers) // 10, (callers.count(False), len(callers))
    assert jct["muster-fifo-las"] < jct["muster"], jct
