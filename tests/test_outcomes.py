"""Exact task outcomes across agent death (issue 24.5): a task that exits just as its agent is
SIGKILLed is recorded as it ended — exit 0, its job SUCCEEDED in its first attempt — and is
never run again; one that was still running is killed with its agent and recorded as lost (a
platform failure), never as an exit of its own. On the process runtime and on Docker, whether
the agent comes back at once or stays away past the node timeout (then its fence reports).

Each task appends a line to a file of the test's each time it starts, so a second run shows.
The agent is frozen (SIGSTOP) while its tasks exit, so it cannot see them, then SIGKILLed
within milliseconds of the last exit; one case leaves it running and races its own report."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import time
from pathlib import Path

import docker
import pytest

from muster.services.agent import fence, process_runtime
from muster.services.agent.process_runtime import ProcessRuntime, task_pids
from muster.services.agent.reporting import OUTBOX, keep
from muster.services.agent.runtime import (
    LABEL_ATTEMPT,
    LABEL_HOME,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_NODE,
    LABEL_ROLE,
    TaskLaunch,
    note_stop,
    stop_note,
)
from muster.shared import bus, client, subjects
from muster.shared.messages import JobRecord, JobState, TaskCause, TaskEvent, TaskEventKind, TaskState
from tests.test_jobs import attempt, nc, role, wait_final  # noqa: F401 - nc is a fixture

NODE_TIMEOUT = 5.0
# Where the agent comes back at once, the node is not to be found lost first: its new agent's
# start (seconds on a loaded machine, after a freeze that already used some) within the timeout.
BACK_TIMEOUT = 30.0
AGENT = ("--address", "127.0.0.1", "--cpus", "4", "--heartbeat", "0.5")


def _workers_ended(job_id: str) -> bool:
    """No process of the job's workers is alive (a zombie's environment cannot be read)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"MUSTER_JOB_ID={job_id}".encode() in environ and b"MUSTER_TASK_ROLE=w" in environ:
            return False
    return True


def _config(shared: Path, image: str, **extra) -> dict:
    """Two workers that end as soon as the test says so, beside a ps that never ends by
    itself; the job succeeds once both workers have (killAllOnCompletedTaskNumber)."""
    me = "$MUSTER_TASK_ROLE.$MUSTER_TASK_INDEX"
    worker = f"echo {me} >> {shared}/runs; while [ ! -e {shared}/go ]; do sleep 0.01; done; exit 0"
    return {
        "jobName": "exact",
        "image": image,
        "killAllOnCompletedTaskNumber": 2,
        "taskRoles": [role("ps", 1, f"echo {me} >> {shared}/runs; sleep 600"), role("w", 2, worker)],
        **extra,
    }


async def _run(cluster, nc, shared: Path, config: dict, args: tuple, ended, freeze: bool, away: bool):  # noqa: F811
    agent = cluster.agent("n1", *args)
    _, verdict = await client.submit(nc, json.dumps(config).encode())
    assert verdict is not None and verdict.accepted, verdict
    job_id = verdict.job_id
    deadline = time.monotonic() + 90
    while not (shared / "runs").exists() or len((shared / "runs").read_text().split()) < 3:
        assert time.monotonic() < deadline, cluster.logs()
        await asyncio.sleep(0.1)
    if freeze:
        agent.send_signal(signal.SIGSTOP)  # it sees nothing of what follows
    (shared / "go").touch()
    deadline = time.monotonic() + 30
    while not ended(job_id):  # both workers have exited (poll: a few milliseconds)
        assert time.monotonic() < deadline, "the workers never ended"
        await asyncio.sleep(0.005)
    agent.send_signal(signal.SIGKILL)
    agent.wait(10)
    if away:  # past the node timeout: the fence alone can tell, and ps is lost with the node
        record = await wait_final(nc, job_id, timeout=NODE_TIMEOUT + 30)
        await _all_ended(nc, job_id, NODE_TIMEOUT + 30)
        cluster.agent("n1", *args)
    else:
        cluster.agent("n1", *args)
        record = await wait_final(nc, job_id, timeout=60)
    return record


