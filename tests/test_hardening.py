"""Issue 8, safe inputs: what a job config can make an agent do, against the real Docker engine.
A task cannot mount a path outside the data roots (nor a link out of one), reach the Docker
socket, keep or gain capabilities, or fork-bomb the node; an authFile is read only from the
submitter's own root, only as a small regular file, only for the image's own registry."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import docker
import pytest

from services.agent.docker_runtime import TASK_CAPS, DockerRuntime
from services.agent.launch import Where, build_launch, image_registry, read_auth_file
from services.agent.runtime import LaunchError
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


def test_image_registries_are_read_as_docker_reads_them():
    assert image_registry("ubuntu") == "docker.io"
    assert image_registry("muster/base:bookworm") == "docker.io"
    assert image_registry("ghcr.io/org/img:1") == "ghcr.io"
    assert image_registry("localhost/img") == "localhost"
    assert image_registry("registry:5000/img") == "registry:5000"


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
    runtime: DockerRuntime, launch, engine: docker.DockerClient, timeout: float = 60
) -> tuple[list[str], int]:
    lines: list[str] = []
    try:
        task = await runtime.start(launch, lines.append)
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
