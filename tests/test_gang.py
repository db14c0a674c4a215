"""Big gangs cost their size, not its square (issue 23.2): the events of one attempt that come
together are applied in one read-modify-write of its record (the registry's rendezvous, the
supervisor's attempt record), and deciding after each event costs O(1), not a pass over the gang.
Against a real nats-server; the registry and the supervisor run in this process."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from muster.services.agent import environment
from muster.services.agent.runtime import TaskLaunch
from muster.services.agent.service import Agent, AgentOptions
from muster.services.agent.sim_runtime import SimRuntime
from muster.services.registry.service import Registry
from muster.services.scheduler import service as scheduler_service
from muster.services.scheduler.view import Job
from muster.services.supervisor import policy
from muster.services.supervisor.service import Supervisor
from muster.shared import bus, store, subjects
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import (
    Assignment,
    AttemptRecord,
    ClusterSpec,
    Endpoint,
    EndpointReported,
    JobRecord,
    JobState,
    TaskCause,
    TaskEvent,
    TaskEventKind,
    TaskSpec,
    TaskState,
    TaskStatus,
    now,
)

N = 300  # tasks in the gang: each on its own node


def config(tasks: int = N, **role: object) -> JobConfig:
    return JobConfig.model_validate(
        {
            "jobName": "big",
            "image": "x",
            "taskRoles": [
                {"name": "worker", "taskNumber": tasks, "cpuNumber": 1, "memoryMB": 1024, "gpuNumber": 0}
                | {"command": "x"}
                | role
            ],
        }
    )


def gang(tasks: int = N, job_id: str = "jbig") -> AttemptRecord:
    return AttemptRecord(
        job_id=job_id,
        attempt=1,
        tasks=[TaskStatus(role="worker", role_no=0, index=i, node=f"n{i}") for i in range(tasks)],
    )


def waiting_job(attempt: AttemptRecord) -> JobRecord:
    """The job record of `attempt`'s gang, waiting for it to run."""
    return JobRecord(
        job_id=attempt.job_id,
        job_name="big",
        submission_id="s",
        user="u",
        config=config(),
        state=JobState.WAITING,
        attempt=1,
        submitted_at=now(),
    )


async def writes(js, bucket: str) -> int:
    return int((await js.stream_info(f"KV_{bucket}")).state.last_seq)


@contextlib.asynccontextmanager
async def running(service) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        yield
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 15)


