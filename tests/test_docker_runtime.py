"""The Docker runtime against the real engine: output, exit codes, env, host networking (and
another container's network namespace: --docker-network container:NAME), limits,
mounts, labels, stop, pull failures and leftovers. Uses the local base image built by
deploy/build-base-image.sh (nothing can be pulled here)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from muster.services.agent.config import make_runtime
from muster.services.agent.docker_runtime import GONE_EXIT_CODE, DockerRuntime, DockerTask, missed
from muster.services.agent.runtime import (
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_ROLE,
    LaunchError,
    Mount,
    RegistryAuth,
    TaskLaunch,
)
from muster.services.agent.service import AgentOptions, check_declaration
from muster.shared.messages import TaskCause
from muster.shared.natsserver import free_port

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = uuid.uuid4().hex[:8]
TEST_LABEL = "muster.test-run"
MiB = 1024 * 1024


@pytest.fixture
async def runtime(base_image: str) -> AsyncIterator[DockerRuntime]:
    rt = DockerRuntime()
    yield rt
    await rt.close()


@pytest.fixture
def engine() -> Iterator[docker.DockerClient]:
    client = docker.from_env()
    yield client
    client.close()


@pytest.fixture
def launch(base_image: str, engine: docker.DockerClient) -> Iterator[Callable[..., TaskLaunch]]:
    """Makes TaskLaunches with unique names; removes their containers after the test."""
    names: list[str] = []

    def make(command: str, **kw: object) -> TaskLaunch:
        name = kw.pop("name", None) or f"muster-test-{RUN_ID}-{uuid.uuid4().hex[:8]}"
        names.append(str(name))
        labels = {TEST_LABEL: RUN_ID, **kw.pop("labels", {})}  # type: ignore[dict-item]
        defaults: dict = {"image": base_image, "env": {}, "cpus": 1, "memory_mb": 256}
        return TaskLaunch(name=str(name), command=command, labels=labels, **{**defaults, **kw})

    yield make
    for name in names:
        with contextlib.suppress(docker.errors.NotFound):
            engine.api.remove_container(name, force=True)


async def run_to_end(runtime: DockerRuntime, launch: TaskLaunch) -> tuple[list[str], int]:
    lines: list[str] = []
    task = await runtime.start(launch, lines.append)
    code = await asyncio.wait_for(task.wait(), 30)
    return lines, code


async def wait_for_line(lines: list[str], wanted: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while wanted not in lines:
        assert time.monotonic() < deadline, f"{wanted!r} never came; got {lines}"
        await asyncio.sleep(0.02)


async def test_output_lines_in_order_and_exit_code(runtime: DockerRuntime, launch: Callable) -> None:
    threads: set[int] = set()
    lines: list[str] = []

    def sink(line: str) -> None:
        threads.add(threading.get_ident())
        lines.append(line)

    task = await runtime.start(launch("echo a; echo b >&2; echo c; printf 'no newline'; exit 3"), sink)
    assert await asyncio.wait_for(task.wait(), 30) == 3
    assert lines == ["a", "b", "c", "no newline"]
    assert threads == {threading.get_ident()}, "lines must be delivered on the event loop's thread"
    assert await task.wait() == 3  # a second wait gives the same code


async def test_env_and_shell_expansion(runtime: DockerRuntime, launch: Callable) -> None:
    env = {"GREETING": "hello", "WHO": "muster workers"}
    lines, code = await run_to_end(runtime, launch('echo "$GREETING, $WHO"; test -z "$UNSET_VAR"', env=env))
    assert (lines, code) == (["hello, muster workers"], 0)


async def test_host_network(runtime: DockerRuntime, launch: Callable) -> None:
    port = free_port()
    lines: list[str] = []
    task = await runtime.start(launch(f"exec python3 -m http.server {port} --bind 127.0.0.1"), lines.append)
    assert (await served(f"http://127.0.0.1:{port}/", lines)).status_code == 200
    await task.stop(grace=0)


async def served(url: str, lines: list[str], within: float = 15) -> httpx.Response:
    """The first answer from `url`, which a task is starting to serve (its output in `lines`)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return httpx.get(url, timeout=1)
        except httpx.TransportError:
            assert time.monotonic() < deadline, f"task never listened at {url}; output {lines}"
            await asyncio.sleep(0.1)


