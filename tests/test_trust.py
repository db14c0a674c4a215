"""Jobs you can trust (issue 7), end to end against a real nats-server with every service a
process: every task reaches a reported end even when its agent forgot it, tasks die with their
agent, configuration errors end a job at once, garbage on the bus or in KV stalls nothing,
finished jobs are pruned, and reports made while the bus is away are kept."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

from muster.services.agent.reporting import Reporter
from muster.services.agent.service import AgentOptions
from muster.shared import bus, client, subjects
from muster.shared.jobconfig import check_job
from muster.shared.messages import FailureKind, JobRecord, JobState, TaskCause, TaskEvent, TaskEventKind, now
from muster.shared.natsserver import NatsServer
from tests.test_jobs import attempt, nc, role, run_job, wait_final  # noqa: F401 - nc is a fixture


def _task_processes(job_id: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"MUSTER_JOB_ID={job_id}".encode() in environ:
            found.append(int(pid))
    return found


async def _until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)


async def _declared(nc) -> None:  # noqa: F811
    """Wait until the services have declared every stream and bucket."""

    async def ready():
        try:
            await nc.jetstream().stream_info(subjects.COMMANDS_STREAM)
            await nc.jetstream().stream_info(f"KV_{subjects.LEASES_BUCKET}")
            return True
        except Exception:
            return False

    await _until(ready, 60, "the services never declared their streams")


async def _record(nc, job_id: str) -> JobRecord:  # noqa: F811
    kv = await nc.jetstream().key_value(subjects.JOBS_BUCKET)
    return JobRecord.from_bytes((await kv.get(job_id)).value)


async def _submit(nc, config: dict) -> str:  # noqa: F811
    _, verdict = await client.submit(nc, json.dumps(config).encode(), timeout=30)
    assert verdict is not None and verdict.accepted, verdict
    assert verdict.job_id
    return verdict.job_id


async def test_a_task_its_restarted_agent_never_knew_is_reported_and_the_retry_runs(
    cluster,
    nc,  # noqa: F811
    monkeypatch,
):
    """Defect 1: the attempt ends while the agent of one of its tasks is down; the agent that
    comes back must report that task, or the job waits for it for ever."""
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", "60")  # a restart, not a lost node
    cluster.core()
    agents = {
        n: cluster.agent(n, "--address", "127.0.0.1", "--cpus", "1", "--heartbeat", "0.5") for n in "ab"
    }
    config = {
        "jobName": "forgotten",
        "image": "img",
        "retryCount": 1,
        "taskRoles": [role("fails", 1, "sleep 2; exit 1"), role("waits", 1, "sleep 600")],
    }
    job_id = await _submit(nc, config)
    first = await _until(lambda: _started(nc, job_id, "waits"), 60, "the task that waits never started")
    node = first.task("waits", 0).node
    agents[node].send_signal(signal.SIGKILL)
    agents[node].wait(10)
    # The attempt fails (the other task exits 1) while this agent is down: its kill order waits.
    await _until(lambda: _ended(nc, job_id, 1), 60, "attempt 1 did not end")
    cluster.agent(node, "--address", "127.0.0.1", "--cpus", "1", "--heartbeat", "0.5")
    record = await wait_final(nc, job_id, 90)
    assert (record.state, record.attempt, record.retries) == (JobState.FAILED, 2, 1), record
    a1 = await attempt(nc, job_id, 1)
    waits = a1.task("waits", 0)
    assert waits.state.ended and waits.cause in (TaskCause.KILLED, TaskCause.PLATFORM), waits


async def _started(nc, job_id: str, role_name: str):  # noqa: F811
    try:
        a = await attempt(nc, job_id, 1)
    except Exception:
        return None
    return a if a.task(role_name, 0).started_at else None


async def _ended(nc, job_id: str, n: int):  # noqa: F811
    try:
        return (await attempt(nc, job_id, n)).ended
    except Exception:
        return False


async def test_a_killed_agent_takes_its_tasks_with_it(cluster, nc):  # noqa: F811
    """Defect 11: a process task whose agent is SIGKILLed must not run on beside the attempt
    that replaces it."""
    cluster.core()
    agent = cluster.agent("solo", "--address", "127.0.0.1", "--cpus", "2")
    job_id = await _submit(
        nc, {"jobName": "orphan", "image": "img", "taskRoles": [role("w", 2, "sleep 600")]}
    )

    async def running():
        return (await _record(nc, job_id)).state == JobState.RUNNING and len(_task_processes(job_id)) >= 2

    await _until(running, 60, "the job never ran")
    agent.send_signal(signal.SIGKILL)
    agent.wait(10)

    async def gone():
        return not _task_processes(job_id)

    await _until(gone, 15, f"tasks outlived their agent: {_task_processes(job_id)}")


async def test_a_configuration_error_fails_the_job_at_once(cluster, nc, tmp_path):  # noqa: F811
    """Defect 5: a failure that recurs on any node is not retried as a platform fault."""
    cluster.core()
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "2")
    config = {
        "jobName": "no-auth",
        "image": "img",
        "retryCount": 3,
        "authFile": str(tmp_path / "missing-auth"),
        "taskRoles": [role("w", 1, "true")],
    }
    started = time.monotonic()
    record = await run_job(nc, config, timeout=60)
    assert (record.state, record.attempt, record.platform_retries, record.retries) == (
        JobState.FAILED,
        1,
        0,
        0,
    )
    assert "configuration error" in record.reason and "missing-auth" in record.reason, record.reason
    a = await attempt(nc, record.job_id)
    assert a.failure is not None and a.failure.kind == FailureKind.CONFIG
    assert time.monotonic() - started < 60  # services starting on a loaded machine included


async def test_garbage_on_every_consumer_is_terminated_and_stalls_nothing(cluster, nc):  # noqa: F811
    """Defect 13: undecodable messages are terminated and counted, not redelivered for ever,
    and work behind them goes on."""
    cluster.core()
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "2")
    await _declared(nc)
    js = nc.jetstream()
    garbage = [b"", b"{", b"\xff\xfe", b'{"job_id": 3}', b"[]" * 1000]
    for i in range(300):
        body = garbage[i % len(garbage)]
        await js.publish(subjects.kill_request("u"), body)
        await js.publish(subjects.task_event("jx", 1, "w", i, "exited", "n1"), body)
        await js.publish(subjects.task_event("jx", 1, "w", i, "endpoint", "n1"), body)
        await js.publish(subjects.kill("n1"), body)
        await js.publish(subjects.assign("n1"), body)
    started = time.monotonic()
    record = await run_job(
        nc, {"jobName": "after-garbage", "image": "img", "taskRoles": [role("w", 1, "true")]}
    )
    assert record.state == JobState.SUCCEEDED
    assert time.monotonic() - started < 60  # services starting on a loaded machine included

    async def settled():
        for stream, consumer in (
            (subjects.SUBMISSIONS_STREAM, subjects.SUPERVISOR_KILL_CONSUMER),
            (subjects.EVENTS_STREAM, subjects.SUPERVISOR_CONSUMER),
            (subjects.EVENTS_STREAM, subjects.REGISTRY_CONSUMER),
            (subjects.COMMANDS_STREAM, subjects.agent_consumer("n1")),
        ):
            info = await js.consumer_info(stream, consumer)
            if info.num_ack_pending or info.num_pending:
                return False
        return True

    await _until(settled, 30, "garbage is still pending or being redelivered")
    logs = cluster.logs()
    assert "message.rejected" in logs and "Traceback" not in logs


async def test_an_order_for_an_attempt_with_no_record_runs_nothing(cluster, nc, tmp_path):  # noqa: F811
    """The scheduler writes an attempt's record before its orders. An order with no record is
    forged, or outlived its attempt: a node away past the job retention found its old orders
    still queued, and ran the finished job's tasks again (the record it checked them against was
    pruned, so nothing said the attempt had ended). It is refused and counted; work goes on. So is
    an order for another node (an agent can have its own orders delivered on any subject)."""
    from muster.shared.jobconfig import JobConfig
    from muster.shared.messages import Assignment, TaskSpec

    cluster.core()
    agent = cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "2")
    await _declared(nc)
    ran = tmp_path / "ran"
    config = JobConfig.model_validate(
        {"jobName": "ghost", "image": "img", "taskRoles": [role("w", 1, f"touch {ran}")]}
    )
    order = Assignment(
        job_id="jghost", attempt=1, user="u", config=config, node="n1",
        gang=[TaskSpec(role="w", role_no=0, index=0, node="n1")],
    )  # fmt: skip
    await nc.jetstream().publish(subjects.assign("n1"), order.to_bytes())
    # Another node's order on this node's subject (redirected): its tasks are not this node's.
    elsewhere = order.model_copy(
        update={"job_id": "jother", "node": "n2", "gang": [TaskSpec(role="w", role_no=0, index=0, node="n2")]}
    )
    await nc.jetstream().publish(subjects.assign("n1"), elsewhere.to_bytes())
    record = await run_job(nc, {"jobName": "after", "image": "img", "taskRoles": [role("w", 1, "true")]})
    assert record.state == JobState.SUCCEEDED

    async def refused() -> bool:
        logs = cluster.logs()
        return "agent.order_refused" in logs and "an order for node n2" in logs

    await _until(refused, 30, "the order was not refused")
    assert not ran.exists() and agent.poll() is None


async def test_a_running_task_whose_attempt_record_is_gone_is_stopped(cluster, nc, tmp_path):  # noqa: F811
    """An order runs only once its attempt's record exists; a record gone later was pruned with
    its finished job (a node away past the retention comes back with the task still running, or
    its restarted agent adopts it). Nothing else would ever stop it: the agent's own check of its
    live tasks does (it took a missing record for a live one)."""
    cluster.core()
    agent = cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "2")
    alive = tmp_path / "alive"
    command = f"while true; do date > {alive}; sleep 0.2; done"
    _, verdict = await client.submit(
        nc, json.dumps({"jobName": "orphan", "image": "img", "taskRoles": [role("w", 1, command)]}).encode()
    )
    assert verdict and verdict.accepted

    async def ran() -> bool:
        return alive.exists()

    await _until(ran, 60, "the task never ran")
    js = nc.jetstream()
    await (await js.key_value(subjects.ATTEMPTS_BUCKET)).purge(f"{verdict.job_id}.1")
    await (await js.key_value(subjects.JOBS_BUCKET)).purge(verdict.job_id)

    async def stopped() -> bool:
        before = alive.stat().st_mtime
        await asyncio.sleep(1)
        return alive.stat().st_mtime == before

    await _until(stopped, 60, "the orphan task still runs")
    assert "agent.obsolete_task" in agent.log_path.read_text() and agent.poll() is None


async def test_garbage_records_in_kv_are_skipped_not_fatal(cluster, nc):  # noqa: F811
    """Defect 14: one garbage entry in the nodes, jobs or attempts bucket stops nothing."""
    cluster.core()  # the services declare the buckets
    await _declared(nc)
    js = nc.jetstream()
    for bucket, key in (
        (subjects.NODES_BUCKET, "bogus"),
        (subjects.JOBS_BUCKET, "jbogus"),
        (subjects.ATTEMPTS_BUCKET, "jbogus.1"),
        (subjects.RENDEZVOUS_BUCKET, "jbogus.1"),
    ):
        await (await js.key_value(bucket)).put(key, b"\x00 not a record")
    # Services started after the garbage (as after a restart) come up and work.
    for p in cluster.procs:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    cluster.core()
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "2")
    record = await run_job(
        nc, {"jobName": "beside-garbage", "image": "img", "taskRoles": [role("w", 2, "true")]}
    )
    assert record.state == JobState.SUCCEEDED
    assert all(p.poll() is None for p in cluster.procs[-5:]), cluster.logs()
    assert "store.bad_record" in cluster.logs()


async def test_finished_jobs_and_gone_nodes_are_pruned_after_their_retention(cluster, nc, monkeypatch):  # noqa: F811
    """Defect 8: history is kept for a retention, then deleted; no consumer churn meanwhile."""
    monkeypatch.setenv("MUSTER_JOB_RETENTION", "2")
    monkeypatch.setenv("MUSTER_NODE_RETENTION", "4")
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", "2")
    cluster.core()
    cluster.start("muster.services.supervisor")  # a second replica: neither may churn consumers
    cluster.agent("keep", "--address", "127.0.0.1", "--cpus", "2", "--heartbeat", "0.5")
    gone = cluster.agent("gone", "--address", "127.0.0.1", "--cpus", "1", "--heartbeat", "0.5")
    record = await run_job(nc, {"jobName": "pruned", "image": "img", "taskRoles": [role("w", 1, "true")]})
    gone.send_signal(signal.SIGTERM)
    gone.wait(20)
    js = nc.jetstream()
    await js.publish(subjects.kill("gone"), b"an order it will never read")
    jobs = await js.key_value(subjects.JOBS_BUCKET)
    attempts = await js.key_value(subjects.ATTEMPTS_BUCKET)
    nodes = await js.key_value(subjects.NODES_BUCKET)

    async def missing(kv, key):
        try:
            await kv.get(key)
            return False
        except Exception:
            return True

    await _until(lambda: missing(jobs, record.job_id), 120, "the job record was never pruned")
    assert await missing(attempts, f"{record.job_id}.1")
    rendezvous = await js.key_value(subjects.RENDEZVOUS_BUCKET)  # the record and each endpoint
    assert await missing(rendezvous, f"{record.job_id}.1")
    assert await missing(rendezvous, subjects.endpoint_key(record.job_id, 1, "w.0"))
    await _until(lambda: missing(nodes, "gone"), 120, "the gone node was never pruned")
    assert not await missing(nodes, "keep")
    left = await js.stream_info(subjects.COMMANDS_STREAM, subjects_filter=subjects.node_commands("gone"))
    assert not left.state.subjects, left.state.subjects  # its unread orders went with it
    counts = []
    for _ in range(3):
        info = await js.stream_info(f"KV_{subjects.NODES_BUCKET}")
        counts.append(info.state.consumer_count)
        await asyncio.sleep(1)
    assert max(counts) <= 6, counts  # the watchers of the services, not one per check


async def test_reports_made_while_the_bus_is_away_are_sent_when_it_is_back(tmp_path):
    """Defect 12: an outcome reached while disconnected is kept (on disk) and reported later."""
    with NatsServer(tmp_path / "nats") as server:
        port = server.port
        nc = await bus.connect("test", server.url)
        await bus.ensure_jetstream(nc)
    # The server is down: the report waits in the outbox.
    reporter = Reporter(nc.jetstream(timeout=1), tmp_path / "outbox")
    reporter.start()
    event = TaskEvent(
        job_id="j1",
        attempt=1,
        role="w",
        index=0,
        node="n",
        kind=TaskEventKind.EXITED,
        cause=TaskCause.EXITED,
        exit_code=3,
    )
    reporter.report(event)
    await asyncio.sleep(1)
    assert list((tmp_path / "outbox").glob("*.json")), "the report was not kept"
    with NatsServer(tmp_path / "nats", port=port):
        assert await reporter.flush(30), "the report was never sent"
        stored = await nc.jetstream().get_last_msg(
            subjects.EVENTS_STREAM, subjects.task_event("j1", 1, "w", 0, "exited", "n")
        )
        assert TaskEvent.from_bytes(stored.data).exit_code == 3
        assert not list((tmp_path / "outbox").glob("*.json"))
        await reporter.close()
        await nc.close()


async def test_a_report_made_when_the_disk_takes_nothing_is_sent_from_memory(tmp_path, nc):  # noqa: F811
    """A full disk (here: the outbox gone, a file in its place) made keeping a report raise into
    the task's start or end, which died unseen: the task was never reported ended."""
    import shutil

    await bus.ensure_jetstream(nc)
    outbox = tmp_path / "outbox"
    reporter = Reporter(nc.jetstream(timeout=5), outbox)
    reporter.start()
    shutil.rmtree(outbox)
    outbox.write_text("not a directory")
    event = TaskEvent(job_id="j2", attempt=1, role="w", index=0, node="n", kind=TaskEventKind.RUNNING)
    reporter.report(event)  # does not raise
    assert await reporter.flush(30), "the report was never sent"
    stored = await nc.jetstream().get_last_msg(
        subjects.EVENTS_STREAM, subjects.task_event("j2", 1, "w", 0, "running", "n")
    )
    assert TaskEvent.from_bytes(stored.data).kind == TaskEventKind.RUNNING
    await reporter.close()