async def until(check, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def reported(attempt: AttemptRecord, i: int) -> tuple[str, bytes]:
    """Task i's endpoint report, as its node publishes it."""
    return subjects.task_event(attempt.job_id, 1, "worker", i, "endpoint", f"n{i}"), EndpointReported(
        job_id=attempt.job_id,
        attempt=1,
        gang_size=N,
        endpoint=Endpoint(role="worker", role_no=0, index=i, node=f"n{i}", host="10.0.0.1", port=5000 + i),
    ).to_bytes()


@pytest.mark.parametrize("arrival", ["together", "one by one"])
async def test_a_gangs_endpoints_cost_its_size_however_they_come(nats_url, arrival):
    """Every KV write of the rendezvous is seen on the bus (its subjects) and summed: the gang's
    endpoints cost O(N) bytes written whether they come all at once (a few batches) or one at a
    time, each collected before the next is sent (a batch each: the trickle a big gang's
    agents make). On main the record held every endpoint and was rewritten whole per batch: one
    by one, ~N²/2 endpoints written (7.6 MB for 300 tasks)."""
    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        attempt = gang()
        await buckets[subjects.ATTEMPTS_BUCKET].put(attempt.key, attempt.to_bytes())
        spec = await nc.subscribe(subjects.cluster_spec(attempt.job_id, 1))
        written = {"bytes": 0, "records": 0}

        async def on_write(msg) -> None:
            written["bytes"] += len(msg.data)
            written["records"] += msg.subject == f"$KV.{subjects.RENDEZVOUS_BUCKET}.{attempt.key}"

        await nc.subscribe(f"$KV.{subjects.RENDEZVOUS_BUCKET}.>", cb=on_write)
        if arrival == "together":
            # Every endpoint is in the stream before the registry reads one.
            await asyncio.gather(*(js.publish(*reported(attempt, i)) for i in range(N)))
        async with running(Registry(nc, js, buckets)):
            if arrival == "one by one":
                for i in range(N):
                    await js.publish(*reported(attempt, i))

                    async def collected(i: int = i) -> bool:
                        return written["records"] > i

                    await until(collected)
            published = ClusterSpec.from_bytes((await spec.next_msg(timeout=30)).data)
        assert [e.port for e in published.endpoints] == [5000 + i for i in range(N)]
        assert written["bytes"] <= 1000 * N, written  # an endpoint is ~150 bytes
        if arrival == "together":
            assert 1 <= written["records"] <= N // 20, written  # a handful of batches
    finally:
        await nc.close()


@pytest.mark.parametrize("kind", ["running", "lost"])
async def test_a_gangs_task_events_are_recorded_in_a_few_writes_not_one_each(nats_url, kind):
    """The gang starting (N running events) or its nodes lost (N ends declared by the platform):
    the attempt record is written a handful of times, and ends the attempt exactly once."""
    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        attempt = gang()
        job = waiting_job(attempt)
        await buckets[subjects.JOBS_BUCKET].put(job.job_id, job.to_bytes())
        await buckets[subjects.ATTEMPTS_BUCKET].put(attempt.key, attempt.to_bytes())
        before = await writes(js, subjects.ATTEMPTS_BUCKET)
        running_ = kind == "running"
        for i in range(N):
            ev = TaskEvent(
                job_id=attempt.job_id,
                attempt=1,
                role="worker",
                index=i,
                node=f"n{i}",
                kind=TaskEventKind.RUNNING if running_ else TaskEventKind.EXITED,
                cause=None if running_ else TaskCause.NODE_LOST,
                reason="" if running_ else f"node n{i} lost",
            )
            sender = f"n{i}" if running_ else subjects.PLATFORM
            await js.publish(
                subjects.task_event(attempt.job_id, 1, "worker", i, ev.kind, sender), ev.to_bytes()
            )
        kv = buckets[subjects.ATTEMPTS_BUCKET]

        async def all_recorded() -> bool:
            record = AttemptRecord.from_bytes((await kv.get(attempt.key)).value)
            wanted = TaskState.RUNNING if running_ else TaskState.FAILED
            return all(t.state == wanted for t in record.tasks)

        async with running(Supervisor(nc, js, buckets)):
            await until(all_recorded)
        record = AttemptRecord.from_bytes((await kv.get(attempt.key)).value)
        assert record.ended == (not running_)
        if not running_:
            assert record.failure is not None and record.failure.task == "worker.0"
        made = await writes(js, subjects.ATTEMPTS_BUCKET) - before
        assert 1 <= made <= N // 20, made  # one write per event on main (300)
    finally:
        await nc.close()


async def test_a_gangs_orders_are_stored_many_at_once_not_one_round_trip_after_another(nats_url, monkeypatch):
    """The scheduler sends a gang of N nodes its N orders (one per node, each with only that
    node's tasks) with up to ORDERS_IN_FLIGHT of them waiting for the server at once: N round
    trips one after the other took ~1 s for 2,000 nodes before `placed` could be published."""
    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        attempt = gang()
        record = waiting_job(attempt)
        waiting, most = 0, 0
        real = bus.publish_once

        async def counted(*args, **kwargs):
            nonlocal waiting, most
            waiting += 1
            most = max(most, waiting)
            try:
                return await real(*args, **kwargs)
            finally:
                waiting -= 1

        monkeypatch.setattr(scheduler_service.bus, "publish_once", counted)
        orders = await nc.subscribe(subjects.assign("*"), max_msgs=N)
        await scheduler_service.Scheduler(nc, js, buckets)._send_assignments(Job.of(record), attempt)
        got: dict[str, list[int]] = {}
        for _ in range(N):
            order = Assignment.from_bytes((await orders.next_msg(timeout=10)).data)
            got[order.node] = [t.index for t in order.gang]
        assert got == {f"n{i}": [i] for i in range(N)}  # every node its own task, once
        assert 1 < most <= scheduler_service.ORDERS_IN_FLIGHT, most  # 1 on main
        stored = await js.stream_info(subjects.COMMANDS_STREAM)
        assert stored.state.messages == N
    finally:
        await nc.close()


def test_events_applied_together_decide_as_when_applied_one_by_one():
    """`apply_task_events` (one tally for the batch) against `apply_task_event` per event (a
    fresh decision over the whole gang each time): the same records, event by event, over random
    gangs, rules and event orders."""
    rng = random.Random(7)
    at = now()
    for _ in range(300):
        tasks = rng.randint(1, 12)
        rules: dict[str, object] = rng.choice(
            [{}, {"minFailedTaskCount": 2}, {"minSucceededTaskCount": 2}, {"minFailedTaskCount": 3}]
        )
        cfg = config(tasks, **rules)
        if rng.random() < 0.3:
            cfg = cfg.model_copy(update={"killAllOnCompletedTaskNumber": rng.randint(1, tasks)})
        events = []
        for _ in range(rng.randint(1, 3 * tasks)):
            i = rng.randrange(tasks + 1)  # now and then a task that does not exist
            kind = rng.choice([TaskEventKind.RUNNING, TaskEventKind.EXITED])
            cause = rng.choice([TaskCause.EXITED, TaskCause.KILLED, TaskCause.NODE_LOST])
            events.append(
                TaskEvent(
                    job_id="j",
                    attempt=1,
                    role="worker",
                    index=i,
                    node=f"n{i}",
                    kind=kind,
                    cause=cause if kind == TaskEventKind.EXITED else None,
                    exit_code=rng.choice([0, 1]) if kind == TaskEventKind.EXITED else None,
                )
            )
        one_by_one = gang(tasks, "j")
        together = one_by_one.model_copy(deep=True)
        changed = [policy.apply_task_event(cfg, one_by_one, ev, at) for ev in events]
        assert policy.apply_task_events(cfg, together, events, at) == changed
        assert together == one_by_one


def test_applying_events_changes_no_task_it_was_given():
    """The supervisor applies a batch to a shallow copy of the record it holds (its view's, shared
    with every reader of the view): the policy replaces each task it changes and changes none, so
    a write of a big gang's record copies only the tasks that changed. Here the given tasks keep
    their states (PLACED) while the new record holds them RUNNING, then one FAILED (the attempt
    ends) and one more ended after that decision."""
    held = gang(4)
    before = [t.model_copy() for t in held.tasks]
    copy = held.model_copy(update={"tasks": list(held.tasks)})
    at = now()
    events = [
        TaskEvent(job_id="jbig", attempt=1, role="worker", index=i, node=f"n{i}", kind=TaskEventKind.RUNNING)
        for i in range(4)
    ]
    ended = {"kind": TaskEventKind.EXITED, "cause": TaskCause.EXITED, "exit_code": 1}
    for i in (0, 1):
        events.append(TaskEvent(job_id="jbig", attempt=1, role="worker", index=i, node=f"n{i}", **ended))
    assert policy.apply_task_events(config(4), copy, events, at) == [True] * 6
    assert held.tasks == before and all(t.state == TaskState.PLACED for t in held.tasks)
    assert copy.outcome == JobState.FAILED
    assert [t.state for t in copy.tasks] == [TaskState.FAILED] * 2 + [TaskState.RUNNING] * 2
    assert all(a is not b for a, b in zip(held.tasks, copy.tasks, strict=True))


def _here(nc, js, buckets, tmp_path, runtime: object = None, **options: object) -> Agent:
    """An agent of node "here" (4 CPUs, the sim runtime unless given) in this process, not
    started."""
    defaults: dict[str, object] = {
        "node": "here",
        "address": "127.0.0.1",
        "cpus": 4,
        "memory_mb": 4096,
        "gpus": [],
        "work_root": str(tmp_path / "work"),
        "output_root": str(tmp_path / "output"),
    }
    opts = AgentOptions(**{**defaults, **options})  # type: ignore[arg-type]
    return Agent(nc, js, buckets, opts, runtime or SimRuntime())  # type: ignore[arg-type]


def _here_and_there(job_id: str) -> AttemptRecord:
    """Attempt 1 of a two-task gang: worker 0 on "here", worker 1 on "there"."""
    nodes = ["here", "there"]
    return AttemptRecord(
        job_id=job_id,
        attempt=1,
        tasks=[TaskStatus(role="worker", role_no=0, index=i, node=n) for i, n in enumerate(nodes)],
    )


async def _order_here(nc, tmp_path, job_id: str) -> tuple[Agent, Assignment, Any]:
    """The agent of "here" (not started), the order of `job_id`'s two-task gang for it (its
    record stored, worker 1 on "there"), and a subscription to the endpoint it reports."""
    js, buckets = await bus.setup(nc)
    record = _here_and_there(job_id)
    await buckets[subjects.ATTEMPTS_BUCKET].put(record.key, record.to_bytes())
    order = Assignment(
        job_id=job_id, attempt=1, user="u", node="here",
        config=config(2).model_copy(update={"extras": {"sim": {"seconds": 600}}}),
        gang=[t.spec() for t in record.tasks],
    )  # fmt: skip
    told = await nc.subscribe(subjects.task_event(job_id, 1, "worker", 0, "endpoint", "here"))
    return _here(nc, js, buckets, tmp_path), order, told


async def test_a_task_stopped_before_its_runner_began_is_reported_killed(nats_url, tmp_path):
    """A kill that comes in the same turn of the loop as the order, before the task's runner has
    taken its first step: cancelled then, the runner's own handler never runs. The task was
    left live for ever, its ports held and its end never reported; now `stop` says it."""
    from muster.services.agent.tasks import LocalTask

    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        agent = _here(nc, js, buckets, tmp_path)
        agent.reporter.start()
        order = Assignment(
            job_id="jearly", attempt=1, user="u", config=config(1), node="here",
            gang=[TaskSpec(role="worker", role_no=0, index=0, node="here")],
        )  # fmt: skip
        ended = await nc.subscribe(subjects.task_event("jearly", 1, "worker", 0, "exited", "here"))
        key = ("jearly", 1, "worker", 0)
        ports = agent.tasks.ports.take(1)
        endpoint = Endpoint(role="worker", role_no=0, index=0, node="here", host="127.0.0.1", port=ports[0])
        task = LocalTask(order, order.gang[0], endpoint, ports)
        agent.tasks.take(key, task)  # its runner is made, not yet run
        await agent.tasks.stop(task, "its attempt ended", 0)
        assert key not in agent.tasks.live and agent.tasks.known(key)
        event = TaskEvent.from_bytes((await ended.next_msg(timeout=10)).data)
        assert (event.cause, event.reason) == (TaskCause.KILLED, "killed before start: its attempt ended")
        await agent.reporter.close()
    finally:
        await nc.close()


async def test_an_order_whose_keeping_fails_holds_no_port_and_tells_no_endpoint(nats_url, tmp_path):
    """The agent keeps each order on disk before taking it on. A full disk there raised after the
    task's ports were taken and its endpoint told: the ports stayed held, and the order's next
    delivery took other ones than the endpoint the gang had been told (deduplicated, the first
    stands). Now the order is kept first: a failure holds and tells nothing."""
    nc = await bus.connect("test", nats_url)
    try:
        agent, order, told = await _order_here(nc, tmp_path, "jfull")
        save = agent.assignments.save

        def full(a: Assignment) -> None:
            raise OSError(28, "No space left on device")

        agent.assignments.save = full  # type: ignore[method-assign]  # a full disk: no test can fill one on demand
        with pytest.raises(OSError):
            await agent.assign(order)
        assert agent.tasks.ports.taken == set() and not agent.tasks.live
        with pytest.raises(nats.errors.TimeoutError):
            await told.next_msg(timeout=0.5)
        agent.assignments.save = save  # type: ignore[method-assign]
        await agent.assign(order)  # delivered again
        (task,) = agent.tasks.live.values()
        reported = EndpointReported.from_bytes((await told.next_msg(timeout=10)).data)
        assert reported.endpoint.port == task.endpoint.port and agent.tasks.ports.taken == set(task.ports)
        await agent.tasks.stop(task, "done", 0)
    finally:
        await nc.close()


async def test_an_endpoint_report_that_timed_out_but_was_stored_keeps_its_ports(
    nats_url, tmp_path, monkeypatch
):
    """A gang task's endpoint report whose publish timed out may still have been stored; the
    order comes again and its report, under the same message id, is deduplicated: the first one
    stands. The task took other ports on that delivery and listened where the gang was not told.
    Now it keeps the ports the first report named."""
    nc = await bus.connect("test", nats_url)
    try:
        agent, order, told = await _order_here(nc, tmp_path, "jtold")
        publish_once, failed = bus.publish_once, []

        async def stored_then_timed_out(*args, **kwargs):
            ack = await publish_once(*args, **kwargs)
            if not failed and ".endpoint." in args[1]:
                failed.append(args[1])
                raise nats.errors.TimeoutError  # its answer lost: the report is stored all the same
            return ack

        monkeypatch.setattr(
            bus, "publish_once", stored_then_timed_out
        )  # a lost answer: no test can lose one on demand
        with pytest.raises(nats.errors.TimeoutError):
            await agent.assign(order)
        first = EndpointReported.from_bytes((await told.next_msg(timeout=10)).data).endpoint
        await agent.assign(order)  # delivered again
        (task,) = agent.tasks.live.values()
        assert task.endpoint.port == first.port and task.ports == [first.port], (task.ports, first)
        assert agent.tasks.ports.taken == set(task.ports)
        await agent.tasks.stop(task, "done", 0)
    finally:
        await nc.close()


async def test_an_auth_file_read_that_hangs_leaves_the_agent_answering(nats_url, tmp_path, monkeypatch):
    """An authFile on a hung network filesystem is given AUTH_TIMEOUT (5 s) to be read; that wait
    held the agent's event loop (its heartbeats, every other task's start and end, the bus) for
    as long, once per task started. Now the read waits in a thread."""
    from muster.services.agent import launch

    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        record = AttemptRecord(
            job_id="jauth", attempt=1, tasks=[TaskStatus(role="worker", role_no=0, index=0, node="here")]
        )
        await buckets[subjects.ATTEMPTS_BUCKET].put(record.key, record.to_bytes())
        auth = tmp_path / "users" / "u" / "auth"
        auth.parent.mkdir(parents=True)
        auth.write_text("docker.io\nu\npw\n")
        read = launch._read_bounded

        def hung(*args: object) -> bytes:
            time.sleep(3)  # a read on a hung filesystem: no test can hang one on demand
            return read(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(launch, "_read_bounded", hung)
        agent = _here(nc, js, buckets, tmp_path, data_roots=[str(tmp_path / "users" / "{user}")])
        cfg = config(1).model_copy(update={"authFile": str(auth), "extras": {"sim": {"seconds": 600}}})
        order = Assignment(
            job_id="jauth", attempt=1, user="u", node="here", config=cfg, gang=[record.tasks[0].spec()]
        )
        gaps, stop = [0.0], asyncio.Event()

        async def tick() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.05)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticking = asyncio.create_task(tick())
        await agent.assign(order)
        (task,) = agent.tasks.live.values()
        deadline = time.monotonic() + 30
        while task.handle is None:
            assert time.monotonic() < deadline and task.runner is not None and not task.runner.done()
            await asyncio.sleep(0.05)
        stop.set()
        await ticking
        assert max(gaps) < 2, max(gaps)  # ~3 s on main: the read's whole wait
        await agent.tasks.stop(task, "done", 0)
    finally:
        await nc.close()


async def test_an_agents_check_of_its_tasks_reads_each_attempt_once_not_once_per_task(nats_url, tmp_path):
    """A node running 8 tasks of a 2,000-task attempt (its record ~250 KB): the routine check
    that its tasks are still live reads the record once for all of them, and finds each by its
    key; on main it read the record again for every task (8 reads, each with a pass over the
    gang). Once the attempt has ended, the check stops them all. A running task keeps no
    launch (its environment lists the whole gang: on main each task's was held for its life,
    ~200 MB for a sim process running a 2,000-task gang)."""
    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        mine, size = 8, 2000
        record = AttemptRecord(
            job_id="jcheck",
            attempt=1,
            tasks=[
                TaskStatus(role="worker", role_no=0, index=i, node="here" if i < mine else f"n{i}")
                for i in range(size)
            ],
        )
        kv = buckets[subjects.ATTEMPTS_BUCKET]
        await kv.put(record.key, record.to_bytes())
        reads = 0
        get = kv.get

        async def counted(key: str):
            nonlocal reads
            reads += key == record.key
            return await get(key)

        kv.get = counted  # type: ignore[method-assign]
        options = AgentOptions(
            node="here",
            address="127.0.0.1",
            cpus=64,
            memory_mb=262144,
            gpus=[],
            work_root=str(tmp_path / "work"),
            output_root=str(tmp_path / "output"),
        )
        agent = Agent(nc, js, buckets, options, SimRuntime())
        cfg = config(size).model_copy(update={"extras": {"sim": {"seconds": 600}}})
        order = Assignment(
            job_id=record.job_id,
            attempt=1,
            user="u",
            config=cfg,
            gang=[t.spec() for t in record.tasks[:mine]],
            node="here",
        )
        spec = ClusterSpec(
            job_id=record.job_id,
            attempt=1,
            endpoints=[
                Endpoint(role="worker", role_no=0, index=i, node=t.node, host="10.0.0.1", port=5000)
                for i, t in enumerate(record.tasks)
            ],
        )
        await js.publish(subjects.cluster_spec(record.job_id, 1), spec.to_bytes())
        await agent.assign(order)

        async def all_running() -> bool:
            return len(agent.tasks.live) == mine and all(t.handle for t in agent.tasks.live.values())

        await until(all_running)
        assert not [o for o in gc.get_objects() if type(o) is TaskLaunch]  # (isinstance wakes lazy modules)
        reads = 0
        await agent.reconciler.stop_obsolete()
        assert reads <= 1, reads  # 8 on main
        assert len(agent.tasks.live) == mine  # live: nothing stopped
        # The heartbeat's routine check of a gang of 2,000 (each of its nodes reads the whole
        # record) comes every 200 s, not every 10 s: O(1) a second per node, O(N) for the gang.
        agent.attempts.ttl = 0  # no read reused: each check that reads, reads
        reads = 0
        for _ in range(5):
            await agent.reconciler.stop_obsolete(routine=True)
        assert reads == 1, reads  # 5 on the code before
        agent.reconciler._due.clear()  # 200 s later
        await agent.reconciler.stop_obsolete(routine=True)
        assert reads == 2, reads
        # A task removed from its elastic role whose kill order never came (its leader went
        # between the record and the order) ran on, holding its GPUs: now it counts as obsolete.
        gone = record.tasks[0].key
        tasks = [t.model_copy(update={"removed": True}) if t.key == gone else t for t in record.tasks]
        await kv.put(record.key, record.model_copy(update={"tasks": tasks}).to_bytes())

        async def the_removed_one_stopped() -> bool:
            await agent.reconciler.stop_obsolete(wait=True)
            return len(agent.tasks.live) == mine - 1

        await until(the_removed_one_stopped)
        assert all(f"{k[2]}.{k[3]}" != gone for k in agent.tasks.live)
        ended = record.model_copy(update={"ended_at": now(), "outcome": JobState.FAILED})
        await kv.put(record.key, ended.to_bytes())

        async def all_stopped() -> bool:
            await agent.reconciler.stop_obsolete(wait=True)
            return not agent.tasks.live

        await until(all_stopped)
        await agent.reporter.close()
    finally:
        await nc.close()


def test_a_gangs_environments_encode_its_cluster_once_not_once_per_task(monkeypatch):
    """A sim process renders the environment of every task of a gang: TF_CONFIG and
    CLUSTER_SPEC hold the whole cluster (O(N) bytes each, by the format), and on main each was
    encoded again per task (json.dumps of N addresses, N times: O(N²) encoding for the process).
    Here the cluster is encoded once per spec and each task's value is the same text as
    json.dumps of the whole would give."""
    size = 400
    cfg = config(size)
    spec = ClusterSpec(
        job_id="jenv",
        attempt=1,
        endpoints=[
            Endpoint(
                role="worker", role_no=0, index=i, node=f"n{i}", host=f"10.0.{i // 250}.{i % 250}", port=5000
            )
            for i in range(size)
        ],
    )
    encoded = 0
    dumps = environment.json.dumps

    def counted(value, *args, **kwargs):
        nonlocal encoded
        text = dumps(value, *args, **kwargs)
        encoded += len(text)
        return text

    monkeypatch.setattr(environment.json, "dumps", counted)
    for i in range(size):
        env = environment.render_env(
            environment.TaskContext(
                job_id="jenv",
                attempt=1,
                user="u",
                config=cfg,
                spec=spec,
                role="worker",
                index=i,
                gpus=[],
                output_root="/o",
            )
        )
        cluster = {"worker": [f"{e.address}" for e in spec.endpoints]}
        want = dumps({"cluster": cluster, "task": {"type": "worker", "index": i}, "environment": "cloud"})
        assert env["TF_CONFIG"] == env["CLUSTER_SPEC"] == want
    # The cluster's ~7 KB twice (TF_CONFIG, CLUSTER_SPEC) and a few bytes per task; main: 5.6 MB.
    assert encoded <= 2 * len(want) + 100 * size, encoded


async def test_sim_tasks_take_ports_without_binding_sockets(nats_url, tmp_path):
    """A sim task listens on nothing: its ports are counted, not probed (main bound a socket per
    port, thousands per gang in one sim process): a port some process here holds is taken."""
    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        with socket.socket() as held:
            held.bind(("0.0.0.0", 0))
            held.listen()
            port = held.getsockname()[1]
            options = AgentOptions(
                node="s",
                address="127.0.0.1",
                cpus=1,
                memory_mb=1024,
                gpus=[],
                port_low=port,
                port_high=port,
                work_root=str(tmp_path),
            )
            agent = Agent(nc, js, buckets, options, SimRuntime())
            assert agent.tasks.ports.take(1) == [port]
    finally:
        await nc.close()


async def test_a_gangs_trickling_task_events_rewrite_its_record_at_a_bounded_pace(nats_url):
    """A 400-task gang whose tasks start one by one, 10 ms apart (image pulls end at different
    times): its record (~100 KB) is rewritten at most once per 0.1 s (0.25 ms per task) unless
    an eighth of the gang's events wait, the events of that time together, so the bytes written
    per second are bounded whatever the gang's size; on main each event that found the record
    idle was written alone (a write of the whole gang per task: O(N²))."""
    size = 400
    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        attempt = gang(size, "jtrickle")
        job = JobRecord(
            job_id=attempt.job_id,
            job_name="trickle",
            submission_id="s",
            user="u",
            config=config(size),
            state=JobState.WAITING,
            attempt=1,
            submitted_at=now(),
        )
        await buckets[subjects.JOBS_BUCKET].put(job.job_id, job.to_bytes())
        kv = buckets[subjects.ATTEMPTS_BUCKET]
        await kv.put(attempt.key, attempt.to_bytes())
        loop = asyncio.get_running_loop()
        writes: list[float] = []

        async def written(msg) -> None:
            writes.append(loop.time())

        await nc.subscribe(f"$KV.{subjects.ATTEMPTS_BUCKET}.{attempt.key}", cb=written)
        supervisor = Supervisor(nc, js, buckets)

        async def all_recorded() -> bool:
            record = AttemptRecord.from_bytes((await kv.get(attempt.key)).value)
            return all(t.state == TaskState.RUNNING for t in record.tasks)

        async with running(supervisor):
            await asyncio.wait_for(supervisor.synced["attempts"].wait(), 30)
            assert supervisor.spacing(attempt.key, 1) == pytest.approx(0.1)
            assert supervisor.spacing(attempt.key, size // 8) == 0  # a burst: written at once
            began = loop.time()
            for i in range(size):
                ev = TaskEvent(
                    job_id=attempt.job_id, attempt=1, role="worker", index=i, node=f"n{i}", kind="running"
                )
                await js.publish(
                    subjects.task_event(attempt.job_id, 1, "worker", i, "running", f"n{i}"), ev.to_bytes()
                )
                await asyncio.sleep(0.01)
            await until(all_recorded)
        elapsed = writes[-1] - began
        assert 1 <= len(writes) <= elapsed / 0.1 + 2, (len(writes), elapsed)
    finally:
        await nc.close()


async def test_a_stopping_agent_does_not_wait_out_a_kill_grace(nats_url, tmp_path):
    """The agent is told to stop while a kill order waits out its grace (60 s, for a task that
    ignores SIGTERM). It waited for the order before stopping, past any stop timeout (compose's
    15 s), and was killed before it had stopped or left its tasks. Now the orders it is handling
    get DRAIN_WAIT seconds; the kill's order, cut, comes again to the next agent."""
    from muster.services.agent.process_runtime import ProcessRuntime, task_pids
    from muster.services.agent.service import DRAIN_WAIT
    from muster.shared.messages import KillOrder

    nc = await bus.connect("test", nats_url)
    stop = asyncio.Event()
    name = ""
    try:
        js, buckets = await bus.setup(nc)
        spec = TaskSpec(role="worker", role_no=0, index=0, node="here")
        record = AttemptRecord(job_id="jtrap", attempt=1, tasks=[TaskStatus(**spec.model_dump())])
        await buckets[subjects.ATTEMPTS_BUCKET].put(record.key, record.to_bytes())
        agent = _here(nc, js, buckets, tmp_path, ProcessRuntime(tmp_path / "work" / "tasks"), stop_grace=1)
        run = asyncio.create_task(agent.run(stop))
        trapping = config(1, command="trap '' TERM; sleep 600")
        order = Assignment(job_id="jtrap", attempt=1, user="u", config=trapping, node="here", gang=[spec])
        await js.publish(subjects.assign("here"), order.to_bytes())

        async def started() -> bool:
            return any(t.handle is not None for t in agent.tasks.live.values())

        await until(started)
        (task,) = agent.tasks.live.values()
        name = task.name
        kill = KillOrder(job_id="jtrap", attempt=1, reason="preempted", grace=60)
        await js.publish(subjects.kill("here"), kill.to_bytes())

        async def killing() -> bool:
            return task.kill_reason is not None

        await until(killing)
        await asyncio.sleep(0.5)  # the task has had its SIGTERM, and ignores it
        began = time.monotonic()
        stop.set()
        await asyncio.wait_for(run, 45)
        took = time.monotonic() - began
        assert took < DRAIN_WAIT + 10, f"the agent took {took:.1f} s to stop"
        assert not task_pids(name), "the agent stopped and left its task running"
    finally:
        stop.set()
        if name:
            from muster.services.agent.process_runtime import kill_task

            kill_task(name)
        await nc.close()


async def test_an_adopted_elastic_task_follows_its_gang_from_the_version_it_was_told(nats_url, tmp_path):
    """An elastic task adopted after its agent restarted: adoption did not follow its attempt, so
    the task never heard of a gang change again; and a follow heard only versions published after
    it began, so one published while no agent ran (or while a task's image was pulled) was lost.
    Now an adopted task follows from the version its env file says it was told: one it was told
    is not signalled again, one it missed is written and signalled once, and so is the next."""
    from muster.services.agent.launch import task_env
    from muster.services.agent.sim_runtime import SimPlan, SimTask
    from muster.services.agent.tasks import LocalTask

    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        agent = _here(nc, js, buckets, tmp_path)
        elastic = config(1, minTaskNumber=1, maxTaskNumber=3).model_copy(
            update={"extras": {"elastic": {"signal": "SIGUSR1"}}}
        )

        def spec(job_id: str, version: int, n: int) -> ClusterSpec:
            eps = [
                Endpoint(role="worker", role_no=0, index=i, node="here", host="127.0.0.1", port=7000 + i)
                for i in range(n)
            ]
            return ClusterSpec(job_id=job_id, attempt=1, endpoints=eps, version=version)

        async def adopted(job_id: str, stored: int) -> tuple[list[str], Path]:
            """A task of `job_id` told version 1 by the agent before; `stored`: the version on
            the bus as the agent adopts it."""
            me = TaskSpec(role="worker", role_no=0, index=0, node="here")
            a = Assignment(job_id=job_id, attempt=1, user="u", config=elastic, node="here", gang=[me])
            task_env(a, me, spec(job_id, 1, 1), agent.tasks.where)
            for v in range(1, stored + 1):
                await js.publish(subjects.cluster_spec(job_id, 1), spec(job_id, v, v).to_bytes())
            lines: list[str] = []
            endpoint = Endpoint.of(me, "127.0.0.1", [], [])
            task = LocalTask(assignment=a, spec=me, endpoint=endpoint, ports=[])
            task.handle = SimTask(f"muster-{job_id}-1-worker-0", SimPlan(600.0), lines.append)
            agent.tasks.watch((job_id, 1, "worker", 0), task)
            return lines, Path(tmp_path / "work" / job_id / "1" / "worker-0" / "env")

        def told(env: Path) -> int:
            return int(env.read_text().split("export MUSTER_SPEC_VERSION=")[1].split()[0])

        signalled = f"sim: signal {int(signal.SIGUSR1)}"
        kept, kept_env = await adopted("jtold", stored=1)
        missed, missed_env = await adopted("jmissed", stored=2)

        async def caught_up() -> bool:
            return told(missed_env) == 2

        await until(caught_up, 15)
        assert missed.count(signalled) == 1, missed
        await js.publish(subjects.cluster_spec("jtold", 1), spec("jtold", 2, 2).to_bytes())

        async def followed() -> bool:
            return told(kept_env) == 2

        await until(followed, 15)
        assert kept.count(signalled) == 1, kept  # for version 2 only: it had been told version 1
        for task in list(agent.tasks.live.values()):
            await agent.tasks.stop(task, "done", 0)
    finally:
        await nc.close()


async def test_an_agent_holds_one_copy_of_an_attempt_however_often_it_reads_it(nats_url):
    """Every read of an attempt record after the reuse window is a new record, and each kept an
    index of its own holding it, up to 256: an agent checking one 2,000-task gang's record every
    200 s held ~1 GB of copies of it after a day. Now it keeps the newest read's, one per attempt."""
    from muster.services.agent.sharing import Attempts

    nc = await bus.connect("test", nats_url)
    try:
        _, buckets = await bus.setup(nc)
        record = gang(50, "jcopies")
        await buckets[subjects.ATTEMPTS_BUCKET].put(record.key, record.to_bytes())
        attempts = Attempts(buckets[subjects.ATTEMPTS_BUCKET], ttl=0)  # every read a fresh one
        for _ in range(300):
            found = await attempts.placement(record.key)
            assert found is not None and found.by_key["worker.7"].node == "n7"
        gc.collect()
        held = [o for o in gc.get_objects() if isinstance(o, AttemptRecord) and o.job_id == "jcopies"]
        assert len(held) <= 2, f"{len(held)} copies of the record held"  # the newest (and `record`)
    finally:
        await nc.close()


async def test_an_agent_starts_on_a_full_disk(nats_url, tmp_path, monkeypatch):
    """Restarted while its node's disk was full: writing its pid file raised, the agent exited
    before it had registered, and was restarted again and again, its tasks unwatched, until the
    node was declared lost. It now says so and starts."""
    nc = await bus.connect("test", nats_url)
    stop = asyncio.Event()
    real = Path.write_text
    run: asyncio.Task[None] | None = None

    def full(self: Path, *args: object, **kw: object) -> int:
        if self.name.startswith("agent.pid"):
            raise OSError(28, "No space left on device")  # no test can fill a disk on demand
        return real(self, *args, **kw)  # type: ignore[arg-type]

    try:
        js, buckets = await bus.setup(nc)
        agent = _here(nc, js, buckets, tmp_path)
        monkeypatch.setattr(Path, "write_text", full)
        run = asyncio.create_task(agent.run(stop))

        async def registered() -> bool:
            assert not run.done(), run.exception()
            return "here" in await store.keys(buckets[subjects.NODES_BUCKET])

        await until(registered, 30)
    finally:
        stop.set()
        if run is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(run, 30)
        await nc.close()


async def test_an_order_a_node_never_took_tells_its_tasks_not_started(nats_url, tmp_path):
    """An order that failed every time it came (the node's disk full) was given up on after
    MUSTER_MAX_DELIVERIES and nothing was said: the gang waited for the start deadline (10
    minutes) before it ran again elsewhere. Now its tasks are told not started, the platform's
    failure (not charged), as it is given up on."""
    nc = await bus.connect("test", nats_url)
    try:
        agent, order, _ = await _order_here(nc, tmp_path, "jnever")
        agent.reporter.start()
        ended = await nc.subscribe(subjects.task_event("jnever", 1, "worker", 0, "exited", "here"))
        await agent._order_given_up(order, "OSError: [Errno 28] No space left on device")
        event = TaskEvent.from_bytes((await ended.next_msg(timeout=10)).data)
        assert event.cause == TaskCause.PLATFORM and "could not take its order" in event.reason, event
        assert "No space left" in event.reason and agent.tasks.known(("jnever", 1, "worker", 0))
        await agent.reporter.close()
    finally:
        await nc.close()


async def test_a_preempted_gang_is_settled_once_every_end_came_and_its_own_success_stands(nats_url):
    """A two-task gang (minSucceededTaskCount 1) is preempted while worker 1's success is on its
    way. Worker 0's stop comes first: the supervisor settled the attempt at once as preempted
    (waiting again, to run the whole job a second time), and the success that came next changed
    nothing. Now it waits for every task's end, and the success decides: the job succeeded."""
    from datetime import datetime, timedelta

    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        at = now()
        attempt = gang(2, "jpre").model_copy(
            update={"ended_at": at, "outcome": JobState.STOPPED, "rule": "for jhead", "preempted_by": "jhead"}
        )
        job = waiting_job(attempt).model_copy(
            update={"config": config(2, minSucceededTaskCount=1), "state": JobState.RUNNING}
        )
        await buckets[subjects.JOBS_BUCKET].put(job.job_id, job.to_bytes())
        await buckets[subjects.ATTEMPTS_BUCKET].put(attempt.key, attempt.to_bytes())

        async def end(i: int, cause: TaskCause, code: int, when: datetime) -> None:
            ev = TaskEvent(
                job_id="jpre", attempt=1, role="worker", index=i, node=f"n{i}", kind=TaskEventKind.EXITED,
                cause=cause, exit_code=code, at=when,
            )  # fmt: skip
            await js.publish(subjects.task_event("jpre", 1, "worker", i, ev.kind, f"n{i}"), ev.to_bytes())

        jobs = buckets[subjects.JOBS_BUCKET]

        async def state() -> JobRecord:
            return JobRecord.from_bytes((await jobs.get("jpre")).value)

        async with running(Supervisor(nc, js, buckets)):
            await end(0, TaskCause.KILLED, 143, at + timedelta(seconds=2))  # the preemption's stop
            kv = buckets[subjects.ATTEMPTS_BUCKET]

            async def stop_recorded() -> bool:
                record = AttemptRecord.from_bytes((await kv.get(attempt.key)).value)
                return record.tasks[0].state == TaskState.STOPPED

            await until(stop_recorded)
            await asyncio.sleep(0.5)
            assert (await state()).state == JobState.RUNNING  # not settled: an end is still to come
            await end(1, TaskCause.EXITED, 0, at - timedelta(seconds=1))  # it had succeeded before

            async def settled() -> bool:
                return (await state()).state.final

            await until(settled)
        assert (await state()).state == JobState.SUCCEEDED
    finally:
        await nc.close()
