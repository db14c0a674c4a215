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

from muster.services.agent.args import add_agent_arguments
from muster.services.agent.config import check_task_settings, make_runtime
from muster.services.agent.docker_runtime import TASK_CAPS, DockerRuntime, parse_caps
from muster.services.agent.launch import Where, build_launch, image_registry, read_auth_file
from muster.services.agent.output import OutputLimits
from muster.services.agent.runtime import LaunchError, TaskLaunch
from muster.services.agent.tasks import LocalTask, Tasks
from muster.shared.jobconfig import check_job
from muster.shared.messages import Assignment, ClusterSpec, Endpoint, TaskCause, TaskSpec

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
    """--task-caps, --task-user and --pids-limit as `python -m muster.services.agent` parses them."""
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
        of_attempt=lambda job_id, attempt: [],
        workdirs=types.SimpleNamespace(ended=lambda job_id, attempt: None),  # its directory's end
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


# ---------------------------------------------------------------- issue 24: hostile messages
# One message from anyone must not stop a service or be taken for what it is not.


def test_commands_refuse_unknown_fields_and_values_of_the_wrong_shape():
    from pydantic import ValidationError

    from muster.shared.messages import DrainOrder, KillOrder, KillRequest, TaskEvent

    assert DrainOrder.from_bytes(b'{"node": "n1"}').node == "n1"
    a = assignment(Path("/tmp"), "img")
    refused = [
        (DrainOrder, b'{"node": "n1", "job_id": "x"}'),  # a stray field: not a drain order
        (DrainOrder, a.to_bytes()),  # an assignment (it has a `node`) taken for a drain
        (DrainOrder, b'{"node": "n1 n2"}'),
        (DrainOrder, b'{"node": "n1", "grace": NaN}'),
        (KillRequest, json_bytes({"job_id": "x" * 5000})),
        (KillRequest, json_bytes({"job_id": "../../x"})),
        (KillRequest, json_bytes({"job_id": "j1.2"})),  # a dot: another KV key, another subject
        (KillRequest, json_bytes({"job_id": "j1", "grace": 1e300})),
        (KillRequest, json_bytes({"job_id": "j1", "at": "2030-01-01T00:00:00"})),  # no time zone
        (KillOrder, json_bytes({"job_id": "j1", "attempt": 0, "reason": "r"})),
        (KillOrder, json_bytes({"job_id": "j1", "attempt": 1, "reason": "r", "tasks": ["w.0", "*"]})),
        (TaskEvent, json_bytes(task_event(reason="x" * 100_000))),
        (TaskEvent, json_bytes(task_event(last_lines=["x" * 70_000]))),
        (TaskEvent, json_bytes(task_event(last_lines=["x"] * 1001))),
        (TaskEvent, json_bytes(task_event(last_lines=[3]))),
        (TaskEvent, json_bytes(task_event(role="w.0"))),
        (TaskEvent, json_bytes(task_event(attempt=10**400))),
    ]
    for model, data in refused:
        with pytest.raises(ValidationError):
            model.from_bytes(data)
    # The CLI offers the graces an order may carry (it imports no model to say so).
    from muster.services.cli.main import MAX_GRACE
    from muster.shared import shapes

    assert MAX_GRACE == shapes.MAX_GRACE


def json_bytes(doc: dict) -> bytes:
    import json

    return json.dumps(doc).encode()


def task_event(**fields: object) -> dict:
    return {"job_id": "j1", "attempt": 1, "role": "w", "index": 0, "node": "n1", "kind": "exited", **fields}


