"""The scheduler's incremental view (services/scheduler/view.py), a pure core: records go in one
change at a time and the placement index, the queue and the wake decisions follow; checked
against a `placement.Cluster` built from scratch out of the same records."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muster.services.scheduler import placement
from muster.services.scheduler.view import Job, View
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import (
    AttemptRecord,
    Failure,
    FailureKind,
    GpuDevice,
    JobRecord,
    JobState,
    NodeInfo,
    TaskState,
    TaskStatus,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def node(name: str, gpus: int = 4, at: datetime = T0, **kw: object) -> NodeInfo:
    devices = [GpuDevice(index=i, model="V100") for i in range(gpus)]
    return NodeInfo(
        node=name, address="10.0.0.1", cpus=16, memory_mb=65536, gpus=devices, runtime="sim", agent_id="a",
        heartbeat_at=at, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def job(job_id: str, tasks: int = 1, gpus: int = 1, at: datetime = T0, **kw: object) -> JobRecord:
    role = {"name": "w", "taskNumber": tasks, "cpuNumber": 2, "memoryMB": 1024, "gpuNumber": gpus}
    config = JobConfig.model_validate(
        {"jobName": job_id, "image": "x", "taskRoles": [role | {"command": "x"}]}
    )
    return JobRecord(
        job_id=job_id, job_name=job_id, submission_id=job_id, user="u", config=config, submitted_at=at,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def attempt(job_id: str, n: int, *tasks: tuple[str, list[int], TaskState], **kw: object) -> AttemptRecord:
    return AttemptRecord(
        job_id=job_id,
        attempt=n,
        tasks=[
            TaskStatus(role="w", role_no=0, index=i, node=where, gpus=gpus, state=state)
            for i, (where, gpus, state) in enumerate(tasks)
        ],
        **kw,  # type: ignore[arg-type]
    )


def put_node(v: View, info: NodeInfo, at: datetime = T0) -> bool:
    v.nodes[info.node] = info
    return v.node_changed(info.node, at)


def put_job(v: View, record: JobRecord) -> bool:
    v.jobs[record.job_id] = Job.of(record)  # what the watcher keeps of a record
    return v.job_changed(record.job_id)


def put_attempt(v: View, record: AttemptRecord) -> bool:
    v.attempts[record.key] = record
    return v.attempt_changed(record.key)


def used(v: View) -> dict[str, tuple[int, set[int]]]:
    return {n.name: (n.used_cpus, set(n.used_gpus)) for n in v.cluster.nodes.values()}


R = TaskState.RUNNING


def test_a_heartbeat_that_changes_nothing_wakes_nothing():
    v = View(node_timeout=5)
    assert put_node(v, node("a"))
    assert not put_node(v, node("a", at=T0 + timedelta(seconds=2)), T0 + timedelta(seconds=2))
    assert put_node(v, node("a", gpus=8, at=T0 + timedelta(seconds=3)), T0 + timedelta(seconds=3))
    assert len(v.cluster.nodes["a"].gpus) == 8 and len(v.capacity.cluster.nodes["a"].gpus) == 8
    assert put_node(v, node("a", drained=True), T0)
    assert "a" not in v.cluster.nodes and "a" not in v.capacity.cluster.nodes


def test_a_node_whose_heartbeat_stops_leaves_and_comes_back_with_its_tasks():
    v = View(node_timeout=5)
    put_node(v, node("a"))
    put_job(v, job("j"))
    put_attempt(v, attempt("j", 1, ("a", [2], R)))
    assert not v.expire(T0 + timedelta(seconds=4))
    assert v.expire(T0 + timedelta(seconds=6))
    assert "a" not in v.cluster.nodes
    later = T0 + timedelta(seconds=7)
    assert put_node(v, node("a", at=later), later)
    assert used(v) == {"a": (2, {2})}


def test_only_the_nodes_that_stopped_beating_leave_however_many_beats_came_before():
    v = View(node_timeout=5)
    for name in ("a", "b", "c"):
        put_node(v, node(name))
    for s in range(1, 20):  # a and b beat every second; c stopped at T0
        at = T0 + timedelta(seconds=s)
        put_node(v, node("a", at=at), at)
        if s < 10:
            put_node(v, node("b", at=at), at)
        expired = v.expire(at)
        assert expired == (s in (6, 15)), s  # c's last beat is 5 s old at 6, b's (9 s) at 15
        assert "a" in v.cluster.nodes
    assert set(v.cluster.nodes) == {"a"}
    assert len(v.beats._heap) <= 3  # one entry per node at most, not every beat seen


def test_beats_heard_on_the_bus_keep_a_node_without_writes_of_its_record():
    """Issue 23.3: a node's record is written only when it changes; its beats (core NATS) keep it
    schedulable, cost a dict write each and wake nothing; a beat after it went quiet brings it
    back and wakes a plan."""
    v = View(node_timeout=5)
    put_node(v, node("a"))
    for s in range(1, 30):  # its record stays as it was at T0; only beats come
        at = T0 + timedelta(seconds=s)
        assert not v.node_beat("a", at) and not v.expire(at)
        assert "a" in v.cluster.nodes
    assert v.last_beat("a") == T0 + timedelta(seconds=29)
    assert v.expire(T0 + timedelta(seconds=35))  # then silence: it leaves
    assert "a" not in v.cluster.nodes
    assert v.node_beat("a", T0 + timedelta(seconds=36))  # and its next beat brings it back
    assert "a" in v.cluster.nodes
    assert not v.node_beat("unknown", T0)  # a beat of a node with no record places nothing
    assert "unknown" not in v.cluster.nodes


def test_nothing_is_kept_of_a_pruned_node_or_a_pruned_jobs_attempts():
    """A node's last beat and a job's set of attempt keys outlived their records: one entry per
    node and per job ever seen, in a scheduler that runs for months."""
    v = View(node_timeout=5)
    put_node(v, node("a"))
    assert v.node_beat("a", T0 + timedelta(seconds=1)) is False and v.last_beat("a") is not None
    del v.nodes["a"]
    v.node_changed("a", T0 + timedelta(seconds=2))
    assert v.last_beat("a") is None and "a" not in v.beats.last
    put_job(v, job("j", state=JobState.SUCCEEDED, attempt=1))
    put_attempt(v, attempt("j", 1, ("b", [0], TaskState.SUCCEEDED)))
    del v.attempts["j.1"]
    v.attempt_changed("j.1")
    del v.jobs["j"]
    v.job_changed("j")
    assert "j" not in v._attempts_of


def test_tasks_hold_until_they_end_and_an_attempt_can_come_before_its_job():
    v = View(node_timeout=5)
    put_node(v, node("a"))
    put_node(v, node("b"))
    put_attempt(v, attempt("j", 1, ("a", [0], R), ("b", [1], R)))
    assert used(v) == {"a": (0, set()), "b": (0, set())}  # its job (the sizes) is not known yet
    assert put_job(v, job("j", tasks=2, state=JobState.RUNNING, attempt=1))
    assert used(v) == {"a": (2, {0}), "b": (2, {1})}
    assert put_attempt(v, attempt("j", 1, ("a", [0], TaskState.SUCCEEDED), ("b", [1], R)))
    assert used(v) == {"a": (0, set()), "b": (2, {1})}
    assert not put_attempt(v, attempt("j", 1, ("a", [0], TaskState.SUCCEEDED), ("b", [1], R)))
    del v.attempts["j.1"]
    assert v.attempt_changed("j.1")
    assert used(v) == {"a": (0, set()), "b": (0, set())}


def test_records_that_do_not_add_up_keep_the_node_out_until_they_do():
    v = View(node_timeout=5)
    put_node(v, node("a"))
    put_job(v, job("j"))
    put_job(v, job("k"))
    put_attempt(v, attempt("j", 1, ("a", [3], R)))
    put_attempt(v, attempt("k", 1, ("a", [3], R)))  # the same GPU twice: a view that does not add up
    assert "a" not in v.cluster.nodes and "GPU 3" in v.inconsistent["a"]
    assert "a" in v.capacity.cluster.nodes  # it still counts for "can this job ever run"
    put_attempt(v, attempt("k", 1, ("a", [3], TaskState.FAILED)))
    assert used(v) == {"a": (2, {3})} and not v.inconsistent


def test_the_queue_is_in_submission_order_and_a_reason_wakes_nothing():
    v = View(node_timeout=5)
    assert put_job(v, job("late", at=T0 + timedelta(seconds=5)))
    assert put_job(v, job("b", at=T0))
    assert put_job(v, job("a", at=T0))
    assert [j.job_id for j, _ in v.queue(T0)] == ["a", "b", "late"]
    assert not put_job(v, job("a", at=T0, reason="needs 1 GPU; no GPU is free now"))
    assert put_job(v, job("a", at=T0, attempt=1))  # placed: attempt 1 written, record to come
    assert [(j.job_id, n) for j, n in v.queue(T0)] == [("a", 1), ("b", 1), ("late", 1)]
    assert not put_attempt(v, attempt("a", 1, ("x", [0], R)))  # on no known node: frees nothing
    assert [j.job_id for j, _ in v.queue(T0)] == ["b", "late"]
    assert put_job(v, job("b", at=T0, state=JobState.STOPPED))
    assert [j.job_id for j, _ in v.queue(T0)] == ["late"] and v.waiting == 2


def test_a_backoff_that_ends_wakes_a_plan():
    v = View(node_timeout=5)
    put_job(v, job("j"))
    ended = attempt("j", 1, ("a", [0], TaskState.FAILED), ended_at=T0, rule="failed")
    put_attempt(v, ended)
    due = T0 + timedelta(seconds=30)
    assert put_job(v, job("j", attempt=1, settled=1, not_before=due))
    assert v.queue(T0) == []
    assert not v.expire(T0 + timedelta(seconds=29))
    assert v.expire(due)
    assert [(j.job_id, n) for j, n in v.queue(due)] == [("j", 2)]


def test_platform_failures_are_kept_for_the_avoid_window_only():
    v = View(node_timeout=5)
    put_job(v, job("j"))
    failure = Failure(kind=FailureKind.PLATFORM, task="w.0", node="a", reason="lost")
    put_attempt(v, attempt("j", 1, ("a", [0], TaskState.FAILED), ended_at=T0, failure=failure))
    assert [a.key for a in v.avoid_candidates(T0)] == ["j.1"]
    assert list(v.avoid_candidates(T0 + timedelta(days=1))) == []


def test_the_kept_index_equals_one_built_from_the_records():
    v = View(node_timeout=5)
    for name in "abcd":
        put_node(v, node(name, gpus=8))
    for i in range(6):
        put_job(v, job(f"j{i}", tasks=2, gpus=2))
    plan = v.cluster.plan([placement.PendingJob(f"j{i}", v.jobs[f"j{i}"].config) for i in range(6)])
    for job_id, specs in plan.placements.items():
        put_attempt(v, attempt(job_id, 1, *((t.node, t.gpus, R) for t in specs)))
    put_attempt(v, attempt("j0", 1, *((t.node, t.gpus, TaskState.SUCCEEDED) for t in plan.placements["j0"])))
    fresh = {name: placement.NodeState.from_info(info) for name, info in v.nodes.items()}
    for record in v.attempts.values():
        live = [t.spec() for t in record.tasks if not t.state.ended]
        placement.allocate(fresh, v.jobs[record.job_id].config, live)
    assert used(v) == {n.name: (n.used_cpus, set(n.used_gpus)) for n in fresh.values()}


def _index(cluster: placement.Cluster) -> tuple[object, ...]:
    """Everything `Cluster` keeps indexed, empty lists dropped (a node that left one keeps it)."""
    groups = {
        (g, sig): entries for g, by in cluster._groups.items() for sig, entries in by.items() if entries
    }
    most = {m: tops for m, tops in cluster._most.items() if tops}
    return groups, most, cluster._cpus, cluster._memory, cluster._sharing, cluster._hosting


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_what_attempt_changes_free_and_take_is_the_index_built_from_the_records(data: st.DataObject) -> None:
    """Attempt records change one at a time (tasks placed, ended, moved, some on GPUs another
    attempt holds, whole and shared): after each, the kept nodes and their index equal a cluster
    built from the records, and a node whose tasks do not add up is kept out."""
    v = View(node_timeout=5)
    for name in "abc":
        put_node(v, node(name, gpus=4))
    shares = {"w": 2, "h": 0.5, "q": 0.25}  # GPUs per task of each job: whole, or part of one
    for job_id, gpus in shares.items():
        record = job(job_id, tasks=2, gpus=1)
        role = record.config.taskRoles[0].model_copy(update={"gpuNumber": gpus})
        config = record.config.model_copy(update={"taskRoles": [role]})
        put_job(v, record.model_copy(update={"config": config}))
    states = st.sampled_from([R, R, TaskState.PLACED, TaskState.SUCCEEDED, TaskState.FAILED])
    for _ in range(data.draw(st.integers(1, 25))):
        job_id = data.draw(st.sampled_from(sorted(shares)))
        n = data.draw(st.integers(1, 2))
        if data.draw(st.integers(0, 5)) == 0:
            v.attempts.pop(f"{job_id}.{n}", None)
            v.attempt_changed(f"{job_id}.{n}")
        else:
            width = 1 if shares[job_id] < 1 else shares[job_id]
            tasks = [
                (
                    data.draw(st.sampled_from("abc")),
                    sorted(data.draw(st.sets(st.integers(0, 3), min_size=int(width), max_size=int(width)))),
                    data.draw(states),
                )
                for _ in range(data.draw(st.integers(1, 2)))
            ]
            put_attempt(v, attempt(job_id, n, *tasks))
        fresh: dict[str, placement.NodeState] = {}
        for name, info in v.nodes.items():
            state = placement.NodeState.from_info(info)
            try:
                for record in v.attempts.values():
                    role = v.jobs[record.job_id].config.taskRoles[0]
                    for t in record.tasks:
                        if t.node == name and not t.state.ended:
                            state.use(role.cpuNumber, role.memoryMB, t.gpus, role.gpu_milli)
            except ValueError:
                assert name not in v.cluster.nodes and name in v.inconsistent
                continue
            fresh[name] = state
            assert name not in v.inconsistent

        def holds(nodes: dict[str, placement.NodeState]) -> dict[str, tuple[object, ...]]:
            return {n: (s.used_cpus, s.used_memory_mb, s.used_gpus, s.shared) for n, s in nodes.items()}

        assert holds(v.cluster.nodes) == holds(fresh)
        assert _index(v.cluster) == _index(placement.Cluster(fresh.values()))


def test_a_job_refreshed_from_a_later_write_is_the_job_that_write_decodes_to_whole() -> None:
    """The scheduler's job mirror decodes a write to a job it holds with `Job.refresh` (what
    changes only; the config is never rewritten): the result is what decoding it whole gives."""
    created = job("jr", tasks=2)
    held = Job.of(created)
    for update in (
        {"attempt": 1, "reason": "placed on n1; starting tasks"},
        {"state": JobState.RUNNING, "attempt": 1, "reason": "running"},
        {"attempt": 1, "settled": 1, "not_before": T0 + timedelta(seconds=5), "reason": "retrying"},
        {"unschedulable": True, "reason": "can never run on the current nodes: ..."},
        {"state": JobState.FAILED, "attempt": 2, "settled": 2, "reason": "w failed"},
    ):
        later = created.model_copy(update=update)
        refreshed, whole = held.refresh(later.to_bytes()), Job.of(JobRecord.from_bytes(later.to_bytes()))
        fields = [f.name for f in dataclasses.fields(Job)]
        assert [getattr(refreshed, f) for f in fields] == [getattr(whole, f) for f in fields], update
        assert refreshed.config is held.config  # kept, not decoded again
    with pytest.raises(ValueError):
        held.refresh(job("other").to_bytes())  # another job's record under this key
    with pytest.raises(ValueError):
        held.refresh(b'{"job_id": "jr", "state": "NOPE"}')


def test_a_jobs_past_attempts_are_held_without_their_tasks():
    """A job retried (or preempted, or called back) again and again: the scheduler held each of
    its attempts whole, every task's last lines with them, until a week after the job ended. A
    settled attempt that is not the job's newest is now held without its tasks; what each ran
    still counts, and the newest stays whole."""
    v = View(node_timeout=5)
    placed = T0 - timedelta(hours=200)
    for n in range(1, 101):
        lines = [f"attempt {n} failed: " + "x" * 200] * 30
        record = AttemptRecord(
            job_id="r",
            attempt=n,
            placed_at=placed + timedelta(hours=n),
            ended_at=placed + timedelta(hours=n, minutes=30),
            tasks=[
                TaskStatus(
                    role="w", role_no=0, index=i, node="a", gpus=[i], state=TaskState.FAILED, last_lines=lines
                )
                for i in range(8)
            ],
        )
        v.attempts[record.key] = record
        v.attempt_changed(record.key)
    assert sum(len(a.tasks) for a in v.attempts.values()) == 8  # the newest's alone: 800 before
    assert len(v.attempts["r.100"].tasks) == 8
    assert v.service("r", T0.timestamp()).attained == pytest.approx(100 * 8 * 1800)
