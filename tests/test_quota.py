"""Issue 10, the sharing core (services/scheduler/quota.py): virtual clusters' quotas, the queue's
order (priority, quota, dominant resource fairness), and which gangs a waiting job may preempt.
Pure: no bus."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from muster.services.scheduler import placement, quota
from muster.services.supervisor.policy import RetryLimits, settle
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import (
    AttemptRecord,
    GpuDevice,
    JobRecord,
    JobState,
    TaskSpec,
    TaskState,
    TaskStatus,
    VirtualCluster,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def config(
    name: str, gpus: int = 1, tasks: int = 1, priority: str = "normal", vc: str = "default"
) -> JobConfig:
    return JobConfig.model_validate(
        {
            "jobName": name,
            "image": "img",
            "gpuType": "V100",
            "priority": priority,
            "virtualCluster": vc,
            "taskRoles": [
                {
                    "name": "w",
                    "taskNumber": tasks,
                    "cpuNumber": 1,
                    "memoryMB": 1000,
                    "gpuNumber": gpus,
                    "command": "x",
                }
            ],
        }
    )


def node(name: str, gpus: int = 4) -> placement.NodeState:
    return placement.NodeState(
        name=name, cpus=32, memory_mb=64000, gpus=[GpuDevice(index=i, model="V100") for i in range(gpus)]
    )


def vc(name: str, v100: int, borrow: bool = True, **kw: object) -> VirtualCluster:
    return VirtualCluster.model_validate(
        {"name": name, "quota": {"gpus": {"V100": v100}}, "borrow": borrow, **kw}
    )


def running(
    job_id: str, cfg: JobConfig, tasks: list[TaskSpec], lost: float, borrowed: bool = False, user: str = "u"
):
    use = quota.held(cfg, tasks, lambda n, i: "V100")
    return quota.Running(
        job_id, f"{job_id}.1", cfg.virtualCluster, user, ["low", "normal", "high"].index(cfg.priority),
        cfg, tasks, use, borrowed, lost,
    )  # fmt: skip


def waiting(job_id: str, cfg: JobConfig, user: str = "u", at: int = 0) -> quota.Waiting:
    return quota.Waiting(
        job_id,
        cfg.virtualCluster,
        user,
        ["low", "normal", "high"].index(cfg.priority),
        cfg,
        T0 + timedelta(seconds=at),
    )


def test_default_gets_what_the_configured_vcs_leave():
    cap = quota.capacity_of([node("a", 8), node("b", 8)])
    lims = quota.limits({"research": vc("research", 6), "prod": vc("prod", 4)}, cap)
    assert lims["research"].gpus["v100"] == 6 and lims["prod"].gpus["v100"] == 4
    assert lims["default"].gpus["v100"] == 6 and lims["default"].gpus[quota.ANY_MODEL] == 6
    assert lims["default"].cpus == 64  # the others do not limit CPUs: all of them are left
    # With none configured, default is the whole cluster.
    assert quota.limits({}, cap)["default"].gpus["v100"] == 16


def test_within_quota_counts_what_the_vc_holds():
    cap = quota.capacity_of([node("a", 8)])
    lims = quota.limits({"r": vc("r", 2)}, cap)
    one = config("one", vc="r")
    ledger = quota.Ledger(
        lims, [running("j1", one, [TaskSpec(role="w", role_no=0, index=0, node="a", gpus=[0])], 1)]
    )
    assert ledger.within("r", quota.need(one))  # 1 held + 1 ≤ 2
    ledger.take("r", "u", quota.need(one))
    assert not ledger.within("r", quota.need(one))  # 2 held + 1 > 2
    # A VC that may not borrow holds such a job back, and says why.
    hard = quota.Ledger(quota.limits({"r": vc("r", 2, borrow=False)}, cap), [])
    hard.take("r", "u", quota.need(config("two", gpus=2, vc="r")))
    why = hard.why_not(waiting("j3", config("three", vc="r")))
    assert why is not None and "virtual cluster r's quota (2 v100" in why
    assert ledger.why_not(waiting("j3", config("three", vc="r"))) is None  # it may borrow


def test_order_is_priority_then_within_quota_then_fair_share_then_submission():
    cap = quota.capacity_of([node("a", 8)])
    lims = quota.limits({"r": vc("r", 4), "s": vc("s", 4)}, cap)
    heavy = config("heavy", gpus=3, vc="r")
    ledger = quota.Ledger(
        lims,
        [
            running(
                "held",
                heavy,
                [TaskSpec(role="w", role_no=0, index=0, node="a", gpus=[0, 1, 2])],
                1,
                user="alice",
            )
        ],
    )
    jobs = [
        waiting("alice-old", config("a1", vc="r"), "alice", at=0),
        waiting("bob-new", config("b1", vc="r"), "bob", at=5),
        waiting("borrower", config("big", gpus=4, vc="r"), "carol", at=-10),  # beyond r's quota
        waiting("urgent", config("u", priority="high", vc="s"), "dave", at=50),
        waiting("lowly", config("l", priority="low", vc="s"), "erin", at=-50),
    ]
    order = [w.job_id for w in ledger.order(jobs)]
    # high first; within quota before the borrower; bob (holding nothing) before alice (3 of 4)
    # though alice submitted first; low last.
    assert order == ["urgent", "bob-new", "alice-old", "borrower", "lowly"]


def spec(node_name: str, gpus: list[int], index: int = 0) -> TaskSpec:
    return TaskSpec(role="w", role_no=0, index=index, node=node_name, gpus=gpus)


def test_choose_victims_frees_enough_at_least_lost_work_and_leaves_the_cluster_as_it_was():
    cluster = placement.Cluster([node("a", 4), node("b", 4)])
    low = [config(f"low{i}", gpus=2, priority="low") for i in range(4)]
    gangs = [
        running("old-a", low[0], [spec("a", [0, 1])], lost=9000),
        running("new-a", low[1], [spec("a", [2, 3])], lost=10),
        running("old-b", low[2], [spec("b", [0, 1])], lost=5000),
        running("new-b", low[3], [spec("b", [2, 3])], lost=20),
    ]
    for g in gangs:
        cluster.allocate(g.config, g.tasks)
    before = {n: sorted(s.used_gpus) for n, s in cluster.nodes.items()}
    hi = waiting("hi", config("hi", gpus=4, priority="high"))
    ledger = quota.Ledger(quota.limits({}, quota.capacity_of(cluster.nodes.values())), gangs)
    options = quota.candidates(hi, ledger, gangs)
    assert [o.job_id for o in options] == ["new-a", "new-b", "old-b", "old-a"]  # cheapest first
    victims = quota.choose_victims(cluster, hi, options)
    # 4 GPUs on one node: both gangs of one node. b's two cost 5020 GPU-s, a's 9010: b's.
    assert victims is not None and sorted(v.job_id for v in victims) == ["new-b", "old-b"]
    assert {n: sorted(s.used_gpus) for n, s in cluster.nodes.items()} == before
    # A job no victims can make room for gets none.
    huge = waiting("huge", config("huge", gpus=8, priority="high"))
    assert quota.choose_victims(cluster, huge, options) is None


def test_who_may_be_preempted():
    cap = quota.capacity_of([node("a", 8)])
    lims = quota.limits({"r": vc("r", 4), "s": vc("s", 1)}, cap)  # s holds 2: beyond its quota
    t = [spec("a", [i]) for i in range(8)]
    gangs = [
        running("r-low", config("rl", priority="low", vc="r"), [t[0]], 1),
        running("r-normal", config("rn", vc="r"), [t[1]], 1),
        running("r-high", config("rh", priority="high", vc="r"), [t[2]], 1),
        running("s-borrowed-high", config("sb", priority="high", vc="s"), [t[3]], 1, borrowed=True),
        running("s-own-low", config("so", priority="low", vc="s"), [t[4]], 1),
    ]
    ledger = quota.Ledger(lims, gangs)
    mine = waiting("r-new", config("new", vc="r"))
    # Its own VC's lower priority, and another VC's borrowed work (any priority): never an equal
    # or higher one of its own VC, never what another VC runs within its quota.
    assert sorted(r.job_id for r in quota.candidates(mine, ledger, gangs)) == ["r-low", "s-borrowed-high"]
    # A gang placed on borrowed GPUs whose VC is within its quota now (its other work ended,
    # or the quota grew) runs on what its quota guarantees: no one's to reclaim.
    within = quota.Ledger(quota.limits({"r": vc("r", 4), "s": vc("s", 4)}, cap), gangs)
    assert [r.job_id for r in quota.candidates(mine, within, gangs)] == ["r-low"]
    # Beyond its own quota it reclaims nothing from others.
    ledger.take("r", "u", quota.need(config("x", gpus=4, vc="r")))
    assert [r.job_id for r in quota.candidates(mine, ledger, gangs)] == ["r-low"]
    # A gang already being stopped is no one's victim again.
    gangs[0].stopping = True
    assert quota.candidates(mine, ledger, gangs) == []


def test_a_preempted_attempt_is_settled_back_to_waiting_uncharged():
    cfg = config("v", priority="low")
    job = JobRecord(
        job_id="jv", job_name="v", state=JobState.RUNNING, submission_id="s", user="u", config=cfg,
        submitted_at=T0, attempt=1, retries=0,
    )  # fmt: skip
    attempt = AttemptRecord(
        job_id="jv", attempt=1, ended_at=T0, outcome=JobState.STOPPED,
        rule="preempted by jh (high priority, u)", preempted_by="jh",
        tasks=[TaskStatus(role="w", role_no=0, index=0, node="a", state=TaskState.STOPPED)],
    )  # fmt: skip
    settled = settle(job, attempt, RetryLimits(), T0)
    assert settled is not None
    record, step = settled
    assert record.state == JobState.WAITING and record.retries == 0 and record.platform_retries == 0
    assert record.settled == 1 and not step.charged and "preempted by jh" in record.reason
    assert record.submitted_at == T0  # its old place in the queue


@pytest.mark.parametrize(
    "gpus, shown",
    [
        ({}, "0 GPUs, 2 CPUs, 100 MB"),
        ({quota.ANY_MODEL: 2}, "2 GPUs of any model, 2 CPUs, 100 MB"),  # a job with no gpuType
        ({quota.ANY_MODEL: 3, "v100": 3}, "3 v100, 2 CPUs, 100 MB"),
        ({quota.ANY_MODEL: 5, "v100": 3}, "3 v100, 2 GPUs of any model, 2 CPUs, 100 MB"),
    ],
)
def test_an_amount_shows_gpus_of_no_model_too(gpus, shown):
    """A waiting reason ("it needs ...") or a VC's use never says 0 GPUs of GPUs asked for
    without a gpuType."""
    assert quota.Amount(dict(gpus), 2, 100).shown() == shown