def test_free_text_is_cut_to_what_real_output_fits_and_facts_keep_unknown_fields():
    from muster.shared import shapes
    from muster.shared.messages import JobRecord, TaskEvent

    ev = TaskEvent.from_bytes(
        json_bytes(task_event(reason="r" * 5000, last_lines=[f"{i}" * 3000 for i in range(100)], new=1))
    )
    assert len(ev.reason) == shapes.REASON and ev.reason.endswith("…")
    assert len(ev.last_lines) == shapes.LINES and ev.last_lines[-1].startswith("99")
    assert all(len(line) <= shapes.LINE for line in ev.last_lines)
    # Built by a producer (the agent), the same: what it sends is never more.
    built = TaskEvent(job_id="j1", attempt=1, role="w", index=0, node="n1", kind="exited", reason="r" * 9000)
    assert len(TaskEvent.from_bytes(built.to_bytes()).reason) == shapes.REASON
    # A record written by a newer version (a field this one does not know) still decodes.
    config, _ = check_job({"jobName": "n", "image": "i", "taskRoles": [_role()]})
    assert config is not None
    record = JobRecord(
        job_id="j1", job_name="n", submission_id="s", user="u", config=config, submitted_at=now_utc()
    )
    assert JobRecord.from_bytes(record.to_bytes()[:-1] + b', "from_the_future": 1}').job_id == "j1"


def _role() -> dict:
    return {"name": "w", "taskNumber": 1, "cpuNumber": 1, "memoryMB": 128, "gpuNumber": 0, "command": "true"}


def now_utc():
    from muster.shared.messages import now

    return now()


def test_a_lone_surrogate_anywhere_in_a_config_is_a_field_error():
    import json

    raw = json.loads('{"jobName": "\\ud800x", "image": "i", "jobEnvs": {"K\\udc00": "v"}, "taskRoles": []}')
    raw["taskRoles"] = [{**_role(), "command": "echo \ud83d"}]
    config, errors = check_job(raw)
    assert config is None
    found = {e.path: e.reason for e in errors}
    assert "must be valid Unicode text" in found["jobName"], errors
    assert "must be valid Unicode text" in found["taskRoles[0].command"], errors
    assert any(p.startswith("jobEnvs.K") for p in found), errors
    from muster.shared.messages import Verdict

    Verdict(submission_id="s1", accepted=False, errors=errors).to_bytes()  # it can be sent


async def test_a_lone_surrogate_in_a_submission_gets_its_verdict_at_once(procs, nats_url):
    """Against a real validator: a field error naming jobName, not 'internal error' after
    seconds of retries."""
    from muster.shared import bus, client

    procs.start("muster.services.validator")
    nc = await bus.connect("test", nats_url, quiet=True)
    try:
        config = json_bytes({"jobName": "x", "image": "i", "taskRoles": [_role()]})
        data = config.replace(b'"x"', b'"\\ud800"')
        started = time.monotonic()
        _, verdict = await client.submit(nc, data, timeout=60)
        assert verdict is not None and not verdict.accepted
        assert [(e.path, "Unicode" in e.reason) for e in verdict.errors] == [("jobName", True)], verdict
        # Judged on its first delivery (no retries: those wait a second each).
        assert time.monotonic() - started < 60  # a validator starting on a loaded machine included
        assert "validator.retry" not in procs.procs[0].log_path.read_text()
    finally:
        await nc.close()


async def test_a_kill_request_with_a_huge_or_crooked_job_id_stops_nothing(cluster, monkeypatch):
    """Issue 24.1: such a request once made the supervisor build a direct-get subject the server
    closed its connection over; the supervisor lived on doing nothing, and a restarted one wedged
    again on the redelivered request. Now each is refused on decode (terminated, counted) and
    the next job completes."""
    import httpx

    from muster.shared import bus, subjects
    from muster.shared.messages import JobState
    from muster.shared.natsserver import free_port
    from tests.test_jobs import role, run_job

    port = free_port()
    monkeypatch.setenv("MUSTER_METRICS_PORT", str(port))
    supervisor = cluster.start("muster.services.supervisor")
    monkeypatch.delenv("MUSTER_METRICS_PORT")
    for module in ("muster.services.validator", "muster.services.scheduler", "muster.services.registry"):
        cluster.start(module)
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "2")
    nc = await bus.connect("test", cluster.url, quiet=True)
    try:
        js = nc.jetstream()
        await _until_declared(js)
        for job_id in ("x" * 5000, "x" * 100_000, "../../x", "j1 j2", "j1.1"):
            await js.publish(subjects.kill_request("alice"), json_bytes({"job_id": job_id}))
        record = await run_job(
            nc, {"jobName": "after-kills", "image": "img", "taskRoles": [role("w", 1, "true")]}, 60
        )
        assert record.state == JobState.SUCCEEDED, cluster.logs()
        assert supervisor.poll() is None, cluster.logs()
        info = await js.consumer_info(subjects.SUBMISSIONS_STREAM, subjects.SUPERVISOR_KILL_CONSUMER)
        assert (info.num_pending, info.num_ack_pending) == (0, 0), info
        page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        rejected = [
            float(line.rsplit(" ", 1)[1])
            for line in page.splitlines()
            if line.startswith("muster_messages_rejected_total{")
            and 'consumer="supervisor-kill"' in line
            and 'why="undecodable"' in line
        ]
        assert rejected == [5.0], page
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    finally:
        await nc.close()


