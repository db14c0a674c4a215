"""The queue's least-attained order under FIFO's bound (services/scheduler/attained.py), pure:
the FIFO shadow against the bench's own strict FIFO, what a job's attempts have run as the view
reads it from their records, and what a cycle decides with the order (`decide(shadow=...)`):
FIFO lending's decisions while every job is below one GPU-hour, a long gang that overtook FIFO
called back for a newcomer, a gang that started on time never."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import pytest

from bench.replay import replay
from bench.replay_policies import POLICIES
from bench.replay_trace import Trace, TraceTask
from muster.services.scheduler import quota
from muster.services.scheduler.attained import Seen, Service, Shadow, fifo_starts, level
from muster.services.scheduler.cycle import decide
from muster.services.scheduler.placement import NodeState
from muster.services.scheduler.service import Scheduler
from muster.services.scheduler.view import View
from muster.shared import bus, subjects
from muster.shared.messages import (
    AttemptRecord,
    GpuDevice,
    JobRecord,
    JobState,
    NodeInfo,
    TaskSpec,
    TaskState,
    TaskStatus,
    now,
)
from tests.test_cycle import NOW, ROWS, J, R, Row, matches, view_of


def nodes(n: int, gpus: int = 8) -> list[NodeState]:
    devices = [GpuDevice(index=i, model="V100") for i in range(gpus)]
    return [NodeState(f"n{i}", 64, 512 * 1024, devices) for i in range(n)]


def job(job_id: str, gpus: int, tasks: int = 1) -> J:
    return J(job_id, tasks=tasks, gpus=gpus)


# ------------------------------------------------------------------ the shadow


@pytest.mark.parametrize("seed", range(6))
def test_the_shadow_starts_jobs_when_the_benchs_strict_fifo_does(seed: int) -> None:
    """Differential: `fifo_starts` against `bench.replay`'s `fifo` over the same jobs and nodes
    (arrivals faster than completions, gangs of 1-16 GPUs)."""
    rng = random.Random(seed)
    at, seen = 0.0, []
    for i in range(120):
        at += rng.expovariate(1 / 300)
        gpus = rng.choice([1, 1, 2, 4, 8])
        tasks = 2 if gpus == 8 and rng.random() < 0.3 else 1
        run = rng.choice([60.0, 600.0, 3600.0, 20000.0])
        seen.append(Seen(f"j{i}", at, run, job(f"j{i}", gpus, tasks).config()))
    ours = fifo_starts(nodes(4), seen)
    tasks = [TraceTask(s.job_id, s.arrival, s.run_s, s.config) for s in seen]
    bench = replay(Trace("x", tasks, nodes(4), []), POLICIES["fifo"](), never={})
    assert ours == pytest.approx(bench.started)
    assert sum(1 for s in seen if ours[s.job_id] > s.arrival) > 20  # the queue was busy


def test_a_job_that_never_fits_is_left_out_and_blocks_nobody() -> None:
    seen = [
        Seen("a", 0.0, 100.0, job("a", 8).config()),
        Seen("huge", 1.0, 100.0, job("huge", 8, tasks=4).config()),  # 32 GPUs on 2 x 8
        Seen("b", 2.0, 100.0, job("b", 8).config()),
        Seen("c", 3.0, 100.0, job("c", 8).config()),
    ]
    assert fifo_starts(nodes(2), seen) == {"a": 0.0, "b": 2.0, "c": 100.0}


def test_bounds_and_keys() -> None:
    seen = [Seen("a", 0.0, 1000.0, job("a", 8).config()), Seen("b", 10.0, 0.0, job("b", 8).config())]
    shadow = Shadow.make(nodes(1), seen)
    assert shadow.bounds == {"a": 0.0, "b": 990.0} and shadow.latest_start == 1000.0
    assert shadow.bound("new", 1500.0) == 0.0 and shadow.bound("new", 400.0) == 600.0
    # One submitted before the newest the shadow replayed, but not in it (older than its
    # horizon): no bound is known, so none is assumed.
    assert shadow.bound("left-out", 5.0) == 0.0 and Shadow().bound("any", 5.0) == 0.0
    fresh = Service()
    # b has waited 500 s of the 990 FIFO would have made it wait: not due, level 0.
    assert shadow.key("b", 10.0, 510.0, fresh) == (1, 0, 10.0, "b")
    assert shadow.due_at("b", 10.0, 510.0, fresh) == pytest.approx(1000.0)
    assert shadow.key("b", 10.0, 1000.0, fresh) == (0, 0, 10.0, "b")
    # It ran 2 GPU-hours in an attempt since stopped: level 1. Its run counts as waited (no
    # checkpoint: it starts over), unless progress is kept.
    ran = Service(attained=7200.0, ran=900.0, longest=900.0)
    assert shadow.key("b", 10.0, 510.0, ran) == (1, 1, 10.0, "b")
    assert shadow.key("b", 10.0, 1000.0, ran) == (0, 0, 10.0, "b")
    assert shadow.key("b", 10.0, 1000.0, ran, resumable=True) == (1, 1, 10.0, "b")
    assert shadow.key("b", 10.0, 1900.0, ran, resumable=True) == (0, 0, 10.0, "b")
    assert [level(x) for x in (0, 3599, 3600, 36000, 360000)] == [0, 0, 1, 2, 3]


# ------------------------------------------------------------------ the view


def test_the_view_reads_what_a_job_has_run_from_its_attempt_records() -> None:
    """Two GPUs for an hour in an attempt stopped, and one GPU for 30 minutes in the running one."""
    v, _ = view_of(Row("x", nodes={"a": 4}, queue=[], expect=[], running=[R(J("r", gpus=1), ("a:0",))]))
    placed = NOW - timedelta(hours=3)
    old = AttemptRecord(
        job_id="r",
        attempt=1,
        placed_at=placed,
        ended_at=placed + timedelta(hours=1),
        tasks=[TaskStatus(role="w", role_no=0, index=0, node="a", gpus=[0, 1], state=TaskState.STOPPED)],
    )
    half_hour = NOW - timedelta(minutes=30)
    current = v.attempts.pop("r.1").model_copy(update={"attempt": 2, "placed_at": half_hour})
    for record in (old, current):
        v.attempts[record.key] = record
    for key in ("r.1", "r.2"):
        v.attempt_changed(key)
    got = v.service("r", NOW.timestamp())
    assert got == Service(attained=2 * 3600 + 1800, ran=5400, longest=3600)
    assert v.service("nobody", NOW.timestamp()) == Service()


def test_the_shadow_replays_no_job_cancelled_while_it_waited() -> None:
    """FIFO would have dropped it when it was cancelled, not blocked on it until it fitted."""
    row = Row("x", nodes={"a": 4}, queue=[J("w", at=5), J("gone", gpus=4, at=1)], expect=[])
    v, _ = view_of(row)
    v.jobs["gone"].state = JobState.STOPPED
    v.job_changed("gone")
    assert [s.job_id for s in v.seen(NOW.timestamp(), 10)] == ["w"]
    assert [s.job_id for s in v.seen(NOW.timestamp(), 1)] == ["w"]


# ------------------------------------------------------------------ the cycle


def _one_user(row: Row) -> bool:
    return len({j.user for j in row.queue} | {r.job.user for r in row.running}) == 1


# With priorities and one user, the sharing order is priority, then submission: the same.
PLAIN = [r for r in ROWS if not r.vcs and (_one_user(r) or all(j.priority == "normal" for j in r.queue))]


@pytest.mark.parametrize("row", PLAIN, ids=[r.name for r in PLAIN])
def test_below_one_gpu_hour_the_order_decides_as_fifo_lending(row: Row) -> None:
    """Every job in these rows has run under an hour on under one GPU: the same decision as in
    submission order (by priority first, preemptions included), with no shadow yet, and with the
    shadow made from the view. (Steps come in the order the cycle took the jobs: where a priority
    is in use, the sharing order's cycle takes them in submission order.)"""
    v, vcs = view_of(row)
    plain = decide(v, vcs, quota.Fixeds(), NOW)
    for shadow in (Shadow(), Shadow.make(v.capacity.cluster.nodes.values(), v.seen(NOW.timestamp(), 100))):
        d = decide(v, vcs, quota.Fixeds(), NOW, shadow=shadow)
        assert (sorted(d.lines()), d.queue) == (sorted(plain.lines()), plain.queue)


def long_gang(bound: float) -> tuple[Row, Shadow]:
    """`long` (4 GPUs, placed an hour ago: 4 GPU-hours, level 2) holds node a; `new` (4 GPUs, level
    0) was submitted after it. `bound`: what the shadow says FIFO would have made `long` wait."""
    row = Row(
        "x",
        nodes={"a": 4},
        running=[R(J("long", gpus=4, at=0), ("a:0,1,2,3",))],
        queue=[J("new", gpus=4, at=3000)],
        expect=[],
    )
    return row, Shadow({"long": bound, "new": 0.0}, 0.0)


def test_a_long_gang_that_started_before_fifo_would_have_is_called_back_for_a_newcomer() -> None:
    row, shadow = long_gang(bound=7200.0)  # FIFO would have started it an hour from now
    v, vcs = view_of(row)
    assert decide(v, vcs, quota.Fixeds(), NOW).lines()[0].startswith("wait new:")  # FIFO lending
    d = decide(v, vcs, quota.Fixeds(), NOW, shadow=shadow)
    assert matches(d.lines(), ["preempt long.1 for new (head)", "wait new: *"]), d.lines()
    assert d.preempt[0].why.startswith("stopped to let job new, which has waited as long as it would have")
    # `new` not due yet either: it goes ahead by level (0 against 2), but a stop would throw
    # `long`'s four GPU-hours away, which only a due job is worth; if `long` resumes, it is stopped.
    shadow.bounds["new"] = 3600.0
    d = decide(v, vcs, quota.Fixeds(), NOW, shadow=shadow)
    assert not d.preempt and matches(d.lines(), ["wait new: *"]), d.lines()
    v.jobs["long"].config = v.jobs["long"].config.model_copy(update={"resumable": True})
    d = decide(v, vcs, quota.Fixeds(), NOW, shadow=shadow)
    assert d.preempt[0].why == "stopped to let job new, which has used fewer GPU-hours, start"


def test_a_priority_in_use_keeps_the_least_attained_order_within_each_priority() -> None:
    """One job with a priority (here a high one running on node b) does not turn the whole queue
    to the sharing order: within each priority it stays least-attained under FIFO's bound, so
    `new` (due) still calls `long` back, and a higher priority still goes first."""
    row, shadow = long_gang(bound=7200.0)
    row.nodes["b"] = 2
    row.running.append(R(J("hi", gpus=2, priority="high", at=1), ("b:0,1",)))
    v, vcs = view_of(row)
    assert v.ranked and not vcs
    d = decide(v, vcs, quota.Fixeds(), NOW, shadow=shadow)
    assert matches(d.lines(), ["preempt long.1 for new (head)", "wait new: *"]), d.lines()
    # A low job submitted first, and one that has run long, go behind `new` by priority and level.
    row.queue = [J("lo", gpus=4, priority="low", at=0), J("new", gpus=4, at=3000)]
    v, vcs = view_of(row)
    assert decide(v, vcs, quota.Fixeds(), NOW, shadow=shadow).queue == ["new", "lo"]


def test_of_gangs_that_resume_the_one_that_has_run_most_is_called_back_first() -> None:
    """`new` needs a whole node; stopping either `big` (4 GPUs on a for 3 hours: 12 GPU-hours,
    level 2) or `small` (3 GPUs on b for an hour, started after it: 3 GPU-hours, level 1) makes
    room. Both resume: the one last in the order, `big`, is stopped (Tiresias' choice; a stop
    costs it no work). Neither resumes (and `new` is due): the newest, `small`, which throws
    the least away, as before."""
    row = Row(
        "x",
        nodes={"a": 4, "b": 4},
        running=[R(J("big", gpus=4, at=0), ("a:0,1,2,3",)), R(J("small", gpus=3, at=10), ("b:0,1,2",))],
        queue=[J("new", gpus=4, at=3000)],
        expect=[],
    )
    v, vcs = view_of(row)
    three_hours_ago = NOW - timedelta(hours=3)
    big = v.attempts["big.1"]
    v.attempts["big.1"] = big.model_copy(
        update={
            "placed_at": three_hours_ago,
            "tasks": [t.model_copy(update={"started_at": three_hours_ago}) for t in big.tasks],
        }
    )
    v.attempt_changed("big.1")
    v.attempt_changed("small.1")  # the record that changed last is not what decides
    for job_id in ("big", "small"):
        v.jobs[job_id].config = v.jobs[job_id].config.model_copy(update={"resumable": True})
    far = 1e7  # none is due: FIFO would start them later still
    shadow = Shadow({"big": far, "small": far, "new": far}, 0.0)
    d = decide(v, vcs, quota.Fixeds(), NOW, shadow=shadow)
    assert matches(d.lines(), ["preempt big.1 for new (head)", "wait new: *"]), d.lines()
    for job_id in ("big", "small"):
        v.jobs[job_id].config = v.jobs[job_id].config.model_copy(update={"resumable": False})
    v.attempt_changed("big.1")
    shadow.bounds["new"] = 0.0
    d = decide(v, vcs, quota.Fixeds(), NOW, shadow=shadow)
    assert matches(d.lines(), ["preempt small.1 for new (head)", "wait new: *"]), d.lines()


def test_a_gang_that_has_waited_as_long_as_fifo_would_have_is_never_called_back() -> None:
    row, shadow = long_gang(bound=1800.0)  # it started after FIFO would have: it is due
    v, vcs = view_of(row)
    d = decide(v, vcs, quota.Fixeds(), NOW, shadow=shadow)
    assert not d.preempt and matches(d.lines(), ["wait new: *"]), d.lines()


def with_run(row: Row, job_id: str, gpus: list[int], hours: float) -> tuple:
    """The view of `row`, where `job_id` (waiting) ran an attempt stopped an hour ago."""
    v, vcs = view_of(row)
    start = NOW - timedelta(hours=1 + hours)
    record = AttemptRecord(
        job_id=job_id,
        attempt=1,
        placed_at=start,
        ended_at=start + timedelta(hours=hours),
        tasks=[TaskStatus(role="w", role_no=0, index=0, node="a", gpus=gpus, state=TaskState.STOPPED)],
    )
    v.attempts[record.key] = record
    v.attempt_changed(record.key)
    v.jobs[job_id].attempt = v.jobs[job_id].settled = 1  # the supervisor settled it: it waits again
    v.job_changed(job_id)
    return v, vcs


def test_a_job_that_has_run_long_waits_behind_newcomers_until_it_is_due() -> None:
    row = Row("x", nodes={"a": 2}, queue=[J("old", gpus=2, at=0), J("young", gpus=2, at=10)], expect=[])
    v, vcs = with_run(row, "old", [0, 1], hours=2)  # 4 GPU-hours: level 2
    at = NOW.timestamp()
    arrival = v.jobs["old"].submitted_at.timestamp()
    not_yet = Shadow({"old": at - arrival + 600.0, "young": 0.0}, 0.0)  # due in 10 minutes
    d = decide(v, vcs, quota.Fixeds(), NOW, shadow=not_yet)
    assert matches(d.lines(), ["place young.1 w.0@a[0, 1]", "wait old: *"]), d.lines()
    assert d.due_at == pytest.approx(at + 600.0)
    assert decide(v, vcs, quota.Fixeds(), NOW).lines()[0] == "place old.2 w.0@a[0, 1]"  # FIFO
    due = Shadow({"old": at - arrival, "young": 0.0}, 0.0)
    d = decide(v, vcs, quota.Fixeds(), NOW, shadow=due)
    assert d.lines()[0] == "place old.2 w.0@a[0, 1]" and d.due_at is None


def test_a_resumable_jobs_runs_count_as_run_not_as_waited() -> None:
    """`old` (submitted an hour ago) ran 2 hours and was stopped; the shadow says FIFO would
    have made it wait half an hour. Taken to start over, its whole hour counts as waited: it is
    due and goes first. Resumable, its runs count as run: it has waited less than nothing, and
    goes behind `young` by level."""
    row = Row("x", nodes={"a": 2}, queue=[J("old", gpus=2, at=0), J("young", gpus=2, at=10)], expect=[])
    v, vcs = with_run(row, "old", [0, 1], hours=2)
    shadow = Shadow({"old": 1800.0, "young": 0.0}, 0.0)
    assert decide(v, vcs, quota.Fixeds(), NOW, shadow=shadow).lines()[0] == "place old.2 w.0@a[0, 1]"
    v.jobs["old"].config = v.jobs["old"].config.model_copy(update={"resumable": True})
    assert decide(v, vcs, quota.Fixeds(), NOW, shadow=shadow).lines()[0] == "place young.1 w.0@a[0, 1]"


def test_with_virtual_clusters_the_sharing_order_rules() -> None:
    """The least-attained order applies where no VC or priority is in use (documented)."""
    row = Row("x", nodes={"a": 2}, queue=[J("old", gpus=2, at=0), J("young", gpus=2, at=10)], expect=[])
    row.vcs = {"default": (2, True)}
    v, vcs = with_run(row, "old", [0, 1], hours=2)
    arrival = v.jobs["old"].submitted_at.timestamp()
    shadow = Shadow({"old": NOW.timestamp() - arrival + 600.0}, 0.0)
    assert decide(v, vcs, quota.Fixeds(), NOW, shadow=shadow).lines()[0] == "place old.2 w.0@a[0, 1]"


# ------------------------------------------------------------------ the service, on a real bus


@contextlib.asynccontextmanager
async def leader(
    nats_url: str, puts: list[tuple[str, str, Any]]
) -> AsyncIterator[tuple[Any, Any, Scheduler]]:
    """A scheduler leading on the bus, over node a (4 V100) and the records `puts` (bucket, key,
    record) written first; yields (connection, buckets, scheduler)."""
    nc = await bus.connect("test", nats_url)
    js, buckets = await bus.setup(nc)
    node = NodeInfo(
        node="a", address="10.0.0.1", cpus=16, memory_mb=65536, runtime="sim", agent_id="a",
        gpus=[GpuDevice(index=i, model="V100") for i in range(4)],
    )  # fmt: skip
    for bucket, key, value in [(subjects.NODES_BUCKET, "a", node), *puts]:
        await buckets[bucket].put(key, value.to_bytes())
    scheduler = Scheduler(nc, js, buckets)
    stop = asyncio.Event()
    task = asyncio.create_task(scheduler.run(stop))
    try:
        yield nc, buckets, scheduler
        assert not task.done() and scheduler.leading
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 15)
        await nc.close()


