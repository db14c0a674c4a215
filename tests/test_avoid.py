"""Nodes that keep failing attempts are avoided by the next placement, but never at the price of
a job waiting forever."""

from __future__ import annotations

from datetime import timedelta

from muster.services.scheduler.avoid import nodes_to_avoid, plan_around
from muster.services.scheduler.placement import Capacity, Cluster, NodeState, PendingJob
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import AttemptRecord, Failure, FailureKind, GpuDevice, JobState, TaskStatus, now

AT = now()


def failed(
    node: str, seconds_ago: float, kind: FailureKind = FailureKind.PLATFORM, n: int = 1
) -> AttemptRecord:
    task = TaskStatus(role="w", role_no=0, index=0, node=node)
    return AttemptRecord(
        job_id=f"j{node}{seconds_ago}{n}",
        attempt=n,
        tasks=[task],
        ended_at=AT - timedelta(seconds=seconds_ago),
        outcome=JobState.FAILED,
        failure=Failure(kind=kind, task="w.0", node=node),
    )


def test_three_platform_failures_at_different_moments_make_a_node_avoided():
    history = [failed("bad", 5), failed("bad", 65), failed("bad", 125), failed("ok", 5), failed("ok", 65)]
    assert nodes_to_avoid(history, AT) == {"bad"}


def test_one_restart_losing_many_tasks_counts_once_and_user_failures_not_at_all():
    burst = [failed("n", 1, n=i) for i in range(1, 6)]  # five attempts lost in the same moment
    user = [failed("n", s, FailureKind.USER) for s in (30, 60, 90)]
    assert nodes_to_avoid(burst + user, AT) == set()


def test_old_failures_are_forgiven():
    assert nodes_to_avoid([failed("n", s) for s in (700, 800, 900)], AT) == set()


def job(job_id: str) -> PendingJob:
    return PendingJob(
        job_id,
        JobConfig.model_validate(
            {
                "jobName": job_id,
                "image": "img",
                "taskRoles": [
                    {
                        "name": "w",
                        "taskNumber": 1,
                        "cpuNumber": 2,
                        "memoryMB": 100,
                        "gpuNumber": 1,
                        "command": "x",
                    }
                ],
            }
        ),
    )


def node(name: str) -> NodeState:
    return NodeState(name=name, cpus=2, memory_mb=1000, gpus=[GpuDevice(index=0, model="T4")])


def test_placement_goes_around_an_avoided_node_while_others_have_room():
    plan = plan_around(*cluster(node("bad"), node("ok")), [job("a")], {"bad"})
    assert [t.node for t in plan.placements["a"]] == ["ok"]


def test_a_job_waits_for_a_healthy_node_rather_than_take_an_avoided_one():
    plan = plan_around(*cluster(node("bad"), node("ok")), [job("a"), job("b")], {"bad"})
    assert {jid: [t.node for t in ts] for jid, ts in plan.placements.items()} == {"a": ["ok"]}
    assert "b" in plan.pending


def test_a_job_that_can_only_ever_run_on_avoided_nodes_still_runs_there():
    plan = plan_around(*cluster(node("bad"), node("worse")), [job("c")], {"bad", "worse"})
    assert [t.node for t in plan.placements["c"]] in (["bad"], ["worse"])
    assert plan.pending == {}


def cluster(*nodes: NodeState) -> tuple[Cluster, Capacity]:
    return Cluster(nodes), Capacity(nodes)