async def _all_ended(nc, job_id: str, timeout: float):  # noqa: F811
    """The job's attempt once every task of it is recorded as ended."""
    deadline = time.monotonic() + timeout
    while True:
        a = await attempt(nc, job_id)
        if all(t.state.ended for t in a.tasks):
            return a
        assert time.monotonic() < deadline, a
        await asyncio.sleep(0.2)


async def _check(nc, record: JobRecord, shared: Path, cluster, away: bool) -> None:  # noqa: F811
    """SUCCEEDED in its first attempt, its workers recorded as exited 0, and nothing run twice."""
    a = await _all_ended(nc, record.job_id, 30)  # the job ends with its workers; ps is stopped after
    assert (record.state, record.attempt, record.platform_retries) == (JobState.SUCCEEDED, 1, 0), (
        record,
        cluster.logs(),
    )
    for i in (0, 1):
        w = a.task("w", i)
        assert (w.state, w.cause, w.exit_code) == (TaskState.SUCCEEDED, TaskCause.EXITED, 0), w
    # Killed with its agent (process; Docker when no agent came back) or by the kill order the
    # job's end sent (an agent came back and adopted it): never an exit of its own (137). Away
    # past the node timeout, it is declared lost with its node before any agent comes back.
    ps = a.task("ps", 0)
    assert ps.cause in ((TaskCause.NODE_LOST,) if away else (TaskCause.PLATFORM, TaskCause.KILLED)), ps
    runs = sorted((shared / "runs").read_text().split())
    assert runs == ["ps.0", "w.0", "w.1"], f"a task ran again: {runs}"


@pytest.mark.parametrize(
    ("freeze", "away"),
    [(True, False), (True, True), (False, False)],
    ids=["back-at-once", "away-past-node-timeout", "racing-its-report"],
)
async def test_process_tasks_that_exit_as_their_agent_is_killed_are_not_run_again(
    cluster,
    nc,  # noqa: F811
    tmp_path,
    monkeypatch,
    freeze,
    away,
):
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", str(NODE_TIMEOUT if away else BACK_TIMEOUT))
    cluster.core()
    shared = tmp_path / "shared"
    shared.mkdir()
    config = _config(shared, "img")
    record = await _run(cluster, nc, shared, config, AGENT, _workers_ended, freeze, away)
    await _check(nc, record, shared, cluster, away)


async def test_a_task_printing_as_its_agent_dies_is_lost_not_failed(cluster, nc, tmp_path, monkeypatch):  # noqa: F811
    """The agent's death must not end a task in a way taken for its own: one printing without
    pause (its output read by the agent) is killed with its agent and retried as a platform
    failure, not ended by a broken pipe and charged as a failure of its own (retryCount 0)."""
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", str(BACK_TIMEOUT))
    cluster.core()
    agent = cluster.agent("n1", *AGENT)
    runs = tmp_path / "runs"
    command = f"echo $MUSTER_ATTEMPT >> {runs}; test $MUSTER_ATTEMPT -gt 1 || while :; do echo tick; done"
    config = {"jobName": "chatty", "image": "img", "retryCount": 0, "taskRoles": [role("w", 1, command)]}
    _, verdict = await client.submit(nc, json.dumps(config).encode())
    assert verdict is not None and verdict.accepted, verdict
    deadline = time.monotonic() + 60
    while not runs.exists():
        assert time.monotonic() < deadline, cluster.logs()
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # printing away
    agent.send_signal(signal.SIGKILL)
    agent.wait(10)
    cluster.agent("n1", *AGENT)
    record = await wait_final(nc, verdict.job_id, timeout=60)
    expected = (JobState.SUCCEEDED, 2, 0)
    assert (record.state, record.attempt, record.retries) == expected, (record, cluster.logs())
    lost = (await attempt(nc, record.job_id, 1)).task("w", 0)
    assert lost.cause == TaskCause.PLATFORM, lost