async def test_tasks_run_in_another_containers_network_namespace(
    base_image: str, launch: Callable, engine: docker.DockerClient, tmp_path: Path
) -> None:
    """--docker-network container:HOLDER: a task listens at the holder's address (its ports are
    the holder's, not the host's), the runtime tells that address, and the agent is told not to
    probe free ports in its own namespace, which is not the tasks'."""
    holder = engine.containers.run(
        base_image,
        ["sleep", "infinity"],
        detach=True,
        name=f"muster-test-{RUN_ID}-holder",
        labels={TEST_LABEL: RUN_ID},
    )
    rt = DockerRuntime(network=f"container:{holder.name}")
    try:
        holder.reload()
        address = holder.attrs["NetworkSettings"]["Networks"]["bridge"]["IPAddress"]
        assert rt.network_addresses() == [address] and not rt.tasks_in_agent_network
        on_host = DockerRuntime()
        assert on_host.tasks_in_agent_network and on_host.network_addresses() == []
        await on_host.close()
        port = free_port()
        lines: list[str] = []
        task = await rt.start(launch(f"exec python3 -m http.server {port} --bind 0.0.0.0"), lines.append)
        assert (await served(f"http://{address}:{port}/", lines)).status_code == 200
        with pytest.raises(httpx.TransportError):  # not on the host's network
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
        await task.stop(grace=0)
    finally:
        await rt.close()
        holder.remove(force=True)


def test_a_network_tasks_could_not_be_reached_in_is_refused(base_image: str, tmp_path: Path) -> None:
    for bad in ("bridge", "none", "my-net", "container:"):
        with pytest.raises(ValueError, match="use host, or container:NAME"):
            DockerRuntime(network=bad)
    with pytest.raises(SystemExit, match=r"--docker-network container:no-such-holder-\w+: no container"):
        make_runtime(
            "docker", str(tmp_path), network=f"container:no-such-holder-{RUN_ID}", address="10.9.0.2"
        )


async def test_memory_limit_in_cgroup(runtime: DockerRuntime, launch: Callable) -> None:
    read = "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes"
    lines, code = await run_to_end(runtime, launch(read, memory_mb=96))
    assert (lines, code) == ([str(96 * MiB)], 0)


async def test_memory_beyond_limit_is_oom_killed(runtime: DockerRuntime, launch: Callable) -> None:
    hog = "python3 -c \"x = b'x' * (256 << 20); print('survived')\""
    lines: list[str] = []
    task = await runtime.start(launch(hog, memory_mb=64), lines.append)
    assert await asyncio.wait_for(task.wait(), 30) == 137
    assert "survived" not in lines
    assert task.oom_killed  # reported as "out of memory": a user failure, not the platform's
    sleeper = await runtime.start(launch("sleep 60"), lines.append)
    await sleeper.stop(0)
    assert await sleeper.wait() == 137 and not sleeper.oom_killed


async def test_cpu_limit(runtime: DockerRuntime, launch: Callable, engine: docker.DockerClient) -> None:
    read = "cat /sys/fs/cgroup/cpu.max 2>/dev/null || cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us"
    task_launch = launch(read, cpus=2)
    lines, code = await run_to_end(runtime, task_launch)
    assert code == 0
    assert lines[0].split()[0] == "200000"  # 2 CPUs of a 100 ms period
    assert engine.containers.get(task_launch.name).attrs["HostConfig"]["NanoCpus"] == 2_000_000_000


async def test_shm_size(runtime: DockerRuntime, launch: Callable, engine: docker.DockerClient) -> None:
    lines, code = await run_to_end(runtime, launch("df -k /dev/shm | tail -n 1", shm_mb=128))
    assert code == 0
    assert lines[0].split()[1] == str(128 * 1024)  # 1K-blocks
    default = launch("true")
    await run_to_end(runtime, default)
    assert engine.containers.get(default.name).attrs["HostConfig"]["ShmSize"] == 64 * MiB