async def test_a_run_that_ends_while_its_agent_is_down_is_charged_exactly(
    cluster,
    nc,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """Defect 12: every run of a failing command that reached its end is charged to retryCount,
    and only those: a run whose outcome nobody saw (its agent was down) must not be counted as a
    platform failure and run again uncharged. Runs record themselves ("run", then "done")."""
    retries = 2
    # A restart, not a lost node: on a loaded machine the agent's 3 s away and its start-up
    # passed the default 5 s, the node was declared lost, and its run came again uncharged.
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", "60")
    cluster.core()
    args = ("--address", "127.0.0.1", "--cpus", "2", "--heartbeat", "0.5")
    agent = cluster.agent("n1", *args)
    runs = tmp_path / "runs"
    config = {
        "jobName": "exact",
        "image": "img",
        "retryCount": retries,
        "taskRoles": [role("w", 1, f"echo run >> {runs}; sleep 2; echo done >> {runs}; exit 3")],
    }
    job_id = await _submit(nc, config)

    async def first_run():
        return runs.exists() and "run" in runs.read_text()

    await _until(first_run, 60, "the command never ran")
    agent.send_signal(signal.SIGKILL)  # mid-run: the run would end while no agent watches
    agent.wait(10)
    await asyncio.sleep(3)
    cluster.agent("n1", *args)
    record = await wait_final(nc, job_id, 120)
    assert record.state == JobState.FAILED and record.retries == retries, record
    user_failures = 0
    for n in range(1, record.attempt + 1):
        a = await attempt(nc, job_id, n)
        user_failures += a.failure is not None and a.failure.kind == FailureKind.USER
    assert user_failures == retries + 1, record
    assert runs.read_text().split().count("done") == user_failures, runs.read_text()


async def test_status_lists_jobs_beside_a_garbage_record(cluster, nc):  # noqa: F811
    """Defect 14: `muster status` skips a record that does not decode instead of crashing."""
    cluster.core()
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "2")
    record = await run_job(nc, {"jobName": "listed", "image": "img", "taskRoles": [role("w", 1, "true")]})
    await (await nc.jetstream().key_value(subjects.JOBS_BUCKET)).put("jgarbage", b"{not json")
    r = cluster.cli("status")
    assert r.returncode == 0, r.stderr
    assert record.job_id in r.stdout and "Traceback" not in r.stderr


