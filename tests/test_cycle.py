"""The scheduler's cycle as data (services/scheduler/cycle.py `decide`), table-tested with no bus:
each row is a cluster, its virtual clusters, what runs and what waits, and the decision expected,
one line per act in the order the service applies them (`Decision.lines()`):

    preempt <victim attempt> for <job> (priority|reclaim|head)
    place <job>.<attempt> <role>.<index>@<node>[<gpus>] ... [borrowed]
    wait <job>: <reason> [unschedulable]
    shrink <attempt> <role>.<index>@<node> for <job>
    grow <attempt> +<role>.<index>@<node>

Expected lines are patterns (a reason is long; `*` stands for the rest of it). Every node
has GPUs of model V100, 16 CPUs and 64 GB; jobs ask for 1 CPU and 1 GB per task."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest

from muster.services.scheduler import quota
from muster.services.scheduler.cycle import Decision, decide
from muster.services.scheduler.view import Job, View
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import (
    AttemptRecord,
    GpuDevice,
    JobRecord,
    JobState,
    NodeInfo,
    TaskState,
    TaskStatus,
    VirtualCluster,
)

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
LONG_AGO = NOW - timedelta(hours=1)  # past every elastic dwell


@dataclass(frozen=True)
class J:
    """A job: `tasks` tasks of role w with `gpus` GPUs each; `elastic`: (min, max) of w."""

    id: str
    tasks: int = 1
    gpus: float = 1
    vc: str = "default"
    user: str = "u"
    priority: str = "normal"
    at: int = 0  # submitted, seconds after LONG_AGO
    elastic: tuple[int, int] | None = None

    def config(self) -> JobConfig:
        role: dict[str, object] = {
            "name": "w", "taskNumber": self.tasks, "cpuNumber": 1, "memoryMB": 1024,
            "gpuNumber": self.gpus, "command": "x",
        }  # fmt: skip
        if self.elastic:
            role |= {"minTaskNumber": self.elastic[0], "maxTaskNumber": self.elastic[1]}
            role["taskNumber"] = max(self.tasks, self.elastic[0])
        return JobConfig.model_validate(
            {
                "jobName": self.id,
                "image": "x",
                "priority": self.priority,
                "virtualCluster": self.vc,
                "taskRoles": [role],
            }
        )


@dataclass(frozen=True)
class R:
    """A running attempt 1 of `job`, one task per entry of `on` ("node:gpu,gpu", or "node:gpu@milli"
    for a share of one GPU); `stopping`:
    the indexes of tasks an elastic shrink removed that still hold their node (still running)."""

    job: J
    on: tuple[str, ...]
    borrowed: bool = False
    stopping: tuple[int, ...] = ()


@dataclass
class Row:
    name: str
    nodes: dict[str, int]  # node -> V100 GPUs
    queue: list[J]
    expect: list[str]
    running: list[R] = field(default_factory=list)
    vcs: dict[str, tuple[int, bool]] = field(default_factory=dict)  # VC -> (V100 quota, may borrow)
    waiting: list[str] | None = None  # the queue left after the cycle, in order (Decision.queue)
    restarting: tuple[str, ...] = ()  # nodes whose agents restart: out of placement, tasks still on


ROWS = [
    Row(
        "plain placement: a gang goes where the fewest GPUs remain free",
        nodes={"a": 4, "b": 2},
        queue=[J("j1", tasks=2, gpus=1)],
        expect=["place j1.1 w.0@b[0] w.1@b[1]"],
    ),
    Row(
        "a gang that does not fit waits with its reason; one that never can says so",
        nodes={"a": 4},
        running=[R(J("r", gpus=2), ("a:0,1",))],
        queue=[J("big", tasks=2, gpus=2), J("huge", gpus=8)],
        expect=[
            "wait big: *",
            "wait huge: can never run on the current nodes: * [unschedulable]",
        ],
    ),
    Row(
        "backfill: a later small job runs beside a waiting head that it does not delay",
        nodes={"a": 4, "b": 4, "c": 2},
        running=[R(J("r", gpus=2), ("a:0,1",))],
        queue=[J("head", tasks=2, gpus=4, at=1), J("small", gpus=2, at=2)],
        expect=["wait head: *holding resources on a, b", "place small.1 w.0@c[0, 1]"],
        waiting=["head"],
    ),
    Row(
        "the head lends its reservation: a later job runs on what is held for it",
        nodes={"a": 4},
        running=[R(J("r", gpus=2), ("a:0,1",))],
        queue=[J("head", gpus=4, at=1), J("small", gpus=2, at=2)],
        expect=["wait head: *holding resources on a", "place small.1 w.0@a[2, 3]"],
    ),
    Row(
        "the head calls back a gang that started after it once it fits on what that gang holds",
        nodes={"a": 4, "b": 2},
        running=[R(J("later", gpus=4, at=5), ("a:0,1,2,3",))],
        queue=[J("head", gpus=4, at=1), J("small", gpus=2, at=6), J("more", gpus=1, at=7)],
        expect=[
            "preempt later.1 for head (head)",
            "wait head: first in line: stopping 1 gang(s) that started after it (later); "
            "it starts on a once they have stopped",
            "place small.1 w.0@b[0, 1]",  # beside it, on what is free and not held for the head
            "wait more: *",  # nothing is lent on what the head is about to take
        ],
    ),
    Row(
        "a gang submitted before the head, or of higher priority, is not called back",
        nodes={"a": 4},
        running=[R(J("first", gpus=2), ("a:0,1",)), R(J("hi", gpus=2, priority="high", at=5), ("a:2,3",))],
        queue=[J("head", gpus=4, at=1)],
        expect=["wait head: *"],
    ),
    Row(
        "with virtual clusters the head calls back only its own user's later gangs (the order is by share)",
        nodes={"a": 4, "b": 4},
        vcs={"team": (8, True)},
        running=[
            R(J("bobs", gpus=4, vc="team", user="bob", at=5), ("a:0,1,2,3",)),
            R(J("mine", gpus=2, vc="team", at=6), ("b:0,1",)),
        ],
        queue=[J("head", gpus=4, vc="team", at=1)],
        expect=["preempt mine.1 for head (head)", "wait head: *stopping 1 gang(s)*(mine)*on b once*"],
    ),
    Row(
        "gangs stopped for the head: no elastic role shrinks for it as well",
        nodes={"a": 4},
        running=[
            R(J("e", gpus=1, elastic=(1, 2)), ("a:0", "a:1")),
            R(J("later", gpus=2, at=5), ("a:2,3",)),
        ],
        queue=[J("head", gpus=1, at=1)],
        expect=["preempt later.1 for head (head)", "wait head: first in line: stopping 1 gang(s)*"],
    ),
    Row(
        "the queue left after a cycle is in sharing order (priority first), the placed left out",
        nodes={"a": 2},
        running=[R(J("r", gpus=1, priority="high"), ("a:0",))],
        queue=[
            J("lo", gpus=1, priority="low", at=1),
            J("n1", gpus=2, at=2),
            J("hi", gpus=1, priority="high", at=3),
            J("n2", gpus=2, at=4),
        ],
        expect=["wait lo: *", "wait n1: *first in line*", "place hi.1 w.0@a[1]", "wait n2: *"],
        waiting=["n1", "n2", "lo"],
    ),
    Row(
        "quota borrowing: a VC beyond its quota runs on idle GPUs, marked borrowed",
        nodes={"a": 4},
        vcs={"x": (1, True), "y": (3, True)},
        queue=[J("x1", gpus=1, vc="x", at=1), J("x2", gpus=2, vc="x", at=2)],
        expect=["place x1.1 w.0@a[0]", "place x2.1 w.0@a[1, 2] borrowed"],
    ),
    Row(
        "a VC that may not borrow waits for its own quota while another's job runs on the idle GPUs",
        nodes={"a": 4},
        vcs={"x": (1, False), "y": (3, True)},
        running=[R(J("x1", gpus=1, vc="x"), ("a:0",))],
        queue=[J("x2", gpus=1, vc="x", at=2), J("y1", gpus=1, vc="y", at=3)],
        expect=["wait x2: waiting for virtual cluster x's quota *", "place y1.1 w.0@a[1]"],
    ),
    Row(
        "a VC that may not borrow: of two jobs each within its quota alone, only the first runs",
        nodes={"a": 4},
        vcs={"x": (2, False), "y": (2, True)},
        queue=[J("x1", gpus=2, vc="x", at=1), J("x2", gpus=2, vc="x", at=2)],
        expect=["place x1.1 w.0@a[0, 1]", "wait x2: waiting for virtual cluster x's quota *"],
    ),
    Row(
        "reclaim: a job within its VC's quota preempts another VC's borrowed gang",
        nodes={"a": 4},
        vcs={"x": (2, True), "y": (2, True)},
        running=[
            R(J("x1", gpus=2, vc="x"), ("a:0,1",)),
            R(J("x2", gpus=2, vc="x", at=1), ("a:2,3",), borrowed=True),
        ],
        queue=[J("y1", gpus=2, vc="y", at=5)],
        expect=[
            "preempt x2.1 for y1 (reclaim)",
            "wait y1: preempted x2 to make room; waiting for them to stop",
        ],
    ),
    Row(
        "a job beyond its own quota may not reclaim borrowed work",
        nodes={"a": 4},
        vcs={"x": (3, True), "y": (1, True)},
        running=[R(J("x1", gpus=4, vc="x"), ("a:0,1,2,3",), borrowed=True)],
        queue=[J("y1", gpus=2, vc="y", at=5)],
        expect=["wait y1: *"],
    ),
    Row(
        "priority: a high job preempts the cheapest low gang of its own VC that makes room",
        nodes={"a": 2, "b": 2},
        running=[
            R(J("old", gpus=2, priority="low"), ("a:0,1",)),
            R(J("new", gpus=2, priority="low", at=30), ("b:0,1",)),
        ],
        queue=[J("hi", gpus=2, priority="high", at=60)],
        expect=[
            "preempt new.1 for hi (priority)",  # it has run the shorter time: the fewest GPU-seconds lost
            "wait hi: preempted new to make room; waiting for them to stop",
        ],
    ),
    Row(
        "no priority preemption of an equal priority gang",
        nodes={"a": 2},
        running=[R(J("r", gpus=2), ("a:0,1",))],
        queue=[J("same", gpus=2, at=60)],
        expect=["wait same: *"],
    ),
    Row(
        "elastic grow: a running elastic role grows into idle GPUs up to its maximum",
        nodes={"a": 4},
        running=[R(J("e", gpus=1, elastic=(1, 3)), ("a:0",))],
        queue=[],
        expect=["grow e.1 +w.1@a", "grow e.1 +w.2@a"],
    ),
    Row(
        "elastic grow stops at what this cycle places",
        nodes={"a": 4},
        running=[R(J("e", gpus=1, elastic=(1, 4)), ("a:0",))],
        queue=[J("j", gpus=2, at=5)],
        expect=["place j.1 w.0@a[1, 2]", "grow e.1 +w.1@a"],
    ),
    Row(
        "elastic grows one after the other: the second sees what the first took",
        nodes={"a": 3},
        running=[
            R(J("e1", gpus=1, elastic=(1, 3)), ("a:0",)),
            R(J("e2", gpus=1, elastic=(1, 3)), ("a:1",)),
        ],
        queue=[],
        expect=["grow e1.1 +w.1@a"],
    ),
    Row(
        "elastic grow within a quota that may not be exceeded",
        nodes={"a": 4},
        vcs={"x": (2, False)},
        running=[R(J("e", gpus=1, vc="x", elastic=(1, 4)), ("a:0",))],
        queue=[],
        expect=["grow e.1 +w.1@a"],
    ),
    Row(
        "elastic shrink: the newest tasks above the minimum go so that a waiting job fits",
        nodes={"a": 4},
        running=[R(J("e", gpus=1, elastic=(1, 4)), ("a:0", "a:1", "a:2", "a:3"))],
        queue=[J("j", gpus=2, at=5)],
        expect=["wait j: *", "shrink e.1 w.3@a for j", "shrink e.1 w.2@a for j"],
    ),
    Row(
        "no shrink below the minimum: the waiting job waits and nothing grows",
        nodes={"a": 4},
        running=[R(J("e", gpus=1, elastic=(3, 4)), ("a:0", "a:1", "a:2", "a:3"))],
        queue=[J("j", gpus=2, at=5)],
        expect=["wait j: *"],
    ),
    Row(
        "while removed tasks still stop, what they free is the waiting job's: nothing grows into it",
        nodes={"a": 3},
        running=[R(J("e", gpus=1, elastic=(1, 3)), ("a:0", "a:1"), stopping=(1,))],
        queue=[J("j", gpus=2, at=5)],
        expect=["wait j: *"],
    ),
    Row(
        "a gang called back for the head: no elastic role grows into what the head is planned onto",
        nodes={"a": 4},
        running=[
            R(J("e", gpus=1, elastic=(1, 3)), ("a:0",)),
            R(J("later", gpus=2, at=5), ("a:2,3",)),
        ],
        queue=[J("head", gpus=3, at=1)],
        expect=["preempt later.1 for head (head)", "wait head: first in line: stopping 1 gang(s)*"],
    ),
    Row(
        "removed tasks still stopping that would not make room: the role grows as before",
        nodes={"a": 3},
        running=[R(J("e", gpus=1, elastic=(1, 3)), ("a:0", "a:1"), stopping=(1,))],
        queue=[J("j", gpus=3, at=5)],
        expect=["wait j: *", "grow e.1 +w.2@a"],
    ),
    # What one cycle must never do: raise (the leader then places nothing for anyone, each
    # cycle failing again) or stop more than the waiting job needs.
    Row(
        "an elastic role of half GPUs grows into a share (its new task's share was dropped, and "
        "the cycle raised: nothing placed for anyone)",
        nodes={"a": 2},
        running=[R(J("e", gpus=0.5, elastic=(1, 3)), ("a:0@500",))],
        queue=[J("other", gpus=1, at=5)],
        expect=["place other.1 w.0@a[1]", "grow e.1 +w.1@a"],
    ),
    Row(
        "an elastic task on a node out of placement (its agent restarting) is no option to shrink "
        "(releasing and taking it back raised: every cycle failed while the node was away)",
        nodes={"a": 2, "b": 2},
        running=[R(J("e", gpus=1, elastic=(1, 3)), ("a:0", "b:0")), R(J("r", gpus=1, at=1), ("a:1",))],
        queue=[J("w", gpus=2, at=5)],
        restarting=("b",),
        expect=["wait w: *"],
    ),
    Row(
        "a job a gang is preempted for gets no elastic shrink too (two GPUs freed for one)",
        nodes={"a": 3},
        running=[
            R(J("low", gpus=1, priority="low"), ("a:0",)),
            R(J("e", gpus=1, priority="high", elastic=(1, 2)), ("a:1", "a:2")),
        ],
        queue=[J("hi", gpus=1, priority="high", at=5)],
        expect=["preempt low.1 for hi (priority)", "wait hi: preempted low to make room*"],
    ),
    Row(
        "an elastic job preempts for its minimum, as it is placed (sized at taskNumber, it stopped "
        "two gangs for one, or none where one would do)",
        nodes={"a": 1, "b": 1},
        running=[
            R(J("l1", gpus=1, priority="low"), ("a:0",)),
            R(J("l2", gpus=1, priority="low", at=1), ("b:0",)),
        ],
        queue=[J("hi", tasks=2, gpus=1, priority="high", elastic=(1, 2), at=5)],
        expect=["preempt l2.1 for hi (priority)", "wait hi: preempted l2 to make room*"],
    ),
    Row(
        "a gang placed on borrowed GPUs whose VC is within its quota now (its other work ended) is "
        "no reclaim's victim: a gang of a VC really beyond its quota is",
        nodes={"a": 4, "b": 2},
        vcs={"x": (2, True), "y": (2, True)},
        running=[
            R(J("x2", gpus=2, vc="x", at=3000), ("a:0,1",), borrowed=True),
            R(J("d1", gpus=2), ("a:2,3",)),
            R(J("y0", gpus=1, vc="y"), ("b:0",)),
            R(J("d2", gpus=1, at=1), ("b:1",), borrowed=True),
        ],
        queue=[J("y1", gpus=1, vc="y", at=3100)],
        expect=["preempt d2.1 for y1 (reclaim)", "wait y1: preempted d2 to make room*"],
    ),
]


def view_of(row: Row) -> tuple[View, dict[str, VirtualCluster]]:
    v = View(node_timeout=30)
    for name, gpus in row.nodes.items():
        v.nodes[name] = NodeInfo(
            node=name, address="10.0.0.1", cpus=16, memory_mb=65536, runtime="sim", agent_id=name,
            gpus=[GpuDevice(index=i, model="V100") for i in range(gpus)], heartbeat_at=NOW,
        )  # fmt: skip
        v.node_changed(name, NOW)

    def put_job(j: J, state: JobState, attempt: int) -> None:
        record = JobRecord(
            job_id=j.id, job_name=j.id, submission_id=j.id, user=j.user, config=j.config(),
            submitted_at=LONG_AGO + timedelta(seconds=j.at), state=state, attempt=attempt,
        )  # fmt: skip
        v.jobs[j.id] = Job.of(record)
        v.job_changed(j.id)

    for r in row.running:
        put_job(r.job, JobState.RUNNING, 1)
        tasks = []
        for i, where in enumerate(r.on):
            node, gpus = where.split(":")
            gpus, _, milli = gpus.partition("@")
            tasks.append(
                TaskStatus(
                    role="w",
                    role_no=0,
                    index=i,
                    node=node,
                    gpus=[int(g) for g in gpus.split(",") if g],
                    gpu_milli=int(milli) if milli else None,
                    state=TaskState.RUNNING,
                    started_at=LONG_AGO + timedelta(seconds=r.job.at),
                    removed=i in r.stopping,
                )
            )
        record = AttemptRecord(
            job_id=r.job.id, attempt=1, tasks=tasks, borrowed=r.borrowed, placed_at=LONG_AGO,
            elastic=["w"] if r.job.elastic else [],
        )  # fmt: skip
        v.attempts[record.key] = record
        v.attempt_changed(record.key)
    for j in row.queue:
        put_job(j, JobState.WAITING, 0)
    for name in row.restarting:
        v.nodes[name] = v.nodes[name].model_copy(update={"restarting_until": NOW + timedelta(seconds=60)})
        v.node_changed(name, NOW)
    vcs = {
        name: VirtualCluster.model_validate({"name": name, "quota": {"gpus": {"V100": n}}, "borrow": borrow})
        for name, (n, borrow) in row.vcs.items()
    }
    return v, vcs


def matches(lines: list[str], expect: list[str]) -> bool:
    """Each line matches its pattern, in order; `*` is the only wildcard."""

    def glob(pattern: str) -> re.Pattern[str]:
        return re.compile(".*".join(re.escape(part) for part in pattern.split("*")) + r"\Z", re.DOTALL)

    return len(lines) == len(expect) and all(
        glob(e).match(line) for line, e in zip(lines, expect, strict=True)
    )


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_a_cycle_decides(row: Row) -> None:
    v, vcs = view_of(row)
    before = {n.name: (n.used_cpus, set(n.used_gpus)) for n in v.cluster.nodes.values()}
    decision = decide(v, vcs, quota.Fixeds(), NOW)
    lines = decision.lines()
    assert matches(lines, row.expect), "\n".join(["decided:", *lines, "expected:", *row.expect])
    if row.waiting is not None:
        assert decision.queue == row.waiting
    # The view's index is left as it was: every tentative allocation was undone.
    assert {n.name: (n.used_cpus, set(n.used_gpus)) for n in v.cluster.nodes.values()} == before


def test_the_apply_order_is_preemptions_then_queue_order_then_resize() -> None:
    row = next(r for r in ROWS if r.name.startswith("elastic grow stops"))
    v, vcs = view_of(row)
    d = decide(v, vcs, quota.Fixeds(), NOW)
    assert isinstance(d, Decision) and d.queued == 1 and not d.preempt and d.shrink is None
    assert [s.job.job_id for s in d.steps] == ["j"] and [g.record.key for g in d.grow] == ["e.1"]


def test_a_reason_already_on_the_record_is_not_written_again() -> None:
    row = ROWS[1]
    v, vcs = view_of(row)
    first = decide(v, vcs, quota.Fixeds(), NOW)
    for step in first.steps:  # as if the service had written them
        job = v.jobs[step.job.job_id]
        job.reason, job.unschedulable = step.reason, step.unschedulable  # type: ignore[union-attr]
    assert decide(v, vcs, quota.Fixeds(), NOW).lines() == []


def test_nothing_is_decided_while_a_preempted_gang_is_still_stopping() -> None:
    row = next(r for r in ROWS if r.name.startswith("reclaim"))
    v, vcs = view_of(row)
    stopping = v.attempts["x2.1"].model_copy(update={"preempted_by": "y1", "ended_at": NOW})
    v.attempts["x2.1"] = stopping
    v.attempt_changed("x2.1")
    assert decide(v, vcs, quota.Fixeds(), NOW).lines() == ["wait y1: waiting for 1 preempted gang(s) to stop"]


def test_while_a_gang_stops_for_the_head_no_elastic_role_grows_into_its_place() -> None:
    row = next(r for r in ROWS if r.name.startswith("a gang called back for the head"))
    v, vcs = view_of(row)
    record = v.attempts["later.1"]
    v.attempts["later.1"] = record.model_copy(update={"preempted_by": "head", "ended_at": NOW})
    v.attempt_changed("later.1")
    lines = decide(v, vcs, quota.Fixeds(), NOW).lines()
    assert lines == ["wait head: waiting for 1 gang(s) stopped for it to stop"]
    # Once its tasks have stopped, the head takes the GPU beside them, not the elastic role.
    ended = [t.model_copy(update={"state": TaskState.STOPPED}) for t in record.tasks]
    v.attempts["later.1"] = v.attempts["later.1"].model_copy(update={"tasks": ended})
    v.attempt_changed("later.1")
    assert not v.stopping
    assert decide(v, vcs, quota.Fixeds(), NOW).lines() == ["place head.1 w.0@a[1, 2, 3]"]


def test_while_a_gang_stops_for_the_head_nothing_else_is_stopped_and_nothing_is_lent_on_its_place() -> None:
    row = next(r for r in ROWS if r.name.startswith("the head calls back"))
    v, vcs = view_of(row)
    stopping = v.attempts["later.1"].model_copy(update={"preempted_by": "head", "ended_at": NOW})
    v.attempts["later.1"] = stopping
    v.attempt_changed("later.1")
    lines = decide(v, vcs, quota.Fixeds(), NOW).lines()
    assert matches(
        lines,
        [
            "wait head: waiting for 1 gang(s) stopped for it to stop",
            "place small.1 w.0@b[0, 1]",
            "wait more: *",
        ],
    ), lines
    # Once its tasks have stopped, the head starts where they were, before anyone behind it.
    tasks = [t.model_copy(update={"state": TaskState.STOPPED}) for t in stopping.tasks]
    v.attempts["later.1"] = stopping.model_copy(update={"tasks": tasks})
    v.attempt_changed("later.1")
    lines = decide(v, vcs, quota.Fixeds(), NOW).lines()
    assert lines[0] == "place head.1 w.0@a[0, 1, 2, 3]", lines


def test_without_lending_the_claims_idle_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    from muster.services.scheduler import cycle

    monkeypatch.setattr(cycle, "LEND", False)
    for name, expect in [
        (
            "the head lends",
            ["wait head: *holding resources on a", "wait small: waiting behind job head (FIFO)*"],
        ),
        ("the head calls back", ["wait head: *", "place small.1 w.0@b[0, 1]", "wait more: *"]),
    ]:
        row = next(r for r in ROWS if r.name.startswith(name))
        v, vcs = view_of(row)
        lines = decide(v, vcs, quota.Fixeds(), NOW).lines()
        assert matches(lines, expect), lines


def test_a_gang_stopped_for_the_head_is_told_why_in_words() -> None:
    row = next(r for r in ROWS if r.name.startswith("the head calls back"))
    v, vcs = view_of(row)
    (stop,) = decide(v, vcs, quota.Fixeds(), NOW).preempt
    assert (stop.victim.job_id, stop.for_job.job_id, stop.kind) == ("later", "head", "head")
    assert stop.why == "stopped to let job head, which waited longer, start"


def test_a_gang_with_a_finished_task_is_not_called_back_for_the_head() -> None:
    """Stopping it would run its finished task again in the next attempt (the chaos test caught
    a task that exited 0 running again after such a call-back): it runs on; the head waits."""
    row = next(r for r in ROWS if r.name.startswith("the head calls back"))
    v, vcs = view_of(row)
    record = v.attempts["later.1"]
    done = record.tasks[0].model_copy(update={"state": TaskState.SUCCEEDED, "exit_code": 0})
    extra = record.tasks[0].model_copy(update={"index": 1})
    v.attempts["later.1"] = record.model_copy(update={"tasks": [done, extra, *record.tasks[1:]]})
    v.attempt_changed("later.1")
    decision = decide(v, vcs, quota.Fixeds(), NOW)
    assert not decision.preempt, decision.lines()
    assert any(line.startswith("wait head:") for line in decision.lines()), decision.lines()


def test_a_gang_its_time_limit_ends_within_the_grace_is_not_called_back_for_the_head() -> None:
    """maxRunTimeSec in the planner: a gang whose limit ends it within the preemption grace
    would free its place no later if stopped, and lose its work: it runs on and the head waits
    for it. One whose limit is further off is called back as before."""
    import dataclasses

    row = next(r for r in ROWS if r.name.startswith("the head calls back"))
    v, vcs = view_of(row)
    (stop,) = decide(v, vcs, quota.Fixeds(), NOW).preempt
    victim = stop.victim.job_id
    started = min(t.started_at for t in v.attempts[stop.victim.key].tasks if t.started_at is not None)
    ran = int((NOW - started).total_seconds())
    for left, called_back in [(int(quota.PREEMPT_GRACE) - 5, False), (int(quota.PREEMPT_GRACE) + 60, True)]:
        job = v.jobs[victim]
        v.jobs[victim] = dataclasses.replace(
            job, config=job.config.model_copy(update={"maxRunTimeSec": ran + left})
        )
        v.job_changed(victim)
        decision = decide(v, vcs, quota.Fixeds(), NOW)
        assert bool(decision.preempt) is called_back, (left, decision.lines())
        if not called_back:
            assert any(line.startswith("wait head:") for line in decision.lines()), decision.lines()


def test_a_stop_is_judged_again_on_the_stored_record_and_refused_once_a_task_has_ended() -> None:
    """The plan reads the view; a task's end may be recorded between the plan and the stop (its
    event was on its way). The stop is applied to the stored record (a compare-and-set), which
    it leaves alone then: the gang runs on and the next cycle plans again."""
    row = next(r for r in ROWS if r.name.startswith("the head calls back"))
    v, vcs = view_of(row)
    (stop,) = decide(v, vcs, quota.Fixeds(), NOW).preempt
    stored = v.attempts[stop.victim.key]
    stopped = stop.stopped(stored, NOW)
    assert stopped is not None
    assert (stopped.ended_at, stopped.preempted_by, stopped.rule) == (NOW, "head", stop.why)
    assert stop.stopped(stopped, NOW) is None  # stopping already: once is enough
    done = stored.tasks[0].model_copy(update={"state": TaskState.SUCCEEDED, "exit_code": 0, "ended_at": NOW})
    assert stop.stopped(stored.model_copy(update={"tasks": [done, *stored.tasks[1:]]}), NOW) is None
    removed = done.model_copy(update={"removed": True})  # an elastic role's shrink: not finished work
    assert stop.stopped(stored.model_copy(update={"tasks": [removed, *stored.tasks[1:]]}), NOW) is not None


def test_a_gang_on_a_node_that_missed_beats_is_not_called_back_until_it_beats_again() -> None:
    """Its agent may be down with a task's end unheard (it reports it when it comes back): the
    gang is nobody's victim while its node has been quiet for half the node timeout."""
    row = next(r for r in ROWS if r.name.startswith("the head calls back"))
    v, vcs = view_of(row)
    victim = decide(v, vcs, quota.Fixeds(), NOW).preempt[0].victim
    (node,) = {t.node for t in victim.tasks}
    later = NOW + v.node_timeout / 2 + timedelta(seconds=1)
    for name in v.nodes:
        if name != node:
            v.node_beat(name, later)
    assert not decide(v, vcs, quota.Fixeds(), later).preempt
    v.node_beat(node, later)
    assert [p.victim.key for p in decide(v, vcs, quota.Fixeds(), later).preempt] == [victim.key]