async def test_bind_mounts_and_workdir(runtime: DockerRuntime, launch: Callable, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "data.txt").write_text("input data\n")
    out = tmp_path / "out" / "nested"  # missing: the runtime creates writable mount points
    mounts = [Mount(str(tmp_path / "in"), "/data", read_only=True), Mount(str(out), "/out")]
    command = (
        "pwd; cat /data/data.txt; echo result > result.txt; "
        "if echo x > /data/new.txt; then echo WROTE; else echo READ-ONLY; fi"
    )
    lines, code = await run_to_end(runtime, launch(command, mounts=mounts, workdir="/out"))
    assert code == 0
    assert lines[:2] == ["/out", "input data"]
    assert lines[-1] == "READ-ONLY"
    assert (out / "result.txt").read_text() == "result\n"
    assert not (tmp_path / "in" / "new.txt").exists()


async def test_labels_and_find(runtime: DockerRuntime, launch: Callable, engine: docker.DockerClient) -> None:
    job = f"job-{uuid.uuid4().hex[:8]}"
    labels = {LABEL_JOB: job, LABEL_ROLE: "worker", LABEL_INDEX: "0"}
    done = launch("exit 5", labels=labels)
    await run_to_end(runtime, done)
    running = launch("sleep 600", labels={**labels, LABEL_INDEX: "1"})
    task = await runtime.start(running, lambda _: None)

    assert engine.containers.get(done.name).labels[LABEL_JOB] == job
    found = {f.name: f for f in await runtime.find({LABEL_JOB: job})}
    assert set(found) == {done.name, running.name}
    assert (found[done.name].running, found[done.name].exit_code) == (False, 5)
    assert (found[running.name].running, found[running.name].exit_code) == (True, None)
    assert found[running.name].labels[LABEL_INDEX] == "1"
    assert [f.name for f in await runtime.find({LABEL_JOB: job, LABEL_INDEX: "0"})] == [done.name]
    assert await runtime.find({LABEL_JOB: "no-such-job-" + RUN_ID}) == []
    await task.stop(grace=0)


async def test_stop_kills_after_grace_and_is_idempotent(runtime: DockerRuntime, launch: Callable) -> None:
    task = await runtime.start(launch("sleep 600"), lambda _: None)
    t0 = time.monotonic()
    await asyncio.wait_for(task.stop(grace=1), 15)
    assert time.monotonic() - t0 < 1 + 4
    assert await task.wait() in (137, 143)
    await task.stop(grace=1)  # again: nothing happens
    await task.remove()
    await task.remove()
    await task.stop(grace=1)  # the container is gone: still fine


async def test_a_container_removed_under_its_task_ends_it(
    runtime: DockerRuntime, launch: Callable, engine: docker.DockerClient
) -> None:
    """`docker rm -f` of a running task's container: the task ends, with the exit code of a
    vanished container, and a stop of it returns. Docker's NotFound is also a requests error,
    which the wait took for a slice that timed out: it asked again every second for ever, the
    task was never reported ended and its GPUs stayed held. It is said to have vanished, so the
    agent tells it as the platform's failure, not as a task that exited 137 (charged)."""
    task = await runtime.start(launch("sleep 600"), lambda _: None)
    assert not task.vanished
    engine.api.remove_container(task.name, force=True)
    assert await asyncio.wait_for(task.wait(), 30) == GONE_EXIT_CODE
    assert task.vanished
    await asyncio.wait_for(task.stop(1), 30)


async def test_stop_lets_a_trapping_task_exit_gracefully(runtime: DockerRuntime, launch: Callable) -> None:
    lines: list[str] = []
    command = "trap 'echo graceful shutdown; exit 7' TERM; echo ready; sleep 600 & wait"
    task = await runtime.start(launch(command), lines.append)
    await wait_for_line(lines, "ready")
    t0 = time.monotonic()
    await asyncio.wait_for(task.stop(grace=20), 15)
    assert time.monotonic() - t0 < 5, "the task handled TERM; stop must not wait for the grace period"
    assert await task.wait() == 7
    assert lines == ["ready", "graceful shutdown"]