async def _until_declared(js) -> None:
    from muster.shared import subjects

    deadline = time.monotonic() + 60
    while True:
        try:
            await js.stream_info(subjects.SUBMISSIONS_STREAM)
            await js.stream_info(f"KV_{subjects.LEASES_BUCKET}")
            return
        except Exception:
            assert time.monotonic() < deadline, "the services never declared their streams"
            await asyncio.sleep(0.2)


async def test_a_forged_drain_drains_nothing(cluster):
    """Issue 24.4: any JSON object with a `node` field on a drain subject drained the node. An
    order with a field a drain order does not have, or naming another node, is refused; a real
    drain order still drains."""
    from muster.shared import bus, subjects
    from muster.shared.messages import DrainOrder, NodeInfo

    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "2")
    nc = await bus.connect("test", cluster.url, quiet=True)
    try:
        js = nc.jetstream()
        nodes = None
        deadline = time.monotonic() + 60
        while nodes is None:
            try:
                kv = await js.key_value(subjects.NODES_BUCKET)
                await kv.get("n1")
                nodes = kv
            except Exception:
                assert time.monotonic() < deadline, cluster.logs()
                await asyncio.sleep(0.2)

        async def drained() -> bool:
            return NodeInfo.from_bytes((await nodes.get("n1")).value).drained

        forged = [
            json_bytes({"node": "n1", "job_id": "j1", "attempt": 1}),
            json_bytes({"node": "n1", "extra": True}),
            DrainOrder(node="n2").to_bytes(),  # another node's order, on this node's subject
        ]
        for data in forged:
            await js.publish(subjects.drain("n1"), data)
        await js.publish(subjects.drain("n1"), DrainOrder(node="n1", grace=0).to_bytes())
        while not await drained():  # the real order, behind the forged ones, is applied
            assert time.monotonic() < deadline + 30, cluster.logs()
            await asyncio.sleep(0.2)
        log_file = next(cluster.log_dir.glob("agent-*.log"))
        while '"agent.drain"' not in log_file.read_text():  # logged just after the record is written
            assert time.monotonic() < deadline + 30, cluster.logs()
            await asyncio.sleep(0.2)
        log = log_file.read_text()
        assert log.count("agent.drain_refused") == 1 and log.count('"agent.drain"') == 1, log[-3000:]
        assert log.count("message.rejected") >= 1, log[-3000:]
    finally:
        await nc.close()


# ---------------------------------------------------------------- settings and a lost bus


BAD_SETTINGS = {
    # read at import, at parsing the command line, at build
    "muster.services.registry": [("MUSTER_MAX_DELIVERIES", "0"), ("MUSTER_METRICS_PORT", "x")],
    "muster.services.supervisor": [
        ("MUSTER_METRICS_PORT", "70000"),
        ("MUSTER_NODE_TIMEOUT", "soon"),
        ("MUSTER_PLATFORM_RETRIES", "-1"),
        ("MUSTER_JOB_RETENTION", "inf"),
    ],
}