async def test_drain_stops_a_nodes_tasks_on_purpose_and_they_run_elsewhere(cluster, nc, tmp_path):  # noqa: F811
    """Defect 2: SIGTERM no longer stops tasks; `muster drain` does, on purpose: the job is retried
    on another node without spending retryCount, and the drained node gets no new work."""
    cluster.core()
    args = ("--address", "127.0.0.1", "--cpus", "1", "--heartbeat", "0.5")
    cluster.agent("first", *args)
    await _declared(nc)
    marker = tmp_path / "where"
    config = {
        "jobName": "drained",
        "image": "img",
        "taskRoles": [
            role("w", 1, f'echo "$MUSTER_ATTEMPT" >> {marker}; test "$MUSTER_ATTEMPT" -gt 1 || sleep 600')
        ],
    }
    job_id = await _submit(nc, config)
    await _until(lambda: _started(nc, job_id, "w"), 60, "the task never started")
    cluster.agent("second", *args)
    r = cluster.cli("drain", "first", "--grace", "1")
    assert r.returncode == 0 and "drained" in r.stdout, r.stdout + r.stderr
    record = await wait_final(nc, job_id, 90)
    assert (record.state, record.retries, record.platform_retries) == (JobState.SUCCEEDED, 0, 1), record
    a1, a2 = await attempt(nc, job_id, 1), await attempt(nc, job_id, 2)
    assert a1.task("w", 0).node == "first" and a1.task("w", 0).cause == TaskCause.KILLED
    assert a2.task("w", 0).node == "second"
    r = cluster.cli("drain", "nowhere")
    assert r.returncode == 2 and "no node 'nowhere'" in r.stderr, r.stderr


