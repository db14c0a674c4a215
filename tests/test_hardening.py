"""Issue 8, safe inputs: what a job config can make an agent do, against the real Docker engine.
A task cannot mount a path outside the data roots (nor a link out of one), reach the Docker
socket, keep or gain capabilities, or fork-bomb the node; an authFile is read only from the
submitter's own root, only as a small regular file, only for the image's own registry."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import time
import types
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import docker
import pytest
import structlog

from services.agent.args import add_agent_arguments
from services.agent.config import check_task_settings, make_runtime
from services.agent.docker_runtime import TASK_CAPS, DockerRuntime, parse_caps
from services.agent.launch import Where, build_launch, image_registry, read_auth_file
from services.agent.output import OutputLimits
from services.agent.runtime import LaunchError, TaskLaunch
from services.agent.tasks import LocalTask, Tasks
from shared.jobconfig import check_job
from shared.messages import Assignment, ClusterSpec, Endpoint, TaskCause, TaskSpec

CAP_BITS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "KILL": 5, "SETGID": 6, "SETUID": 7}
PASSWORD = "hunter2-do-not-show"


def assignment(tmp: Path, image: str, command: str = "true", **fields: object) -> Assignment:
    config, errors = check_job(
        {
            "jobName": "hardened",
            "image": image,
            "taskRoles": [
                {
                    "name": "w",
                    "taskNumber": 1,
                    "cpuNumber": 1,
                    "memoryMB": 256,
                    "gpuNumber": 0,
                    "command": command,
                }
            ],
            **fields,
        }
    )
    assert config is not None, errors
    spec = TaskSpec(role="w", role_no=0, index=0, node="n1")
    return Assignment(
        job_id=f"j{uuid.uuid4().hex[:8]}", attempt=1, user="alice", config=config, gang=[spec], node="n1"
    )


def where(tmp: Path) -> Where:
    return Where(
        node="n1",
        work_root=str(tmp / "work"),
        output_root=str(tmp / "output"),
        default_fs_uri="",
        gpu_devices=False,
        data_roots=(str(tmp / "users" / "{user}"), str(tmp / "shared")),
    )


def launch_of(tmp: Path, a: Assignment):
    spec = a.gang[0]
    cluster = ClusterSpec(
        job_id=a.job_id,
        attempt=1,
        endpoints=[Endpoint(role="w", role_no=0, index=0, node="n1", host="127.0.0.1", port=5000)],
    )
    return build_launch(a, spec, [5000], cluster, where(tmp))


# ---------------------------------------------------------------- host paths (no engine needed)


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    (tmp_path / "users" / "alice" / "code").mkdir(parents=True)
    (tmp_path / "users" / "bob" / "secret").mkdir(parents=True)
    (tmp_path / "shared" / "datasets").mkdir(parents=True)
    return tmp_path


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("dataDir", "/", "not under the allowed roots"),
        ("codeDir", "/etc", "not under the allowed roots"),
        ("dataDir", "/var/run/docker.sock", "not under the allowed roots"),
        ("dataDir", "/run/docker.sock", "not under the allowed roots"),
        ("codeDir", "file:///etc", "not under the allowed roots"),
        ("outputDir", "{tmp}/users/bob/secret", "not under the allowed roots"),  # another user's root
        ("dataDir", "{tmp}/users/alice/escape", "resolves to"),  # a link out of the root
    ],
)
def test_a_mount_outside_the_roots_is_a_configuration_error(roots, field, value, why):
    os.symlink("/etc", roots / "users" / "alice" / "escape")
    a = assignment(roots, "img", **{field: value.replace("{tmp}", str(roots))})
    with pytest.raises(LaunchError) as refused:
        launch_of(roots, a)
    assert refused.value.cause == TaskCause.CONFIG
    assert field in str(refused.value) and why in str(refused.value), str(refused.value)


def test_dot_dot_tricks_are_refused_at_validation(roots):
    config, errors = check_job(
        {
            "jobName": "dots",
            "image": "img",
            "codeDir": f"{roots}/users/alice/../bob/secret",
            "taskRoles": [
                {
                    "name": "w",
                    "taskNumber": 1,
                    "cpuNumber": 1,
                    "memoryMB": 256,
                    "gpuNumber": 0,
                    "command": "true",
                }
            ],
        }
    )
    assert config is None and errors[0].path == "codeDir" and ".." in errors[0].reason


@pytest.mark.parametrize("field", ["dataDir", "codeDir", "outputDir"])
def test_a_dot_dot_that_got_past_validation_is_refused_at_launch(roots, field):
    a = assignment(roots, "img")
    trick = f"{roots}/users/alice/../../../etc"
    a = a.model_copy(update={"config": a.config.model_copy(update={field: trick})})
    with pytest.raises(LaunchError) as refused:
        launch_of(roots, a)
    assert (
        refused.value.cause == TaskCause.CONFIG and field in str(refused.value) and ".." in str(refused.value)
    )


def test_a_user_root_that_is_a_link_mounts_nothing(roots):
    # alice owns her directory: she could replace it with a link to /etc.
    (roots / "users" / "alice").rename(roots / "alice-was")
    os.symlink("/etc", roots / "users" / "alice")
    a = assignment(roots, "img", codeDir=f"{roots}/users/alice")
    with pytest.raises(LaunchError, match="outside the allowed roots") as refused:
        launch_of(roots, a)
    assert refused.value.cause == TaskCause.CONFIG


def test_mounts_under_the_roots_are_resolved_and_allowed(roots):
    os.symlink(roots / "shared" / "datasets", roots / "users" / "alice" / "data")
    a = assignment(
        roots,
        "img",
        codeDir=str(roots / "users" / "alice" / "code"),
        dataDir=str(roots / "users" / "alice" / "data"),
    )
    mounts = [m.host for m in launch_of(roots, a).mounts]
    assert str(roots / "users" / "alice" / "code") in mounts
    assert str(roots / "shared" / "datasets") in mounts  # where the link really points


# ---------------------------------------------------------------- authFile


def auth_file(roots: Path, name: str = "auth", server: str = "docker.io") -> Path:
    path = roots / "users" / "alice" / name
    path.write_text(f"{server}\nalice\n{PASSWORD}\n")
    return path


def test_an_auth_file_is_read_from_the_users_own_root_for_the_images_registry(roots):
    r = [str(roots / "users" / "{user}"), str(roots / "shared")]
    auth = read_auth_file(str(auth_file(roots)), r, "alice", "muster/base:bookworm")
    assert auth is not None and auth.username == "alice" and auth.password == PASSWORD
    assert PASSWORD not in repr(auth)
    private = auth_file(roots, "private", "registry.example.com:5000")
    assert read_auth_file(str(private), r, "alice", "registry.example.com:5000/team/img:1").server


@pytest.mark.parametrize(
    "kind", ["fifo", "dev-zero", "big", "link-out", "other-user", "shared-root", "wrong-registry"]
)
def test_a_bad_auth_file_is_refused_fast_without_showing_it(roots, kind):
    r = [str(roots / "users" / "{user}"), str(roots / "shared")]
    alice = roots / "users" / "alice"
    path = alice / "auth"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "big":
        path.write_text(f"docker.io\nalice\n{PASSWORD}\n" + "x" * 5000)
    elif kind == "link-out":
        os.symlink(auth_file(roots, "real").rename(roots / "shared" / "auth"), path)  # out of alice's root
    elif kind == "other-user":
        path = roots / "users" / "bob" / "auth"
        path.write_text(f"docker.io\nbob\n{PASSWORD}\n")
    elif kind == "shared-root":
        path = roots / "shared" / "auth"
        path.write_text(f"docker.io\nalice\n{PASSWORD}\n")
    elif kind == "wrong-registry":
        auth_file(roots, "auth", "evil.example.com")
    started = time.monotonic()
    with pytest.raises(LaunchError) as refused:
        read_auth_file(str(path), r, "alice", "muster/base:bookworm")
    assert time.monotonic() - started < 5
    assert refused.value.cause == TaskCause.CONFIG
    assert PASSWORD not in str(refused.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_an_auth_file_another_user_owns_is_not_this_users(roots):
    r = [str(roots / "users" / "{user}")]
    path = auth_file(roots)
    os.chown(path, 4242, 4242)  # someone else's file, in alice's root-owned directory
    with pytest.raises(LaunchError, match="owned by uid 4242") as refused:
        read_auth_file(str(path), r, "alice", "muster/base:bookworm")
    assert refused.value.cause == TaskCause.CONFIG and PASSWORD not in str(refused.value)
    os.chown(roots / "users" / "alice", 4242, 4242)  # alice is uid 4242: her directory, her file
    auth = read_auth_file(str(path), r, "alice", "muster/base:bookworm")
    assert auth is not None and auth.password == PASSWORD


def test_no_per_user_root_means_no_auth_file(roots):
    with pytest.raises(LaunchError, match="no per-user data root") as refused:
        read_auth_file(str(auth_file(roots)), [str(roots / "users" / "alice")], "alice", "img")
    assert refused.value.cause == TaskCause.CONFIG


def test_image_registries_are_read_as_docker_reads_them():
    assert image_registry("ubuntu") == "docker.io"
    assert image_registry("muster/base:bookworm") == "docker.io"
    assert image_registry("ghcr.io/org/img:1") == "ghcr.io"
    assert image_registry("localhost/img") == "localhost"
    assert image_registry("registry:5000/img") == "registry:5000"
    assert image_registry("Registry.Example.COM/img") == "registry.example.com"
    assert image_registry("library/ubuntu@sha256:" + "0" * 64) == "docker.io"


def test_index_docker_io_is_docker_hubs_registry(roots):
    r = [str(roots / "users" / "{user}")]
    path = auth_file(roots, "hub", "https://index.docker.io/v1/")
    assert read_auth_file(str(path), r, "alice", "ubuntu:22.04") is not None
    with pytest.raises(LaunchError, match="not the image's") as refused:
        read_auth_file(str(path), r, "alice", "ghcr.io/org/img:1")
    assert PASSWORD not in str(refused.value)


# ---------------------------------------------------------------- agent settings


def test_the_task_settings_are_checked_when_the_agent_starts():
    ok = types.SimpleNamespace(task_user="auto", pids_limit=64, task_caps="cap_chown, KILL")
    check_task_settings(ok)
    assert parse_caps("cap_chown, KILL,kill") == ("CHOWN", "KILL") and parse_caps("") == ()
    for bad, said in (
        ({"pids_limit": 0}, "--pids-limit"),
        ({"pids_limit": -1}, "--pids-limit"),
        ({"task_caps": "CHOWN,SYS_ADMINN"}, "SYS_ADMINN"),
        ({"task_user": "1000:1000; rm -rf /"}, "--task-user"),
    ):
        with pytest.raises(SystemExit, match=said):
            check_task_settings(types.SimpleNamespace(**{**vars(ok), **bad}))


def test_the_agents_flags_reach_its_docker_runtime(base_image: str, tmp_path: Path):
    """--task-caps, --task-user and --pids-limit as `python -m services.agent` parses them."""
    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    args = parser.parse_args(
        ["--runtime", "docker", "--task-caps", "kill", "--task-user", "2000:2000", "--pids-limit", "99"]
    )
    rt = make_runtime(args.runtime, str(tmp_path), args.task_user, args.pids_limit, args.task_caps)
    assert isinstance(rt, DockerRuntime)
    assert (rt.caps, rt.task_user, rt.pids_limit) == (("KILL",), "2000:2000", 99)
    default = make_runtime("docker", str(tmp_path))
    assert isinstance(default, DockerRuntime) and default.caps == TASK_CAPS


def test_the_container_request_drops_what_it_must():
    launch = TaskLaunch(name="t", image="img", command="true", env={}, cpus=2, memory_mb=512, gpus=[])
    kwargs = DockerRuntime._create_kwargs(launch, None, "1000:1000", 64, ("KILL",))
    assert kwargs["cap_drop"] == ["ALL"] and kwargs["cap_add"] == ["KILL"]
    assert kwargs["security_opt"] == ["no-new-privileges:true"] and kwargs["privileged"] is False
    assert kwargs["pids_limit"] == 64 and kwargs["user"] == "1000:1000"
    assert kwargs["mem_limit"] == kwargs["memswap_limit"] == 512 * 1024 * 1024
    assert kwargs["nano_cpus"] == 2 * 10**9
    assert "devices" not in kwargs and "device_requests" not in kwargs
    assert kwargs["network_mode"] == "host" and "volumes" not in kwargs


# ---------------------------------------------------------------- inside the container


@pytest.fixture
async def runtime(base_image: str) -> AsyncIterator[DockerRuntime]:
    rt = DockerRuntime(pids_limit=64)
    yield rt
    await rt.close()


@pytest.fixture
def engine() -> Iterator[docker.DockerClient]:
    client = docker.from_env()
    yield client
    client.close()


async def run(
    runtime: DockerRuntime, launch, engine: docker.DockerClient, timeout: float = 60, sink=None
) -> tuple[list[str], int]:
    lines: list[str] = []

    def output(line: str) -> None:
        lines.append(line)
        if sink is not None:
            sink(line)

    try:
        task = await runtime.start(launch, output)
        code = await asyncio.wait_for(task.wait(), timeout)
        await asyncio.sleep(0.2)
        return lines, code
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            engine.api.remove_container(launch.name, force=True)


@pytest.mark.docker
async def test_a_task_runs_unprivileged_with_no_socket_and_bounded_processes(
    runtime, engine, roots, base_image
):
    probe = (
        "id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status; "
        "test -e /var/run/docker.sock && echo socket || echo no-socket; "
        # A fork bomb of sorts: far more processes than the limit. It must fail, not the node.
        "n=0; for i in $(seq 1 500); do sleep 30 & n=$((n+1)); done 2>/dev/null; "
        "echo started-all; kill $(jobs -p) 2>/dev/null; true"
    )
    launch = launch_of(roots, assignment(roots, base_image, probe))
    lines, _ = await run(runtime, launch, engine)
    status = {k: v.strip() for k, _, v in (line.partition(":") for line in lines if ":" in line)}
    assert lines[0] != "0", lines  # not root
    assert int(status["CapEff"], 16) == 0, lines  # no capability in effect
    bounding = int(status["CapBnd"], 16)
    assert bounding == sum(1 << CAP_BITS[c] for c in TASK_CAPS), lines  # all others dropped
    assert status["NoNewPrivs"] == "1", lines
    assert "no-socket" in lines and "socket" not in lines
    assert "started-all" not in lines, lines  # the pids limit stopped the loop
    # The node survived it: the engine answers and the next task runs.
    assert engine.ping()
    after = launch_of(roots, assignment(roots, base_image, "echo alive"))
    assert await run(runtime, after, engine) == (["alive"], 0)


@pytest.mark.docker
async def test_a_fork_bomb_stops_at_the_pids_limit(runtime, engine, roots, base_image):
    # Processes that stay: count how many could be started before fork failed.
    bomb = (
        "i=0; while [ $i -lt 10000 ]; do "
        "(sleep 30 &) 2>/dev/null || break; i=$((i+1)); "
        "[ $((i % 1000)) -ne 0 ] || echo still-forking-$i; "
        "done; echo started=$i; pkill sleep 2>/dev/null; true"
    )
    started = time.monotonic()
    lines, _ = await run(runtime, launch_of(roots, assignment(roots, base_image, bomb)), engine, timeout=120)
    counts = [int(line.split("=")[1]) for line in lines if line.startswith("started=")]
    assert counts and counts[0] < 64, lines  # 64 processes in all, the shell included
    assert not any(line.startswith("still-forking") for line in lines), lines
    assert time.monotonic() - started < 120
    assert engine.ping()


@pytest.mark.docker
async def test_the_container_is_configured_as_declared(runtime, engine, roots, base_image):
    launch = launch_of(roots, assignment(roots, base_image, "sleep 30"))
    task = await runtime.start(launch, lambda line: None)
    try:
        host = engine.api.inspect_container(launch.name)["HostConfig"]
        assert host["CapDrop"] == ["ALL"] and sorted(host["CapAdd"]) == sorted(TASK_CAPS)
        assert host["SecurityOpt"] == ["no-new-privileges:true"]
        assert host["PidsLimit"] == 64 and host["Privileged"] is False
        assert host["Memory"] == 256 * 1024 * 1024 and host["NanoCpus"] == 10**9
        assert not host.get("Devices") and not host.get("DeviceRequests")
        assert engine.api.inspect_container(launch.name)["Config"]["User"] == "1000:1000"
    finally:
        await task.stop(0)
        with contextlib.suppress(docker.errors.NotFound):
            engine.api.remove_container(launch.name, force=True)


@pytest.mark.docker
async def test_a_root_task_keeps_only_the_minimal_capabilities(engine, roots, base_image):
    rt = DockerRuntime(task_user="root", pids_limit=64)
    try:
        launch = launch_of(roots, assignment(roots, base_image, "id -u; grep CapEff /proc/self/status"))
        lines, code = await run(rt, launch, engine)
        assert lines[0] == "0" and code == 0
        eff = int(lines[1].split(":")[1].strip(), 16)
        assert eff == sum(1 << CAP_BITS[c] for c in TASK_CAPS), lines  # no NET_RAW, MKNOD, SYS_ADMIN...
    finally:
        await rt.close()


# ---------------------------------------------------------------- secrets in output


@pytest.mark.docker
async def test_a_task_printing_its_secrets_shows_them_masked(runtime, engine, roots, base_image):
    token, password = "hf_s3cr3t-value-123", "pa55-w0rd!"
    a = assignment(
        roots,
        base_image,
        'echo "token=$HF_TOKEN"; echo "db=$DB_PASSWORD epochs=$EPOCHS"; echo "$HF_TOKEN" >&2; exit 3',
        jobEnvs={"HF_TOKEN": token, "DB_PASSWORD": password, "EPOCHS": 3},
    )
    launch = launch_of(roots, a)
    assert launch.env["HF_TOKEN"] == token  # the task's environment has it
    published: list[tuple[str, bytes]] = []

    async def publish(subject: str, data: bytes) -> None:
        published.append((subject, data))

    events: list = []
    seen: list[str] = []  # what the training-metric reader was given

    async def untrack(key: object) -> None:
        pass

    # The agent's Tasks, with the bus and the bookkeeping _finish touches stubbed out.
    tasks = types.SimpleNamespace(
        nc=types.SimpleNamespace(publish=publish),
        node="n1",
        report=lambda *x, **kw: events.append(kw),
        ports=types.SimpleNamespace(release=lambda ports: None),
        live={},
        remember=lambda key: None,
        log=structlog.get_logger(),
        progress=types.SimpleNamespace(line=lambda key, line: seen.append(line), untrack=untrack),
        rsh=None,  # no MPI here
        where=types.SimpleNamespace(work_root=str(roots)),
        limits=OutputLimits(),
        keep_output=False,  # its output file is not what this test looks at
    )
    tasks.report_ended = functools.partial(Tasks.report_ended, tasks)
    task = LocalTask(assignment=a, spec=a.gang[0], endpoint=None, ports=[5000])  # type: ignore[arg-type]
    _, code = await run(runtime, launch, engine, sink=lambda line: Tasks.output(tasks, task, line))
    await asyncio.sleep(0.1)  # the publishes
    key = (a.job_id, 1, "w", 0)
    await Tasks._finish(tasks, key, task, TaskCause.EXITED, code, f"exited, {token}")
    logs = [line for _, data in published for line in data.decode().split("\n")]  # lines, batched
    assert code == 3 and logs == ["token=***", "db=*** epochs=3", "***"], logs
    assert seen == logs  # metrics are read from the masked lines too
    (event,) = events
    assert event["last_lines"] == logs
    assert token not in repr(events) and password not in repr(events)