@pytest.mark.docker
@pytest.mark.timeout(240)
@pytest.mark.parametrize("away", [False, True], ids=["back-at-once", "away-past-node-timeout"])
async def test_docker_tasks_that_exit_as_their_agent_is_killed_are_not_run_again(
    base_image,
    cluster,
    nc,  # noqa: F811
    tmp_path,
    monkeypatch,
    away,
):
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", str(NODE_TIMEOUT if away else BACK_TIMEOUT))
    cluster.core()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # tasks run as a non-root user
    config = _config(shared, base_image, outputDir=str(shared))  # mounted where it is

    def ended(job_id: str) -> bool:  # the workers' containers have exited; ps still runs
        engine = docker.from_env()
        try:
            found = engine.containers.list(
                all=True, filters={"label": f"muster.job={job_id}"}, ignore_removed=True
            )
            workers = [c for c in found if c.labels.get("muster.role") == "w"]
            return len(workers) == 2 and all(c.status == "exited" for c in workers)
        finally:
            engine.close()

    args = ("--runtime", "docker", "--overcommit", *AGENT)
    record = await _run(cluster, nc, shared, config, args, ended, True, away)
    await _check(nc, record, shared, cluster, away)


@pytest.mark.docker
@pytest.mark.timeout(240)
async def test_docker_tasks_that_exit_while_their_dead_agents_fence_waits_are_reported_as_they_exit(
    base_image,
    cluster,
    nc,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """The agent is SIGKILLed while its workers run, and they exit 2.5 s later, while its fence
    waits for a new agent (0.6 of the node timeout) before it removes the containers; no agent
    comes back before the node is declared lost. Each exit is on the bus while the fence still
    waits (the ps container not yet removed), not after the wait: on main the fence told them
    only once it had removed the containers, which under load came after the node was declared
    lost, and the runs were recorded as lost with the node (tests/test_chaos.py, Docker)."""
    timeout = 20.0  # the fence waits 12 s: room for its looks on a loaded engine after the exits at 2.5 s
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", str(timeout))
    cluster.core()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # tasks run as a non-root user
    args = ("--runtime", "docker", "--overcommit", *AGENT)
    agent = cluster.agent("n1", *args)
    _, verdict = await client.submit(
        nc, json.dumps(_config(shared, base_image, outputDir=str(shared))).encode()
    )
    assert verdict is not None and verdict.accepted, verdict
    job_id = verdict.job_id
    exits: list[str] = []
    both = asyncio.Event()

    async def on_exit(msg) -> None:
        event = TaskEvent.from_bytes(msg.data)
        if event.job_id == job_id and event.role == "w":
            exits.append(f"w.{event.index}")
            if len(set(exits)) == 2:
                both.set()

    await nc.subscribe(subjects.task_event(job_id, "*", "*", "*", "exited", "*"), cb=on_exit)
    deadline = time.monotonic() + 90
    while not (shared / "runs").exists() or len((shared / "runs").read_text().split()) < 3:
        assert time.monotonic() < deadline, cluster.logs()
        await asyncio.sleep(0.1)
    agent.send_signal(signal.SIGKILL)
    agent.wait(10)
    # The workers exit once the fence has had its first look (it starts in well under a second
    # when the machine is not loaded; if it took longer, it would find them ended in that look,
    # and the test would show less, never fail) and long before its wait is over.
    await asyncio.sleep(2.5)
    (shared / "go").touch()
    await asyncio.wait_for(both.wait(), 60)

    def ps_left() -> list[str]:
        engine = docker.from_env()
        try:
            found = engine.containers.list(
                all=True, filters={"label": f"muster.job={job_id}"}, ignore_removed=True
            )
            return [c.name for c in found if c.labels.get("muster.role") == "ps"]
        finally:
            engine.close()

    assert await asyncio.to_thread(ps_left), "the exits were told only after the fence removed the containers"
    record = await wait_final(nc, job_id, timeout=timeout + 30)
    await _all_ended(nc, job_id, timeout + 30)
    cluster.agent("n1", *args)
    await _check(nc, record, shared, cluster, away=True)


# ------------------------------------------------------------------ the pieces, one by one


def _launch(name: str, command: str, node: str = "n1") -> TaskLaunch:
    job, attempt, role_name, index = name.split("-")[1:]
    labels = {
        LABEL_JOB: job,
        LABEL_ATTEMPT: attempt,
        LABEL_ROLE: role_name,
        LABEL_INDEX: index,
        LABEL_NODE: node,
    }
    return TaskLaunch(name=name, image="img", command=command, env={}, cpus=1, memory_mb=64, labels=labels)


async def test_a_process_task_records_its_own_exit_and_a_stop_is_never_taken_for_one(tmp_path):
    """The shell a task runs under writes its exit code before it exits (so before its agent
    can see the exit); a task stopped by its agent is recorded as killed first; what the task
    prints is its own (no word of the shell's)."""
    runtime = ProcessRuntime(tmp_path / "tasks")
    lines: list[str] = []
    done = await runtime.start(_launch("muster-j1-1-w-0", "echo hi; exit 3"), lines.append)
    assert await done.wait() == 3
    stopped = await runtime.start(_launch("muster-j1-1-w-1", "sleep 60"), lines.append)
    await asyncio.sleep(0.2)
    await stopped.stop(5)
    assert await stopped.wait() == 143
    found = {f.name: f for f in await runtime.find({LABEL_JOB: "j1"})}
    assert found["muster-j1-1-w-0"].exit_code == 3 and found["muster-j1-1-w-0"].ended_at is not None
    assert found["muster-j1-1-w-1"].exit_code is None  # stopped: not an exit of its own
    assert lines == ["hi"]
    await done.remove()  # reported: forgotten
    assert [f.name for f in await runtime.find({LABEL_JOB: "j1"})] == ["muster-j1-1-w-1"]
    assert await runtime.reap(found["muster-j1-1-w-1"]) is None


async def test_a_process_task_is_stopped_and_settled_on_a_full_disk(tmp_path, monkeypatch):
    """A full disk: the kill cannot be recorded in the task's exit file. The stop sent no signal
    (the claim raised first) and failed again at every later stop; a dead agent's fence, which
    settles every task the same way, killed none. Now both kill it all the same."""
    runtime = ProcessRuntime(tmp_path / "tasks")
    stopped = await runtime.start(_launch("muster-j4-1-w-0", "sleep 600"), lambda _: None)
    settled = await runtime.start(_launch("muster-j4-1-w-1", "sleep 600"), lambda _: None)

    def full(path: Path, text: str) -> bool:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(process_runtime, "claim", full)  # no test can fill a disk on demand
    try:
        await asyncio.wait_for(stopped.stop(1), 15)
        assert await asyncio.wait_for(stopped.wait(), 5) in (143, 137)
        assert process_runtime.settle(tmp_path / "tasks" / "muster-j4-1-w-1.json") is None
        assert await asyncio.wait_for(settled.wait(), 15) == 137
        assert not task_pids("muster-j4-1-w-0") and not task_pids("muster-j4-1-w-1")
    finally:
        process_runtime.kill_task("muster-j4-1-w-0")
        process_runtime.kill_task("muster-j4-1-w-1")


async def test_a_process_task_ends_with_its_main_process_whatever_it_left_running(tmp_path):
    """A command that leaves a child in the background (`server &`) ended, but the child held
    its output pipe open: the task was never reported ended, and a stop found nothing left to
    stop. It ends with its main process, as a container does, its output delivered first."""
    runtime = ProcessRuntime(tmp_path / "tasks")
    lines: list[str] = []
    task = await runtime.start(
        _launch("muster-j3-1-w-0", "echo hi; sleep 600 & echo bye; exit 0"), lines.append
    )
    assert await asyncio.wait_for(task.wait(), 15) == 0
    assert lines == ["hi", "bye"]
    deadline = time.monotonic() + 10
    while task_pids("muster-j3-1-w-0"):  # the sleep was killed with it
        assert time.monotonic() < deadline, task_pids("muster-j3-1-w-0")
        await asyncio.sleep(0.05)


async def test_the_fence_of_a_dead_agent_reports_what_ended_and_kills_what_runs(tmp_path, nats_url):
    """The agent (here, this test) dies having seen nothing: one task had ended by itself,
    one still runs, and a report waits in its outbox. Its fence kills the running one (recorded
    as killed, left for the next agent to report lost) and sends, as the agent, the end of the
    one that ended with its own exit code and the report the agent left."""
    conn = await bus.connect("test", nats_url)
    try:
        await bus.ensure_jetstream(conn)
        home, state = tmp_path / "work", tmp_path / "work" / "tasks"
        runtime = ProcessRuntime(state)
        await runtime.start(_launch("muster-j2-1-w-0", "exit 0"), lambda _: None)
        await runtime.start(_launch("muster-j2-1-ps-0", "sleep 600"), lambda _: None)
        left = TaskEvent(
            job_id="j2", attempt=1, role="w", index=1, node="n1", kind=TaskEventKind.EXITED, exit_code=5
        )
        (home / OUTBOX).mkdir()
        keep(home / OUTBOX, left)
        deadline = time.monotonic() + 10
        while not (state / "muster-j2-1-w-0.exit").exists():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        runtime.start_fence(str(home), "", 0, bus_url=nats_url)
        await runtime.close()  # the pipe closes without a word: the agent died

        async def told(task: str):
            role_name, index = task.split(".")
            try:
                msg = await conn.jetstream().get_last_msg(
                    subjects.EVENTS_STREAM,
                    subjects.task_event("j2", 1, role_name, int(index), "exited", "n1"),
                    direct=True,
                )
            except Exception:
                return None
            return TaskEvent.from_bytes(msg.data)

        deadline = time.monotonic() + 30
        while (await told("w.0")) is None or (await told("w.1")) is None:
            assert time.monotonic() < deadline, "the fence never reported"
            await asyncio.sleep(0.1)
        ended = await told("w.0")
        assert (ended.cause, ended.exit_code) == (TaskCause.EXITED, 0), ended
        assert (await told("w.1")).exit_code == 5
        assert await told("ps.0") is None  # killed: the next agent reports it lost
        assert not task_pids("muster-j2-1-ps-0")
        assert (state / "muster-j2-1-ps-0.exit").read_text().strip() == "killed"
        deadline = time.monotonic() + 10
        while (state / "muster-j2-1-w-0.json").exists():  # told: nothing left to say of it
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert not list((home / OUTBOX).glob("*.json"))
    finally:
        await conn.close()


class _Restarting:
    """The way to a Docker engine that is being restarted (the fence's seam to the engine): the
    first connection fails, then the first two listings, then each container's first removal;
    everything else is the real engine's."""

    def __init__(self) -> None:
        self.connects, self.lists, self.removals = 0, 0, set()
        self.clients: list[docker.DockerClient] = []

    def __call__(self) -> _Restarting:
        self.connects += 1
        if self.connects == 1:
            raise docker.errors.DockerException("Error while fetching server API version: connection refused")
        self.clients.append(docker.from_env())
        return self

    @property
    def containers(self) -> _Restarting:
        return self

    def list(self, **kw: object) -> list[object]:
        self.lists += 1
        if self.lists <= 2:
            raise docker.errors.APIError("500 Server Error: engine restarting")
        return [_RemovedOnSecondTry(c, self.removals) for c in self.clients[-1].containers.list(**kw)]

    def close(self) -> None:
        self.clients[-1].close()


class _RemovedOnSecondTry:
    def __init__(self, real: object, failed: set[str]) -> None:
        self._real, self._failed = real, failed

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)

    def remove(self, **kw: object) -> None:
        if self._real.name not in self._failed:
            self._failed.add(self._real.name)
            raise docker.errors.APIError("500 Server Error: engine restarting")
        self._real.remove(**kw)