async def test_stop_tells_the_commands_own_processes_not_only_pid_1(
    runtime: DockerRuntime, launch: Callable
) -> None:
    """The command runs under `/bin/sh -c` as PID 1, which ignores SIGTERM: the engine's stop
    alone would leave the program itself running through the grace (a preempted task never told
    to stop, or finishing meanwhile and running again in its next attempt). Its processes get
    SIGTERM from inside the container, so a program that stops on it ends at once."""
    lines: list[str] = []
    child = "trap 'echo child got TERM; exit 0' TERM; echo ready; while true; do sleep 0.2; done"
    task = await runtime.start(launch(f'sh -c "{child}"; echo after $?'), lines.append)
    await wait_for_line(lines, "ready")
    t0 = time.monotonic()
    await asyncio.wait_for(task.stop(grace=30), 25)
    assert time.monotonic() - t0 < 10, "the program was not told to stop: the stop waited for the grace"
    assert "child got TERM" in lines, lines


async def test_pull_failure_names_image_not_password(
    runtime: DockerRuntime, launch: Callable, capsys: pytest.CaptureFixture[str]
) -> None:
    password = "s3cr3t-PASSWORD-do-not-leak-4711"
    image = f"127.0.0.1:9/muster-test/missing-{RUN_ID}:v1"  # no registry listens there
    auth = RegistryAuth(server="127.0.0.1:9", username="robot", password=password)
    with pytest.raises(LaunchError) as info:
        await runtime.start(launch("true", image=image, auth=auth), lambda _: None)
    err = info.value
    assert image in str(err)
    assert password not in str(err)
    assert password not in repr(err)
    assert err.__cause__ is None and err.__context__ is None  # no engine response (auth header) chained
    captured = capsys.readouterr()
    assert password not in captured.out + captured.err


async def test_missing_read_only_mount_raises_launch_error(runtime: DockerRuntime, launch: Callable) -> None:
    missing = Mount("/nonexistent/muster-test-" + RUN_ID, "/data", read_only=True)
    with pytest.raises(LaunchError, match=r"cannot (create|start) container") as info:
        await runtime.start(launch("true", mounts=[missing]), lambda _: None)
    assert info.value.cause == TaskCause.CONFIG  # it would fail on any node: not retried


@pytest.mark.parametrize(
    "change",
    [
        {"mounts": [Mount("relative/path", "/data")]},  # "mount path must be absolute"
        {"image": "Not A Valid:Reference"},  # "invalid reference format"
    ],
    ids=["relative-mount", "bad-image-reference"],
)
async def test_failures_that_would_recur_anywhere_are_configuration_errors(
    runtime: DockerRuntime, launch: Callable, change: dict
) -> None:
    with pytest.raises(LaunchError) as info:
        await runtime.start(launch("true", **change), lambda _: None)
    assert info.value.cause == TaskCause.CONFIG, info.value


async def test_a_declaration_above_the_engine_is_refused_unless_overcommitted(
    runtime: DockerRuntime, launch: Callable
) -> None:
    capacity = await runtime.capacity()
    assert capacity is not None
    cpus, memory_mb = capacity
    options = AgentOptions(node="n", address="127.0.0.1", cpus=cpus + 1, memory_mb=memory_mb, gpus=[])
    with pytest.raises(SystemExit, match=rf"--cpus {cpus + 1} is more than the {cpus} CPUs"):
        await check_declaration(options, runtime)
    options.overcommit = True
    await check_declaration(options, runtime)
    kwargs = DockerRuntime._create_kwargs(launch("true", cpus=cpus + 1), runtime.cpu_cap)
    assert kwargs["nano_cpus"] == cpus * 10**9  # a task gets at most every CPU the engine has


async def test_leftover_container_with_same_name_is_replaced(
    runtime: DockerRuntime, launch: Callable, engine: docker.DockerClient, base_image: str
) -> None:
    task_launch = launch("echo fresh")
    engine.containers.run(
        base_image, ["sleep", "600"], name=task_launch.name, detach=True
    )  # a crash leftover
    lines, code = await run_to_end(runtime, task_launch)
    assert (lines, code) == (["fresh"], 0)