def test_what_runs_is_read_only_when_a_head_would_call_gangs_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading every running attempt costs O(running) a cycle: a cycle whose queue fits (the
    common one) must not pay it for lending; one with a head that would call gangs back does."""
    reads: list[datetime] = []
    for name, read in [("plain placement", False), ("the head calls back", True)]:
        row = next(r for r in ROWS if r.name.startswith(name))
        v, vcs = view_of(row)
        real = v.running
        monkeypatch.setattr(v, "running", lambda at, real=real: reads.append(at) or real(at))
        reads.clear()
        decide(v, vcs, quota.Fixeds(), NOW)
        assert bool(reads) is read, (name, reads)


def test_a_fault_in_resizing_costs_no_job_its_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resizing elastic roles raised (two such faults are rows above): `decide` raised with it,
    and every cycle after, so nothing was placed for anyone. A fault there is now said in the
    decision (the service logs it) and the cycle's placements stand."""
    from muster.services.scheduler import elastic

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("a record resizing cannot read")

    monkeypatch.setattr(elastic, "grow", broken)
    row = Row(
        "",
        nodes={"a": 4},
        running=[R(J("e", gpus=1, elastic=(1, 3)), ("a:0",))],
        queue=[J("other", gpus=1, at=5)],
        expect=[],
    )
    v, vcs = view_of(row)
    decision = decide(v, vcs, quota.Fixeds(), NOW)
    assert decision.lines() == ["place other.1 w.0@a[1]"]
    assert decision.resize_failed == "ValueError: a record resizing cannot read"