def _task_labels(home: str, job_id: str, index: int = 0) -> dict[str, str]:
    """The labels of attempt 1's task w.<index> of `job_id` on node n1, an agent of work root `home`."""
    return {
        LABEL_HOME: home, LABEL_JOB: job_id, LABEL_ATTEMPT: "1", LABEL_ROLE: "w", LABEL_INDEX: str(index),
        LABEL_NODE: "n1",
    }  # fmt: skip


@pytest.mark.docker
@pytest.mark.timeout(120)
async def test_the_docker_fence_outlasts_an_engine_that_fails_its_looks(base_image, tmp_path, capsys):
    """The dead agent's container still runs; the engine fails the fence's first connection,
    its first two looks and the container's first removal. The fence looks again each time
    (each failure logged) and removes the container. The container it killed, still there at
    the second try with SIGKILL's exit code, is not reported as a task that exited by itself.
    On main the fence ended at the first error and the task ran on beside whatever came next."""
    home = str(tmp_path / "work")
    labels = _task_labels(home, "jf")
    engine = docker.from_env()
    name = f"muster-test-fence-{os.getpid()}-{time.monotonic_ns()}"
    container = engine.containers.run(base_image, ["sleep", "600"], detach=True, name=name, labels=labels)
    try:
        await asyncio.sleep(0.05)
        restarting = _Restarting()
        died, nobody = time.time(), tmp_path / "no-agent.pid"
        fenced = asyncio.to_thread(fence._fence_docker, home, nobody, 1.0, 999_999_999, died, 2.0, restarting)
        await asyncio.wait_for(fenced, 60)
        with pytest.raises(docker.errors.NotFound):
            engine.containers.get(container.id)
        said = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
        assert [s["event"] for s in said].count("fence.look_failed") == 4, said
        assert said[-1]["event"] == "fence.removed_containers" and said[-1]["reported"] == 0, said
        assert not list((Path(home) / OUTBOX).glob("*.json")), "the container it killed was told as an exit"
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
        engine.close()


