"""Fractional GPUs in the placement core (services/scheduler/placement.py) and in the VC
arithmetic (shared/vcquota.py): a task asking for part of one GPU (gpuNumber 0.01 ... 0.99) shares
a GPU with other such tasks, a GPU is held whole or shared but never both, shares pack where they
fit best, and quotas count a share as its fraction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.replay_saturation import saturate
from bench.replay_trace import load
from muster.services.scheduler.placement import Cluster, NodeState, PendingJob, allocate, plan, release
from muster.shared import vcquota
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import GpuDevice, Quota, TaskSpec, VirtualCluster

SAMPLE = Path(__file__).parent / "data" / "alibaba-gpu-2023-sample"


def job(
    name: str, gpus: float, tasks: int = 1, cpus: int = 2, vc: str = "default", **extra: Any
) -> PendingJob:
    config = JobConfig.model_validate(
        {
            "jobName": name,
            "image": "busybox",
            "virtualCluster": vc,
            "taskRoles": [
                {
                    "name": "w",
                    "taskNumber": tasks,
                    "cpuNumber": cpus,
                    "memoryMB": 1024,
                    "gpuNumber": gpus,
                    "command": "run",
                }
            ],
            **extra,
        }
    )
    return PendingJob(name, config)


def node(name: str, gpus: int = 2, cpus: int = 32, model: str = "V100") -> NodeState:
    return NodeState(
        name, cpus, 64 * 1024, [GpuDevice(index=i, model=model, memory_mb=16384) for i in range(gpus)]
    )


def where(result: Any, job_id: str) -> list[tuple[str, list[int], int | None]]:
    return [(t.node, t.gpus, t.gpu_milli) for t in result.placements[job_id]]


def test_two_halves_share_one_gpu_and_a_whole_task_takes_the_other() -> None:
    result = plan([node("a")], [job("h1", 0.5), job("h2", 0.5), job("w", 1)])
    assert where(result, "h1") == [("a", [0], 500)]
    assert where(result, "h2") == [("a", [0], 500)]
    assert where(result, "w") == [("a", [1], None)]


def test_a_shared_gpu_is_never_held_whole_and_a_whole_one_never_shared() -> None:
    n = node("a", gpus=1)
    n.use(1, 100, [0], milli=300)
    with pytest.raises(ValueError, match="shared: it cannot be held whole"):
        n.use(1, 100, [0])
    m = node("b", gpus=1)
    m.use(1, 100, [0])
    with pytest.raises(ValueError, match="already in use"):
        m.use(1, 100, [0], milli=300)
    with pytest.raises(ValueError, match="has 700/1000 left, not 800"):
        n.use(1, 100, [0], milli=800)
    # the queue agrees: with GPU 0 shared, a 1-GPU job waits rather than take it
    result = plan([n], [job("whole", 1)])
    assert "whole" in result.pending and "no GPU is free now" in result.pending["whole"]


def test_shares_that_do_not_add_up_to_one_gpu_take_separate_gpus() -> None:
    result = plan([node("a")], [job("big", 0.6), job("half", 0.5)])
    assert where(result, "big") == [("a", [0], 600)]
    assert where(result, "half") == [("a", [1], 500)]


def test_a_share_fills_the_shared_gpu_it_fits_best() -> None:
    n = node("a", gpus=3)
    n.use(1, 100, [0], milli=500)  # 0.5 left
    n.use(1, 100, [1], milli=700)  # 0.3 left
    result = plan([n], [job("s", 0.3), job("t", 0.4)])
    assert where(result, "s") == [("a", [1], 300)]  # the tightest fit, GPU 1 is full after it
    assert where(result, "t") == [("a", [0], 400)]  # not the untouched GPU 2


def test_a_new_share_goes_to_a_node_that_already_shares_and_whole_nodes_stay_whole() -> None:
    sharing = node("sharing", gpus=4)
    sharing.use(1, 100, [0], milli=900)  # no room for 0.5
    fresh = node("fresh", gpus=1)  # best fit for a 1-GPU task: it would be left with none
    result = plan([sharing, fresh], [job("s", 0.5)])
    assert where(result, "s") == [("sharing", [1], 500)]
    # a whole 1-GPU task still goes where it fits best
    result = plan([sharing, fresh], [job("w", 1)])
    assert where(result, "w") == [("fresh", [0], None)]


def test_a_cpu_only_task_keeps_off_the_cpus_beside_shared_gpus_with_room() -> None:
    room = node("room", gpus=1)
    room.use(1, 100, [0], milli=500)  # half a GPU free: a share still needs CPUs beside it
    full = node("full", gpus=1)
    full.use(1, 100, [0])
    result = plan([room, full], [job("cpu", 0, cpus=4)])
    assert where(result, "cpu") == [("full", [], None)]


def test_a_gang_of_shares_and_its_release() -> None:
    n = node("a", gpus=2)
    result = plan([n], [job("g", 0.25, tasks=6)])
    tasks = result.placements["g"]
    assert sorted(t.gpus[0] for t in tasks) == [0, 0, 0, 0, 1, 1]
    allocate({"a": n}, job("g", 0.25, tasks=6).config, tasks)
    assert n.shared == {0: 1000, 1: 500} and n.free_gpu_count == 0
    release({"a": n}, job("g", 0.25, tasks=6).config, tasks)
    assert n.shared == {} and n.free_gpu_count == 2  # the last share gone: untouched again


def test_a_spec_that_does_not_match_its_role_is_refused() -> None:
    n = node("a")
    config = job("g", 0.5).config
    for bad in (
        TaskSpec(role="w", role_no=0, index=0, node="a", gpus=[0]),  # a share given as whole
        TaskSpec(role="w", role_no=0, index=0, node="a", gpus=[0], gpu_milli=250),  # the wrong share
        TaskSpec(role="w", role_no=0, index=0, node="a", gpus=[0, 1], gpu_milli=500),
    ):
        with pytest.raises(ValueError):
            allocate({"a": n}, config, [bad])
        assert n.used_gpus == set() and n.shared == {}


def test_the_reason_a_share_waits_says_what_it_asks() -> None:
    n = node("a", gpus=1)
    n.use(1, 100, [0], milli=800)
    result = plan([n], [job("s", 0.5)])
    assert "0.5 of a GPU" in result.pending["s"] and "no GPU has 0.5 free now" in result.pending["s"]


def test_place_alone_and_the_index_agree_after_shares_come_and_go() -> None:
    cluster = Cluster([node("a", gpus=2), node("b", gpus=2)])
    first = job("x", 0.5)
    specs = cluster.place_alone(first)
    assert specs is not None
    cluster.allocate(first.config, specs)
    second = job("y", 0.5)
    again = cluster.place_alone(second)
    assert again is not None and (again[0].node, again[0].gpus) == (specs[0].node, specs[0].gpus)
    cluster.release(first.config, specs)
    assert all(not n.shared for n in cluster.nodes.values())
    assert cluster.place_alone(job("w", 2)) is not None  # both GPUs of a node untouched again


def test_quotas_count_a_share_as_its_fraction_exactly() -> None:
    need = vcquota.need(job("g", 0.1, tasks=3).config)
    assert need.gpus[vcquota.ANY_MODEL] == pytest.approx(0.3) and need.cpus == 6
    used = vcquota.Amount()
    for _ in range(10):
        used.add(vcquota.task_need(job("g", 0.1).config, 0))
    assert used.gpus[vcquota.ANY_MODEL] == 1  # ten tenths are one GPU, not 0.9999999999999999
    for _ in range(10):
        used.add(vcquota.task_need(job("g", 0.1).config, 0), -1)
    assert used.gpus[vcquota.ANY_MODEL] == 0
    limit = vcquota.limits(
        {"team": VirtualCluster(name="team", quota=Quota(gpus={"V100": 1}))}, vcquota.Amount()
    )["team"]
    nine = vcquota.Amount({vcquota.ANY_MODEL: 0.9, "v100": 0.9})
    tenth = vcquota.need(job("t", 0.1, gpuType="V100").config)
    assert limit.fits(nine, tenth)  # 0.9 + 0.1 is the quota's one GPU
    assert not limit.fits(nine, vcquota.need(job("t", 0.2, gpuType="V100").config))
    held = vcquota.held(
        job("g", 0.25, tasks=2).config,
        [TaskSpec(role="w", role_no=0, index=i, node="a", gpus=[0], gpu_milli=250) for i in range(2)],
        lambda node, index: "V100",
    )
    assert held.gpus == {"v100": 0.5, vcquota.ANY_MODEL: 0.5}
    assert "0.5 GPUs of any model" in vcquota.need(job("g", 0.25, tasks=2).config).shown()


def test_sharing_beats_rounding_up_on_the_trace_sample() -> None:
    """The saturation replay (bench/replay_saturation.py) on the repository's sample of the Alibaba
    trace: Muster's core with shares kept puts far more of the GPUs to use than rounding each share
    up to a whole GPU, and about as much as the FGD-like rule (within a point; the full trace's
    figures are in docs/BENCHMARKS.md). Deterministic: no timing is measured."""
    trace = load(SAMPLE, None, None, 0, None)
    runs = {rule: saturate(trace, rule) for rule in ("muster-whole", "muster", "fgd")}
    assert runs["muster"].useful_share > runs["muster-whole"].useful_share + 0.10
    assert runs["muster"].useful_share >= runs["fgd"].useful_share - 0.01