@pytest.mark.parametrize("module", sorted(BAD_SETTINGS))
def test_an_empty_metrics_port_is_unset_and_a_bad_setting_is_one_line(module, nats_url, tmp_path):
    import subprocess
    import sys

    env = {**os.environ, "MUSTER_NATS_URL": nats_url, "MUSTER_CONNECT_TIMEOUT": "5"}
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module], env={**env, "MUSTER_METRICS_PORT": ""}, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 60
        while "service.started" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait(10)
    for name, value in BAD_SETTINGS[module]:
        done = subprocess.run(
            [sys.executable, "-m", module],
            env={**env, name: value},
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode != 0 and len(lines) == 1, (name, value, done.stderr)
        assert name in lines[0] and repr(value) in lines[0] and "Traceback" not in done.stderr, lines


async def test_a_service_whose_connection_the_server_closes_stops_and_is_restarted(nats_url):
    """The server closes a connection over a protocol error (nats-py never reconnects it): the
    service is stopped, `run_service` raises (the process exits 1) and `muster up` restarts it."""
    import nats.errors
    from nats.aio.client import Client as NATS

    from muster.services.cli.mesh import supervise
    from muster.shared import bus
    from muster.shared.service import run_service

    connections: list = []
    stopped: list[bool] = []

    class Idle:
        async def run(self, stop: asyncio.Event) -> None:
            await stop.wait()
            stopped.append(True)

    async def build(nc):
        connections.append(nc)
        return Idle()

    async def closed_by_the_server(nc) -> None:
        with pytest.raises(nats.errors.BadSubjectError):  # bus.Client refuses to send it ...
            await nc.publish("x" * 5000, b"")
        assert nc.is_connected
        await NATS.publish(nc, "x" * 5000, b"")  # ... nats-py itself sends anything
        await NATS.flush(nc, timeout=5)

    # One service: it stops and run_service raises at once.
    running = asyncio.create_task(run_service("idle", build, url=nats_url))
    while not connections:
        await asyncio.sleep(0.05)
    with contextlib.suppress(Exception):
        await closed_by_the_server(connections[0])
    with pytest.raises(ConnectionError, match="closed"):
        await asyncio.wait_for(running, 20)
    assert stopped == [True] and bus.lost(connections[0])
    # Under `muster up`: the same service is built again on a new connection.
    stop = asyncio.Event()
    mesh = asyncio.create_task(supervise("idle", build, nats_url, stop))
    while len(connections) < 2:
        await asyncio.sleep(0.05)
    with contextlib.suppress(Exception):
        await closed_by_the_server(connections[1])
    deadline = time.monotonic() + 20
    while len(connections) < 3 or not connections[2].is_connected:
        assert time.monotonic() < deadline, "not restarted"
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(mesh, 20)


async def test_the_bus_refuses_a_subject_the_server_would_close_the_connection_over(nats_url):
    import nats.errors

    from muster.shared import bus

    nc = await bus.connect("test", nats_url, quiet=True)
    try:
        for subject in ("x" * 5000, "a b", "a\r\nPUB b 0", ""):
            with pytest.raises(nats.errors.Error):
                await nc.publish(subject, b"{}")
        with pytest.raises(nats.errors.BadSubjectError):
            await nc.subscribe("x" * 2000)
        kv = await bus.jetstream(nc).create_key_value(bucket="probe")
        with pytest.raises(Exception):  # noqa: B017 - nats-py's key check, or ours
            await kv.get("k" * 5000)
        await nc.flush(timeout=5)
        assert nc.is_connected and not nc.is_closed
    finally:
        await nc.close()


async def test_an_exec_request_of_the_wrong_shape_is_answered_with_its_refusal(cluster):
    """The launcher's agent waits for an answer to each exec request: one that does not decode
    is answered with why (if it names its session), not left to time out."""
    import nats.errors

    from muster.shared import bus, subjects
    from muster.shared.messages import ExecReply

    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "2")
    nc = await bus.connect("test", cluster.url, quiet=True)
    try:
        replies = await nc.subscribe(subjects.exec_reply("n2", "n1"))
        bad = {"kind": "open", "session": "s1", "job_id": "x" * 5000, "attempt": 1, "role": "w"}
        deadline = time.monotonic() + 60
        while True:  # until the agent listens
            await nc.publish(subjects.exec_request("n1", "n2"), json_bytes(bad))
            try:
                reply = ExecReply.from_bytes((await replies.next_msg(timeout=1)).data)
                break
            except nats.errors.TimeoutError:
                assert time.monotonic() < deadline, cluster.logs()
        assert (reply.kind, reply.session) == ("error", "s1") and "job_id" in reply.error, reply
    finally:
        await nc.close()