@pytest.mark.docker
@pytest.mark.timeout(120)
async def test_the_docker_fence_tells_a_container_its_agent_was_stopping_as_stopped(base_image, tmp_path):
    """The agent noted a stop (a drain, a preemption's kill) and sent SIGTERM, then died; the
    container checkpointed and exited 0. The fence told that exit as the task's own, and the
    supervisor took it for a success. Now the fence reads the agent's note: the end is the stop
    it was. A container with no note is still told as its own exit."""
    home = tmp_path / "work"
    (home / "jn").mkdir(parents=True)
    labels = _task_labels(str(home), "jn")
    note = stop_note(home, "jn", 1, "w", 0)
    assert note_stop(note, TaskCause.KILLED, "killed: node n1 drained by root")
    engine = docker.from_env()
    name = f"muster-test-noted-{os.getpid()}-{time.monotonic_ns()}"
    container = engine.containers.run(base_image, ["true"], detach=True, name=name, labels=labels)
    try:
        container.wait(timeout=60)
        told = fence._exited_containers(engine, str(home), time.time() + 1)[name]
        assert (told.cause, told.exit_code) == (TaskCause.KILLED, 0), told
        assert told.reason.startswith("killed: node n1 drained by root"), told.reason
        note.unlink()
        told = fence._exited_containers(engine, str(home), time.time() + 1)[name]
        assert (told.cause, told.exit_code) == (TaskCause.EXITED, 0), told
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
        engine.close()