async def test_attach_to_a_running_container(runtime: DockerRuntime, launch: Callable) -> None:
    first: list[str] = []
    task_launch = launch("echo before; sleep 1; echo after; sleep 600")
    await runtime.start(task_launch, first.append)
    await wait_for_line(first, "before")
    other = DockerRuntime()  # as a restarted agent would
    lines: list[str] = []
    task: DockerTask = await other.attach(task_launch.name, lines.append)
    await wait_for_line(lines, "after")
    assert lines == ["after"]  # only what was written after attaching
    await task.stop(grace=0)
    assert await task.wait() == 137
    await other.close()
    with pytest.raises(LaunchError, match="no container"):
        await runtime.attach("muster-test-no-such-" + RUN_ID)


class _FollowEndsAtOnce:
    """A container whose engine ends every follow stream before any output is in it (the
    engine's race, seen under load); everything else is the real container."""

    def __init__(self, container: Any) -> None:
        self._container = container
        self.name = container.name

    def logs(self, **kwargs: Any) -> Any:
        return iter(()) if kwargs.get("follow") else self._container.logs(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._container, name)


async def test_an_adopted_task_whose_follow_stream_ended_early_still_gets_what_it_wrote_since(
    runtime: DockerRuntime, launch: Callable, engine: docker.DockerClient
) -> None:
    """A restarted agent adopts a task from `since` (what the agent before had read); when the
    engine ends the follow stream before the output is in it, the lines written since are read
    from the log once the container ends, and none from before `since`."""
    first: list[str] = []
    task_launch = launch("echo before; sleep 1.5; echo after; echo last")
    await runtime.start(task_launch, first.append)
    await wait_for_line(first, "before")
    since = time.time()
    container = engine.containers.get(task_launch.name)
    container.wait(timeout=60)
    lines: list[str] = []
    loop = asyncio.get_running_loop()
    task = DockerTask(_FollowEndsAtOnce(container), lines.append, loop, since=since)  # type: ignore[arg-type]
    await asyncio.wait_for(asyncio.shield(task._logs_done), 30)
    assert lines == ["after", "last"]


def test_gpu_request_and_visible_devices() -> None:
    kw = DockerRuntime._create_kwargs(
        TaskLaunch(name="t", image="i", command="true", env={}, cpus=1, memory_mb=1, gpus=[2, 3])
    )
    (request,) = kw["device_requests"]
    assert request["DeviceIDs"] == ["2", "3"] and request["Capabilities"] == [["gpu"]]
    assert kw["environment"]["NVIDIA_VISIBLE_DEVICES"] == "2,3"
    assert kw["environment"]["CUDA_VISIBLE_DEVICES"] == "0,1"  # the container sees its GPUs from 0
    no_gpu = DockerRuntime._create_kwargs(
        TaskLaunch(name="t", image="i", command="true", env={}, cpus=1, memory_mb=1)
    )
    assert "device_requests" not in no_gpu and "CUDA_VISIBLE_DEVICES" not in no_gpu["environment"]


@pytest.mark.parametrize(
    "came, tail, expected",
    [
        ([b"a", b"b", b"c"], b"a\nb\nc\nno newline", ([], b"no newline")),  # the engine's race
        ([b"a", b"b"], b"a\nb\nc\nd\n", ([b"c", b"d"], b"")),
        ([b"a", b"b", b"c"], b"a\nb\nc\n", ([], None)),  # nothing missed
        ([b"a", b"no newline"], b"a\nno newline", ([], None)),  # the partial line came
        ([b"x", b"x"], b"x\nx\nx\n", ([], None)),  # repeated lines: the longest overlap wins
        ([b"old-3", b"b"], b"old-1\nold-2\nold-3\nb\nc", ([], b"c")),  # older lines before
        ([], b"a\nb", ([b"a"], b"b")),  # nothing came: all of it
        ([b"never", b"logged"], b"a\nb\n", ([], None)),  # not found: nothing emitted twice
    ],
)
def test_what_a_follow_stream_missed_is_found_in_the_logs_tail(came, tail, expected):
    assert missed(came, tail) == expected