async def test_a_new_leader_that_cannot_resend_one_attempts_orders_leads_on(nats_url):
    """A new leader re-sends the orders of attempts no task has acted on yet. One it could not
    send (here: the job's secrets record is not an object) ended the scheduler's process, and a
    restarted one took the lease and ended again, for as long as the record stayed: nothing was
    placed. Now that attempt is logged and the leader places on."""
    from muster.shared import subjects
    from muster.shared.messages import AttemptRecord, JobRecord, JobState, TaskSpec, TaskStatus
    from muster.shared.messages import now as now_
    from tests.test_attained import J, leader, until

    t = now_()
    stuck = J("stuck", gpus=2).config().model_copy(update={"jobEnvs": {"API_TOKEN": "***"}})
    spec = TaskSpec(role="w", role_no=0, index=0, node="a", gpus=[0, 1])

    class Raw(bytes):
        def to_bytes(self) -> bytes:
            return bytes(self)

    def job(job_id: str, config, state: JobState, attempt: int = 0) -> JobRecord:
        return JobRecord(
            job_id=job_id, job_name=job_id, submission_id=job_id, user="u", config=config,
            submitted_at=t, state=state, attempt=attempt, settled=attempt,
        )  # fmt: skip

    puts = [
        (subjects.SECRETS_BUCKET, "stuck", Raw(b"[1, 2]")),
        (subjects.JOBS_BUCKET, "stuck", job("stuck", stuck, JobState.RUNNING, 1)),
        (
            subjects.ATTEMPTS_BUCKET,
            "stuck.1",
            AttemptRecord(job_id="stuck", attempt=1, tasks=[TaskStatus.placed(spec)]),
        ),
        (subjects.JOBS_BUCKET, "next", job("next", J("next", gpus=2).config(), JobState.WAITING)),
    ]
    async with leader(nats_url, puts) as (nc, buckets, _):
        got = await until(nc, buckets, "next.1", lambda a: True, lambda: "next was not placed")
        assert got.tasks[0].gpus == [2, 3]  # beside the attempt whose orders could not go


async def test_waiting_on_a_container_while_the_engine_refuses_asks_once_a_second():
    """Each wait of a running task's container is a blocking call in slices; one the engine
    refused at once (dockerd restarting) was asked again at once: about 1,150 calls a second
    per task, each a worker thread's. The engine here is a stand-in (its restart is the seam)."""
    import requests

    from muster.services.agent.docker_runtime import DockerTask

    class Restarting:
        name = "muster-j1-1-w-0"

        def __init__(self) -> None:
            self.asked, self.until = 0, time.monotonic() + 2.0
            self.attrs: dict = {"State": {}}

        def logs(self, **kwargs: object) -> Iterator[bytes]:
            return iter(())

        def wait(self, timeout: float) -> dict:
            self.asked += 1
            if time.monotonic() < self.until:
                raise requests.exceptions.ConnectionError("the engine is restarting")
            return {"StatusCode": 7}

        def reload(self) -> None:
            pass

    container = Restarting()
    task = DockerTask(container, None, asyncio.get_running_loop(), None)  # type: ignore[arg-type]
    assert await asyncio.wait_for(task.wait(), 30) == 7
    assert container.asked <= 5, container.asked


