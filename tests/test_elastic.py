"""Issue 10, elastic roles (PaddlePaddle EDL): the config's bounds, the completion rules, and the
scheduler's pure core (services/scheduler/elastic.py) that grows a running attempt into free
capacity and removes its newest tasks for a waiting job. No bus."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from muster.services.agent.environment import TaskContext, render_env
from muster.services.scheduler import elastic, placement
from muster.services.supervisor.policy import decide
from muster.shared.jobconfig import JobConfig, check_job
from muster.shared.messages import (
    AttemptRecord,
    ClusterSpec,
    Endpoint,
    GpuDevice,
    JobState,
    TaskSpec,
    TaskState,
    TaskStatus,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def raw(**role: object) -> dict:
    base = {
        "name": "worker",
        "taskNumber": 1,
        "cpuNumber": 1,
        "memoryMB": 512,
        "gpuNumber": 1,
        "command": "x",
    }
    return {"jobName": "el", "image": "img", "taskRoles": [{**base, **role}]}


def config(lo: int = 1, hi: int = 3, gpus: int = 1) -> JobConfig:
    cfg, errors = check_job(raw(taskNumber=lo, minTaskNumber=lo, maxTaskNumber=hi, gpuNumber=gpus))
    assert cfg is not None, errors
    return cfg


def test_an_elastic_role_gives_both_bounds_around_task_number():
    assert check_job(raw(minTaskNumber=1, maxTaskNumber=4))[0] is not None
    for role, path, reason in [
        ({"minTaskNumber": 1}, "taskRoles[0].maxTaskNumber", "required with minTaskNumber"),
        ({"maxTaskNumber": 3}, "taskRoles[0].minTaskNumber", "required with maxTaskNumber"),
        (
            {"minTaskNumber": 2, "maxTaskNumber": 3},
            "taskRoles[0].minTaskNumber",
            "must be ≤ taskNumber (1), got 2",
        ),
        (
            {"taskNumber": 5, "minTaskNumber": 1, "maxTaskNumber": 3},
            "taskRoles[0].maxTaskNumber",
            "must be ≥ taskNumber (5), got 3",
        ),
        (
            {"minTaskNumber": 1, "maxTaskNumber": 2, "minFailedTaskCount": 1},
            "taskRoles[0].minFailedTaskCount",
            "does not apply",
        ),
        ({"minTaskNumber": 0, "maxTaskNumber": 2}, "taskRoles[0].minTaskNumber", "must be ≥ 1"),
    ]:
        cfg, errors = check_job(raw(**role))
        assert cfg is None and any(e.path == path and reason in e.reason for e in errors), (role, errors)
    cfg = config(1, 3)
    assert cfg.most_tasks == 3 and cfg.smallest().taskRoles[0].taskNumber == 1
    assert cfg.sized({"worker": 2}).taskRoles[0].taskNumber == 2


def task(
    index: int, state: TaskState = TaskState.RUNNING, removed: bool = False, node: str = "n0"
) -> TaskStatus:
    return TaskStatus(
        role="worker", role_no=0, index=index, node=node, gpus=[index], state=state, removed=removed
    )


def test_an_elastic_role_fails_only_below_its_minimum_and_removed_tasks_do_not_count():
    cfg = config(2, 4)
    going = [task(0), task(1), task(2, TaskState.FAILED)]
    assert decide(cfg, going).outcome is None  # 2 left ≥ 2: goes on
    down = [task(0), task(1, TaskState.FAILED), task(2, TaskState.FAILED)]
    decision = decide(cfg, down)
    assert decision.outcome == JobState.FAILED and decision.rule.startswith(
        "minTaskNumber: 2 of role worker failed"
    )
    # A removed task stopped by the platform is no failure; the rest succeeding ends it well.
    done = [
        task(0, TaskState.SUCCEEDED),
        task(1, TaskState.SUCCEEDED),
        task(2, TaskState.STOPPED, removed=True),
    ]
    assert decide(cfg, done).outcome == JobState.SUCCEEDED
    # A fixed role is as before: one failure fails it.
    fixed = JobConfig.model_validate(raw(taskNumber=2))
    assert decide(fixed, [task(0), task(1, TaskState.FAILED)]).outcome == JobState.FAILED


def nodes(n: int, gpus: int) -> list[placement.NodeState]:
    return [
        placement.NodeState(
            name=f"n{i}",
            cpus=16,
            memory_mb=64000,
            gpus=[GpuDevice(index=g, model="V100") for g in range(gpus)],
        )
        for i in range(n)
    ]


def attempt(tasks: list[TaskStatus], placed: datetime = T0) -> AttemptRecord:
    return AttemptRecord(job_id="je", attempt=1, tasks=tasks, elastic=["worker"], placed_at=placed)


def test_an_attempt_changes_only_when_every_member_runs_and_after_the_dwell():
    a = attempt([task(0)])
    assert not elastic.settled(a, T0 + timedelta(seconds=5), dwell=10)
    assert elastic.settled(a, T0 + timedelta(seconds=10), dwell=10)
    starting = attempt([task(0), task(1, TaskState.PLACED)])
    assert not elastic.settled(starting, T0 + timedelta(hours=1), dwell=10)
    fixed = AttemptRecord(job_id="jf", attempt=1, tasks=[task(0)], placed_at=T0)
    assert not elastic.settled(fixed, T0 + timedelta(hours=1), dwell=10)


def test_grow_takes_what_is_free_up_to_the_maximum_with_new_indexes():
    cluster = placement.Cluster(nodes(1, 4))
    cfg = config(1, 3)
    running = attempt([task(0)])
    cluster.allocate(cfg, [t.spec() for t in running.tasks])
    added = elastic.grow(cluster, cfg, running)
    assert [(s.index, s.node) for s in added] == [(1, "n0"), (2, "n0")]  # up to 3, not 4
    assert sorted(cluster.nodes["n0"].used_gpus) == [0]  # left as it was
    assert len({g for s in added for g in s.gpus} | {0}) == 3  # no GPU given twice
    # Only what fits: 1 GPU free.
    other = JobConfig.model_validate(raw(taskNumber=2))
    cluster.allocate(
        other, [TaskSpec(role="worker", role_no=0, index=i, node="n0", gpus=[i + 1]) for i in range(2)]
    )
    assert [s.index for s in elastic.grow(cluster, cfg, running)] == [1]
    # After a failed member, the next index goes on from the highest.
    gone = attempt([task(0), task(1, TaskState.FAILED)])
    assert [s.index for s in elastic.grow(cluster, cfg, gone)] == [2]
    # A role one of whose tasks succeeded is finishing: it does not grow.
    finishing = attempt([task(0), task(1, TaskState.SUCCEEDED)])
    assert elastic.grow(cluster, cfg, finishing) == []


def test_shrink_removes_the_newest_tasks_above_the_minimum_and_only_if_that_is_enough():
    cluster = placement.Cluster(nodes(1, 4))
    cfg = config(1, 4)
    old, new = T0, T0 + timedelta(minutes=5)
    members = [task(0), task(1), task(2), task(3)]
    members[2].placed_at = members[3].placed_at = new
    members[1].placed_at = old
    running = attempt(members)
    cluster.allocate(cfg, [t.spec() for t in members])
    wants2 = placement.PendingJob("w2", JobConfig.model_validate(raw(gpuNumber=2)))
    chosen = elastic.shrink_for(cluster, wants2, [(cfg, running)])
    assert chosen is not None and sorted(s.index for _, s in chosen) == [2, 3]  # the newest two
    assert sorted(cluster.nodes["n0"].used_gpus) == [0, 1, 2, 3]  # left as it was
    wants4 = placement.PendingJob("w4", JobConfig.model_validate(raw(gpuNumber=4)))
    assert elastic.shrink_for(cluster, wants4, [(cfg, running)]) is None  # the minimum stays


def test_an_elastic_task_sees_the_gang_of_its_spec_version_and_where_to_rendezvous():
    cfg = config(1, 3, gpus=0)
    eps = [
        Endpoint(role="worker", role_no=0, index=i, node="a", host="10.0.0.1", port=7000 + i)
        for i in (0, 2, 5)
    ]
    spec = ClusterSpec(job_id="je", attempt=1, endpoints=eps, version=3)
    envs = {
        i: render_env(
            TaskContext(
                job_id="je", attempt=1, user="u", config=cfg.sized({"worker": 2}), spec=spec, role="worker",
                index=i, gpus=[], output_root="/out",
            )
        )
        for i in (0, 5)
    }  # fmt: skip
    assert envs[5]["PAI_TASK_ROLE_NUM"] == "3" and envs[5]["WORLD_SIZE"] == "3" and envs[5]["RANK"] == "2"
    assert envs[5]["PAI_TASK_ROLE_worker_HOST_LIST"] == "10.0.0.1:7000,10.0.0.1:7002,10.0.0.1:7005"
    assert envs[0]["MUSTER_RDZV_ENDPOINT"] == envs[5]["MUSTER_RDZV_ENDPOINT"] == "10.0.0.1:7000"
    assert (envs[0]["MUSTER_RDZV_IS_HOST"], envs[5]["MUSTER_RDZV_IS_HOST"]) == ("1", "0")
    assert envs[0]["MUSTER_RDZV_ID"] == "je.1"


def _worker_0(cfg: JobConfig, tmp_path: Path, gpus: list[int] | None = None) -> tuple[Any, Any, Any]:
    """Task worker.0 of elastic job je on node a (its role sized 1), its order, and the agent's
    settings a launch needs (GPU devices when it holds some)."""
    from muster.services.agent.launch import Where
    from muster.shared.messages import Assignment

    me = TaskSpec(role="worker", role_no=0, index=0, node="a", gpus=gpus or [])
    a = Assignment(job_id="je", attempt=1, user="u", config=cfg.sized({"worker": 1}), gang=[me], node="a")
    where = Where(
        node="a",
        work_root=str(tmp_path),
        output_root=str(tmp_path / "out"),
        default_fs_uri="",
        gpu_devices=bool(gpus),
    )
    return me, a, where


def test_an_elastic_tasks_env_file_is_rewritten_for_each_gang_without_the_jobs_own_values(tmp_path):
    from muster.services.agent.launch import resize_signal, task_env
    from muster.shared.messages import Assignment

    cfg, errors = check_job(
        {
            **raw(minTaskNumber=1, maxTaskNumber=3, gpuNumber=0),
            "jobEnvs": {"API_TOKEN": "s3cret value"},
            "extras": {"elastic": {"signal": "SIGUSR1"}},
        }
    )
    assert cfg is not None, errors
    me, a, where = _worker_0(cfg, tmp_path)

    def spec(version: int, n: int) -> ClusterSpec:
        eps = [
            Endpoint(role="worker", role_no=0, index=i, node="a", host="10.0.0.1", port=7000 + i)
            for i in range(n)
        ]
        return ClusterSpec(job_id="je", attempt=1, endpoints=eps, version=version)

    env = task_env(a, me, spec(1, 1), where)
    path = tmp_path / "je" / "1" / "worker-0" / "env"
    assert env["MUSTER_ENV_FILE"] == str(path) and env["API_TOKEN"] == "s3cret value"
    text = path.read_text()
    assert "export PAI_TASK_ROLE_NUM=1\n" in text and "export MUSTER_SPEC_VERSION=1\n" in text
    assert "s3cret" not in text and "API_TOKEN" not in text  # the job's own values stay out of files
    task_env(a, me, spec(2, 3), where)
    text = path.read_text()
    assert "export PAI_TASK_ROLE_NUM=3\n" in text and "export MUSTER_SPEC_VERSION=2\n" in text
    assert "export PAI_TASK_ROLE_worker_HOST_LIST=10.0.0.1:7000,10.0.0.1:7001,10.0.0.1:7002\n" in text
    assert "export TF_CONFIG='{" in text  # quoted for the shell
    assert resize_signal(cfg.extras) == 10 and resize_signal({}) is None
    # A fixed job has no env file.
    fixed = Assignment(
        job_id="jf", attempt=1, user="u", config=JobConfig.model_validate(raw()), gang=[me], node="a"
    )
    assert "MUSTER_ENV_FILE" not in task_env(fixed, me, spec(1, 1).model_copy(update={"job_id": "jf"}), where)


def test_an_elastic_tasks_role_index_is_its_place_in_the_host_lists_beside_it():
    """An elastic role's indexes have gaps (worker 1 failed and was replaced by worker 3). TF's
    task.index, OpenPAI's PAI_TASK_ROLE_INDEX and ModelArts' VC_TASK_INDEX were the raw index:
    worker 3 was told index 3 of a 3-host list (TF refuses it) and worker 2 claimed worker 3's
    address. Each is now the task's place in the list; MUSTER_TASK_INDEX keeps its own."""
    import json

    cfg = config(1, 4, gpus=0)
    eps = [
        Endpoint(role="worker", role_no=0, index=i, node=f"n{i}", host=f"10.0.0.{i}", port=2000)
        for i in (0, 2, 3)
    ]
    spec = ClusterSpec(job_id="je", attempt=1, endpoints=eps, version=2)

    def env(i: int) -> dict[str, str]:
        return render_env(
            TaskContext(
                job_id="je", attempt=1, user="u", config=cfg.sized({"worker": 3}), spec=spec, role="worker",
                index=i, gpus=[], output_root="/out",
            )
        )  # fmt: skip

    for place, i in enumerate((0, 2, 3)):
        e = env(i)
        tf = json.loads(e["TF_CONFIG"])
        assert tf["task"]["index"] == place and tf["cluster"]["worker"][place] == f"10.0.0.{i}:2000"
        assert e["PAI_TASK_ROLE_INDEX"] == e["VC_TASK_INDEX"] == str(place), e
        assert e["PAI_TASK_ROLE_worker_HOST_LIST"].split(",")[place] == f"10.0.0.{i}:2000"
        assert e["MUSTER_TASK_INDEX"] == str(i) and e["RANK"] == str(place)