async def until(
    nc: Any, buckets: Any, key: str, done: Callable[[AttemptRecord], bool], why: Callable[[], str]
) -> AttemptRecord:
    """Attempt record `key` once `done` holds of it (node a beats meanwhile), within 30 s."""
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(Exception):
            got = AttemptRecord.from_bytes((await buckets[subjects.ATTEMPTS_BUCKET].get(key)).value)
            if done(got):
                return got
        assert time.monotonic() < deadline, why()
        await nc.publish(subjects.beat("a"), b"")  # node a's agent beats
        await asyncio.sleep(0.1)


async def test_the_leader_makes_its_shadow_from_the_records_and_calls_back_a_gang_that_overtook_fifo(
    nats_url: str,
) -> None:
    """Node a (4 GPUs) runs `long` (4 GPUs for an hour: level 2). `e1` and `e2` (4 GPUs each),
    submitted before it, ran 3 hours side by side, one on a node since gone: on the nodes there
    are now, FIFO would run them one after the other and start `long` two hours from now, so
    `long` overtook FIFO and is not due. `new` (level 0) arrives and does not fit: the leader,
    once its shadow is made (in a thread, from the records it mirrors), calls `long` back (it
    resumes from its checkpoints: a gang that does not is called back only for a due job)."""
    t = now()

    def record(j: J, state: JobState, submitted: timedelta, attempt: int = 0) -> JobRecord:
        config = j.config().model_copy(update={"resumable": j.id == "long"})
        return JobRecord(
            job_id=j.id, job_name=j.id, submission_id=j.id, user="u", config=config,
            submitted_at=t - submitted, state=state, attempt=attempt, settled=attempt,
        )  # fmt: skip

    def ran(job_id: str, node: str, placed: timedelta, hours: float | None = None) -> AttemptRecord:
        tasks = [TaskStatus.placed(TaskSpec(role="w", role_no=0, index=0, node=node, gpus=[0, 1, 2, 3]))]
        ended = None if hours is None else t - placed + timedelta(hours=hours)
        state = TaskState.RUNNING if ended is None else TaskState.SUCCEEDED
        tasks = [x.model_copy(update={"state": state}) for x in tasks]
        return AttemptRecord(job_id=job_id, attempt=1, tasks=tasks, placed_at=t - placed, ended_at=ended)

    four = timedelta(hours=4)
    puts = [
        (subjects.JOBS_BUCKET, "e1", record(J("e1", gpus=4), JobState.SUCCEEDED, four, 1)),
        (subjects.ATTEMPTS_BUCKET, "e1.1", ran("e1", "a", four, hours=3)),
        (subjects.JOBS_BUCKET, "e2", record(J("e2", gpus=4), JobState.SUCCEEDED, four, 1)),
        (subjects.ATTEMPTS_BUCKET, "e2.1", ran("e2", "gone", four, hours=3)),
        (subjects.JOBS_BUCKET, "long", record(J("long", gpus=4), JobState.RUNNING, timedelta(hours=3), 1)),
        (subjects.ATTEMPTS_BUCKET, "long.1", ran("long", "a", timedelta(hours=1))),
        (subjects.JOBS_BUCKET, "new", record(J("new", gpus=4), JobState.WAITING, timedelta(seconds=1))),
    ]
    async with leader(nats_url, puts) as (nc, buckets, scheduler):
        got = await until(
            nc,
            buckets,
            "long.1",
            lambda a: a.preempted_by is not None,
            lambda: f"long was not called back: {scheduler.shadow}",
        )
        assert got.preempted_by == "new" and got.rule is not None and "fewer GPU-hours" in got.rule
        assert scheduler.shadow is not None
        assert scheduler.shadow.bounds["long"] == pytest.approx(5 * 3600, abs=60)


@pytest.mark.parametrize("where", ["copying the view", "in its thread"])
async def test_a_shadow_that_fails_is_logged_and_the_leader_places_on(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The shadow is made beside the leader's loop: an error there (a record it cannot read) is
    logged and the old bounds stay; the leader goes on placing."""

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a record the shadow cannot read")

    if where == "in its thread":
        monkeypatch.setattr(Shadow, "make", broken)
    else:
        monkeypatch.setattr(View, "seen", broken)
    j = J("j", gpus=4)
    record = JobRecord(
        job_id="j", job_name="j", submission_id="j", user="u", config=j.config(), submitted_at=now()
    )
    async with leader(nats_url, [(subjects.JOBS_BUCKET, "j", record)]) as (nc, buckets, scheduler):
        await until(nc, buckets, "j.1", lambda a: True, lambda: "j was not placed")
        assert scheduler.shadow == Shadow()  # the bounds it had: none yet
