"""Issue 23 point 6: the sharing order costs what the planner takes of it, not a sort of the whole
backlog per cycle (services/scheduler/quota.py `Order`). Pure: no bus.

- Differential: on random clusters, quotas, running gangs and backlogs, the windowed order is the
  full sort (`Ledger.order`) less the jobs a quota holds back, holds back the same jobs with the
  same reasons, and the planner given it decides exactly what it decides given the full sort
  (placements, reasons, head, claims; around avoided nodes too).
- Cost: with 20,000 jobs waiting, one cycle works out the place of about as many jobs as the
  planner tries (its backfill window), counted, not timed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from muster.services.scheduler import placement, quota
from muster.services.scheduler.avoid import plan_around
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import GpuDevice, TaskSpec, VirtualCluster

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PRIORITIES = ["low", "normal", "high"]
VCS = ["default", "r", "s"]
USERS = ["alice", "bob", "carol"]


def config(gpus: int, cpus: int, memory_gb: int, tasks: int, priority: str, vc: str) -> JobConfig:
    return JobConfig.model_validate(
        {
            "jobName": "j",
            "image": "img",
            "gpuType": "V100",
            "priority": priority,
            "virtualCluster": vc,
            "taskRoles": [
                {
                    "name": "w",
                    "taskNumber": tasks,
                    "cpuNumber": cpus,
                    "memoryMB": memory_gb * 1024,
                    "gpuNumber": gpus,
                    "command": "x",
                }
            ],
        }
    )


def node(name: str, gpus: int = 4, cpus: int = 32) -> placement.NodeState:
    return placement.NodeState(
        name=name,
        cpus=cpus,
        memory_mb=128 * 1024,
        gpus=[GpuDevice(index=i, model="V100") for i in range(gpus)],
    )


def vc(name: str, v100: int, borrow: bool, cpus: int | None = None) -> VirtualCluster:
    return VirtualCluster.model_validate(
        {"name": name, "quota": {"gpus": {"V100": v100}, "cpus": cpus}, "borrow": borrow}
    )


def outcome(plan: placement.Plan) -> tuple[Any, ...]:
    return (
        {j: [(t.key, t.node, t.gpus) for t in ts] for j, ts in plan.placements.items()},
        plan.pending,
        plan.unschedulable,
        plan.head,
        {n: (c.cpus, c.memory_mb, sorted(c.gpus.items())) for n, c in plan.reserved.items()},
    )


@st.composite
def scene(draw: Any) -> dict[str, Any]:
    n_nodes = draw(st.integers(1, 6))
    nodes = [
        node(f"n{i}", draw(st.sampled_from([0, 2, 4, 8])), draw(st.sampled_from([8, 16, 32])))
        for i in range(n_nodes)
    ]
    vcs = {
        name: vc(name, draw(st.integers(0, 8)), draw(st.booleans()), draw(st.sampled_from([None, 8, 24])))
        for name in draw(st.lists(st.sampled_from(VCS[1:]), unique=True))
    }
    shapes = [
        config(
            draw(st.integers(0, 3)),
            draw(st.integers(1, 12)),
            draw(st.integers(1, 8)),
            draw(st.integers(1, 3)),
            draw(st.sampled_from(PRIORITIES)),
            draw(st.sampled_from(VCS)),
        )
        for _ in range(draw(st.integers(1, 8)))
    ]
    # What runs: gangs that hold GPUs and CPUs, by VC and user (the users' shares differ).
    running = []
    for k in range(draw(st.integers(0, 6))):
        cfg = draw(st.sampled_from(shapes))
        where = draw(st.sampled_from(nodes))
        gpus = list(range(min(len(where.gpus), cfg.taskRoles[0].gpuNumber)))
        tasks = [TaskSpec(role="w", role_no=0, index=0, node=where.name, gpus=gpus)]
        use = quota.held(cfg, tasks, lambda n, i: "V100")
        running.append(
            quota.Running(
                f"run{k}",
                f"run{k}.1",
                cfg.virtualCluster,
                draw(st.sampled_from(USERS)),
                PRIORITIES.index(cfg.priority),
                cfg,
                tasks,
                use,
                False,
                1.0,
            )
        )
    # The backlog, mostly in submission order (the view's), with ties and a few out of order.
    waiting = []
    at = 0
    for k in range(draw(st.integers(0, 40))):
        at += draw(st.sampled_from([0, 1, 1, 5, -3]))
        cfg = draw(st.sampled_from(shapes))
        waiting.append(
            quota.Waiting(
                f"w{k:03d}",
                cfg.virtualCluster,
                draw(st.sampled_from(USERS)),
                PRIORITIES.index(cfg.priority),
                cfg,
                T0 + timedelta(seconds=at),
            )
        )
    return {
        "nodes": nodes,
        "vcs": vcs,
        "running": running,
        "waiting": waiting,
        "window": draw(st.sampled_from([0, 1, 2, 5, None])),
        "avoid": set(draw(st.lists(st.sampled_from([n.name for n in nodes]), unique=True, max_size=2))),
    }


def order_of(ledger: quota.Ledger, waiting: list[quota.Waiting]) -> quota.Order[placement.PendingJob]:
    return quota.Order(
        ledger,
        (
            (
                quota.Fixed.of(w.job_id, w.config, w.user, w.submitted_at),
                placement.PendingJob(w.job_id, w.config),
            )
            for w in waiting
        ),
    )


@settings(max_examples=300, deadline=None)
@given(scene())
def test_the_windowed_order_places_what_the_full_sort_places(s: dict[str, Any]) -> None:
    cluster = placement.Cluster(s["nodes"])
    capacity = placement.Capacity(s["nodes"])
    lims = quota.limits(s["vcs"], quota.capacity_of(s["nodes"]))

    # The reference: the whole backlog sorted, the jobs a quota holds back taken out.
    ledger = quota.Ledger(lims, s["running"])
    held = {w.job_id: why for w in s["waiting"] if (why := ledger.why_not(w)) is not None}
    full = [
        placement.PendingJob(w.job_id, w.config) for w in ledger.order(s["waiting"]) if w.job_id not in held
    ]
    want = plan_around(cluster, capacity, full, s["avoid"], s["window"])

    order = order_of(quota.Ledger(lims, s["running"]), s["waiting"])
    got = plan_around(cluster, capacity, order, s["avoid"], s["window"])
    assert outcome(got) == outcome(want)
    assert order.held() == held
    # Taken on after the plan (what preemption and shrinking read), it is the full sort itself.
    assert [p.job_id for p in order.ordered()] == [p.job_id for p in full]
    assert order.in_order(reversed([p.job_id for p in full])) == [p.job_id for p in full]


def test_held_back_jobs_are_never_planned_and_are_told_why() -> None:
    nodes = [node("a", 8)]
    lims = quota.limits({"prod": vc("prod", 2, borrow=False)}, quota.capacity_of(nodes))
    small = config(1, 1, 1, 1, "normal", "prod")
    big = config(4, 1, 1, 1, "normal", "prod")
    waiting = [
        quota.Waiting(f"j{k}", "prod", "u", 1, cfg, T0 + timedelta(seconds=k))
        for k, cfg in enumerate([big, small, big, small])
    ]
    order = order_of(quota.Ledger(lims, []), waiting)
    plan = placement.Cluster(nodes).plan(order, window=500)
    assert set(plan.placements) == {"j1", "j3"}  # both within the quota of 2 (the ledger read once)
    held = order.held()
    assert set(held) == {"j0", "j2"} and all("virtual cluster prod's quota" in why for why in held.values())
    assert not set(held) & (set(plan.pending) | set(plan.placements))


def test_a_cycle_works_out_the_place_of_about_the_jobs_the_planner_tries_not_the_whole_backlog() -> None:
    """20,000 jobs wait in three VCs (one at its quota, so all of its jobs borrow), of many
    shapes; the cluster is full. The planner tries the head and the 500 jobs of its window
    behind it; the order works out the place of about that many, where one sort works out
    20,000 keys. The plan is the one the full sort gives."""
    nodes = [node(f"n{i:02d}", 8, 64) for i in range(16)]
    cluster = placement.Cluster(nodes)
    capacity = placement.Capacity(nodes)
    lims = quota.limits({"r": vc("r", 32, True), "s": vc("s", 32, True)}, quota.capacity_of(nodes))
    # The cluster is full: r holds its whole quota (its jobs borrow), s and default hold some.
    running = []
    for i, n in enumerate(nodes):
        owner = ["r", "r", "r", "r", "s", "default", "s", "default"][i % 8]
        cfg = config(8, 64, 64, 1, "normal", owner)
        tasks = [TaskSpec(role="w", role_no=0, index=0, node=n.name, gpus=list(range(8)))]
        cluster.allocate(cfg, tasks)
        running.append(
            quota.Running(
                f"run{i}",
                f"run{i}.1",
                owner,
                USERS[i % 3],
                1,
                cfg,
                tasks,
                quota.held(cfg, tasks, lambda n, i: "V100"),
                False,
                1.0,
            )
        )
    # Thousands of shapes: the planner reuses a reason for a shape it has tried (such jobs it
    # reads in order too, but they do not count in its window), so few shapes would let it read
    # the whole backlog in order however long.
    shapes = [
        config(g, c, m, 1, p, v)
        for g in (1, 2, 4)
        for c in (2, 4, 6, 8, 10)
        for m in range(1, 41)
        for p in ("normal", "high", "low")
        for v in VCS
    ]
    waiting = [
        quota.Waiting(
            f"w{k:05d}",
            cfg.virtualCluster,
            USERS[k % 3],
            PRIORITIES.index(cfg.priority),
            cfg,
            T0 + timedelta(seconds=k),
        )
        for k in range(20_000)
        for cfg in [shapes[(k * 7919) % len(shapes)]]
    ]
    ledger = quota.Ledger(lims, running)
    full = [placement.PendingJob(w.job_id, w.config) for w in ledger.order(waiting)]
    want = plan_around(cluster, capacity, full, set(), 500)

    order = order_of(quota.Ledger(lims, running), waiting)
    got = plan_around(cluster, capacity, order, set(), 500)
    assert outcome(got) == outcome(want)
    assert order.given == 20_000  # one pass drops each job into its group
    # In order: the head, the 500 jobs of its window and those that shared a shape with a job
    # tried before them; the others came through rest(), unordered.
    assert 501 <= len(order.taken) < 1_000, len(order.taken)
    assert order.keyed < 1_500, order.keyed
    assert order.sorted_groups == 0
    assert len(order.groups) <= len(PRIORITIES) * len(VCS) * len(USERS)