async def test_a_huge_queued_job_never_costs_the_scheduler_its_lease(cluster, nc):  # noqa: F811
    """Defect 17: planning a job of 640,000 tasks (written straight to the jobs bucket, as one
    accepted before the task limits were set) must not block the leader's lease renewal, and a
    one-task job still runs."""
    cluster.core()
    cluster.start("muster.services.scheduler")  # a standby that would take over if the lease lapsed
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "2")
    await _declared(nc)
    roles = [role(f"w{r}", 10000, "true") for r in range(64)]
    huge, errors = check_job({"jobName": "huge", "image": "img", "taskRoles": roles})
    assert huge is not None, errors
    record = JobRecord(
        job_id="jhuge", job_name="huge", submission_id="huge", user="u", config=huge, submitted_at=now()
    )
    await (await nc.jetstream().key_value(subjects.JOBS_BUCKET)).put("jhuge", record.to_bytes())
    await asyncio.sleep(3)
    small = await run_job(nc, {"jobName": "small", "image": "img", "taskRoles": [role("w", 1, "true")]}, 60)
    assert small.state == JobState.SUCCEEDED
    big = await _record(nc, "jhuge")
    assert big.unschedulable and "640000 tasks" in big.reason, big.reason
    assert "scheduler.lease_lost" not in cluster.logs()


