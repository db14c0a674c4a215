"""How jobs end, end to end (real nats-server, every service a process): retries as retryCount
says, a lost node's gang retried elsewhere, kill, and agents that restart under running tasks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time

import docker
import nats.errors
import pytest

from muster.shared import client, subjects
from muster.shared.messages import (
    FailureKind,
    JobEvent,
    JobEventKind,
    JobRecord,
    JobState,
    NodeInfo,
    TaskCause,
    TaskState,
)
from tests.test_jobs import attempt, ended_attempt, nc, role, run_job, wait_final  # noqa: F401 - nc is a fixture


async def test_a_worker_exiting_1_with_retry_count_2_runs_exactly_3_attempts(cluster, nc, tmp_path):  # noqa: F811
    cluster.core()
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "4")
    runs = tmp_path / "runs"
    config = {
        "jobName": "always-fails",
        "image": "img",
        "retryCount": 2,
        "taskRoles": [
            role("ps", 1, f"echo ps >> {runs}; sleep 600"),
            role("worker", 1, f"echo worker >> {runs}; echo boom >&2; exit 1"),
        ],
    }
    record = await run_job(nc, config, timeout=60)
    assert (record.state, record.attempt, record.retries) == (JobState.FAILED, 3, 2), record
    assert "all 2 retries spent" in record.reason
    assert runs.read_text().split().count("worker") == 3
    await _until_gone(nc, record.job_id, 3)
    for n in (1, 2, 3):
        a = await attempt(nc, record.job_id, n)
        assert a.outcome == JobState.FAILED and a.failure is not None
        assert (a.failure.kind, a.failure.task, a.failure.exit_code) == (FailureKind.USER, "worker.0", 1)
        assert a.failure.last_lines == ["boom"]
        assert a.task("ps", 0).state == TaskState.STOPPED  # the rest of the gang was killed
        assert a.charged is (n < 3 or None)
    # muster status shows the whole history.
    status = cluster.cli("status", record.job_id).stdout
    assert status.count("[user failure]") == 3 and status.count("(retry charged to retryCount)") == 2


async def test_a_lost_node_fails_its_gang_as_platform_and_it_succeeds_elsewhere(cluster, nc, tmp_path):  # noqa: F811
    os.environ["MUSTER_NODE_TIMEOUT"] = "3"  # read by the supervisor started below
    try:
        cluster.core()
    finally:
        del os.environ["MUSTER_NODE_TIMEOUT"]
    doomed = cluster.agent("doomed", "--address", "127.0.0.1", "--cpus", "2", "--heartbeat", "0.5")
    await asyncio.sleep(1.5)  # the only node at first: the job lands there
    marker = tmp_path / "attempt"
    config = {
        "jobName": "survivor",
        "image": "img",
        "retryCount": 0,
        "taskRoles": [
            role("main", 2, f"echo $MUSTER_ATTEMPT >> {marker}; test $MUSTER_ATTEMPT -gt 1 || sleep 600")
        ],
    }
    _, verdict = await client.submit(nc, json.dumps(config).encode())
    assert verdict and verdict.accepted
    deadline = time.monotonic() + 30
    while not marker.exists() or len(marker.read_text().split()) < 2:
        assert time.monotonic() < deadline, cluster.logs()
        await asyncio.sleep(0.2)
    doomed.send_signal(signal.SIGSTOP)  # the machine stops answering: no heartbeat, no reports
    cluster.agent("spare", "--address", "127.0.0.1", "--cpus", "2", "--ports", "30000-30999")
    try:
        record = await wait_final(nc, verdict.job_id, timeout=60)
        assert record.state == JobState.SUCCEEDED, cluster.logs()
        assert (record.attempt, record.retries, record.platform_retries) == (2, 0, 1)
        first, second = await attempt(nc, record.job_id, 1), await attempt(nc, record.job_id, 2)
        assert first.failure is not None and first.failure.kind == FailureKind.PLATFORM
        assert "node doomed lost" in first.failure.reason and first.charged is False
        assert {t.node for t in second.tasks} == {"spare"}
    finally:
        doomed.send_signal(signal.SIGCONT)
    # The lost agent comes back: it stops what belongs to the dead attempt, by whichever comes
    # first: its own check on waking (obsolete_task), or the kill order the supervisor queued
    # for it meanwhile (each task then ends, killed).
    deadline = time.monotonic() + 20
    while True:
        text = doomed.log_path.read_text()
        if "obsolete_task" in text or text.count('"event": "agent.task_ended"') >= 2:
            break
        assert time.monotonic() < deadline, text[-2000:]
        await asyncio.sleep(0.2)
    deadline = time.monotonic() + 20  # the stop is under way once it is logged
    while True:
        pgrep = subprocess.run(["pgrep", "-f", "sleep 600"], capture_output=True, text=True)  # noqa: ASYNC221
        leftover = [p for p in pgrep.stdout.split() if _task_of(p, record.job_id)]
        if not leftover:
            break
        assert time.monotonic() < deadline, leftover
        await asyncio.sleep(0.2)


async def test_a_task_that_ended_before_its_node_was_lost_is_recorded_as_it_ended(cluster, nc, tmp_path):  # noqa: F811
    """A supervisor replica that took a task's exit report and died before its ack holds the report
    for the ack wait (30 s); the node, gone meanwhile, is found lost sooner by another replica. The
    task ended as its node said (exit 3: the job failed), not lost with the node (a platform
    fault, retried). Seen in a chaos run; here the test takes the report off the supervisors'
    consumer itself and never acks it, as the dead replica did."""
    os.environ["MUSTER_NODE_TIMEOUT"] = "3"  # read by the supervisors started below
    try:
        cluster.core()
        (first_supervisor,) = [p for p in cluster.procs if "supervisor" in p.log_path.name]
        doomed = cluster.agent("doomed", "--address", "127.0.0.1", "--cpus", "2", "--heartbeat", "0.5")
        go = tmp_path / "go"
        command = f"while [ ! -e {go} ]; do sleep 0.1; done; exit 3"
        config = {
            "jobName": "as-said",
            "image": "img",
            "retryCount": 0,
            "taskRoles": [role("main", 1, command)],
        }
        _, verdict = await client.submit(nc, json.dumps(config).encode())
        assert verdict and verdict.accepted
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(Exception):
                if (await attempt(nc, verdict.job_id, 1)).tasks[0].state == TaskState.RUNNING:
                    break
            assert time.monotonic() < deadline, cluster.logs()
            await asyncio.sleep(0.2)
        first_supervisor.kill()
        first_supervisor.wait(10)
        js = nc.jetstream()
        taken = await js.pull_subscribe_bind(
            durable=subjects.SUPERVISOR_CONSUMER, stream=subjects.EVENTS_STREAM
        )
        go.touch()
        held: list[str] = []
        deadline = time.monotonic() + 30
        while not any(s.endswith(".exited.doomed") for s in held):
            assert time.monotonic() < deadline, f"no exit report: {held}\n{cluster.logs()}"
            with contextlib.suppress(nats.errors.TimeoutError):
                held += [m.subject for m in await taken.fetch(10, timeout=1)]  # never acked
        doomed.kill()
        doomed.wait(10)
        cluster.start("muster.services.supervisor")
    finally:
        del os.environ["MUSTER_NODE_TIMEOUT"]
    record = await wait_final(nc, verdict.job_id, timeout=25)  # within the 30 s ack wait
    (task,) = (await attempt(nc, verdict.job_id, 1)).tasks
    assert (task.cause, task.exit_code) == (TaskCause.EXITED, 3), (task, cluster.logs())
    assert (record.state, record.attempt, record.platform_retries) == (JobState.FAILED, 1, 0), record


async def _until_gone(nc, job_id: str, n: int, timeout: float = 20) -> None:  # noqa: F811
    """The job is final as soon as the policy says so; the rest of its gang is stopped right after."""
    deadline = time.monotonic() + timeout
    while not all(t.state.ended for t in (await attempt(nc, job_id, n)).tasks):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)


def _task_of(pid: str, job_id: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"MUSTER_JOB_ID={job_id}".encode() in f.read().split(b"\0")
    except OSError:
        return False


async def test_kill_stops_a_running_job_and_it_is_not_retried(cluster, nc, tmp_path):  # noqa: F811
    cluster.core()
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "4")
    config = {
        "jobName": "to-kill",
        "image": "img",
        "retryCount": -2,
        "taskRoles": [role("main", 2, "echo up; sleep 600")],
    }
    _, verdict = await client.submit(nc, json.dumps(config).encode())
    await _wait_state(nc, verdict.job_id, JobState.RUNNING)
    r = cluster.cli("kill", "to-kill", "--grace", "2")
    assert r.returncode == 0, r.stderr + cluster.logs()
    assert "STOPPED: killed by" in r.stdout
    record = await wait_final(nc, verdict.job_id)
    assert record.state == JobState.STOPPED and record.attempt == 1
    a = await attempt(nc, record.job_id)
    assert all(t.state == TaskState.STOPPED for t in a.tasks) and a.outcome == JobState.STOPPED
    await asyncio.sleep(2)  # nothing comes back: a killed job is never retried, even with -2
    assert (
        JobRecord.from_bytes(
            (await (await nc.jetstream().key_value(subjects.JOBS_BUCKET)).get(record.job_id)).value
        ).attempt
        == 1
    )
    # Killing it again, or a finished job, says so and changes nothing.
    again = cluster.cli("kill", record.job_id)
    assert again.returncode == 0 and "already ended" in again.stdout


async def _wait_state(nc, job_id: str, state: JobState, timeout: float = 30) -> JobRecord:  # noqa: F811
    kv = await nc.jetstream().key_value(subjects.JOBS_BUCKET)
    deadline = time.monotonic() + timeout
    while True:
        record = JobRecord.from_bytes((await kv.get(job_id)).value)
        if record.state == state:
            return record
        assert time.monotonic() < deadline, record
        await asyncio.sleep(0.2)


@pytest.mark.docker
async def test_muster_kill_stops_a_4_task_docker_job_within_the_grace_and_frees_its_gpus(
    base_image,
    cluster,
    nc,  # noqa: F811
):
    cluster.core()
    cluster.agent(
        "gpu",
        "--runtime",
        "docker",
        "--gpus",
        "4xT4",
        "--cpus",
        "8",
        "--overcommit",
        "--address",
        "127.0.0.1",
    )
    config = {
        "jobName": "docker-kill",
        "image": base_image,
        "gpuType": "T4",
        # No TERM trap: the shell is PID 1 and ignores SIGTERM, so this takes the whole grace.
        "taskRoles": [role("main", 4, "sleep 600", gpu=1)],
    }
    _, verdict = await client.submit(nc, json.dumps(config).encode())
    await _wait_state(nc, verdict.job_id, JobState.RUNNING, timeout=60)
    a = await attempt(nc, verdict.job_id)
    assert sorted(g for t in a.tasks for g in t.gpus) == [0, 1, 2, 3]
    started = time.monotonic()
    r = cluster.cli("kill", "docker-kill", "--grace", "3")
    took = time.monotonic() - started
    assert r.returncode == 0, r.stderr + cluster.logs()
    assert took < 3 + 30, took  # the grace, plus the CLI's own start (seconds on a loaded machine)
    # The 3 s grace held, not the default 10 s: from the kill's taking to the tasks' ends.
    stored = await nc.jetstream().get_last_msg(
        subjects.EVENTS_STREAM, subjects.job_event(verdict.job_id, JobEventKind.KILLED)
    )
    killed_at = JobEvent.from_bytes(stored.data).at
    a = await attempt(nc, verdict.job_id)
    ends = [(t.ended_at - killed_at).total_seconds() for t in a.tasks if t.ended_at is not None]
    assert len(ends) == 4 and max(ends) < 3 + 5, ends
    engine = docker.from_env()
    try:
        running = engine.containers.list(
            filters={"label": f"muster.job={verdict.job_id}"}, ignore_removed=True
        )
        assert running == []
    finally:
        engine.close()
    # The GPUs are free again: a job that needs all four runs.
    config2 = {"jobName": "after-kill", "image": base_image, "taskRoles": [role("m", 1, "true", gpu=4)]}
    record = await run_job(nc, config2, timeout=60)
    assert record.state == JobState.SUCCEEDED


@pytest.mark.docker
async def test_an_agent_killed_and_restarted_adopts_its_running_containers(
    base_image,
    cluster,
    nc,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    # The crash is not a lost node here: a restart slower than the 5 s node timeout (a loaded
    # machine) would fail the attempt, and this test is about adopting, not about that.
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", "60")
    cluster.core()
    args = ("--runtime", "docker", "--cpus", "4", "--overcommit", "--address", "127.0.0.1")
    agent = cluster.agent("box", *args)
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)  # tasks run as a non-root user: their outputDir must be theirs to write
    config = {
        "jobName": "adopted",
        "image": base_image,
        "outputDir": str(out),
        "taskRoles": [
            role("main", 2, "echo start >> $PAI_OUTPUT_DIR/$PAI_TASK_ROLE_INDEX; sleep 4; echo done")
        ],
    }
    _, verdict = await client.submit(nc, json.dumps(config).encode())
    await _wait_state(nc, verdict.job_id, JobState.RUNNING, timeout=60)
    agent.send_signal(signal.SIGKILL)
    agent.wait(5)
    cluster.agent("box", *args)
    record = await wait_final(nc, verdict.job_id, timeout=60)
    assert record.state == JobState.SUCCEEDED and record.attempt == 1, cluster.logs()
    assert [(out / str(i)).read_text() for i in range(2)] == ["start\n", "start\n"]  # not restarted
    assert "agent.adopted" in cluster.logs()
    a = await attempt(nc, record.job_id)
    assert all(t.exit_code == 0 and t.last_lines[-1:] == ["done"] for t in a.tasks), a.tasks


@pytest.mark.docker
@pytest.mark.timeout(240)
async def test_an_agent_restarted_for_30s_mid_job_loses_nothing(base_image, cluster, nc, tmp_path):  # noqa: F811
    """Defect 2: SIGTERM leaves the containers running and announces a restart; the supervisor
    waits the restart grace (not the 5 s node timeout); the new agent adopts the containers
    and the job finishes in its first attempt, one of its tasks ending while no agent ran. What
    a task wrote while no agent ran is not lost: the new agent reads on from where the old one
    stopped."""
    cluster.core()
    args = (
        "--runtime",
        "docker",
        "--cpus",
        "2",
        "--overcommit",
        "--address",
        "127.0.0.1",
        "--heartbeat",
        "0.5",
    )
    agent = cluster.agent("box", *args)
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)  # tasks run as a non-root user: their outputDir must be theirs to write
    config = {
        "jobName": "restarted",
        "image": base_image,
        "outputDir": str(out),
        "taskRoles": [
            role("short", 1, "echo start >> $PAI_OUTPUT_DIR/short; sleep 10; echo said while no agent ran"),
            role("long", 1, "echo start >> $PAI_OUTPUT_DIR/long; sleep 40; echo done"),
        ],
    }
    _, verdict = await client.submit(nc, json.dumps(config).encode())
    await _wait_state(nc, verdict.job_id, JobState.RUNNING, timeout=60)
    deadline = time.monotonic() + 60
    while not all(t.state == TaskState.RUNNING for t in (await attempt(nc, verdict.job_id)).tasks):
        assert time.monotonic() < deadline, "both tasks never ran"
        await asyncio.sleep(0.2)
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(30) == 0, cluster.logs()
    engine = docker.from_env()
    try:
        running = engine.containers.list(
            filters={"label": f"muster.job={verdict.job_id}"}, ignore_removed=True
        )
        assert len(running) == 2  # left running for the next agent
    finally:
        engine.close()
    await asyncio.sleep(30)  # far longer than the node timeout; "short" ends meanwhile
    record = await _wait_state(nc, verdict.job_id, JobState.RUNNING, timeout=1)
    assert record.attempt == 1
    cluster.agent("box", *args)
    record = await wait_final(nc, verdict.job_id, timeout=90)
    assert (record.state, record.attempt) == (JobState.SUCCEEDED, 1), cluster.logs()
    assert [(out / n).read_text() for n in ("short", "long")] == ["start\n", "start\n"]  # never run twice
    a = await attempt(nc, record.job_id)
    assert [(t.key, t.exit_code) for t in a.tasks] == [("short.0", 0), ("long.0", 0)], a.tasks
    assert [t.last_lines[-1:] for t in a.tasks] == [["said while no agent ran"], ["done"]], a.tasks


@pytest.mark.docker
async def test_an_agent_killed_mid_job_loses_no_output_its_task_wrote_meanwhile(
    base_image,
    cluster,
    nc,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """An agent SIGKILLed leaves no note of where it stopped reading, but every heartbeat says
    what it had read by then: the agent started after it adopts the container and reads on
    from a little before its predecessor's last heartbeat, so a line the task wrote while no
    agent ran is in its output (a line of the last seconds may come twice; none is lost)."""
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", "60")  # the crash is not a lost node here
    cluster.core()
    args = ("--runtime", "docker", "--cpus", "1", "--address", "127.0.0.1", "--heartbeat", "0.5")
    agent = cluster.agent("crashy", *args)
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    command = (
        "echo start; while [ ! -f $PAI_OUTPUT_DIR/go ]; do sleep 0.2; done; "
        "echo said while no agent ran; sleep 4; echo done"
    )
    config = {
        "jobName": "crashed",
        "image": base_image,
        "outputDir": str(out),
        "taskRoles": [role("w", 1, command)],
    }
    _, verdict = await client.submit(nc, json.dumps(config).encode())
    await _wait_state(nc, verdict.job_id, JobState.RUNNING, timeout=60)
    await asyncio.sleep(2)  # a few heartbeats: each notes what was read by then
    agent.send_signal(signal.SIGKILL)
    agent.wait(10)
    (out / "go").touch()
    await asyncio.sleep(2)  # the task speaks while no agent runs
    cluster.agent("crashy", *args)
    record = await wait_final(nc, verdict.job_id, timeout=90)
    assert (record.state, record.attempt) == (JobState.SUCCEEDED, 1), cluster.logs()
    task = (await attempt(nc, record.job_id)).tasks[0]
    assert "said while no agent ran" in task.last_lines and task.last_lines[-1] == "done", task


@pytest.mark.docker
async def test_containers_of_an_agent_that_died_and_stays_away_are_removed(base_image, cluster, nc):  # noqa: F811
    """Defect 11: an agent SIGKILLed (no restart announced) that does not come back within the
    node timeout must not leave its containers running beside the attempt that replaces them."""
    cluster.core()
    agent = cluster.agent("gone", "--runtime", "docker", "--cpus", "1", "--address", "127.0.0.1")
    config = {"jobName": "fenced", "image": base_image, "taskRoles": [role("w", 1, "sleep 600")]}
    _, verdict = await client.submit(nc, json.dumps(config).encode())
    await _wait_state(nc, verdict.job_id, JobState.RUNNING, timeout=60)
    agent.send_signal(signal.SIGKILL)
    agent.wait(10)
    engine = docker.from_env()
    try:
        deadline = time.monotonic() + 30
        while engine.containers.list(
            all=True, filters={"label": f"muster.job={verdict.job_id}"}, ignore_removed=True
        ):
            assert time.monotonic() < deadline, "the dead agent's container still runs"
            await asyncio.sleep(0.5)
    finally:
        engine.close()


@pytest.mark.docker
@pytest.mark.timeout(240)
async def test_a_task_stopped_as_its_agent_restarted_is_told_as_stopped_and_the_drain_holds(
    base_image,
    cluster,
    nc,  # noqa: F811
    monkeypatch,
):
    """`muster drain` sends SIGTERM with a grace; a trainer checkpoints and exits 0. An agent
    restarted within that grace (the operator's next step) adopted the container, and, not
    knowing it had stopped it, told its exit as the task's own: the attempt SUCCEEDED, and the
    job with it, its training cut short. The new agent also took new work at once, the drain
    forgotten. Now the stop is noted on the node before the signal, the end is told as the stop
    (the job waits to run again, uncharged), and the node stays drained."""
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", "60")  # the restart is not a lost node
    cluster.core()
    args = ("--runtime", "docker", "--cpus", "4", "--overcommit", "--address", "127.0.0.1")
    agent = cluster.agent("box", *args)
    trainer = "trap 'sleep 4; echo checkpointed; exit 0' TERM; echo up; while true; do sleep 0.2; done"
    config = {"jobName": "cut", "image": base_image, "taskRoles": [role("main", 1, trainer)]}
    _, verdict = await client.submit(nc, json.dumps(config).encode())
    await _wait_state(nc, verdict.job_id, JobState.RUNNING, timeout=60)
    r = await asyncio.to_thread(cluster.cli, "drain", "box", "--grace", "30")
    assert r.returncode == 0, r.stderr
    await asyncio.sleep(1.5)  # SIGTERM is sent: the trainer checkpoints for 4 s
    agent.send_signal(signal.SIGKILL)
    agent.wait(5)
    cluster.agent("box", *args)
    a = await ended_attempt(nc, verdict.job_id, timeout=60)
    task = a.tasks[0]
    assert task.state == TaskState.STOPPED and task.cause == TaskCause.KILLED, (task, cluster.logs())
    assert "drained" in task.reason and task.exit_code == 0, task
    record = await _wait_state(nc, verdict.job_id, JobState.WAITING, timeout=30)
    assert record.retries == 0, record
    kv = await nc.jetstream().key_value(subjects.NODES_BUCKET)
    assert NodeInfo.from_bytes((await kv.get("box")).value).drained  # still: nothing runs here
    await asyncio.sleep(2)
    assert (await client.ask(nc, "job", {"ref": verdict.job_id}))["job"]["state"] == "WAITING"