async def test_a_leader_held_past_its_lease_places_nothing_on_a_successors_watch(nats_url, monkeypatch):
    """A leader's loop held past the lease's life (one long plan, a pause): its lease expired, a
    standby took it, and the old leader then committed the plan it had made, placing beside the
    new leader on the same GPUs. Now a leader writes nothing once its last renewal is older than
    it can trust; here the stand-in standby holds the lease meanwhile and no attempt appears."""
    import threading

    from nats.js.errors import KeyNotFoundError

    from muster.services.scheduler import service as scheduler_service
    from muster.shared import bus, subjects
    from muster.shared.messages import JobRecord
    from muster.shared.messages import now as now_
    from tests.test_attained import J, leader, until

    real, held = scheduler_service.decide, threading.Event()

    async def take_the_lease() -> None:  # a standby, on a connection of its own
        nc = await bus.connect("standby", nats_url)
        try:
            leases = (await bus.ensure_jetstream(nc))[1][subjects.LEASES_BUCKET]
            while True:
                try:
                    await leases.create(subjects.SCHEDULER_LEASE, b"standby")
                    return
                except Exception:
                    await asyncio.sleep(0.2)
        finally:
            await nc.close()

    def held_up(*args, **kwargs):  # the first plan holds the leader's loop until the lease passed
        if not held.is_set():
            held.set()
            thread = threading.Thread(target=asyncio.run, args=(take_the_lease(),))
            thread.start()
            thread.join(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(scheduler_service, "decide", held_up)
    j = JobRecord(job_id="j", job_name="j", submission_id="j", user="u", config=J("j", gpus=2).config(),
                  submitted_at=now_())  # fmt: skip
    async with leader(nats_url, [(subjects.JOBS_BUCKET, "j", j)]) as (nc, buckets, _):
        deadline = asyncio.get_running_loop().time() + 30
        while not held.is_set():
            assert asyncio.get_running_loop().time() < deadline, "no plan was made"
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)  # the standby holds the lease for 4 s: nothing may be placed
        with pytest.raises(KeyNotFoundError):
            await buckets[subjects.ATTEMPTS_BUCKET].get("j.1")
        # Once the standby's lease lapses (it never renews), the leader leads again and places.
        await until(nc, buckets, "j.1", lambda a: True, lambda: "j was never placed")


async def test_a_new_leader_sends_again_the_kill_orders_an_old_one_may_not_have_sent(nats_url):
    """A leader writes a preemption (or an elastic shrink) into the attempt record, then sends
    the kill orders. One that went between the two left the gang running: the new leader only
    re-sent placements, so the preempted gang held its GPUs until it ended of itself (days, for
    a training run) and the job it made room for waited. Now a new leader sends them again."""
    from muster.shared import subjects
    from muster.shared.messages import (
        AttemptRecord,
        JobRecord,
        JobState,
        KillOrder,
        TaskSpec,
        TaskState,
        TaskStatus,
    )  # fmt: skip
    from muster.shared.messages import now as now_
    from tests.test_attained import J, leader

    t = now_()

    def running(role: str, index: int, gpus: list[int], **update) -> TaskStatus:
        spec = TaskSpec(role=role, role_no=0, index=index, node="a", gpus=gpus)
        return TaskStatus.placed(spec).model_copy(update={"state": TaskState.RUNNING, **update})

    def job(job_id: str) -> JobRecord:
        return JobRecord(
            job_id=job_id, job_name=job_id, submission_id=job_id, user="u", config=J(job_id, gpus=1).config(),
            submitted_at=t, state=JobState.RUNNING, attempt=1, settled=0,
        )  # fmt: skip

    victim = AttemptRecord(
        job_id="victim", attempt=1, tasks=[running("w", 0, [0])], ended_at=t, outcome=JobState.STOPPED,
        preempted_by="head",
    )  # fmt: skip
    shrunk = AttemptRecord(
        job_id="shrunk", attempt=1,
        tasks=[
            running("w", 0, [1]),
            running("w", 1, [2], removed=True, reason="removed to make room for head"),
        ],
    )  # fmt: skip
    puts = [
        (subjects.JOBS_BUCKET, "victim", job("victim")),
        (subjects.ATTEMPTS_BUCKET, "victim.1", victim),
        (subjects.JOBS_BUCKET, "shrunk", job("shrunk")),
        (subjects.ATTEMPTS_BUCKET, "shrunk.1", shrunk),
    ]
    from muster.shared import bus

    nc = await bus.connect("listener", nats_url)
    try:
        kills = await nc.subscribe(subjects.kill("a"))
        async with leader(nats_url, puts):
            heard = {}
            while len(heard) < 2:
                order = KillOrder.from_bytes((await kills.next_msg(timeout=30)).data)
                heard[order.job_id] = order
        assert heard["victim"].tasks is None or heard["victim"].tasks == []
        assert heard["shrunk"].tasks == ["w.1"] and "make room for head" in heard["shrunk"].reason
    finally:
        await nc.close()