def test_an_elastic_env_file_carries_the_platforms_values_of_names_the_job_sets_and_the_containers_gpus(
    tmp_path,
):
    """A job setting MASTER_PORT (as torch jobs do) had it left out of its env file, so a task
    that sourced the file after a resize kept the old gang's port beside the new MASTER_ADDR
    (the rendezvous hung). And on Docker the file said the host's GPU numbers, where the
    container sees its GPUs from 0: after sourcing it, CUDA found no GPU."""
    from muster.services.agent.launch import task_env

    cfg, errors = check_job(
        {
            **raw(minTaskNumber=1, maxTaskNumber=3, gpuNumber=1),
            "jobEnvs": {"MASTER_PORT": "29500", "LR": "0.1"},
        }
    )
    assert cfg is not None, errors
    me, a, where = _worker_0(cfg, tmp_path, gpus=[3])
    eps = [Endpoint(role="worker", role_no=0, index=0, node="a", host="10.0.0.1", port=7000)]
    env = task_env(a, me, ClusterSpec(job_id="je", attempt=1, endpoints=eps, version=1), where)
    text = (tmp_path / "je" / "1" / "worker-0" / "env").read_text()
    assert env["MASTER_PORT"] == "7000" and "export MASTER_PORT=7000\n" in text  # the platform's
    assert "LR=" not in text  # the job's own values stay out of files
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and "export CUDA_VISIBLE_DEVICES=0\n" in text
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID\n" in text