async def test_a_task_that_never_starts_fails_after_the_start_timeout(cluster, nc, monkeypatch):  # noqa: F811
    """Defect 16: "placed; starting tasks" does not last for ever: after MUSTER_START_TIMEOUT the
    attempt fails as a platform fault naming the cause."""
    monkeypatch.setenv("MUSTER_START_TIMEOUT", "3")
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", "60")  # the frozen agent's node is not lost meanwhile
    cluster.core()
    agent = cluster.agent("frozen", "--address", "127.0.0.1", "--cpus", "1")
    await _declared(nc)
    nodes = await nc.jetstream().key_value(subjects.NODES_BUCKET)

    async def registered():
        try:
            return await nodes.get("frozen")
        except Exception:
            return None

    await _until(registered, 60, "the agent never registered")
    agent.send_signal(signal.SIGSTOP)
    try:
        job_id = await _submit(nc, {"jobName": "stuck", "image": "img", "taskRoles": [role("w", 1, "true")]})
        await _until(lambda: _ended(nc, job_id, 1), 60, "attempt 1 never timed out")
        a = await attempt(nc, job_id, 1)
        assert a.failure is not None and a.failure.kind == FailureKind.PLATFORM, a.failure
        assert a.failure.cause == TaskCause.PLATFORM and "not started within 3s" in a.failure.reason
    finally:
        agent.send_signal(signal.SIGCONT)


def test_a_relative_data_dir_becomes_absolute(tmp_path, monkeypatch):
    """Defect 5: Docker mounts need absolute sources; `muster up --data-dir .muster` works."""
    monkeypatch.chdir(tmp_path)
    options = AgentOptions(
        node="n", address="127.0.0.1", cpus=1, memory_mb=128, gpus=[], work_root=".muster/w", output_root="o"
    )
    assert (options.work_root, options.output_root) == (str(tmp_path / ".muster/w"), str(tmp_path / "o"))