@pytest.mark.docker
@pytest.mark.timeout(120)
async def test_the_docker_fence_leaves_what_is_left_to_an_agent_that_came_during_its_sweep(
    base_image, tmp_path
):
    """The fence asked whether a new agent had come once, then killed the dead agent's
    containers one after another: one the new agent was adopting meanwhile was killed under it.
    Now it asks before each kill and leaves the rest to the new agent."""
    home = tmp_path / "work"
    engine = docker.from_env()
    names, containers = [], []
    try:
        for i in range(2):
            labels = _task_labels(str(home), "jc", i)
            name = f"muster-test-sweep-{os.getpid()}-{time.monotonic_ns()}"
            containers.append(
                engine.containers.run(base_image, ["sleep", "600"], detach=True, name=name, labels=labels)
            )
            names.append(name)
        asked = []

        def came() -> bool:  # a new agent comes once the first container is dealt with
            asked.append(True)
            return len(asked) > 1

        await asyncio.to_thread(
            fence._remove_containers, engine, str(home), time.time() + 1, set(), set(), came
        )
        left = [c.name for c in engine.containers.list(all=True, filters={"label": f"muster.home={home}"})]
        assert len(left) == 1 and engine.containers.get(left[0]).status == "running", left
    finally:
        for c in containers:
            with contextlib.suppress(docker.errors.NotFound):
                c.remove(force=True)
        engine.close()