async def test_a_shrink_is_written_only_on_the_gang_it_was_chosen_on(nats_url):
    """An elastic role of 3 (minTaskNumber 2) is shrunk by one for a waiting job. A member
    failed between the choice and the write: removing one more left the role below its minimum,
    and the attempt FAILED, charged, for a shrink. Now the write checks the stored gang is the
    one the choice was made on, and leaves it alone otherwise (the next cycle looks again)."""
    from datetime import timedelta
    from types import SimpleNamespace

    from muster.services.scheduler.service import Scheduler
    from muster.shared import bus, subjects
    from muster.shared.messages import AttemptRecord, TaskSpec, TaskState, TaskStatus
    from muster.shared.messages import now as now_

    long_ago = now_() - timedelta(minutes=5)

    def member(i: int, state: TaskState = TaskState.RUNNING) -> TaskStatus:
        spec = TaskSpec(role="w", role_no=0, index=i, node="a", gpus=[i])
        return TaskStatus.placed(spec, placed_at=long_ago).model_copy(update={"state": state})

    chosen_on = AttemptRecord(
        job_id="el", attempt=1, elastic=["w"], placed_at=long_ago, tasks=[member(i) for i in range(3)]
    )
    stored = chosen_on.model_copy(update={"tasks": [member(0), member(1, TaskState.FAILED), member(2)]})
    nc = await bus.connect("test", nats_url)
    try:
        js, buckets = await bus.setup(nc)
        await buckets[subjects.ATTEMPTS_BUCKET].put(stored.key, stored.to_bytes())
        scheduler = Scheduler(nc, js, buckets)
        scheduler.attempts[chosen_on.key] = chosen_on
        await scheduler._shrink([(chosen_on, chosen_on.tasks[2].spec())], SimpleNamespace(job_id="head"))
        after = AttemptRecord.from_bytes((await buckets[subjects.ATTEMPTS_BUCKET].get(stored.key)).value)
        assert not any(t.removed for t in after.tasks), after.tasks
        # On the gang it was chosen on, the shrink is written.
        await buckets[subjects.ATTEMPTS_BUCKET].put(chosen_on.key, chosen_on.to_bytes())
        await scheduler._shrink([(chosen_on, chosen_on.tasks[2].spec())], SimpleNamespace(job_id="head"))
        after = AttemptRecord.from_bytes((await buckets[subjects.ATTEMPTS_BUCKET].get(stored.key)).value)
        assert [t.removed for t in after.tasks] == [False, False, True]
    finally:
        await nc.close()


async def test_an_order_names_the_envs_the_validator_kept_apart(nats_url):
    """The agent masks a job's secrets by its own MUSTER_SECRET_ENV, which may differ from the
    validator's: each order now names the jobEnvs the validator kept apart, and the agent masks
    those too (tests/test_secrets.py)."""
    from muster.shared import bus, subjects
    from muster.shared.messages import Assignment, JobRecord
    from muster.shared.messages import now as now_
    from tests.test_attained import J, leader

    class Raw(bytes):
        def to_bytes(self) -> bytes:
            return bytes(self)

    shown = J("s", gpus=1).config().model_copy(update={"jobEnvs": {"DB_URL": "***", "EPOCHS": 3}})
    job = JobRecord(job_id="s", job_name="s", submission_id="s", user="u", config=shown, submitted_at=now_())
    puts = [
        (subjects.SECRETS_BUCKET, "s", Raw(b'{"DB_URL": "postgres://u:pw@db"}')),
        (subjects.JOBS_BUCKET, "s", job),
    ]
    nc = await bus.connect("listener", nats_url)
    try:
        orders = await nc.subscribe(subjects.assign("a"))
        async with leader(nats_url, puts):
            order = Assignment.from_bytes((await orders.next_msg(timeout=30)).data)
        assert order.secret_names == ["DB_URL"]
        assert order.config.jobEnvs["DB_URL"] == "postgres://u:pw@db"
    finally:
        await nc.close()
